"""target/load.py: a target resolved and fingerprinted (a local folder referenced, never copied),
missing models failing fast in one line, and the layer taps' convention (DFlash's default ids;
id i is the output of decoder layer i)."""

import json
import shutil

import pytest
import torch
from support.helpers import flip_a_byte

from dflash_pipeline.foundation.config import TargetConfig
from dflash_pipeline.foundation.errors import PipelineError
from dflash_pipeline.target.load import (
    LayerTap,
    TargetInfo,
    build_target_layer_ids,
    fingerprint_target,
    load_target,
    prepare_target,
)


def test_local_folder_is_referenced_not_copied(tiny_llama_dir, tmp_path):
    info = prepare_target(TargetConfig(model=str(tiny_llama_dir)), out_dir=tmp_path / "target")
    assert sorted(p.name for p in (tmp_path / "target").iterdir()) == ["target.json"]
    assert info["path"] == str(tiny_llama_dir.resolve())
    assert (info["architecture"], info["num_layers"], info["hidden_size"], info["vocab_size"]) == ("LlamaForCausalLM", 4, 64, 49152)
    loaded = TargetInfo.from_json(tmp_path / "target" / "target.json")
    assert loaded.path == tiny_llama_dir.resolve() and loaded.eos_token_ids == (2,)


def test_target_json_records_the_context_length_the_stages_check_against(tiny_llama_dir, tmp_path):
    info = prepare_target(TargetConfig(model=str(tiny_llama_dir)), out_dir=tmp_path / "target")
    assert info["max_position_embeddings"] == 4096  # the tiny Llama's config.json
    assert TargetInfo.from_json(tmp_path / "target" / "target.json").max_position_embeddings == 4096
    del info["max_position_embeddings"]  # a target.json from before it was recorded: nothing to check against
    (tmp_path / "target" / "target.json").write_text(json.dumps(info))
    assert TargetInfo.from_json(tmp_path / "target" / "target.json").max_position_embeddings is None
    (tmp_path / "target" / "target.json").write_text(json.dumps({**info, "max_position_embeddings": "8k"}))
    with pytest.raises(PipelineError, match=r"target.json: max_position_embeddings is '8k', expected a whole number >= 1 or null$"):
        TargetInfo.from_json(tmp_path / "target" / "target.json")


def test_a_model_the_stage_wrote_carries_its_digests_and_a_damaged_file_is_refused_in_one_line(tiny_llama_dir, tmp_path):
    # The embedded conversion lies inside the stage's output (data/target/model) and is cached by
    # DVC: target.json records every file's sha256, and opening the target checks them. A user's
    # own folder is only referenced: nothing recorded, nothing hashed in full.
    out = tmp_path / "target"
    shutil.copytree(tiny_llama_dir, out / "converted")
    info = prepare_target(TargetConfig(model=str(out / "converted")), out_dir=out)
    assert info["path"] == "converted" and "converted/model.safetensors" in info["files"] and "target.json" not in info["files"]
    TargetInfo.from_json(out / "target.json")
    weights = out / "converted" / "model.safetensors"
    flip_a_byte(weights)
    with pytest.raises(PipelineError) as error:
        TargetInfo.from_json(out / "target.json")
    assert str(error.value).startswith(f"{weights}: damaged (sha256 ") and str(error.value).endswith("target.json records "
                                                                                                    f"{info['files']['converted/model.safetensors'][:12]}...)")
    referenced = prepare_target(TargetConfig(model=str(tiny_llama_dir)), out_dir=tmp_path / "user")
    assert "files" not in referenced


def test_fingerprint_is_stable_and_tracks_config_weights_tokenizer_and_template(tiny_llama_dir, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, model)
    base = fingerprint_target(model, name="m", recorded_path="m")
    assert fingerprint_target(model, name="m", recorded_path="m") == base

    def changed(component, edit):
        edit()
        after = fingerprint_target(model, name="m", recorded_path="m")
        assert after["hashes"][component] != base["hashes"][component]
        assert after["fingerprint"] != base["fingerprint"]
        return after

    config = json.loads((model / "config.json").read_text())
    changed("config", lambda: (model / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-5})))
    template = model / "chat_template.jinja"
    changed("chat_template", lambda: template.write_text(template.read_text() + "{{ '' }}"))
    tokenizer_config = model / "tokenizer_config.json"
    changed("tokenizer", lambda: tokenizer_config.write_text(tokenizer_config.read_text().replace("}", ', "x_note": 1}', 1)))

    import torch
    from safetensors.torch import load_file, save_file

    weights = load_file(model / "model.safetensors")
    weights["extra.bias"] = torch.zeros(3)
    changed("weights", lambda: save_file(weights, model / "model.safetensors", metadata={"format": "pt"}))


def test_the_weights_hash_is_the_headers_bytes_as_stored(tiny_llama_dir):
    """Every fingerprint a run recorded (target.json, the shards, checkpoints) hashes each weight
    file's header bytes as stored: read through the one safetensors reader now
    (`tensor_files.safetensors_header_bytes`), they must hash to the same digest as ever."""
    import hashlib

    from dflash_pipeline.target.load import _weights_index_hash

    digest = hashlib.sha256()
    for file in sorted(tiny_llama_dir.glob("*.safetensors")):
        data = file.read_bytes()
        digest.update(f"{file.name}:{len(data)}".encode())
        digest.update(data[8 : 8 + int.from_bytes(data[:8], "little")])
    assert _weights_index_hash(tiny_llama_dir) == digest.hexdigest()


@pytest.mark.parametrize(
    "name, message",
    [
        ("/nonexistent/model-dir", "no such folder, not a hub id"),
        ("someorg/some-model-that-is-not-cached", "not in the Hugging Face cache and hub downloads are off"),
    ],
)
def test_missing_model_fails_fast_with_one_line(tmp_path, name, message, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(PipelineError) as error:
        prepare_target(TargetConfig(model=name), out_dir=tmp_path / "t")
    assert message in str(error.value) and name in str(error.value) and "\n" not in str(error.value)
    assert not (tmp_path / "t" / "target.json").exists()


def test_folder_without_weights_is_refused(tiny_llama_dir, tmp_path):
    folder = tmp_path / "no-weights"
    folder.mkdir()
    shutil.copy(tiny_llama_dir / "config.json", folder / "config.json")
    with pytest.raises(PipelineError, match="no \\*.safetensors"):
        prepare_target(TargetConfig(model=str(folder)), out_dir=tmp_path / "t")


def test_default_layer_ids_follow_dflash():
    assert build_target_layer_ids(30, 5) == [1, 8, 14, 20, 27]
    assert build_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert build_target_layer_ids(30, 1) == [15]
    assert build_target_layer_ids(4, 2) == [1, 1]  # degenerate, refused later as a repeat


def test_layer_id_i_is_output_hidden_states_i_plus_1(tiny_llama_target):
    """Pins the convention against a hand-run forward, including the last layer (after the norm)."""
    model, _ = load_target(tiny_llama_target)
    ids = torch.randint(0, 49152, (2, 9), generator=torch.Generator().manual_seed(0))
    layer_ids = [0, 1, 2, 3]
    tap = LayerTap(model, layer_ids)
    with torch.inference_mode():
        reference = model(ids, output_hidden_states=True)
        model.get_decoder()(input_ids=ids)
    tap.remove()
    for layer_id in layer_ids:
        assert torch.equal(tap.outputs[layer_id], reference.hidden_states[layer_id + 1]), layer_id
    assert not torch.equal(tap.outputs[0], reference.hidden_states[0])  # not the embeddings


def test_a_tokenizer_without_a_chat_template_is_refused_in_one_line(tiny_llama_dir, tmp_path):
    # A base model's folder: generate renders every prompt through the chat template, and used to
    # fail there with a long apply_chat_template traceback (json.dumps(None) is the non-empty "null").
    folder = tmp_path / "base-model"
    shutil.copytree(tiny_llama_dir, folder)
    (folder / "chat_template.jinja").unlink()
    with pytest.raises(PipelineError) as error:
        prepare_target(TargetConfig(model=str(folder)), out_dir=tmp_path / "t")
    message = str(error.value)
    assert message.startswith(f"target.model {str(folder)!r}: the tokenizer in {folder.resolve()} has no chat template")
    assert "generate stage renders every prompt through it" in message and "\n" not in message
    assert not (tmp_path / "t" / "target.json").exists()


def test_a_local_target_must_be_the_path_dvc_watches(tiny_llama_dir, tmp_path, monkeypatch):
    """dvc.yaml lists ${target.watch} as the target stage's dependency: a local target.model
    that is not also target.watch would leave DVC blind to edits of its files."""
    from dflash_pipeline.target.load import check_watch

    params = tmp_path / "experiment.yaml"
    with pytest.raises(PipelineError) as error:
        check_watch(TargetConfig(model=str(tiny_llama_dir)), source=str(params))
    assert str(error.value) == (f"{params}: key 'target.watch' must name target.model's local path {str(tiny_llama_dir)!r}, "
                                "so that editing one of its files reruns the target stage, got 'stages/target.py'")
    monkeypatch.chdir(tiny_llama_dir.parent)  # a relative spelling of the same folder is the same path
    check_watch(TargetConfig(model=str(tiny_llama_dir), watch=tiny_llama_dir.name), source=str(params))
    check_watch(TargetConfig(), source=str(params))  # the embedded default has no local files
    check_watch(TargetConfig(model="someorg/some-model"), source=str(params))  # nor has a hub id
