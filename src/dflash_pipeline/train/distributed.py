"""Train's own part of data parallelism: every rank must resume at the same step (joining the
process group and summing over ranks are `foundation.distributed`'s)."""

import torch

from dflash_pipeline.foundation.errors import PipelineError


def check_every_rank_resumes_at(step: int, *, device: str) -> None:
    """Fail on every rank unless all ranks resume at the same step: ranks that see different
    checkpoints (nodes without a shared --out) would otherwise train different models in lockstep."""
    import torch.distributed as dist

    steps = torch.tensor([step, -step], dtype=torch.int64, device=device)
    dist.all_reduce(steps, op=dist.ReduceOp.MAX)  # [largest step, -smallest step]
    if steps[0] != -steps[1]:
        raise PipelineError(f"train: ranks would resume at different steps ({int(-steps[1])} to {int(steps[0])}): "
                            "on several machines --out must be a folder all nodes share")
