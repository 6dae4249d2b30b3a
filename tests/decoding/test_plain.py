"""decoding/plain.py on the tiny Llama: plain decoding streams and stops where it should and
`end_to_end` runs every candidate on every prompt against one plain run, lossless at T = 0, its
runs keyed by candidate and mode; and the host oracles the engine is tested against: a verified
prefix cuts a proposal (and its q) to k tokens, a tree verify leaves the target's cache holding
exactly the accepted path."""

import pytest
import torch
from oracles.decoding import keep_path, verify_tree
from oracles.drafting import Proposal, verified_prefix
from oracles.trees import ANCHOR, DraftTree
from support.decoding import plain_logits, prefilled

from dflash_pipeline.decoding.plain import greedy_decode
from dflash_pipeline.decoding.session import Speculation
from dflash_pipeline.measure.end_to_end import (
    RunKey,
    end_to_end,
    first_difference,
    summarize_end_to_end,
)
from dflash_pipeline.speculation.modes import DecodingMode


@pytest.fixture
def tiny_llama(tiny_target):
    return tiny_target[0]


def test_first_difference_is_the_first_parting_position_or_the_shorter_length():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2 and first_difference([1, 2, 3], [1]) == 1


def test_greedy_decoding_streams_every_token_and_stops_at_an_eos_or_the_cap(tiny_target):
    model, _, _, _, prompt = tiny_target
    streamed = []
    run = greedy_decode(model, prompt, max_new_tokens=6, eos_ids=set(), on_tokens=streamed.extend)
    assert len(run.tokens) == 6 and streamed == run.tokens and 0 < run.prefill_seconds <= run.seconds
    stopped = greedy_decode(model, prompt, max_new_tokens=6, eos_ids={run.tokens[2]})
    assert stopped.tokens == run.tokens[:run.tokens.index(run.tokens[2]) + 1]  # the EOS is kept, nothing after it


def test_a_verified_prefix_cuts_the_tokens_and_their_q_rows():
    q = torch.rand(4, 10)
    chain = verified_prefix(lambda cache, anchor: Proposal([7, 8, 9, 10]), 2)
    sampled = verified_prefix(lambda cache, anchor: Proposal([7, 8, 9, 10], q), 3)
    assert chain(None, 0).tokens == [7, 8] and chain(None, 0).q is None
    cut = sampled(None, 0)
    assert cut.tokens == [7, 8, 9] and torch.equal(cut.q, q[:3])
    assert verified_prefix(lambda cache, anchor: Proposal([7, 8]), 5)(None, 0).q is None


def test_end_to_end_runs_every_candidate_on_every_prompt_losslessly(tiny_target):
    model, _, head, drafter, prompt = tiny_target
    prompts = [("a", prompt), ("b", prompt[:5])]
    candidates = [("d", Speculation(drafter, head)), ("d", Speculation(drafter, head, DecodingMode.chain(1))),
                  ("d", Speculation(drafter, head, DecodingMode.tree(3)))]
    keys = [RunKey("d"), RunKey("d", DecodingMode.chain(1)), RunKey("d", DecodingMode.tree(3))]
    results = end_to_end(model, candidates, prompts, max_new_tokens=8, eos_ids=set(), feature_dtype="bf16")
    assert [r.prompt_id for r in results] == ["a", "b"] and all(list(r.speculative) == keys for r in results)
    for key in keys:
        summary = summarize_end_to_end(results, key)
        assert summary.lossless_rate == 1.0 and summary.prompts == 2 and summary.mismatches == []
    assert all(max(r.speculative[keys[1]].steps) <= 2 for r in results)  # one drafted token and the bonus per step
    with pytest.raises(ValueError, match="two candidates of one name decode in one mode"):
        end_to_end(model, candidates[:1] * 2, prompts, max_new_tokens=8, eos_ids=set(), feature_dtype="bf16")


def test_after_a_tree_verify_the_cache_holds_exactly_the_accepted_path(tiny_llama):
    prompt, anchor = [1, 504, 3112, 314, 253], 1345
    first = int(plain_logits(tiny_llama, prompt + [anchor]).argmax())
    second = int(plain_logits(tiny_llama, prompt + [anchor, first]).argmax())
    bonus = int(plain_logits(tiny_llama, prompt + [anchor, first, second]).argmax())
    decoys = [t for t in (40, 41, 42) if t not in (first, second)]
    # the accepted branch is grown second, so its nodes (1, 3) must be moved down in the cache
    tree = DraftTree(tokens=[decoys[0], first, decoys[1], second], parents=[ANCHOR, ANCHOR, 0, 1], depths=[0, 0, 1, 1])
    cache = prefilled(tiny_llama, prompt)
    with torch.no_grad():
        path, token = verify_tree(tiny_llama, cache, tree, anchor, len(prompt))
    assert path == [1, 3] and token == bonus
    reference = prefilled(tiny_llama, prompt + [anchor, first, second])
    assert cache.get_seq_length() == reference.get_seq_length() == len(prompt) + 3
    for ours, theirs in zip(cache.layers, reference.layers):
        torch.testing.assert_close(ours.keys, theirs.keys, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(ours.values, theirs.values, rtol=1e-4, atol=1e-4)


def test_keep_path_leaves_a_prefix_of_the_node_order_in_place_and_drops_the_rest():
    from types import SimpleNamespace

    keys = torch.arange(10.0).view(1, 1, 10, 1)
    layer = SimpleNamespace(keys=keys.clone(), values=keys.clone())

    class Cache:
        layers = [layer]

        def get_seq_length(self):
            return layer.keys.shape[-2]

        def crop(self, remove):
            layer.keys, layer.values = layer.keys[..., :remove, :], layer.values[..., :remove, :]

    keep_path(Cache(), 4, [1, 4])  # nodes start at entry 4: keep entries 5 and 8 after the first four
    assert layer.keys.flatten().tolist() == [0, 1, 2, 3, 5, 8]
    keep_path(Cache(), 4, [])  # every node rejected
    assert layer.keys.flatten().tolist() == [0, 1, 2, 3]


def test_the_package_has_one_decoding_engine():
    """Issue #36: one loop family, tree builder, drafter cache and graph runner in src/; the host
    loops, the heap builder, the host drafter cache and the one-block scorer live in tests/oracles."""
    import ast
    from pathlib import Path

    import dflash_pipeline

    package = Path(dflash_pipeline.__file__).parent
    defined, uses = {}, {}
    for path in package.rglob("*.py"):
        text = path.read_text()
        tree = ast.parse(text)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                defined.setdefault(node.name, []).append(path.relative_to(package).as_posix())
        for needle in ("torch.cuda.CUDAGraph", "heapq", "DynamicCache(", "\nREAD_EVERY ="):
            if needle in text:
                uses.setdefault(needle.strip(), []).append(path.relative_to(package).as_posix())
    for gone in ("host_greedy_decode", "host_speculative_decode", "dynamic_greedy_generate", "build_draft_tree", "DraftTree", "DraftCache",
                 "draft_block", "keep_path", "verify_tree", "score_one_block_at_a_time", "score_one_block", "chain_proposer",
                 "tree_proposer", "GraphedStep", "GraphedPhases", "select_block"):
        assert gone not in defined, f"{gone} is defined in src/ ({defined[gone]}): it belongs in tests/oracles"
    assert uses["torch.cuda.CUDAGraph"] == ["decoding/graphs.py"]  # the one graph runner
    assert "heapq" not in uses  # the one tree builder is the tensor one
    assert uses["DynamicCache("] == ["target/load.py"]  # only to read a config's sliding layers, never to decode
    assert uses["READ_EVERY ="] == ["foundation/devices.py"]
    assert defined["draft_chain"] == ["drafters/architecture.py", "drafters/dflash2.py"]  # the one drafting hook
    assert sorted(defined["StaticDraftCache"]) == ["decoding/static_speculation.py"]


def test_a_failed_graph_capture_warns_and_runs_the_same_phases_eagerly_with_their_state_put_back():
    from dflash_pipeline.decoding.graphs import PhaseRunner

    counter, log = torch.zeros((), dtype=torch.long), []

    def phase():
        counter.add_(1)
        log.append(int(counter))

    eager = PhaseRunner([phase], state=[counter], device=torch.device("cpu"))
    assert not eager.graphed and eager.phases == (phase,) and not log  # nothing runs until called
    with pytest.warns(UserWarning, match="CUDA graph capture of the decode step failed"):
        runner = PhaseRunner([phase], state=[counter], device=torch.device("cpu"), capture=True)  # no CUDA here: capture fails
    assert not runner.graphed and runner.phases == (phase,) and int(counter) == 0
    runner.phases[0]()
    assert int(counter) == 1


@pytest.mark.parametrize("fails", [False, True], ids=["captured", "capture-fails"])
def test_graph_capture_is_thread_local_with_the_garbage_collector_off_and_puts_it_back(monkeypatch, fails):
    """Issue #37 item 3: each phase is captured in "thread_local" error mode (a CUDA call elsewhere
    in the process does not invalidate it) with garbage collection off (no finaliser runs during
    capture), and collection is on again afterwards, whether the capture succeeded or not. The
    CUDA calls are stand-ins recording what capture asked for, so this runs on a CPU."""
    import contextlib
    import gc
    import types
    import warnings

    from dflash_pipeline.decoding import graphs

    seen = []

    class Graph:
        def replay(self):
            pass

    @contextlib.contextmanager
    def graph(cuda_graph, **kwargs):
        seen.append((kwargs, gc.isenabled()))
        yield
        if fails:
            raise RuntimeError("operation not permitted when stream is capturing")

    class Stream:
        def wait_stream(self, other):
            pass

    cuda = types.SimpleNamespace(Stream=Stream, current_stream=Stream, stream=lambda stream: contextlib.nullcontext(),
                                 CUDAGraph=Graph, graph=graph)
    monkeypatch.setattr(graphs.torch, "cuda", cuda)
    counter = torch.zeros((), dtype=torch.long)
    assert gc.isenabled()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        runner = graphs.PhaseRunner([lambda: counter.add_(1), lambda: counter.add_(2)], state=[counter], device=torch.device("cpu"),
                                    capture=True)
    assert runner.graphed is not fails and int(counter) == 0
    assert seen == [({"capture_error_mode": "thread_local"}, False)] * (1 if fails else 2)
    assert gc.isenabled()
