"""The static-KV decode step (issue #28) on a CPU: the same greedy answers as transformers' own
forward, no device read inside a steady-state step, and one compiled graph over 64 steps."""

import pytest
import torch

from dflash_pipeline.decoding.static_decoder import StaticDecoder, supports
from dflash_pipeline.generate import READ_EVERY, decoding_engine, dynamic_greedy_generate, left_padded, static_greedy_generate
from test_step_contract import DeviceReads, Paused


def _prompts(count: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 49152, (int(torch.randint(3, 40, (1,), generator=generator)),), generator=generator).tolist()
            for _ in range(count)]


def test_the_static_path_serves_llama_targets_on_a_gpu_only(tiny_target, monkeypatch):
    """On a CPU transformers' forward measured faster (bench/generate.py --engines); the static
    loop is for the GPU, where its step is a replayed CUDA graph."""
    model = tiny_target[0]
    assert supports(model) and decoding_engine(model) == "transformers-dynamic-cache"
    cuda = type("Parameter", (), {"device": torch.device("cuda")})()
    monkeypatch.setattr(model, "parameters", lambda: iter([cuda]))
    assert decoding_engine(model) == "static-kv-cuda-graph"
    monkeypatch.setattr(model.config, "model_type", "gpt2")
    assert decoding_engine(model) == "transformers-dynamic-cache"


@pytest.mark.parametrize("seed", range(3))
def test_static_answers_equal_transformers_answers(tiny_target, seed, monkeypatch):
    """Left padding of very different lengths, rows ending at EOS at different steps (a common
    token made EOS) and leaving the batch at the reads (on a CPU), the length cap: token for token
    what transformers' forward answers."""
    model = tiny_target[0]
    kept = []
    keep_rows = StaticDecoder.keep_rows
    monkeypatch.setattr(StaticDecoder, "keep_rows", lambda self, rows: kept.append(rows.numel()) or keep_rows(self, rows))
    prompts = _prompts(7, seed)
    reference = dynamic_greedy_generate(model, prompts, max_new_tokens=40, eos_ids={2}, pad_id=2)
    frequent = max(set(t for a in reference for t in a.token_ids), key=lambda t: sum(a.token_ids.count(t) for a in reference))
    for eos in ({2}, {frequent}):
        expected = dynamic_greedy_generate(model, prompts, max_new_tokens=40, eos_ids=eos, pad_id=2)
        got = static_greedy_generate(model, prompts, max_new_tokens=40, eos_ids=eos, pad_id=2)
        assert [(a.token_ids, a.finish_reason) for a in got] == [(a.token_ids, a.finish_reason) for a in expected]
    assert any(a.finish_reason == "stop" for a in got) and any(len(a.token_ids) < 40 for a in got)
    assert kept and all(0 < count < 7 for count in kept)  # rows that ended left the batch


def test_the_step_equals_transformers_logits(tiny_target):
    model = tiny_target[0]
    ids, valid = left_padded(_prompts(4, 5), 2)
    width = ids.shape[1]
    decoder = StaticDecoder(model, batch=4, length=width + 8)
    logits = decoder.prefill(ids, valid)
    with torch.inference_mode():
        reference = model(input_ids=ids, attention_mask=valid.long(), position_ids=(valid.long().cumsum(-1) - 1).clamp(min=0)).logits[:, -1]
    assert torch.allclose(logits, reference, atol=1e-5, rtol=1e-5)
    token = logits.argmax(-1)
    following = decoder.step(token)
    with torch.inference_mode():
        longer = torch.cat([ids, token[:, None]], 1)
        mask = torch.cat([valid, torch.ones(4, 1, dtype=torch.bool)], 1).long()
        reference = model(input_ids=longer, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits[:, -1]
    assert torch.allclose(following, reference, atol=1e-5, rtol=1e-5)


def test_a_decode_loop_reads_the_device_once_every_read_interval(tiny_target, monkeypatch):
    """Between the prefill and the answers, the loop reads back one pair of numbers every
    READ_EVERY steps (tokens made, rows ended); the step itself reads nothing."""
    import dflash_pipeline.decoding.static_decoder as static

    model = tiny_target[0]
    prompts = _prompts(5, 1)
    reads = DeviceReads()
    quiet_prefill = Paused(reads, static.StaticDecoder.prefill)
    monkeypatch.setattr(static.StaticDecoder, "prefill", lambda self, *args: quiet_prefill(self, *args))
    with reads:
        answers = static_greedy_generate(model, prompts, max_new_tokens=3 * READ_EVERY, eos_ids={-1}, pad_id=2)
    assert all(len(a.token_ids) == 3 * READ_EVERY for a in answers)
    assert reads.calls == ["tolist"] * 3 + ["tolist"]  # three reads in the loop, then the answers once

    decoder = StaticDecoder(model, batch=2, length=64)
    decoder.prefill(torch.tensor([[2, 5, 6], [7, 8, 9]]), torch.tensor([[False, True, True], [True, True, True]]))
    with DeviceReads() as step_reads:
        for _ in range(8):
            decoder.step(torch.tensor([11, 12]))
    assert step_reads.calls == []


@pytest.mark.slow
def test_the_step_compiles_whole_and_never_recompiles_over_64_steps(tiny_target):
    import torch._dynamo
    from torch._dynamo.utils import counters

    model = tiny_target[0]
    ids, valid = left_padded(_prompts(3, 2), 2)
    width = ids.shape[1]
    eager, compiled_decoder = (StaticDecoder(model, batch=3, length=width + 70) for _ in range(2))
    tokens = eager.prefill(ids, valid).argmax(-1)
    compiled_decoder.prefill(ids, valid)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(compiled_decoder.step, fullgraph=True, dynamic=False, backend="aot_eager")
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(64):
            expected = eager.step(tokens)
            got = compiled(tokens)
            assert torch.allclose(got, expected, atol=1e-5)
            tokens = expected.argmax(-1)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1


def test_cuda_turns_cudnn_attention_off_where_the_target_is_loaded(monkeypatch):
    """cuDNN attention plans anew for every key length (~45 ms of a decode step on an H200): the
    target's loader makes the one choice of kernels, on CUDA only."""
    import inspect

    from dflash_pipeline import devices
    from dflash_pipeline.target import load

    calls = []
    monkeypatch.setattr(torch.backends.cuda, "enable_cudnn_sdp", calls.append)
    devices.configure_attention("cpu")
    assert calls == []
    devices.configure_attention("cuda:0")
    assert calls == [False]
    assert "configure_attention(device)" in inspect.getsource(load.load_target)
