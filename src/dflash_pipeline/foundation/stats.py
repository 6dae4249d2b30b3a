"""The project-wide statistics: a mean with its 95% interval, over prompts, and paired differences.

Blocks of one answer are not independent (an easy math answer makes every block of it easy), so
every interval the pipeline reports is taken over prompts: each prompt's blocks are averaged
first, and the interval is over those per-prompt means. Train's periodic τ, evaluate's τ and the
comparison between drafters all use these three functions.

An interval that does not exist (one prompt has no spread to measure) is infinite in memory
(`files.undefined`), null in every JSON file (`files.strict_json`), an empty cell in every CSV file
(`files.csv_cell`) and `n/a` on the console (`NOT_AVAILABLE`: `format_interval`, the one spelling
of a value and its interval there, and `console_value` for a table's cells).
"""

import math

import numpy as np

from dflash_pipeline.foundation.files import undefined

NOT_AVAILABLE = "n/a"


def acceptance_length(correct: np.ndarray) -> np.ndarray:
    """τ per block: 1 + the number of leading drafted slots that are correct. correct [n, B-1]."""
    return 1 + np.cumprod(correct.astype(np.int64), axis=1).sum(axis=1)


def mean_ci95(values: list[float]) -> tuple[float, float]:
    """Mean and the half-width of its normal-approximation 95% confidence interval."""
    n = len(values)
    if n == 0:
        return float("nan"), float("nan")
    mean = sum(values) / n
    if n == 1:
        return mean, float("inf")
    variance = sum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, 1.96 * math.sqrt(variance / n)


def per_prompt_means(values: np.ndarray, prompt: np.ndarray) -> list[float]:
    """The mean of `values` [n] within each prompt of `prompt` [n], in ascending prompt order."""
    return [float(values[prompt == p].mean()) for p in np.unique(prompt)]


def mean_ci95_over_prompts(values: np.ndarray, prompt: np.ndarray) -> tuple[float, float]:
    """Mean and 95% CI half-width of per-block `values`, with each prompt weighted once."""
    return mean_ci95(per_prompt_means(np.asarray(values, dtype=np.float64), prompt))


def paired_difference(values: np.ndarray, prompt: np.ndarray, reference: np.ndarray, reference_prompt: np.ndarray
                      ) -> tuple[float, float, int]:
    """mean(values) - mean(reference), paired by prompt: the mean and 95% CI half-width of the
    per-prompt differences over the prompts both sides scored, and how many prompts that is.

    When both sides are scored on the same prompts, the spread between prompts (math answers are
    easy for any drafter, chat answers hard) cancels in the difference: its interval is much
    narrower than either side's own, and it is the one that says whether one beats the other.
    """
    shared = np.intersect1d(np.unique(prompt), np.unique(reference_prompt))
    ours, theirs = (per_prompt_means(np.asarray(v, dtype=np.float64)[np.isin(p, shared)], p[np.isin(p, shared)])
                    for v, p in ((values, prompt), (reference, reference_prompt)))
    differences = [a - b for a, b in zip(ours, theirs)]
    mean, half = mean_ci95(differences)
    return mean, half, len(differences)


def console_value(value):
    """`value` for a console table or line: an undefined number is "n/a", anything else as is."""
    return NOT_AVAILABLE if undefined(value) else value


def format_interval(mean, half, *, digits: int = 3, signed: bool = False) -> str:
    """"1.234 ± 0.056" for the console; an undefined mean or interval (None, NaN, infinite: one
    prompt has no spread) is "n/a", the same wherever a value and its interval are printed."""
    def shown(value, sign: str) -> str:
        if undefined(value):
            return NOT_AVAILABLE
        return f"{float(value):{sign}.{digits}f}"

    return f"{shown(mean, '+' if signed else '')} ± {shown(half, '')}"
