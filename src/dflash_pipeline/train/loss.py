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

A DFlash2 drafter adds its selector's term (`selector_loss`, weight `selector_weight`): for every
drafted slot, a K-way cross-entropy of the answer token among the slot's top-K candidates (the
same head pass picks them), scored with the answer's previous token as predecessor (teacher
forcing, as the walk starts from the verified anchor). Where the answer token is not among the K
it takes the K-th candidate's place, so every slot teaches the selector something. Our reading
of SpecForge's DFlash2 objective (sgl-project/SpecForge#772: alpha-weighted selector CE, gold
inserted when missing), with our slot weights and normaliser so it adds up across ranks as the
main term does; the unary scores keep their gradient into the drafter, as there.
"""

from dataclasses import dataclass

import torch

from dflash_pipeline.data.blocks import Batch
from dflash_pipeline.errors import PipelineError
from dflash_pipeline.drafters.core import DFlashDrafter
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
    index_of: torch.Tensor | None  # [V] full id -> row in head_rows (-1: absent); None = full
    token_ids: torch.Tensor | None = None  # [V'] the rows' token ids, ascending; None = full

    @classmethod
    def full(cls, head: TargetHead) -> "TrainingVocabulary":
        return cls(head.lm_head_weight, None)

    @classmethod
    def from_tokens(cls, head: TargetHead, token_ids: torch.Tensor) -> "TrainingVocabulary":
        token_ids = torch.unique(token_ids).to(head.lm_head_weight.device)
        index_of = torch.full((head.lm_head_weight.shape[0],), -1, dtype=torch.long, device=token_ids.device)
        index_of[token_ids] = torch.arange(token_ids.numel(), device=token_ids.device)
        return cls(head.lm_head_weight[token_ids].contiguous(), index_of, token_ids)

    def map(self, labels: torch.Tensor) -> torch.Tensor:
        return labels if self.index_of is None else self.index_of[labels]


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


def selector_loss(selector, hidden: torch.Tensor, head_rows: torch.Tensor, columns: torch.Tensor, labels: torch.Tensor,
                  predecessors: torch.Tensor, weights: torch.Tensor, *, token_ids: torch.Tensor | None = None):
    """sum(w * CE) of the answer among each slot's candidates, and whether it was among them.

    hidden [N, H] drafted slots; head_rows [V', H] the head rows the columns index; columns [N, K]
    each slot's top-K columns, best first; labels [N] the answer's column; predecessors [N] the
    token id before the answer (the anchor for slot 1); weights [N]; token_ids [V'] column ->
    token id (None: columns are token ids). Returns (total, covered [N], hits [N]): covered =
    the answer was in the top-K as drafted, hits = the selector ranks it first (teacher-forced).
    """
    present = columns == labels[:, None]
    covered = present.any(dim=1)
    columns = columns.clone()
    columns[~covered, -1] = labels[~covered]  # the answer replaces the weakest candidate
    target = (columns == labels[:, None]).int().argmax(dim=1)
    rows = head_rows[columns]  # [N, K, H]; differentiable through hidden only (the head is frozen)
    unary = torch.einsum("nh,nkh->nk", hidden.to(rows.dtype), rows).float()
    candidates = columns if token_ids is None else token_ids[columns]
    scores = selector.pair_scores(hidden, unary, candidates, predecessors)
    cross_entropy = torch.logsumexp(scores, dim=1) - scores.gather(1, target[:, None])[:, 0]
    return (cross_entropy * weights).sum(), covered, scores.argmax(dim=1) == target


def block_loss(drafter: DFlashDrafter, head: TargetHead, batch: Batch, *, logits_chunk: int, weight_total: torch.Tensor | None = None,
               attention: str = "sdpa", vocabulary: TrainingVocabulary | None = None, distill_weight: float = 0.0,
               selector_weight: float = 0.0, stats: dict | None = None):
    """Decayed CE over the drafted slots of a batch: (loss, hits [blocks, B-1], weight sum).

    `weight_total` (the sum over all ranks) normalises the loss so data-parallel ranks add up to
    the same objective as one process with the whole batch. `vocabulary` restricts the softmax.
    `distill_weight` α > 0 mixes the target's captured top-K distribution into each slot's target
    (the batch must carry it). `selector_weight` > 0 adds a DFlash2 drafter's selector term
    (`selector_loss`), with the same slot weights and normaliser; `stats`, if given, receives its
    sums (selector_loss, selector_covered, selector_hits, selector_slots).
    """
    vocabulary = vocabulary or TrainingVocabulary.full(head)
    block_size = drafter.config.block_size
    embeddings = head.embed(batch.block_ids).to(drafter.fc.weight.dtype)
    hidden = drafter.forward_blocks(batch.features, batch.context_positions, embeddings, batch.block_positions, batch.mask,
                                    attention=attention)
    hidden = hidden.view(-1, block_size, hidden.shape[-1])[:, 1:].reshape(-1, hidden.shape[-1])
    labels, weights = batch.labels.reshape(-1), batch.weights.reshape(-1).to(hidden.device)
    labels = vocabulary.map(labels.to(hidden.device))
    keep = (weights > 0) & (labels >= 0)  # slots past the end, outside the answer or vocabulary cost nothing
    soft_ids = soft_probs = None
    if distill_weight > 0:
        if batch.soft_ids is None:
            raise PipelineError("train.distill_weight > 0 needs the target's top-k in the shards (capture.target_top_k > 0)")
        soft_ids, soft_probs = distillation_targets(
            labels[keep], batch.soft_ids.reshape(-1, batch.soft_ids.shape[-1]).to(hidden.device)[keep],
            batch.soft_logprobs.reshape(-1, batch.soft_logprobs.shape[-1]).to(hidden.device)[keep], distill_weight, vocabulary)
    with_selector = selector_weight > 0 and drafter.config.architecture == "dflash2"
    top_k = drafter.config.selector_top_k if with_selector else 0
    total, hits, *top = ChunkedHeadCrossEntropy.apply(hidden[keep], vocabulary.head_rows, labels[keep], weights[keep],
                                                      logits_chunk, soft_ids, soft_probs, top_k)
    if with_selector:
        anchors = batch.block_ids.view(-1, block_size)[:, :1].to(batch.labels.device)
        predecessors = torch.cat([anchors, batch.labels[:, :-1]], dim=1).reshape(-1).to(hidden.device)  # slot k follows slot k-1's answer
        term, covered, selector_hits = selector_loss(drafter.candidate_selector, hidden[keep], vocabulary.head_rows, top[0],
                                                     labels[keep], predecessors[keep], weights[keep], token_ids=vocabulary.token_ids)
        total = total + selector_weight * term
        if stats is not None:
            stats.update(selector_loss=float(term.detach()), selector_covered=int(covered.sum()), selector_hits=int(selector_hits.sum()),
                         selector_slots=int(covered.numel()))
    weight_sum = weights.sum()
    denominator = weight_total if weight_total is not None else weight_sum
    all_hits = torch.zeros(labels.shape, dtype=torch.bool, device=hidden.device)
    all_hits[keep] = hits
    return total / denominator.clamp(min=1e-9), all_hits.view(batch.labels.shape), weight_sum
