"""Stage `train`: a DFlash drafter trained on the captured shards.

    run_train = setup_run (shards, drafter, head, optimizer, plan; resume or start fresh)
              + a loop of train_step (one optimizer step), validation_tau every eval_every steps
                and a checkpoint every save_every steps (`checkpoints`)

Inputs: the train/val shard folders (`shards`), the target (only its embedding and LM head are
read, from its weight files) and `TrainConfig`. Outputs in the checkpoints folder: `step_NNNNNN/`
checkpoints and the resume state (`checkpoints` describes both); the stage script writes the
metrics and curves (`report`).

One step: a packed batch of sequences (about `tokens_per_step` context tokens), up to
`anchors_per_sequence` anchors per sequence drawn afresh (`blocks`), every block drafted in one
forward under the DFlash mask, decayed cross-entropy on slots 1..B-1 through a chunked LM head
that never holds more than `logits_chunk` x vocab logits, plus the architecture's own term
(`Architecture.extra_loss`, e.g. DFlash2's selector). What a step sees depends only on
(seed, step), so a resumed run, or a torchrun run of any size, replays exactly the same batches.
"""

import math
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dflash_pipeline.data.blocks import Batch, build_batch, training_anchor_seed
from dflash_pipeline.drafters.checkpoints import (
    list_checkpoints,
    load_resume_state,
    record_changes,
    remove_checkpoints,
    save_step,
    step_folder,
)
from dflash_pipeline.foundation.config import TrainConfig
from dflash_pipeline.foundation.devices import READ_EVERY, autocast, bf16_by_default
from dflash_pipeline.drafters.build import choose_architecture, choose_mask_token, drafter_config_for, new_drafter
from dflash_pipeline.foundation.errors import PipelineError
from dflash_pipeline.foundation.files import sha256_file
from dflash_pipeline.train.loss import TrainingTargets, TrainingVocabulary, block_loss, default_gamma, training_targets
from dflash_pipeline.drafters.core import DFlashDrafter
from dflash_pipeline.drafters.config import DrafterConfig
from dflash_pipeline.measure.scoring import per_slot_acceptance, score_teacher_forced
from dflash_pipeline.data.shards import ShardDataset, open_split
from dflash_pipeline.foundation.stats import mean_ci95_over_prompts
from dflash_pipeline.target.load import TargetHead, TargetInfo, load_target_head


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


@dataclass
class TrainingRun:
    """Everything a training step needs, set up once by `setup_run`."""

    config: TrainConfig
    drafter: DFlashDrafter
    head: TargetHead
    vocabulary: TrainingVocabulary
    optimizer: torch.optim.Optimizer
    train_set: ShardDataset
    val_set: ShardDataset
    plan: list[list[int]]  # sequence indices of every step
    mask_token_id: int
    gamma: float
    record: dict  # what makes two runs the same run (resume only continues an equal record)
    device: str
    attention: str
    loss_options: object = None  # the architecture's training-only options (`Architecture.loss_options_type`)
    world: int = 1
    rank: int = 0
    bf16: bool | None = None  # bf16 autocast; None: on CUDA only (`devices.autocast`)
    lengths: list = field(default_factory=list)  # every train sequence's length
    resident: ResidentFeatures | None = None  # the train split's features on the device (a GPU, when they fit)
    static_shape: tuple | None = None  # (context tokens, blocks) every step is padded to when compiled
    compile_backend: str = "inductor"  # torch.compile's backend (tests use "aot_eager")
    loss_fn: object = None  # block_loss with the run's settings, compiled or not (`_loss_function`)
    start_step: int = 0
    last_saved: int = 0  # the newest checkpoint's step
    curve: list = field(default_factory=list)
    recent_losses: list = field(default_factory=list)  # the last LOSS_WINDOW losses (the reported loss is their mean)
    tokens_seen: int = 0  # context tokens of every step so far, over all ranks, resumed runs included
    seconds: float = 0.0  # training time so far, resumed runs included


LOSS_WINDOW = 20


def _init_distributed(device: str) -> tuple[str, int, int]:
    """(device, world, rank); joins the torchrun process group when there is one."""
    import torch.distributed as dist

    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    if world > 1 and not dist.is_initialized():
        if device.startswith("cuda"):
            device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
            torch.cuda.set_device(device)
        dist.init_process_group(backend="nccl" if device.startswith("cuda") else "gloo")
    return device, world, rank


def _open_shards(target: TargetInfo, train_dir: Path, val_dir: Path) -> tuple[ShardDataset, ShardDataset]:
    train_set = open_split(train_dir, expected_fingerprint=target.fingerprint)
    val_set = open_split(val_dir, expected_fingerprint=target.fingerprint)
    check_contract(train_set.manifest, target=target, source=str(train_dir / "manifest.json"))
    check_contract(val_set.manifest, target=target, source=str(val_dir / "manifest.json"))
    if val_set.manifest.layer_ids != train_set.manifest.layer_ids:
        raise PipelineError(f"{val_dir / 'manifest.json'}: layer_ids {val_set.manifest.layer_ids} differ from train's "
                            f"{train_set.manifest.layer_ids}")
    for name, dataset, folder in (("train", train_set, train_dir), ("val", val_set, val_dir)):
        # Found here, before step 1: the val split is scored every eval_every steps, and an empty
        # one would otherwise stop the run there (generate and capture refuse one when they make it).
        if len(dataset) == 0:
            raise PipelineError(f"train: {folder / 'manifest.json'}: the {name} split holds no sequence; rerun generate with "
                                f"more prompts (or pin some to {name} with a \"split\" field)")
    return train_set, val_set


def shards_record(train_set: ShardDataset, val_set: ShardDataset, *, train_dir: Path, val_dir: Path) -> dict:
    """The data part of the run record, by content: each split's manifest sha256 (the manifest
    lists every shard's sha256, so any change of what a shard holds changes it, at equal counts
    too), beside the capture settings that decide a shard's content, spelled out so the line that
    starts a run afresh names the one that changed (`record_changes`)."""
    manifest = train_set.manifest
    return {"train": {"tokens": manifest.tokens, "manifest_sha256": sha256_file(Path(train_dir) / "manifest.json")},
            "val": {"tokens": val_set.manifest.tokens, "manifest_sha256": sha256_file(Path(val_dir) / "manifest.json")},
            "layer_ids": manifest.layer_ids, "feature_dtype": manifest.feature_dtype, "target_top_k": manifest.target_top_k}


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


def setup_run(config: TrainConfig, *, target: TargetInfo, train_dir: Path, val_dir: Path, out_dir: Path, device: str,
              log=print, source: str = "params.yaml") -> TrainingRun:
    """Shards, drafter, frozen head, optimizer and step plan; resumed from `out_dir` when it holds
    a checkpoint of this exact run configuration, else `out_dir` is cleared of other runs' ones.
    `source`: the params file `config` came from, named in configuration errors."""
    architecture = choose_architecture(config, source=source)  # a bad architecture or option stops before any work
    device, world, rank = _init_distributed(device)
    on_gpu = device.startswith("cuda")
    torch.manual_seed(config.seed)
    if not on_gpu:
        torch.use_deterministic_algorithms(True, warn_only=True)
    train_set, val_set = _open_shards(target, train_dir, val_dir)
    manifest = train_set.manifest

    if config.mask_token_id is not None:
        mask_token_id, mask_reason = config.mask_token_id, "set in params (train.mask_token_id)"
        if not 0 <= mask_token_id < target.vocab_size:
            raise PipelineError(f"{source}: key 'train.mask_token_id' must be in the vocabulary of the target (0..{target.vocab_size - 1}), "
                                f"got {mask_token_id}")
    else:
        mask_token_id, mask_reason = choose_mask_token(target, _used_token_ids(train_set, val_set))
    gamma = config.gamma if config.gamma is not None else default_gamma(config.block_size)
    drafter_config = drafter_config_for(target, config, layer_ids=manifest.layer_ids, mask_token_id=mask_token_id,
                                        extra={"mask_token": mask_reason, "gamma": gamma}, source=source)
    check_contract(manifest, target=target, drafter_config=drafter_config, source=str(train_dir / "manifest.json"))
    if config.distill_weight > 0 and manifest.target_top_k == 0:
        raise PipelineError(f"{train_dir / 'manifest.json'}: train.distill_weight {config.distill_weight} needs the target's top-k, "
                            "and these shards hold none; set capture.target_top_k > 0 and rerun capture")
    drafter, init_note = new_drafter(config, target, drafter_config)
    if config.feature_norm == "channel_rms":
        drafter.feature_scale.copy_(channel_rms_scale(train_set))
    drafter.to(device).train()
    head = load_target_head(target, device=device, dtype=torch.bfloat16 if bf16_by_default(device) else torch.float32)
    if config.train_vocab == "data":
        answer_tokens = torch.cat([train_set[i].input_ids[train_set[i].loss_mask.bool()].long() for i in range(len(train_set))])
        vocabulary = TrainingVocabulary.from_tokens(head, answer_tokens)
        drafter.set_draft_vocab(vocabulary.token_ids)  # it drafts over what it learnt to rank
    else:
        vocabulary = TrainingVocabulary.full(head)
    run = TrainingRun(
        config=config, drafter=drafter, head=head, vocabulary=vocabulary,
        # Fused: one kernel for every parameter, and no per-step read of the step counters.
        optimizer=torch.optim.AdamW(drafter.parameters(), lr=config.lr, weight_decay=config.weight_decay, betas=(0.9, 0.95), fused=True),
        train_set=train_set, val_set=val_set,
        plan=plan_steps(train_set.lengths(), tokens_per_step=config.tokens_per_step, max_steps=config.max_steps, seed=config.seed),
        mask_token_id=mask_token_id, gamma=gamma, device=device, world=world, rank=rank,
        attention=config.attention if config.attention != "auto" else ("flex" if on_gpu else "sdpa"),
        loss_options=architecture.loss_options,
        record={"train_config": architecture.record(config), "target_fingerprint": target.fingerprint,
                "shards": shards_record(train_set, val_set, train_dir=train_dir, val_dir=val_dir)},
    )
    run.lengths = train_set.lengths()
    if on_gpu:
        run.resident = ResidentFeatures.upload(train_set, run.lengths, device)
    if config.compile:
        run.static_shape = static_shape(run)
    run.loss_fn = _loss_function(run)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    _resume_or_start_fresh(run, Path(out_dir), log=log)
    if rank == 0:
        log(f"train: drafter {config.num_layers} layer(s), {sum(p.numel() for p in drafter.parameters()) / 1e6:.1f}M params "
            f"(init {init_note}); block {config.block_size}, gamma {gamma}; softmax over {vocabulary.head_rows.shape[0]} tokens; "
            f"mask token {mask_token_id} ({mask_reason}); {len(train_set)} train sequences / {manifest.tokens:,} tokens; "
            f"{config.max_steps} steps on {device} x{world}, {run.attention} attention"
            + (f"; train features resident on the device ({run.resident.table.numel() * 2 / 2**30:.2f} GB)" if run.resident else ""))
    return run


def _listed(skipped: list[str], limit: int = 2) -> str:
    return "; ".join(skipped[:limit]) + (f"; and {len(skipped) - limit} more" if len(skipped) > limit else "")


def _check_every_rank_resumes_at(step: int, *, device: str) -> None:
    """Fail on every rank unless all ranks resume at the same step: ranks that see different
    checkpoints (nodes without a shared --out) would otherwise train different models in lockstep."""
    import torch.distributed as dist

    steps = torch.tensor([step, -step], dtype=torch.int64, device=device)
    dist.all_reduce(steps, op=dist.ReduceOp.MAX)  # [largest step, -smallest step]
    if steps[0] != -steps[1]:
        raise PipelineError(f"train: ranks would resume at different steps ({int(-steps[1])} to {int(steps[0])}): "
                            "on several machines --out must be a folder all nodes share")


def _resume_or_start_fresh(run: TrainingRun, out_dir: Path, *, log) -> None:
    """Continue from the newest intact checkpoint of this run configuration (saying which newer ones
    were passed over and why, then removing those), or start fresh and remove what is there."""
    import torch.distributed as dist

    point = load_resume_state(out_dir, run.record) if run.config.resume else None
    if run.world > 1:
        _check_every_rank_resumes_at(point.state["step"] if point is not None and point.state is not None else 0, device=run.device)
        dist.barrier()  # every rank has looked before rank 0 removes anything
    if point is not None and point.state is not None:
        state = point.state
        run.drafter.load_state_dict(point.drafter.state_dict())
        run.optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["torch_rng"])
        run.start_step, run.curve = state["step"], state["curve"]
        run.last_saved = run.start_step
        # The reported loss is a moving mean: rebuild its window, not just the steps after the resume.
        run.recent_losses = list(state.get("recent_losses") or [row["loss"] for row in run.curve[-LOSS_WINDOW:]])
        run.tokens_seen, run.seconds = int(state.get("tokens_seen", 0)), float(state.get("seconds", 0.0))
        if run.rank == 0:
            passed_over = f"; passed over and removed newer {_listed(point.skipped)}" if point.skipped else ""
            log(f"train: resuming at step {run.start_step} from {step_folder(out_dir, run.start_step)}{passed_over}")
            remove_checkpoints(out_dir, newer_than=run.start_step)
    elif run.rank == 0:
        stale = len(list_checkpoints(out_dir))
        if point is None:
            message = f"starting fresh (train.resume is false); removing {stale} checkpoint(s)" if stale else ""
        elif point.same_configuration:
            message = (f"starting fresh: no checkpoint of this run configuration can be continued ({_listed(point.skipped)}); "
                       f"removing {stale} checkpoint(s)")
        else:
            # Every key of the record is part of what the run computes: train.max_steps too, since the
            # learning-rate schedule runs to it (README, "Parameters and experiments").
            changes = f" ({record_changes(point.other_record, run.record)})" if point.other_record is not None else ""
            message = f"starting fresh; removing {stale} checkpoint(s) of a different run configuration{changes}" if point.skipped else ""
        if message:
            log(f"train: {message}")
        remove_checkpoints(out_dir)
    if run.world > 1:
        dist.barrier()


@dataclass
class PreparedStep:
    """A step's inputs, built on the host (`prepare_step`) while the device runs the step before."""

    step: int
    batch: Batch
    targets: TrainingTargets
    context_tokens: int  # over every rank's share of the step (the plan says; nothing to reduce)
    trained_positions: int  # this rank's slots that exist


def prepare_step(run: TrainingRun, step: int) -> PreparedStep:
    """Host work of one step: read this rank's share of its sequences, draw anchors, pack the
    batch (into pinned memory on a GPU) with its training targets, padded to the static shape
    when the step is compiled. Reads no device value, so it can run a step ahead in a thread."""
    config, world = run.config, run.world
    indices = run.plan[step]
    mine = list(range(run.rank, len(indices), world))
    samples = [run.train_set[indices[i]] for i in mine]
    drafter_config = run.drafter.config  # the block geometry's one source once the drafter exists
    batch = build_batch(samples, anchors_per_sequence=config.anchors_per_sequence, block_size=drafter_config.block_size,
                        mask_token_id=run.mask_token_id, anchor_seeds=[training_anchor_seed(config.seed, step, i) for i in mine],
                        sliding_window=drafter_config.sliding_window, pin_memory=run.device.startswith("cuda"),
                        feature_starts=None if run.resident is None else [run.resident.starts[indices[i]] for i in mine])
    resident_topk = run.resident is not None and run.resident.topk_ids is not None
    targets = training_targets(batch, samples, run.gamma, pin_memory=run.device.startswith("cuda"), resident_rows=resident_topk)
    trained_positions = int(batch.exists.sum())  # host tensor
    if run.static_shape is not None:
        batch, targets = pad_step(batch, targets, run.static_shape, mask_token_id=run.mask_token_id)
    lengths = run.lengths
    return PreparedStep(step, batch, targets, sum(lengths[i] for i in indices), trained_positions)


def pad_step(batch: Batch, targets: TrainingTargets, shape: tuple[int, int], *, mask_token_id: int) -> tuple[Batch, TrainingTargets]:
    """A batch and its targets grown to the static (context tokens, blocks) shape; padding weighs 0."""
    context_tokens, blocks = shape
    padded = batch.padded(context_tokens=context_tokens, blocks=blocks, mask_token_id=mask_token_id)
    extra = blocks - batch.block_sequence.shape[0]

    def grow(tensor):
        return None if tensor is None else torch.cat([tensor, tensor.new_zeros((extra, *tensor.shape[1:]))])

    return padded, TrainingTargets(grow(targets.weights), grow(targets.soft_ids), grow(targets.soft_logprobs), grow(targets.soft_rows))


def static_shape(run: TrainingRun) -> tuple[int, int]:
    """The largest (context tokens, blocks) any step of the plan gives this rank: every step is
    padded to it, so a compiled step never sees a new shape (the context rounded up to whole
    128-key tiles, the flex-attention tile)."""
    from dflash_pipeline.data.blocks import valid_anchors

    config = run.config
    cap = config.anchors_per_sequence
    anchors: dict[int, int] = {}
    context, blocks = 0, 0
    for indices in run.plan:
        mine = indices[run.rank::run.world]
        for index in mine:
            if index not in anchors:
                anchors[index] = min(cap, int(valid_anchors(run.train_set[index].loss_mask).numel()))
        context = max(context, sum(run.lengths[i] for i in mine))
        blocks = max(blocks, sum(anchors[i] for i in mine))
    return -(-context // 128) * 128, blocks


# Curve values stay on the device and are read back every READ_EVERY steps (devices.py; and before
# every validation, checkpoint and the end): the only device-to-host reads of a steady-state step.


@dataclass
class StepResult:
    """One step's curve values, still on the device (`read_back` turns them into curve rows)."""

    step: int
    lr: float
    context_tokens: int
    trained_positions: int
    values: torch.Tensor  # [loss, grad norm, slot-1 hits, slot-1 slots, the architecture's statistics...]
    extra_names: list


def _loss_function(run: TrainingRun):
    """block_loss with this run's settings: compiled (fullgraph, one static shape; CUDA graphs on
    a GPU) when train.compile is on."""
    config = run.config

    def loss(drafter, batch: Batch, targets: TrainingTargets, weight_total: torch.Tensor):
        return block_loss(drafter, run.head, batch, targets, logits_chunk=config.logits_chunk, weight_total=weight_total,
                          attention=run.attention, vocabulary=run.vocabulary, distill_weight=config.distill_weight,
                          loss_options=run.loss_options)

    if not config.compile:
        return loss
    mode = "reduce-overhead" if run.device.startswith("cuda") else None
    return torch.compile(loss, fullgraph=True, dynamic=False, mode=mode, backend=run.compile_backend)


def train_step(run: TrainingRun, step: int, prepared: PreparedStep | None = None) -> StepResult:
    """One optimizer step (0-based `step`) on this rank's share of the step's sequences.

    Nothing here waits for the device: the batch arrives prepared (`prepare_step`), the curve
    values stay device tensors (`read_back`), the optimizer is fused. The loss is summed over
    ranks; a non-finite one is found when the values are read back (`read_back` raises), always
    before a checkpoint is written."""
    import torch.distributed as dist

    config, world, device = run.config, run.world, run.device
    prepared = prepared if prepared is not None else prepare_step(run, step)
    lr = learning_rate(step, max_steps=config.max_steps, base_lr=config.lr, warmup_fraction=config.warmup_fraction)
    for group in run.optimizer.param_groups:
        group["lr"] = lr
    batch = prepared.batch.to(device)
    if run.resident is not None:
        batch = batch.with_features(run.resident.table)
    targets = prepared.targets.to(device)
    if run.resident is not None and run.resident.topk_ids is not None:
        targets = targets.with_soft(run.resident.topk_ids, run.resident.topk_logprobs)
    weight_total = _all_reduce(targets.weights.sum(), world)
    with autocast(device, run.bf16):
        step_loss = run.loss_fn(run.drafter, batch, targets, weight_total)
    loss_value = _all_reduce(step_loss.loss.detach().clone(), world)
    run.optimizer.zero_grad(set_to_none=True)
    step_loss.loss.backward()
    if world > 1:
        for parameter in run.drafter.parameters():
            if parameter.grad is not None:
                dist.all_reduce(parameter.grad)
    grad_norm = torch.nn.utils.clip_grad_norm_(run.drafter.parameters(), config.grad_clip)
    run.optimizer.step()
    first = batch.exists[:, 0]
    names = sorted(step_loss.extra_stats)
    values = torch.stack([loss_value.float(), grad_norm.float(), (step_loss.hits[:, 0] & first).sum().float(), first.sum().float(),
                          *(step_loss.extra_stats[name].float() for name in names)])
    return StepResult(step, lr, prepared.context_tokens, prepared.trained_positions, values, names)


def read_back(run: TrainingRun, results: list[StepResult]) -> list[dict]:
    """The curve rows of steps whose values are still on the device: one read for all of them.
    Raises NonFiniteLoss naming the first step whose loss was NaN or infinite."""
    if not results:
        return []
    values = torch.stack([result.values for result in results]).tolist() if len(set(r.values.shape for r in results)) == 1 \
        else [result.values.tolist() for result in results]
    rows = []
    for result, numbers in zip(results, values):
        loss, grad_norm, slot1_hits, slot1_slots, *extra = numbers
        if not math.isfinite(loss):
            raise NonFiniteLoss(f"train: loss is {loss} at step {result.step}")
        row = {"step": result.step + 1, "loss": round(loss, 6), "lr": result.lr, "grad_norm": round(grad_norm, 4),
               "slot1_acc": round(slot1_hits / slot1_slots, 4) if slot1_slots else float("nan"),
               "loss_value": loss, "context_tokens": result.context_tokens, "trained_positions": result.trained_positions}
        row.update(run.drafter.architecture.curve_fields(dict(zip(result.extra_names, extra))))  # e.g. DFlash2's selector coverage
        rows.append(row)
    return rows


class NonFiniteLoss(PipelineError):
    """The loss became NaN or infinite. Found when the curve is read (every READ_EVERY steps and
    before every checkpoint), so the weights it made are never saved."""


def validation_tau(run: TrainingRun) -> dict:
    """Held-out teacher-forced τ with evaluate's own scorer (`scoring.score_teacher_forced`): the
    same anchors seed rule, the same 95% interval over prompts. About `eval_blocks` blocks: an
    equal number of anchors from every val sequence."""
    config = run.config
    per_sequence = max(1, math.ceil(config.eval_blocks / max(1, len(run.val_set))))
    with autocast(run.device, run.bf16):
        scores = score_teacher_forced(run.drafter, run.head, run.val_set, anchors_per_sequence=per_sequence,
                                      tokens_per_batch=config.tokens_per_step, tree_budgets=[], seed=config.seed,
                                      attention=run.attention)
    run.drafter.train()
    tau, ci = mean_ci95_over_prompts(scores.tau, scores.sequence)
    unconditional, _ = per_slot_acceptance(scores)
    return {"tau": tau, "tau_ci95": ci, "blocks": int(scores.tau.shape[0]), "slot_accuracy": unconditional}


def _mean(values: list[float]) -> float | None:
    return round(sum(values) / len(values), 6) if values else None


def run_train(config: TrainConfig, *, target: TargetInfo, train_dir: Path, val_dir: Path, out_dir: Path, device: str,
              log=print, source: str = "params.yaml") -> dict:
    """Train (or resume) a drafter; return the final metrics and curve. Rank 0 writes every file.

    A run that finds itself already finished (resumed at its last step) reports the metrics of
    its saved state, not an empty loop's.
    """
    import torch.distributed as dist

    from dflash_pipeline.foundation.progress import progress

    run = setup_run(config, target=target, train_dir=train_dir, val_dir=val_dir, out_dir=out_dir, device=device, log=log, source=source)
    rank, world = run.rank, run.world
    bar = progress(total=config.max_steps, initial=run.start_step, desc="train", unit="step", disable=rank != 0)
    started, seconds_before = time.perf_counter(), run.seconds
    pending: list[StepResult] = []
    prefetch = StepPrefetcher(run)

    def read_pending() -> dict | None:
        """Turn the steps still on the device into curve rows; the last one, or None."""
        try:
            rows = read_back(run, pending)
        except NonFiniteLoss as exc:
            kept = list_checkpoints(out_dir)
            raise PipelineError(f"{exc}; stopped, last good checkpoint {kept[-1].name if kept else '(none)'} kept") from None
        pending.clear()
        run.seconds = seconds_before + time.perf_counter() - started
        for row in rows:
            row["seconds"] = round(run.seconds, 2)  # when the step's values were read (every READ_EVERY steps)
            run.tokens_seen += row.pop("context_tokens")
            row.pop("trained_positions")
            run.recent_losses = (run.recent_losses + [row.pop("loss_value")])[-LOSS_WINDOW:]
            if rank == 0:
                run.curve.append(row)
        return rows[-1] if rows else None

    try:
        for step in range(run.start_step, config.max_steps):
            pending.append(train_step(run, step, prefetch.get(step)))
            validate = rank == 0 and ((step + 1) % config.eval_every == 0 or step + 1 == config.max_steps)
            save = (step + 1) % config.save_every == 0 or step + 1 == config.max_steps
            row = None
            if validate or save or (step + 1) % READ_EVERY == 0:
                row = read_pending()
            if validate:
                result = validation_tau(run)
                row.update(tau=round(result["tau"], 4), tau_ci95=round(result["tau_ci95"], 4),
                           slot_accuracy=[round(a, 4) for a in result["slot_accuracy"]])
            if row is not None:
                bar.set_postfix_str(f"loss {sum(run.recent_losses) / len(run.recent_losses):.3f} "
                                    f"{run.tokens_seen / max(run.seconds, 1e-9):.0f} tok/s"
                                    + (f" tau {row['tau']:.3f}" if "tau" in row else ""), refresh=False)
            bar.update(1)
            if save:
                if rank == 0:
                    _save(run, out_dir, step + 1)
                if world > 1:
                    dist.barrier()
    finally:
        prefetch.close()
        bar.close()
        if world > 1 and dist.is_initialized():
            dist.destroy_process_group()
    return _final_metrics(run)


class StepPrefetcher:
    """Builds step n + 1's batch on a host thread while the device runs step n (GPU only: on a
    CPU the thread would take cores from the step itself). `prepare_seconds` keeps each step's
    host preparation time, measured in the thread that did it (`measure_train_steps` reports it)."""

    def __init__(self, run: TrainingRun):
        from concurrent.futures import ThreadPoolExecutor

        self.run = run
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prepare-step") if run.device.startswith("cuda") else None
        self.ahead = None  # (step, future)
        self.prepare_seconds: dict[int, float] = {}

    def _prepare(self, step: int) -> PreparedStep:
        began = time.perf_counter()
        prepared = prepare_step(self.run, step)
        self.prepare_seconds[step] = time.perf_counter() - began
        return prepared

    def get(self, step: int) -> PreparedStep:
        if self.ahead is not None and self.ahead[0] == step:
            prepared = self.ahead[1].result()
        else:
            prepared = self._prepare(step)
        self.ahead = None
        if self.pool is not None and step + 1 < self.run.config.max_steps:
            self.ahead = (step + 1, self.pool.submit(self._prepare, step + 1))
        return prepared

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)


def measure_train_steps(run: TrainingRun, *, steps: int, warmup: int = 3) -> dict:
    """Train steps timed as the stage runs them: each batch prepared by the stage's `StepPrefetcher`
    (a step ahead in its thread on a GPU, inline on a CPU), curve values read back every
    READ_EVERY steps and at the end, from a synchronised start to a synchronised end. So the step
    time includes whatever host preparation the device waits for. `warmup` steps run first
    (compilation, allocator, kernel choice) and are not counted; the run's plan and max_steps must
    cover warmup + steps. Returns step_ms, host_prepare_ms (mean host time to prepare one of the
    timed steps, in whichever thread did it; above step_ms the stage is host-bound),
    context_tokens_per_s and trained_positions_per_s."""
    from dflash_pipeline.foundation.devices import timed

    last = warmup + steps
    if steps < 1 or len(run.plan) < last or run.config.max_steps < last:
        raise PipelineError(f"measure_train_steps: {warmup} + {steps} steps need a plan and max_steps of at least {last}, "
                            f"the run has {len(run.plan)} and {run.config.max_steps}")
    prefetch = StepPrefetcher(run)

    def run_steps(first: int, end: int) -> list[dict]:
        rows, pending = [], []
        for step in range(first, end):
            pending.append(train_step(run, step, prefetch.get(step)))
            if len(pending) == READ_EVERY:
                rows += read_back(run, pending)
                pending = []
        return rows + read_back(run, pending)

    try:
        if warmup:
            run_steps(0, warmup)
        rows, seconds = timed(lambda: run_steps(warmup, last), run.device)
    finally:
        prefetch.close()
    host = [prefetch.prepare_seconds[step] for step in range(warmup, last)]
    return {"steps": steps, "step_ms": 1000 * seconds / steps, "host_prepare_ms": 1000 * sum(host) / len(host),
            "context_tokens_per_s": sum(row["context_tokens"] for row in rows) / seconds,
            "trained_positions_per_s": sum(row["trained_positions"] for row in rows) / seconds,
            "prefetch_thread": prefetch.pool is not None}


def _latest_tau(curve: list[dict]) -> dict:
    return next((row for row in reversed(curve) if "tau" in row), {})


def _save(run: TrainingRun, out_dir: Path, step: int) -> None:
    latest = _latest_tau(run.curve)
    metrics = {"step": step, "loss": _mean(run.recent_losses), "tau_tf": latest.get("tau"), "tau_tf_ci95": latest.get("tau_ci95")}
    save_step(out_dir, step=step, drafter=run.drafter, optimizer=run.optimizer, curve=run.curve, record=run.record, metrics=metrics,
              extra={"recent_losses": run.recent_losses, "tokens_seen": run.tokens_seen, "seconds": run.seconds})
    run.last_saved = step


def _final_metrics(run: TrainingRun) -> dict:
    final = _latest_tau(run.curve)
    return {
        "steps": run.config.max_steps,
        "resumed_from": run.start_step,
        "last_checkpoint": run.last_saved,
        "loss": _mean(run.recent_losses),
        "tau_tf": final.get("tau"),
        "tau_tf_ci95": final.get("tau_ci95"),
        "slot_accuracy": final.get("slot_accuracy"),
        "tokens_per_s": round(run.tokens_seen / run.seconds, 1) if run.seconds > 0 and run.tokens_seen else None,
        "seconds": round(run.seconds, 3),  # ms: a tiny run takes well under 0.1 s
        "curve": run.curve,
        "mask_token_id": run.mask_token_id,
    }
