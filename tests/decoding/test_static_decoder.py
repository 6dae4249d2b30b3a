"""The static-KV decode step (issue #28) on a CPU: the same greedy answers as transformers' own
forward, no device read inside a steady-state step, and one compiled graph over 64 steps."""

import pytest
import torch
from oracles.generate import dynamic_greedy_generate
from support.decoding import tiny_layout
from support.device_reads import DeviceReads, Paused

from dflash_pipeline.decoding.static_decoder import StaticDecoder, supports
from dflash_pipeline.foundation.devices import READ_EVERY
from dflash_pipeline.generate.run import (
    decoding_engine,
    left_padded,
    static_greedy_generate,
)


def _prompts(count: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 49152, (int(torch.randint(3, 40, (1,), generator=generator)),), generator=generator).tolist()
            for _ in range(count)]


def test_generate_decodes_on_the_static_step_on_every_device_and_refuses_what_it_cannot(tiny_target, monkeypatch):
    """One engine: the static step on a CPU (written columns only) and on a GPU (a replayed CUDA
    graph). A target it cannot serve is refused in one line naming its model type, never decoded
    down another path."""
    from dflash_pipeline.foundation.errors import PipelineError

    model = tiny_target[0]
    assert supports(model) and decoding_engine(model) == "static-kv"
    monkeypatch.setattr("dflash_pipeline.decoding.plain.model_device", lambda model: torch.device("cuda"))
    assert decoding_engine(model) == "static-kv-cuda-graph"
    # A target split over devices (`target.placement`) is never captured as a graph: eager, same answers.
    monkeypatch.setattr(model, "hf_device_map", {"model.embed_tokens": 0, "model.layers": "cpu"}, raising=False)
    assert decoding_engine(model) == "static-kv"
    monkeypatch.delattr(model, "hf_device_map")
    monkeypatch.setattr(model.config, "attn_logit_softcapping", 50.0, raising=False)
    with pytest.raises(PipelineError, match="model type 'llama' soft-caps attention logits"):
        decoding_engine(model)


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


def test_a_decode_loop_reads_the_device_once_every_read_interval(gpu_shaped_steps, tiny_target, monkeypatch):
    """Between the prefill and the answers, the loop reads back one pair of numbers every
    READ_EVERY steps (tokens made, rows ended); the step itself reads nothing."""
    import dflash_pipeline.decoding.static_decoder as static

    model = tiny_target[0]
    prompts = _prompts(5, 1)
    reads = DeviceReads()
    quiet_prefill = Paused(reads, static.StaticDecoder.prefill)
    monkeypatch.setattr(static.StaticDecoder, "prefill", lambda self, *args: quiet_prefill(self, *args))
    with reads:
        answers = static_greedy_generate(model, prompts, max_new_tokens=3 * READ_EVERY, eos_ids={-1}, pad_id=2, read_every=READ_EVERY)
    assert all(len(a.token_ids) == 3 * READ_EVERY for a in answers)
    assert reads.calls == ["tolist"] * 3 + ["tolist"]  # three reads in the loop, then the answers once

    decoder = StaticDecoder(model, batch=2, length=64)
    decoder.prefill(torch.tensor([[2, 5, 6], [7, 8, 9]]), torch.tensor([[False, True, True], [True, True, True]]))
    with DeviceReads() as step_reads:
        for _ in range(8):
            decoder.step(torch.tensor([11, 12]))
    assert step_reads.calls == []


@pytest.mark.slow
def test_the_step_compiles_whole_and_never_recompiles_over_64_steps(gpu_shaped_steps, tiny_target):
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

    from dflash_pipeline.foundation import devices
    from dflash_pipeline.target import load

    calls = []
    monkeypatch.setattr(torch.backends.cuda, "enable_cudnn_sdp", calls.append)
    devices.configure_attention("cpu")
    assert calls == []
    devices.configure_attention("cuda:0")
    assert calls == [False]
    assert "configure_attention(device)" in inspect.getsource(load.load_target)


# ----------------------------------------------------------------------------- every layout


@pytest.mark.parametrize("kind,attention", [("llama", "sdpa"), ("llama", "eager"), ("llama-rope-scaling-bias", "sdpa"), ("qwen3", "sdpa"),
                                            ("qwen2-sliding", "sdpa"), ("mistral-sliding", "sdpa"), ("gemma3", "eager")])
def test_every_layout_decodes_what_transformers_generate_decodes(kind, attention):
    """Left-padded rows of a batch, 40 greedy tokens each, past a sliding window of 12 where the
    layout has one: token for token transformers' own `generate`, one prompt at a time."""
    model = tiny_layout(kind, attention)
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 1024, (length,), generator=generator).tolist() for length in (30, 17, 24)]
    ids, valid = left_padded(prompts, 0)
    answers = []
    for trim in (True, False):  # the CPU's step (written columns only) and the GPU's (the whole length)
        decoder = StaticDecoder(model, batch=3, length=ids.shape[1] + 41, tap_layers=(1, 3), trim=trim)
        tokens = [decoder.prefill(ids, valid).argmax(-1)]
        for _ in range(39):
            tokens.append(decoder.step(tokens[-1]).argmax(-1))
        answers.append(torch.stack(tokens, 1).tolist())
        assert decoder.features.shape == (3, 1, 2 * 64)
    for prompt, trimmed, whole in zip(prompts, *answers):
        with torch.no_grad():
            expected = model.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert trimmed == whole == expected[0, len(prompt):].tolist(), kind


@pytest.mark.parametrize("change,words", [
    (lambda c: setattr(c, "attn_logit_softcapping", 50.0), "soft-caps attention logits"),
    (lambda c: setattr(c, "rope_parameters", {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}), "rope type ['dynamic']"),
    (lambda c: setattr(c, "_attn_implementation", "flash_attention_2"), "attention 'flash_attention_2'"),
    (lambda c: setattr(c, "layer_types", ["full_attention", "linear_attention"] * 2), "layer types ['linear_attention']"),
])
def test_a_target_the_engine_cannot_serve_is_refused_in_one_line_naming_its_model_type(change, words):
    from dflash_pipeline.decoding.static_decoder import check_servable
    from dflash_pipeline.foundation.errors import PipelineError

    model = tiny_layout("qwen3")
    change(model.config)
    with pytest.raises(PipelineError, match=r"model type 'qwen3'") as refused:
        check_servable(model)
    assert words in str(refused.value) and "\n" not in str(refused.value)
    with pytest.raises(PipelineError):
        StaticDecoder(model, batch=1, length=8)


def test_every_forward_that_passes_a_cache_takes_the_keyword_the_installed_forward_names(monkeypatch):
    """transformers 5.17 names its cache `past_key_values` and swallows an unknown `cache=` in
    **kwargs (decoding with no cache, no error): the keyword is read from the forward's signature."""
    from dflash_pipeline.decoding import static_decoder
    from dflash_pipeline.foundation.errors import PipelineError

    class Newer(torch.nn.Module):
        def forward(self, input_ids, cache=None, **kwargs):
            return cache

    class Older(torch.nn.Module):
        def forward(self, input_ids, past_key_values=None, **kwargs):
            return past_key_values

    class Neither(torch.nn.Module):
        def forward(self, input_ids, **kwargs):
            return kwargs

    marker = object()
    for module in (Newer(), Older()):
        assert module(None, **static_decoder.cache_argument(module, marker)) is marker
    with pytest.raises(PipelineError, match="takes neither 'cache' nor 'past_key_values'"):
        static_decoder.cache_argument(Neither(), marker)
    model = tiny_layout("llama")
    assert static_decoder.cache_keyword(model) == static_decoder.cache_keyword(model.get_decoder()) == "cache"


def test_moving_a_trees_path_moves_its_keys_values_and_their_positions():
    """A sliding window masks by token position: the positions must travel with the keys."""
    decoder = StaticDecoder(tiny_layout("qwen2-sliding"), batch=1, length=16)
    for cache in (decoder.keys, decoder.values):
        cache.copy_(torch.randn(cache.shape))
    decoder.key_positions.copy_(torch.tensor([[0, 1, 2, 3, 4, 5, 5, 6, 6, 7, 0, 0, 0, 0, 0, 0]]))  # a tree after column 4
    keys, values = decoder.keys.clone(), decoder.values.clone()
    into, source = torch.tensor([5, 6, 7]), torch.tensor([6, 8, 9])  # the path: nodes at columns 6, 8, 9
    decoder.move_columns(into, source)
    assert decoder.key_positions[0, :8].tolist() == [0, 1, 2, 3, 4, 5, 6, 7]
    assert torch.equal(decoder.keys[..., 5:8, :], keys[..., [6, 8, 9], :]) and torch.equal(decoder.values[..., 5:8, :], values[..., [6, 8, 9], :])


def test_folded_grouped_query_attention_equals_grouped_sdpa():
    """CUDA's path (query heads folded into equal heads, issue #36 item 5), checked on a CPU:
    the same output as SDPA's own grouped-query call, under a mask that hides keys per step."""
    from dflash_pipeline.decoding.static_decoder import folded_attention

    generator = torch.Generator().manual_seed(0)
    query = torch.randn(2, 6, 3, 8, generator=generator)
    key, value = torch.randn(2, 2, 10, 8, generator=generator), torch.randn(2, 2, 10, 8, generator=generator)
    mask = torch.rand(2, 1, 3, 10, generator=generator) > 0.4
    mask[..., 0] = True  # no empty row
    expected = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=0.3, enable_gqa=True)
    assert torch.allclose(folded_attention(query, key, value, mask, 0.3), expected.transpose(1, 2), atol=1e-6)


@pytest.mark.parametrize("kind", ["llama", "qwen2-sliding"])
def test_masks_folded_once_per_forward_give_the_grouped_steps_logits(kind, monkeypatch):
    """CUDA's decoder (`fold_heads`) hands every layer masks already folded for the query groups,
    sliding ones included; on a CPU, forced on, its prefill and steps equal the grouped decoder's."""
    from dflash_pipeline.decoding import static_decoder

    model = tiny_layout(kind)
    assert model.config.num_attention_heads > model.config.num_key_value_heads
    folded_calls = []
    folded = static_decoder.folded_attention
    monkeypatch.setattr(static_decoder, "folded_attention", lambda q, k, v, mask, s: folded_calls.append(mask.shape[-2]) or folded(q, k, v, mask, s))
    ids, valid = left_padded([[token % 1000 + 3 for token in prompt] for prompt in _prompts(3, 30)], 0)
    outputs = {}
    for fold in (False, True):
        decoder = StaticDecoder(model, batch=3, length=ids.shape[1] + 20, fold_heads=fold)
        assert decoder.fold_groups == (model.config.num_attention_heads // model.config.num_key_value_heads if fold else 1)
        steps = [decoder.prefill(ids, valid)]
        for _ in range(16):  # past the sliding window of 12
            steps.append(decoder.step(steps[-1].argmax(-1)))
        outputs[fold] = torch.stack(steps)
    assert folded_calls and all(rows % decoder.fold_groups == 0 for rows in folded_calls)
    torch.testing.assert_close(outputs[True], outputs[False], atol=2e-5, rtol=1e-5)


def test_the_engine_attention_serves_a_switched_model_outside_the_engine_as_before(tiny_target):
    """Building a static decoder switches an SDPA target to the engine's attention function; the
    target's own forward (no static mask) then answers exactly as transformers' SDPA did."""
    from dflash_pipeline.decoding.static_decoder import STATIC_SDPA

    model = tiny_target[0]
    ids, valid = left_padded(_prompts(3, 7), 2)
    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        before = model(input_ids=ids, attention_mask=valid.long()).logits
        StaticDecoder(model, batch=1, length=8)
        assert model.config._attn_implementation == STATIC_SDPA
        after = model(input_ids=ids, attention_mask=valid.long()).logits
    assert torch.equal(before, after)


@pytest.mark.parametrize("trim", [True, False], ids=["cpu-trimmed", "gpu-shaped"])
def test_one_cache_tensor_per_layer_decodes_what_the_stacked_cache_decodes(tiny_target, monkeypatch, trim):
    """A target split over devices keeps each layer's keys where the layer runs (`PER_LAYER_CACHE`
    forces that layout on one CPU): batched greedy answers with rows leaving the batch, and tree
    speculation, come out token for token and step for step the same, and the cache moves a tree's
    accepted path makes leave the same keys and values."""
    from dataclasses import replace

    from support.drafters import randomize

    from dflash_pipeline.decoding import static_decoder
    from dflash_pipeline.decoding.session import Speculation, speculative_decode
    from dflash_pipeline.speculation.modes import DecodingMode
    from dflash_pipeline.drafters.core import DFlashDrafter
    from dflash_pipeline.generate.run import greedy_generate

    model, _, head, drafter, prompt = tiny_target
    monkeypatch.setattr(static_decoder, "TRIM_ON_CPU", trim)
    torch.manual_seed(0)
    dflash2 = randomize(DFlashDrafter(replace(drafter.config, architecture="dflash2", options=dict(
        conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=4))), seed=2)
    prompts = [prompt, prompt[:5], [1, 77, 78, 79]]
    runs = []
    for per_layer in (False, True):
        monkeypatch.setattr(static_decoder, "PER_LAYER_CACHE", per_layer)
        answers = greedy_generate(model, prompts, max_new_tokens=16, eos_ids={2}, pad_id=2)
        tree = speculative_decode(model, Speculation(dflash2, head, DecodingMode.tree(6)), prompt, max_new_tokens=24, eos_ids={2})
        runs.append(([a.token_ids for a in answers], tree.tokens, tree.steps))
    assert runs[0] == runs[1]

    # The moves a tree's accepted path makes, and a smaller batch, on both layouts.
    decoders = []
    for per_layer in (False, True):
        monkeypatch.setattr(static_decoder, "PER_LAYER_CACHE", per_layer)
        decoder = static_decoder.StaticDecoder(model, batch=2, length=16)
        ids = torch.tensor([prompt[:6], prompt[2:8]])
        decoder.prefill(ids, torch.ones_like(ids, dtype=torch.bool))
        decoder.move_columns(torch.tensor([1, 2]), torch.tensor([4, 5]))
        decoder.keep_rows(torch.tensor([1]))
        decoders.append(decoder)
    stacked, per_layer = decoders
    assert isinstance(per_layer.keys, list) and len(per_layer.keys) == len(stacked.keys)
    for layer in range(len(stacked.keys)):
        assert torch.equal(stacked.keys[layer], per_layer.keys[layer]) and torch.equal(stacked.values[layer], per_layer.values[layer])
    assert torch.equal(stacked.key_positions, per_layer.key_positions)
