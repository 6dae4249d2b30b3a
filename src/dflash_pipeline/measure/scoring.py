"""The one teacher-forced scorer: τ, per-slot acceptance and DDTree streaks of a drafter, without
running the target.

On the captured val features, each block is drafted exactly as at decoding (the context is the
target's own features before the anchor) and compared with the target-greedy answer:

    τ (acceptance length)  1 + the number of leading drafted slots whose argmax is the target's
                           token: what speculative decoding at T = 0 would commit per step if
                           the committed prefix were the target's own. Slots past the answer end
                           count as misses.
    slot acceptance        per slot, unconditional and given every earlier slot was accepted
    DDTree-k streak        how far the target's tokens walk down the best-first tree of the k
                           most probable drafted prefixes (tree verification's acceptance)

Means carry a 95% interval over prompts (`stats`), never over blocks: blocks of one answer are
not independent. `score_teacher_forced` drafts all blocks of several sequences in one forward
under the DFlash mask (seconds for thousands of blocks); tests/oracles/scoring.py keeps the plain
reference, one block at a time through a host context cache, that the tests compare it with.
Train's periodic τ and the `evaluate` stage both call `score_teacher_forced`.
"""

from dataclasses import dataclass, field

import numpy as np
import torch

from dflash_pipeline.data.blocks import build_batch, scoring_anchor_seed, valid_anchors
from dflash_pipeline.drafters import family
from dflash_pipeline.drafters.core import DFlashDrafter
from dflash_pipeline.foundation.errors import PipelineError
from dflash_pipeline.foundation.progress import progress_iter
from dflash_pipeline.foundation.stats import (
    acceptance_length,
    format_interval,
    mean_ci95_over_prompts,
)
from dflash_pipeline.foundation.stats import (
    paired_difference as paired_prompt_difference,
)
from dflash_pipeline.measure.record import Interval, TeacherForced
from dflash_pipeline.speculation.trees import (
    build_draft_tree_tensors,
    ranked_candidates,
    tree_streaks,
)
from dflash_pipeline.target.load import TargetHead

EVERY_ANCHOR = 1 << 30


def _anchors_cap(anchors_per_sequence: int) -> int:
    return anchors_per_sequence if anchors_per_sequence > 0 else EVERY_ANCHOR


def ddtree_streak(logprobs, token_ids, reference: list[int], budget: int) -> int:
    """DDTree-k streak of one block: how many nodes of the tree of the `budget` most probable
    drafted prefixes (`trees.build_draft_tree_tensors`, the tree that tree decoding verifies) the
    reference walk matches from the root: 0..min(budget, len(reference)).

    logprobs / token_ids [D][K]: each drafted depth's K best tokens in `trees.ranked_candidates`' order.
    """
    slots, width = len(logprobs), len(logprobs[0]) if len(logprobs) else 0
    logprobs = torch.tensor(logprobs, dtype=torch.float64).reshape(1, slots, width)
    token_ids = torch.tensor(token_ids, dtype=torch.int64).reshape(1, slots, width)
    # one reference token per drafted slot: the rest of a longer reference is never reached, and
    # a shorter one's padding lies past its length
    counted = list(reference[:slots])
    padded = torch.tensor([counted + [0] * (slots - len(counted))], dtype=torch.int64)
    tree = build_draft_tree_tensors(logprobs, token_ids, max(budget, 0))
    return int(tree_streaks(tree, padded, torch.tensor([len(counted)]), [budget])[budget][0])


@dataclass
class BlockScores:
    """Teacher-forced results of every evaluated block of one drafter."""

    sequence: np.ndarray  # [n] index of the val sequence
    anchor: np.ndarray  # [n] anchor position
    correct: np.ndarray  # [n, B-1] drafted argmax == target-greedy token (and the slot exists)
    valid: np.ndarray  # [n, B-1] the slot holds an answer token to compare with
    streaks: dict[int, np.ndarray] = field(default_factory=dict)  # budget -> [n]
    # The drafter's architecture, and its own per-block arrays (`Architecture.score_blocks`, e.g.
    # DFlash2's each-slot argmax and top-K membership), which its `summarize_extras` turns into metrics.
    architecture: str = ""
    extras: dict[str, np.ndarray] = field(default_factory=dict)  # name -> [n, B-1]

    @property
    def tau(self) -> np.ndarray:
        return acceptance_length(self.correct)


def ddtree_streaks(logprobs: np.ndarray, token_ids: np.ndarray, reference: np.ndarray, reference_length: np.ndarray,
                   budgets: list[int]) -> dict[int, np.ndarray]:
    """`ddtree_streak` for many blocks at once, for every budget: {budget: streaks [n]}.

    logprobs [n, D, K] float64 and token_ids [n, D, K]: each depth's K best tokens, best first;
    reference [n, D]: the target's tokens, of which the first reference_length [n] count. Every
    block's tree grows in lockstep (`trees.build_draft_tree_tensors`); pops come in the same order
    whatever the budget, so one growth to the largest budget serves them all (`trees.tree_streaks`).
    """
    def tensor(array: np.ndarray) -> torch.Tensor:
        return torch.as_tensor(np.ascontiguousarray(array))

    tree = build_draft_tree_tensors(tensor(logprobs), tensor(token_ids), max([0, *budgets]))
    streaks = tree_streaks(tree, tensor(reference), tensor(reference_length), budgets)
    return {budget: streak.numpy() for budget, streak in streaks.items()}


def _score_logits(logits: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor, budgets: list[int]):
    """logits [n, B-1, V] (overwritten when float32) -> correct [n, B-1] and streaks {budget: [n]}.

    Any number of blocks, one block (the reference loop) included, grows the same lockstep trees
    (`trees.build_draft_tree_tensors`, walked by `trees.tree_streaks`). The tree's candidates are
    each slot's top max(budgets) tokens in `trees.ranked_candidates`' order (which takes the
    log-sum-exp in place).
    """
    if not budgets:
        return ((logits.argmax(-1).cpu() == labels) & valid).numpy(), {}
    logprobs, ids = ranked_candidates(logits, max(budgets))  # a bf16 head's logits (GPU) are ranked in fp32, in a copy
    correct = (ids[..., 0].cpu() == labels) & valid  # the argmax (the lowest id among tied maxima)
    reference_length = valid.int().cumprod(1).sum(1)
    tree = build_draft_tree_tensors(logprobs.cpu(), ids.cpu(), max(budgets))  # on the host, as `ddtree_streaks`
    streaks = tree_streaks(tree, labels, reference_length, budgets)
    return correct.numpy(), {budget: streak.numpy() for budget, streak in streaks.items()}


def logits_into(head_weight: torch.Tensor, hidden: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
    """The logits [..., V] of hidden [..., H] through head rows [V, H], written into `buffer`
    (>= rows x V elements).

    On CPU a fresh vocabulary-sized result is first touched page by page: its matmul ran at
    150-180 GFLOP/s here against ~400 in a reused buffer. Valid until the buffer is reused.
    """
    flat = hidden.reshape(-1, hidden.shape[-1]).to(head_weight.dtype).contiguous()
    result = buffer.view(-1)[: flat.shape[0] * head_weight.shape[0]].view(flat.shape[0], -1)
    torch.mm(flat, head_weight.T, out=result)
    return result.view(*hidden.shape[:-1], -1)


def _joined(parts: dict[str, list], streak_parts: dict[int, list], extra_parts: dict[str, list], architecture: str) -> BlockScores:
    """One BlockScores from the per-batch (or per-block) pieces."""
    return BlockScores(**{name: np.concatenate(pieces) for name, pieces in parts.items()},
                       streaks={budget: np.concatenate(pieces) for budget, pieces in streak_parts.items()},
                       architecture=architecture, extras={name: np.concatenate(pieces) for name, pieces in extra_parts.items()})


@torch.no_grad()
def score_teacher_forced(drafter: DFlashDrafter, head: TargetHead, dataset, *, anchors_per_sequence: int, tokens_per_batch: int,
                         tree_budgets: list[int], seed: int = 0, sequences: list[int] | None = None, logits_chunk: int = 1024,
                         blocks_per_forward: int = 64, attention: str = "sdpa", progress: bool = False) -> BlockScores:
    """Teacher-forced scores of one drafter, all blocks of a packed group of sequences per forward.

    Block `anchors_per_sequence` anchors per val sequence (0: every anchor), drawn by
    `scoring_anchor_seed(seed, sequence)`. Leaves the drafter in eval mode.
    """
    # One function on purpose (~70 lines): packing, the forwards and the head's chunks share the
    # pending queue and the reused logits buffer, which a split would have to pass around.
    drafter.eval()
    config = drafter.config
    block_size, cap = config.block_size, _anchors_cap(anchors_per_sequence)
    indices = list(range(len(dataset))) if sequences is None else list(sequences)
    lengths = dataset.lengths()
    anchors = {index: min(cap, max(0, int(dataset[index].loss_mask.sum()) - 1)) for index in indices}  # an upper bound
    # Pack sequences up to a context budget and a block budget: the dense DFlash mask costs
    # blocks x (context + blocks), so packing too many blocks wastes attention on masked keys.
    groups, current, tokens, blocks = [], [], 0, 0
    for index in indices:
        if current and (tokens + lengths[index] > tokens_per_batch or blocks + anchors[index] > blocks_per_forward):
            groups.append(current)
            current, tokens, blocks = [], 0, 0
        current.append(index)
        tokens += lengths[index]
        blocks += anchors[index]
    if current:
        groups.append(current)
    device = head.embed_weight.device
    member = drafter.architecture
    parts = {"sequence": [], "anchor": [], "correct": [], "valid": []}
    extra_parts: dict[str, list] = {}
    streak_parts: dict[int, list] = {budget: [] for budget in tree_budgets}
    # The head runs on chunks of `chunk` blocks gathered across forwards (a forward holds few
    # blocks, to keep its dense mask small), in one reused buffer (see `logits_into`).
    chunk = max(1, logits_chunk // (block_size - 1))
    head_weight = drafter.draft_head_weight(head)  # labels are compared in the drafter's vocabulary columns
    logits_buffer = torch.empty(chunk * (block_size - 1) * head_weight.shape[0], device=device, dtype=head_weight.dtype)
    pending: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # drafted, not yet through the head

    def score_pending(everything: bool) -> None:
        hidden, labels, valid, anchor_ids, label_ids = (torch.cat(piece) for piece in zip(*pending))
        pending.clear()
        ready = hidden.shape[0] if everything else hidden.shape[0] // chunk * chunk
        for start in range(0, ready, chunk):
            stop = min(start + chunk, ready)
            logits = logits_into(head_weight, hidden[start:stop], logits_buffer)
            # The architecture's own reading first: _score_logits overwrites the logits.
            own, extras = member.score_blocks(drafter, hidden=hidden[start:stop], logits=logits, anchors=anchor_ids[start:stop],
                                              labels=label_ids[start:stop], valid=valid[start:stop])
            for name, values in extras.items():
                extra_parts.setdefault(name, []).append(values)
            correct, streaks = _score_logits(logits, labels[start:stop], valid[start:stop], tree_budgets)
            parts["correct"].append(correct if own is None else own)
            for budget in tree_budgets:
                streak_parts[budget].append(streaks[budget])
        if ready < hidden.shape[0]:
            pending.append((hidden[ready:], labels[ready:], valid[ready:], anchor_ids[ready:], label_ids[ready:]))

    for group in progress_iter(groups, desc=f"score {drafter_label(drafter)}", unit="batch", disable=not progress, leave=False):
        samples = [dataset[index] for index in group]
        if not any(valid_anchors(sample.loss_mask).numel() for sample in samples):
            continue
        host = build_batch(samples, anchors_per_sequence=cap, block_size=block_size, mask_token_id=config.mask_token_id,
                           anchor_seeds=[scoring_anchor_seed(seed, index) for index in group],
                           sliding_window=config.sliding_window, pin_memory=device.type == "cuda")
        batch = host.to(str(device))
        embeddings = head.embed(batch.block_ids).to(drafter.fc.weight.dtype)
        hidden = drafter.forward_blocks(batch.features, batch.context_positions, embeddings, batch.block_positions,
                                        batch.attention_mask(attention), attention=attention)
        pending.append((batch.drafted(hidden), drafter.vocab_index(host.labels), host.exists, host.anchor_ids, host.labels))
        if sum(piece[0].shape[0] for piece in pending) >= chunk:
            score_pending(everything=False)
        parts["valid"].append(host.exists.numpy())
        parts["sequence"].append(np.array(group)[host.block_sequence.numpy()])
        parts["anchor"].append(host.anchors.numpy())
    if pending:
        score_pending(everything=True)
    if not parts["correct"]:
        raise PipelineError("evaluate: the val shards hold no answer with two tokens in a row to anchor a block")
    return _joined(parts, streak_parts, extra_parts, member.name)


def drafter_label(drafter: DFlashDrafter) -> str:
    config = drafter.config
    return f"{config.num_layers}L/B{config.block_size}"


# ----------------------------------------------------------------------------- summaries


def per_slot_acceptance(scores: BlockScores) -> tuple[list[float], list[float]]:
    """(unconditional, conditional) acceptance per drafted slot.

    Unconditional: P(slot k correct) over blocks where slot k exists. Conditional: the same over
    blocks whose slots 1..k-1 were all accepted, i.e. the chance that speculation continues.
    """
    correct, valid = scores.correct, scores.valid
    reached = np.concatenate([np.ones((correct.shape[0], 1), dtype=bool), np.cumprod(correct, axis=1)[:, :-1].astype(bool)], axis=1)
    unconditional, conditional = [], []
    for k in range(correct.shape[1]):
        exists = valid[:, k]
        unconditional.append(float(correct[exists, k].mean()) if exists.any() else float("nan"))
        got_there = exists & reached[:, k]
        conditional.append(float(correct[got_there, k].mean()) if got_there.any() else float("nan"))
    return unconditional, conditional


def summarize_blocks(scores: BlockScores, categories: list[str] | None = None) -> TeacherForced:
    """The teacher-forced section of one drafter's record: means over prompts (each prompt's blocks
    averaged first), rounded to 4 places; per category of `categories` (of each val sequence) when given."""
    def over_prompts(values: np.ndarray, sequence: np.ndarray) -> Interval:
        mean, half = mean_ci95_over_prompts(values, sequence)
        return Interval(round(mean, 4), round(half, 4))

    unconditional, conditional = per_slot_acceptance(scores)
    by_category = {}
    if categories is not None:
        labels = np.array([categories[s] for s in scores.sequence])
        for category in sorted(set(labels.tolist())):
            chosen = labels == category
            by_category[category] = over_prompts(scores.tau[chosen], scores.sequence[chosen])
    return TeacherForced(tau=over_prompts(scores.tau, scores.sequence), blocks=int(scores.tau.shape[0]),
                         prompts=int(np.unique(scores.sequence).shape[0]), tau_per_block=round(float(scores.tau.mean()), 4),
                         slot_acceptance=[round(u, 4) for u in unconditional], slot_acceptance_conditional=[round(c, 4) for c in conditional],
                         ddtree_streak={budget: over_prompts(streak, scores.sequence) for budget, streak in sorted(scores.streaks.items())},
                         categories=by_category, extras=_architecture_extras(scores))


def _architecture_extras(scores: BlockScores) -> dict[str, float]:
    """The drafter architecture's own teacher-forced figures, by name (the record's `extras`;
    DFlash2: what its selector buys over each slot's own argmax), from its `summarize_extras`."""
    return family.architecture(scores.architecture).summarize_extras(scores) if scores.extras else {}


def paired_difference(scores: BlockScores, reference: BlockScores) -> tuple[float, float, int]:
    """τ of `scores` minus τ of `reference`, paired by prompt (`stats.paired_difference`): every
    drafter is scored on the same anchors of the same prompts, so this is the interval that says
    whether one drafter beats another."""
    return paired_prompt_difference(scores.tau, scores.sequence, reference.tau, reference.sequence)


def comparison_verdict(name: str, reference: str, mean: float, half: float, prompts: int) -> str:
    """One line: is `name` better or worse than `reference`, or can 95% not tell them apart."""
    if half is None or not np.isfinite(half) or abs(mean) <= half:
        verdict = "not distinguishable at 95%"
    else:
        verdict = f"{name} is {'better' if mean > 0 else 'worse'}"
    return (f"{name} vs {reference}: tau difference {format_interval(mean, half, digits=4, signed=True)} (paired over {prompts} prompts): "
            f"{verdict}")
