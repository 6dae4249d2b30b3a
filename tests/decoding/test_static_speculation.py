"""The speculative step on static buffers (issue #28) on a CPU: token for token plain greedy
decoding, the same steps as the host loop, nothing read back inside a step, one compiled graph
per phase over 64 steps, and sampling that keeps the target's distribution.

An oracle drafter makes acceptance happen on a random tiny target: its logits put the target's
true next token at rank 0, at rank 1 (behind a decoy) or nowhere near the top, by a fixed table
over answer positions, so chains stop part-way and DDTrees accept paths through second-ranked
nodes, whose keys/values must then move into place.
"""

import pytest
import torch
from oracles.decoding import host_greedy_decode, host_speculative_decode
from support.device_reads import DeviceReads, Paused
from support.speculation import host_proposer, install_oracle

import dflash_pipeline.decoding.static_speculation as static
from dflash_pipeline.decoding.plain import greedy_decode
from dflash_pipeline.decoding.static_speculation import Speculation
from dflash_pipeline.speculation.modes import DecodingMode
from dflash_pipeline.speculation.sampling import Sampling, draw_with_uniforms
from dflash_pipeline.speculation.trees import ranked_candidates, ranked_candidates_on_device

MAX_NEW = 48


@pytest.fixture
def oracle(tiny_target, monkeypatch):
    """The oracle for the tiny target's prompt; returns its plain greedy decoding."""
    model, tap, head, drafter, prompt = tiny_target
    reference = host_greedy_decode(model, prompt, max_new_tokens=MAX_NEW, eos_ids={2})
    install_oracle(monkeypatch, len(prompt), reference.tokens, model.config.vocab_size)
    return reference


MODES = [DecodingMode.chain(), DecodingMode.chain(2), DecodingMode.tree(3), DecodingMode.tree(8)]


@pytest.mark.parametrize("mode", MODES, ids=["chain", "chain-2", "tree-3", "tree-8"])
def test_static_speculation_equals_plain_greedy_and_the_host_loop(tiny_target, oracle, mode):
    model, tap, head, drafter, prompt = tiny_target
    run = Speculation(drafter, head, mode).decode(model, prompt, max_new_tokens=MAX_NEW, eos_ids={2})
    assert run.tokens == oracle.tokens
    host = host_speculative_decode(model, tap, drafter, host_proposer(drafter, head, mode), prompt, max_new_tokens=MAX_NEW,
                                          eos_ids={2})
    assert host.tokens == run.tokens
    assert run.steps == host.steps and run.drafted == host.drafted  # the same trees, the same accepted paths
    assert max(run.steps) >= 3 and min(run.steps) == 1  # acceptance happened, and rejection


def test_a_tree_accepts_paths_through_second_ranked_nodes(tiny_target, oracle, monkeypatch):
    """The accepted path is not always a prefix of the node order: keep-path must move keys."""
    model, tap, head, drafter, prompt = tiny_target
    moved = []
    accept = static.accept_greedy

    def watching(choice, tokens, parents, depths, depth):
        count, path, bonus = accept(choice, tokens, parents, depths, depth)
        moved.append(bool((path[: int(count)] != torch.arange(int(count))).any()))
        return count, path, bonus

    monkeypatch.setattr(static, "accept_greedy", watching)
    run = Speculation(drafter, head, DecodingMode.tree(8)).decode(model, prompt, max_new_tokens=MAX_NEW, eos_ids={2})
    assert run.tokens == oracle.tokens and any(moved)


def test_plain_static_decoding_equals_transformers(tiny_target):
    model, tap, head, drafter, prompt = tiny_target
    for eos in ({2}, {-5}):
        reference = host_greedy_decode(model, prompt, max_new_tokens=MAX_NEW, eos_ids=eos)
        streamed = []
        run = greedy_decode(model, prompt, max_new_tokens=MAX_NEW, eos_ids=eos, on_tokens=streamed.extend, read_every=5)
        assert run.tokens == reference.tokens == streamed


def test_an_eos_inside_a_block_ends_the_answer_there(tiny_target, oracle):
    """A frequent answer token made EOS: the answer stops at its first occurrence, even mid-block,
    and the steps after the end (until the read) change nothing."""
    model, tap, head, drafter, prompt = tiny_target
    frequent = max(set(oracle.tokens[1:]), key=oracle.tokens.count)
    expected = host_greedy_decode(model, prompt, max_new_tokens=MAX_NEW, eos_ids={frequent})
    streamed = []
    run = Speculation(drafter, head).decode(model, prompt, max_new_tokens=MAX_NEW, eos_ids={frequent}, read_every=16,
                                                  on_tokens=streamed.extend)
    assert run.tokens == expected.tokens == streamed and run.tokens[-1] == frequent
    assert sum(run.steps) >= len(run.tokens) - 1


def test_device_ranked_candidates_equal_the_host_ones_ties_included():
    generator = torch.Generator().manual_seed(0)
    for trial in range(100):
        vocab = int(torch.randint(2, 50, (1,), generator=generator))
        logits = torch.randint(-2, 2, (3, vocab), generator=generator).float() if trial % 2 else torch.randn(3, vocab, generator=generator)
        width = int(torch.randint(1, vocab + 2, (1,), generator=generator))
        host, device = ranked_candidates(logits.clone(), width), ranked_candidates_on_device(logits.clone(), width)
        assert torch.equal(host[1], device[1]) and torch.equal(host[0], device[0])


def test_draws_from_uniforms_follow_the_distribution_and_never_take_a_zero():
    probs = torch.tensor([0.0, 0.5, 0.0, 0.2, 0.3, 0.0])
    uniforms = torch.rand(20000, generator=torch.Generator().manual_seed(3))
    draws = draw_with_uniforms(probs.expand(20000, -1), uniforms)
    counts = torch.bincount(draws, minlength=6).double() / 20000
    assert counts[[0, 2, 5]].sum() == 0 and torch.allclose(counts, probs.double(), atol=0.015)
    assert draw_with_uniforms(probs, torch.tensor(1.0 - 2 ** -24)).item() == 4  # the top of [0, 1): the last token with mass


def _step(tiny_target, mode, sampling=None):
    model, tap, head, drafter, prompt = tiny_target
    step = static.SpeculativeStep(model, drafter, head, capacity=64, max_new_tokens=200, eos_ids={-5}, mode=mode, sampling=sampling)
    step.generator = torch.Generator().manual_seed(0)
    step.prefill(prompt, step.generator)
    return step


CHAIN = DecodingMode.chain()
SAMPLED = [(CHAIN, None), (DecodingMode.tree(6), None), (CHAIN, Sampling(0.8, rule="ratio", top_k=50)), (CHAIN, Sampling(1.0, rule="match"))]


class DeviceTraffic(DeviceReads):
    """DeviceReads, and tensors made from host data (a copy to the device, which a CUDA graph
    capture refuses)."""

    NAMES = DeviceReads.NAMES | {"tensor", "as_tensor", "from_numpy"}


@pytest.mark.parametrize("mode,sampling", SAMPLED, ids=["chain", "tree", "ratio", "match"])
def test_a_step_reads_nothing_back_and_copies_nothing_in(gpu_shaped_steps, tiny_target, mode, sampling):
    step = _step(tiny_target, mode, sampling)
    with DeviceTraffic() as reads:
        for _ in range(6):
            if sampling is not None:
                step.uniforms.uniform_(generator=step.generator)
            for phase in step.phases():
                phase()
    assert reads.calls == []


def test_the_loop_reads_once_every_read_interval(gpu_shaped_steps, tiny_target):
    model, tap, head, drafter, prompt = tiny_target
    mode = Speculation(drafter, head)
    mode.decode(model, prompt, max_new_tokens=MAX_NEW, eos_ids={-5})  # builds the step (allocation reads nothing either)
    reads = DeviceReads()
    quiet = Paused(reads, static.SpeculativeStep.prefill)  # the prefill is not a step
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(static.SpeculativeStep, "prefill", lambda self, *args: quiet(self, *args))
        with reads:
            run = mode.decode(model, prompt, max_new_tokens=MAX_NEW, eos_ids={-5}, read_every=16)
    steps = len(run.steps)
    # the read before the first step, one per 16 steps (the last round cut to what the cap may need), and the record's two
    assert reads.calls.count("tolist") <= 1 + -(-steps // 16) + 2 + 1 and set(reads.calls) == {"tolist"}


@pytest.mark.slow
@pytest.mark.parametrize("mode,sampling", SAMPLED[:3], ids=["chain", "tree", "ratio"])
def test_every_phase_compiles_whole_and_never_recompiles_over_64_steps(gpu_shaped_steps, tiny_target, mode, sampling):
    import torch._dynamo
    from torch._dynamo.utils import counters

    eager, compiled = _step(tiny_target, mode, sampling), _step(tiny_target, mode, sampling)
    torch._dynamo.reset()
    counters.clear()
    phases = [torch.compile(phase, fullgraph=True, dynamic=False, backend="aot_eager") for phase in compiled.phases()]
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(64):
            if sampling is not None:
                eager.uniforms.uniform_(generator=eager.generator)
                compiled.uniforms.copy_(eager.uniforms)
            for phase in eager.phases():
                phase()
            for phase in phases:
                phase()
            assert torch.equal(eager.count, compiled.count) and torch.equal(eager.anchor, compiled.anchor)
    assert torch.equal(eager.answer, compiled.answer)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 3


@pytest.mark.parametrize("kind", ["qwen3", "qwen2-sliding", "gemma3"])
@pytest.mark.parametrize("mode", [DecodingMode.chain(), DecodingMode.tree(8)], ids=["chain", "tree-8"])
def test_every_layout_speculates_token_for_token_what_it_decodes_plainly(kind, mode, monkeypatch):
    """Qwen3's q/k norms, a sliding window of 12 that a 48-token answer slides past (the tree's
    accepted path moves keys and their positions inside the static cache, which drops nothing),
    Gemma3's scaled embeddings, extra norms and final logit soft-cap: chains and trees accept
    part-way and the answer is plain greedy decoding's, which is transformers' own."""
    from support.decoding import tiny_layout

    from dflash_pipeline.drafters.core import DFlashDrafter
    from dflash_pipeline.drafters.config import DrafterConfig
    from dflash_pipeline.target.load import TargetHead

    model = tiny_layout(kind)
    head = TargetHead(model.get_input_embeddings().weight.detach(), model.get_output_embeddings().weight.detach())
    torch.manual_seed(0)
    drafter = DFlashDrafter(DrafterConfig(hidden_size=64, intermediate_size=128, num_layers=1, num_attention_heads=4,
                                          num_key_value_heads=2, head_dim=16, vocab_size=1024, block_size=5,
                                          target_layer_ids=(1, 3), num_target_layers=4, mask_token_id=0)).eval()
    prompt = torch.randint(3, 1024, (20,), generator=torch.Generator().manual_seed(3)).tolist()
    plain = greedy_decode(model, prompt, max_new_tokens=MAX_NEW, eos_ids={-1})
    with torch.no_grad():
        expected = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert plain.tokens == expected[0, len(prompt):].tolist()
    install_oracle(monkeypatch, len(prompt), plain.tokens, model.config.vocab_size)
    run = Speculation(drafter, head, mode).decode(model, prompt, max_new_tokens=MAX_NEW, eos_ids={-1})
    assert run.tokens == plain.tokens
    assert max(run.steps) >= 3 and min(run.steps) == 1


@pytest.mark.parametrize("mode", [DecodingMode.chain(), DecodingMode.tree(8)], ids=["chain", "tree-8"])
def test_at_the_gpu_read_interval_the_loop_plans_steps_by_tau_and_wastes_few_past_the_cap(tiny_target, oracle, mode, monkeypatch):
    """Issue #37 item 3: between two reads the loop runs ceil(tokens left / tau so far) steps, not
    min(READ_EVERY, tokens left), so a speculative decode (tau > 1) runs few steps past its cap.
    The GPU's read interval is forced here (a CPU reads every step); the steps run are counted at
    the draft phase, and the answer and every step's size are those of reading after each step."""
    import dflash_pipeline.decoding.loop as loop
    from dflash_pipeline.decoding.session import speculative_decode
    from dflash_pipeline.foundation.devices import READ_EVERY

    model, tap, head, drafter, prompt = tiny_target
    ran = []
    draft = static.SpeculativeStep.draft
    monkeypatch.setattr(static.SpeculativeStep, "draft", lambda self: (ran.append(1), draft(self))[1])
    runs = {}
    for every in (1, READ_EVERY):
        monkeypatch.setattr(loop, "default_read_every", lambda device, every=every: every)
        ran.clear()
        run = speculative_decode(model, Speculation(drafter, head, mode), prompt, max_new_tokens=MAX_NEW, eos_ids={-5})
        runs[every] = (run, len(ran))
    (each, each_ran), (gpu, gpu_ran) = runs[1], runs[READ_EVERY]
    assert len(each.tokens) == MAX_NEW and each.tokens == gpu.tokens == oracle.tokens[:MAX_NEW]
    assert each.steps == gpu.steps and each.drafted == gpu.drafted
    assert each_ran == len(each.steps)  # reading after every step wastes none
    assert sum(gpu.steps) / len(gpu.steps) > 1.5  # speculation: more than one token a step
    # on main's plan (min(READ_EVERY, tokens left)) the chain ran 2 steps past the cap, the tree 4
    assert gpu_ran - len(gpu.steps) <= 1, f"{gpu_ran - len(gpu.steps)} steps run past the cap"


@pytest.mark.parametrize("feature_dtype", ["bf16", "fp8_e4m3"])
def test_live_features_round_on_the_device_bit_for_bit_as_the_shards_store_them(feature_dtype):
    """Issue #37 item 3: the step's rounding of live features (`stored_features`) is the shards'
    encode-then-decode, bit for bit: rows of every scale, a zero row, ties and tiny values."""
    from dflash_pipeline.data.shards import decode_features, encode_features

    generator = torch.Generator().manual_seed(0)
    features = torch.randn(64, 96, generator=generator) * torch.logspace(-30, 30, 64)[:, None]
    features[3] = 0.0
    features[5, :8] = torch.tensor([1.0625, 1.1875, -3.25, 448.0, 1e-40, -1e-40, 5.5, 0.015625])
    ours = static.stored_features(features, feature_dtype)
    theirs = decode_features(*encode_features(features, feature_dtype), features.shape[-1], feature_dtype)
    assert ours.dtype == theirs.dtype == torch.bfloat16
    assert torch.equal(ours.view(torch.int16), theirs.view(torch.int16))


def test_an_fp8_feature_step_reads_nothing_back_and_copies_nothing_in(gpu_shaped_steps, tiny_target):
    """With `capture.feature_dtype: fp8_e4m3` too, the step stays capturable (issue #37 item 3)."""
    model, tap, head, drafter, prompt = tiny_target
    step = static.SpeculativeStep(model, drafter, head, capacity=64, max_new_tokens=200, eos_ids={-5}, feature_dtype="fp8_e4m3")
    step.prefill(prompt)
    with DeviceTraffic() as reads:
        for _ in range(6):
            for phase in step.phases():
                phase()
    assert reads.calls == []


def test_a_model_its_speculation_and_their_kept_steps_are_freed_with_the_last_reference(tiny_llama_dir, tiny_target, monkeypatch):
    """Issue #37 item 3: the steps kept per model (plain) and per `Speculation` hold the model, so
    a process-wide table keyed by the owner kept both alive for the life of the process."""
    import gc
    import weakref

    from transformers import AutoModelForCausalLM

    import dflash_pipeline.decoding.loop as loop

    _, tap, head, drafter, prompt = tiny_target
    kept = []
    runner = loop.PhaseRunner

    def recording(phases, **kwargs):  # each kept step, as the cache makes its runner
        kept.append(weakref.ref(phases[0].__self__))
        return runner(phases, **kwargs)

    monkeypatch.setattr(loop, "PhaseRunner", recording)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    speculation = Speculation(drafter, head)
    plain = greedy_decode(model, prompt, max_new_tokens=8, eos_ids={2})
    assert speculation.decode(model, prompt, max_new_tokens=8, eos_ids={2}).tokens == plain.tokens
    greedy_decode(model, prompt, max_new_tokens=8, eos_ids={2})  # kept: no new step
    assert len(kept) == 2 and all(step() is not None for step in kept)
    owners = [weakref.ref(model), weakref.ref(speculation)]
    del model, speculation
    gc.collect()
    assert [owner() for owner in owners] == [None, None] and [step() for step in kept] == [None, None]


def _vocab_drafter(tiny_target, seed: int, ids: torch.Tensor):
    from dflash_pipeline.drafters.core import DFlashDrafter

    torch.manual_seed(seed)
    drafter = DFlashDrafter(tiny_target[3].config).eval()
    drafter.set_draft_vocab(ids)
    return drafter


def test_a_new_drafter_state_is_loaded_into_the_tensors_a_captured_draft_graph_reads(tiny_target):
    """Issue #37 item 3: a draft graph reads `draft_vocab` and the cached head rows at their
    addresses; `load_state_dict` / `set_draft_vocab` of the same length must write the new values
    there (replacing the tensors freed them under the graph: garbage drafts)."""
    model, tap, head, drafter, prompt = tiny_target
    ours = _vocab_drafter(tiny_target, 1, torch.arange(0, 600, 2))
    theirs = _vocab_drafter(tiny_target, 2, torch.arange(1, 601, 2))
    vocab, rows = ours.draft_vocab, ours.draft_head_weight(head)  # what a capture would have read
    ours.load_state_dict(theirs.state_dict())
    assert ours.draft_vocab is vocab and torch.equal(vocab, theirs.draft_vocab)
    assert ours.draft_head_weight(head) is rows and torch.equal(rows, head.lm_head_weight[theirs.draft_vocab])
    assert torch.equal(ours.fc.weight, theirs.fc.weight)
    ours.set_draft_vocab(torch.arange(5, 305))
    assert ours.draft_vocab is vocab and ours.draft_head_weight(head) is rows
    assert torch.equal(rows, head.lm_head_weight[5:305])
    layout = ours.draft_layout
    ours.set_draft_vocab(torch.arange(5, 105))  # another length: a new layout, steps built for the old one are stale
    assert ours.draft_layout == layout + 1 and ours.draft_head_weight(head).shape[0] == 100


@pytest.mark.parametrize("mode", [DecodingMode.chain(), DecodingMode.tree(8)], ids=["chain", "tree-8"])
def test_after_a_new_drafter_state_the_kept_step_drafts_what_a_fresh_one_does(tiny_target, mode):
    """Issue #37 item 3: a kept speculative step after `load_state_dict` (same draft vocabulary
    length: loaded in place) and after `set_draft_vocab` of another length (the kept steps are
    stale and rebuilt) drafts and decodes as a fresh step of the loaded drafter does. (Eagerly,
    as here, main's kept step did too: it looked the rows up again; a replayed graph cannot.)"""
    import dflash_pipeline.decoding.loop as loop

    model, tap, head, drafter, prompt = tiny_target
    ours = _vocab_drafter(tiny_target, 1, torch.arange(0, 600, 2))
    theirs = _vocab_drafter(tiny_target, 2, torch.arange(1, 601, 2))
    speculation = Speculation(ours, head, mode)
    speculation.decode(model, prompt, max_new_tokens=MAX_NEW, eos_ids={2})  # builds and keeps the step
    for change in (lambda d: d.load_state_dict(theirs.state_dict()), lambda d: d.set_draft_vocab(torch.arange(1, 7))):
        change(ours)
        fresh_drafter = _vocab_drafter(tiny_target, 3, torch.zeros(0, dtype=torch.long))
        fresh_drafter.load_state_dict(ours.state_dict())
        fresh = Speculation(fresh_drafter, head, mode)
        kept, new = (speculation.decode(model, prompt, max_new_tokens=MAX_NEW, eos_ids={2}),
                     fresh.decode(model, prompt, max_new_tokens=MAX_NEW, eos_ids={2}))
        assert (kept.tokens, kept.steps, kept.drafted) == (new.tokens, new.steps, new.drafted)
        (step, _), = loop.steps_of(speculation).values()
        (fresh_step, _), = loop.steps_of(fresh).values()
        for each in (step, fresh_step):
            each.prefill(prompt)
            each.draft()
        assert torch.equal(step.node_tokens, fresh_step.node_tokens) and torch.equal(step.node_parents, fresh_step.node_parents)
