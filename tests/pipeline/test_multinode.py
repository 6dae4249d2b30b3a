"""Capture and train across several machines, as far as one machine can show it: two torchrun
"nodes" (two gloo processes each) launched at the same time, meeting on localhost.

Each node is its own `torchrun --nnodes 2 --nproc_per_node 2 ...`, the README's multi-node recipe
with localhost for the head node's address, in both of its rendezvous forms: static (`--node_rank`,
`--master_addr`, `--master_port`; the capture test) and c10d (`--rdzv-backend c10d`, which assigns
node ranks itself; the train test). The outcome must be the single-process one: capture's shards
byte-identical, train's curve and final weights the same with the same global batch. Both nodes
write into one folder, as nodes sharing a filesystem do (the recipe's requirement).
"""

import json
import socket
import subprocess
import sys

import pytest
import torch
from support.helpers import run, stage_env, write_generated
from support.stage_commands import (
    assert_same_split,
    capture_params,
    capture_stage_cmd,
    train_stage_cmd,
)

from dflash_pipeline.data.shards import open_split
from dflash_pipeline.drafters.checkpoints import load_checkpoint

NODES, PROCESSES_PER_NODE = 2, 2


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def static_node(node_rank: int, port: int) -> tuple[str, ...]:
    """torchrun for one node with a fixed node rank; node 0 hosts the rendezvous and holds global rank 0."""
    return (sys.executable, "-m", "torch.distributed.run", "--nnodes", str(NODES), "--node_rank", str(node_rank),
            "--nproc_per_node", str(PROCESSES_PER_NODE), "--master_addr", "127.0.0.1", "--master_port", str(port))


def c10d_node(node_rank: int, port: int) -> tuple[str, ...]:
    """torchrun for one node of an elastic c10d rendezvous: the same command on every node (the
    rendezvous picks node ranks, so `node_rank` is unused), the head's address as the endpoint."""
    return (sys.executable, "-m", "torch.distributed.run", "--nnodes", str(NODES), "--nproc_per_node", str(PROCESSES_PER_NODE),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "dflash-test",
            "--local-addr", "127.0.0.1")


def run_on_two_nodes(node_launcher, make_cmd, cwd, timeout: float = 300) -> list[str]:
    """Start one torchrun per node at once (`make_cmd(launcher)` builds the stage command), wait for
    both, fail with both outputs when either fails; return each node's output."""
    port = free_port()
    nodes = [subprocess.Popen(make_cmd(node_launcher(node_rank, port)), cwd=cwd, env=stage_env(), text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for node_rank in range(NODES)]
    try:
        outputs = [node.communicate(timeout=timeout)[0] for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
                node.wait()
    if any(node.returncode != 0 for node in nodes):
        raise AssertionError("\n".join(f"node {i} exited {node.returncode}:\n{out}" for i, (node, out) in enumerate(zip(nodes, outputs))))
    return outputs


@pytest.mark.subprocess
def test_two_nodes_of_two_processes_write_the_same_shards_as_one_process(tiny_run, tmp_path):
    _, root = tiny_run
    target_json = root / "target" / "target.json"
    generated = write_generated(tmp_path / "generated", {"train": 90, "val": 9}, answer_len=(10, 120))
    params = capture_params(tmp_path, layer_ids=[0, 3], shard_mb=1, batch_tokens=2048)
    run(capture_stage_cmd(params, generated, target_json, tmp_path / "single"), cwd=tmp_path)
    outputs = run_on_two_nodes(static_node, lambda launcher: capture_stage_cmd(params, generated, target_json, tmp_path / "nodes", launcher=launcher),
                               tmp_path)
    # Enough shards that every one of the four ranks wrote some: shard n belongs to global rank n % 4.
    assert len(open_split(tmp_path / "nodes" / "train").manifest.shards) >= NODES * PROCESSES_PER_NODE
    assert_same_split(tmp_path / "single", tmp_path / "nodes")
    # Global rank 0 (node 0's first process) alone reports and writes the manifests: node 1 says nothing of it.
    assert "capture train: 90 sequences" in outputs[0] and "shard(s) written" in outputs[0], outputs[0]
    assert "capture train" not in outputs[1] and "shard(s) written" not in outputs[1], outputs[1]


@pytest.mark.subprocess
def test_two_nodes_of_two_processes_train_the_same_curve_and_weights_as_one_process(tiny_run, tmp_path):
    single = tmp_path / "single" / "ck"
    run(train_stage_cmd(tmp_path, tiny_run, single, max_steps=4, eval_every=4, save_every=4), cwd=tmp_path)
    nodes = tmp_path / "nodes" / "ck"
    outputs = run_on_two_nodes(c10d_node, lambda launcher: train_stage_cmd(tmp_path, tiny_run, nodes, launcher=launcher, max_steps=4,
                                                                      eval_every=4, save_every=4), tmp_path)
    # One job of four ranks, not two jobs of two: global rank 0 alone reports, and sees four.
    assert [f"on cpu x{NODES * PROCESSES_PER_NODE}," in output for output in outputs].count(True) == 1, outputs
    assert not any(f"on cpu x{PROCESSES_PER_NODE}," in output for output in outputs), outputs
    one = load_checkpoint(single / "step_000004")[0].state_dict()
    four = load_checkpoint(nodes / "step_000004")[0].state_dict()
    assert one.keys() == four.keys()
    for name in one:
        # Four ranks add the same gradients in another order: equal up to float rounding.
        torch.testing.assert_close(four[name], one[name], rtol=1e-4, atol=1e-6, msg=name)
    curve_one = json.loads((single / "state.json").read_text())["curve"]
    curve_four = json.loads((nodes / "state.json").read_text())["curve"]
    assert [r["step"] for r in curve_four] == [r["step"] for r in curve_one]
    assert [r["loss"] for r in curve_four] == pytest.approx([r["loss"] for r in curve_one], rel=1e-4)
    assert curve_four[-1]["tau"] == pytest.approx(curve_one[-1]["tau"], rel=1e-4)


def test_capture_refuses_a_manifest_when_another_nodes_shards_are_not_in_its_folder(tiny_run, tmp_path):
    """Rank 0 of two, with rank 1 writing to a disk rank 0 cannot see (simulated: rank 1 never runs here)."""
    from dflash_pipeline.capture.run import capture_split
    from dflash_pipeline.capture.plan import load_sequences
    from dflash_pipeline.foundation.config import CaptureConfig
    from dflash_pipeline.foundation.errors import PipelineError
    from dflash_pipeline.target.load import LayerTap, load_target

    target, _ = tiny_run
    generated = write_generated(tmp_path / "generated", {"train": 90}, answer_len=(10, 120))
    sequences, stats = load_sequences(generated / "train.parquet", max_length=2048, on_too_long="truncate")
    model, _ = load_target(target)
    tap = LayerTap(model, [0, 3])
    out = tmp_path / "hidden" / "train"
    with pytest.raises(PipelineError, match=r"shard-00001\.arrow: written by rank 1 of 2 but not visible to rank 0 "
                                            r"\(2 shard\(s\) absent\); on several machines --out must be a folder all nodes share"):
        capture_split(sequences, stats, split="train", model=model, tap=tap, target=target,
                      config=CaptureConfig(layer_ids=[0, 3], shard_mb=1, batch_tokens=2048), layer_ids=[0, 3], out_dir=out,
                      pad_id=2, rank=0, world=2, barrier=lambda: None)
    tap.remove()
    assert not (out / "manifest.json").exists()


@pytest.mark.subprocess
def test_train_refuses_ranks_that_would_resume_at_different_steps(tiny_run, tmp_path):
    """Nodes without a shared --out: rank 0's folder holds a finished run, rank 1's is empty (each
    rank gets its own folder through a wrapper). Resuming the first and starting the second afresh
    would train two models in lockstep; every rank must stop with the reason instead."""
    run(train_stage_cmd(tmp_path, tiny_run, tmp_path / "ck-rank0", max_steps=4, eval_every=4, save_every=2), cwd=tmp_path)
    wrapper = tmp_path / "own_out_per_rank.py"
    wrapper.write_text("import os, runpy, sys\n"
                       "args = sys.argv[1:]\n"
                       "args[args.index('--out') + 1] += f\"-rank{os.environ['RANK']}\"\n"
                       "sys.argv = args\n"
                       "runpy.run_path(args[0], run_name='__main__')\n")
    torchrun = (sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
                str(wrapper))
    result = run(train_stage_cmd(tmp_path, tiny_run, tmp_path / "ck", launcher=torchrun, max_steps=4, eval_every=4, save_every=2),
                 cwd=tmp_path, check=False)
    assert result.returncode != 0
    message = "error: train: ranks would resume at different steps (0 to 4): on several machines --out must be a folder all nodes share"
    assert (result.stdout + result.stderr).count(message) == 2, result.stdout + result.stderr
    assert not (tmp_path / "ck-rank1").exists() or not list((tmp_path / "ck-rank1").glob("step_*"))


@pytest.mark.dvc
@pytest.mark.slow
def test_the_recipe_generate_on_two_nodes_then_dvc_commit_records_what_one_process_makes(tiny_pipeline):
    """docs/scale.md's multi-node recipe for generate: every node runs the same torchrun line (c10d)
    over the shared checkout, `dvc commit` records the output, and DVC then sees a pipeline that
    needs no rerun of it; a single-process rerun makes the same answers (the same hash)."""
    import yaml

    repo = tiny_pipeline

    def dvc(*args):
        return run([sys.executable, "-m", "dvc", *args], repo)

    dvc("repro", "target")
    params = yaml.safe_load((repo / "params.yaml").read_text())
    command = ["stages/generate.py", "--params", "params.yaml", "--prompts", params["generate"]["prompts"], "--target",
               "data/target/target.json", "--out", "data/generated", "--metrics", "data/metrics/generate.json"]
    outputs = run_on_two_nodes(c10d_node, lambda launcher: [*launcher, *command], repo)
    assert ["generate: train" in output for output in outputs].count(True) == 1, outputs  # global rank 0 alone reports
    dvc("commit", "-f", "generate")
    status = dvc("status", "generate").stdout
    assert "changed" not in status, status

    def recorded() -> str:
        lock = yaml.safe_load((repo / "dvc.lock").read_text())["stages"]["generate"]
        return next(out["md5"] for out in lock["outs"] if out["path"] == "data/generated")

    by_nodes = recorded()
    run(["rm", "-rf", "data/generated"], repo)
    dvc("repro", "-f", "-s", "generate")  # one process, from nothing
    assert recorded() == by_nodes
