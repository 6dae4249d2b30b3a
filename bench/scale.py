"""Benchmark: the data-parallel stages at 1 and 2 processes, side by side, on the default target.

    python bench/scale.py [--prompts 64] [--max-new-tokens 48] [--rounds 1]
    python bench/scale.py --dry-run      # the tiny random target, 32 prompts x 4 tokens (tests/bench/test_dry_runs.py)

Runs `generate` and then `capture` as `dvc repro` runs them (`stages/launch.py --processes N`),
each three ways on the same inputs: one process with one thread, one process with a thread per
core, and two processes of one thread each (torchrun, gloo), in turn, round by round. Prints each
stage's wall time (the whole command: start-up, model load, work, the rank-0 assembly) and the
stage's own tokens/s, the ratios against one process with one thread, and whether each way wrote
that run's bytes (answers, shards). Writes bench/results/scale_cpu.json. Needs the `target` stage's output.

On a GPU node the same comparison is one process per GPU: `launch.processes` = GPUs (docs/scale.md).
"""

import filecmp
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click
import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # the checkout: `bench.*` from a plain `python bench/...`

from bench.toy import dry_run_options, toy_run  # noqa: E402

WAYS = {  # name -> (processes, threads per process)
    "1 process x 1 thread": (1, 1),
    "1 process x all cores": (1, os.cpu_count() or 1),
    "2 processes x 1 thread": (2, 1),
}


def _environment(threads: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def _run(stage: str, args: list[str], *, processes: int, threads: int, cwd: Path) -> float:
    """Seconds the whole stage command took."""
    cmd = [sys.executable, str(REPO / "stages" / "launch.py"), "--processes", str(processes), str(REPO / "stages" / f"{stage}.py"), *args]
    started = time.perf_counter()
    result = subprocess.run(cmd, cwd=cwd, env=_environment(threads), capture_output=True, text=True)
    if result.returncode != 0:
        raise click.ClickException(f"{stage} with {processes} process(es) failed:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")
    return time.perf_counter() - started


def _same_files(a: Path, b: Path, pattern: str) -> bool:
    names = sorted(p.relative_to(a) for p in a.glob(pattern))
    return bool(names) and names == sorted(p.relative_to(b) for p in b.glob(pattern)) and all(
        filecmp.cmp(a / name, b / name, shallow=False) for name in names)


@click.command()
@click.option("--target", "target_json", type=click.Path(path_type=Path), default="data/target/target.json", show_default=True)
@click.option("--prompts", "prompt_count", type=int, default=64, show_default=True,
              help="The first N of the default set (its first 24 are pinned to val).")
@click.option("--max-new-tokens", type=int, default=48, show_default=True)
@click.option("--batch-size", type=int, default=8, show_default=True)
@click.option("--rounds", type=int, default=1, show_default=True)
@click.option("--json", "json_path", type=click.Path(path_type=Path), default=REPO / "bench" / "results" / "scale_cpu.json", show_default=True)
@dry_run_options
def main(target_json: Path, prompt_count: int, max_new_tokens: int, batch_size: int, rounds: int, json_path: Path, dry_run: bool,
         work: Path | None) -> None:
    from dflash_pipeline.foundation.devices import machine_description

    if dry_run:  # never the committed result: the dry run's JSON goes beside its toy data
        target_json, json_path = toy_run(work, upto="target").target_json, work / "scale_cpu.json"
        prompt_count, max_new_tokens, batch_size, rounds = 32, 4, 8, 1  # the default set pins its first 24 to val
    # A dry run checks both launch paths (one process, torchrun); a thread count is only an environment variable.
    ways = {way: shape for way, shape in WAYS.items() if not dry_run or shape[1] == 1}
    scratch = Path(tempfile.mkdtemp(prefix="bench-scale-", dir=work))  # every way's outputs, removed at the end
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["generate"].update(max_prompts=prompt_count, max_new_tokens=max_new_tokens, batch_size=batch_size)
    params["capture"].update(shard_mb=4)  # several shards, so both ranks write some
    if dry_run:
        params["capture"].update(layer_ids=[1, 3])  # the tiny target has 4 layers: 5 taps would repeat some
    (scratch / "params.yaml").write_text(yaml.safe_dump(params))
    target_json = target_json.resolve()
    prompts = REPO / params["generate"]["prompts"]
    seconds: dict[str, dict[str, list[float]]] = {"generate": {}, "capture": {}}
    rates: dict[str, dict[str, list[float]]] = {"generate": {}, "capture": {}}
    for round_ in range(rounds):
        for way, (processes, threads) in ways.items():
            out = scratch / f"r{round_}-{processes}-{threads}"
            generate_args = ["--params", str(scratch / "params.yaml"), "--prompts", str(prompts), "--target", str(target_json),
                             "--out", str(out / "generated"), "--metrics", str(out / "generate.json"), "--device", "cpu"]
            seconds["generate"].setdefault(way, []).append(_run("generate", generate_args, processes=processes, threads=threads, cwd=scratch))
            rates["generate"].setdefault(way, []).append(json.loads((out / "generate.json").read_text())["tokens_per_s"])
            capture_args = ["--params", str(scratch / "params.yaml"), "--generated", str(out / "generated"), "--target", str(target_json),
                            "--out", str(out / "hidden"), "--metrics", str(out / "capture.json"), "--device", "cpu"]
            seconds["capture"].setdefault(way, []).append(_run("capture", capture_args, processes=processes, threads=threads, cwd=scratch))
            capture = json.loads((out / "capture.json").read_text())  # both splits: the stage's tokens over its seconds
            rates["capture"].setdefault(way, []).append(round(sum(split["tokens_written"] for split in capture.values())
                                                              / sum(split["seconds"] for split in capture.values()), 1))
            print(f"round {round_ + 1}, {way}: generate {seconds['generate'][way][-1]:.1f} s, capture {seconds['capture'][way][-1]:.1f} s",
                  flush=True)
    # Each way's outputs against one process with one thread, round by round: the same bytes where the
    # arithmetic is the same (one thread per process); another thread count may round a feature otherwise.
    baseline = "1 process x 1 thread"
    same = {}
    for way, (processes, threads) in ways.items():
        pairs = [(scratch / f"r{r}-1-1", scratch / f"r{r}-{processes}-{threads}") for r in range(rounds)]
        same[way] = {"answers": all(_same_files(a / "generated", b / "generated", "*.parquet") for a, b in pairs),
                     "shards": all(_same_files(a / "hidden", b / "hidden", "*/*.arrow") for a, b in pairs)}
    record = {"machine": machine_description(), "date": time.strftime("%Y-%m-%d"), "prompts": prompt_count,
              "max_new_tokens": max_new_tokens, "batch_size": batch_size, "rounds": rounds, "identical_outputs": same, "stages": {}}
    for stage in ("generate", "capture"):
        best = {way: min(values) for way, values in seconds[stage].items()}
        record["stages"][stage] = {way: {"seconds": round(best[way], 2), "stage_tokens_per_s": max(rates[stage][way]),
                                         "speedup_vs_1x1": round(best[baseline] / best[way], 3)} for way in ways}
        print(f"{stage}: " + "; ".join(f"{way} {best[way]:.1f} s ({best[baseline] / best[way]:.2f}x, stage {max(rates[stage][way]):.0f} tok/s)"
                                      for way in ways))
    print(f"the same bytes as 1 process x 1 thread: {same}")
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {json_path}")
    shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
