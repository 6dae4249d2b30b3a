"""End-to-end speculative decoding measured against plain greedy decoding on the same prompts.

    RunKey               whose runs and in which mode: a candidate's name and its `DecodingMode`
    end_to_end           both on the same prompts, alternating which goes first
    summarize_end_to_end lossless rate, τ per step, speedup, time split and break-even τ (a typed
                         `measure.record.EndToEnd`)
    first_difference, is_near_tie  where two answers part, and whether the target was tied there

At T = 0 speculative decoding is lossless by construction; `summarize_end_to_end` checks it token
for token against plain decoding rather than trusting it."""

from dataclasses import dataclass, field

import numpy as np
import torch

from dflash_pipeline.decoding.plain import DecodeRun, greedy_decode
from dflash_pipeline.decoding.session import Speculation, speculative_decode
from dflash_pipeline.foundation.progress import progress_iter
from dflash_pipeline.foundation.stats import mean_ci95
from dflash_pipeline.measure.record import EndToEnd, Interval, Mismatch, TimeSplit
from dflash_pipeline.speculation.modes import DecodingMode
from dflash_pipeline.speculation.sampling import Sampling
from dflash_pipeline.target.placement import model_device


def first_difference(a: list[int], b: list[int]) -> int | None:
    for position, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return position
    return None if len(a) == len(b) else min(len(a), len(b))


@torch.inference_mode()
def is_near_tie(model, prompt_ids: list[int], reference: list[int], other: list[int], position: int) -> bool:
    """Whether two answers part at a near-tie of the target: its logits for the two tokens after
    the shared prefix (one plain forward) differ by at most 2 ulps of their dtype at their size.

    In bf16 a 5-token verify forward and a 1-token decode step round differently, so greedy
    decoding itself can go either way on such a tie; any wider gap is a real loss.
    """
    if position >= min(len(reference), len(other)):
        return False
    device = model_device(model)
    logits = model(input_ids=torch.tensor([prompt_ids + reference[:position]], device=device), logits_to_keep=1).logits[0, -1]
    first, second = float(logits[reference[position]]), float(logits[other[position]])
    return abs(first - second) <= 2 * torch.finfo(logits.dtype).eps * max(abs(first), abs(second), 1.0)


@dataclass(frozen=True)
class RunKey:
    """Whose runs and in which mode: one candidate drafter's name and the decoding mode it ran in.
    The key of `EndToEndPrompt`'s runs; `name` is how files name them (`DecodingMode.run_name`)."""

    candidate: str
    mode: DecodingMode = DecodingMode.chain()

    @property
    def name(self) -> str:
        return self.mode.run_name(self.candidate)


@dataclass
class EndToEndPrompt:
    prompt_id: str
    plain: DecodeRun
    speculative: dict[RunKey, DecodeRun]  # candidate and mode -> run
    near_ties: dict[RunKey, bool] = field(default_factory=dict)  # candidate and mode -> its answer parts from plain's at a near-tie


def end_to_end(model, candidates: list[tuple[str, Speculation]], prompts: list[tuple[str, list[int]]], *, max_new_tokens: int,
               eos_ids: set[int], feature_dtype: str, progress: bool = False, bf16: bool | None = None,
               sampling: Sampling | None = None) -> list[EndToEndPrompt]:
    """Plain and speculative decoding of each prompt, alternating which goes first so drift in
    machine speed (turbo, other load) falls on both sides alike. Greedy, or sampled with
    `sampling` (then the candidates' chains sample too, and prompt i's target draws come from
    the seed + i, the same stream for plain and speculative decoding). Each candidate's runs are
    keyed by its name and its speculation's mode (`RunKey`)."""
    keyed = [(RunKey(name, speculation.mode), speculation) for name, speculation in candidates]
    if len({key for key, _ in keyed}) < len(keyed):
        raise ValueError(f"two candidates of one name decode in one mode: {[key.name for key, _ in keyed]}")
    if prompts:  # warm-up: first-call allocations and kernel selection are not part of either side
        greedy_decode(model, prompts[0][1], max_new_tokens=4, eos_ids=eos_ids)
        for _, speculation in keyed:
            speculative_decode(model, speculation, prompts[0][1], max_new_tokens=4, eos_ids=eos_ids, feature_dtype=feature_dtype,
                               bf16=bf16)
    results = []
    for number, (prompt_id, prompt_ids) in enumerate(progress_iter(prompts, desc="end-to-end", unit="prompt", disable=not progress)):
        runs: dict[RunKey, DecodeRun] = {}
        plain_runs: list[DecodeRun] = []
        seeded = sampling.reseeded(sampling.seed + number) if sampling else None

        def plain():
            plain_runs.append(greedy_decode(model, prompt_ids, max_new_tokens=max_new_tokens, eos_ids=eos_ids, sampling=seeded))

        def speculative():
            for key, speculation in keyed:
                runs[key] = speculative_decode(model, speculation, prompt_ids, max_new_tokens=max_new_tokens,
                                               eos_ids=eos_ids, feature_dtype=feature_dtype, bf16=bf16, sampling=seeded)

        for part in ((plain, speculative) if number % 2 == 0 else (speculative, plain)):
            part()
        (plain_run,) = plain_runs
        near_ties = {} if sampling else {  # sampled answers part by design
            key: is_near_tie(model, prompt_ids, plain_run.tokens, run.tokens, position)
            for key, run in runs.items() if (position := first_difference(plain_run.tokens, run.tokens)) is not None}
        results.append(EndToEndPrompt(prompt_id=prompt_id, plain=plain_run, speculative=runs, near_ties=near_ties))
    return results


def summarize_end_to_end(results: list[EndToEndPrompt], key: RunKey) -> EndToEnd:
    """Lossless rate, tau per step, tokens/s, speedup, time split and break-even tau of one
    drafter in one mode (`key`).

    `speedup` and the tokens/s are end to end, prefill included on both sides (as every earlier
    record); `decode_speedup` and the decode tokens/s leave each prompt's prefill out on both
    sides alike (tokens after the first over `DecodeRun.decode_seconds`), and the mean prefill of
    each side is reported apart.

    `lossless_rate` counts prompts whose answer equals plain greedy decoding token for token; each
    other prompt is a `Mismatch` at its first differing answer token, flagged when it parts from
    plain decoding at a near-tie of the target (`is_near_tie`: rounding, not a defect).

    Break-even tau = (cost of one speculative step) / (cost of one plain decode step), both
    measured here: a drafter whose tau is below it makes decoding slower on this machine.
    """
    mismatches = []
    per_prompt_tau, plain_tokens, plain_seconds, spec_tokens, spec_seconds = [], 0, 0.0, 0, 0.0
    plain_decode_seconds, plain_decode_tokens, spec_decode_seconds, spec_decode_tokens = 0.0, 0, 0.0, 0
    steps = verify = draft = overhead = prefill = plain_prefill = 0.0
    accepted = drafted = 0
    for result in results:
        run, plain = result.speculative[key], result.plain
        difference = first_difference(run.tokens, plain.tokens)
        if difference is not None:
            mismatches.append(Mismatch(prompt_id=result.prompt_id, position=difference, near_tie=bool(result.near_ties.get(key, False))))
        per_prompt_tau.append(float(np.mean(run.steps)) if run.steps else 1.0)
        plain_tokens += len(plain.tokens)
        plain_seconds += plain.seconds
        plain_decode_seconds += plain.decode_seconds
        plain_decode_tokens += len(plain.tokens) - 1  # the first token is the prefill's
        plain_prefill += plain.prefill_seconds
        spec_tokens += len(run.tokens)
        spec_seconds += run.seconds
        spec_decode_seconds += run.decode_seconds
        spec_decode_tokens += len(run.tokens) - 1
        steps += len(run.steps)
        accepted += sum(run.steps) - len(run.steps)
        drafted += run.drafted
        verify += run.verify_seconds
        draft += run.draft_seconds
        prefill += run.prefill_seconds
        overhead += run.seconds - run.prefill_seconds - run.verify_seconds - run.draft_seconds
    tau, ci = mean_ci95(per_prompt_tau)
    decode_step = plain_decode_seconds / max(1, plain_decode_tokens)
    per_step = (verify + draft + overhead) / max(1.0, steps)
    plain_rate, spec_rate = plain_tokens / max(plain_seconds, 1e-9), spec_tokens / max(spec_seconds, 1e-9)
    plain_decode_rate = plain_decode_tokens / max(plain_decode_seconds, 1e-9)
    spec_decode_rate = spec_decode_tokens / max(spec_decode_seconds, 1e-9)
    prompts = max(1, len(results))
    spent = max(spec_seconds, 1e-9)
    return EndToEnd(
        prompts=len(results),
        tau=Interval(round(tau, 4), round(ci, 4)),
        speedup=round(spec_rate / plain_rate, 4) if plain_rate > 0 else None,
        lossless_rate=round(1.0 - len(mismatches) / max(1, len(results)), 4),
        mismatches=mismatches,
        acceptance_rate=round(accepted / max(1, drafted), 4),  # of the drafted tokens (tree nodes) verified
        plain_tokens_per_s=round(plain_rate, 2),
        spec_tokens_per_s=round(spec_rate, 2),
        decode_step_ms=round(1000 * decode_step, 3),
        verify_cost_steps=round(verify / max(1.0, steps) / decode_step, 3) if decode_step > 0 else None,
        draft_cost_steps=round(draft / max(1.0, steps) / decode_step, 3) if decode_step > 0 else None,
        break_even_tau=round(per_step / decode_step, 3) if decode_step > 0 else None,
        time=TimeSplit(prefill=round(prefill / spent, 4), verify=round(verify / spent, 4), draft=round(draft / spent, 4),
                       overhead=round(overhead / spent, 4)),
        decode_speedup=round(spec_decode_rate / plain_decode_rate, 4) if plain_decode_rate > 0 else None,
        plain_decode_tokens_per_s=round(plain_decode_rate, 2),
        spec_decode_tokens_per_s=round(spec_decode_rate, 2),
        plain_prefill_ms=round(1000 * plain_prefill / prompts, 3),
        spec_prefill_ms=round(1000 * prefill / prompts, 3),
    )
