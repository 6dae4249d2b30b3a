"""Stage `generate`: batched greedy decoding, resume after kill -9, the stage's outputs."""

import json
import sys

import pyarrow.parquet as pq
import pytest
from support.helpers import (
    REPO_ROOT,
    SAMPLE_PROMPTS,
    folder_bytes,
    run,
    start_then_kill_9,
    write_jsonl,
)

from dflash_pipeline.data.prompts import GENERATED_SCHEMA, read_generated, read_prompts
from dflash_pipeline.foundation.config import GenerateConfig, TargetConfig
from dflash_pipeline.foundation.errors import PipelineError
from dflash_pipeline.generate.run import greedy_generate, render_prompt, run_generate
from dflash_pipeline.target.load import TargetInfo, load_target, prepare_target


@pytest.fixture(scope="module")
def tiny_target(tiny_llama_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("target")
    prepare_target(TargetConfig(model=str(tiny_llama_dir)), out_dir=out)
    info = TargetInfo.from_json(out / "target.json")
    model, tokenizer = load_target(info)
    return info, model, tokenizer, out / "target.json"


def _token_ids(tokenizer, count):
    prompts = read_prompts(write_jsonl_tmp(), val_fraction=0.1).prompts[:count]
    return [render_prompt(tokenizer, p, system_prompt=None, enable_thinking=False) for p in prompts]


def write_jsonl_tmp():
    import tempfile
    from pathlib import Path

    return write_jsonl(Path(tempfile.mkdtemp()) / "p.jsonl", SAMPLE_PROMPTS)


def test_batched_greedy_equals_one_prompt_at_a_time(tiny_target):
    info, model, tokenizer, _ = tiny_target
    prompts = _token_ids(tokenizer, 6)
    assert len({len(p) for p in prompts}) > 1, "prompts of different lengths exercise left padding"
    batched = greedy_generate(model, prompts, max_new_tokens=12, eos_ids={2}, pad_id=2)
    single = [greedy_generate(model, [p], max_new_tokens=12, eos_ids={2}, pad_id=2)[0] for p in prompts]
    assert [a.token_ids for a in batched] == [a.token_ids for a in single]
    assert all(a.finish_reason == "length" and len(a.token_ids) == 12 for a in batched)


def test_rows_stop_at_eos_and_leave_the_batch(tiny_target):
    info, model, tokenizer, _ = tiny_target
    prompts = _token_ids(tokenizer, 4)
    free = [greedy_generate(model, [p], max_new_tokens=10, eos_ids={2}, pad_id=2)[0].token_ids for p in prompts]
    # Declare the 4th token of the first answer an EOS token: that row must stop right there while
    # the others (unless they emit it too) run on, and every row must still match its solo run.
    stop_token = free[0][3]
    batched = greedy_generate(model, prompts, max_new_tokens=10, eos_ids={stop_token}, pad_id=2)
    for answer, solo in zip(batched, free):
        cut = solo.index(stop_token) + 1 if stop_token in solo else len(solo)
        assert answer.token_ids == solo[:cut]
        assert answer.finish_reason == ("stop" if stop_token in solo else "length")
    assert batched[0].finish_reason == "stop" and len(batched[0].token_ids) <= 4


def _config(**overrides) -> GenerateConfig:
    base = dict(max_prompts=0, max_new_tokens=6, batch_size=3, val_fraction=0.25)
    base.update(overrides)
    return GenerateConfig(**base)


def test_run_generate_writes_splits_with_exact_token_ids(tiny_target, sample_prompts, tmp_path):
    info, _, tokenizer, _ = tiny_target
    config = _config()
    prompt_set = read_prompts(sample_prompts, val_fraction=config.val_fraction)
    summary = run_generate(prompt_set, config=config, target=info, out_dir=tmp_path)
    train, val = read_generated(tmp_path / "train.parquet"), read_generated(tmp_path / "val.parquet")
    assert train.schema.remove_metadata().equals(GENERATED_SCHEMA)
    assert train.num_rows + val.num_rows == len(SAMPLE_PROMPTS)
    assert summary["prompts"] == {"train": train.num_rows, "val": val.num_rows}
    by_id = {p.id: p for p in prompt_set.prompts}
    for row in train.to_pylist() + val.to_pylist():
        prompt = by_id[row["prompt_id"]]
        assert row["split"] == prompt.split
        assert row["prompt_ids"] == render_prompt(tokenizer, prompt, system_prompt=None, enable_thinking=False)
        assert len(row["answer_ids"]) == 6 and row["finish_reason"] == "length"
    # Pinned validation prompts stay in validation; file order is kept within each split.
    val_ids = [r["prompt_id"] for r in val.to_pylist()]
    assert all(by_id[i].split == "val" for i in val_ids)
    assert {p.id for p in prompt_set.prompts if p.split == "val"} == set(val_ids)
    settings = json.loads(train.schema.metadata[b"dflash.generation_settings"])
    assert settings["target_fingerprint"] == info.fingerprint and settings["max_new_tokens"] == 6


def test_system_prompt_and_thinking_flag_are_applied_and_recorded(tiny_target, sample_prompts, tmp_path):
    info, _, tokenizer, _ = tiny_target
    config = _config(system_prompt="You answer tersely.", enable_thinking=True)
    prompt_set = read_prompts(sample_prompts, val_fraction=0.25, limit=5)  # the fifth is pinned to val: every split needs one
    summary = run_generate(prompt_set, config=config, target=info, out_dir=tmp_path)
    row = pq.read_table(tmp_path / "train.parquet").to_pylist()[0]
    assert "You answer tersely." in tokenizer.decode(row["prompt_ids"])
    assert summary["settings"]["system_prompt"] == "You answer tersely."
    assert summary["settings"]["enable_thinking"] is True


def test_changed_settings_discard_cached_answers(tiny_target, sample_prompts, tmp_path):
    info, _, _, _ = tiny_target
    prompt_set = read_prompts(sample_prompts, val_fraction=0.25)
    run_generate(prompt_set, config=_config(max_new_tokens=4), target=info, out_dir=tmp_path)
    again = run_generate(prompt_set, config=_config(max_new_tokens=4, batch_size=5), target=info, out_dir=tmp_path)
    assert again["this_run"]["reused_answers"] == len(SAMPLE_PROMPTS) and again["this_run"]["prompts"] == 0
    longer = run_generate(prompt_set, config=_config(max_new_tokens=7), target=info, out_dir=tmp_path)
    assert longer["this_run"]["reused_answers"] == 0
    rows = pq.read_table(tmp_path / "train.parquet").to_pylist()
    assert all(len(r["answer_ids"]) == 7 for r in rows)


def _many_prompts(path, count):
    rows = [{"prompt": f"Question number {i}: what is {i} plus {i * 3}?", "category": "math"} for i in range(count)]
    return write_jsonl(path, rows)


def _generate_cmd(tmp_path, prompts, target_json, out):
    params = tmp_path / "params.yaml"
    params.write_text((REPO_ROOT / "params.yaml").read_text().replace("batch_size: 64", "batch_size: 1")
                      .replace("max_new_tokens: 256", "max_new_tokens: 24").replace("max_prompts: 256", "max_prompts: 0"))
    return [sys.executable, str(REPO_ROOT / "stages" / "generate.py"), "--params", str(params), "--prompts", str(prompts),
            "--target", str(target_json), "--out", str(out), "--metrics", str(_metrics_path(out)), "--device", "cpu"]


def _metrics_path(out):
    return out.parent / "metrics" / f"{out.name}-generate.json"


@pytest.mark.subprocess
def test_kill_9_then_rerun_resumes_without_loss_or_duplicates(tiny_target, tmp_path):
    _, _, _, target_json = tiny_target
    prompts = _many_prompts(tmp_path / "many.jsonl", 40)
    reference = tmp_path / "reference"
    run(_generate_cmd(tmp_path, prompts, target_json, reference), cwd=tmp_path)

    out = tmp_path / "killed"
    start_then_kill_9(_generate_cmd(tmp_path, prompts, target_json, out), tmp_path,
                      lambda: len(list((out / "chunks").glob("chunk-*.parquet"))) >= 3)
    written = len(list((out / "chunks").glob("chunk-*.parquet")))
    assert 3 <= written < 40 and not (out / "train.parquet").exists()

    result = run(_generate_cmd(tmp_path, prompts, target_json, out), cwd=tmp_path)
    assert f"resuming, {written} of 40 prompts already answered" in result.stdout
    for split in ("train", "val"):
        resumed = pq.read_table(out / f"{split}.parquet").to_pylist()
        expected = pq.read_table(reference / f"{split}.parquet").to_pylist()
        assert resumed == expected
    ids = [r["prompt_id"] for s in ("train", "val") for r in pq.read_table(out / f"{s}.parquet").to_pylist()]
    assert len(ids) == len(set(ids)) == 40
    this_run = json.loads(_metrics_path(out).read_text())
    assert this_run["reused_answers"] == written and this_run["prompts"] == 40 - written


@pytest.mark.subprocess
def test_a_rerun_that_adds_no_answer_leaves_the_output_byte_identical(tiny_target, sample_prompts, tmp_path):
    # Timings inside data/generated changed its hash on every rerun; they live in the metrics file.
    _, _, _, target_json = tiny_target
    out = tmp_path / "out"
    run(_generate_cmd(tmp_path, sample_prompts, target_json, out), cwd=tmp_path)
    first = folder_bytes(out)
    assert {"train.parquet", "val.parquet", "summary.json", "chunks/settings.json"} <= set(first)
    this_run = json.loads(_metrics_path(out).read_text())
    assert this_run["prompts"] == len(SAMPLE_PROMPTS) and this_run["seconds"] > 0 and this_run["new_tokens"] > 0
    run(_generate_cmd(tmp_path, sample_prompts, target_json, out), cwd=tmp_path)
    assert folder_bytes(out) == first
    this_run = json.loads(_metrics_path(out).read_text())
    assert this_run["reused_answers"] == len(SAMPLE_PROMPTS) and this_run["prompts"] == 0


@pytest.mark.subprocess
def test_stage_reports_a_bad_prompt_row_as_one_line(tiny_target, tmp_path):
    _, _, _, target_json = tiny_target
    prompts = write_jsonl(tmp_path / "bad.jsonl", [SAMPLE_PROMPTS[0], '{"prompt": "unterminated'])
    result = run(_generate_cmd(tmp_path, prompts, target_json, tmp_path / "out"), cwd=tmp_path, check=False)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1].startswith(f"error: {prompts}:2: malformed JSON")


def test_settings_past_the_targets_context_stop_generate_before_anything_is_written(tiny_target, sample_prompts, tmp_path):
    # generate.max_prompt_tokens: 20000 was accepted for a target of 8192 positions; a 10,001-token
    # prompt then ran for minutes and left an empty chunks/.
    info, _, _, _ = tiny_target
    assert info.max_position_embeddings == 4096
    prompt_set = read_prompts(sample_prompts, val_fraction=0.25)
    with pytest.raises(PipelineError) as error:
        run_generate(prompt_set, config=_config(max_prompt_tokens=4000, max_new_tokens=200), target=info, out_dir=tmp_path / "out",
                     source="experiment.yaml")
    assert str(error.value) == ("experiment.yaml: key 'generate.max_prompt_tokens' plus generate.max_new_tokens (200) must fit the "
                                "target's context, 4096 tokens (its max_position_embeddings, in target.json), got 4000")
    assert not (tmp_path / "out").exists()
    run_generate(prompt_set, config=_config(max_prompt_tokens=4090, max_new_tokens=6), target=info, out_dir=tmp_path / "out")  # fits


def test_a_prompt_over_max_prompt_tokens_is_a_bad_row(tiny_target, tmp_path):
    # It used to be skipped and counted whatever generate.on_bad_row said.
    info, _, tokenizer, _ = tiny_target
    prompts = write_jsonl(tmp_path / "long.jsonl", SAMPLE_PROMPTS + [{"prompt": "many words " * 120, "category": "chat"}])
    line = len(SAMPLE_PROMPTS) + 1
    prompt_set = read_prompts(prompts, val_fraction=0.25)
    length = len(render_prompt(tokenizer, prompt_set.prompts[-1], system_prompt=None, enable_thinking=False))
    assert length > 200
    with pytest.raises(PipelineError) as error:
        run_generate(prompt_set, config=_config(max_prompt_tokens=200, on_bad_row="error"), target=info, out_dir=tmp_path / "out")
    assert str(error.value) == (f"{prompts}:{line}: the prompt is {length} tokens in the target's chat template, longer than "
                                "generate.max_prompt_tokens (200); shorten it, or skip such rows with generate.on_bad_row: skip")
    assert not (tmp_path / "out").exists()  # stopped before anything was written
    summary = run_generate(prompt_set, config=_config(max_prompt_tokens=200, on_bad_row="skip"), target=info, out_dir=tmp_path / "out")
    assert summary["skipped_rows"] == {"longer than max_prompt_tokens=200": 1}
    assert sum(summary["prompts"].values()) == len(SAMPLE_PROMPTS)


def test_a_prompt_file_that_leaves_a_split_empty_is_refused_before_any_answer(tiny_target, tmp_path):
    # One prompt gives 0 val prompts; it used to pass here and in capture, and train stopped at its
    # first periodic tau with an error labelled `evaluate:`.
    info, _, _, _ = tiny_target
    one = write_jsonl(tmp_path / "one.jsonl", [SAMPLE_PROMPTS[0]])
    with pytest.raises(PipelineError) as error:
        run_generate(read_prompts(one, val_fraction=0.1), config=_config(), target=info, out_dir=tmp_path / "out")
    message = str(error.value)
    assert "\n" not in message and message.startswith(f"generate: {one}: 1 prompt(s) give 0 val prompts (generate.val_fraction 0.25"), message
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())  # refused before any work
    only_val = write_jsonl(tmp_path / "val.jsonl", [{**SAMPLE_PROMPTS[0], "split": "val"}])
    with pytest.raises(PipelineError, match=r"give 0 train prompts"):
        run_generate(read_prompts(only_val, val_fraction=0.1), config=_config(), target=info, out_dir=tmp_path / "out")


def test_a_damaged_chunk_is_answered_again_and_damaged_splits_are_refused(tiny_target, sample_prompts, tmp_path, capsys):
    # A flipped byte in chunk-00000.parquet used to be reused on resume ("64 of 64 prompts already
    # answered"), changed a prompt token in train.parquet, and then looked valid to every check.
    from support.helpers import flip_a_byte

    from dflash_pipeline.capture.plan import load_sequences
    from dflash_pipeline.integrity.checks import RunPaths, check_run
    from dflash_pipeline.integrity.repair import repair

    info, _, _, _ = tiny_target
    prompt_set = read_prompts(sample_prompts, val_fraction=0.25)
    out = tmp_path / "data" / "generated"
    run_generate(prompt_set, config=_config(), target=info, out_dir=out)
    first = folder_bytes(out)
    chunk = out / "chunks" / "chunk-00000.parquet"
    in_chunk = pq.read_table(chunk).num_rows
    flip_a_byte(chunk)
    paths = RunPaths.at(tmp_path)
    assert [(f.path, f.kind) for f in check_run(paths)] == [(chunk, "damaged")]  # `dflash-pipeline verify` names it
    capsys.readouterr()
    again = run_generate(prompt_set, config=_config(), target=info, out_dir=out)
    said = [line for line in capsys.readouterr().out.splitlines() if "chunk" in line]
    assert len(said) == 1 and said[0].startswith("generate: answering again the prompts of 1 chunk(s) that do not match their "
                                                 f"recorded sha256: {chunk}: damaged (sha256 "), said
    assert again["this_run"]["reused_answers"] == len(SAMPLE_PROMPTS) - in_chunk and again["this_run"]["prompts"] == in_chunk
    assert folder_bytes(out) == first  # the same answers again (greedy on a CPU), under the chunk's old name
    assert check_run(paths) == []
    assert {"train.parquet.sha256", "val.parquet.sha256", "chunks/chunk-00000.parquet.sha256"} <= set(first)

    # train.parquet and val.parquet: refused in one line naming them by capture's reader and by evaluate's check
    for split in ("train", "val"):
        damaged = out / f"{split}.parquet"
        flip_a_byte(damaged)
        with pytest.raises(PipelineError) as error:
            load_sequences(damaged, max_length=4096, on_too_long="truncate")
        message = str(error.value)
        assert "\n" not in message and message.startswith(f"{damaged}: damaged (sha256 ") and f"{split}.parquet.sha256 records" in message
    findings = check_run(paths)
    assert [f.path for f in findings] == [out / "train.parquet", out / "val.parquet"]
    done = repair(paths, findings)
    assert done == [f"removed {out / 'train.parquet'} (damaged)", f"removed {out / 'val.parquet'} (damaged)"]
    run_generate(prompt_set, config=_config(), target=info, out_dir=out)  # what `dvc repro` then runs
    assert folder_bytes(out) == first
