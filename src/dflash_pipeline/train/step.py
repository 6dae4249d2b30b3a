"""The device side of a step: the loss function (compiled or not), one optimizer step
(`train_step`) whose curve values stay on the device, and their read-back into curve rows
(`read_back`, which stops a run whose loss is not finite)."""

import math
from dataclasses import dataclass

import torch

from dflash_pipeline.data.blocks import Batch
from dflash_pipeline.foundation.devices import autocast
from dflash_pipeline.foundation.errors import PipelineError
from dflash_pipeline.foundation.distributed import sum_over_ranks
from dflash_pipeline.train.loss import TrainingTargets, block_loss
from dflash_pipeline.train.prepare import PreparedStep, prepare_step
from dflash_pipeline.train.schedule import learning_rate
from dflash_pipeline.train.state import TrainingRun

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


def loss_function(run: TrainingRun):
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
    weight_total = sum_over_ranks(targets.weights.sum(), world)
    with autocast(device, run.bf16):
        step_loss = run.loss_fn(run.drafter, batch, targets, weight_total)
    loss_value = sum_over_ranks(step_loss.loss.detach().clone(), world)
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
