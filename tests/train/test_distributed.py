"""train/distributed.py: two gloo processes (torchrun) train what one process does with the same global batch."""

import json
import sys

import pytest
from support.helpers import run
from support.stage_commands import train_stage_cmd


@pytest.mark.subprocess
def test_two_gloo_processes_match_one_process_with_the_same_global_batch(tiny_run, tmp_path):
    single = tmp_path / "single" / "ck"
    run(train_stage_cmd(tmp_path, tiny_run, single, max_steps=4, eval_every=4, save_every=4), cwd=tmp_path)
    torchrun = (sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29544")
    ddp = tmp_path / "ddp" / "ck"
    run(train_stage_cmd(tmp_path, tiny_run, ddp, launcher=torchrun, max_steps=4, eval_every=4, save_every=4), cwd=tmp_path)
    one = [r["loss"] for r in json.loads((single / "state.json").read_text())["curve"]]
    two = [r["loss"] for r in json.loads((ddp / "state.json").read_text())["curve"]]
    assert two == pytest.approx(one, rel=1e-4)


@pytest.mark.subprocess
def test_dflash2_two_gloo_processes_match_one_process(tiny_run, tmp_path):
    dflash2 = dict(architecture="dflash2", options={"dflash2": dict(selector_rank=8, selector_top_k=4)}, max_steps=3, eval_every=3,
                   save_every=3)
    single = tmp_path / "single" / "ck"
    run(train_stage_cmd(tmp_path, tiny_run, single, **dflash2), cwd=tmp_path)
    torchrun = (sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29545")
    ddp = tmp_path / "ddp" / "ck"
    run(train_stage_cmd(tmp_path, tiny_run, ddp, launcher=torchrun, **dflash2), cwd=tmp_path)
    curve = json.loads((single / "state.json").read_text())["curve"]
    assert "selector_acc" in curve[0]  # a DFlash2 run
    one = [r["loss"] for r in curve]
    two = [r["loss"] for r in json.loads((ddp / "state.json").read_text())["curve"]]
    assert two == pytest.approx(one, rel=1e-4)
