"""Data parallelism over torchrun ranks: joining the process group, summing a tensor over ranks,
and checking that every rank resumes at the same step. With one process (no torchrun) each is a
no-op."""

import os

import torch

from dflash_pipeline.foundation.errors import PipelineError


def sum_over_ranks(tensor: torch.Tensor, world: int) -> torch.Tensor:
    """`tensor` summed in place over the `world` ranks (unchanged in a single process)."""
    if world > 1:
        import torch.distributed as dist

        dist.all_reduce(tensor)
    return tensor


def init_distributed(device: str) -> tuple[str, int, int]:
    """(device, world, rank); joins the torchrun process group when there is one."""
    import torch.distributed as dist

    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    if world > 1 and not dist.is_initialized():
        if device.startswith("cuda"):
            device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
            torch.cuda.set_device(device)
        dist.init_process_group(backend="nccl" if device.startswith("cuda") else "gloo")
    return device, world, rank


def check_every_rank_resumes_at(step: int, *, device: str) -> None:
    """Fail on every rank unless all ranks resume at the same step: ranks that see different
    checkpoints (nodes without a shared --out) would otherwise train different models in lockstep."""
    import torch.distributed as dist

    steps = torch.tensor([step, -step], dtype=torch.int64, device=device)
    dist.all_reduce(steps, op=dist.ReduceOp.MAX)  # [largest step, -smallest step]
    if steps[0] != -steps[1]:
        raise PipelineError(f"train: ranks would resume at different steps ({int(-steps[1])} to {int(steps[0])}): "
                            "on several machines --out must be a folder all nodes share")
