"""Stage `target`: resolution, fast failures, fingerprints, config spellings, and the embedded default's conversion."""

import json
import shutil
from pathlib import Path

import pytest

from conftest import REPO_ROOT, run
from dflash_pipeline.config import TargetConfig
from dflash_pipeline.errors import PipelineError
from dflash_pipeline.generate import render_prompt
from dflash_pipeline.target.folder import forward_fields, with_both_spellings
from dflash_pipeline.data.prompts import read_prompts
from dflash_pipeline.target.embedded import CONVERSION_VERSION, _reusable_conversion
from dflash_pipeline.target.load import TargetInfo, fingerprint_target, prepare_target

# The fields of config.json that change the forward pass, as the embedded SmolLM2 GGUF defines them.
EMBEDDED_FORWARD = {"rope_theta": 100000.0, "rope_scaling": {"rope_type": "default"}, "partial_rotary_factor": 1.0,
                    "rms_norm_eps": 9.999999747378752e-06, "tie_word_embeddings": True, "vocab_size": 49152,
                    "dtype": "float32"}
# What transformers 4.x names differently; dropping these leaves what 5.x wrote before the fix.
OLD_SPELLINGS = ("rope_theta", "rope_scaling", "partial_rotary_factor", "torch_dtype")
# tokenizer_class values that transformers 4.57's AutoTokenizer resolves to a fast tokenizer built
# from tokenizer.json: "PreTrainedTokenizerFast" (its tokenizer_class_from_name returns that class
# by name) and the GPT2 classes (listed in its TOKENIZER_MAPPING_NAMES; the hub's SmolLM2 names
# GPT2Tokenizer). 5.x's "TokenizersBackend" is not one: 4.57.1 raises "Tokenizer class
# TokenizersBackend does not exist or is not currently imported".
TOKENIZER_CLASSES_4X_KNOWS = ("PreTrainedTokenizerFast", "GPT2Tokenizer", "GPT2TokenizerFast")


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


@pytest.mark.subprocess
def test_stage_command_prints_one_error_line_and_exits_1(tmp_path):
    params = tmp_path / "params.yaml"
    params.write_text((REPO_ROOT / "params.yaml").read_text().replace("model: smollm2-135m-instruct", "model: /no/such/model"))
    result = run(["python", str(REPO_ROOT / "stages" / "target.py"), "--params", str(params), "--out", str(tmp_path / "t")],
                 cwd=tmp_path, check=False)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == ["error: target.model '/no/such/model': no such folder, not a hub id (org/name), "
                                                  "and not the embedded 'smollm2-135m-instruct'"]


def tiny_with_config(source, folder, edit):
    """A copy of the tiny model `source` at `folder` whose config.json is `edit(config)`."""
    shutil.copytree(source, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(edit(config), indent=2))
    return folder


def config_as_5x_reads_it(config: dict, folder):
    """`config` as transformers 5 loads it (from `folder`/config.json), minus where it was loaded from."""
    from transformers import AutoConfig

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    loaded = AutoConfig.from_pretrained(folder).to_dict()
    loaded.pop("_name_or_path", None)
    return loaded


@pytest.mark.parametrize("rope_parameters", [
    {"rope_type": "default", "rope_theta": 100000.0},
    {"rope_type": "linear", "factor": 2.0, "rope_theta": 50000.0},
])
def test_both_spellings_read_the_same_under_4x_and_5x_and_change_nothing_5x_reads(tiny_llama_dir, tmp_path, rope_parameters):
    import torch
    from transformers import AutoModelForCausalLM

    only_5x = tiny_with_config(tiny_llama_dir, tmp_path / "only-5x", lambda config: {**config, "rope_parameters": rope_parameters})
    assert forward_fields(json.loads((only_5x / "config.json").read_text()), reader="4.x")["rope_theta"] == 10000.0
    both = tiny_with_config(only_5x, tmp_path / "both", lambda config: with_both_spellings(config, where=only_5x / "config.json"))
    config = json.loads((both / "config.json").read_text())
    old, new = forward_fields(config, reader="4.x"), forward_fields(config, reader="5.x")
    assert old == new
    assert (old["rope_theta"], old["rope_scaling"]["rope_type"]) == (rope_parameters["rope_theta"], rope_parameters["rope_type"])
    assert (old["rms_norm_eps"], old["tie_word_embeddings"], old["vocab_size"], old["dtype"]) == (1e-6, True, 49152, "float32")
    # transformers 5 reads exactly what it read before the 4.x spellings were added: same config, same logits.
    only_5x_config = json.loads((only_5x / "config.json").read_text())
    assert config_as_5x_reads_it(config, tmp_path / "read-both") == config_as_5x_reads_it(only_5x_config, tmp_path / "read-5x")
    ids = torch.tensor([[1, 200, 3000, 45000, 7, 2]])
    with torch.inference_mode():
        logits = [AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()(ids).logits for folder in (only_5x, both)]
    torch.testing.assert_close(logits[1], logits[0], rtol=0, atol=0)


def _theta(config, value):
    return {**config, "rope_parameters": {"rope_type": "default", "rope_theta": value}}


@pytest.mark.parametrize("edit, message", [
    (lambda c: {**_theta(c, 100000.0), "rope_theta": 10000.0},
     "rope_theta (10000.0) and rope_parameters.rope_theta (100000.0) disagree"),
    (lambda c: _theta(c, 100000.0), "transformers 4.x reads rope_theta as 10000.0 (from rope_theta, absent) but 5.x as 100000.0"),
    (lambda c: {**_theta(c, 10000.0), "rope_scaling": {"rope_type": "linear", "factor": 2.0}},
     "rope_scaling ({'rope_type': 'linear', 'factor': 2.0}) and rope_parameters ({'rope_type': 'default'}) disagree"),
    (lambda c: {**c, "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}},
     "transformers 4.x reads rope_scaling as {'rope_type': 'default'} (from rope_scaling, absent)"),
    (lambda c: {**c, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}},
     "transformers 4.x reads partial_rotary_factor as 1.0"),
    (lambda c: {**c, "torch_dtype": "bfloat16"}, "torch_dtype ('bfloat16') and dtype ('float32') disagree"),
], ids=["theta-both-differ", "theta-only-5x", "scaling-vs-parameters", "scaling-only-5x", "rotary-fraction-only-5x", "dtype"])
def test_user_folder_whose_4x_and_5x_spellings_disagree_is_refused(tiny_llama_dir, tmp_path, edit, message):
    folder = tiny_with_config(tiny_llama_dir, tmp_path / "model", edit)
    with pytest.raises(PipelineError) as error:
        prepare_target(TargetConfig(model=str(folder)), out_dir=tmp_path / "t")
    text = str(error.value)
    assert text.startswith(f"{folder.resolve() / 'config.json'}: ") and message in text and "\n" not in text
    assert not (tmp_path / "t" / "target.json").exists()


@pytest.mark.parametrize("edit", [
    # What most hub folders hold today: the 4.x spelling only, which 5.x falls back to.
    lambda c: {**{k: v for k, v in c.items() if k not in ("rope_parameters", "dtype")},
               "rope_theta": 100000.0, "rope_scaling": None, "torch_dtype": "float32"},
    lambda c: with_both_spellings(_theta(c, 100000.0), where=Path("config.json")),
    lambda c: {**c, "rope_scaling": {"type": "linear", "factor": 2.0}, "rope_theta": 10000.0,
               "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}},
], ids=["4x-only", "both-spellings", "legacy-type-key"])
def test_user_folder_that_reads_the_same_under_4x_and_5x_is_accepted(tiny_llama_dir, tmp_path, edit):
    folder = tiny_with_config(tiny_llama_dir, tmp_path / "model", edit)
    assert prepare_target(TargetConfig(model=str(folder)), out_dir=tmp_path / "t")["num_layers"] == 4


def test_conversion_from_older_code_is_not_reused(tmp_path):
    """A folder stamped by the conversion before both spellings existed is converted again."""
    folder = tmp_path / "model"
    folder.mkdir()
    only_5x = {"rope_parameters": {"rope_type": "default", "rope_theta": 100000.0}, "dtype": "float32", "vocab_size": 49152}
    stamp = {"source": "x.gguf", "gguf_sha256": "abc", "dtype": "float32"}
    tokenizer_5x = {"backend": "tokenizers", "eos_token": "<|im_end|>", "tokenizer_class": "TokenizersBackend"}
    tokenizer_both = {**tokenizer_5x, "tokenizer_class": "PreTrainedTokenizerFast"}

    def reusable(config, stamp, tokenizer_config=tokenizer_both):
        (folder / "config.json").write_text(json.dumps(config))
        (folder / "conversion.json").write_text(json.dumps(stamp))
        (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
        return _reusable_conversion(folder, "abc")

    current = {**stamp, "conversion_version": CONVERSION_VERSION, "transformers_version": "5.24.0"}
    both = with_both_spellings(only_5x, where=folder / "config.json")
    assert reusable(both, current)
    assert not reusable(only_5x, stamp, tokenizer_5x)  # the first conversion's folder
    assert not reusable(both, {**current, "conversion_version": 2}, tokenizer_5x)  # the second's
    assert not reusable(both, stamp)                   # an old stamp, even on files patched by hand
    assert not reusable(only_5x, current)              # the 4.x spellings edited away
    assert not reusable(both, current, tokenizer_5x)   # the tokenizer class 4.x knows edited away
    assert not reusable(both, {**current, "gguf_sha256": "other"})


def test_tokenizer_config_is_respelled_for_4x_and_a_class_it_cannot_vouch_for_is_refused(tmp_path):
    from dflash_pipeline.target.folder import tokenizer_config_conflict, tokenizer_config_for_both

    where = tmp_path / "tokenizer_config.json"
    written_by_5x = {"tokenizer_class": "TokenizersBackend", "backend": "tokenizers", "eos_token": "<|im_end|>",
                     "extra_special_tokens": ["<file_sep>"], "is_local": True, "local_files_only": True}
    assert tokenizer_config_conflict(written_by_5x)
    both = tokenizer_config_for_both(written_by_5x, where=where)
    assert both == {"additional_special_tokens": ["<file_sep>"], "backend": "tokenizers", "eos_token": "<|im_end|>",
                    "tokenizer_class": "PreTrainedTokenizerFast"}
    assert list(both) == sorted(both) and tokenizer_config_conflict(both) is None
    assert both["tokenizer_class"] in TOKENIZER_CLASSES_4X_KNOWS
    with pytest.raises(PipelineError, match="tokenizer_class 'LlamaTokenizer'"):
        tokenizer_config_for_both({**written_by_5x, "tokenizer_class": "LlamaTokenizer"}, where=where)


def check_tokenizer_folder_as_gguf(folder: Path, gguf_tokenizer, prompts_file: Path) -> None:
    """`folder`'s tokenizer names a class 4.x knows and, loaded by transformers (5.x here), renders
    every prompt to the GGUF tokenizer's ids, with the same special tokens, added tokens and length."""
    from transformers import AutoTokenizer

    tokenizer_class = json.loads((folder / "tokenizer_config.json").read_text())["tokenizer_class"]
    assert tokenizer_class in TOKENIZER_CLASSES_4X_KNOWS
    loaded = AutoTokenizer.from_pretrained(folder)
    for name in ("all_special_ids", "all_special_tokens", "bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id",
                 "chat_template"):
        assert getattr(loaded, name) == getattr(gguf_tokenizer, name), name
    assert len(loaded) == len(gguf_tokenizer) == 49152
    assert {i: (str(t), t.special) for i, t in loaded.added_tokens_decoder.items()} == \
           {i: (str(t), t.special) for i, t in gguf_tokenizer.added_tokens_decoder.items()}
    prompts = read_prompts(prompts_file, val_fraction=0.1).prompts
    for system_prompt in (None, "Answer in one line."):
        for prompt in prompts:
            ids = render_prompt(loaded, prompt, system_prompt=system_prompt, enable_thinking=False)
            assert ids == render_prompt(gguf_tokenizer, prompt, system_prompt=system_prompt, enable_thinking=False)
            assert loaded.decode(ids) == gguf_tokenizer.decode(ids)


def test_tokenizer_is_saved_for_4x_and_tokenizes_as_the_gguf(smollm2_gguf_tokenizer, sample_prompts, tmp_path):
    """transformers 5 saves the GGUF's tokenizer as "TokenizersBackend", which 4.x cannot load; the
    conversion's writer names the same tokenizer so both versions load it, byte-stable."""
    from dflash_pipeline.target.embedded import save_tokenizer_for_both

    for folder in (tmp_path / "a", tmp_path / "b"):
        save_tokenizer_for_both(smollm2_gguf_tokenizer, folder)
    check_tokenizer_folder_as_gguf(tmp_path / "a", smollm2_gguf_tokenizer, sample_prompts)
    files = sorted(path.name for path in (tmp_path / "a").iterdir())
    assert files == ["chat_template.jinja", "tokenizer.json", "tokenizer_config.json"]
    for path in (tmp_path / "a").iterdir():
        assert path.read_bytes() == (tmp_path / "b" / path.name).read_bytes(), path.name


@pytest.fixture(scope="module")
def embedded_target(tmp_path_factory):
    """The embedded default converted once for this module's slow tests: (target folder, target.json content)."""
    out_dir = tmp_path_factory.mktemp("embedded") / "target"
    return out_dir, prepare_target(TargetConfig(), out_dir=out_dir)


@pytest.mark.slow
def test_embedded_conversion_reads_the_same_under_transformers_4x_and_5x(embedded_target, tmp_path, smollm2_gguf_tokenizer,
                                                                          sample_prompts):
    """transformers 4.x reads rope_theta at the top level only; without it, it loads RoPE base 10000.
    Its AutoTokenizer does not know 5.x's "TokenizersBackend" class."""
    import transformers

    out_dir, _ = embedded_target
    model_dir = out_dir / "model"
    config = json.loads((model_dir / "config.json").read_text())
    assert forward_fields(config, reader="4.x") == EMBEDDED_FORWARD
    assert forward_fields(config, reader="5.x") == EMBEDDED_FORWARD
    assert (config["rope_theta"], config["rope_scaling"], config["torch_dtype"]) == (100000.0, None, "float32")
    stamp = json.loads((model_dir / "conversion.json").read_text())
    assert stamp["conversion_version"] == CONVERSION_VERSION
    assert stamp["transformers_version"] == config["transformers_version"] == transformers.__version__
    # Adding the 4.x spellings changed nothing transformers 5 reads.
    only_5x = {key: value for key, value in config.items() if key not in OLD_SPELLINGS}
    assert config_as_5x_reads_it(config, tmp_path / "both") == config_as_5x_reads_it(only_5x, tmp_path / "only-5x")
    check_tokenizer_folder_as_gguf(model_dir, smollm2_gguf_tokenizer, sample_prompts)


@pytest.mark.slow
def test_embedded_default_converts_to_identical_logits(embedded_target):
    """The fp32 conversion of the GGUF gives the GGUF-loaded model's logits exactly (tolerance 0)."""
    import torch
    from transformers import AutoModelForCausalLM

    from dflash_pipeline.target.embedded import embedded_gguf_path
    from dflash_pipeline.target.load import load_target

    out_dir, info = embedded_target
    assert (info["model"], info["num_layers"], info["hidden_size"], info["vocab_size"]) == ("smollm2-135m-instruct", 30, 576, 49152)
    assert info["path"] == "model" and info["eos_token_ids"] == [2]
    converted, tokenizer = load_target(TargetInfo.from_json(out_dir / "target.json"))
    gguf = embedded_gguf_path()
    reference = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Write fizzbuzz in Python."}], tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        expected, actual = reference(ids).logits, converted(ids).logits
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)
    # A second run reuses the conversion (its stamp matches) and writes the same fingerprint.
    stamp_mtime = (out_dir / "model" / "model.safetensors").stat().st_mtime_ns
    again = prepare_target(TargetConfig(), out_dir=out_dir)
    assert again == info
    assert (out_dir / "model" / "model.safetensors").stat().st_mtime_ns == stamp_mtime
