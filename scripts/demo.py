"""`make demo`: every stage on the real embedded target, then the `dflash-pipeline` commands, in minutes.

    python scripts/demo.py                       # what `make demo` runs
    python scripts/demo.py --set train.max_steps=60 --scratch /tmp/demo

What it does, in a scratch folder (default `.demo/`, gitignored) so that your own run is never
touched (your params.yaml, data/, dvc.lock and DVC cache stay as they are):

1. copies the repository's files (`git ls-files`: tracked, and new ones not yet added unless
   ignored; less dvc.lock: the demo is a fresh run) into the scratch folder and makes it a git +
   DVC repository of its own;
2. writes a small prompt file (2 pinned val prompts and 8 train prompts of data/prompts/default.jsonl)
   and a demo params.yaml (DEMO_PARAMS below, then any --set KEY=VALUE), checked by `load_params`;
3. `dvc repro`: target, generate, capture, train, evaluate, export; then `dvc metrics show`;
4. the console command on the demo's outputs: `show` of the export, `verify-shards` of the
   capture, `decode` with the exported drafter (against plain decoding), and `evaluate` of the
   chosen checkpoint against its own export.

The converted target (data/target/model, ~540 MB) is the slow part of a first run: the scratch
folder keeps its own between demos, and a first demo copies yours when data/target holds one.
Torch runs on one thread (OMP_NUM_THREADS=1) unless OMP_NUM_THREADS is set. Every step's wall time
is printed at the end. A failing step stops the demo with its status.
"""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import click
import yaml

from dflash_pipeline.foundation.config import EMBEDDED_TARGET, load_params

REPO_ROOT = Path(__file__).resolve().parent.parent
# The demo's params.yaml, over the repository's: ten prompts, 20 training steps, a small evaluation.
DEMO_PARAMS = {
    "generate": {"prompts": "data/prompts/demo.jsonl", "max_prompts": 0, "val_fraction": 0.0, "max_new_tokens": 32,
                 "batch_size": 10},
    "train": {"max_steps": 20, "eval_every": 10, "save_every": 10, "eval_blocks": 32, "tokens_per_step": 512},
    "evaluate": {"anchors_per_sequence": 16, "tree_budgets": [4], "num_prompts": 2, "max_new_tokens": 32},
}
VAL_PROMPTS, TRAIN_PROMPTS = 2, 8  # the first rows of default.jsonl are its pinned val prompts; train rows follow them
DECODE_PROMPT = "Write a Python function that reverses a string."


def demo_prompts(source: Path) -> list[str]:
    """JSONL lines: the first VAL_PROMPTS pinned val rows of `source`, then its first TRAIN_PROMPTS other rows."""
    val, train = [], []
    for line in source.read_text(encoding="utf-8").splitlines():
        (val if json.loads(line).get("split") == "val" else train).append(line)
        if len(val) >= VAL_PROMPTS and len(train) >= TRAIN_PROMPTS:
            break
    return val[:VAL_PROMPTS] + train[:TRAIN_PROMPTS]


def parse_override(text: str) -> tuple[str, str, object]:
    """`section.key=value` (value in YAML, as `dvc exp run -S` takes it) -> (section, key, value)."""
    name, sep, value = text.partition("=")
    section, dot, key = name.partition(".")
    if not sep or not dot:
        raise click.BadParameter(f"{text!r}: expected section.key=value, e.g. train.max_steps=60")
    return section, key, yaml.safe_load(value)


def write_params(scratch: Path, overrides: list[tuple[str, str, object]]) -> None:
    """The scratch folder's params.yaml: the repository's, then DEMO_PARAMS, then `overrides`; checked."""

    path = scratch / "params.yaml"
    params = yaml.safe_load(path.read_text(encoding="utf-8"))
    for section, values in DEMO_PARAMS.items():
        params[section].update(values)
    for section, key, value in overrides:
        params.setdefault(section, {})[key] = value
    named = {(section, key) for section, key, _ in overrides}
    model = str(params["target"]["model"])
    if ("target", "model") in named and ("target", "watch") not in named and Path(model).expanduser().exists():
        # A local target is also the target stage's dependency (params.yaml explains target.watch):
        # --set target.model=DIR alone would be refused by the stage, so the demo sets both.
        params["target"]["watch"] = model
    path.write_text(yaml.safe_dump(params, sort_keys=False), encoding="utf-8")
    load_params(path)  # an unknown key or a bad value stops here, named


def prepare_scratch(scratch: Path, *, embedded_target: bool) -> None:
    """Empty `scratch` (keeping its converted target), then copy the repository's files into it, and
    your converted target when the demo runs the embedded one and has no conversion of its own yet."""
    kept_target = scratch / "data" / "target"
    if scratch.exists():
        for entry in scratch.iterdir():
            if entry.name != "data":
                shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
        for entry in (scratch / "data").iterdir() if (scratch / "data").is_dir() else []:
            if entry != kept_target:
                shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
    listed = ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"]  # your edits too, committed or not
    tracked = subprocess.run(listed, cwd=REPO_ROOT, capture_output=True, text=True, check=True).stdout
    for name in filter(None, tracked.split("\0")):
        if name == "dvc.lock" or not (REPO_ROOT / name).is_file():  # a file deleted but not yet committed
            continue
        (scratch / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO_ROOT / name, scratch / name)
    yours = REPO_ROOT / "data" / "target" / "model"
    if embedded_target and not (kept_target / "model").is_dir() and (yours / "conversion.json").is_file():
        shutil.copytree(yours, kept_target / "model")  # the target stage keeps it when its stamp matches
    subprocess.run(["git", "init", "-q"], cwd=scratch, check=True)


class Steps:
    """Run commands in the scratch folder one after another, echoing each and timing it."""

    def __init__(self, scratch: Path):
        self.scratch = scratch
        self.times: list[tuple[str, float]] = []
        self.env = dict(os.environ, HF_HUB_OFFLINE=os.environ.get("HF_HUB_OFFLINE", "1"), PYTHONUNBUFFERED="1",
                        TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(scratch / "src"))
        self.env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + self.env.get("PATH", "")
        # One torch thread unless you say otherwise: on a busy 2-core machine two threads per process
        # made the demo 3x slower (386 s against 122 s), and a 135M target gains little from a second.
        self.env.setdefault("OMP_NUM_THREADS", "1")

    def run(self, label: str, command: list) -> None:
        click.secho(f"\n$ {' '.join(map(str, command))}", bold=True)
        sys.stdout.flush()  # before the command's own output, also when piped
        started = time.perf_counter()
        code = subprocess.run([str(part) for part in command], cwd=self.scratch, env=self.env).returncode
        self.times.append((label, time.perf_counter() - started))
        if code != 0:
            raise click.ClickException(f"demo: {label} failed with exit status {code} (in {self.scratch})")

    def timed(self, label: str, function) -> None:
        started = time.perf_counter()
        function()
        self.times.append((label, time.perf_counter() - started))


@click.command()
@click.option("--scratch", type=click.Path(file_okay=False, path_type=Path), default=REPO_ROOT / ".demo", show_default=True,
              help="The demo's own repository (emptied first, its converted target kept).")
@click.option("--set", "overrides", multiple=True, metavar="SECTION.KEY=VALUE", help="Override a demo param (repeatable).")
@click.option("--commands/--no-commands", default=True, show_default=True, help="Run the dflash-pipeline commands after dvc repro.")
def main(scratch: Path, overrides: tuple[str, ...], commands: bool) -> None:
    """Run the whole pipeline on ten prompts in a scratch folder, then the console command on its outputs."""
    began = time.perf_counter()
    scratch = scratch.resolve()
    if scratch == REPO_ROOT or REPO_ROOT.is_relative_to(scratch):
        raise click.ClickException(f"--scratch {scratch}: must not be the repository or hold it")
    overrides = [parse_override(text) for text in overrides]
    target_model = next((value for section, key, value in reversed(overrides) if (section, key) == ("target", "model")),
                        yaml.safe_load((REPO_ROOT / "params.yaml").read_text(encoding="utf-8"))["target"]["model"])
    steps = Steps(scratch)
    steps.timed("copy the repository's files", lambda: prepare_scratch(scratch, embedded_target=target_model == EMBEDDED_TARGET))
    prompts = scratch / DEMO_PARAMS["generate"]["prompts"]
    prompts.write_text("\n".join(demo_prompts(REPO_ROOT / "data" / "prompts" / "default.jsonl")) + "\n", encoding="utf-8")
    write_params(scratch, overrides)
    dvc = [sys.executable, "-m", "dvc"]
    steps.run("dvc repro (6 stages)", dvc + ["repro"])
    steps.run("dvc metrics show", dvc + ["metrics", "show"])
    if commands:
        cli = [Path(sys.executable).parent / "dflash-pipeline"]
        target = "data/target/target.json"
        best = json.loads((scratch / "data" / "eval" / "best.json").read_text())["path"]
        steps.run("dflash-pipeline show", cli + ["show", "data/export/drafter"])
        steps.run("dflash-pipeline verify-shards", cli + ["verify-shards", "data/hidden", "--target", target])
        steps.run("dflash-pipeline decode", cli + ["decode", DECODE_PROMPT, "--target", target, "--drafter", "data/export/drafter",
                                                   "--max-new-tokens", 32, "--compare"])
        steps.run("dflash-pipeline evaluate", cli + ["evaluate", best, "data/export/drafter", "--target", target, "--shards", "data/hidden/val",
                                                     "--prompts", "data/generated/val.parquet", "--e2e-prompts", 1, "--max-new-tokens", 16,
                                                     "--tree-budgets", 4, "--temperatures", 0])
    click.secho("\ndemo: wall time per step", bold=True)
    for label, seconds in steps.times:
        click.echo(f"  {label:32s} {seconds:7.1f} s")
    click.echo(f"  {'total':32s} {time.perf_counter() - began:7.1f} s   (outputs in {scratch})")


if __name__ == "__main__":
    main()
