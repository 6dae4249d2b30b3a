"""cli/verify_shards.py: `dflash-pipeline verify-shards` passes good splits, names a corrupt shard,
and with --target refuses shards captured from another target."""

import json
import shutil

from support.console import assert_one_line_error, invoke


def test_verify_shards_passes_a_good_split_and_names_the_corrupt_shard(cli_run, tmp_path):
    good = invoke("verify-shards", cli_run.val)
    assert good.exit_code == 0, good.output
    assert "ok, 3 sequences" in good.stdout and "layers [1, 3] x 64 in bf16" in good.stdout
    both = invoke("verify-shards", cli_run.hidden)  # a capture output: each split
    assert both.exit_code == 0 and both.stdout.count(": ok, ") == 2, both.output

    split = shutil.copytree(cli_run.val, tmp_path / "val")
    shard = split / "shard-00000.arrow"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, one byte flipped
    shard.write_bytes(bytes(data))
    assert_one_line_error(invoke("verify-shards", split), str(shard), "sha256")
    (tmp_path / "empty").mkdir()
    assert_one_line_error(invoke("verify-shards", tmp_path / "empty"), "no manifest.json")


def test_verify_shards_with_a_target_refuses_shards_of_another_target(cli_run, tmp_path):
    # Without --target, shards captured from another model verify fine: they match their own manifest.
    good = invoke("verify-shards", cli_run.hidden, "--target", cli_run.target_json)
    assert good.exit_code == 0 and good.stdout.count(": ok, ") == good.stdout.count("(matches --target)") == 2, good.output
    foreign = tmp_path / "target.json"
    foreign.write_text(json.dumps({**json.loads(cli_run.target_json.read_text()), "fingerprint": "f" * 64}))
    assert invoke("verify-shards", cli_run.val).exit_code == 0
    assert_one_line_error(invoke("verify-shards", cli_run.val, "--target", foreign), str(cli_run.val / "manifest.json"),
                          "target_fingerprint", f"fingerprint of {foreign} (ffffffffffff): captured from another target")
