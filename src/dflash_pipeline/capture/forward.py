"""The target forward of one capture batch: the tapped layers' outputs, the target's greedy next
token and its top-k log-probabilities at every position, on their way to the host (`CapturedBatch`).
"""

import time
from dataclasses import dataclass
from typing import NamedTuple

from dflash_pipeline.capture.plan import Sequence
from dflash_pipeline.target.load import LayerTap
from dflash_pipeline.target.placement import model_device


class Captured(NamedTuple):
    """One sequence's capture: features [S, W], the target's greedy next token [S], and its
    `top_k` most probable next tokens [S, K] with their log-probabilities [S, K]."""

    features: "object"
    target_next: "object"
    topk_ids: "object"
    topk_logprobs: "object"


def _head_outputs(model, flat, *, top_k: int, logits_chunk: int):
    """Greedy next token, top-k ids and log-probs of every row of flat [T, H], chunk by chunk."""
    import torch

    argmax, ids, logprobs = [], [], []
    for start in range(0, flat.shape[0], logits_chunk):
        logits = model.lm_head(flat[start : start + logits_chunk]).float()
        argmax.append(logits.argmax(-1))
        if top_k:
            values, indices = torch.log_softmax(logits, dim=-1).topk(top_k, dim=-1, sorted=True)
            ids.append(indices)
            logprobs.append(values)
    empty = flat.new_zeros((flat.shape[0], 0))
    return (torch.cat(argmax), torch.cat(ids) if ids else empty.long(), torch.cat(logprobs) if logprobs else empty.float())


@dataclass
class CapturedBatch:
    """One padded batch's outputs on the host, one tensor per column (`rows` slices them per
    sequence as views). On a GPU each column came back in one non-blocking copy into pinned
    memory; `wait` blocks until those copies have landed (the one wait of a batch)."""

    lengths: list[int]
    features: "object"  # [rows, width, W]: bf16 when the shards store bf16, else the compute dtype
    target_next: "object"  # [rows, width] int32
    topk_ids: "object"  # [rows, width, K] int32
    topk_logprobs: "object"  # [rows, width, K] float32
    copied: "object" = None  # a CUDA event recorded after the copies, or None

    def wait(self) -> "CapturedBatch":
        if self.copied is not None:
            self.copied.synchronize()
            self.copied = None
        return self

    def rows(self) -> list["Captured"]:
        self.wait()
        return [Captured(self.features[row, :length], self.target_next[row, :length], self.topk_ids[row, :length],
                         self.topk_logprobs[row, :length]) for row, length in enumerate(self.lengths)]


def _to_host(tensor, dtype):
    """`tensor` as `dtype` on the host: itself on a CPU; on a GPU converted there, then one
    non-blocking copy into pinned memory (the caller waits on an event before reading it)."""
    import torch

    tensor = tensor.to(dtype)
    if tensor.device.type != "cuda":
        return tensor
    host = torch.empty(tensor.shape, dtype=dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    return host


def capture_batch(model, tap: LayerTap, batch: list[Sequence], *, pad_id: int, top_k: int = 0, logits_chunk: int = 2048,
                  feature_dtype: str | None = None) -> CapturedBatch:
    """Run one right-padded batch; its outputs start on their way to the host (see CapturedBatch).

    Right padding needs no attention mask: with causal attention a real token never sees the
    padding after it. The LM head runs in chunks of positions, so [tokens, vocab] logits for the
    whole batch never exist at once. With `feature_dtype` "bf16" the features are rounded to bf16
    on the device (half the bytes to copy; the same rounding the writer would do).
    """
    import torch

    device = model_device(model)
    lengths = [len(s.input_ids) for s in batch]
    width = max(lengths)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    for row, sequence in enumerate(batch):
        input_ids[row, : lengths[row]] = torch.tensor(sequence.input_ids)
    with torch.inference_mode():
        hidden = model.get_decoder()(input_ids=input_ids.to(device), use_cache=False).last_hidden_state
        flat = hidden.reshape(-1, hidden.shape[-1])
        next_tokens, topk_ids, topk_logprobs = _head_outputs(model, flat, top_k=top_k, logits_chunk=logits_chunk)
        features = tap.features()
        result = CapturedBatch(
            lengths,
            _to_host(features, torch.bfloat16 if feature_dtype == "bf16" else features.dtype),
            _to_host(next_tokens.view(len(batch), width), torch.int32),
            _to_host(topk_ids.view(len(batch), width, top_k), torch.int32),
            _to_host(topk_logprobs.view(len(batch), width, top_k), torch.float32),
        )
        if device.type == "cuda":
            result.copied = torch.cuda.Event()
            result.copied.record()
    return result


def forward_batch(model, tap: LayerTap, batch: list[Sequence], *, pad_id: int, top_k: int = 0, logits_chunk: int = 2048) -> list[Captured]:
    """Run one right-padded batch; return each sequence's `Captured` outputs (on the host)."""
    return capture_batch(model, tap, batch, pad_id=pad_id, top_k=top_k, logits_chunk=logits_chunk).rows()


def warmup_tokens_per_s(model, tap, sequences: list[Sequence], pad_id: int) -> float:
    """Time one small forward to estimate the run's duration before it starts."""
    sample = sorted(sequences, key=lambda s: len(s.input_ids))[: max(1, min(len(sequences), 4))]
    forward_batch(model, tap, sample, pad_id=pad_id)  # first call pays one-time costs
    started = time.perf_counter()
    forward_batch(model, tap, sample, pad_id=pad_id)
    return sum(len(s.input_ids) for s in sample) / max(time.perf_counter() - started, 1e-6)
