"""The decoding engine: plain greedy and lossless speculative decoding with the real target.

    greedy_decode       the target alone over the static KV cache: the reference output and timing
    speculative_decode  draft B-1 tokens (a chain) or a DDTree of them, verify them in one target
                        forward, commit the matching prefix (the longest agreeing tree path) and
                        the target's bonus token; the output equals greedy decoding
    forward_costs       the target's forward of n new tokens, timed as a verify step runs it
    end_to_end          both on the same prompts, alternating which goes first, and
    summarize_end_to_end lossless rate, τ per step, speedup, time split and break-even τ (a typed
                        `evaluate.record.EndToEnd`)

At T = 0 speculative decoding is lossless by construction; `summarize_end_to_end` checks it token
for token against `greedy_decode` rather than trusting it.

There is one engine: `static_speculation`'s steps, kept whole on the device over static caches,
for every target transformers loads (`static_decoder`). A target it cannot serve is refused in
one line naming its model type (`speculation_engine`); nothing falls back to another loop. The
host loops it replaced live on under tests/oracles/, as the references it is tested against.
"""

from dataclasses import dataclass, field

import numpy as np
import torch

from dflash_pipeline.decoding.loop import DecodeRun, engine_name, static_plain_decode
from dflash_pipeline.speculation.sampling import Sampling
from dflash_pipeline.decoding.static_speculation import Speculation, static_forward_costs
from dflash_pipeline.measure.record import EndToEnd, Interval, Mismatch, TimeSplit
from dflash_pipeline.foundation.progress import progress_iter
from dflash_pipeline.foundation.stats import mean_ci95

# ----------------------------------------------------------------------------- decoding


def speculation_engine(model) -> str:
    """The engine that decodes with this target, as records name it (`loop.engine_name`:
    "static-kv", "static-kv-cuda-graph" on a GPU); a target it cannot serve is refused in one line."""
    return engine_name(model)


def greedy_decode(model, prompt_ids: list[int], *, max_new_tokens: int, eos_ids: set[int], sampling: Sampling | None = None,
                  on_tokens=None) -> DecodeRun:
    """Plain decoding of one prompt, greedy (or sampled with `sampling`): the reference output and
    timing. `on_tokens(list)` sees the new tokens as they are made."""
    speculation_engine(model)
    return static_plain_decode(model, prompt_ids, max_new_tokens=max_new_tokens, eos_ids=eos_ids, sampling=sampling, on_tokens=on_tokens)


def speculative_decode(model, speculation: Speculation, prompt_ids: list[int], *, max_new_tokens: int, eos_ids: set[int],
                       feature_dtype: str = "bf16", bf16: bool | None = None, sampling: Sampling | None = None,
                       on_tokens=None) -> DecodeRun:
    """Lossless speculative decoding of one prompt in `speculation`'s mode (a chain verifying
    `verify_tokens`, or a DDTree of `tree_budget` nodes; `session.DecodingSession.speculation`):
    greedy at T = 0, or a sampled chain with `sampling`, whose committed tokens are distributed
    exactly as `greedy_decode(..., sampling=...)` samples them.

    Each step drafts after the anchor (the last committed token), verifies [anchor, draft] in one
    target forward, commits the accepted prefix (the longest agreeing tree path) and the target's
    bonus token, and writes the committed positions' features (the tapped layers' outputs,
    rounded as the shards store them: `feature_dtype`) into the drafter's context cache. The
    drafter's work runs under bf16 autocast when `bf16` says so (default: on CUDA); the target
    runs in its own dtype, exactly as in `greedy_decode`. `on_tokens(list)` sees committed tokens.
    """
    speculation_engine(model)
    return speculation.decode(model, prompt_ids, max_new_tokens=max_new_tokens, eos_ids=eos_ids, feature_dtype=feature_dtype, bf16=bf16,
                              sampling=sampling, on_tokens=on_tokens)


def forward_costs(model, prompt_ids: list[int], lengths: list[int], *, repeats: int = 5) -> dict[int, float]:
    """Median seconds of one target forward of n new tokens (with the argmax of each position's
    logits, as a verify step takes it) after the KV cache of `prompt_ids`, for each n in `lengths`,
    on the static cache; the lengths take turns, so drift in machine speed falls on all alike."""
    speculation_engine(model)
    return static_forward_costs(model, prompt_ids, lengths, repeats=repeats)


def choose_verify_tokens(conditional_acceptance: list[float], verify_steps: dict[int, float], draft_steps: float) -> tuple[int, list[float]]:
    """The number k of drafted tokens to verify per step (1..B-1) that commits the most tokens per
    unit of time, and that rate for every k: (1 + sum_{j<=k} prod_{i<=j} a_i) / (verify_steps[k+1] + draft_steps),
    with a_i the drafter's conditional acceptance of slot i (teacher-forced) and the costs of a
    (k+1)-token verify forward and of drafting in decode steps, measured on this machine."""
    rates, reach, expected = [], 1.0, 1.0
    for k, acceptance in enumerate(conditional_acceptance, start=1):
        reach *= acceptance if acceptance == acceptance else 0.0  # nan: the slot never reached
        expected += reach
        rates.append(expected / (verify_steps[k + 1] + draft_steps))
    return int(np.argmax(rates)) + 1, rates


@dataclass
class VerifyPlan:
    """How many drafted tokens a chain step verifies, and the measurements behind the choice."""

    tokens: int
    forward_cost_steps: dict[int, float]  # target forward of n new tokens, in decode steps
    draft_cost_steps: float  # one drafting step, in decode steps
    expected_rates: list[float]  # expected committed tokens per unit of cost for k = 1..B-1

    def as_dict(self) -> dict:
        return {"verify_tokens": self.tokens, "forward_cost_steps": [round(self.forward_cost_steps[n], 3) for n in sorted(self.forward_cost_steps)],
                "expected_tokens_per_step_cost": [round(r, 4) for r in self.expected_rates]}


def measure_forward_costs(model, prompt_ids: list[int], longest: int) -> dict[int, float]:
    """The target's forward of 1..longest new tokens on this machine, in decode steps (`forward_costs`)."""
    seconds = forward_costs(model, prompt_ids, list(range(1, longest + 1)))
    return {n: value / seconds[1] for n, value in seconds.items()}


def plan_verify_tokens(model, speculation: Speculation, prompt_ids: list[int], conditional_acceptance: list[float], *,
                       eos_ids: set[int], feature_dtype: str, costs: dict[int, float]) -> VerifyPlan:
    """The verify length that pays best for this drafter here: its drafting cost from a 16-token
    trial decode of `prompt_ids`, the target's `costs` (`measure_forward_costs`) and its
    teacher-forced conditional acceptance per slot, through `choose_verify_tokens`."""
    trial = speculative_decode(model, speculation, prompt_ids, max_new_tokens=16, eos_ids=eos_ids, feature_dtype=feature_dtype)
    decode_step = forward_costs(model, prompt_ids, [1], repeats=3)[1]
    draft_steps = trial.draft_seconds / max(1, len(trial.steps)) / decode_step
    tokens, rates = choose_verify_tokens(conditional_acceptance, costs, draft_steps)
    return VerifyPlan(tokens=tokens, forward_cost_steps=costs, draft_cost_steps=draft_steps, expected_rates=rates)


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
    device = next(model.parameters()).device
    logits = model(input_ids=torch.tensor([prompt_ids + reference[:position]], device=device), logits_to_keep=1).logits[0, -1]
    first, second = float(logits[reference[position]]), float(logits[other[position]])
    return abs(first - second) <= 2 * torch.finfo(logits.dtype).eps * max(abs(first), abs(second), 1.0)


@dataclass
class EndToEndPrompt:
    prompt_id: str
    plain: DecodeRun
    speculative: dict[str, DecodeRun]  # candidate name -> run
    near_ties: dict[str, bool] = field(default_factory=dict)  # candidate name -> its answer parts from plain's at a near-tie


def end_to_end(model, candidates: list[tuple[str, Speculation]], prompts: list[tuple[str, list[int]]], *, max_new_tokens: int,
               eos_ids: set[int], feature_dtype: str, progress: bool = False, bf16: bool | None = None,
               sampling: Sampling | None = None) -> list[EndToEndPrompt]:
    """Plain and speculative decoding of each prompt, alternating which goes first so drift in
    machine speed (turbo, other load) falls on both sides alike. Greedy, or sampled with
    `sampling` (then the candidates' chains sample too, and prompt i's target draws come from
    the seed + i, the same stream for plain and speculative decoding)."""
    if prompts:  # warm-up: first-call allocations and kernel selection are not part of either side
        greedy_decode(model, prompts[0][1], max_new_tokens=4, eos_ids=eos_ids)
        for _, speculation in candidates:
            speculative_decode(model, speculation, prompts[0][1], max_new_tokens=4, eos_ids=eos_ids, feature_dtype=feature_dtype,
                               bf16=bf16)
    results = []
    for number, (prompt_id, prompt_ids) in enumerate(progress_iter(prompts, desc="end-to-end", unit="prompt", disable=not progress)):
        runs: dict[str, DecodeRun] = {}
        seeded = sampling.reseeded(sampling.seed + number) if sampling else None

        def plain():
            runs["__plain__"] = greedy_decode(model, prompt_ids, max_new_tokens=max_new_tokens, eos_ids=eos_ids, sampling=seeded)

        def speculative():
            for name, speculation in candidates:
                runs[name] = speculative_decode(model, speculation, prompt_ids, max_new_tokens=max_new_tokens,
                                                eos_ids=eos_ids, feature_dtype=feature_dtype, bf16=bf16, sampling=seeded)

        for part in ((plain, speculative) if number % 2 == 0 else (speculative, plain)):
            part()
        plain_run = runs.pop("__plain__")
        near_ties = {} if sampling else {  # sampled answers part by design
            name: is_near_tie(model, prompt_ids, plain_run.tokens, run.tokens, position)
            for name, run in runs.items() if (position := first_difference(plain_run.tokens, run.tokens)) is not None}
        results.append(EndToEndPrompt(prompt_id=prompt_id, plain=plain_run, speculative=runs, near_ties=near_ties))
    return results


def summarize_end_to_end(results: list[EndToEndPrompt], name: str) -> EndToEnd:
    """Lossless rate, tau per step, tokens/s, speedup, time split and break-even tau of one drafter.

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
        run, plain = result.speculative[name], result.plain
        difference = first_difference(run.tokens, plain.tokens)
        if difference is not None:
            mismatches.append(Mismatch(prompt_id=result.prompt_id, position=difference, near_tie=bool(result.near_ties.get(name, False))))
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
