"""Data parallelism over torchrun ranks, shared by every stage that runs under torchrun (generate,
capture, train): which rank and how many, joining and leaving the process group, a barrier, a sum.
With one process (no torchrun, or torchrun with one process) each is a no-op.

torchrun sets WORLD_SIZE, RANK and LOCAL_RANK; on CUDA, local rank r drives the GPUs
r * devices_per_replica ... (r + 1) * devices_per_replica - 1 (one replica of the target may span
several GPUs, `target.device_map`), on a CPU every rank computes on the host (gloo).
"""

import os
from dataclasses import dataclass
from datetime import timedelta

import torch

from dflash_pipeline.foundation.errors import PipelineError

# How long a rank waits at a barrier for the others. Ranks finish their shares of a stage at
# different times (generate's longest answers, capture's largest shards); torch's default (10 to
# 30 min by backend) would fail a rank that merely finished first on a long run.
BARRIER_TIMEOUT = timedelta(hours=6)


@dataclass(frozen=True)
class Ranks:
    """This process's place among the torchrun processes of a stage."""

    world: int = 1
    rank: int = 0
    local_rank: int = 0

    @classmethod
    def from_environment(cls) -> "Ranks":
        try:
            return cls(world=int(os.environ.get("WORLD_SIZE", "1")), rank=int(os.environ.get("RANK", "0")),
                       local_rank=int(os.environ.get("LOCAL_RANK", "0")))
        except ValueError:
            raise PipelineError(f"WORLD_SIZE {os.environ.get('WORLD_SIZE')!r}, RANK {os.environ.get('RANK')!r}: not whole numbers "
                                "(torchrun sets them)") from None

    @property
    def first(self) -> bool:
        return self.rank == 0


def replica_device(device: str, ranks: Ranks, devices_per_replica: int = 1) -> str:
    """The first device of this rank's replica: on CUDA under torchrun, local rank r starts at GPU
    r * devices_per_replica; elsewhere `device` as given."""
    if ranks.world == 1 or not device.startswith("cuda"):
        return device
    first = ranks.local_rank * devices_per_replica
    if first + devices_per_replica > torch.cuda.device_count():
        raise PipelineError(f"launch.devices_per_replica {devices_per_replica}: local rank {ranks.local_rank} needs GPUs {first}.."
                            f"{first + devices_per_replica - 1}, this node has {torch.cuda.device_count()}; "
                            "launch.processes x launch.devices_per_replica must not exceed the GPUs of a node")
    return f"cuda:{first}"


def init_distributed(device: str, *, devices_per_replica: int = 1) -> tuple[str, int, int]:
    """(device, world, rank); joins the torchrun process group when there is one (once per process)."""
    import torch.distributed as dist

    ranks = Ranks.from_environment()
    device = replica_device(device, ranks, devices_per_replica)
    if ranks.world > 1 and not dist.is_initialized():
        if device.startswith("cuda"):
            torch.cuda.set_device(device)
        dist.init_process_group(backend="nccl" if device.startswith("cuda") else "gloo", timeout=BARRIER_TIMEOUT)
    return device, ranks.world, ranks.rank


def leave_process_group(world: int) -> None:
    """Leave the process group joined by `init_distributed` (nothing with one process)."""
    import torch.distributed as dist

    if world > 1 and dist.is_initialized():
        dist.destroy_process_group()


def barrier(world: int) -> None:
    """Wait until every rank is here (nothing with one process)."""
    if world > 1:
        import torch.distributed as dist

        dist.barrier()


def sum_over_ranks(tensor: torch.Tensor, world: int) -> torch.Tensor:
    """`tensor` summed in place over the `world` ranks (unchanged in a single process)."""
    if world > 1:
        import torch.distributed as dist

        dist.all_reduce(tensor)
    return tensor
