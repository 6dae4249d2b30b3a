"""Teacher-forced evaluation on a machine smaller than the target: scoring from cached shards reads
only the target's embedding and LM head from its weight files (never the whole model), and when the
whole target does not fit, end-to-end decoding is skipped with the reason recorded in eval.json."""

import dataclasses
import json

import pytest
import torch
from support.stage_commands import train_tiny_run

import dflash_pipeline.foundation.tensor_files as tensor_files
import dflash_pipeline.target.placement as placement
from dflash_pipeline.evaluate.report import to_metrics
from dflash_pipeline.evaluate.run import run_evaluate
from dflash_pipeline.foundation.config import EvaluateConfig
from dflash_pipeline.target.load import load_target, load_target_head

CONFIG = EvaluateConfig(checkpoints="final", anchors_per_sequence=4, tree_budgets=[2], num_prompts=1, max_new_tokens=4, temperatures=[0.0])


@pytest.fixture(scope="module")
def tiny_checkpoints(tiny_run, tmp_path_factory):
    out = tmp_path_factory.mktemp("head-only") / "checkpoints"
    train_tiny_run(tiny_run, out)
    return out


def _figures(record) -> str:
    """The chosen drafter's teacher-forced figures as JSON (NaN spelled alike), without its timing."""
    figures = dataclasses.asdict(record.chosen_record.teacher_forced)
    figures.pop("seconds")
    return json.dumps(figures, sort_keys=True)


def _evaluate(tiny_run, checkpoints, config=CONFIG):
    target, root = tiny_run
    return run_evaluate(config, target=target, hidden_val_dir=root / "hidden" / "val", generated_val=root / "generated" / "val.parquet",
                        checkpoints_dir=checkpoints, device="cpu", log=lambda *_: None)


def test_the_head_read_alone_equals_the_full_models_embedding_and_head(tiny_run):
    target, _ = tiny_run
    head = load_target_head(target, device="cpu", dtype=torch.float32)
    model, _ = load_target(target)
    assert torch.equal(head.embed_weight, model.get_input_embeddings().weight)
    assert torch.equal(head.lm_head_weight, model.get_output_embeddings().weight)


def test_teacher_forced_scoring_never_loads_the_target_and_reads_only_its_head(tiny_run, tiny_checkpoints, monkeypatch):
    target, _ = tiny_run
    reference = _evaluate(tiny_run, tiny_checkpoints, CONFIG.__class__(**{**CONFIG.__dict__, "num_prompts": 0})).record

    import transformers

    def refuse(*args, **kwargs):
        raise AssertionError("the whole target was loaded")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
    read = []
    original = tensor_files.load_safetensors

    def recording(file, names=None):
        if str(file).startswith(str(target.path)):
            read.extend(names or ["<every tensor>"])
        return original(file, names)

    monkeypatch.setattr(tensor_files, "load_safetensors", recording)
    monkeypatch.setattr("dflash_pipeline.target.folder.load_safetensors", recording)
    scored = _evaluate(tiny_run, tiny_checkpoints, CONFIG.__class__(**{**CONFIG.__dict__, "num_prompts": 0})).record
    assert read == ["model.embed_tokens.weight"]  # tied: the head is the embedding; no decoder layer is read
    assert _figures(scored) == _figures(reference)


def test_a_target_too_large_for_this_machine_skips_decoding_and_says_why(tiny_run, tiny_checkpoints, monkeypatch):
    full = _evaluate(tiny_run, tiny_checkpoints).record
    assert full.chosen_record.decoding is not None and full.decoding_skipped is None
    monkeypatch.setattr(placement, "memory_available", lambda device: 1_000_000)  # 1 MB free: the 13 MB target does not fit
    skipped = _evaluate(tiny_run, tiny_checkpoints).record
    assert skipped.chosen_record.decoding is None
    assert "more than 80% of the 0.0 GiB free on cpu" in skipped.decoding_skipped and "target.device_map" in skipped.decoding_skipped
    assert _figures(skipped) == _figures(full)
    metrics = to_metrics(skipped)
    assert metrics["decoding_skipped"] == skipped.decoding_skipped and "chain" not in metrics
    assert "decoding_skipped" not in to_metrics(full)


def test_end_to_end_decoding_on_a_split_target_decodes_what_the_whole_target_does(tiny_run, tiny_checkpoints, tmp_path):
    from dflash_pipeline.target.placement import TargetPlacement

    target, root = tiny_run
    split = TargetPlacement(device_map="auto", max_memory={"cpu": 12_900_000}, offload_folder=str(tmp_path / "offload"))
    results = []
    for chosen in (None, split):
        result = run_evaluate(CONFIG, target=target, hidden_val_dir=root / "hidden" / "val", generated_val=root / "generated" / "val.parquet",
                              checkpoints_dir=tiny_checkpoints, device="cpu", log=lambda *_: None, placement=chosen)
        results.append(result)
    whole, on_split = results
    for a, b in zip(whole.e2e_results, on_split.e2e_results, strict=True):
        assert a.plain.tokens == b.plain.tokens
        assert {name: (run.tokens, run.steps) for name, run in a.speculative.items()} == \
               {name: (run.tokens, run.steps) for name, run in b.speculative.items()}
    assert on_split.record.chosen_record.decoding.chain.lossless_rate == 1.0
    assert on_split.record.decoding_skipped is None
