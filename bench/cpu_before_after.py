"""Benchmark: the capture and train stages of this tree against an earlier commit, side by side.

    python bench/cpu_before_after.py [--baseline 0121fa1] [--sequences 300] [--steps 40] [--rounds 2]

Both versions run in their own process, alternating round by round, on the same inputs: the real
target (the `target` stage of this tree, into a temporary folder unless --target names one), a
fabricated generate output (bench/gpu.py's: random answers over a 10K-token vocabulary, lengths as
in the default run) and the settings of params.yaml. Each version captures the shards with its own `run_capture`
and trains on them with its own `run_train`. Prints, per version and as ratios (this tree /
baseline): capture tokens/s, train ms per steady-state step (steps 16 to 32, read from the curve),
and whether the shards are byte-identical and the losses equal. Writes bench/results/cpu_before_after.json.
The baseline is checked out with `git worktree` into a temporary folder and removed afterwards.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import click

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]

WORKER = r'''
import json, sys, time
from pathlib import Path
from dflash_pipeline.capture.run import run_capture
from dflash_pipeline.foundation.config import load_params
from dflash_pipeline.target.load import TargetInfo
from dflash_pipeline.train.run import run_train
from dataclasses import replace
import torch

params_path, target_json, generated, out, steps = sys.argv[1:6]
params = load_params(params_path)
target = TargetInfo.from_json(Path(target_json))
out = Path(out)
started = time.perf_counter()
summary = run_capture(params.capture, target=target, generated_dir=Path(generated), out_dir=out / "hidden", device="cpu")
capture_seconds = time.perf_counter() - started
manifests = {split: json.loads((out / "hidden" / split / "manifest.json").read_text()) for split in ("train", "val")}
steps = int(steps)
config = replace(params.train, max_steps=steps, eval_every=steps, save_every=steps, resume=False)
result = run_train(config, target=target, train_dir=out / "hidden" / "train", val_dir=out / "hidden" / "val", out_dir=out / "ck",
                   device="cpu", log=lambda *_: None)
# A baseline from before the typed train record returns a dict.
curve = result["curve"] if isinstance(result, dict) else result.curve
tau_tf = result["tau_tf"] if isinstance(result, dict) else (result.held_out.tau.mean if result.held_out else None)
seconds = {row["step"]: row["seconds"] for row in curve if "seconds" in row}
print(json.dumps({"capture_seconds": capture_seconds, "capture_tokens": sum(m["tokens"] for m in manifests.values()),
                  "shards": {s: [shard["sha256"] for shard in m["shards"]] for s, m in manifests.items()},
                  "step_ms": (seconds[32] - seconds[16]) / 16 * 1e3 if 16 in seconds and 32 in seconds else None,
                  "losses": {row["step"]: row["loss"] for row in curve}, "tau_tf": tau_tf,
                  "threads": torch.get_num_threads()}))
'''


def _worker(tree: Path, work: Path, name: str, params: Path, target_json: Path, generated: Path, steps: int) -> dict:
    out = work / "runs" / name
    shutil.rmtree(out, ignore_errors=True)
    env = {**os.environ, "PYTHONPATH": str(tree / "src"), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", WORKER, str(params), str(target_json), str(generated), str(out), str(steps)],
                          env=env, capture_output=True, text=True, cwd=tree)
    if done.returncode != 0:
        raise click.ClickException(f"{name}: the worker failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


@click.command()
@click.option("--baseline", default="0121fa1", show_default=True, help="The commit to compare with.")
@click.option("--target", "target_json", type=click.Path(path_type=Path), default=None,
              help="target.json of a prepared target (default: the target stage into a temporary folder).")
@click.option("--sequences", default=300, show_default=True, help="Fabricated train sequences (val: 1/16 of them).")
@click.option("--steps", default=40, show_default=True, help="Train steps per run (>= 33: steps 16-32 are timed).")
@click.option("--rounds", default=2, show_default=True)
@click.option("--out", "out_path", type=click.Path(path_type=Path), default=ROOT / "bench" / "results" / "cpu_before_after.json",
              show_default=True)
def main(baseline, target_json, sequences, steps, rounds, out_path):
    import yaml

    from dflash_pipeline.foundation.config import load_params
    from dflash_pipeline.foundation.devices import machine_description
    from dflash_pipeline.target.load import prepare_target

    commit = subprocess.run(["git", "rev-parse", "--short", baseline], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="before-after-") as temporary:
        work = Path(temporary)
        tree = work / "tree"
        subprocess.run(["git", "worktree", "add", "--detach", str(tree), commit], cwd=ROOT, check=True, capture_output=True)
        try:
            if target_json is None:
                prepare_target(load_params(ROOT / "params.yaml").target, out_dir=work / "target")
                target_json = work / "target" / "target.json"
            raw = yaml.safe_load((ROOT / "params.yaml").read_text())
            ours = work / "params-this-tree.yaml"
            ours.write_text(yaml.safe_dump(raw))
            raw["train"].pop("compile", None)  # a key the baseline does not know (off: its behaviour)
            theirs = work / "params-baseline.yaml"
            theirs.write_text(yaml.safe_dump(raw))
            from gpu import fabricate_generated  # bench/gpu.py: the same fabricated generate output

            generated = work / "generated"
            fabricate_generated(generated, prompts=sequences)
            versions = {f"baseline {commit}": (tree, theirs), f"this tree ({head}+)": (ROOT, ours)}
            runs: dict[str, list[dict]] = {name: [] for name in versions}
            for round_index in range(rounds):
                for name, (path, params) in versions.items():
                    result = _worker(path, work, name.split()[0], params, target_json, generated, steps)
                    runs[name].append(result)
                    print(f"round {round_index + 1}: {name:22s} capture {result['capture_tokens'] / result['capture_seconds']:7.0f} tok/s "
                          f"({result['capture_seconds']:.1f} s), train {result['step_ms']:.1f} ms/step", flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, capture_output=True)

    (old_name, old), (new_name, new) = runs.items()

    def total(rows, key):
        return sum(row[key] for row in rows)

    capture_ratio = (total(new, "capture_tokens") / total(new, "capture_seconds")) / (total(old, "capture_tokens") / total(old, "capture_seconds"))
    step_ratio = total(new, "step_ms") / total(old, "step_ms")
    identical = all(run["shards"] == old[0]["shards"] for run in old + new)
    loss_gap = max(abs(new[0]["losses"][step] - loss) / abs(loss) for step, loss in old[0]["losses"].items() if step in new[0]["losses"])
    print(f"capture tokens/s, this tree / baseline: {capture_ratio:.3f} (goal >= 1: no slower)")
    print(f"train ms per step, this tree / baseline: {step_ratio:.3f} (goal <= 1: no slower)")
    print(f"shards byte-identical across versions and rounds: {identical}; largest relative loss difference {loss_gap:.2e}")
    record = {"machine": machine_description(), "baseline": commit, "head": head,
              "sequences": sequences, "steps": steps, "rounds": rounds, "capture_tokens_per_s_ratio": round(capture_ratio, 4),
              "train_step_time_ratio": round(step_ratio, 4), "shards_identical": identical, "max_relative_loss_difference": loss_gap,
              "runs": {name: [{k: v for k, v in run.items() if k != "shards"} for run in rows] for name, rows in runs.items()}}
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
