"""target/folder.py: config.json and tokenizer_config.json spelled for transformers 4.x and 5.x alike,
and a user's folder whose two spellings disagree refused before any stage trusts it."""

import json
import shutil
from pathlib import Path

import pytest
from support.targets import TOKENIZER_CLASSES_4X_KNOWS, config_as_5x_reads_it

from dflash_pipeline.foundation.config import TargetConfig
from dflash_pipeline.foundation.errors import PipelineError
from dflash_pipeline.target.folder import forward_fields, with_both_spellings
from dflash_pipeline.target.load import prepare_target


def tiny_with_config(source, folder, edit):
    """A copy of the tiny model `source` at `folder` whose config.json is `edit(config)`."""
    shutil.copytree(source, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(edit(config), indent=2))
    return folder


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
    (lambda c: {**_theta(c, 10000.0), "rope_scaling": {"rope_type": "linear", "factor": 2.0}},
     "rope_scaling ({'rope_type': 'linear', 'factor': 2.0}) and rope_parameters ({'rope_type': 'default'}) disagree"),
    (lambda c: {**c, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
                "partial_rotary_factor": 1.0},
     "partial_rotary_factor (1.0) and rope_parameters.partial_rotary_factor (0.5) disagree"),
    (lambda c: {**c, "torch_dtype": "bfloat16"}, "torch_dtype ('bfloat16') and dtype ('float32') disagree"),
], ids=["theta", "scaling-vs-parameters", "rotary-fraction", "dtype"])
def test_user_folder_whose_two_spellings_disagree_is_refused(tiny_llama_dir, tmp_path, edit, message):
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


@pytest.mark.parametrize("rope_parameters", [
    {"rope_type": "default", "rope_theta": 1000000.0},  # Qwen2.5's base, as transformers 5.x saves it
    {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
    {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
], ids=["theta", "scaling", "rotary-fraction"])
def test_a_folder_saved_by_transformers_5x_is_accepted_and_target_json_records_the_rope_it_read(tiny_llama_dir, tmp_path,
                                                                                                  rope_parameters):
    """transformers 5.x saves RoPE under rope_parameters alone, which 4.x never reads (it would use
    base 10,000 and no scaling). The pipeline runs on 5.x: the folder is accepted, read as 5.x reads
    it, and target.json records that RoPE, the same as for the folder spelled for both versions."""
    from transformers import AutoConfig

    saved = tmp_path / "saved-by-5x"
    shutil.copytree(tiny_llama_dir, saved)
    config = AutoConfig.from_pretrained(tiny_llama_dir)
    config.rope_parameters = dict(rope_parameters)
    config.save_pretrained(saved)
    written = json.loads((saved / "config.json").read_text())
    assert "rope_theta" not in written and "rope_scaling" not in written and written["rope_parameters"] == rope_parameters
    info = prepare_target(TargetConfig(model=str(saved)), out_dir=tmp_path / "t")
    assert info["rope"] == rope_parameters and info["num_layers"] == 4
    both = tiny_with_config(saved, tmp_path / "both", lambda config: with_both_spellings(config, where=saved / "config.json"))
    spelled_twice = prepare_target(TargetConfig(model=str(both)), out_dir=tmp_path / "t-both")
    assert spelled_twice["rope"] == info["rope"]  # one reading, whichever spelling the folder used
    assert spelled_twice["fingerprint"] != info["fingerprint"]  # other config.json bytes: another fingerprint


def test_tokenizer_config_is_respelled_for_4x_and_a_class_it_cannot_vouch_for_is_refused(tmp_path):
    from dflash_pipeline.target.folder import (
        tokenizer_config_conflict,
        tokenizer_config_for_both,
    )

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
