"""train/schedule.py: the learning rate's warmup and cosine decay, and the seeded step plan."""

import math

import pytest

from dflash_pipeline.train.schedule import learning_rate, plan_steps


def test_learning_rate_warms_up_then_decays_by_cosine():
    rates = [learning_rate(s, max_steps=100, base_lr=1.0, warmup_fraction=0.1) for s in range(100)]
    assert rates[0] == pytest.approx(0.1) and rates[9] == pytest.approx(1.0)
    assert rates[10] == pytest.approx(1.0) and rates[-1] == pytest.approx(0.1, abs=1e-3)
    assert all(a >= b for a, b in zip(rates[10:], rates[11:]))
    assert rates[55] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))


def test_step_plan_is_deterministic_and_covers_each_epoch():
    lengths = [100, 300, 50, 250, 80, 120]
    plan = plan_steps(lengths, tokens_per_step=400, max_steps=9, seed=3)
    assert plan == plan_steps(lengths, tokens_per_step=400, max_steps=9, seed=3) and len(plan) == 9
    first_epoch, seen = [], set()
    for step in plan:
        if seen & set(step):
            break
        seen |= set(step)
        first_epoch.append(step)
        assert sum(lengths[i] for i in step) <= 400 or len(step) == 1
    assert seen == set(range(len(lengths)))
