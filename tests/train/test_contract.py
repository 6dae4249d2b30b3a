"""train/contract.py: the shards checked before step 1 (target, drafter, an empty split), and shards of
other content at equal counts are another run."""

import json
import re
import shutil
from dataclasses import replace

import pytest
from support.stage_commands import TINY_TRAIN, untimed

from dflash_pipeline.capture.run import run_capture
from dflash_pipeline.foundation.config import CaptureConfig
from dflash_pipeline.foundation.errors import PipelineError
from dflash_pipeline.train.run import run_train


def test_an_empty_val_split_stops_before_the_first_step_naming_train(tiny_run, tmp_path):
    # It used to train until the first periodic tau, then stop with an error labelled `evaluate:`.
    target, root = tiny_run
    hidden = tmp_path / "hidden"
    shutil.copytree(root / "hidden" / "train", hidden / "train")
    (hidden / "val").mkdir()
    manifest = json.loads((root / "hidden" / "val" / "manifest.json").read_text())
    (hidden / "val" / "manifest.json").write_text(json.dumps({**manifest, "shards": [], "sequences": 0, "tokens": 0, "loss_tokens": 0}))
    with pytest.raises(PipelineError, match=rf"^train: {re.escape(str(hidden / 'val' / 'manifest.json'))}: the val split holds no "
                                            r"sequence; rerun generate with more prompts"):
        run_train(TINY_TRAIN, target=target, train_dir=hidden / "train", val_dir=hidden / "val", out_dir=tmp_path / "ck", device="cpu")
    assert not (tmp_path / "ck").exists() or not list((tmp_path / "ck").iterdir())


def test_contract_mismatches_are_one_line(tiny_run, tmp_path):
    target, root = tiny_run
    other = replace(target, fingerprint="0" * 64)
    with pytest.raises(PipelineError, match="captured from target .* but the current target is 000000000000"):
        run_train(TINY_TRAIN, target=other, train_dir=root / "hidden" / "train", val_dir=root / "hidden" / "val",
                  out_dir=tmp_path / "ck", device="cpu")
    wider = replace(target, hidden_size=128)
    with pytest.raises(PipelineError, match="manifest hidden_size is 64, but the target has 128"):
        run_train(TINY_TRAIN, target=wider, train_dir=root / "hidden" / "train", val_dir=root / "hidden" / "val",
                  out_dir=tmp_path / "ck", device="cpu")


def test_shards_of_other_content_at_equal_counts_start_a_fresh_run_saying_what_changed(tiny_run, tmp_path):
    # The run record compared shards by token counts, layer ids and dtype only: after recapturing
    # with another capture.target_top_k (or one prompt token changed), train resumed the old run and
    # reported its loss and tau with its weights, for data the params no longer describe.
    import pyarrow as pa
    import pyarrow.parquet as pq

    from dflash_pipeline.data.prompts import GENERATED_SCHEMA

    target, root = tiny_run
    generated = shutil.copytree(root / "generated", tmp_path / "generated")
    hidden, out = tmp_path / "hidden", tmp_path / "ck"
    config = replace(TINY_TRAIN, max_steps=2, save_every=2, eval_every=2)

    def capture(top_k):
        run_capture(CaptureConfig(layer_ids=[1, 3], target_top_k=top_k), target=target, generated_dir=generated, out_dir=hidden,
                    device="cpu")
        return json.loads((hidden / "train" / "manifest.json").read_text())["tokens"]

    def train(folder=out):
        messages = []
        result = run_train(config, target=target, train_dir=hidden / "train", val_dir=hidden / "val", out_dir=folder, device="cpu",
                           log=messages.append)
        return result, [m for m in messages if m.startswith("train: starting fresh") or m.startswith("train: resuming")]

    tokens = capture(8)
    train()
    assert train()[0].resumed_from == 2  # the same shards: the run continues (here: is already done)

    assert capture(4) == tokens  # another target_top_k, equal counts
    result, said = train()
    assert result.resumed_from == 0, said
    assert len(said) == 1 and said[0].startswith("train: starting fresh; removing 1 checkpoint(s) of a different run configuration "
                                                 "(shards.target_top_k 8 -> 4, shards.train.manifest_sha256 "), said
    assert untimed(result.curve) == untimed(train(tmp_path / "fresh")[0].curve)  # what a fresh run on these shards gives

    rows = pq.read_table(generated / "train.parquet").to_pylist()
    rows[0]["prompt_ids"][1] = 563 if rows[0]["prompt_ids"][1] != 563 else 7476  # one prompt token, equal counts
    pq.write_table(pa.Table.from_pylist(rows, schema=GENERATED_SCHEMA), generated / "train.parquet")
    assert capture(4) == tokens
    result, said = train()
    assert result.resumed_from == 0, said
    assert len(said) == 1 and said[0].startswith("train: starting fresh; removing 1 checkpoint(s) of a different run configuration "
                                                 "(shards.train.manifest_sha256 "), said
    assert "shards.val" not in said[0]  # the val shards are the same
