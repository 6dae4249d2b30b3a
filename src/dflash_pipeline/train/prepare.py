"""The host side of a step: which sequences this rank reads, their anchors and training targets
packed into a batch (`prepare_step`), padded to the one static shape a compiled step sees
(`static_shape`, `pad_step`), built a step ahead on a thread on a GPU (`StepPrefetcher`)."""

import time
from dataclasses import dataclass

import torch

from dflash_pipeline.data.blocks import Batch, build_batch, training_anchor_seed
from dflash_pipeline.train.loss import TrainingTargets, training_targets
from dflash_pipeline.train.state import TrainingRun


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
    targets = training_targets(batch, samples, run.gamma, block_size=drafter_config.block_size, pin_memory=run.device.startswith("cuda"),
                               resident_rows=resident_topk)
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
