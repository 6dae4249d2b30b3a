"""Stage command lines and output comparisons shared by the stage and multi-node tests."""

import filecmp
import json
import sys
from dataclasses import replace

import yaml

from dflash_pipeline.foundation.config import TrainConfig
from dflash_pipeline.train.run import run_train
from support.helpers import REPO_ROOT


def capture_params(tmp_path, **capture):
    import yaml

    params = yaml.safe_load((REPO_ROOT / "params.yaml").read_text())
    params["capture"].update(capture)
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(params))
    return path

def capture_stage_cmd(params, generated, target_json, out, launcher=(sys.executable,)):
    return [*launcher, str(REPO_ROOT / "stages" / "capture.py"), "--params", str(params), "--generated", str(generated),
            "--target", str(target_json), "--out", str(out), "--metrics", str(capture_metrics_path(out)), "--device", "cpu"]

def assert_same_split(a, b):
    for split in ("train", "val"):
        manifest_a = json.loads((a / split / "manifest.json").read_text())
        manifest_b = json.loads((b / split / "manifest.json").read_text())
        assert manifest_a == manifest_b
        for shard in manifest_a["shards"]:
            assert filecmp.cmp(a / split / shard["file"], b / split / shard["file"], shallow=False), shard["file"]


def train_stage_cmd(tmp_path, tiny_run, out, launcher=(sys.executable,), **train):
    _, root = tiny_run
    params = yaml.safe_load((REPO_ROOT / "params.yaml").read_text())
    params["train"].update({k: v for k, v in TINY_TRAIN.__dict__.items()})
    params["train"].update(train)
    path = tmp_path / f"params-{len(train)}-{abs(hash(str(sorted(train.items()))))}.yaml"
    path.write_text(yaml.safe_dump(params))
    return [*launcher, str(REPO_ROOT / "stages" / "train.py"), "--params", str(path), "--hidden", str(root / "hidden"),
            "--target", str(root / "target" / "target.json"), "--out", str(out), "--metrics", str(out.parent / "m.json"),
            "--plots", str(out.parent / "plots"), "--device", "cpu"]


# DFlash: the losses above are pinned for it; DFlash2 runs take `replace(TINY_TRAIN, architecture="dflash2")`.
TINY_TRAIN = TrainConfig(num_layers=1, block_size=4, max_steps=6, tokens_per_step=400, anchors_per_sequence=4,
                         eval_every=3, save_every=3, eval_blocks=16, logits_chunk=64, lr=1e-3, architecture="dflash")

# A DFlash2 drafter with a selector small enough for the tiny run.
TINY_DFLASH2 = replace(TINY_TRAIN, architecture="dflash2", options={"dflash2": dict(selector_rank=8, selector_top_k=4)})


def untimed(curve):
    """A curve without its wall-clock column: what two runs of the same steps must share."""
    return [{key: value for key, value in row.items() if key != "seconds"} for row in curve]


def capture_metrics_path(out):
    return out.parent / "metrics" / f"{out.name}-capture.json"


def train_tiny_run(tiny_run, out, config=TINY_TRAIN, log=lambda *_: None):
    target, root = tiny_run
    return run_train(config, target=target, train_dir=root / "hidden" / "train", val_dir=root / "hidden" / "val",
                     out_dir=out, device="cpu", log=log)
