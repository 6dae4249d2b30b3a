"""Stage `target`: resolution, fast failures, fingerprints, and the embedded default's conversion."""

import json
import shutil

import pytest

from conftest import REPO_ROOT, run
from dflash_pipeline.config import TargetConfig
from dflash_pipeline.errors import PipelineError
from dflash_pipeline.target import TargetInfo, fingerprint_target, prepare_target


def test_local_folder_is_referenced_not_copied(tiny_llama_dir, tmp_path):
    info = prepare_target(TargetConfig(model=str(tiny_llama_dir)), out_dir=tmp_path / "target")
    assert sorted(p.name for p in (tmp_path / "target").iterdir()) == ["target.json"]
    assert info["path"] == str(tiny_llama_dir.resolve())
    assert (info["architecture"], info["num_layers"], info["hidden_size"], info["vocab_size"]) == ("LlamaForCausalLM", 4, 64, 49152)
    loaded = TargetInfo.from_json(tmp_path / "target" / "target.json")
    assert loaded.path == tiny_llama_dir.resolve() and loaded.eos_token_ids == (2,)


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


def test_stage_command_prints_one_error_line_and_exits_1(tmp_path):
    params = tmp_path / "params.yaml"
    params.write_text((REPO_ROOT / "params.yaml").read_text().replace("model: smollm2-135m-instruct", "model: /no/such/model"))
    result = run(["python", str(REPO_ROOT / "stages" / "target.py"), "--params", str(params), "--out", str(tmp_path / "t")],
                 cwd=tmp_path, check=False)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == ["error: target.model '/no/such/model': no such folder, not a hub id (org/name), "
                                                  "and not the embedded 'smollm2-135m-instruct'"]


@pytest.mark.slow
def test_embedded_default_converts_to_identical_logits(tmp_path):
    """The fp32 conversion of the GGUF gives the GGUF-loaded model's logits exactly (tolerance 0)."""
    import torch
    from transformers import AutoModelForCausalLM

    from dflash_pipeline.target import embedded_gguf_path, load_target

    info = prepare_target(TargetConfig(), out_dir=tmp_path / "target")
    assert (info["model"], info["num_layers"], info["hidden_size"], info["vocab_size"]) == ("smollm2-135m-instruct", 30, 576, 49152)
    assert info["path"] == "model" and info["eos_token_ids"] == [2]
    converted, tokenizer = load_target(TargetInfo.from_json(tmp_path / "target" / "target.json"))
    gguf = embedded_gguf_path()
    reference = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Write fizzbuzz in Python."}], tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        expected, actual = reference(ids).logits, converted(ids).logits
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)
    # A second run reuses the conversion (its stamp matches) and writes the same fingerprint.
    stamp_mtime = (tmp_path / "target" / "model" / "model.safetensors").stat().st_mtime_ns
    again = prepare_target(TargetConfig(), out_dir=tmp_path / "target")
    assert again == info
    assert (tmp_path / "target" / "model" / "model.safetensors").stat().st_mtime_ns == stamp_mtime
