"""Stage `train`: a DFlash drafter trained on the captured shards.

Inputs: the train/val shard folders (`shards.py`), the target (only its embedding and LM head
are read, from its weight files) and `TrainConfig`. Outputs: `step_NNNNNN/` checkpoints
(`model.safetensors` + `checkpoint.json`), a resumable `state/` (optimizer, scheduler, RNG),
`metrics.json` and the training curve.

One step: a packed batch of sequences (about `tokens_per_step` context tokens), up to
`anchors_per_sequence` anchors per sequence drawn afresh, every block drafted in one forward
under the DFlash mask, decayed cross-entropy on slots 1..B-1 through a chunked LM head that never
holds more than `logits_chunk` x vocab logits. What a step sees depends only on (seed, step),
so a resumed run, or a torchrun run of any size, replays exactly the same batches.
"""

import json
import math
import os
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from dflash_pipeline.config import TrainConfig, as_dict
from dflash_pipeline.errors import PipelineError
from dflash_pipeline.files import write_json_atomic
from dflash_pipeline.model import (
    DFlashDrafter,
    DrafterConfig,
    TargetHead,
    decay_weights,
    default_gamma,
    dflash_mask,
    mean_ci95,
)
from dflash_pipeline.shards import ShardDataset
from dflash_pipeline.target import TargetInfo

CHECKPOINT_FORMAT_VERSION = 1


# ----------------------------------------------------------------------------- target pieces


def _safetensors_files(model_dir: Path) -> dict[str, Path]:
    """tensor name -> file, from the shard index or the single safetensors file."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: model_dir / file for name, file in weight_map.items()}
    from safetensors import safe_open

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise PipelineError(f"{model_dir}: no safetensors weights (the drafter reads the target's embedding and LM head from them)")
    names = {}
    for file in files:
        with safe_open(file, framework="pt") as handle:
            names.update({name: file for name in handle.keys()})
    return names


def read_target_tensors(model_dir: Path, suffixes: list[str]) -> dict[str, torch.Tensor]:
    """Read only the named tensors (matched by name suffix) from the target's weight files."""
    from safetensors import safe_open

    names = _safetensors_files(model_dir)
    found = {}
    for suffix in suffixes:
        matches = sorted(n for n in names if n == suffix or n.endswith("." + suffix))
        if matches:
            with safe_open(names[matches[0]], framework="pt") as handle:
                found[suffix] = handle.get_tensor(matches[0])
    return found


def load_target_head(target: TargetInfo, *, device: str, dtype: torch.dtype) -> TargetHead:
    """The frozen embedding and LM head, read alone from the weight files (never the whole target)."""
    tensors = read_target_tensors(target.path, ["embed_tokens.weight", "lm_head.weight"])
    if "embed_tokens.weight" not in tensors:
        raise PipelineError(f"{target.path}: no '*embed_tokens.weight' tensor in the target's safetensors files")
    embed = tensors["embed_tokens.weight"]
    head = tensors.get("lm_head.weight", embed)  # tied embeddings store the head once
    if embed.shape[0] != target.vocab_size:
        raise PipelineError(f"{target.path}: embedding has {embed.shape[0]} rows, target.json says vocab {target.vocab_size}")
    return TargetHead(embed.to(device=device, dtype=dtype), head.to(device=device, dtype=dtype))


def choose_mask_token(target: TargetInfo, used_ids: set[int]) -> tuple[int, str]:
    """An embedding row no real token uses, else a special token that never occurs in the data."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target.path)
    if target.vocab_size > len(tokenizer):
        return len(tokenizer), f"first unused embedding row ({len(tokenizer)} tokens, {target.vocab_size} rows)"
    special = sorted(set(tokenizer.all_special_ids) | {i for i in tokenizer.added_tokens_decoder if i < target.vocab_size})
    eos = set(target.eos_token_ids)
    for token_id in sorted(special, key=lambda i: (i in eos, i == tokenizer.pad_token_id, i)):
        if token_id not in used_ids and token_id not in eos:
            return token_id, f"special token {tokenizer.convert_ids_to_tokens(token_id)!r}, absent from the data"
    raise PipelineError("train.mask_token_id: no unused embedding row and every special token occurs in the data; set it explicitly")


def drafter_config_for(target: TargetInfo, config: TrainConfig, *, layer_ids: list[int], mask_token_id: int, extra: dict) -> DrafterConfig:
    """Sizes copied from the target's config.json; depth and block from the train params."""
    from transformers import AutoConfig

    text = AutoConfig.from_pretrained(target.path)
    text = text.get_text_config() if hasattr(text, "get_text_config") else text
    rope = getattr(text, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(text, "rope_theta", 10000.0))
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return DrafterConfig(
        hidden_size=text.hidden_size,
        intermediate_size=text.intermediate_size,
        num_layers=config.num_layers,
        num_attention_heads=text.num_attention_heads,
        num_key_value_heads=getattr(text, "num_key_value_heads", text.num_attention_heads),
        head_dim=head_dim,
        vocab_size=text.vocab_size,
        block_size=config.block_size,
        target_layer_ids=tuple(layer_ids),
        num_target_layers=target.num_layers,
        mask_token_id=mask_token_id,
        rms_norm_eps=float(text.rms_norm_eps),
        rope_theta=float(theta),
        max_position_embeddings=int(getattr(text, "max_position_embeddings", 32768)),
        sliding_window=config.sliding_window,
        extra=extra,
    )


def init_from_target_layers(drafter: DFlashDrafter, target: TargetInfo) -> list[int]:
    """Copy the target's top decoder layers into the drafter's layers (norms and projections).

    Only those layers' tensors are read. q_norm / k_norm stay at one where the target has none.
    """
    count = len(drafter.layers)
    source_layers = list(range(target.num_layers - count, target.num_layers))
    wanted = []
    names = ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
             "self_attn.q_norm.weight", "self_attn.k_norm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
             "mlp.down_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight"]
    for source in source_layers:
        wanted += [f"layers.{source}.{name}" for name in names]
    tensors = read_target_tensors(target.path, wanted)
    state = drafter.state_dict()
    for own_index, source in enumerate(source_layers):
        for name in names:
            tensor = tensors.get(f"layers.{source}.{name}")
            if tensor is not None:
                state[f"layers.{own_index}.{name}"] = tensor.to(state[f"layers.{own_index}.{name}"].dtype)
    drafter.load_state_dict(state)
    return source_layers


# ----------------------------------------------------------------------------- batches


@dataclass
class Batch:
    features: list[torch.Tensor]  # per sequence [S_i, N*H]; together the packed context [C, N*H]
    context_positions: torch.Tensor  # [C]
    block_ids: torch.Tensor  # [Q] anchor token, then mask tokens, per block
    block_positions: torch.Tensor  # [Q]
    mask: torch.Tensor  # [Q, C + Q]
    labels: torch.Tensor  # [blocks, B-1] token each drafted slot should produce
    weights: torch.Tensor  # [blocks, B-1] decayed loss weight (0 where there is nothing to learn)
    context_tokens: int


def valid_anchors(loss_mask: torch.Tensor) -> torch.Tensor:
    """Positions a with loss_mask[a] = loss_mask[a+1] = 1: the anchor is committed answer text and
    there is at least one answer token after it to draft."""
    mask = loss_mask.bool()
    return torch.nonzero(mask[:-1] & mask[1:]).flatten()


def build_batch(samples, *, anchors_per_sequence: int, block_size: int, mask_token_id: int, gamma: float, anchor_seeds: list[int]) -> Batch:
    """Pack sequences and their freshly drawn anchors into one DFlash forward's inputs.

    Each sequence draws its anchors from its own seed, so a sequence gets the same anchors
    whichever rank or batch it lands in."""
    features, context_positions, context_sequence = [], [], []
    block_ids, block_positions, block_sequence, block_anchor, block_index = [], [], [], [], []
    labels, weights = [], []
    decay = decay_weights(block_size, gamma)
    offsets = torch.arange(block_size)
    blocks = 0
    for number, sample in enumerate(samples):
        length = sample.input_ids.shape[0]
        ids = sample.input_ids.long()
        mask = sample.loss_mask.float()
        features.append(sample.features)
        context_positions.append(torch.arange(length))
        context_sequence.append(torch.full((length,), number))
        candidates = valid_anchors(sample.loss_mask)
        if candidates.numel() == 0:
            continue
        take = min(anchors_per_sequence, candidates.numel())
        generator = torch.Generator().manual_seed(anchor_seeds[number])
        anchors = candidates[torch.randperm(candidates.numel(), generator=generator)[:take]].sort().values
        for anchor in anchors.tolist():
            slots = anchor + offsets
            inside = slots < length
            block = torch.full((block_size,), mask_token_id, dtype=torch.long)
            block[0] = ids[anchor]
            block_ids.append(block)
            block_positions.append(slots)
            block_sequence.append(torch.full((block_size,), number))
            block_anchor.append(torch.full((block_size,), anchor))
            block_index.append(torch.full((block_size,), blocks))
            target_slots = slots[1:].clamp(max=length - 1)
            labels.append(ids[target_slots])
            weights.append(decay * mask[target_slots] * inside[1:].float())
            blocks += 1
    if blocks == 0:
        raise PipelineError("train: no sequence in this batch has two answer tokens in a row to anchor a block")
    context_sequence_t, context_positions_t = torch.cat(context_sequence), torch.cat(context_positions)
    mask = dflash_mask(context_sequence_t, context_positions_t, torch.cat(block_sequence), torch.cat(block_anchor), torch.cat(block_index))
    return Batch(
        features=features,
        context_positions=context_positions_t,
        block_ids=torch.cat(block_ids),
        block_positions=torch.cat(block_positions),
        mask=mask,
        labels=torch.stack(labels),
        weights=torch.stack(weights),
        context_tokens=int(context_positions_t.numel()),
    )


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


# ----------------------------------------------------------------------------- metrics


@torch.no_grad()
def teacher_forced_tau(drafter: DFlashDrafter, head: TargetHead, batches: list[Batch], *, attention: str = "sdpa") -> dict:
    """Held-out acceptance length with teacher forcing, on fixed validation blocks.

    For each block anchored at a, the drafter sees the target's features of positions < a and
    drafts slots 1..B-1; tau = 1 + the number of leading slots whose argmax equals the
    target-greedy text. This is what speculative decoding would accept at T = 0 if the committed
    prefix were the target's own, and it needs no target forward, so it is cheap enough to track
    during training. Slots past the answer end count as misses.
    """
    drafter.eval()
    taus, slot_hits, slot_counts = [], None, None
    for batch in batches:
        embeddings = head.embed(batch.block_ids).to(drafter.fc.weight.dtype)
        hidden = drafter.forward_blocks(batch.features, batch.context_positions, embeddings, batch.block_positions, batch.mask,
                                        attention=attention)
        block_size = drafter.config.block_size
        hidden = hidden.view(-1, block_size, hidden.shape[-1])[:, 1:]
        predictions = head.logits(hidden).argmax(-1)  # [blocks, B-1]
        correct = (predictions.cpu() == batch.labels) & (batch.weights > 0)
        accepted = correct.int().cumprod(dim=1).sum(dim=1)
        taus += (1 + accepted).tolist()
        valid = (batch.weights > 0).sum(0)
        slot_hits = correct.sum(0) if slot_hits is None else slot_hits + correct.sum(0)
        slot_counts = valid if slot_counts is None else slot_counts + valid
    drafter.train()
    mean, ci = mean_ci95([float(t) for t in taus])
    accuracy = (slot_hits.float() / slot_counts.clamp(min=1).float()).tolist()
    return {"tau": mean, "tau_ci95": ci, "blocks": len(taus), "slot_accuracy": accuracy}


def fixed_validation_batches(dataset: ShardDataset, *, blocks: int, block_size: int, mask_token_id: int, gamma: float, seed: int,
                             tokens_per_batch: int) -> list[Batch]:
    """The same validation blocks at every evaluation: anchors spread over the val sequences."""
    indices = list(range(len(dataset)))
    random.Random(seed).shuffle(indices)
    lengths = dataset.lengths()
    total_anchors = sum(max(0, int(dataset[i].loss_mask.sum()) - 1) for i in indices)
    per_sequence = max(1, math.ceil(blocks / max(1, len(indices)))) if total_anchors else 0
    batches, pending, pending_tokens, drawn = [], [], 0, 0
    for index in indices:
        if drawn >= blocks:
            break
        pending.append(dataset[index])
        pending_tokens += lengths[index]
        drawn += min(per_sequence, max(0, int(pending[-1].loss_mask.sum()) - 1))
        if pending_tokens >= tokens_per_batch:
            batches.append(build_batch(pending, anchors_per_sequence=per_sequence, block_size=block_size,
                                       mask_token_id=mask_token_id, gamma=gamma, anchor_seeds=[seed + 7919 + i for i in range(len(pending))]))
            pending, pending_tokens = [], 0
    if pending:
        batches.append(build_batch(pending, anchors_per_sequence=per_sequence, block_size=block_size,
                                   mask_token_id=mask_token_id, gamma=gamma, anchor_seeds=[seed + 7919 + i for i in range(len(pending))]))
    return batches


# ----------------------------------------------------------------------------- schedule and plan


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


# ----------------------------------------------------------------------------- checkpoints


def _git_revision() -> str | None:
    import subprocess

    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def save_checkpoint(out_dir: Path, *, step: int, drafter: DFlashDrafter, record: dict, metrics: dict) -> Path:
    """step_NNNNNN/{model.safetensors, checkpoint.json}, renamed into place when complete."""
    from safetensors.torch import save_file

    final = out_dir / f"step_{step:06d}"
    tmp = out_dir / f"step_{step:06d}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    weights = {name: tensor.detach().to("cpu").contiguous() for name, tensor in drafter.state_dict().items()}
    save_file(weights, tmp / "model.safetensors", metadata={"format": "pt"})
    info = {"format_version": CHECKPOINT_FORMAT_VERSION, "step": step, "drafter": drafter.config.to_dict(),
            "git_revision": _git_revision(), "metrics": metrics, **record}
    (tmp / "checkpoint.json").write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    return final


def load_checkpoint(folder: Path, *, device: str = "cpu") -> tuple[DFlashDrafter, dict]:
    """A drafter from a step folder: weights from safetensors (no pickle), config from its JSON."""
    from safetensors.torch import load_file

    try:
        info = json.loads((Path(folder) / "checkpoint.json").read_text())
    except FileNotFoundError:
        raise PipelineError(f"{folder}: no checkpoint.json (not a checkpoint folder)") from None
    if info.get("format_version") != CHECKPOINT_FORMAT_VERSION:
        raise PipelineError(f"{folder}/checkpoint.json: format_version {info.get('format_version')!r}, expected {CHECKPOINT_FORMAT_VERSION}")
    drafter = DFlashDrafter(DrafterConfig.from_dict(info["drafter"]))
    drafter.load_state_dict(load_file(Path(folder) / "model.safetensors", device="cpu"))
    return drafter.to(device), info


def list_checkpoints(out_dir: Path) -> list[Path]:
    return sorted(p for p in Path(out_dir).glob("step_*") if p.is_dir() and not p.name.endswith(".tmp") and (p / "checkpoint.json").is_file())


def _save_state(out_dir: Path, *, step: int, optimizer, curve: list[dict], record: dict) -> None:
    """Everything needed to continue exactly, in ONE file replaced atomically: step, optimizer
    moments, RNG, curve so far and the run's settings. (Two files written one after the other
    let a kill between them pair one step's optimizer with another step's weights.) state.json
    repeats step, curve and settings for people and tools; resuming never reads it."""
    state = {"step": step, "optimizer": optimizer.state_dict(), "torch_rng": torch.get_rng_state(), "curve": curve, "record": record}
    tmp = out_dir / "state.pt.tmp"
    torch.save(state, tmp)
    os.replace(tmp, out_dir / "state.pt")
    write_json_atomic(out_dir / "state.json", {"step": step, "curve": curve, **record})


def _resume_point(out_dir: Path, record: dict) -> dict | None:
    """The saved state (state.pt) when it belongs to this exact run configuration, else None."""
    try:
        state = torch.load(out_dir / "state.pt", weights_only=True)
    except FileNotFoundError:
        return None
    except Exception:  # not loadable as plain tensors and containers (another program's file): start fresh
        return None
    if state.get("record") != record or not (out_dir / f"step_{state['step']:06d}").is_dir():
        return None
    return state


# ----------------------------------------------------------------------------- the stage


def check_contract(manifest, *, target: TargetInfo, drafter_config: DrafterConfig | None = None, source: str) -> None:
    """Stop before step 1 when the shards disagree with the target or the drafter, naming the field."""
    expected = {"target_fingerprint": target.fingerprint, "hidden_size": target.hidden_size, "num_target_layers": target.num_layers}
    if drafter_config is not None:
        expected["layer_ids"] = list(drafter_config.target_layer_ids)
        expected["feature_width"] = drafter_config.feature_width
    for name, value in expected.items():
        actual = getattr(manifest, name)
        if actual != value:
            raise PipelineError(f"{source}: manifest {name} is {actual!r}, but the {'drafter' if name in ('layer_ids', 'feature_width') else 'target'} has {value!r}")


def _used_token_ids(*datasets: ShardDataset) -> set[int]:
    used: set[int] = set()
    for dataset in datasets:
        for index in range(len(dataset)):
            used.update(torch.unique(dataset[index].input_ids).tolist())
    return used


def _all_reduce(tensor: torch.Tensor, world: int) -> torch.Tensor:
    if world > 1:
        import torch.distributed as dist

        dist.all_reduce(tensor)
    return tensor


def run_train(
    config: TrainConfig,
    *,
    target: TargetInfo,
    train_dir: Path,
    val_dir: Path,
    out_dir: Path,
    device: str,
    log=print,
) -> dict:
    """Train (or resume) a drafter; return the final metrics. Rank 0 writes every file."""
    import torch.distributed as dist
    from tqdm import tqdm

    from dflash_pipeline.shards import open_split

    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    if world > 1 and not dist.is_initialized():
        if device.startswith("cuda"):
            device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
            torch.cuda.set_device(device)
        dist.init_process_group(backend="nccl" if device.startswith("cuda") else "gloo")
    on_gpu = device.startswith("cuda")
    attention = config.attention if config.attention != "auto" else ("flex" if on_gpu else "sdpa")
    torch.manual_seed(config.seed)
    if not on_gpu:
        torch.use_deterministic_algorithms(True, warn_only=True)

    train_set = open_split(train_dir, expected_fingerprint=target.fingerprint)
    val_set = open_split(val_dir, expected_fingerprint=target.fingerprint)
    manifest = train_set.manifest
    check_contract(manifest, target=target, source=str(train_dir / "manifest.json"))
    check_contract(val_set.manifest, target=target, source=str(val_dir / "manifest.json"))
    if val_set.manifest.layer_ids != manifest.layer_ids:
        raise PipelineError(f"{val_dir / 'manifest.json'}: layer_ids {val_set.manifest.layer_ids} differ from train's {manifest.layer_ids}")

    if config.mask_token_id is not None:
        mask_token_id, mask_reason = config.mask_token_id, "set in params (train.mask_token_id)"
        if not 0 <= mask_token_id < target.vocab_size:
            raise PipelineError(f"params.yaml: train.mask_token_id {mask_token_id} is outside the vocabulary (0..{target.vocab_size - 1})")
    else:
        mask_token_id, mask_reason = choose_mask_token(target, _used_token_ids(train_set, val_set))
    gamma = config.gamma if config.gamma is not None else default_gamma(config.block_size)
    drafter_config = drafter_config_for(target, config, layer_ids=manifest.layer_ids, mask_token_id=mask_token_id,
                                        extra={"mask_token": mask_reason, "gamma": gamma})
    check_contract(manifest, target=target, drafter_config=drafter_config, source=str(train_dir / "manifest.json"))

    drafter = DFlashDrafter(drafter_config)
    init_note = "random"
    if config.init == "target_top_layers":
        init_note = f"target layers {init_from_target_layers(drafter, target)} and final norm"
        # The frozen head reads what the target's final norm produces; start the drafter's there.
        final_norm = read_target_tensors(target.path, ["norm.weight"]).get("norm.weight")
        if final_norm is not None and final_norm.shape == drafter.norm.weight.shape:
            drafter.norm.weight.data.copy_(final_norm.float())
    drafter.to(device).train()
    head = load_target_head(target, device=device, dtype=torch.bfloat16 if on_gpu else torch.float32)
    if config.train_vocab == "data":
        answer_tokens = torch.cat([train_set[i].input_ids[train_set[i].loss_mask.bool()].long() for i in range(len(train_set))])
        vocabulary = TrainingVocabulary.from_tokens(head, answer_tokens)
    else:
        vocabulary = TrainingVocabulary.full(head)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=config.lr, weight_decay=config.weight_decay, betas=(0.9, 0.95))

    out_dir.mkdir(parents=True, exist_ok=True)
    record = {"train_config": as_dict(config), "target_fingerprint": target.fingerprint,
              "shards": {"train": manifest.tokens, "val": val_set.manifest.tokens, "layer_ids": manifest.layer_ids,
                         "feature_dtype": manifest.feature_dtype}}
    start_step, curve = 0, []
    resume = _resume_point(out_dir, record) if config.resume else None
    if resume is not None:
        drafter_state, _ = load_checkpoint(out_dir / f"step_{resume['step']:06d}")
        drafter.load_state_dict(drafter_state.state_dict())
        optimizer.load_state_dict(resume["optimizer"])
        torch.set_rng_state(resume["torch_rng"])
        start_step, curve = resume["step"], resume["curve"]
        if rank == 0:
            log(f"train: resuming at step {start_step} from {out_dir / f'step_{start_step:06d}'}")
    elif rank == 0:
        stale = list_checkpoints(out_dir)
        if stale:
            log(f"train: starting fresh; removing {len(stale)} checkpoint(s) of a different run configuration")
        for folder in stale:
            shutil.rmtree(folder)
        for name in ("state.pt", "state.json"):
            (out_dir / name).unlink(missing_ok=True)
    if world > 1:
        dist.barrier()

    lengths = train_set.lengths()
    plan = plan_steps(lengths, tokens_per_step=config.tokens_per_step, max_steps=config.max_steps, seed=config.seed)
    val_batches = fixed_validation_batches(val_set, blocks=config.eval_blocks, block_size=config.block_size,
                                           mask_token_id=mask_token_id, gamma=gamma, seed=config.seed,
                                           tokens_per_batch=config.tokens_per_step) if rank == 0 else []
    if rank == 0:
        log(f"train: drafter {config.num_layers} layer(s), {sum(p.numel() for p in drafter.parameters()) / 1e6:.1f}M params "
            f"(init {init_note}); block {config.block_size}, gamma {gamma}; softmax over {vocabulary.head_rows.shape[0]} tokens; mask token {mask_token_id} ({mask_reason}); "
            f"{len(train_set)} train sequences / {manifest.tokens:,} tokens; {config.max_steps} steps on {device} x{world}, {attention} attention")

    def evaluate(step: int) -> dict:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=on_gpu):
            result = teacher_forced_tau(drafter, head, [_to(b, device) for b in val_batches], attention=attention)
        return result

    bar = tqdm(total=config.max_steps, initial=start_step, desc="train", unit="step", disable=rank != 0, dynamic_ncols=True)
    started, tokens_seen, recent = time.perf_counter(), 0, []
    metrics: dict = {}
    last_saved = start_step
    try:
        for step in range(start_step, config.max_steps):
            lr = learning_rate(step, max_steps=config.max_steps, base_lr=config.lr, warmup_fraction=config.warmup_fraction)
            for group in optimizer.param_groups:
                group["lr"] = lr
            indices = plan[step]
            seeds = [config.seed * 1_000_003 + step * 10_007 + position for position in range(len(indices))]
            mine = list(range(rank, len(indices), world))
            batch = build_batch([train_set[indices[i]] for i in mine], anchors_per_sequence=config.anchors_per_sequence,
                                block_size=config.block_size, mask_token_id=mask_token_id, gamma=gamma,
                                anchor_seeds=[seeds[i] for i in mine])
            batch = _to(batch, device)
            weight_total = _all_reduce(batch.weights.sum().to(device), world)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=on_gpu):
                loss, hits, _ = block_loss(drafter, head, batch, logits_chunk=config.logits_chunk, weight_total=weight_total,
                                           attention=attention, vocabulary=vocabulary)
            hits = hits.cpu()
            loss_value = _all_reduce(loss.detach().clone(), world)
            if not torch.isfinite(loss_value):
                raise PipelineError(
                    f"train: loss is {loss_value.item()} at step {step}; stopped, last good checkpoint "
                    f"{list_checkpoints(out_dir)[-1].name if list_checkpoints(out_dir) else '(none)'} kept"
                )
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if world > 1:
                for parameter in drafter.parameters():
                    if parameter.grad is not None:
                        dist.all_reduce(parameter.grad)
            grad_norm = torch.nn.utils.clip_grad_norm_(drafter.parameters(), config.grad_clip)
            optimizer.step()
            tokens_seen += int(_all_reduce(torch.tensor(float(batch.context_tokens), device=device), world).item())
            row = {"step": step + 1, "loss": round(loss_value.item(), 6), "lr": lr, "grad_norm": round(float(grad_norm), 4),
                   "seconds": round(time.perf_counter() - started, 2),
                   "slot1_acc": round(float(hits[:, 0][batch.weights[:, 0] > 0].float().mean()), 4) if hits.numel() else None}
            recent = (recent + [loss_value.item()])[-20:]
            if rank == 0 and ((step + 1) % config.eval_every == 0 or step + 1 == config.max_steps):
                result = evaluate(step + 1)
                row.update(tau=round(result["tau"], 4), tau_ci95=round(result["tau_ci95"], 4),
                           slot_accuracy=[round(a, 4) for a in result["slot_accuracy"]])
            if rank == 0:
                curve.append(row)
            elapsed = time.perf_counter() - started
            bar.set_postfix_str(f"loss {sum(recent) / len(recent):.3f} {tokens_seen / elapsed:.0f} tok/s"
                                + (f" tau {curve[-1]['tau']:.3f}" if rank == 0 and "tau" in curve[-1] else ""), refresh=False)
            bar.update(1)
            if (step + 1) % config.save_every == 0 or step + 1 == config.max_steps:
                if rank == 0:
                    latest_tau = next((r for r in reversed(curve) if "tau" in r), {})
                    metrics = {"step": step + 1, "loss": round(sum(recent) / len(recent), 6),
                               "tau_tf": latest_tau.get("tau"), "tau_tf_ci95": latest_tau.get("tau_ci95")}
                    save_checkpoint(out_dir, step=step + 1, drafter=drafter, record=record, metrics=metrics)
                    _save_state(out_dir, step=step + 1, optimizer=optimizer, curve=curve, record=record)
                    last_saved = step + 1
                if world > 1:
                    dist.barrier()
    finally:
        bar.close()
        if world > 1 and dist.is_initialized():
            dist.destroy_process_group()
    elapsed = time.perf_counter() - started
    final = next((r for r in reversed(curve) if "tau" in r), {})
    return {
        "steps": config.max_steps,
        "resumed_from": start_step,
        "last_checkpoint": last_saved,
        "loss": round(sum(recent) / len(recent), 6) if recent else None,
        "tau_tf": final.get("tau"),
        "tau_tf_ci95": final.get("tau_ci95"),
        "slot_accuracy": final.get("slot_accuracy"),
        "tokens_per_s": round(tokens_seen / elapsed, 1) if elapsed > 0 and tokens_seen else None,
        "seconds": round(elapsed, 1),
        "curve": curve,
        "mask_token_id": mask_token_id,
    }


def _to(batch: Batch, device: str) -> Batch:
    if device == "cpu":
        return batch
    moved = {k: (v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) and k not in ("labels", "weights") else v)
             for k, v in batch.__dict__.items()}
    moved["features"] = [piece.to(device, non_blocking=True) for piece in batch.features]
    return Batch(**moved)
