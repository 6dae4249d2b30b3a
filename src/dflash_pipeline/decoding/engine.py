"""The decoding engine: plain greedy and lossless speculative decoding with the real target.

    greedy_decode       the target alone, with its KV cache: the reference output and timing
    speculative_decode  draft B-1 tokens (a chain) or a DDTree of them, verify them in one target
                        forward, commit the matching prefix (the longest agreeing tree path) and
                        the target's bonus token; the output equals greedy decoding
    verify_tree         one forward over every node of a draft tree under the tree mask, the
                        target's KV cache kept to exactly the accepted path
    end_to_end          both on the same prompts, alternating which goes first, and
    summarize_end_to_end lossless rate, τ per step, speedup, time split and break-even τ (a typed
                        `evaluate.record.EndToEnd`)

At T = 0 speculative decoding is lossless by construction; `summarize_end_to_end` checks it token
for token against `greedy_decode` rather than trusting it.

Every transformers target decodes on `static_speculation`'s steps, kept whole on the device over
static caches (`speculation_engine`). The host loops here (`host_greedy_decode`,
`host_speculative_decode`, over transformers' forward and DynamicCache) serve only stand-ins that
are no transformers model and any `propose` that is not a session's: the references the static
steps are tested against. On the CPU both give the same answers and the same steps.
"""

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from dflash_pipeline.devices import autocast, synchronize, timed
from dflash_pipeline.drafters.core import DFlashDrafter, DraftCache, Proposal
from dflash_pipeline.evaluate.record import EndToEnd, Interval, Mismatch, TimeSplit
from dflash_pipeline.progress import progress_iter
from dflash_pipeline.decoding.sampling import Sampling, draw, verify_chain
from dflash_pipeline.decoding.static_speculation import DecodeRun, StaticSpeculation, static_forward_costs, static_plain_decode
from dflash_pipeline.decoding.static_speculation import stored_features as as_stored
from dflash_pipeline.decoding.static_decoder import cache_argument
from dflash_pipeline.stats import mean_ci95
from dflash_pipeline.target.load import TargetHead
from dflash_pipeline.decoding.trees import DraftTree, tree_attention_mask, tree_positions

# ----------------------------------------------------------------------------- decoding


def _crop(cache, length: int) -> None:
    """Keep the first `length` positions of a transformers KV cache."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


STATIC_ENGINE = "static-kv"  # `static_speculation`: static KV, whole steps on the device
HOST_ENGINE = "transformers-dynamic-cache"  # this module's loops over transformers' forward


def speculation_engine(model) -> str:
    """The loop that decodes one prompt at a time with this target (evaluate's end-to-end runs,
    its plain baseline, the `generate` command): the static step for every transformers target;
    one it cannot serve is refused in one line (`static_decoder.check_servable`), never sent down
    another path. Only a stand-in that is no transformers model (a test's scripted target) takes
    the host loops here. Plain and speculative decoding always take the same one, so a speedup
    never compares two kernel paths."""
    from dflash_pipeline.decoding.static_decoder import check_servable

    if getattr(model, "config", None) is None or not callable(getattr(model, "get_decoder", None)):
        return HOST_ENGINE
    check_servable(model)
    return STATIC_ENGINE


def greedy_decode(model, prompt_ids: list[int], *, max_new_tokens: int, eos_ids: set[int], sampling: Sampling | None = None,
                  on_tokens=None, engine: str | None = None) -> DecodeRun:
    """Plain decoding of one prompt, greedy (or sampled with `sampling`): the reference output and
    timing, on `engine` (default: `speculation_engine(model)`). `on_tokens(list)` sees the new
    tokens as they are made."""
    if (engine or speculation_engine(model)) == STATIC_ENGINE:
        return static_plain_decode(model, prompt_ids, max_new_tokens=max_new_tokens, eos_ids=eos_ids, sampling=sampling, on_tokens=on_tokens)
    return host_greedy_decode(model, prompt_ids, max_new_tokens=max_new_tokens, eos_ids=eos_ids, sampling=sampling, on_tokens=on_tokens)


@torch.inference_mode()
def host_greedy_decode(model, prompt_ids: list[int], *, max_new_tokens: int, eos_ids: set[int], sampling: Sampling | None = None,
                       on_tokens=None) -> DecodeRun:
    """Plain decoding with transformers' forward and a DynamicCache, any target: one token and one
    read back per step."""
    from transformers import DynamicCache

    device = next(model.parameters()).device
    generator = sampling.generator() if sampling else None

    def next_token(logits) -> int:
        return int(logits.argmax()) if sampling is None else draw(sampling.probs(logits), generator)

    cache = DynamicCache(config=model.config)
    synchronize(device)
    started = time.perf_counter()
    out = model(input_ids=torch.tensor([prompt_ids], device=device), **cache_argument(model, cache), use_cache=True, logits_to_keep=1)
    token = next_token(out.logits[0, -1])
    synchronize(device)
    prefilled = time.perf_counter()
    tokens, position = [token], len(prompt_ids)
    if on_tokens:
        on_tokens([token])
    while token not in eos_ids and len(tokens) < max_new_tokens:
        out = model(input_ids=torch.tensor([[token]], device=device), position_ids=torch.tensor([[position]], device=device),
                    **cache_argument(model, cache), use_cache=True)
        token = next_token(out.logits[0, -1])
        tokens.append(token)
        position += 1
        if on_tokens:
            on_tokens([token])
    synchronize(device)
    return DecodeRun(tokens=tokens, seconds=time.perf_counter() - started, prefill_seconds=prefilled - started)


def drafter_proposer(drafter: DFlashDrafter, head: TargetHead, sampling: Sampling | None = None):
    """The proposal function of a drafter's chains, as its architecture drafts them
    (`Architecture.chain_proposer`): greedy at T = 0, and under the sampling rule otherwise, with
    the drafter's own random stream."""
    generator = sampling.generator(offset=1) if sampling else None  # the drafter's own stream
    return drafter.architecture.chain_proposer(drafter, head, sampling, generator)


def tree_proposer(drafter: DFlashDrafter, head: TargetHead, budget: int):
    """The proposal function of tree decoding (T = 0): the DDTree of the `budget` most probable
    drafted prefixes of the block, as the drafter's architecture builds it (`Architecture.tree_proposer`)."""
    return drafter.architecture.tree_proposer(drafter, head, budget)


def keep_path(cache, start: int, path: list[int]) -> None:
    """After a tree verify forward: of the cache entries from `start` (node 0 onward), keep the
    accepted path's nodes, in order, and drop the rest (siblings, rejected branches)."""
    if path != list(range(len(path))):  # a prefix of the node order is already in place
        for layer in cache.layers:
            if getattr(layer, "is_sliding", False):
                raise ValueError("tree verification needs a full-attention KV cache (this target has sliding-window layers)")
            index = torch.tensor([start + node for node in path], device=layer.keys.device)
            layer.keys[..., start : start + len(path), :] = layer.keys[..., index, :]  # the gather copies first: overlap is safe
            layer.values[..., start : start + len(path), :] = layer.values[..., index, :]
    _crop(cache, start + len(path))


def verify_tree(model, cache, tree: DraftTree, anchor: int, position: int) -> tuple[list[int], int]:
    """Verify every node of `tree` in ONE target forward: input [anchor, nodes...], each node at
    position anchor + depth + 1, under `trees.tree_attention_mask` (a node sees the cache, the
    anchor and its ancestors only). Walks the target's argmax from the anchor down the tree and
    returns (accepted nodes, the target's bonus token). The cache (`position` entries before the
    call, the anchor at `position`) then holds exactly the prefix, the anchor and the accepted path.
    """
    parameter = next(model.parameters())
    out = model(input_ids=torch.tensor([[anchor] + tree.tokens], device=parameter.device),
                position_ids=torch.tensor([tree_positions(tree, position)], device=parameter.device),
                attention_mask=tree_attention_mask(tree, position, parameter.dtype, parameter.device), **cache_argument(model, cache), use_cache=True)
    choice = out.logits[0].argmax(-1).tolist()  # the target's token after the anchor (0) and after each node (1 + node)
    path, bonus = tree.walk(lambda node: choice[node + 1])
    keep_path(cache, position + 1, path)
    return path, bonus


def speculative_decode(model, tap, drafter: DFlashDrafter, propose, prompt_ids: list[int], *, max_new_tokens: int, eos_ids: set[int],
                       feature_dtype: str = "bf16", bf16: bool | None = None, sampling: Sampling | None = None,
                       on_tokens=None) -> DecodeRun:
    """Lossless speculative decoding of one prompt: greedy at T = 0, or sampled with `sampling`.

    Loop: the drafter proposes (a `Proposal`) up to B-1 tokens after the anchor (the last committed
    token; fewer when `propose` is cut to a shorter verify length, `verified_prefix`), or a
    `DraftTree` (`tree_proposer`); the target verifies [anchor, proposal] in one forward (`verify_tree` for a
    tree); the matching prefix (the longest agreeing tree path) plus the target's own next
    token (the bonus) are committed; the target KV cache is cropped to the committed length and
    the drafter's context cache is extended with the committed positions' features only.
    `tap` is the capture stage's LayerTap on `model`, so features come from the same layers as
    the shards. `propose(cache, anchor) -> Proposal` is the drafter (replaceable in tests).
    The drafter's work runs under bf16 autocast when `bf16` says so (default: on CUDA); the target
    runs in its own dtype, exactly as in `greedy_decode`.

    With `sampling` (T > 0), `propose` is `drafter_proposer(..., sampling)` (q with the tokens) and
    each step is verified by `sampling.verify_chain` under `sampling.rule`: the committed tokens are
    distributed exactly as `greedy_decode(..., sampling=...)` samples them. `on_tokens(list)` sees
    each step's committed tokens (streaming).

    A proposer of `session.DecodingSession.proposer` carries its mode (`propose.static`, a
    `static_speculation.StaticSpeculation`): on the static engine (`speculation_engine`) that
    decodes instead, with the same answers at T = 0 and the same steps. Any other `propose`
    runs this host loop.
    """
    static = getattr(propose, "static", None)
    if static is not None and speculation_engine(model) == STATIC_ENGINE:
        return static.decode(model, prompt_ids, max_new_tokens=max_new_tokens, eos_ids=eos_ids, feature_dtype=feature_dtype, bf16=bf16,
                             sampling=sampling, on_tokens=on_tokens)
    return host_speculative_decode(model, tap, drafter, propose, prompt_ids, max_new_tokens=max_new_tokens, eos_ids=eos_ids,
                                   feature_dtype=feature_dtype, bf16=bf16, sampling=sampling, on_tokens=on_tokens)


@torch.inference_mode()
def host_speculative_decode(model, tap, drafter: DFlashDrafter, propose, prompt_ids: list[int], *, max_new_tokens: int, eos_ids: set[int],
                            feature_dtype: str = "bf16", bf16: bool | None = None, sampling: Sampling | None = None,
                            on_tokens=None) -> DecodeRun:
    """`speculative_decode`'s loop on the host: transformers' forward and DynamicCache, the
    proposal, acceptance and caches handled step by step in Python (any target, any `propose`)."""
    from transformers import DynamicCache

    device = next(model.parameters()).device
    cache, draft_cache = DynamicCache(config=model.config), DraftCache(drafter)
    synchronize(device)
    started = time.perf_counter()
    generator = sampling.generator() if sampling else None
    out = model(input_ids=torch.tensor([prompt_ids], device=device), **cache_argument(model, cache), use_cache=True, logits_to_keep=1)
    anchor = int(out.logits[0, -1].argmax()) if sampling is None else draw(sampling.probs(out.logits[0, -1]), generator)
    with autocast(device, bf16):
        draft_cache.extend(as_stored(tap.features()[0], feature_dtype).to(drafter.fc.weight.device))
    synchronize(device)
    run = DecodeRun(tokens=[anchor], seconds=0.0, prefill_seconds=time.perf_counter() - started)
    if on_tokens:
        on_tokens([anchor])
    position = len(prompt_ids)  # where the anchor sits
    finished = anchor in eos_ids or len(run.tokens) >= max_new_tokens
    while not finished:
        began = time.perf_counter()
        with autocast(device, bf16):
            proposal = propose(draft_cache, anchor)
        synchronize(device)
        drafted = time.perf_counter()
        if proposal.tree is not None:
            if sampling is not None:
                raise ValueError("tree verification is lossless at T = 0 only: sample with a chain")
            path, bonus = verify_tree(model, cache, proposal.tree, anchor, position)
            accepted_tokens, feature_rows = [proposal.tokens[node] for node in path], [0] + [1 + node for node in path]
        else:
            accepted, bonus = verify_chain_step(model, cache, proposal, anchor, position, sampling, generator)
            accepted_tokens, feature_rows = proposal.tokens[:accepted], list(range(accepted + 1))
        accepted = len(accepted_tokens)
        run.drafted += len(proposal.tokens)
        synchronize(device)
        verified = time.perf_counter()
        with autocast(device, bf16):
            features = tap.features()[0]
            rows = torch.tensor(feature_rows, device=features.device)
            draft_cache.extend(as_stored(features.index_select(0, rows), feature_dtype).to(drafter.fc.weight.device))
        synchronize(device)
        extended = time.perf_counter()
        committed = accepted_tokens + [bonus]
        kept = []
        for token in committed:
            kept.append(token)
            # An EOS accepted inside the block ends the answer even though the block goes on.
            if token in eos_ids or len(run.tokens) + len(kept) >= max_new_tokens:
                finished = True
                break
        run.tokens += kept
        if on_tokens:
            on_tokens(kept)
        run.steps.append(accepted + 1)
        position += accepted + 1
        anchor = committed[-1]
        run.verify_seconds += verified - drafted
        run.draft_seconds += (drafted - began) + (extended - verified)  # proposing + extending the context cache
    synchronize(device)
    run.seconds = time.perf_counter() - started
    return run


def verify_chain_step(model, cache, proposal: Proposal, anchor: int, position: int, sampling: Sampling | None,
                      generator) -> tuple[int, int]:
    """Verify a drafted chain in one target forward over [anchor, tokens...] (the anchor at
    `position`): the longest prefix the target's argmax agrees with at T = 0, or the lossless rule
    of `sampling` (`sampling.verify_chain`). Returns (accepted tokens, the target's bonus token);
    the cache then holds the prefix, the anchor and the accepted tokens."""
    tokens = proposal.tokens
    device = next(model.parameters()).device
    out = model(input_ids=torch.tensor([[anchor] + tokens], device=device),
                position_ids=torch.arange(position, position + len(tokens) + 1, device=device)[None], **cache_argument(model, cache), use_cache=True)
    if sampling is None:
        choice = out.logits[0].argmax(-1).tolist()  # the target's token after each verified position
        accepted = 0
        while accepted < len(tokens) and tokens[accepted] == choice[accepted]:
            accepted += 1
        bonus = choice[accepted]
    else:
        accepted, bonus = verify_chain(sampling.probs(out.logits[0]), tokens, proposal.q, rule=sampling.rule, generator=generator)
    _crop(cache, position + accepted + 1)
    return accepted, bonus


def verified_prefix(propose, tokens: int):
    """`propose` cut to its first `tokens` drafted tokens: the target then verifies tokens + 1
    positions per step. Lossless at any length; which length pays best is `choose_verify_tokens`'s."""

    def shorter(cache: DraftCache, anchor: int):
        proposal = propose(cache, anchor)
        return Proposal(proposal.tokens[:tokens], None if proposal.q is None else proposal.q[:tokens])

    return shorter


def forward_costs(model, prompt_ids: list[int], lengths: list[int], *, repeats: int = 5) -> dict[int, float]:
    """Median seconds of one target forward of n new tokens (with the argmax of each position's
    logits, as a verify step takes it) after the KV cache of `prompt_ids`, for each n in `lengths`,
    on the engine that decodes (`speculation_engine`); the lengths take turns, so drift in machine
    speed falls on all alike."""
    if speculation_engine(model) == STATIC_ENGINE:
        return static_forward_costs(model, prompt_ids, lengths, repeats=repeats)
    return host_forward_costs(model, prompt_ids, lengths, repeats=repeats)


@torch.inference_mode()
def host_forward_costs(model, prompt_ids: list[int], lengths: list[int], *, repeats: int = 5) -> dict[int, float]:
    """`forward_costs` with transformers' forward, cropping the DynamicCache back after each
    forward (on CUDA a cuDNN plan cache can then hit where a real decode misses)."""
    from transformers import DynamicCache

    device = next(model.parameters()).device
    cache = DynamicCache(config=model.config)
    model(input_ids=torch.tensor([prompt_ids], device=device), **cache_argument(model, cache), use_cache=True, logits_to_keep=1)
    start = len(prompt_ids)
    samples = {n: [] for n in lengths}
    for repeat in range(repeats + 1):  # the first round warms up
        for n in lengths:
            ids = torch.tensor([prompt_ids[-n:]], device=device)
            positions = torch.arange(start, start + n, device=device)[None]
            _, seconds = timed(lambda: model(input_ids=ids, position_ids=positions, **cache_argument(model, cache), use_cache=True).logits[0].argmax(-1).tolist(),
                               device)
            _crop(cache, start)
            if repeat:
                samples[n].append(seconds)
    return {n: float(np.median(values)) for n, values in samples.items()}


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


def plan_verify_tokens(model, tap, drafter: DFlashDrafter, propose, prompt_ids: list[int], conditional_acceptance: list[float], *,
                       eos_ids: set[int], feature_dtype: str, costs: dict[int, float]) -> VerifyPlan:
    """The verify length that pays best for this drafter here: its drafting cost from a 16-token
    trial decode of `prompt_ids`, the target's `costs` (`measure_forward_costs`) and its
    teacher-forced conditional acceptance per slot, through `choose_verify_tokens`."""
    trial = speculative_decode(model, tap, drafter, propose, prompt_ids, max_new_tokens=16, eos_ids=eos_ids, feature_dtype=feature_dtype)
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


def end_to_end(model, tap, candidates: list[tuple[str, DFlashDrafter, object]], prompts: list[tuple[str, list[int]]], *, max_new_tokens: int,
               eos_ids: set[int], feature_dtype: str, progress: bool = False, bf16: bool | None = None,
               sampling: Sampling | None = None) -> list[EndToEndPrompt]:
    """Plain and speculative decoding of each prompt, alternating which goes first so drift in
    machine speed (turbo, other load) falls on both sides alike. Greedy, or sampled with
    `sampling` (then the candidates' proposers sample too, and prompt i's target draws come from
    the seed + i, the same stream for plain and speculative decoding)."""
    if prompts:  # warm-up: first-call allocations and kernel selection are not part of either side
        greedy_decode(model, prompts[0][1], max_new_tokens=4, eos_ids=eos_ids)
        for _, drafter, propose in candidates:
            speculative_decode(model, tap, drafter, propose, prompts[0][1], max_new_tokens=4, eos_ids=eos_ids, feature_dtype=feature_dtype,
                               bf16=bf16)
    results = []
    for number, (prompt_id, prompt_ids) in enumerate(progress_iter(prompts, desc="end-to-end", unit="prompt", disable=not progress)):
        runs: dict[str, DecodeRun] = {}
        seeded = sampling.reseeded(sampling.seed + number) if sampling else None

        def plain():
            runs["__plain__"] = greedy_decode(model, prompt_ids, max_new_tokens=max_new_tokens, eos_ids=eos_ids, sampling=seeded)

        def speculative():
            for name, drafter, propose in candidates:
                runs[name] = speculative_decode(model, tap, drafter, propose, prompt_ids, max_new_tokens=max_new_tokens,
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

    `lossless_rate` counts prompts whose answer equals plain greedy decoding token for token; each
    other prompt is a `Mismatch` at its first differing answer token, flagged when it parts from
    plain decoding at a near-tie of the target (`is_near_tie`: rounding, not a defect).

    Break-even tau = (cost of one speculative step) / (cost of one plain decode step), both
    measured here: a drafter whose tau is below it makes decoding slower on this machine.
    """
    mismatches = []
    per_prompt_tau, plain_tokens, plain_seconds, spec_tokens, spec_seconds = [], 0, 0.0, 0, 0.0
    plain_decode_seconds, plain_decode_tokens = 0.0, 0
    steps = verify = draft = overhead = prefill = 0.0
    accepted = drafted = 0
    for result in results:
        run, plain = result.speculative[name], result.plain
        difference = first_difference(run.tokens, plain.tokens)
        if difference is not None:
            mismatches.append(Mismatch(prompt_id=result.prompt_id, position=difference, near_tie=bool(result.near_ties.get(name, False))))
        per_prompt_tau.append(float(np.mean(run.steps)) if run.steps else 1.0)
        plain_tokens += len(plain.tokens)
        plain_seconds += plain.seconds
        plain_decode_seconds += plain.seconds - plain.prefill_seconds
        plain_decode_tokens += len(plain.tokens) - 1
        spec_tokens += len(run.tokens)
        spec_seconds += run.seconds
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
    )
