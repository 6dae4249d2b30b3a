"""The typed evaluation record: what the evaluate stage measured, kept as dataclasses until the
last moment.

    Interval         a mean and the half-width of its 95% interval over prompts
    TeacherForced    one drafter's teacher-forced figures (`scoring.summarize_blocks`)
    Mismatch         a prompt whose speculative answer parts from plain greedy decoding, and where
    EndToEnd         one decoding mode of one drafter on the real target (`end_to_end.summarize_end_to_end`)
    BestMode         the lossless greedy mode (the chain or a tree budget) that measured fastest
    Decoding         a drafter's modes: the greedy chain, greedy trees by node budget, sampled
                     chains by temperature, and the best of the greedy ones
    Paired           a τ difference to the chosen checkpoint, paired over prompts
    CandidateRecord  one drafter under evaluation: a checkpoint of this run or a baseline
    Evaluation       every candidate, which checkpoint was chosen, and the scoring time

Figures are held as the summaries round them, so what a metrics file shows is what the record
holds. Exactly one function writes a record as metrics keys (`evaluate.report.to_metrics`);
nothing reads keys back into a record. The record holds data only: the scorer (which `train`
runs too) builds its section, and `evaluate` alone decides how it is written.
"""

from dataclasses import dataclass, field

from dflash_pipeline.foundation.errors import PipelineError
from dflash_pipeline.speculation.modes import DecodingMode


@dataclass(frozen=True)
class Interval:
    """A mean over prompts (each prompt's blocks or steps averaged first) and its 95% half-width
    (`stats.mean_ci95_over_prompts`; nan over a single prompt)."""

    mean: float
    ci95: float


@dataclass(frozen=True)
class TeacherForced:
    """One drafter scored teacher-forced on the cached val features (`scoring`)."""

    tau: Interval  # acceptance length per block, over prompts
    blocks: int
    prompts: int
    tau_per_block: float  # the plain mean over blocks, for comparison with reports that average blocks
    slot_acceptance: list[float]  # slot 1..B-1: the slot's argmax is the target's token (nan: no block has the slot)
    slot_acceptance_conditional: list[float]  # the same, over blocks whose earlier slots were all accepted
    ddtree_streak: dict[int, Interval] = field(default_factory=dict)  # node budget -> DDTree streak
    categories: dict[str, Interval] = field(default_factory=dict)  # prompt category -> τ
    extras: dict[str, float] = field(default_factory=dict)  # the drafter architecture's own figures, by name
    seconds: float | None = None  # how long scoring this drafter took


@dataclass(frozen=True)
class Mismatch:
    """A prompt whose speculative answer differs from plain decoding: the first differing answer
    token, and whether the target's logits there are a near-tie (`end_to_end.is_near_tie`: rounding
    decides which token greedy decoding takes, not a defect of the drafter or the verifier)."""

    prompt_id: str
    position: int
    near_tie: bool


@dataclass(frozen=True)
class TimeSplit:
    """Shares of the speculative decoding time."""

    prefill: float
    verify: float
    draft: float
    overhead: float


@dataclass(frozen=True)
class EndToEnd:
    """One decoding mode of one drafter against plain decoding on the same prompts (`end_to_end`)."""

    prompts: int
    tau: Interval  # committed tokens per speculative step, over prompts
    speedup: float | None  # speculative tokens/s over plain tokens/s, measured alternately
    lossless_rate: float | None  # share of answers equal to plain decoding token for token; None when sampled
    mismatches: list[Mismatch]
    acceptance_rate: float  # accepted drafted tokens (tree nodes) over those verified
    plain_tokens_per_s: float
    spec_tokens_per_s: float
    decode_step_ms: float  # one plain decode step on this machine
    verify_cost_steps: float | None  # one verify forward, in plain decode steps
    draft_cost_steps: float | None  # one drafting step (propose + extend the context cache), in decode steps
    break_even_tau: float | None  # the τ below which speculative decoding is slower here
    time: TimeSplit
    verify_tokens: int | None = None  # a greedy chain: drafted tokens verified per step
    forward_cost_steps: list[float] = field(default_factory=list)  # the measured target forward of 1.. tokens, when planned
    expected_tokens_per_step_cost: list[float] = field(default_factory=list)  # the plan's rate per verify length
    # The same decodes with each prompt's prefill left out on both sides alike (it makes the first
    # token, the rest are decode steps): tokens after the first over the seconds after the prefill.
    # `speedup` above keeps the prefill, as every earlier record did, so records stay comparable.
    decode_speedup: float | None = None
    plain_decode_tokens_per_s: float | None = None
    spec_decode_tokens_per_s: float | None = None
    plain_prefill_ms: float | None = None  # mean per prompt
    spec_prefill_ms: float | None = None  # mean per prompt

    @property
    def near_tie_mismatches(self) -> int:
        return sum(mismatch.near_tie for mismatch in self.mismatches)


@dataclass(frozen=True)
class BestMode:
    """The greedy decoding mode that paid best end to end on the machine evaluate ran on: the chain
    at its verify length or a DDTree budget, among those that stayed lossless (`evaluate.best_mode.
    choose_decoding_mode`). Which one pays depends on the machine (a verify forward of many tokens
    is dear on a CPU), so the record names the machine it was measured on."""

    decoding_mode: DecodingMode | None  # the chain at its verify length or a tree budget; None when no greedy mode qualified
    speedup: float | None
    tau: Interval | None
    lossless_rate: float | None
    speedups: dict[str, float | None] = field(default_factory=dict)  # every greedy mode measured, by mode name
    refused: dict[str, str] = field(default_factory=dict)  # mode name -> why it could not win
    machine: str = ""  # the device and machine in words ("cpu on AMD EPYC 7B13, 2 CPUs")
    engine: str = ""  # the decoding engine it was measured on (`plain.engine_name`: "static-kv", "static-kv-cuda-graph")

    @property
    def mode(self) -> str | None:
        """The winning mode's name ("chain", "tree<budget>"), or None."""
        return self.decoding_mode.name if self.decoding_mode is not None else None

    @classmethod
    def from_json(cls, section, where: str) -> "BestMode":
        """The `best_mode` section as `evaluate.report.best_mode_figures` writes it, read back and
        checked: a malformed record is one error naming `where` and the key."""
        if not isinstance(section, dict):
            raise PipelineError(f"{where} is {type(section).__name__}, expected a mapping")
        for key in ("speedups", "refused"):
            if not isinstance(section.get(key) or {}, dict):
                raise PipelineError(f"{where}.{key} is {type(section[key]).__name__}, expected a mapping by mode name")
        mode = DecodingMode.from_dict(section, where, optional=True)
        tau = Interval(section["tau"], section.get("tau_ci95")) if isinstance(section.get("tau"), (int, float)) else None
        return cls(decoding_mode=mode, speedup=section.get("speedup"), tau=tau, lossless_rate=section.get("lossless_rate"),
                   speedups=dict(section.get("speedups") or {}), refused=dict(section.get("refused") or {}),
                   machine=str(section.get("machine") or "an unrecorded machine"), engine=str(section.get("engine") or ""))


@dataclass(frozen=True)
class Decoding:
    """A drafter decoded end to end: greedy chain, greedy trees and sampled chains."""

    chain: EndToEnd
    trees: dict[int, EndToEnd] = field(default_factory=dict)  # node budget -> greedy tree decoding
    sampled: dict[float, EndToEnd] = field(default_factory=dict)  # temperature > 0 -> sampled chain decoding
    best: BestMode | None = None  # the fastest lossless greedy mode of chain and trees
    engine: str = ""  # the decoding loop both plain and speculative decoding ran on (`plain.engine_name`)


@dataclass(frozen=True)
class Paired:
    """τ of a drafter minus τ of the chosen checkpoint, paired over the prompts both scored."""

    mean: float
    ci95: float
    prompts: int


@dataclass(frozen=True)
class CandidateRecord:
    """One drafter under evaluation and everything measured of it."""

    name: str  # "step_000900" or the baseline folder's name
    kind: str  # "checkpoint" | "baseline"
    path: str
    step: int | None  # a checkpoint's training step
    block_size: int
    num_layers: int
    teacher_forced: TeacherForced
    vs_chosen: Paired | None = None  # set once a checkpoint is chosen
    decoding: Decoding | None = None  # the chosen checkpoint and the baselines, when prompts are decoded


@dataclass(frozen=True)
class Evaluation:
    """The whole evaluation: candidates in scoring order (checkpoints, then baselines), the chosen
    checkpoint's name (highest teacher-forced τ; the first candidate when only baselines ran) and
    the time teacher-forced scoring of all of them took."""

    candidates: list[CandidateRecord]
    chosen: str
    teacher_forced_seconds: float
    # Why end-to-end decoding did not run though prompts were asked for (the whole target does not
    # fit this machine and no device map splits it); None when it ran or was not asked for.
    decoding_skipped: str | None = None

    def candidate(self, name: str) -> CandidateRecord:
        return next(candidate for candidate in self.candidates if candidate.name == name)

    @property
    def chosen_record(self) -> CandidateRecord:
        return self.candidate(self.chosen)

    @property
    def checkpoints(self) -> list[CandidateRecord]:
        return [candidate for candidate in self.candidates if candidate.kind == "checkpoint"]

    @property
    def baselines(self) -> list[CandidateRecord]:
        return [candidate for candidate in self.candidates if candidate.kind == "baseline"]
