"""integrity/ (checks.py, repair.py) under real DVC: bit rot in hard-linked outputs (a shard, a
checkpoint's weights, an answer chunk), which DVC alone restores from its run cache and relinks onto
rebuilt files, is repaired by `make repro`'s own commands; and a kill -9 during `dvc repro`:
generate's answers resume, and the killed capture's staging folder, which DVC's run cache leaves
behind when it serves the rerun, is gone after them. (The checks and the repair themselves, without
DVC: tests/cli/test_verify.py.)"""

import hashlib

import pyarrow.parquet as pq
import pytest
from support.helpers import REPO_ROOT, flip_a_byte, run, set_params, start_then_kill_9

from dflash_pipeline.data.shards import verify_split
from dflash_pipeline.drafters.checkpoints import load_checkpoint
from dflash_pipeline.integrity.checks import RunPaths, check_cache, check_run
from dflash_pipeline.integrity.dvc_repository import dvc_cache_dir

pytestmark = [pytest.mark.slow, pytest.mark.dvc]  # test lanes (pyproject.toml)


def dvc(repo, *args, check=True):
    return run(["dvc", *args], cwd=repo, check=check)


def make_recipe(target: str) -> list[str]:
    """The commands of a Makefile target as make runs them, its comments and prerequisites left out."""
    lines = (REPO_ROOT / "Makefile").read_text().splitlines()
    start = next(number for number, line in enumerate(lines) if line.startswith(f"{target}:"))
    commands = []
    for line in lines[start + 1:]:
        if not line.startswith("\t"):
            break
        if line.strip() and not line.strip().startswith("#"):
            commands.append(line.strip())
    return commands


def run_make_repro(repo) -> str:
    return "".join(run(["bash", "-c", command], repo).stdout for command in make_recipe("repro"))


def cache_object(repo, path):
    """The DVC cache file that is `path` (its hard link)."""
    inode = path.stat().st_ino
    found = [obj for obj in (dvc_cache_dir(repo) / "files" / "md5").rglob("*") if obj.is_file() and obj.stat().st_ino == inode]
    assert len(found) == 1, f"{path} is not a hard link into the cache ({found})"
    return found[0]


def test_make_repro_checks_the_cache_before_relinking():
    # Relinking trusts the cache: every object must have been checked (and the damaged ones rebuilt) first.
    commands = make_recipe("repro")
    assert commands[0] == "dvc repro" and commands[-1].startswith("dvc checkout --relink")
    assert commands.index("dflash-pipeline verify --repair") < len(commands) - 2 and commands[-2] == "dvc repro"


def test_bit_rot_in_hard_linked_outputs_is_repaired_by_make_repro(reproduced_tiny_pipeline):
    repo = reproduced_tiny_pipeline  # a copy of the run, its outputs still hard links into its cache
    # DVC's state database (per repository path) knows the outputs' hashes after a run; a copy has none until it looks once.
    assert dvc(repo, "status").stdout.strip().endswith("Data and pipelines are up to date.")
    shard = repo / "data" / "hidden" / "train" / "shard-00000.arrow"
    weights = repo / "data" / "checkpoints" / "step_000004" / "model.safetensors"  # the last of max_steps 4, save_every 2
    chunk = repo / "data" / "generated" / "chunks" / "chunk-00000.parquet"  # generate's resume cache: it was reused as it was
    good = {path: path.read_bytes() for path in (shard, weights, chunk)}
    objects = {path: cache_object(repo, path) for path in good}
    for path in good:
        flip_a_byte(path)  # in place: the cache file flips with it
        assert hashlib.md5(objects[path].read_bytes()).hexdigest() != objects[path].parent.name + objects[path].name
    # DVC alone: its state database trusts the unchanged size and mtime, and its cache is the damaged copy.
    assert dvc(repo, "status").stdout.strip().endswith("Data and pipelines are up to date.")
    problems = [finding.problem for finding in check_run(RunPaths.at(repo))]
    assert any(str(shard) in problem and "damaged (sha256" in problem for problem in problems), problems
    assert any(str(weights) in problem and "damaged (sha256" in problem for problem in problems), problems
    assert any(str(chunk) in problem and "damaged (sha256" in problem for problem in problems), problems
    assert sum("DVC cache object" in problem for problem in problems) == 3, problems

    printed = run_make_repro(repo)  # make runs in the repository: paths print relative to it
    removed = [f"verify: removed {path.relative_to(repo)} (damaged)" for path in (shard, weights.parent, chunk)]
    assert all(line in printed.splitlines() for line in removed), printed
    for path, content in good.items():
        # rebuilt byte for byte (train resumed from step 2 and wrote step 4 again; generate answered the chunk's prompts again)
        assert path.read_bytes() == content
        assert cache_object(repo, path).read_bytes() == content  # relinked to a good cache file, not the damaged one
    verify_split(repo / "data" / "hidden" / "train")
    load_checkpoint(weights.parent)
    assert check_cache(repo) == [] and check_run(RunPaths.at(repo)) == []
    assert dvc(repo, "status").stdout.strip().endswith("Data and pipelines are up to date.")


def test_kill_9_during_dvc_repro_resumes_and_make_repro_clears_the_staging_folder_dvc_leaves(tiny_pipeline):
    """The one kill -9 under DVC (each stage's own kill and resume: tests/<stage>/): generate's answered
    prompts survive DVC's rerun (its chunks are a persisted output), and a killed capture's staging
    folder, which DVC's run cache leaves behind when it serves the rerun, is gone after `make repro`."""
    repo = tiny_pipeline
    set_params(repo, generate={"max_prompts": 38, "batch_size": 1, "max_new_tokens": 24})
    dvc(repo, "repro", "target")
    chunks = repo / "data" / "generated" / "chunks"
    start_then_kill_9(["dvc", "repro", "capture"], repo, lambda: len(list(chunks.glob("chunk-*.parquet"))) >= 3, process_group=True)
    written = len(list(chunks.glob("chunk-*.parquet")))
    assert 3 <= written < 38
    resumed = dvc(repo, "repro", "capture")  # DVC's run cache now holds capture with these settings
    assert f"resuming, {written} of 38 prompts already answered" in resumed.stdout
    rows = [r for s in ("train", "val") for r in pq.read_table(repo / "data" / "generated" / f"{s}.parquet").to_pylist()]
    assert len(rows) == len({r["prompt_id"] for r in rows}) == 38

    staging = repo / "data" / "hidden.partial"
    set_params(repo, capture={"batch_tokens": 64})  # other settings, many small batches: a run long enough to kill
    start_then_kill_9(["dvc", "repro", "capture"], repo, lambda: (staging / "train").is_dir(), process_group=True)
    assert staging.is_dir() and not (repo / "data" / "hidden").exists()
    set_params(repo, capture={"batch_tokens": 8192})  # back: DVC serves the output from its run cache, the stage never runs
    cached = dvc(repo, "repro", "capture")
    assert "Stage 'capture' is cached - skipping run" in cached.stdout and staging.is_dir(), cached.stdout  # what DVC leaves

    printed = run_make_repro(repo)
    assert f"verify: removed leftover {staging.relative_to(repo)}" in printed.splitlines(), printed
    assert not staging.exists()
    for split in ("train", "val"):
        verify_split(repo / "data" / "hidden" / split)
    assert dvc(repo, "status").stdout.strip().endswith("Data and pipelines are up to date.")
