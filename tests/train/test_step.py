"""train/step.py: a non-finite loss stops the run with one line and keeps the last good checkpoint."""

from dataclasses import replace

import pytest
from support.stage_commands import TINY_DFLASH2, TINY_TRAIN, train_tiny_run

from dflash_pipeline.drafters.checkpoints import list_checkpoints
from dflash_pipeline.foundation.errors import PipelineError


def test_nan_loss_stops_with_a_clear_message_and_keeps_the_last_checkpoint(tiny_run, tmp_path):
    config = replace(TINY_TRAIN, lr=1e30, save_every=1, max_steps=6, warmup_fraction=0.0)
    with pytest.raises(PipelineError, match=r"train: loss is (nan|inf) at step \d; stopped, last good checkpoint step_00000\d kept"):
        train_tiny_run(tiny_run, tmp_path / "ck", config)
    assert list_checkpoints(tmp_path / "ck")


def test_dflash2_nan_loss_stops_and_keeps_the_last_checkpoint(tiny_run, tmp_path):
    config = replace(TINY_DFLASH2, lr=1e30, save_every=1, max_steps=6, warmup_fraction=0.0)
    with pytest.raises(PipelineError, match=r"train: loss is (nan|inf) at step \d; stopped, last good checkpoint step_00000\d kept"):
        train_tiny_run(tiny_run, tmp_path / "ck", config)
    assert list_checkpoints(tmp_path / "ck")
