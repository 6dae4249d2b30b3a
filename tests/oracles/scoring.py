"""The teacher-forced scorer's reference: one block per drafter forward through a host context cache.

`score_one_block_at_a_time` drafts each block as the host decoding loop did (`oracles.drafting`)
and scores it with the same rules as `measure.scoring.score_teacher_forced` (the member's
`score_blocks`, `_score_logits`); the tests and bench/evaluate.py compare the two.
"""

import numpy as np
import torch

from dflash_pipeline.data.blocks import draw_anchors, scoring_anchor_seed
from dflash_pipeline.drafters.core import DFlashDrafter, draft_logits
from dflash_pipeline.measure.scoring import (
    BlockScores,
    _anchors_cap,
    _joined,
    _score_logits,
)
from dflash_pipeline.target.load import TargetHead
from oracles.drafting import DraftCache, draft_hidden


@torch.no_grad()
def score_one_block_at_a_time(drafter: DFlashDrafter, head: TargetHead, dataset, *, anchors_per_sequence: int, tree_budgets: list[int],
                              seed: int = 0, sequences: list[int] | None = None, reuse_context: bool = True) -> BlockScores:
    """The plain reference: one block per drafter forward through the inference KV cache.

    Same anchors and scoring as `score_teacher_forced`; obvious by inspection, and slow (the
    vocabulary head runs on B-1 rows at a time). `reuse_context=False` rebuilds the context
    cache for every block, as a script that drafts each block from scratch does. Used by the
    tests and the benchmark.
    """
    drafter.eval()
    config = drafter.config
    block_size, cap = config.block_size, _anchors_cap(anchors_per_sequence)
    member = drafter.architecture
    parts = {"sequence": [], "anchor": [], "correct": [], "valid": []}
    extra_parts: dict[str, list] = {}
    streak_parts: dict[int, list] = {budget: [] for budget in tree_budgets}
    for index in (range(len(dataset)) if sequences is None else sequences):
        sample = dataset[index]
        ids, mask, length = sample.input_ids.long(), sample.loss_mask.bool(), sample.input_ids.shape[0]
        anchors = draw_anchors(sample.loss_mask, cap, scoring_anchor_seed(seed, index))
        cache = DraftCache(drafter)
        for anchor in anchors:
            if not reuse_context:
                cache = DraftCache(drafter)
            cache.extend(sample.features[cache.length : anchor].to(head.embed_weight.device))
            hidden = draft_hidden(drafter, head, cache, int(ids[anchor]))
            logits = draft_logits(drafter, head, hidden)
            slots = torch.arange(anchor + 1, anchor + block_size)
            inside = slots < length
            labels = drafter.vocab_index(ids[slots.clamp(max=length - 1)])
            valid = inside & mask[slots.clamp(max=length - 1)]
            # the member's one scoring path, on this single block drafted through the host cache
            own, extras = member.score_blocks(drafter, hidden=hidden[None], logits=logits[None].clone(),
                                              anchors=torch.tensor([int(ids[anchor])], device=logits.device),
                                              labels=ids[slots.clamp(max=length - 1)][None], valid=valid[None])
            for name, values in extras.items():
                extra_parts.setdefault(name, []).append(values)
            correct, streaks = _score_logits(logits[None], labels[None], valid[None], tree_budgets)
            parts["correct"].append(correct if own is None else own)
            parts["valid"].append(valid[None].numpy())
            parts["sequence"].append(np.array([index]))
            parts["anchor"].append(np.array([anchor]))
            for budget in tree_budgets:
                streak_parts[budget].append(streaks[budget])
    return _joined(parts, streak_parts, extra_parts, member.name)
