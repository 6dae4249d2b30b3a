"""cli/verify.py: `dflash-pipeline verify` checks a whole run laid out as the pipeline lays it out,
and --repair removes what is damaged (the checks themselves: tests/integrity/test_checks.py)."""

import shutil
from pathlib import Path

from support.console import invoke
from support.helpers import flip_a_byte


def copy_run(cli_run, root: Path) -> Path:
    """The tiny run laid out as the pipeline lays out its outputs (dvc.yaml's paths) under `root`."""
    data = root / "data"
    (data / "target").mkdir(parents=True)
    shutil.copy(cli_run.target_json, data / "target" / "target.json")
    shutil.copytree(cli_run.hidden, data / "hidden")
    shutil.copytree(cli_run.root / "checkpoints", data / "checkpoints")
    shutil.copytree(cli_run.export, data / "export" / "drafter")
    return root


def test_verify_checks_a_whole_run_and_repair_removes_what_is_damaged(cli_run, tmp_path):
    run = copy_run(cli_run, tmp_path / "run")
    data = run / "data"
    good = invoke("verify", run)
    assert good.exit_code == 0 and good.stdout == (f"verify: {run}: no damage found (target, generated answers, shards, checkpoints, "
                                                   "best choice, export, DVC cache) and no leftover\n"), good.output
    shard, weights = data / "hidden" / "val" / "shard-00000.arrow", data / "checkpoints" / "step_000004" / "model.safetensors"
    exported = data / "export" / "drafter" / "model.safetensors"
    for path in (shard, weights, exported):
        flip_a_byte(path)
    shutil.copytree(data / "hidden", data / "hidden.partial")  # a killed capture's staging folder, its output complete
    found = invoke("verify", run)
    assert found.exit_code == 1 and found.stderr.strip().splitlines() == [
        f"error: {run}: 4 problem(s) found; `dflash-pipeline verify --repair`, then `dvc pull` or `dvc repro` (README, Recovery)"]
    lines = found.stdout.splitlines()
    assert [line.split(": ")[1] for line in lines] == [str(shard), str(weights), str(exported), str(data / "hidden.partial")], lines
    assert all("damaged (sha256 " in line for line in lines[:3]) and "staging folder of a killed capture" in lines[3]

    repaired = invoke("verify", run, "--repair")
    assert repaired.exit_code == 0, repaired.output
    assert f"verify: removed {shard} (damaged)" in repaired.stdout and f"verify: removed {exported} (damaged)" in repaired.stdout
    assert f"verify: removed {weights.parent} (damaged)" in repaired.stdout
    # the only step went, and with it the only resume state: train says where it will start, not "from the step before"
    assert "verify: train starts from step 0: no step is left" in repaired.stdout.splitlines()
    assert f"verify: removed leftover {data / 'hidden.partial'}" in repaired.stdout and "dvc repro" in repaired.stdout.splitlines()[-1]
    assert not shard.exists() and not weights.parent.exists() and not (data / "checkpoints" / "state" / "step_000004.pt").exists()
    assert not (data / "hidden.partial").exists() and (data / "hidden" / "train" / "shard-00000.arrow").is_file()
    after = invoke("verify", run)  # until `dvc pull` or `dvc repro` brings them back
    assert after.exit_code == 1 and after.stdout.splitlines() == [f"verify: {shard}: missing (manifest.json records its sha256)",
                                                                  f"verify: {exported}: missing (dflash_pipeline.json records its sha256)"]
