"""The drafter's training objective: decayed cross-entropy on the drafted slots, through the
target's frozen LM head, chunk by chunk, optionally against the target's own distribution.

With `distill_weight` α > 0 each slot's target is the mixture (1 - α)·one-hot(answer token) +
α·p_target, p_target being the target's top-K next-token probabilities renormalised over the K
(captured by `capture.target_top_k`). Cross-entropy to that mixture is (1 - α)·CE + α·KL(p_target
|| q) plus a constant, and its gradient is softmax(z) - mixture: the same two matmuls per position
as plain CE, so distillation costs nothing in the head.

The head (vocabulary x hidden) dominates a small drafter's step, so the loss never materialises
more than `logits_chunk` x vocabulary logits, computes the hidden gradient in the same pass, and
can restrict the softmax to the tokens the training answers use (`TrainingVocabulary`).

An architecture may add a term of its own (`Architecture.extra_loss`; DFlash2's selector
cross-entropy, `drafters.dflash2.selector_loss`): it gets each slot's top-K columns from the same
head pass, the answer's previous token as predecessor (teacher forcing: the walk starts from the
verified anchor), and the same slot weights and normaliser, so it adds up across ranks as the
main term does.
"""

from dataclasses import dataclass

import torch

from dflash_pipeline.data.blocks import Batch
from dflash_pipeline.foundation.errors import PipelineError
from dflash_pipeline.drafters.core import DFlashDrafter
from dflash_pipeline.drafters.token_columns import TokenColumns
from dflash_pipeline.target.load import TargetHead


class ChunkedHeadCrossEntropy(torch.autograd.Function):
    """Weighted CE through a frozen LM head, chunk by chunk, with the hidden gradient computed in
    the forward pass: two vocab-sized matmuls per position (the minimum) and never more than
    `chunk` x vocab logits alive. Returns sum(w * CE) and whether each argmax hits its label.

    `soft_ids` / `soft_probs` [N, M] (optional) give each row a sparse target distribution
    instead of the one-hot label (`labels` still decide the hits). `top_k` > 0 also returns each
    row's top-K columns [N, K], best first (DFlash2's candidates), from the same logits."""

    @staticmethod
    def forward(ctx, hidden, head_weight, labels, weights, chunk, soft_ids=None, soft_probs=None, top_k=0):
        total = hidden.new_zeros((), dtype=torch.float32)
        hits = torch.zeros(labels.shape, dtype=torch.bool, device=hidden.device)
        top_k = min(top_k, head_weight.shape[0])
        top_columns = torch.zeros(labels.shape[0], top_k, dtype=torch.long, device=hidden.device)
        grad = torch.zeros_like(hidden) if hidden.requires_grad else None
        for start in range(0, hidden.shape[0], chunk):
            h = hidden[start : start + chunk]
            logits = (h @ head_weight.T).float()
            y, w = labels[start : start + chunk], weights[start : start + chunk]
            log_probs = torch.log_softmax(logits, dim=-1)
            if soft_ids is None:
                total = total + (-(log_probs.gather(1, y[:, None])[:, 0]) * w).sum()
            else:
                ids, probs = soft_ids[start : start + chunk], soft_probs[start : start + chunk]
                total = total + (-(log_probs.gather(1, ids) * probs).sum(1) * w).sum()
            hits[start : start + chunk] = logits.argmax(-1) == y
            if top_k:
                top_columns[start : start + chunk] = logits.topk(top_k, dim=-1).indices
            if grad is not None:
                d_logits = log_probs.exp_()
                if soft_ids is None:
                    d_logits[torch.arange(y.shape[0], device=y.device), y] -= 1.0
                else:
                    d_logits.scatter_add_(1, ids, -probs.to(d_logits.dtype))
                d_logits *= w[:, None]
                grad[start : start + chunk] = (d_logits.to(head_weight.dtype) @ head_weight).to(hidden.dtype)
        ctx.save_for_backward(grad if grad is not None else hidden.new_zeros(0))
        if not top_k:
            ctx.mark_non_differentiable(hits)
            return total, hits
        ctx.mark_non_differentiable(hits, top_columns)
        return total, hits, top_columns

    @staticmethod
    def backward(ctx, grad_total, *unused):
        (grad,) = ctx.saved_tensors
        return grad * grad_total.to(grad.dtype), None, None, None, None, None, None, None


@dataclass
class TrainingVocabulary:
    """The LM-head rows the loss normalises over: all of them, or only tokens the data uses.

    Restricting the softmax to the tokens that occur in the training answers cuts the cost of
    the frozen head (most of a small drafter's step) by the vocabulary ratio. Such a drafter then
    drafts over the same tokens (its `draft_vocab`), and evaluation scores it there: trained to
    rank only those tokens, it would let the untrained rest win a full-vocabulary argmax.
    """

    head_rows: torch.Tensor  # [V', H] rows of the LM head
    columns: TokenColumns  # token ids <-> rows of head_rows (the drafter's draft vocabulary uses the same map)

    @property
    def token_ids(self) -> torch.Tensor | None:
        """[V'] the rows' token ids, ascending; None = the whole vocabulary."""
        return self.columns.token_ids

    @classmethod
    def full(cls, head: TargetHead) -> "TrainingVocabulary":
        return cls(head.lm_head_weight, TokenColumns(None))

    @classmethod
    def from_tokens(cls, head: TargetHead, token_ids: torch.Tensor) -> "TrainingVocabulary":
        token_ids = torch.unique(token_ids).to(head.lm_head_weight.device)
        return cls(head.lm_head_weight[token_ids].contiguous(), TokenColumns(token_ids))

    def map(self, labels: torch.Tensor) -> torch.Tensor:
        """Token ids -> rows of head_rows (-1 where absent)."""
        return self.columns.columns(labels)


def distillation_targets(labels: torch.Tensor, soft_ids: torch.Tensor, soft_logprobs: torch.Tensor, distill_weight: float,
                         vocabulary: "TrainingVocabulary") -> tuple[torch.Tensor, torch.Tensor]:
    """Per row [N] the sparse mixture (1 - α)·one-hot(label) + α·p_target as ids / probs [N, 1 + K].

    p_target is the target's top-K renormalised over the K; ids outside a restricted training
    vocabulary get probability 0 (the rest is not renormalised: the mass stays the target's).
    """
    probs = torch.softmax(soft_logprobs.float(), dim=-1) * distill_weight
    ids = vocabulary.map(soft_ids)
    probs = torch.where(ids >= 0, probs, torch.zeros_like(probs))
    ids = ids.clamp(min=0)
    one_hot = torch.full((labels.shape[0], 1), 1.0 - distill_weight, dtype=probs.dtype, device=probs.device)
    return torch.cat([labels[:, None], ids], dim=1), torch.cat([one_hot, probs], dim=1)


def decay_weights(block_size: int, gamma: float, device=None) -> torch.Tensor:
    """exp(-(k-1)/gamma) for slots k = 1..B-1: early slots matter most, since a draft is only
    accepted up to its first miss."""
    k = torch.arange(1, block_size, device=device, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma)


def default_gamma(block_size: int) -> float:
    """DFlash's decay: 7 for B = 16, 4 for B = 8 (linear in between, a floor of 1)."""
    return max(1.0, {16: 7.0, 8: 4.0}.get(block_size, 4.0 + (block_size - 8) * 3.0 / 8.0))


@dataclass
class TrainingTargets:
    """What the objective needs beside a batch's blocks: built by training only."""

    weights: torch.Tensor  # [blocks, B-1] decayed loss weight (0 where the slot does not exist)
    # The target's top-K next-token ids and log-probs for each drafted slot (its distribution
    # given the true prefix), [blocks, B-1, K]; None when the shards hold none.
    soft_ids: torch.Tensor | None = None
    soft_logprobs: torch.Tensor | None = None
    # [blocks, B-1] each slot's row in a top-K table held on the device (the train split's, beside
    # its features: `train.run.ResidentFeatures`), while soft_ids / soft_logprobs are still None;
    # `with_soft` gathers them there instead of copying them from the host every step.
    soft_rows: torch.Tensor | None = None

    def to(self, device: str) -> "TrainingTargets":
        """Every tensor on `device` (non-blocking: asynchronous from pinned memory)."""
        if device == "cpu":
            return self
        return TrainingTargets(*(None if t is None else t.to(device, non_blocking=True)
                                 for t in (self.weights, self.soft_ids, self.soft_logprobs, self.soft_rows)))

    def with_soft(self, topk_ids: torch.Tensor, topk_logprobs: torch.Tensor) -> "TrainingTargets":
        """The targets with the slots' top-K gathered from the tables (rows as `soft_rows`)."""
        if self.soft_rows is None:
            return self
        return TrainingTargets(self.weights, topk_ids[self.soft_rows].long(), topk_logprobs[self.soft_rows].float())


def training_targets(batch: Batch, samples, gamma: float, *, block_size: int, pin_memory: bool = False,
                     resident_rows: bool = False) -> TrainingTargets:
    """Slot weights exp(-(k-1)/gamma) where the slot exists, and, when every sample carries the
    target's top-K (capture.target_top_k > 0), each slot's target distribution: slot k's token
    follows position a + k - 1, so the distribution captured there.

    `block_size` is the drafter's (its config is the truth of the block geometry): the decay runs
    over its B-1 drafted slots, and a batch packed for another block size is refused.

    `pin_memory` puts the tensors in page-locked memory (a GPU then copies them asynchronously;
    from pageable memory the copy holds the host until it is done). `resident_rows`: the top-K is
    held on the device in the rows of the batch's `feature_rows`, so only each slot's row is
    given (`TrainingTargets.soft_rows`)."""
    if batch.block_size != block_size:
        raise PipelineError(f"train: a batch of blocks of {batch.block_size} for a drafter of block size {block_size}")
    weights = decay_weights(block_size, gamma) * batch.exists.float()
    if pin_memory:
        weights = weights.pin_memory()
    if not all(getattr(s, "target_topk_ids", None) is not None and s.target_topk_ids.shape[-1] > 0 for s in samples):
        return TrainingTargets(weights)
    lengths = torch.tensor([sample.input_ids.shape[0] for sample in samples])
    starts = (torch.cumsum(lengths, 0) - lengths)[batch.block_sequence][:, None]
    slots = batch.anchors[:, None].cpu() + torch.arange(1, block_size)
    rows = starts + slots.clamp(max=lengths[batch.block_sequence][:, None] - 1) - 1  # the position before each slot
    if resident_rows:
        return TrainingTargets(weights, soft_rows=batch.feature_rows[rows])
    # Only the slots' rows are converted (not the whole step's top-K first): the same values.
    soft_ids = torch.cat([sample.target_topk_ids for sample in samples])[rows].long()
    soft_logprobs = torch.cat([sample.target_topk_logprobs for sample in samples])[rows].float()
    if pin_memory:
        soft_ids, soft_logprobs = soft_ids.pin_memory(), soft_logprobs.pin_memory()
    return TrainingTargets(weights, soft_ids, soft_logprobs)


@dataclass
class BlockLoss:
    loss: torch.Tensor  # the step's objective (normalised by the weight total)
    hits: torch.Tensor  # [blocks, B-1] the slot's argmax is the answer
    weight_sum: torch.Tensor  # this rank's slot weights
    extra_stats: dict  # the architecture's extra term's statistics, device tensors (`Architecture.extra_loss`)


def block_loss(drafter: DFlashDrafter, head: TargetHead, batch: Batch, targets: TrainingTargets, *, logits_chunk: int,
               weight_total: torch.Tensor | None = None,
               attention: str = "sdpa", vocabulary: TrainingVocabulary | None = None, distill_weight: float = 0.0,
               loss_options=None) -> BlockLoss:
    """Decayed CE over the drafted slots of a batch, plus the drafter architecture's own term.

    `weight_total` (the sum over all ranks) normalises the loss so data-parallel ranks add up to
    the same objective as one process with the whole batch. `vocabulary` restricts the softmax.
    `targets` are the slots' weights and the target's distributions (`training_targets`).
    `distill_weight` α > 0 mixes the target's captured top-K distribution into each slot's target
    (`targets` must carry it). `loss_options` are the architecture's training-only options
    (`Architecture.loss_options_type`; None: its defaults), e.g. DFlash2's selector weight.
    """
    vocabulary = vocabulary or TrainingVocabulary.full(head)
    embeddings = head.embed(batch.block_ids).to(drafter.fc.weight.dtype)
    hidden = drafter.forward_blocks(batch.features, batch.context_positions, embeddings, batch.block_positions,
                                    batch.attention_mask(attention), attention=attention)
    hidden = batch.drafted(hidden).reshape(-1, hidden.shape[-1])
    labels = vocabulary.map(batch.labels.reshape(-1).to(hidden.device))
    # Slots past the end, outside the answer or outside the vocabulary weigh 0 and cost nothing.
    # Every slot stays in the tensors (no boolean selection): the shapes do not depend on the
    # data, and nothing waits for the device to say how many slots count.
    weights = targets.weights.reshape(-1).to(hidden.device)
    weights = torch.where(labels >= 0, weights, torch.zeros_like(weights))
    labels = labels.clamp(min=0)
    soft_ids = soft_probs = None
    if distill_weight > 0:
        if targets.soft_ids is None:
            raise PipelineError("train.distill_weight > 0 needs the target's top-k in the shards (capture.target_top_k > 0)")
        soft_ids, soft_probs = distillation_targets(
            labels, targets.soft_ids.reshape(-1, targets.soft_ids.shape[-1]).to(hidden.device),
            targets.soft_logprobs.reshape(-1, targets.soft_logprobs.shape[-1]).to(hidden.device), distill_weight, vocabulary)
    member = drafter.architecture
    loss_options = loss_options if loss_options is not None else member.loss_options_type()
    top_k = member.loss_top_k(drafter.config, loss_options)
    total, hits, *top = ChunkedHeadCrossEntropy.apply(hidden, vocabulary.head_rows, labels, weights, logits_chunk, soft_ids, soft_probs,
                                                      top_k)
    anchors = batch.anchor_ids[:, None].to(batch.labels.device)
    predecessors = torch.cat([anchors, batch.labels[:, :-1]], dim=1).reshape(-1).to(hidden.device)  # slot k follows slot k-1's answer
    term, extra_stats = member.extra_loss(drafter, hidden=hidden, head_rows=vocabulary.head_rows, top_columns=top[0] if top_k else None,
                                          labels=labels, predecessors=predecessors, weights=weights, token_ids=vocabulary.token_ids,
                                          loss_options=loss_options)
    if term is not None:
        total = total + term
    weight_sum = weights.sum()
    denominator = weight_total if weight_total is not None else weight_sum
    return BlockLoss(total / denominator.clamp(min=1e-9), (hits & (weights > 0)).view(batch.labels.shape), weight_sum, extra_stats)
