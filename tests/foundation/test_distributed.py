"""torchrun ranks and the GPUs each replica takes (`launch.devices_per_replica`), without a GPU:
the device count is what the check reads, so it is set here."""

import pytest
import torch

from dflash_pipeline.foundation.distributed import Ranks, replica_device
from dflash_pipeline.foundation.errors import PipelineError
from dflash_pipeline.target.placement import TargetPlacement, _replica_gpus


def test_ranks_come_from_torchruns_environment(monkeypatch):
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert Ranks.from_environment() == Ranks(world=1, rank=0, local_rank=0)
    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("RANK", "11")
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert Ranks.from_environment() == Ranks(world=16, rank=11, local_rank=3)
    monkeypatch.setenv("RANK", "x")
    with pytest.raises(PipelineError, match="not whole numbers"):
        Ranks.from_environment()


def test_each_local_rank_takes_its_own_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert replica_device("cuda", Ranks(world=8, rank=5, local_rank=5)) == "cuda:5"
    assert replica_device("cuda", Ranks(world=4, rank=3, local_rank=3), devices_per_replica=2) == "cuda:6"
    assert replica_device("cpu", Ranks(world=4, rank=3, local_rank=3), devices_per_replica=2) == "cpu"  # gloo on the host
    assert replica_device("cuda:0", Ranks()) == "cuda:0"  # one process: the device it was given
    assert _replica_gpus("cuda:6", TargetPlacement(devices_per_replica=2)) == [6, 7]
    with pytest.raises(PipelineError, match=r"launch.devices_per_replica 2: local rank 4 needs GPUs 8..9, this node has 8"):
        replica_device("cuda", Ranks(world=5, rank=4, local_rank=4), devices_per_replica=2)
    with pytest.raises(PipelineError, match=r"key 'launch.devices_per_replica' 3 from GPU 6 needs GPUs up to 8"):
        _replica_gpus("cuda:6", TargetPlacement(devices_per_replica=3))
