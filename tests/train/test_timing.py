"""The stage's own train-step measurement (`train.timing.measure_train_steps`): it times steps with
their host preparation, and refuses a plan too short for the steps asked for."""

from dataclasses import replace

import pytest
from support.stage_commands import TINY_TRAIN

from dflash_pipeline.foundation.errors import PipelineError
from dflash_pipeline.train.run import setup_run
from dflash_pipeline.train.timing import measure_train_steps


def test_the_step_measurement_includes_host_preparation(tiny_run, tmp_path):
    target, root = tiny_run
    run = setup_run(replace(TINY_TRAIN, max_steps=6, resume=False), target=target, train_dir=root / "hidden" / "train",
                    val_dir=root / "hidden" / "val", out_dir=tmp_path / "measure", device="cpu", log=lambda *_: None)
    figures = measure_train_steps(run, steps=4, warmup=2)
    assert figures["steps"] == 4 and figures["prefetch_thread"] is False
    assert figures["step_ms"] > 0 and 0 < figures["host_prepare_ms"] and figures["context_tokens_per_s"] > 0
    with pytest.raises(PipelineError, match="at least 9"):
        measure_train_steps(run, steps=7, warmup=2)
