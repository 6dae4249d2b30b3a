"""The training schedule: the learning rate at each step (linear warmup, cosine decay) and the
plan of which train sequences every step packs (seeded epochs, so a step's batch depends only on
(seed, step) and a resumed or multi-rank run replays the same batches)."""

import math
import random


def learning_rate(step: int, *, max_steps: int, base_lr: float, warmup_fraction: float, min_lr_fraction: float = 0.1) -> float:
    """Linear warmup, then cosine decay to min_lr_fraction * base_lr at max_steps."""
    warmup = max(1, int(round(warmup_fraction * max_steps)))
    if step < warmup:
        return base_lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, max_steps - warmup))
    return base_lr * (min_lr_fraction + (1 - min_lr_fraction) * 0.5 * (1 + math.cos(math.pi * progress)))


def plan_steps(lengths: list[int], *, tokens_per_step: int, max_steps: int, seed: int) -> list[list[int]]:
    """Sequence indices of every step: epochs of seeded permutations packed to a token budget."""
    steps: list[list[int]] = []
    epoch = 0
    while len(steps) < max_steps:
        order = list(range(len(lengths)))
        random.Random(seed * 1000 + epoch).shuffle(order)
        current, tokens = [], 0
        for index in order:
            if current and tokens + lengths[index] > tokens_per_step:
                steps.append(current)
                current, tokens = [], 0
                if len(steps) == max_steps:
                    break
            current.append(index)
            tokens += lengths[index]
        if current and len(steps) < max_steps:
            steps.append(current)
        epoch += 1
    return steps
