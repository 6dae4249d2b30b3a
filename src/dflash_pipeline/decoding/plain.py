"""Decoding with the target alone: the entry outside code takes for it.

    engine_name     what records call the engine on a device: the static KV step ("static-kv"),
                    replayed as CUDA graphs on a GPU ("static-kv-cuda-graph"); a target it
                    cannot serve is refused in one line naming its model type
    greedy_decode   one prompt, greedy or sampled: the reference output and timing (`DecodeRun`)
                    of evaluate's end-to-end runs and `dflash-pipeline decode --compare`
    decode_batch    left-padded prompts answered together (the generate stage), one token per
                    live row per step
    forward_costs   the target's forward of n new tokens, timed as a verify step runs it (the
                    verify length's plan, `measure.verify_plan`)

This wing has two entries: this module and `session` (speculative decoding, which adds the
drafter). Everything else in it (the static step, the graph runner, the loop) is internal, and
tests/test_layering.py keeps it so. Like the loop, this module imports nothing of the drafters,
so the generate stage does not go stale when drafter code changes.
"""

import statistics
import time

import torch

from dflash_pipeline.decoding.graphs import PhaseRunner
from dflash_pipeline.decoding.loop import DecodeRun, PlainStep, cached_step, run_prompt, run_steps
from dflash_pipeline.decoding.static_decoder import StaticDecoder, check_servable
from dflash_pipeline.foundation.devices import default_read_every, synchronize
from dflash_pipeline.speculation.sampling import Sampling
from dflash_pipeline.target.placement import is_split, model_device

__all__ = ["DecodeRun", "GRAPHED_ENGINE", "STATIC_ENGINE", "decode_batch", "engine_name", "forward_costs", "greedy_decode"]

STATIC_ENGINE = "static-kv"  # static KV, whole steps on the device
GRAPHED_ENGINE = "static-kv-cuda-graph"  # the same steps, each phase replayed as a CUDA graph


def engine_name(model) -> str:
    """The engine that decodes with this target, as records name it: the static step, replayed as
    CUDA graphs on a GPU (eager if a capture fails, with a warning). A target it cannot serve is
    refused in one line (`static_decoder.check_servable`); nothing falls back to another loop."""
    check_servable(model)
    return GRAPHED_ENGINE if model_device(model).type == "cuda" and not is_split(model) else STATIC_ENGINE


@torch.inference_mode(False)
def greedy_decode(model, prompt_ids: list[int], *, max_new_tokens: int, eos_ids: set[int], sampling: Sampling | None = None,
                  on_tokens=None, read_every: int | None = None) -> DecodeRun:
    """Plain decoding of one prompt, greedy (or sampled with `sampling`), batch 1, on a step kept
    per target and reused across prompts: the reference output and timing. `on_tokens(list)` sees
    the new tokens as they are made."""
    engine_name(model)
    sampling_key = None if sampling is None else (sampling.temperature, sampling.top_k, sampling.top_p)
    key = (tuple(sorted(eos_ids)), sampling_key)

    def build(capacity, answer_capacity):
        return PlainStep(model, capacity=capacity, max_new_tokens=answer_capacity, eos_ids=eos_ids, sampling=sampling)

    step, runner = cached_step(model, key, len(prompt_ids), max_new_tokens, build)
    return run_prompt(step, runner, prompt_ids, max_new_tokens, sampling, on_tokens, read_every)


def decode_batch(model, input_ids: torch.Tensor, valid: torch.Tensor, *, max_new_tokens: int, eos_ids: set[int], on_read=None,
                 read_every: int | None = None) -> list[tuple[list[int], bool]]:
    """Greedy answers of left-padded prompts [B, W] (`valid`: their real tokens), decoded together
    on the plain step (`loop.PlainStep`, the step `greedy_decode` takes at one row) driven by the
    one loop: each prompt's answer, cut after its first EOS, and whether it stopped at one.

    Tokens and ends stay on the device and the host reads which rows ended every `read_every`
    steps (`devices.default_read_every`: 16 on a GPU, every step on a CPU, where a read costs
    nothing); `on_read(tokens made, prompts ended)` sees the totals so far at each read. On a GPU
    the batch stays whole (an ended row steps on: free while a step is bound by latency, and the
    replayed CUDA graph keeps its shapes); on a CPU, where a step costs in proportion to its rows,
    the rows that ended leave the batch at each read."""
    engine_name(model)
    device = model_device(model)
    batch, width = input_ids.shape
    step = PlainStep(model, batch=batch, capacity=width, max_new_tokens=max_new_tokens, eos_ids=eos_ids)
    runner = PhaseRunner(step.phases(), state=step.graph_state(), device=device, capture=False if step.split else None)
    step.prefill_rows(input_ids.to(device), valid.to(device))

    def after_read() -> None:  # after each read of the step's state
        if on_read is not None:
            on_read(step.tokens_made, step.prompts_ended)
        if not runner.graphed:
            step.keep_live_rows()

    with torch.no_grad():
        run_steps(step, runner=runner, read_every=read_every or default_read_every(device), on_read=after_read, read_first=False)
    return step.answers()


@torch.inference_mode(False)
def forward_costs(model, prompt_ids: list[int], lengths: list[int], *, repeats: int = 5) -> dict[int, float]:
    """Median seconds of one target forward of n new tokens (causal among themselves, after the KV
    cache of `prompt_ids`) with the argmax of each position's logits, as a verify step takes it, for
    each n in `lengths`, on the static cache. The lengths take turns, so drift in machine speed
    falls on all alike; nothing is cropped: each repeat rewrites the same columns."""
    engine_name(model)
    device = model_device(model)
    width = len(prompt_ids)
    decoder = StaticDecoder(model, batch=1, length=width + max(lengths) + 1)
    with torch.no_grad():
        ids = torch.tensor([prompt_ids], device=device)
        decoder.prefill(ids, torch.ones_like(ids, dtype=torch.bool))
        samples = {n: [] for n in lengths}
        for repeat in range(repeats + 1):  # the first round warms up
            for n in lengths:
                columns = width + torch.arange(n, device=device)
                visible = (decoder.key_columns[None, :] <= columns[:, None])[None]
                tokens = ids[:, -n:]
                synchronize(device)
                started = time.perf_counter()
                decoder.logits(decoder.forward(tokens, columns[None], columns, visible)[0]).argmax(-1)
                synchronize(device)
                if repeat:
                    samples[n].append(time.perf_counter() - started)
    return {n: statistics.median(values) for n, values in samples.items()}
