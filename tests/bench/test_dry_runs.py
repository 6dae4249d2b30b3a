"""Every bench's dry run (bench/README.md): CPU, the tiny random target and toy data of bench/toy.py,
toy sizes. Each bench's `main` runs in this process (a process per bench would pay torch's and
transformers' imports each time), all on one toy run built once; the GPU check's scripts, which are
processes by nature, run in tests/bench/test_device_paths.py. What a dry run prints means nothing:
these tests check that each bench runs end to end and reports its figures."""

import importlib
import json

import click
import pytest
from support.helpers import REPO_ROOT

from bench.toy import dry_run_options, toy_run


@pytest.fixture(scope="module")
def toy_work(tmp_path_factory):
    """One toy run (bench/toy.py) for every bench here: each builds the parts it needs once."""
    return tmp_path_factory.mktemp("bench-toy")


def run_bench(module: str, args: list[str], capsys) -> str:
    bench = importlib.import_module(module)
    bench.main(args, standalone_mode=False)
    return capsys.readouterr().out


# (bench module, what its output must say, the files it must write into the toy run's folder): the
# benches a user runs, then the studies, whose results go beside the toy run, never into bench/results.
DRY_RUNS = [
    ("bench.generate", "ratio", ()),
    ("bench.capture", "time to first sample", ()),
    ("bench.train", "step time, shard loader / in memory", ()),
    ("bench.evaluate", "where the batched path's time goes", ()),
    ("bench.speculative", "tree k=4, T=0", ()),
    ("bench.verify_length", "evaluate's rule picks k =", ()),
    ("bench.studies.train_study", "dflash2", ("train_study.json", "train_study.csv", "train_study.png")),
    ("bench.studies.compute_curve", "break-even", ("compute_curve.json", "compute_curve.csv", "compute_curve.png")),
]


@pytest.mark.parametrize("module, says, writes", DRY_RUNS, ids=[module for module, _, _ in DRY_RUNS])
def test_a_bench_runs_its_dry_run(module, says, writes, toy_work, capsys):
    results = {path: path.stat().st_mtime_ns for path in (REPO_ROOT / "bench" / "results").iterdir()}
    out = run_bench(module, ["--dry-run", "--work", str(toy_work)], capsys)
    assert says in out, out[-2000:]
    assert all((toy_work / name).is_file() for name in writes), sorted(p.name for p in toy_work.iterdir())
    assert {path: path.stat().st_mtime_ns for path in (REPO_ROOT / "bench" / "results").iterdir()} == results


def test_the_capture_figures_dry_run_gives_every_figure(toy_work, capsys):
    out = run_bench("bench.gpu.capture_figures", ["--dry-run", "--folder", str(toy_work)], capsys)
    figures = json.loads(out[out.index("{"):])
    assert figures["device"] == "cpu" and figures["capture_stage_tokens_per_s"] > 0 and figures["writer_vs_disk"] > 0


def test_the_scale_costs_dry_run_writes_only_where_it_is_told(tmp_path, capsys):
    from bench.studies import scale_costs

    committed = scale_costs.OUT.read_text()
    scale_costs.main(["--dry-run"])
    assert "70B" in capsys.readouterr().out and scale_costs.OUT.read_text() == committed
    scale_costs.main(["--dry-run", "--out", str(tmp_path / "costs.json")])
    assert json.loads((tmp_path / "costs.json").read_text())["rows"] == json.loads(committed)["rows"]


@pytest.mark.subprocess  # the stage commands, one process and two under torchrun
def test_the_scale_bench_dry_run(toy_work, capsys):
    out = run_bench("bench.scale", ["--dry-run", "--work", str(toy_work)], capsys)
    record = json.loads((toy_work / "scale_cpu.json").read_text())
    assert set(record["stages"]) == {"generate", "capture"} and "the same bytes" in out
    assert record["identical_outputs"]["2 processes x 1 thread"] == {"answers": True, "shards": True}


@pytest.mark.dvc  # dvc repro, commit, status, push, pull, checkout, unprotect
def test_the_dvc_costs_dry_run(tmp_path, capsys):
    from bench.studies import dvc_costs

    dvc_costs.main(["--dry-run", "--workdir", str(tmp_path / "work"), "--json", str(tmp_path / "costs.json")])
    (row,) = json.loads((tmp_path / "costs.json").read_text())["rows"]
    assert row["name"] == "hardlink-256mb" and row["pulled_verified"] and row["clone_status_clean"]
    assert row["page_cache_dropped"] is False  # a dry run leaves the machine's page cache alone


def test_a_dry_run_without_a_work_folder_removes_the_one_it_made(tmp_path, capsys):
    made = []

    @click.command()
    @dry_run_options
    def bench(dry_run, work):
        made.append(work)
        (work / "toy").write_text("x")

    bench(["--dry-run"], standalone_mode=False)
    assert made[0].name.startswith("bench-dry-run-") and not made[0].exists()
    bench(["--dry-run", "--work", str(tmp_path)], standalone_mode=False)
    assert made[1] == tmp_path and (tmp_path / "toy").is_file()  # a folder it was given stays


def test_a_toy_run_keeps_the_parts_it_has(toy_work):
    first = toy_run(toy_work)
    built = {path: path.stat().st_mtime_ns for path in toy_work.rglob("*") if path.is_file()}
    assert toy_run(toy_work) == first and first.last_checkpoint.name == "step_000004"
    assert {path: path.stat().st_mtime_ns for path in built} == built
