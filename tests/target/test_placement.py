"""A target split over devices (`target.placement`): the tiny Llama with a CPU budget so small that
its decoder layers go to disk computes exactly what the whole target computes (logits, tapped hidden
states, greedy answers on the decoding engine, the capture stage's shards), and bad placements stop
in one line naming the key."""

import pytest
import torch

from dflash_pipeline.foundation.config import LaunchConfig, TargetConfig, section_from_dict
from dflash_pipeline.foundation.errors import PipelineError
from dflash_pipeline.target.load import LayerTap, load_target
from dflash_pipeline.target.placement import (
    TargetPlacement,
    execution_device,
    is_split,
    plan_device_map,
    weight_bytes,
    whole_target_problem,
)

# The tiny Llama's tied embedding is 12.6 MB in fp32 and each decoder layer ~0.15 MB: this CPU
# budget holds the embedding and a layer or so, and sends the rest to disk.
CPU_BUDGET = 12_900_000


@pytest.fixture(scope="module")
def split_and_whole(tiny_llama_target, tmp_path_factory):
    placement = TargetPlacement(device_map="auto", max_memory={"cpu": CPU_BUDGET},
                                offload_folder=str(tmp_path_factory.mktemp("offload")))
    split, tokenizer = load_target(tiny_llama_target, placement=placement)
    whole, _ = load_target(tiny_llama_target)
    return split, whole, tokenizer, placement


def test_the_map_splits_the_tiny_target_between_cpu_and_disk(split_and_whole):
    split, whole, _, _ = split_and_whole
    placed = set(split.hf_device_map.values())
    assert placed == {"cpu", "disk"}, split.hf_device_map
    assert split.hf_device_map["model.embed_tokens"] == "cpu" and split.hf_device_map["model.layers.3"] == "disk"
    assert is_split(split) and not is_split(whole)
    # offloaded layers hold no weights here, yet they run on the CPU
    assert any(p.device.type == "meta" for p in split.model.layers[3].parameters())
    assert execution_device(split.model.layers[3]) == torch.device("cpu")


def test_a_split_target_computes_the_same_logits_and_tapped_hidden_states(split_and_whole):
    split, whole, tokenizer, _ = split_and_whole
    ids = torch.tensor([tokenizer("The capital of France is a city that", add_special_tokens=False)["input_ids"]])
    outputs = []
    for model in (split, whole):
        tap = LayerTap(model, [0, 2, 3])
        with torch.no_grad():
            logits = model(ids).logits
        outputs.append((logits, tap.features()))
        tap.remove()
    assert torch.equal(outputs[0][0], outputs[1][0])
    assert torch.equal(outputs[0][1], outputs[1][1])


def test_the_decoding_engine_answers_the_same_on_a_split_target(split_and_whole):
    from dflash_pipeline.generate.run import decoding_engine, greedy_generate

    split, whole, tokenizer, _ = split_and_whole
    prompts = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in
               ("Tell me a story about a dragon.", "What is two plus two?", "Name three colours")]
    answers = [greedy_generate(model, prompts, max_new_tokens=12, eos_ids={2}, pad_id=2) for model in (split, whole)]
    assert [a.token_ids for a in answers[0]] == [a.token_ids for a in answers[1]]
    assert decoding_engine(split) == decoding_engine(whole)  # the same static engine (eager on a CPU either way)


def test_capture_on_a_split_target_writes_the_same_shards(tiny_llama_target, tmp_path):
    from support.helpers import write_generated
    from support.stage_commands import assert_same_split

    from dflash_pipeline.capture.run import run_capture
    from dflash_pipeline.foundation.config import CaptureConfig

    generated = write_generated(tmp_path / "generated", {"train": 10, "val": 3}, answer_len=(10, 40))
    config = CaptureConfig(layer_ids=[1, 3], shard_mb=1)
    run_capture(config, target=tiny_llama_target, generated_dir=generated, out_dir=tmp_path / "whole", device="cpu")
    placement = TargetPlacement(device_map="auto", max_memory={"cpu": CPU_BUDGET}, offload_folder=str(tmp_path / "offload"))
    run_capture(config, target=tiny_llama_target, generated_dir=generated, out_dir=tmp_path / "split", device="cpu", placement=placement)
    assert_same_split(tmp_path / "whole", tmp_path / "split")


def test_an_explicit_map_is_taken_as_given(tiny_llama_target, tmp_path):
    device_map = {"model.embed_tokens": "cpu", "lm_head": "cpu", "model.layers": "disk", "model.norm": "cpu", "model.rotary_emb": "cpu"}
    placement = TargetPlacement(device_map=device_map, offload_folder=str(tmp_path / "offload"))
    assert plan_device_map(tiny_llama_target.path, placement, device="cpu", dtype=torch.float32) == device_map


@pytest.mark.parametrize("placement, key, why", [
    (TargetPlacement(device_map={"model": 3}), "target.device_map", "names device 3, and this machine has 0 GPU(s)"),
    (TargetPlacement(device_map={"model": "tpu"}), "target.device_map", "names device 'tpu'"),
    (TargetPlacement(device_map="auto", max_memory={"cpu": 1_000_000}), "target.offload_folder", "puts"),
    (TargetPlacement(device_map="auto", max_memory={"cpu": "lots"}), "target.max_memory", "the size 'lots'"),
    (TargetPlacement(device_map="auto", max_memory={5: "1GiB"}), "target.max_memory", "names device 5"),
])
def test_a_bad_placement_is_one_line_naming_its_key(tiny_llama_target, placement, key, why):
    with pytest.raises(PipelineError) as error:
        plan_device_map(tiny_llama_target.path, placement, device="cpu", dtype=torch.float32)
    message = str(error.value)
    assert f"key '{key}'" in message and why in message and "\n" not in message, message


@pytest.mark.parametrize("section, raw, key", [
    (TargetConfig, {"device_map": "balanced"}, "target.device_map"),
    (TargetConfig, {"max_memory": {"cpu": "1GiB"}}, "target.max_memory"),
    (LaunchConfig, {"processes": 0}, "launch.processes"),
    (LaunchConfig, {"devices_per_replica": 0}, "launch.devices_per_replica"),
])
def test_bad_placement_and_launch_params_are_refused_at_load(section, raw, key):
    name = key.split(".")[0]
    with pytest.raises(PipelineError, match=f"key '{key}'"):
        section_from_dict(section, raw, section=name, partial=True)


def test_whole_target_fit_is_judged_from_the_weight_headers(tiny_llama_target, monkeypatch):
    import dflash_pipeline.target.placement as placement

    size = weight_bytes(tiny_llama_target.path, torch.float32)
    parameters = sum(p.numel() for p in load_target(tiny_llama_target)[0].parameters())  # tied: counted once, as stored
    assert size == parameters * 4 and weight_bytes(tiny_llama_target.path, torch.bfloat16) == parameters * 2
    monkeypatch.setattr(placement, "memory_available", lambda device: size * 2)
    assert whole_target_problem(tiny_llama_target.path, "cpu", torch.float32) is None
    monkeypatch.setattr(placement, "memory_available", lambda device: size)
    problem = whole_target_problem(tiny_llama_target.path, "cpu", torch.float32)
    assert "more than 80% of the" in problem and "target.device_map" in problem
