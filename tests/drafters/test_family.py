"""The drafter family: every registered architecture keeps the core's contracts, a third one
written here (and registered only here) goes through train, score, decode and export with no edit
anywhere else, and no code outside the drafters wing names an architecture."""

import ast
from dataclasses import dataclass, replace

import numpy as np
import pytest
import torch
from oracles.drafting import DraftCache, draft_block
from oracles.scoring import score_one_block_at_a_time
from support.blocks import VOCAB, packed_blocks, reference_block
from support.helpers import REPO_ROOT

from dflash_pipeline.drafters import family
from dflash_pipeline.drafters.architecture import Architecture, correct_argmax
from dflash_pipeline.drafters.core import ArchitectureModule, DFlashDrafter
from dflash_pipeline.drafters.config import DrafterConfig, DrafterOptions
from dflash_pipeline.target.load import TargetHead

# ----------------------------------------------------------------------------- a third architecture, for tests only


class SlotGate(ArchitectureModule):
    """Scales the MLP's output per slot of the block (a learnt gate per position)."""

    def __init__(self, block_size: int, init: float):
        super().__init__()
        self.init = init
        self.gate = torch.nn.Parameter(torch.empty(block_size))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        self.gate.fill_(self.init)

    def prepare(self, blocks):
        return blocks, None

    def finish(self, out, state):
        return out * self.gate[None, :, None].to(out.dtype)


class GatePrior(ArchitectureModule):
    """The value every gate is pulled towards by the extra loss term."""

    def __init__(self):
        super().__init__()
        self.value = torch.nn.Parameter(torch.empty(1))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        self.value.fill_(1.0)


@dataclass(frozen=True)
class GatedOptions(DrafterOptions):
    gate_init: float = 0.9


@dataclass(frozen=True)
class GatedLossOptions:
    gate_weight: float = 0.1


class Gated(Architecture):
    name = "gated-test"
    public_class = "GatedTestDraftModel"
    options_type = GatedOptions
    loss_options_type = GatedLossOptions

    def option_problems(self, options, loss_options):
        return [("gate_init", "must be > 0")] if options.gate_init <= 0 else []

    def sublayer_wrappers(self, config):
        return None, SlotGate(config.block_size, config.options.gate_init)

    def extra_modules(self, config):
        return {"gate_prior": GatePrior()}

    def extra_loss(self, drafter, *, hidden, head_rows, top_columns, labels, predecessors, weights, token_ids, loss_options):
        gates = torch.stack([layer.mlp_conv.gate for layer in drafter.layers])
        term = ((gates - drafter.gate_prior.value) ** 2).sum() * weights.sum()
        return loss_options.gate_weight * term, {"gate_mean": gates.detach().mean()}

    def curve_fields(self, stats):
        return {"gate_mean": round(float(stats["gate_mean"]), 4)} if stats else {}

    def score_blocks(self, drafter, *, hidden, logits, anchors, labels, valid):
        return None, {"argmax_correct": correct_argmax(drafter, logits, labels.to(logits.device), valid.to(logits.device))}

    def summarize_extras(self, scores):
        return {"blocks_with_a_hit": round(float(scores.extras["argmax_correct"].any(axis=1).mean()), 4)}

    def public_weight_names(self, num_layers):
        return ["mlp_conv.gate"], ["gate_prior.value"]

    def serving_fields(self, config):
        return {"gate_init": config.options.gate_init}

    def options_from_serving(self, dflash_config, config, *, where):
        return {"gate_init": float(dflash_config["gate_init"])}


@pytest.fixture
def gated():
    with family.registered(Gated()) as member:
        yield member


# ----------------------------------------------------------------------------- every member keeps the core's contracts

OPTIONS = {"dflash": {}, "dflash2": dict(conv_kernel_size=2, conv_group_size=8, selector_rank=6, selector_top_k=5),
           "gated-test": dict(gate_init=0.7)}


def member_drafter(name: str, seed: int = 0) -> tuple[DFlashDrafter, TargetHead]:
    torch.manual_seed(seed)
    config = DrafterConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=8, vocab_size=VOCAB, block_size=4, target_layer_ids=(0, 2), num_target_layers=4,
                           mask_token_id=VOCAB - 1, architecture=name, options=OPTIONS[name])
    drafter = DFlashDrafter(config).eval()
    with torch.no_grad():  # every weight away from its start (identity convolutions, zero codebooks)
        for parameter in drafter.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    return drafter, TargetHead(torch.randn(VOCAB, 32), torch.randn(VOCAB, 32))


def every_member():
    return [*family.names(), "gated-test"]


@pytest.mark.parametrize("name", every_member())
def test_packed_forward_equals_one_block_at_a_time_and_the_cache_the_training_forward(name, request):
    if name == "gated-test":
        request.getfixturevalue("gated")
    drafter, head = member_drafter(name)
    torch.manual_seed(1)
    width = drafter.config.feature_width
    sequences = [(torch.randn(n, width), torch.randint(0, VOCAB - 1, (n,))) for n in (11, 7)]
    anchors = [[1, 4, 9], [2, 5]]
    packed = packed_blocks(drafter, head, sequences, anchors)
    expected = torch.stack([reference_block(drafter, head, f, ids, a) for (f, ids), sequence_anchors in zip(sequences, anchors)
                            for a in sequence_anchors])
    torch.testing.assert_close(packed, expected, rtol=1e-5, atol=1e-5)
    features, ids = sequences[0]
    cache = DraftCache(drafter)
    cache.extend(features[:5])
    cache.extend(features[5:9])
    torch.testing.assert_close(draft_block(drafter, head, cache, int(ids[9])),
                               head.logits(reference_block(drafter, head, features, ids, 9)[1:]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", every_member())
def test_export_round_trip_and_config_round_trip(name, request, tmp_path):
    from dflash_pipeline.drafters.serving import export_drafter, load_dflash_drafter

    if name == "gated-test":
        request.getfixturevalue("gated")
    drafter, head = member_drafter(name)
    assert DrafterConfig.from_dict(drafter.config.to_dict()) == drafter.config
    export_drafter(drafter, tmp_path / "export")
    loaded, info = load_dflash_drafter(tmp_path / "export")
    assert loaded.config.architecture == name and loaded.config.options == drafter.config.options
    assert info["config"]["architectures"] == [family.architecture(name).public_class]
    features = torch.randn(9, drafter.config.feature_width)
    outputs = []
    for model in (drafter, loaded.eval()):
        cache = DraftCache(model)
        cache.extend(features)
        outputs.append(draft_block(model, head, cache, 3))
    torch.testing.assert_close(outputs[0], outputs[1])


@pytest.mark.parametrize("name", every_member())
def test_speculative_decoding_is_lossless(name, request, tiny_target):
    from dflash_pipeline.decoding.plain import greedy_decode
    from dflash_pipeline.decoding.session import Speculation, speculative_decode
    from dflash_pipeline.speculation.modes import DecodingMode

    if name == "gated-test":
        request.getfixturevalue("gated")
    model, _, head, plain_drafter, prompt = tiny_target
    options = dict(OPTIONS[name], conv_group_size=16) if name == "dflash2" else OPTIONS[name]
    torch.manual_seed(0)
    drafter = DFlashDrafter(replace(plain_drafter.config, architecture=name, options=options)).eval()
    plain = greedy_decode(model, prompt, max_new_tokens=12, eos_ids={2})
    for speculation in (Speculation(drafter, head), Speculation(drafter, head, DecodingMode.tree(4))):
        run = speculative_decode(model, speculation, prompt, max_new_tokens=12, eos_ids={2}, feature_dtype="fp32")
        assert run.tokens == plain.tokens


def test_an_unknown_architecture_or_option_is_one_line_naming_the_key():
    from dflash_pipeline.drafters.build import choose_architecture
    from dflash_pipeline.foundation.config import TrainConfig
    from dflash_pipeline.foundation.errors import PipelineError

    with pytest.raises(PipelineError, match=r"train.architecture' must be one of dflash, dflash2, got 'dflash9'"):
        choose_architecture(TrainConfig(architecture="dflash9"), source="p.yaml")
    with pytest.raises(PipelineError, match=r"p.yaml: unknown key 'train.options.dflash2.rank'"):
        choose_architecture(TrainConfig(options={"dflash2": {"rank": 3}}), source="p.yaml")
    with pytest.raises(PipelineError, match=r"p.yaml: key 'train.options.dflash2.selector_top_k' must be >= 2, got 1"):
        choose_architecture(TrainConfig(options={"dflash2": {"selector_top_k": 1}}), source="p.yaml")
    with pytest.raises(PipelineError, match=r"unknown key 'train.options.dflash3'"):
        choose_architecture(TrainConfig(architecture="dflash", options={"dflash3": {}}), source="p.yaml")
    with pytest.raises(ValueError, match=r"selector_top_k 500 must be in 1..vocab_size \(97\)"):
        DrafterConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                      vocab_size=97, block_size=4, target_layer_ids=(0,), num_target_layers=2, mask_token_id=96,
                      architecture="dflash2", options={"selector_top_k": 500})


# ----------------------------------------------------------------------------- the third member, end to end


def test_a_third_architecture_trains_scores_decodes_and_exports_with_no_edit_elsewhere(gated, tiny_run, tiny_target, tmp_path):
    from dflash_pipeline.data.shards import open_split
    from dflash_pipeline.decoding.plain import greedy_decode
    from dflash_pipeline.decoding.session import Speculation, speculative_decode
    from dflash_pipeline.speculation.modes import DecodingMode
    from dflash_pipeline.drafters.checkpoints import load_checkpoint
    from dflash_pipeline.drafters.serving import export_drafter, load_dflash_drafter
    from dflash_pipeline.foundation.config import TrainConfig
    from dflash_pipeline.measure.scoring import score_teacher_forced, summarize_blocks
    from dflash_pipeline.target.load import load_target_head
    from dflash_pipeline.train.run import run_train

    target, root = tiny_run
    config = TrainConfig(num_layers=1, block_size=4, max_steps=4, tokens_per_step=256, anchors_per_sequence=4, eval_every=2,
                         save_every=2, eval_blocks=16, logits_chunk=64, lr=1e-2, train_vocab="full", distill_weight=0.0,
                         architecture="gated-test", options={"gated-test": {"gate_init": 0.5, "gate_weight": 1.0}})
    result = run_train(config, target=target, train_dir=root / "hidden" / "train", val_dir=root / "hidden" / "val",
                       out_dir=tmp_path / "ck", device="cpu", log=lambda *_: None)
    gate_means = [row["gate_mean"] for row in result.curve]
    assert gate_means[0] == 0.5 and gate_means[-1] > gate_means[0]  # the extra term pulls the gates towards the prior (1)
    drafter, info = load_checkpoint(tmp_path / "ck" / "step_000004")
    assert drafter.config.architecture == "gated-test" and drafter.config.options.gate_init == 0.5
    assert info["train_config"]["architecture"] == "gated-test" and info["train_config"]["gate_weight"] == 1.0

    head = load_target_head(target, device="cpu", dtype=torch.float32)
    val = open_split(root / "hidden" / "val")
    batched = score_teacher_forced(drafter, head, val, anchors_per_sequence=4, tokens_per_batch=256, tree_budgets=[4])
    plain = score_one_block_at_a_time(drafter, head, val, anchors_per_sequence=4, tree_budgets=[4])
    assert np.array_equal(batched.correct, plain.correct)
    assert np.array_equal(batched.extras["argmax_correct"], plain.extras["argmax_correct"])
    summary = summarize_blocks(batched)
    assert 0.0 <= summary.extras["blocks_with_a_hit"] <= 1.0 and summary.tau.mean >= 1.0  # the member's own metric, in the record's extras

    model, _, _, _, prompt = tiny_target
    model_head = TargetHead(model.get_input_embeddings().weight.detach(), model.get_output_embeddings().weight.detach())
    greedy = greedy_decode(model, prompt, max_new_tokens=10, eos_ids={2})
    speculative = speculative_decode(model, Speculation(drafter, model_head), prompt, max_new_tokens=10, eos_ids={2},
                                     feature_dtype="fp32")
    assert speculative.tokens == greedy.tokens

    export_drafter(drafter, tmp_path / "export")
    loaded, exported = load_dflash_drafter(tmp_path / "export")
    assert exported["config"]["architectures"] == ["GatedTestDraftModel"] and exported["config"]["dflash_config"]["gate_init"] == 0.5
    for name, tensor in drafter.state_dict().items():
        if name not in ("feature_scale", "fc.weight"):  # the scale is folded into fc on export
            torch.testing.assert_close(loaded.state_dict()[name], tensor, msg=name)


# ----------------------------------------------------------------------------- nothing outside the wing names a member


def test_no_code_outside_the_drafters_wing_names_an_architecture():
    """No string literal equal to a member's name or public class in the package outside drafters/
    (TrainConfig's default architecture is None: the family's `DEFAULT`)."""
    names = set(family.names()) | set(family.public_classes())
    package = REPO_ROOT / "src" / "dflash_pipeline"
    found = []
    for path in sorted(package.rglob("*.py")):
        if path.is_relative_to(package / "drafters"):
            continue
        tree = ast.parse(path.read_text())
        docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                      if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)) and node.body
                      and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names and id(node) not in docstrings:
                found.append(f"{path.relative_to(REPO_ROOT)}:{node.lineno}: {node.value!r}")
    assert found == [], found
