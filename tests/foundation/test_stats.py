"""stats.py: the 95% interval by hand, every prompt weighted once, and paired differences that
cancel the spread between prompts."""

import math

import numpy as np
import pytest

from dflash_pipeline.foundation.stats import (
    format_interval,
    mean_ci95,
    mean_ci95_over_prompts,
    paired_difference,
    per_prompt_means,
)


def test_mean_ci95_by_hand():
    mean, half = mean_ci95([1.0, 2.0, 3.0, 4.0])
    assert mean == 2.5
    assert half == pytest.approx(1.96 * math.sqrt((1.5**2 + 0.5**2 + 0.5**2 + 1.5**2) / 3 / 4))
    assert mean_ci95([5.0]) == (5.0, math.inf)
    assert all(math.isnan(x) for x in mean_ci95([]))


def test_every_prompt_counts_once_however_many_blocks_it_has():
    values = np.array([1.0, 1.0, 1.0, 1.0, 3.0])
    prompt = np.array(["b", "b", "b", "b", "a"])
    assert per_prompt_means(values, prompt) == [3.0, 1.0]  # ascending prompt order
    mean, _ = mean_ci95_over_prompts(values, prompt)
    assert mean == 2.0 != values.mean()


def test_a_paired_difference_cancels_the_spread_between_prompts_and_skips_unshared_prompts():
    prompt = np.array(["p1", "p1", "p2", "p3", "p3"])
    reference = np.array([1.0, 3.0, 10.0, 5.0, 5.0])  # prompts of very different difficulty
    better = reference + 0.5
    mean, half, prompts = paired_difference(better, prompt, reference, prompt)
    assert (mean, prompts) == (pytest.approx(0.5), 3) and half == pytest.approx(0.0)
    _, unpaired = mean_ci95_over_prompts(better, prompt)
    assert unpaired > 1.0  # each side alone is wide; the difference is exact
    extra = paired_difference(np.append(better, 99.0), np.append(prompt, "p4"), reference, prompt)
    assert extra[0] == pytest.approx(0.5) and extra[2] == 3  # p4 was scored by one side only


def test_an_interval_prints_one_way_and_an_undefined_one_as_n_a():
    assert format_interval(1.23456, 0.0831) == "1.235 ± 0.083"
    assert format_interval(0.375, 0.245, digits=4, signed=True) == "+0.3750 ± 0.2450"
    _, one_prompt = mean_ci95([1.5])
    for undefined in (one_prompt, None, float("nan")):  # in memory inf, in JSON null, never "+- inf" or "+- None"
        assert format_interval(1.5, undefined) == "1.500 ± n/a"
    assert format_interval(None, None) == "n/a ± n/a"
