"""How many drafted tokens a chain should verify on this machine: the verify length that maximises
expected tokens per second, from the drafter's conditional acceptance and the target's measured
forward cost per number of new tokens (`plan_verify_tokens`)."""

from dataclasses import dataclass

import numpy as np

from dflash_pipeline.decoding.plain import forward_costs
from dflash_pipeline.decoding.session import Speculation, speculative_decode


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
