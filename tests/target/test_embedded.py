"""target/embedded.py: the embedded SmolLM2 GGUF converted once into a folder that transformers 4.x
and 5.x read alike, its tokenizer saved so that both load it and tokenize as the GGUF, an older
conversion converted again; in the slow lane, the real conversion and its logits."""

import json
from pathlib import Path

import pytest
from support.helpers import flip_a_byte
from support.targets import TOKENIZER_CLASSES_4X_KNOWS, config_as_5x_reads_it

from dflash_pipeline.data.prompts import read_prompts
from dflash_pipeline.foundation.config import TargetConfig
from dflash_pipeline.foundation.files import sha256_file
from dflash_pipeline.generate.run import render_prompt
from dflash_pipeline.target.embedded import CONVERSION_VERSION, _reusable_conversion
from dflash_pipeline.target.folder import forward_fields, with_both_spellings
from dflash_pipeline.target.load import TargetInfo, prepare_target

# The fields of config.json that change the forward pass, as the embedded SmolLM2 GGUF defines them.
EMBEDDED_FORWARD = {"rope_theta": 100000.0, "rope_scaling": {"rope_type": "default"}, "partial_rotary_factor": 1.0,
                    "rms_norm_eps": 9.999999747378752e-06, "tie_word_embeddings": True, "vocab_size": 49152,
                    "dtype": "float32"}
# What transformers 4.x names differently; dropping these leaves what 5.x wrote before the fix.
OLD_SPELLINGS = ("rope_theta", "rope_scaling", "partial_rotary_factor", "torch_dtype")


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
    # A file damaged since the conversion (a flipped bit in a hard-linked cache file) is converted
    # again, not reused: the stamp records every file's sha256. A stamp from before records none.
    (folder / "model.safetensors").write_bytes(bytes(range(256)) * 16)
    digests = {"model.safetensors": sha256_file(folder / "model.safetensors")}
    assert reusable(both, {**current, "files": digests})
    flip_a_byte(folder / "model.safetensors")
    assert not reusable(both, {**current, "files": digests})
    assert reusable(both, current)


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


@pytest.mark.slow
def test_static_kv_generation_answers_the_default_prompts_as_transformers_does(embedded_target):
    """The real target, fp32 on a CPU: the static-KV decode loop (`generate.run.static_greedy_generate`,
    issue #28) gives transformers' own forward's greedy answers token for token, for the first
    default prompts of each category in one left-padded batch."""
    from oracles.generate import dynamic_greedy_generate

    from dflash_pipeline.data.prompts import read_prompts
    from dflash_pipeline.generate.run import render_prompt, static_greedy_generate
    from dflash_pipeline.target.load import load_target

    out_dir, _ = embedded_target
    model, tokenizer = load_target(TargetInfo.from_json(out_dir / "target.json"))
    prompts, seen = [], set()
    for prompt in read_prompts(Path(__file__).parents[2] / "data" / "prompts" / "default.jsonl", val_fraction=0.1).prompts:
        if prompt.category not in seen:
            seen.add(prompt.category)
            prompts.append(render_prompt(tokenizer, prompt, system_prompt=None, enable_thinking=False))
    prompts = prompts[:6]
    expected = dynamic_greedy_generate(model, prompts, max_new_tokens=48, eos_ids={2}, pad_id=2)
    got = static_greedy_generate(model, prompts, max_new_tokens=48, eos_ids={2}, pad_id=2)
    assert len({len(p) for p in prompts}) > 1
    assert [(a.token_ids, a.finish_reason) for a in got] == [(a.token_ids, a.finish_reason) for a in expected]


@pytest.mark.slow
def test_static_speculation_on_the_real_target_equals_plain_greedy_and_the_host_loop(embedded_target, monkeypatch):
    """The real target, fp32 on a CPU, and a drafter of the real sizes (its logits an oracle of
    the answer, `test_static_speculation.install_oracle`): the static speculative step answers two
    default prompts as transformers' plain greedy decoding does, chain and DDTree, and takes the
    host loop's steps (issue #28)."""
    import torch
    from oracles.decoding import host_greedy_decode, host_speculative_decode
    from support.speculation import host_proposer, install_oracle

    from dflash_pipeline.decoding.plain import greedy_decode
    from dflash_pipeline.decoding.session import Speculation
    from dflash_pipeline.speculation.modes import DecodingMode
    from dflash_pipeline.drafters.core import DFlashDrafter
    from dflash_pipeline.drafters.config import DrafterConfig
    from dflash_pipeline.target.load import LayerTap, TargetHead, load_target

    out_dir, _ = embedded_target
    model, tokenizer = load_target(TargetInfo.from_json(out_dir / "target.json"))
    config = model.config
    torch.manual_seed(0)
    drafter = DFlashDrafter(DrafterConfig(hidden_size=config.hidden_size, intermediate_size=1536, num_layers=1, num_attention_heads=9,
                                          num_key_value_heads=3, head_dim=64, vocab_size=config.vocab_size, block_size=8,
                                          target_layer_ids=(1, 14, 27), num_target_layers=config.num_hidden_layers, mask_token_id=0)).eval()
    head = TargetHead(model.get_input_embeddings().weight.detach(), model.get_output_embeddings().weight.detach())
    tap = LayerTap(model, [1, 14, 27])
    prompts = read_prompts(Path(__file__).parents[2] / "data" / "prompts" / "default.jsonl", val_fraction=0.1).prompts[:2]
    for prompt in prompts:
        ids = render_prompt(tokenizer, prompt, system_prompt=None, enable_thinking=False)
        reference = host_greedy_decode(model, ids, max_new_tokens=24, eos_ids={2})
        assert greedy_decode(model, ids, max_new_tokens=24, eos_ids={2}).tokens == reference.tokens
        with monkeypatch.context() as patch:
            install_oracle(patch, len(ids), reference.tokens, config.vocab_size)
            for mode in (DecodingMode.chain(), DecodingMode.tree(8)):
                run = Speculation(drafter, head, mode).decode(model, ids, max_new_tokens=24, eos_ids={2}, feature_dtype="bf16")
                host = host_speculative_decode(model, tap, drafter, host_proposer(drafter, head, mode), ids, max_new_tokens=24,
                                                      eos_ids={2}, feature_dtype="bf16")
                assert run.tokens == reference.tokens == host.tokens and run.steps == host.steps and max(run.steps) >= 3
    tap.remove()


@pytest.mark.slow
@pytest.mark.parametrize("architecture, model_class, reads_alike_in_4x", [
    ("llama", "LlamaForCausalLM", True),  # the generic tokenizer class: both versions' spellings written
    ("qwen2", "Qwen2ForCausalLM", False),  # transformers 5.x names a Qwen2-specific tokenizer class, kept as it is
])
def test_a_local_gguf_file_is_converted_into_the_stage_output_like_the_default(tmp_path, tiny_llama_dir, architecture, model_class,
                                                                              reads_alike_in_4x):
    """target.model names a .gguf file: converted by the default's converter into out/model, with
    the same stamp (reused while the GGUF and the files match), every file's digest in target.json,
    and the GGUF-loaded model's logits exactly; a later folder target removes the conversion."""
    import torch
    from support.helpers import write_tiny_gguf
    from transformers import AutoModelForCausalLM

    from dflash_pipeline.target.load import load_target

    tiny_gguf = write_tiny_gguf(tmp_path / f"tiny-{architecture}.F32.gguf", architecture=architecture)
    out = tmp_path / "target"
    info = prepare_target(TargetConfig(model=str(tiny_gguf)), out_dir=out)
    assert (info["path"], info["architecture"], info["num_layers"], info["hidden_size"]) == ("model", model_class, 2, 64)
    assert info["rope"] == {"rope_theta": 100000.0, "rope_type": "default"} and info["sliding_window"] is None
    assert "model/model.safetensors" in info["files"] and "model/conversion.json" in info["files"]
    stamp = json.loads((out / "model" / "conversion.json").read_text())
    assert (stamp["source"], stamp["gguf_sha256"], stamp["conversion_version"]) == (tiny_gguf.name, sha256_file(tiny_gguf),
                                                                                   CONVERSION_VERSION)
    assert stamp["reads_alike_in_transformers_4x"] is reads_alike_in_4x
    converted, tokenizer = load_target(TargetInfo.from_json(out / "target.json"))
    reference = AutoModelForCausalLM.from_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name, dtype=torch.float32).eval()
    ids = tokenizer(tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True),
                    add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        torch.testing.assert_close(converted(ids).logits, reference(ids).logits, rtol=0, atol=0)
    weights_written = (out / "model" / "model.safetensors").stat().st_mtime_ns
    assert prepare_target(TargetConfig(model=str(tiny_gguf)), out_dir=out) == info
    assert (out / "model" / "model.safetensors").stat().st_mtime_ns == weights_written  # reused, not converted again
    assert prepare_target(TargetConfig(model=str(tiny_llama_dir)), out_dir=out)["path"] == str(tiny_llama_dir.resolve())
    assert sorted(path.name for path in out.iterdir()) == ["target.json"]


@pytest.mark.slow
def test_a_gguf_without_a_chat_template_is_refused_in_one_line(tmp_path):
    from support.helpers import write_tiny_gguf

    from dflash_pipeline.foundation.errors import PipelineError

    gguf = write_tiny_gguf(tmp_path / "base.gguf", chat_template=False)
    with pytest.raises(PipelineError) as error:
        prepare_target(TargetConfig(model=str(gguf)), out_dir=tmp_path / "target")
    assert str(error.value) == (f"{gguf.resolve()}: no chat template (tokenizer.chat_template); "
                                "the generate stage renders every prompt through it")
    assert not (tmp_path / "target").exists()
