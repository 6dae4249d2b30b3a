"""The serving format: export -> load round trips, config.json fields, loader errors, published-style
folders, and z-lab's own DFlashDraftModel (the PyPI package dflash==0.1.0, or the z-lab/dflash checkout
DFLASH_ZLAB_PATH names) loading our export and drafting the same logits as our inference and training paths."""

import hashlib
import json
from dataclasses import replace

import pytest
import torch
from oracles.drafting import DraftCache, draft_block
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from support.drafters import random_drafter
from support.helpers import flip_a_byte

from dflash_pipeline.data.masks import dflash_mask
from dflash_pipeline.drafters import family
from dflash_pipeline.drafters.core import DFlashDrafter
from dflash_pipeline.drafters.config import DrafterConfig
from dflash_pipeline.drafters.serving import (
    PROVENANCE_FILE,
    export_drafter,
    load_dflash_drafter,
)
from dflash_pipeline.export.run import export_checkpoint
from dflash_pipeline.foundation.errors import PipelineError
from dflash_pipeline.target.load import TargetHead

LAYER_WEIGHTS = [
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
    "self_attn.q_norm.weight", "self_attn.k_norm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
    "mlp.down_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight",
]


def tiny_config(**overrides) -> DrafterConfig:
    # head_dim * heads (64) != hidden (32), so a reader that derives head_dim from hidden_size shows up.
    values = dict(hidden_size=32, intermediate_size=64, num_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, vocab_size=97, block_size=4, target_layer_ids=(0, 2, 3), num_target_layers=4,
                  mask_token_id=96, rope_theta=10000.0, extra={"mask_token": "last row"})
    values.update(overrides)
    return DrafterConfig(**values)


def smollm2_config() -> DrafterConfig:
    """SmolLM2-135M's sizes (the default target: 30 layers), taps as the default pipeline makes them."""
    return DrafterConfig(hidden_size=576, intermediate_size=1536, num_layers=2, num_attention_heads=9, num_key_value_heads=3,
                         head_dim=64, vocab_size=49152, block_size=8, target_layer_ids=(1, 8, 14, 20, 27), num_target_layers=30,
                         mask_token_id=0, rms_norm_eps=1e-5, rope_theta=100000.0, max_position_embeddings=8192)


def random_head(config: DrafterConfig, seed: int = 1) -> TargetHead:
    generator = torch.Generator().manual_seed(seed)
    embed = torch.randn(config.vocab_size, config.hidden_size, generator=generator)
    return TargetHead(embed, torch.randn(config.vocab_size, config.hidden_size, generator=generator) * 0.05)


def draft_logits(drafter: DFlashDrafter, head: TargetHead, features: torch.Tensor, anchor_token: int) -> torch.Tensor:
    cache = DraftCache(drafter)
    cache.extend(features)
    return draft_block(drafter, head, cache, anchor_token)


def assert_one_line_error(excinfo, *fragments: str) -> None:
    message = str(excinfo.value)
    assert "\n" not in message, message
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"


# ----------------------------------------------------------------------------- export and load


def test_round_trip_gives_identical_state_and_logits(tmp_path):
    drafter = random_drafter(tiny_config())
    out = export_drafter(drafter, tmp_path / "drafter", source={"step": 7})
    export_drafter(drafter, out, source={"step": 7})  # re-exporting replaces the folder and leaves nothing beside it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["drafter"]

    loaded, info = load_dflash_drafter(out)
    assert loaded.config == drafter.config  # including the `extra` notes, restored from provenance
    assert loaded.state_dict().keys() == drafter.state_dict().keys()
    for name, tensor in drafter.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    head = random_head(drafter.config)
    features = torch.randn(9, drafter.config.feature_width)
    assert torch.equal(draft_logits(loaded.eval(), head, features, 5), draft_logits(drafter, head, features, 5))
    assert info["provenance"]["source"] == {"step": 7}
    assert info["stored_dtype"] == "float32"


def test_config_json_has_the_serving_fields(tmp_path):
    config = smollm2_config()
    out = export_drafter(random_drafter(config), tmp_path / "drafter")
    written = json.loads((out / "config.json").read_text())
    expected = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": 8, "num_target_layers": 30,
        "dflash_config": {"mask_token_id": 0, "target_layer_ids": [1, 8, 14, 20, 27], "block_size": 8},
        "num_hidden_layers": 2, "layer_types": ["full_attention", "full_attention"],
        "hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
        "vocab_size": 49152, "hidden_act": "silu", "rms_norm_eps": 1e-5, "max_position_embeddings": 8192,
        "rope_theta": 100000.0, "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0}, "rope_scaling": None,
        "use_sliding_window": False, "sliding_window": None, "attention_bias": False, "tie_word_embeddings": False,
        "dtype": "float32", "torch_dtype": "float32",
    }
    assert {key: written.get(key) for key in expected} == expected
    names = {"fc.weight", "hidden_norm.weight", "norm.weight"} | {f"layers.{i}.{n}" for i in range(2) for n in LAYER_WEIGHTS}
    with safe_open(out / "model.safetensors", framework="pt") as handle:
        assert set(handle.keys()) == names  # the drafter's own weights only: no embed_tokens, no lm_head
        assert list(handle.get_slice("fc.weight").get_shape()) == [576, 5 * 576]
    provenance = json.loads((out / PROVENANCE_FILE).read_text())
    assert DrafterConfig.from_dict(provenance["drafter"]) == config


def test_bf16_export_stores_bf16(tmp_path):
    drafter = random_drafter(tiny_config())
    out = export_drafter(drafter, tmp_path / "drafter", dtype=torch.bfloat16)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert {t.dtype for t in load_file(out / "model.safetensors").values()} == {torch.bfloat16}
    loaded, info = load_dflash_drafter(out)
    assert info["stored_dtype"] == "bfloat16"
    for name, tensor in loaded.state_dict().items():
        if name == "draft_vocab":  # token ids, not weights (none here)
            assert tensor.numel() == 0
            continue
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, drafter.state_dict()[name].to(torch.bfloat16).float()), name


def test_export_checkpoint_records_where_it_came_from(tmp_path):
    from dflash_pipeline.drafters.checkpoints import save_checkpoint

    drafter = random_drafter(tiny_config())
    step_dir = save_checkpoint(tmp_path / "checkpoints", step=12, drafter=drafter,
                               record={"target_fingerprint": "abc123"}, metrics={})
    out = export_checkpoint(step_dir, tmp_path / "drafter")
    loaded, info = load_dflash_drafter(out)
    assert info["provenance"]["source"]["step"] == 12
    assert info["provenance"]["source"]["target_fingerprint"] == "abc123"
    assert torch.equal(loaded.fc.weight, drafter.fc.weight)
    assert "best_mode" not in info["provenance"]["source"]  # nothing measured, nothing claimed


def test_the_export_stage_records_the_mode_evaluate_measured_fastest(tmp_path):
    import importlib.util

    from click.testing import CliRunner
    from support.helpers import REPO_ROOT

    from dflash_pipeline.drafters.checkpoints import save_checkpoint

    step_dir = save_checkpoint(tmp_path / "checkpoints", step=12, drafter=random_drafter(tiny_config()),
                               record={"target_fingerprint": "abc123"}, metrics={})
    best_mode = {"mode": "tree4", "speedup": 1.08, "tree_budget": 4, "verify_tokens": None, "speedups": {"chain": 0.97, "tree4": 1.08}}
    best_json = tmp_path / "best.json"
    spec = importlib.util.spec_from_file_location("export_stage", REPO_ROOT / "stages" / "export.py")
    stage = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(stage)

    def export(best: dict, out: str):
        best_json.write_text(json.dumps({"name": "step_000012", "kind": "checkpoint", "path": str(step_dir), "tau": 1.5, "tau_ci95": 0.1,
                                         **best}))
        return CliRunner().invoke(stage.main, ["--params", str(REPO_ROOT / "params.yaml"), "--best", str(best_json),
                                               "--out", str(tmp_path / out)], catch_exceptions=False)

    result = export({"best_mode": best_mode}, "drafter")
    assert result.exit_code == 0 and "best mode tree4, speedup 1.08" in result.stdout, result.output
    _, info = load_dflash_drafter(tmp_path / "drafter")
    assert info["provenance"]["source"]["best_mode"] == best_mode and info["provenance"]["source"]["step"] == 12
    result = export({}, "older")  # a best.json of before the best mode: exported as before
    assert result.exit_code == 0 and "best_mode" not in load_dflash_drafter(tmp_path / "older")[1]["provenance"]["source"]
    result = export({"best_mode": "tree4"}, "bad")
    assert result.exit_code == 1 and f"{best_json}: best_mode is str, expected a mapping" in result.output


def test_the_export_stage_refuses_a_best_json_that_differs_from_its_record(tmp_path):
    # best.json says which checkpoint to publish; a flipped bit in it (another step, another tau)
    # was exported as if evaluate had chosen it.
    import importlib.util

    from click.testing import CliRunner
    from support.helpers import REPO_ROOT

    from dflash_pipeline.drafters.checkpoints import save_checkpoint
    step_dir = save_checkpoint(tmp_path / "checkpoints", step=12, drafter=random_drafter(tiny_config()), record={}, metrics={})
    best_json = tmp_path / "eval" / "best.json"
    best_json.parent.mkdir()
    # evaluate's best.json with its record (`sha256sum -c` format), as evaluate writes them (test_cli checks that it does)
    best_json.write_text(json.dumps({"name": "step_000012", "kind": "checkpoint", "path": str(step_dir), "tau": 1.5, "tau_ci95": 0.1}))
    (tmp_path / "eval" / "best.json.sha256").write_text(f"{hashlib.sha256(best_json.read_bytes()).hexdigest()}  best.json\n")
    spec = importlib.util.spec_from_file_location("export_stage", REPO_ROOT / "stages" / "export.py")
    stage = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(stage)

    def export(out: str):
        return CliRunner().invoke(stage.main, ["--params", str(REPO_ROOT / "params.yaml"), "--best", str(best_json),
                                               "--out", str(tmp_path / out)], catch_exceptions=False)

    assert export("good").exit_code == 0
    best_json.write_text(best_json.read_text().replace('"tau": 1.5', '"tau": 1.7'))  # one byte, still valid JSON
    result = export("bad")
    assert result.exit_code == 1 and not (tmp_path / "bad").exists(), result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {best_json}: damaged (sha256 ") and "best.json.sha256 records" in lines[0]
    from dflash_pipeline.integrity.checks import RunPaths, check_run

    assert [(f.path, f.kind) for f in check_run(RunPaths.at(tmp_path, eval=tmp_path / "eval"))] == [(best_json, "damaged")]


def test_a_flipped_bit_is_refused_in_the_checkpoint_it_exports_and_in_the_export(tmp_path):
    # It used to export damaged weights (and evaluate scored them, dvc.lock recorded them) without a word.
    from dflash_pipeline.drafters.checkpoints import save_checkpoint

    step_dir = save_checkpoint(tmp_path / "checkpoints", step=12, drafter=random_drafter(tiny_config()), record={}, metrics={})
    out = export_checkpoint(step_dir, tmp_path / "drafter")
    provenance = json.loads((out / PROVENANCE_FILE).read_text())
    assert sorted(provenance["files"]) == ["config.json", "model.safetensors"]
    for damaged, recorded_in in ((out / "model.safetensors", PROVENANCE_FILE), (step_dir / "model.safetensors", "checkpoint.json")):
        flip_a_byte(damaged)
        with pytest.raises(PipelineError) as excinfo:
            load_dflash_drafter(out) if recorded_in == PROVENANCE_FILE else export_checkpoint(step_dir, tmp_path / "again")
        assert_one_line_error(excinfo, f"{damaged}: damaged (sha256 ", f"{recorded_in} records ")
    assert not (tmp_path / "again").exists()


def test_export_refuses_a_window_the_format_cannot_express(tmp_path):
    with pytest.raises(PipelineError) as excinfo:
        export_drafter(random_drafter(tiny_config(sliding_window=8)), tmp_path / "drafter")
    assert_one_line_error(excinfo, "sliding_window=8")
    assert list(tmp_path.iterdir()) == []


def test_export_never_replaces_a_folder_it_did_not_write(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(PipelineError) as excinfo:
        export_drafter(random_drafter(tiny_config()), tmp_path / "model")
    assert_one_line_error(excinfo, "model", "not a DFlash drafter folder")
    assert json.loads((tmp_path / "model" / "config.json").read_text()) == {"architectures": ["LlamaForCausalLM"]}


# ----------------------------------------------------------------------------- published folders


def published_style_config(config: DrafterConfig, *, transformers_5: bool) -> dict:
    """config.json as z-lab releases spell it, without our additions. The 4.x style (Qwen3-8B-DFlash-b16
    era) has auto_map, rope_theta and top-level block_size; the 5.x style (Qwen3.5 era) rope_parameters
    and block_size inside dflash_config. Neither lists target_layer_ids here, so the default taps apply."""
    data = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 1, "eos_token_id": 2, "dflash_config": {"mask_token_id": config.mask_token_id},
        "dtype": "bfloat16", "head_dim": config.head_dim, "hidden_act": "silu", "hidden_size": config.hidden_size,
        "initializer_range": 0.02, "intermediate_size": config.intermediate_size, "max_position_embeddings": 40960,
        "num_attention_heads": config.num_attention_heads, "num_hidden_layers": config.num_layers,
        "num_key_value_heads": config.num_key_value_heads, "num_target_layers": config.num_target_layers,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "use_cache": True, "vocab_size": config.vocab_size,
    }
    if transformers_5:
        data["dflash_config"]["block_size"] = config.block_size
        data.update(rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta}, use_sliding_window=False,
                    sliding_window=4096, layer_types=["full_attention"] * config.num_layers, transformers_version="5.3.0")
    else:
        data.update(block_size=config.block_size, auto_map={"AutoModel": "dflash.DFlashDraftModel"}, rope_theta=config.rope_theta,
                    rope_scaling=None, sliding_window=None, use_sliding_window=False, max_window_layers=config.num_layers,
                    transformers_version="4.57.3")
    return data


@pytest.mark.parametrize("transformers_5", [False, True], ids=["4.x-style", "5.x-style"])
def test_a_published_style_folder_without_provenance_loads(tmp_path, transformers_5):
    # 2 drafter layers over an 8-layer target: z-lab's default taps are [1, 5].
    config = tiny_config(target_layer_ids=(1, 5), num_target_layers=8, rope_theta=1e6, rms_norm_eps=1e-6,
                         max_position_embeddings=40960, extra={})
    drafter = random_drafter(config)
    out = export_drafter(drafter, tmp_path / "published", dtype=torch.bfloat16)
    (out / PROVENANCE_FILE).unlink()
    (out / "config.json").write_text(json.dumps(published_style_config(config, transformers_5=transformers_5)))

    loaded, info = load_dflash_drafter(out)
    assert loaded.config == config
    assert info["provenance"] is None
    assert info["config"]["num_target_layers"] == 8
    assert torch.equal(loaded.fc.weight, drafter.fc.weight.to(torch.bfloat16).float())


def test_sharded_weights_load(tmp_path):
    drafter = random_drafter(tiny_config())
    out = export_drafter(drafter, tmp_path / "drafter")
    tensors = load_file(out / "model.safetensors")
    (out / "model.safetensors").unlink()
    (out / PROVENANCE_FILE).unlink()  # resharded as large published drafters ship, without our provenance
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2], "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for file, part in shards.items():
        save_file({name: tensors[name] for name in part}, out / file)
    weight_map = {name: file for file, part in shards.items() for name in part}
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    loaded, _ = load_dflash_drafter(out)
    for name, tensor in drafter.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def _drop_weight(out):
    tensors = load_file(out / "model.safetensors")
    del tensors["layers.1.self_attn.k_norm.weight"]
    save_file(tensors, out / "model.safetensors")


def _add_weight(out):
    tensors = load_file(out / "model.safetensors")
    tensors["lm_head.weight"] = torch.zeros(97, 32)
    save_file(tensors, out / "model.safetensors")


def _reshape_weight(out):
    tensors = load_file(out / "model.safetensors")
    tensors["fc.weight"] = torch.zeros(32, 64)  # two taps' width, config.json says three
    save_file(tensors, out / "model.safetensors")


def _edit_config(**changes):
    def edit(out):
        data = json.loads((out / "config.json").read_text())
        for key, value in changes.items():
            if value is None:
                data.pop(key, None)
            else:
                data[key] = value
        (out / "config.json").write_text(json.dumps(data))
    return edit


LOADER_FAULTS = {
    "missing config": (lambda out: (out / "config.json").unlink(), ["config.json", "no config.json"]),
    "missing weight": (_drop_weight, ["model.safetensors", "layers.1.self_attn.k_norm.weight"]),
    "extra weight": (_add_weight, ["model.safetensors", "lm_head.weight"]),
    "wrong shape": (_reshape_weight, ["model.safetensors", "fc.weight", "[32, 64]"]),
    "no weights": (lambda out: (out / "model.safetensors").unlink(), ["model.safetensors"]),
    "no mask token": (_edit_config(dflash_config={"target_layer_ids": [0, 2, 3]}), ["config.json", "mask_token_id"]),
    "no block size": (_edit_config(block_size=None, dflash_config={"mask_token_id": 96}), ["config.json", "block_size"]),
    "sliding layers": (_edit_config(layer_types=["sliding_attention", "full_attention"]), ["config.json", "sliding_attention"]),
    "scaled rope": (_edit_config(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}), ["config.json", "yarn"]),
    "edited config": (_edit_config(hidden_act="gelu"), ["config.json", "hidden_act"]),
    "provenance disagrees": (_edit_config(dflash_config={"mask_token_id": 5, "target_layer_ids": [0, 2, 3]}),
                             [PROVENANCE_FILE, "mask_token_id"]),
}


@pytest.mark.parametrize("fault", list(LOADER_FAULTS))
def test_loader_errors_are_one_line_naming_the_file_and_key(tmp_path, fault):
    out = export_drafter(random_drafter(tiny_config()), tmp_path / "drafter")
    damage, fragments = LOADER_FAULTS[fault]
    damage(out)
    with pytest.raises(PipelineError) as excinfo:
        load_dflash_drafter(out)
    assert_one_line_error(excinfo, *fragments)


# ----------------------------------------------------------------------------- the z-lab reference


def reference_configs():
    """Per architecture of the family, the configs its reference parity runs on (tiny, and the
    sizes of the default target), with the tolerance of float32 rounding in another order."""
    return {"dflash": ((tiny_config, smollm2_config), 1e-5), "dflash2": ((tiny_dflash2_config, smollm2_dflash2_config), 5e-5)}


def zlab_reference_class(zlab_draft_model_class, member):
    """z-lab's class of the same public name as `member`'s, from the module that holds its DFlashDraftModel, or None."""
    import sys

    return getattr(sys.modules[zlab_draft_model_class.__module__], member.public_class, None)


@pytest.mark.parametrize("architecture, size", [(name, size) for name in family.names() for size in (0, 1)],
                         ids=lambda value: {0: "tiny", 1: "smollm2-sizes"}.get(value, value))
def test_zlab_reference_drafts_the_same_logits(tmp_path, zlab_draft_model_class, architecture, size):
    """z-lab's class of the same name loads our export unchanged and agrees with both of our paths,
    for every member of the family that z-lab publishes a class for.

    Inference: z-lab's loop (dflash_generate) keeps context K/V in a DynamicCache, feeds only the newly
    committed features each step and crops the block's K/V off again; ours is DraftCache + draft_block.
    Training: one forward_blocks call with the DFlash mask must equal z-lab drafting each block alone
    (neighbouring blocks included, whose block-local convolutions must not meet).
    """
    from transformers import DynamicCache

    member = family.architecture(architecture)
    reference_class = zlab_reference_class(zlab_draft_model_class, member)
    if reference_class is None:
        pytest.skip(f"z-lab publishes no {member.public_class}")
    makers, tolerance = reference_configs()[architecture]
    config = makers[size]()
    drafter, head = random_drafter(config), random_head(config)
    out = export_drafter(drafter, tmp_path / "drafter")
    reference, loading = reference_class.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    reference.eval()
    assert not loading["missing_keys"] and not loading["unexpected_keys"] and not loading["mismatched_keys"]
    assert (list(reference.target_layer_ids), reference.block_size, reference.mask_token_id) == \
        (list(config.target_layer_ids), config.block_size, config.mask_token_id)
    features, ids, reference_hidden, block_embeddings = reference_drafting(reference, config, head)

    with torch.no_grad():
        cache, past = DraftCache(drafter), DynamicCache()
        for anchor in (17, 22, 23):  # a first draft, then 4 and 0 tokens accepted
            cache.extend(features[cache.length:anchor])
            ours = draft_block(drafter, head, cache, int(ids[anchor]))
            theirs = head.logits(reference_hidden(anchor, anchor, past)[1:])
            past.crop(anchor - past.get_seq_length())  # drop the block's K/V (negative: valid in transformers 4 and 5)
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=tolerance)

        anchors = [3, 11, 12, 30]
        size_b, length = config.block_size, features.shape[0]
        count = len(anchors) * size_b
        mask = dflash_mask(torch.zeros(length, dtype=torch.long), torch.arange(length), torch.zeros(count, dtype=torch.long),
                           torch.tensor(anchors).repeat_interleave(size_b), torch.arange(len(anchors)).repeat_interleave(size_b))
        ours = drafter.forward_blocks(features, torch.arange(length), torch.cat([block_embeddings(a) for a in anchors]),
                                      torch.cat([torch.arange(a, a + size_b) for a in anchors]), mask)
        theirs = torch.cat([reference_hidden(anchor, anchor) for anchor in anchors])
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=tolerance)
        torch.testing.assert_close(head.logits(ours), head.logits(theirs), rtol=1e-5, atol=tolerance)


def reference_drafting(reference, config: DrafterConfig, head: TargetHead, length: int = 40):
    """Seeded features and ids, and z-lab's forward as dflash_generate calls it (positions from the
    cache's length to the block's end), shared by the parity tests."""
    generator = torch.Generator().manual_seed(2)
    features = torch.randn(length, config.feature_width, generator=generator)
    ids = torch.randint(0, config.vocab_size, (length,), generator=generator)

    def block_embeddings(anchor):
        block = torch.full((config.block_size,), config.mask_token_id)
        block[0] = ids[anchor]
        return head.embed(block)

    def reference_hidden(context, anchor, past=None):
        start = 0 if past is None else past.get_seq_length()
        return reference(target_hidden=features[None, start:context], noise_embedding=block_embeddings(anchor)[None],
                         position_ids=torch.arange(start, anchor + config.block_size)[None], past_key_values=past,
                         use_cache=past is not None, is_causal=False)[0]

    return features, ids, reference_hidden, block_embeddings


def test_a_draft_vocabulary_travels_beside_the_public_files(tmp_path):
    drafter = random_drafter(tiny_config())
    drafter.set_draft_vocab(torch.tensor([9, 4, 17, 30]))
    out = export_drafter(drafter, tmp_path / "drafter")
    assert (out / "draft_vocab.safetensors").is_file()
    loaded, info = load_dflash_drafter(out)
    assert loaded.draft_vocab.tolist() == [4, 9, 17, 30] and info["provenance"]["draft_vocab_size"] == 4
    head = random_head(drafter.config)
    features = torch.randn(9, drafter.config.feature_width)
    logits = draft_logits(loaded.eval(), head, features, 5)
    assert logits.shape[-1] == 4 and torch.equal(logits, draft_logits(drafter, head, features, 5))
    # Without the file (a server that ignores it) the same weights draft over the whole vocabulary;
    # our loader takes such a folder only when its provenance does not record the file (else it is damage).
    (out / "draft_vocab.safetensors").unlink()
    with pytest.raises(PipelineError, match=r"draft_vocab.safetensors: missing \(dflash_pipeline.json records its sha256\)"):
        load_dflash_drafter(out)
    provenance = json.loads((out / PROVENANCE_FILE).read_text())
    del provenance["files"]["draft_vocab.safetensors"]
    (out / PROVENANCE_FILE).write_text(json.dumps(provenance))
    assert load_dflash_drafter(out)[0].draft_vocab.numel() == 0
    from safetensors.torch import save_file

    save_file({"token_ids": torch.tensor([3, drafter.config.vocab_size])}, out / "draft_vocab.safetensors")
    with pytest.raises(PipelineError) as excinfo:
        load_dflash_drafter(out)
    assert_one_line_error(excinfo, "draft_vocab.safetensors", "token_ids must be")


# ----------------------------------------------------------------------------- DFlash2


def tiny_dflash2_config(**overrides) -> DrafterConfig:
    # Three taps (released drafters use two) so that a tap read from the wrong offset shows up.
    return tiny_config(architecture="dflash2", options=dict(conv_kernel_size=3, conv_group_size=8, selector_rank=6, selector_top_k=5),
                       **overrides)


def smollm2_dflash2_config() -> DrafterConfig:
    return replace(smollm2_config(), architecture="dflash2", options=dict(conv_kernel_size=2, conv_group_size=16, selector_rank=64,
                   selector_top_k=16))


DFLASH2_NAMES = {f"layers.{i}.{side}_conv.{name}" for i in range(2) for side in ("attention", "mlp")
                 for name in ("base_kernel", "kernel_projection.weight")}
DFLASH2_NAMES |= {"candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook",
                  "candidate_selector.hidden_projection.weight"}


def test_dflash2_export_writes_the_public_contract_and_round_trips(tmp_path):
    drafter = random_drafter(tiny_dflash2_config())
    out = export_drafter(drafter, tmp_path / "drafter")
    written = json.loads((out / "config.json").read_text())
    assert written["architectures"] == ["DFlash2DraftModel"]
    assert written["dflash_config"] == {"mask_token_id": 96, "target_layer_ids": [0, 2, 3], "block_size": 4, "conv_kernel_size": 3,
                                        "conv_group_size": 8, "selector_rank": 6, "selector_top_k": 5}
    dflash_names = {"fc.weight", "hidden_norm.weight", "norm.weight"} | {f"layers.{i}.{n}" for i in range(2) for n in LAYER_WEIGHTS}
    with safe_open(out / "model.safetensors", framework="pt") as handle:
        assert set(handle.keys()) == dflash_names | DFLASH2_NAMES
        assert list(handle.get_slice("layers.0.attention_conv.base_kernel").get_shape()) == [2, 3, 32]
        assert list(handle.get_slice("layers.0.mlp_conv.kernel_projection.weight").get_shape()) == [2 * 3 * 4, 32]
        assert list(handle.get_slice("candidate_selector.predecessor_codebook").get_shape()) == [97, 6]

    loaded, _ = load_dflash_drafter(out)
    assert loaded.config == drafter.config
    for name, tensor in drafter.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def test_an_export_from_before_the_options_were_nested_loads_and_its_provenance_still_checks_them(tmp_path):
    drafter = random_drafter(tiny_dflash2_config())
    out = export_drafter(drafter, tmp_path / "drafter")
    path = out / PROVENANCE_FILE
    provenance = json.loads(path.read_text())
    recorded = provenance["drafter"]
    assert recorded["dflash2"] == {"conv_kernel_size": 3, "conv_group_size": 8, "selector_rank": 6, "selector_top_k": 5}
    provenance["drafter"] = {**{k: v for k, v in recorded.items() if k != "dflash2"}, **recorded["dflash2"]}  # the old flat layout
    path.write_text(json.dumps(provenance))
    loaded, info = load_dflash_drafter(out)
    assert loaded.config == drafter.config and info["provenance"]["drafter"]["selector_rank"] == 6
    for name, tensor in drafter.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    provenance["drafter"]["selector_rank"] = 7  # disagrees with config.json
    path.write_text(json.dumps(provenance))
    with pytest.raises(PipelineError, match=r"dflash_pipeline.json: drafter.dflash2.selector_rank is 7, but config.json gives 6"):
        load_dflash_drafter(out)


def test_a_dflash2_draft_vocabulary_travels_beside_the_full_vocabulary_codebooks(tmp_path):
    from oracles.drafting import select_block

    drafter = random_drafter(tiny_dflash2_config())
    drafter.set_draft_vocab(torch.tensor([9, 4, 17, 30, 55, 61, 80]))
    out = export_drafter(drafter, tmp_path / "drafter")
    with safe_open(out / "model.safetensors", framework="pt") as handle:  # indexed by token id: the whole vocabulary
        assert list(handle.get_slice("candidate_selector.successor_codebook").get_shape()) == [97, 6]
    loaded, _ = load_dflash_drafter(out)
    assert loaded.draft_vocab.tolist() == [4, 9, 17, 30, 55, 61, 80]
    head, features = random_head(drafter.config), torch.randn(9, drafter.config.feature_width)
    paths = []
    for model in (drafter, loaded.eval()):
        cache = DraftCache(model)
        cache.extend(features)
        paths.append(select_block(model, head, cache, 5))
    assert torch.equal(paths[0].tokens, paths[1].tokens) and set(paths[0].tokens.flatten().tolist()) <= set(loaded.draft_vocab.tolist())


def test_published_dflash2_folders_load_as_baselines(tmp_path):
    """A folder as z-lab publishes DFlash2 (transformers 5 style, DFlash2 sizes in dflash_config, no
    provenance) loads; so does the `.weight` spelling of the codebooks some converters write."""
    config = tiny_dflash2_config()
    drafter = random_drafter(config)
    out = export_drafter(drafter, tmp_path / "published", dtype=torch.bfloat16)
    (out / PROVENANCE_FILE).unlink()
    published = published_style_config(config, transformers_5=True)
    published["architectures"] = ["DFlash2DraftModel"]
    published["dflash_config"].update(target_layer_ids=[0, 2, 3], conv_kernel_size=3, conv_group_size=8, selector_rank=6,
                                      selector_top_k=5)
    (out / "config.json").write_text(json.dumps(published))
    loaded, info = load_dflash_drafter(out)
    assert loaded.config == replace(config, extra={}, max_position_embeddings=40960) and info["provenance"] is None
    codebook = drafter.candidate_selector.successor_codebook.detach().to(torch.bfloat16).float()
    assert torch.equal(loaded.candidate_selector.successor_codebook, codebook)

    tensors = load_file(out / "model.safetensors")
    tensors["candidate_selector.successor_codebook.weight"] = tensors.pop("candidate_selector.successor_codebook")
    save_file(tensors, out / "model.safetensors")
    assert torch.equal(load_dflash_drafter(out)[0].candidate_selector.successor_codebook, codebook)


DFLASH2_LOADER_FAULTS = {
    "no selector rank": (_edit_config(dflash_config={"mask_token_id": 96, "target_layer_ids": [0, 2, 3], "conv_kernel_size": 3,
                                                     "conv_group_size": 8, "selector_top_k": 5}),
                         ["config.json", "dflash_config.selector_rank"]),
    "softcapped logits": (_edit_config(final_logit_softcapping=30.0), ["config.json", "final_logit_softcapping"]),
    "uneven groups": (_edit_config(dflash_config={"mask_token_id": 96, "target_layer_ids": [0, 2, 3], "conv_kernel_size": 3,
                                                  "conv_group_size": 5, "selector_rank": 6, "selector_top_k": 5}),
                      ["config.json", "conv_group_size 5"]),
    "missing conv": (lambda out: save_file({k: v for k, v in load_file(out / "model.safetensors").items()
                                            if k != "layers.1.mlp_conv.base_kernel"}, out / "model.safetensors"),
                     ["model.safetensors", "layers.1.mlp_conv.base_kernel"]),
}


@pytest.mark.parametrize("fault", list(DFLASH2_LOADER_FAULTS))
def test_dflash2_loader_errors_are_one_line_naming_the_file_and_key(tmp_path, fault):
    out = export_drafter(random_drafter(tiny_dflash2_config()), tmp_path / "drafter")
    damage, fragments = DFLASH2_LOADER_FAULTS[fault]
    damage(out)
    with pytest.raises(PipelineError) as excinfo:
        load_dflash_drafter(out)
    assert_one_line_error(excinfo, *fragments)


@pytest.fixture(scope="module")
def zlab_dflash2_model_class(zlab_draft_model_class):
    """z-lab's DFlash2DraftModel, found (or skipped, or failed under CI) as `zlab_draft_model_class` is."""
    from dflash.model import DFlash2DraftModel  # a reference without DFlash2 fails here

    return DFlash2DraftModel


@pytest.mark.parametrize("make_config", [tiny_dflash2_config, smollm2_dflash2_config], ids=["tiny", "smollm2-sizes"])
def test_zlab_reference_walks_the_same_dflash2_selector_paths(tmp_path, zlab_dflash2_model_class, make_config):
    """What DFlash2 adds to the family's parity (`test_zlab_reference_drafts_the_same_logits`): with
    z-lab's DFlash2DraftModel on our export, (b) the selector's greedy path (T = 0) and (c) at T > 0,
    given its sampled path, the probabilities q over each slot's candidates, from each side's own
    drafted hidden states (equal to 5e-5). Its top-K is unsorted, so candidates and q are compared per token id."""
    from oracles.drafting import draft_hidden, select_block
    from transformers import DynamicCache

    config = make_config()
    drafter, head = random_drafter(config), random_head(config)
    out = export_drafter(drafter, tmp_path / "drafter")
    reference, loading = zlab_dflash2_model_class.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    reference.eval()
    assert not loading["missing_keys"] and not loading["unexpected_keys"] and not loading["mismatched_keys"]
    selector = reference.candidate_selector
    assert (list(reference.target_layer_ids), reference.block_size, reference.mask_token_id, selector.top_k) == \
        (list(config.target_layer_ids), config.block_size, config.mask_token_id, config.options.selector_top_k)
    assert torch.equal(selector.predecessor_codebook.weight, drafter.candidate_selector.predecessor_codebook)

    features, ids, reference_hidden, _ = reference_drafting(reference, config, head)

    def by_token(candidates, values):
        order = candidates.argsort(dim=-1)
        return candidates.gather(-1, order), values.gather(-1, order)

    selector_changed_a_draft = False
    with torch.no_grad():
        cache, past = DraftCache(drafter), DynamicCache()
        for anchor in (17, 22, 23):
            cache.extend(features[cache.length:anchor])
            anchor_token = int(ids[anchor])
            ours_hidden = draft_hidden(drafter, head, cache, anchor_token)
            theirs_hidden = reference_hidden(anchor, anchor, past)[1:]
            past.crop(anchor - past.get_seq_length())
            # float32 rounding of the same operations in another order (four convolutions a layer, 576
            # wide): measured up to 1.8e-5 on states up to 6 in size; a wrong tap or norm moves them by O(1).
            torch.testing.assert_close(ours_hidden, theirs_hidden, rtol=1e-5, atol=5e-5)
            torch.testing.assert_close(draft_block(drafter, head, cache, anchor_token), head.logits(theirs_hidden),
                                       rtol=1e-5, atol=5e-5)

            # (b) the greedy walk, each from its own hidden states and the target head.
            ours = select_block(drafter, head, cache, anchor_token)
            path, candidates, _ = reference.propose(theirs_hidden[None], torch.tensor([anchor_token]), head.logits, 0.0)
            assert ours.tokens.tolist() == path.tolist()
            assert torch.equal(ours.candidates.sort(dim=-1).values, candidates.sort(dim=-1).values)
            selector_changed_a_draft |= ours.tokens[0].tolist() != draft_block(drafter, head, cache, anchor_token).argmax(-1).tolist()

            # (c) T > 0: z-lab samples a path; along it our q over the same candidates must equal its q.
            torch.manual_seed(anchor)
            sampled, candidates, q_theirs = reference.propose(theirs_hidden[None], torch.tensor([anchor_token]), head.logits, 0.8)
            predecessors = torch.cat([torch.tensor([[anchor_token]]), sampled[:, :-1]], dim=1)
            scores = drafter.candidate_selector.pair_scores(ours_hidden[None], ours.unary, ours.candidates, predecessors)
            ours_ids, ours_q = by_token(ours.candidates, torch.softmax(scores / 0.8, dim=-1))
            theirs_ids, theirs_q = by_token(candidates, q_theirs)
            assert torch.equal(ours_ids, theirs_ids)
            torch.testing.assert_close(ours_q, theirs_q, rtol=1e-5, atol=1e-6)
    assert selector_changed_a_draft  # the pair scores mattered, so (b) compared more than two argmaxes
