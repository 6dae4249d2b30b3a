"""The drafter's training objective: decayed cross-entropy on the drafted slots, through the
target's frozen LM head, chunk by chunk.

The head (vocabulary x hidden) dominates a small drafter's step, so the loss never materialises
more than `logits_chunk` x vocabulary logits, computes the hidden gradient in the same pass, and
can restrict the softmax to the tokens the training answers use (`TrainingVocabulary`).
"""

from dataclasses import dataclass

import torch

from dflash_pipeline.blocks import Batch
from dflash_pipeline.model import DFlashDrafter
from dflash_pipeline.target import TargetHead


class ChunkedHeadCrossEntropy(torch.autograd.Function):
    """Weighted CE through a frozen LM head, chunk by chunk, with the hidden gradient computed in
    the forward pass: two vocab-sized matmuls per position (the minimum) and never more than
    `chunk` x vocab logits alive. Returns sum(w * CE) and the count of argmax hits."""

    @staticmethod
    def forward(ctx, hidden, head_weight, labels, weights, chunk):
        total = hidden.new_zeros((), dtype=torch.float32)
        hits = torch.zeros(labels.shape, dtype=torch.bool, device=hidden.device)
        grad = torch.zeros_like(hidden) if hidden.requires_grad else None
        for start in range(0, hidden.shape[0], chunk):
            h = hidden[start : start + chunk]
            logits = (h @ head_weight.T).float()
            y, w = labels[start : start + chunk], weights[start : start + chunk]
            log_probs = torch.log_softmax(logits, dim=-1)
            total = total + (-(log_probs.gather(1, y[:, None])[:, 0]) * w).sum()
            hits[start : start + chunk] = logits.argmax(-1) == y
            if grad is not None:
                d_logits = log_probs.exp_()
                d_logits[torch.arange(y.shape[0], device=y.device), y] -= 1.0
                d_logits *= w[:, None]
                grad[start : start + chunk] = (d_logits.to(head_weight.dtype) @ head_weight).to(hidden.dtype)
        ctx.save_for_backward(grad if grad is not None else hidden.new_zeros(0))
        ctx.mark_non_differentiable(hits)
        return total, hits

    @staticmethod
    def backward(ctx, grad_total, grad_hits):
        (grad,) = ctx.saved_tensors
        return grad * grad_total.to(grad.dtype), None, None, None, None


@dataclass
class TrainingVocabulary:
    """The LM-head rows the loss normalises over: all of them, or only tokens the data uses.

    Restricting the softmax to the tokens that occur in the training answers cuts the cost of
    the frozen head (most of a small drafter's step) by the vocabulary ratio. The drafter still
    drafts with the full head; evaluation always scores the full head.
    """

    head_rows: torch.Tensor  # [V', H] rows of the LM head
    index_of: torch.Tensor | None  # [V] full id -> row in head_rows (-1: absent); None = full

    @classmethod
    def full(cls, head: TargetHead) -> "TrainingVocabulary":
        return cls(head.lm_head_weight, None)

    @classmethod
    def from_tokens(cls, head: TargetHead, token_ids: torch.Tensor) -> "TrainingVocabulary":
        token_ids = torch.unique(token_ids).to(head.lm_head_weight.device)
        index_of = torch.full((head.lm_head_weight.shape[0],), -1, dtype=torch.long, device=token_ids.device)
        index_of[token_ids] = torch.arange(token_ids.numel(), device=token_ids.device)
        return cls(head.lm_head_weight[token_ids].contiguous(), index_of)

    def map(self, labels: torch.Tensor) -> torch.Tensor:
        return labels if self.index_of is None else self.index_of[labels]


def block_loss(drafter: DFlashDrafter, head: TargetHead, batch: Batch, *, logits_chunk: int, weight_total: torch.Tensor | None = None,
               attention: str = "sdpa", vocabulary: TrainingVocabulary | None = None):
    """Decayed CE over the drafted slots of a batch: (loss, hits [blocks, B-1], weight sum).

    `weight_total` (the sum over all ranks) normalises the loss so data-parallel ranks add up to
    the same objective as one process with the whole batch. `vocabulary` restricts the softmax.
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
    total, hits = ChunkedHeadCrossEntropy.apply(hidden[keep], vocabulary.head_rows, labels[keep], weights[keep], logits_chunk)
    weight_sum = weights.sum()
    denominator = weight_total if weight_total is not None else weight_sum
    all_hits = torch.zeros(labels.shape, dtype=torch.bool, device=hidden.device)
    all_hits[keep] = hits
    return total / denominator.clamp(min=1e-9), all_hits.view(batch.labels.shape), weight_sum
