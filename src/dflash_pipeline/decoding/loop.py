"""The engine's loop and its plain step: what every decode on the static cache runs through.

    DecodeStep         the contract of what the loop drives: a prefill, fixed-shape phases, one
                       read of (ended, tokens made) between steps, the answer read at the end
    PlainStep          the target alone over the static cache (`static_decoder.StaticDecoder`),
                       one row (evaluate's baseline, the CLI) or a left-padded batch (the
                       generate stage), one token per live row per step, greedy or sampled
    run_steps          the one loop, for the plain step and `static_speculation.SpeculativeStep`
                       alike: the host reads (ended, tokens made) once every `read_every` steps
                       (`devices.READ_EVERY` on a GPU, every step on a CPU), each phase replayed
                       through the one CUDA-graph runner (`graphs.PhaseRunner`)
    cached_step, run_prompt  a step kept per owner and reused across prompts, and one prompt on it

It imports nothing of the drafters, so the generate stage, which decodes with the target alone,
does not go stale when drafter code changes. Outside code decodes through `plain` and `session`.
"""

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from dflash_pipeline.decoding.graphs import PhaseRunner
from dflash_pipeline.speculation.sampling import Sampling, draw_with_uniforms, sampling_probs
from dflash_pipeline.decoding.static_decoder import StaticDecoder
from dflash_pipeline.foundation.devices import default_read_every, synchronize
from dflash_pipeline.target.placement import is_split, model_device


@dataclass
class DecodeRun:
    """One prompt decoded: its answer, times, and each speculative step's size (either loop's).
    `seconds` is the whole prompt, prefill included; `prefill_seconds` the prefill alone (which
    also makes the first answer token); `decode_seconds` the rest."""

    tokens: list[int]
    seconds: float
    prefill_seconds: float
    steps: list[int] = field(default_factory=list)  # tau of each speculative step (accepted + bonus)
    verify_seconds: float = 0.0
    draft_seconds: float = 0.0
    drafted: int = 0  # drafted tokens verified (chain tokens or tree nodes), over all steps

    @property
    def decode_seconds(self) -> float:
        """The steps after the prefill, their reads and the answer's read: what makes every answer
        token but the first."""
        return self.seconds - self.prefill_seconds


@dataclass
class StepRecord:
    """What the host reads after a decode: the answer and each step's size."""

    tokens: list[int]
    steps: list[int]  # tokens committed by each step (accepted + bonus)
    drafted: int  # drafted tokens (chain tokens or real tree nodes) verified, over all steps


@runtime_checkable
class DecodeStep(Protocol):
    """What `run_steps`, `cached_step` and `run_prompt` drive: `PlainStep` and
    `static_speculation.SpeculativeStep`. Its state lives in preallocated device tensors; the host
    touches it only through `prefill`, `read_state`, `answer_tokens` and `record`, never inside a
    phase (no read back, no shape that varies from step to step), so each phase can be replayed as
    a CUDA graph (`graphs.PhaseRunner`)."""

    device: torch.device
    split: bool  # the target is split over devices: its phases are never captured as graphs
    capacity: int  # the longest prompt it holds
    answer_capacity: int  # the longest answer it holds
    max_new_tokens: int  # this prompt's cap (at most `answer_capacity`), set by `prefill`
    eos_set: set[int]
    sampling: Sampling | None  # None: greedy
    uniforms: torch.Tensor  # a sampled step's randomness, refilled from `generator` before each step
    generator: torch.Generator | None

    def prefill(self, prompt_ids: list[int], generator: torch.Generator | None = None, max_new_tokens: int | None = None) -> None:
        """Start a prompt: its cache, the first answer token, fresh counters."""

    def phases(self) -> Sequence[Callable[[], None]]:
        """One step's phases, in order: each reads and writes only the step's own tensors."""

    def graph_state(self) -> list[torch.Tensor]:
        """The counters a warm-up run of the phases moves that the next prefill would not put back."""

    def read_state(self) -> tuple[bool, int]:
        """(the answer has ended, the tokens it has made): the one read between steps."""

    def answer_tokens(self, start: int, stop: int) -> list[int]:
        """Answer tokens start..stop (what streaming shows)."""

    def record(self) -> StepRecord:
        """The answer and each step's size, read once after the last step."""


class PlainStep:
    """The target alone over the static cache, for a batch of rows: evaluate's plain decoding
    baseline and the CLI (one row) and the generate stage (a left-padded batch of prompts), one
    token per live row per step, greedy or sampled under `sampling`.

    Per prompt (full size, indexed by `rows`): the answer buffer, the tokens made and the end flag.
    Per batch row: the prompt it answers (`rows`) and the token it steps on. On a GPU the rows
    never change (one shape, one captured graph); on a CPU the rows that ended can leave the batch
    (`keep_live_rows`), since a CPU step costs in proportion to its rows.
    """

    def __init__(self, model, *, batch: int = 1, capacity: int, max_new_tokens: int, eos_ids: set[int], sampling: Sampling | None = None):
        self.model = model
        self.device = device = model_device(model)
        self.split = is_split(model)  # never captured as CUDA graphs (`target.placement`)
        self.sampling = sampling
        self.capacity = capacity
        self.answer_capacity = self.max_new_tokens = max_new_tokens
        self.target = StaticDecoder(model, batch=batch, length=capacity + max_new_tokens + 2)
        self.eos_set = set(eos_ids)
        self.eos = torch.tensor(sorted(eos_ids) or [-1], dtype=torch.long, device=device)
        self.limit = torch.full((), max_new_tokens, dtype=torch.long, device=device)
        self.answer = torch.zeros(batch, max_new_tokens + 1, dtype=torch.long, device=device)  # the last column: where ended rows write
        self.count = torch.zeros(batch, dtype=torch.long, device=device)  # answer tokens made, per prompt
        self.ended = torch.zeros(batch, dtype=torch.bool, device=device)  # per prompt
        self.rows = torch.arange(batch, device=device)  # the prompt each batch row answers
        self.token = torch.zeros(batch, dtype=torch.long, device=device)  # what each batch row steps on
        self.uniforms = torch.zeros(batch, device=device)
        self.generator = None  # a sampled decode's device generator (`run_prompt` seeds it)

    @torch.no_grad()
    def prefill(self, prompt_ids: list[int], generator: torch.Generator | None = None, max_new_tokens: int | None = None) -> None:
        """One prompt (a batch of one row)."""
        if len(prompt_ids) > self.capacity:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens is longer than this step's capacity {self.capacity}")
        ids = torch.tensor([prompt_ids], device=self.device)
        self.prefill_rows(ids, torch.ones_like(ids, dtype=torch.bool), generator, max_new_tokens)

    @torch.no_grad()
    def prefill_rows(self, input_ids: torch.Tensor, valid: torch.Tensor, generator: torch.Generator | None = None,
                     max_new_tokens: int | None = None) -> None:
        """Left-padded prompts [B, W] with their real-token mask: their KV, the first answer token of
        each, fresh counters. `max_new_tokens`: this batch's cap, up to the step's capacity."""
        max_new_tokens = max_new_tokens or self.answer_capacity
        if input_ids.shape[0] != self.rows.shape[0] or self.target.batch != self.answer.shape[0]:
            raise ValueError(f"{input_ids.shape[0]} prompts for a step of {self.answer.shape[0]} rows ({self.rows.shape[0]} still in the batch)")
        if max_new_tokens > self.answer_capacity:
            raise ValueError(f"max_new_tokens {max_new_tokens} exceeds this step's answer capacity {self.answer_capacity}")
        self.max_new_tokens = max_new_tokens
        self.limit.fill_(max_new_tokens)
        logits = self.target.prefill(input_ids, valid)
        if self.sampling is not None:
            self.uniforms.uniform_(generator=generator)
        first = self._next(logits)
        self.answer.zero_()
        self.answer[:, 0] = first
        self.count.fill_(1)
        self.ended.copy_(torch.isin(first, self.eos) | (self.limit <= 1))
        self.token.copy_(first)

    def _next(self, logits: torch.Tensor) -> torch.Tensor:
        if self.sampling is None:
            return logits.argmax(-1)
        sampling = self.sampling
        probs = sampling_probs(logits, sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p)
        return draw_with_uniforms(probs, self.uniforms)

    def step(self) -> None:
        with torch.no_grad():
            made = self._next(self.target.step(self.token))
            rows = self.rows
            live = ~self.ended.gather(0, rows)
            count = self.count.gather(0, rows)
            spot = torch.where(live, count, self.answer.shape[1] - 1)
            self.answer.index_put_((rows, spot), made)
            count = count + live
            self.count.index_copy_(0, rows, count)
            self.ended.index_copy_(0, rows, ~live | torch.isin(made, self.eos) | (count >= self.limit))
            self.token.copy_(torch.where(live, made, self.token))

    def phases(self):
        return (self.step,)

    def graph_state(self) -> list[torch.Tensor]:
        """What a warm-up step moves that the next prefill would not put back."""
        return [self.target.valid, self.target.positions, self.target.column]

    def read_state(self) -> tuple[bool, int]:
        """(every prompt ended, the most tokens a prompt has made): the one read between steps,
        which also brings the answer tokens made and the prompts ended so far (`tokens_made`,
        `prompts_ended`) and which batch rows are live (`keep_live_rows`). Live rows step
        together, so they have all made that many."""
        figures = torch.cat([torch.stack([self.ended.all().long(), self.count.max(), self.count.sum(), self.ended.sum()]),
                             (~self.ended.gather(0, self.rows)).long()]).tolist()
        ended, made, self.tokens_made, self.prompts_ended = figures[:4]
        self.live = figures[4:]
        return bool(ended), made

    def keep_live_rows(self) -> None:
        """The rows whose prompt had not ended at the last read, only (on a CPU: a smaller batch,
        new tensors)."""
        if all(self.live) or not any(self.live):  # no row to drop, or no step to come
            return
        keep = torch.tensor([row for row, live in enumerate(self.live) if live], device=self.device)
        self.target.keep_rows(keep)
        self.rows, self.token, self.uniforms = self.rows[keep], self.token[keep], self.uniforms[keep]

    def answers(self) -> list[tuple[list[int], bool]]:
        """Each prompt's answer, cut after its first EOS, and whether it stopped at one (one read)."""
        values = torch.cat([self.count[:, None], self.answer[:, :-1]], dim=1).tolist()
        result = []
        for count, *row in values:
            answer = row[: min(count, self.max_new_tokens)]
            stop = next((i for i, token in enumerate(answer) if token in self.eos_set), None)
            result.append((answer if stop is None else answer[: stop + 1], stop is not None))
        return result

    def answer_tokens(self, start: int, stop: int) -> list[int]:
        """Tokens start..stop of the first prompt's answer (what streaming shows)."""
        return self.answer[0, start : min(stop, self.max_new_tokens)].tolist()

    def record(self) -> StepRecord:
        return StepRecord(tokens=self.answers()[0][0], steps=[], drafted=0)


class PhaseClock:
    """Seconds spent in each phase over many steps: CUDA events (no wait until `totals`) on a GPU,
    the wall clock on a CPU (where each phase has finished when its call returns)."""

    def __init__(self, device: torch.device, phases: int):
        self.cuda = device.type == "cuda"
        self.phases = phases
        self.marks: list = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def totals(self) -> list[float]:
        """Seconds per phase, summed over the steps (the marks of each step: before each phase and after the last)."""
        totals = [0.0] * self.phases
        per_step = self.phases + 1
        for first in range(0, len(self.marks) - per_step + 1, per_step):
            for phase in range(self.phases):
                a, b = self.marks[first + phase], self.marks[first + phase + 1]
                totals[phase] += a.elapsed_time(b) / 1000 if self.cuda else b - a
        return totals


def run_steps(step: DecodeStep, *, runner: PhaseRunner, read_every: int, on_tokens=None, on_read=None, read_first: bool = True) -> list[float]:
    """Steps until the answer (every answer of a batch) has ended; the host reads (ended, tokens
    made) once every `read_every` steps, sooner when the length cap could come first at the
    tokens per step measured so far (at least one). `on_tokens(list)` sees the answer's new tokens at each read;
    `on_read()` runs at each read (the generate stage: progress, and on a CPU the ended rows
    leave the batch). `read_first=False` skips the read right after the prefill (the first
    interval then steps on whatever ended there). Returns each phase's seconds."""
    phases = runner.phases
    clock = PhaseClock(step.device, len(phases))
    ended, count = step.read_state() if read_first else (False, 1)
    first_count, stepped = count, 0  # tau so far: (count - first_count) tokens over `stepped` steps
    shown, stopped = 0, False
    while True:
        if on_read is not None and (read_first or count > 1):
            on_read()
        if on_tokens is not None and count > shown and not stopped:
            made = step.answer_tokens(shown, count)
            stop = next((i for i, token in enumerate(made) if token in step.eos_set), None)
            stopped = stop is not None
            on_tokens(made if stop is None else made[: stop + 1])
            shown = count
        if ended:
            return clock.totals()
        # A plain step makes one token, a speculative one about tau: planning ceil(tokens left /
        # tau so far) steps (integer arithmetic, tau at least 1) reaches the cap without the steps
        # past it that min(read_every, tokens left) ran, which change nothing but cost a step each.
        left, made = step.max_new_tokens - count, max(count - first_count, stepped)
        planned = max(1, min(read_every, -(-left * stepped // made) if stepped else left))
        stepped += planned
        for _ in range(planned):
            if step.sampling is not None:
                step.uniforms.uniform_(generator=step.generator)
            clock.mark()
            for phase in phases:
                phase()
                clock.mark()
        ended, count = step.read_state()


# Steps are kept per owner (the target model for plain decoding, a `Speculation` for a
# drafter's mode) and reused across prompts: allocating the caches and capturing the graphs is
# paid once. Prompt capacity grows in multiples of CAPACITY_STEP.
CAPACITY_STEP = 256
STEPS_ATTRIBUTE = "_dflash_decode_steps"


class StepCache(dict):
    """An owner's kept steps, by key: (step, runner). It lives in the owner's own `__dict__`, not
    in a module-level table keyed by the owner: a step holds its model, so a table's entry would
    keep its key alive for the life of the process (a WeakKeyDictionary included), while owner ->
    cache -> step -> owner is a cycle the garbage collector frees with the owner. A copy or a
    pickle of the owner starts with no steps (caches and graphs are the device's, not data)."""

    def __deepcopy__(self, memo):
        return StepCache()

    def __reduce__(self):
        return StepCache, ()


def steps_of(owner) -> StepCache:
    """The steps `owner` keeps (none yet: an empty cache, now kept on it)."""
    steps = vars(owner).get(STEPS_ATTRIBUTE)
    if steps is None:  # written into __dict__ itself: a frozen dataclass or a Module's __setattr__ is not involved
        steps = vars(owner)[STEPS_ATTRIBUTE] = StepCache()
    return steps


def cached_step(owner, key: tuple, prompt_length: int, max_new_tokens: int,
                build: Callable[[int, int], DecodeStep]) -> tuple[DecodeStep, PhaseRunner]:
    """(the step of `owner` and `key` that holds this prompt and answer, its graph runner): the
    kept one, or one `build(capacity, answer_capacity)` makes at rounded-up sizes."""
    steps = steps_of(owner)
    entry = steps.get(key)
    if entry is None or entry[0].capacity < prompt_length or entry[0].answer_capacity < max_new_tokens:
        def rounded(n):
            return -(-max(n, 1) // CAPACITY_STEP) * CAPACITY_STEP

        old = entry[0] if entry is not None else None
        step = build(rounded(max(prompt_length, old.capacity if old else 0)), rounded(max(max_new_tokens, old.answer_capacity if old else 0)))
        entry = steps[key] = (step, PhaseRunner(step.phases(), state=step.graph_state(), device=step.device,
                                                        capture=False if step.split else None))
    return entry


def run_prompt(step: DecodeStep, runner: PhaseRunner, prompt_ids: list[int], max_new_tokens: int, sampling: Sampling | None, on_tokens, read_every: int | None):
    """One prompt on a kept step, timed (a `DecodeRun`): prefill, then `run_steps`."""
    device = step.device
    step.generator = torch.Generator(device=device).manual_seed(sampling.seed) if sampling is not None else None
    synchronize(device)
    started = time.perf_counter()
    step.prefill(prompt_ids, step.generator, max_new_tokens)
    synchronize(device)
    prefilled = time.perf_counter()
    totals = run_steps(step, runner=runner, read_every=read_every or default_read_every(device), on_tokens=on_tokens)
    record = step.record()
    seconds = time.perf_counter() - started
    run = DecodeRun(tokens=record.tokens, seconds=seconds, prefill_seconds=prefilled - started, steps=record.steps, drafted=record.drafted)
    if len(totals) == 3:  # draft, verify, extend: extending the drafter's context counts as drafting, as in the host loop
        run.draft_seconds, run.verify_seconds = totals[0] + totals[2], totals[1]
    return run
