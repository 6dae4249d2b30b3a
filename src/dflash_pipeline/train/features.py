"""The train split's features as the drafter sees them: uploaded whole to the device when they fit
(`ResidentFeatures`), and the per-channel RMS scale a `feature_norm: channel_rms` drafter starts
from (`channel_rms_scale`)."""

from dataclasses import dataclass

import torch

from dflash_pipeline.data.shards import ShardDataset


@dataclass
class ResidentFeatures:
    """The whole train split's features in one device tensor, uploaded once: a step then gathers
    its rows on the device (`Batch.with_features`) instead of copying ~6 KB per token from the
    host. The bench's split is 1.4 GB, an H200 holds 141 GB. The target's top-K (when the shards
    hold it) rides along in the same rows, ~0.1 KB per token at K = 16: a step gathers its slots'
    distributions there too (`TrainingTargets.with_soft`)."""

    table: torch.Tensor  # [tokens of the split, N*H]
    starts: list[int]  # row of each sequence's first token
    topk_ids: torch.Tensor | None = None  # [tokens of the split, K] int32, as the shards store them
    topk_logprobs: torch.Tensor | None = None  # [tokens of the split, K] float32

    # At most this share of the device's free memory: the step's activations need the rest.
    SHARE_OF_FREE_MEMORY = 0.25

    @classmethod
    def upload(cls, dataset: ShardDataset, lengths: list[int], device: str, *, budget_bytes: int | None = None) -> "ResidentFeatures | None":
        """The split on `device`, or None when it would take more than `budget_bytes` (default: a
        quarter of the device's free memory)."""
        first = dataset[0]
        width = first.features.shape[1]
        top_k = first.target_topk_ids.shape[-1] if getattr(first, "target_topk_ids", None) is not None else 0
        needed = sum(lengths) * (width * 2 + top_k * 8)  # bf16 features, int32 ids, fp32 log-probs
        if budget_bytes is None:
            free, _ = torch.cuda.mem_get_info(torch.device(device))
            budget_bytes = int(free * cls.SHARE_OF_FREE_MEMORY)
        if needed > budget_bytes:
            return None
        tokens = sum(lengths)
        table = torch.empty((tokens, width), dtype=torch.bfloat16, device=device)
        topk_ids = topk_logprobs = None
        if top_k:
            topk_ids = torch.empty((tokens, top_k), dtype=torch.int32, device=device)
            topk_logprobs = torch.empty((tokens, top_k), dtype=torch.float32, device=device)
        starts, row = [], 0
        for index, length in enumerate(lengths):
            starts.append(row)
            sample = dataset[index]
            table[row : row + length].copy_(sample.features)
            if top_k:
                topk_ids[row : row + length].copy_(sample.target_topk_ids)
                topk_logprobs[row : row + length].copy_(sample.target_topk_logprobs)
            row += length
        return cls(table, starts, topk_ids, topk_logprobs)


def channel_rms_scale(train_set, *, max_tokens: int = 65536) -> torch.Tensor:
    """One over each feature channel's RMS over the first `max_tokens` train tokens (every
    position, the attention-sink first token included), in float64 so it does not depend on
    summation order."""
    total, count = None, 0
    for index in range(len(train_set)):
        features = train_set[index].features[: max_tokens - count].double()
        squares = features.pow(2).sum(0)
        total = squares if total is None else total + squares
        count += features.shape[0]
        if count >= max_tokens:
            break
    rms = (total / max(count, 1)).sqrt()
    return (1.0 / rms.clamp(min=1e-6)).float()
