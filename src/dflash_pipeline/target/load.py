"""The target model: make it available locally, fingerprint it, load it.

Input: `TargetConfig.model`, one of
- the embedded default `smollm2-135m-instruct`, converted once into an fp32 safetensors folder
  (`embedded`);
- a local `.gguf` file, converted the same way into the same place;
- a local Hugging Face model folder (used where it is, never copied);
- a hub id, resolved through the Hugging Face cache (downloads only when HF_HUB_OFFLINE is off).
A local folder or file is also `TargetConfig.watch`, the path DVC hashes as the stage's dependency
(`check_watch`), so that editing one of its files makes the stage stale.

transformers 4.x and 5.x spell some config fields differently (`folder`): a user's folder whose
two spellings of one field disagree is refused; one with 5.x's spelling alone (as 5.x saves it) is
read as 5.x reads it, and target.json records the RoPE it read (`rope`). A tokenizer without a chat
template is refused (generate renders every prompt through it).

Output: `target.json`, a small fingerprint (architecture, sizes, context length, dtype, RoPE, the
sliding window of any sliding-window layers, and a hash of config, weight index, tokenizer and chat
template). Downstream stages depend on that file alone, so a different target makes them stale and
nothing else does. The DVC cache holds only what the stage
writes: the embedded default's conversion, never a user's own folder or the Hugging Face cache.
For a model the stage wrote into its own output (the conversion), target.json also records the
sha256 of every file (`files`, outside the fingerprint), and `TargetInfo.from_json`, which every
stage and command opens the target through, refuses a damaged file in one line naming it.

Also the target's pieces that other modules use: which layers feed the drafter (`build_target_layer_ids`)
and the hooks that read them (`LayerTap`), and the frozen embedding and LM head (`TargetHead`, read
alone from the weight files through `hf_folder.read_tensors`).
"""

import hashlib
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from dflash_pipeline.foundation.config import EMBEDDED_TARGET, TargetConfig
from dflash_pipeline.foundation.errors import PipelineError
from dflash_pipeline.foundation.files import digest_problem, read_json, sha256_file, write_json_atomic
from dflash_pipeline.foundation.tensor_files import safetensors_header_bytes
from dflash_pipeline.target.embedded import GGUF_SUFFIX, convert_embedded, convert_gguf
from dflash_pipeline.target.folder import check_config_spellings, read_tensors
from dflash_pipeline.target.placement import TargetPlacement, plan_device_map

TARGET_FORMAT_VERSION = 1
# Files that define how text becomes token ids and how conversations become text.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model")
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass(frozen=True)
class TargetInfo:
    """What downstream stages know about the target: read from target.json."""

    path: Path
    architecture: str
    model_type: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    dtype: str
    fingerprint: str
    eos_token_ids: tuple[int, ...]
    # The longest sequence the target was built for (config.json's max_position_embeddings); None
    # when its config names none, or target.json is from before it was recorded (nothing checked).
    max_position_embeddings: int | None = None
    # The window of the target's sliding-window layers (None: every layer attends to all of its
    # context). The static decoding engine keeps every key and masks by position, trees included.
    sliding_window: int | None = None

    @classmethod
    def from_json(cls, path: Path) -> "TargetInfo":
        data = read_json(path, missing="no target fingerprint; run the `target` stage first (dvc repro target)")
        # What the file is comes first: another JSON (a shard manifest) is "not a target.json".
        missing = [key for key in ("path", "architecture", "model_type", "num_layers", "hidden_size", "vocab_size", "dtype",
                                   "fingerprint", "eos_token_ids") if key not in data]
        if missing:
            raise PipelineError(f"{path}: no key {missing[0]!r} (not a target.json of the `target` stage)")
        if data.get("format_version") != TARGET_FORMAT_VERSION:
            raise PipelineError(f"{path}: format_version {data.get('format_version')!r}, expected {TARGET_FORMAT_VERSION}")
        model_path = Path(data["path"])
        if not model_path.is_absolute():
            # A relative path (the embedded conversion) is relative to target.json's own folder.
            model_path = Path(path).resolve().parent / model_path
        problem = target_files_problem(path, data)
        if problem:
            raise PipelineError(problem)
        context = data.get("max_position_embeddings")
        if context is not None and (isinstance(context, bool) or not isinstance(context, int) or context < 1):
            raise PipelineError(f"{path}: max_position_embeddings is {context!r}, expected a whole number >= 1 or null")
        return cls(
            path=model_path,
            architecture=data["architecture"],
            model_type=data["model_type"],
            num_layers=data["num_layers"],
            hidden_size=data["hidden_size"],
            vocab_size=data["vocab_size"],
            dtype=data["dtype"],
            fingerprint=data["fingerprint"],
            eos_token_ids=tuple(data["eos_token_ids"]),
            max_position_embeddings=context,
            sliding_window=data.get("sliding_window"),
        )


def target_files_problem(path: Path, data: dict) -> str | None:
    """The first file target.json's `files` records whose sha256 differs (digests are remembered
    per process, so a command that opens the target twice hashes it once), or None."""
    recorded = data.get("files") or {}
    if not isinstance(recorded, dict):
        return f"{path}: files is {type(recorded).__name__}, expected a mapping of file to sha256"
    folder = Path(path).parent
    for name, digest in sorted(recorded.items()):
        problem = digest_problem(folder / name, digest, recorded_in=path, cached=True)
        if problem:
            return problem
    return None


def _sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _check_model_dir(path: Path, what: str) -> Path:
    if not (path / "config.json").is_file():
        raise PipelineError(f"target.model {what}: {path}/config.json not found (not a Hugging Face model folder)")
    has_weights = any(path.glob("*.safetensors")) or (path / "model.safetensors.index.json").is_file()
    if not has_weights and not any(path.glob("pytorch_model*.bin")):
        raise PipelineError(f"target.model {what}: no *.safetensors or pytorch_model*.bin weights in {path}")
    check_config_spellings(path)
    return path


def _hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0").strip().lower() in ("1", "true", "yes", "on")


def resolve_target(config: TargetConfig, *, embedded_dir: Path) -> Path:
    """Return a local folder holding the target, converting or downloading as `config` says.

    The embedded default and a local .gguf file are converted into `embedded_dir`. Fails within
    seconds, with one line naming what was looked for, when the model is not there.
    """
    name = config.model
    if name == EMBEDDED_TARGET:
        return convert_embedded(embedded_dir)
    local = Path(name).expanduser()
    if local.exists():
        if local.is_file() and local.suffix.lower() == GGUF_SUFFIX:
            return convert_gguf(local.resolve(), embedded_dir, name=name, source=local.name, both_versions=False)
        if not local.is_dir():
            raise PipelineError(f"target.model {name!r}: is a file, expected a Hugging Face model folder or a {GGUF_SUFFIX} file")
        return _check_model_dir(local.resolve(), repr(name))
    if not HUB_ID.match(name):
        raise PipelineError(
            f"target.model {name!r}: no such folder, not a hub id (org/name), and not the embedded {EMBEDDED_TARGET!r}"
        )
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    patterns = ["*.json", "*.safetensors", "tokenizer*", "*.jinja", "*.txt", "*.model"]
    try:
        folder = snapshot_download(
            repo_id=name, revision=config.revision, allow_patterns=patterns, local_files_only=_hub_offline()
        )
    except LocalEntryNotFoundError:
        raise PipelineError(
            f"target.model {name!r}: not in the Hugging Face cache and hub downloads are off (HF_HUB_OFFLINE=1); "
            "download it first, point target.model at a local folder, or set HF_HUB_OFFLINE=0"
        ) from None
    except (HfHubHTTPError, OSError, ValueError) as exc:
        raise PipelineError(f"target.model {name!r}: could not fetch from the hub ({type(exc).__name__}: {exc})") from None
    return _check_model_dir(Path(folder), repr(name))


def _weights_index_hash(model_dir: Path) -> str:
    """Hash of what identifies the weights without reading them: the index or each file's header.

    A safetensors header lists every tensor's name, dtype, shape and byte range; together with the
    file size it changes whenever the weights are replaced by a different checkpoint layout. Hashing
    all bytes of a 27B model would take minutes on every stage run; the header takes microseconds.
    Same-shape weight edits are caught by the conversion stamp (embedded) or are the user's choice.
    """
    digest = hashlib.sha256()
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        digest.update(index.read_bytes())
    files = sorted(model_dir.glob("*.safetensors")) or sorted(model_dir.glob("pytorch_model*.bin"))
    for file in files:
        size = file.stat().st_size
        digest.update(f"{file.name}:{size}".encode())
        if file.suffix == ".safetensors":
            digest.update(safetensors_header_bytes(file))
    return digest.hexdigest()


def sliding_window(config) -> int | None:
    """The smallest window of the layers whose KV cache keeps only the last tokens, or None when
    every layer keeps all: the layers transformers' DynamicCache makes for this config, read
    from the cache it builds (sliding-window and chunked attention, any spelling of the config)."""
    from transformers import DynamicCache

    windows = [layer.sliding_window for layer in DynamicCache(config=config).layers if getattr(layer, "is_sliding", False)]
    return min(windows) if windows else None


def fingerprint_target(model_dir: Path, *, name: str, recorded_path: str) -> dict:
    """Describe the target in a small, deterministic dict (the content of target.json)."""
    from transformers import AutoConfig, AutoTokenizer

    try:
        config = AutoConfig.from_pretrained(model_dir)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError, KeyError) as exc:
        raise PipelineError(f"target.model {name!r}: {model_dir} is not loadable ({type(exc).__name__}: {exc})".replace("\n", " ")) from None
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    if not tokenizer.chat_template:
        # json.dumps(None) would be the non-empty "null", and generate would fail on its first prompt.
        raise PipelineError(f"target.model {name!r}: the tokenizer in {model_dir} has no chat template "
                            "(tokenizer_config.json chat_template or chat_template.jinja); the generate stage renders every prompt through it")
    chat_template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else json.dumps(tokenizer.chat_template, sort_keys=True)
    tokenizer_digest = hashlib.sha256()
    for file_name in TOKENIZER_FILES:
        file = model_dir / file_name
        if file.is_file():
            tokenizer_digest.update(file_name.encode() + b"\0" + sha256_file(file).encode())
    hashes = {
        "config": _sha256_bytes((model_dir / "config.json").read_bytes()),
        "weights": _weights_index_hash(model_dir),
        "tokenizer": tokenizer_digest.hexdigest(),
        "chat_template": _sha256_bytes(chat_template.encode()),
    }
    eos = text_config.eos_token_id if getattr(text_config, "eos_token_id", None) is not None else tokenizer.eos_token_id
    eos_ids = sorted({int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]) if e is not None})
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos_ids:
        eos_ids.append(int(tokenizer.eos_token_id))
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "float32"
    return {
        "format_version": TARGET_FORMAT_VERSION,
        "model": name,
        "path": recorded_path,
        "architecture": (config.architectures or [type(config).__name__])[0],
        "model_type": text_config.model_type,
        "num_layers": int(text_config.num_hidden_layers),
        "hidden_size": int(text_config.hidden_size),
        "vocab_size": int(text_config.vocab_size),
        "num_attention_heads": int(text_config.num_attention_heads),
        "num_key_value_heads": int(getattr(text_config, "num_key_value_heads", text_config.num_attention_heads)),
        "tie_word_embeddings": bool(getattr(config, "tie_word_embeddings", False)),
        "max_position_embeddings": _context_length(text_config),
        "dtype": str(dtype).replace("torch.", ""),
        "eos_token_ids": eos_ids,
        # What the pipeline read (transformers 5.x), whichever spelling config.json used.
        "rope": getattr(text_config, "rope_parameters", None),
        "sliding_window": sliding_window(config),
        "hashes": hashes,
        "fingerprint": _sha256_bytes(json.dumps(hashes, sort_keys=True).encode()),
    }


def _context_length(text_config) -> int | None:
    """The target's context length as its config states it (GPT-2-style configs call it n_positions)."""
    for name in ("max_position_embeddings", "n_positions"):
        value = getattr(text_config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def check_watch(config: TargetConfig, *, source: str = "params.yaml") -> None:
    """A local target.model (folder or .gguf file) must also be target.watch, the path dvc.yaml
    lists as the `target` stage's dependency: else DVC would not see its files change."""
    local = Path(config.model).expanduser()
    if config.model != EMBEDDED_TARGET and local.exists() and Path(config.watch).resolve() != local.resolve():
        raise PipelineError(f"{source}: key 'target.watch' must name target.model's local path {config.model!r}, so that "
                            f"editing one of its files reruns the target stage, got {config.watch!r}")


def prepare_target(config: TargetConfig, *, out_dir: Path) -> dict:
    """Run the `target` stage: resolve the model and write `out_dir/target.json`; return its content."""
    embedded_dir = out_dir / "model"
    model_dir = resolve_target(config, embedded_dir=embedded_dir)
    if model_dir.resolve() != embedded_dir.resolve() and embedded_dir.exists():
        # A conversion left from an earlier run would only cost hashing time in DVC.
        shutil.rmtree(embedded_dir)
    try:
        recorded = str(model_dir.resolve().relative_to(out_dir.resolve()))
    except ValueError:
        recorded = str(model_dir.resolve())
    info = fingerprint_target(model_dir, name=config.model, recorded_path=recorded)
    if not Path(recorded).is_absolute():
        # The stage's own output (the conversion), cached and pushed by DVC: every file gets its
        # digest, checked wherever the target is opened. A user's folder is only referenced (and
        # hashing a large one in full at every stage would cost minutes): its header hash stays.
        info["files"] = {str(file.relative_to(out_dir)): sha256_file(file) for file in sorted((out_dir / recorded).rglob("*"))
                         if file.is_file() and file != out_dir / "target.json"}
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out_dir / "target.json", info)
    return info


def load_target(info: TargetInfo, *, device: str = "cpu", placement: TargetPlacement | None = None):
    """Load the target's causal LM and tokenizer for inference: fp32 on CPU, bf16 on GPU; whole on
    `device`, or split over devices as `placement` says (`target.placement`)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash_pipeline.foundation.devices import compute_dtype, configure_attention

    configure_attention(device)
    dtype = compute_dtype(device)
    if not (info.path / "config.json").is_file():
        raise PipelineError(f"{info.path}: target model folder is gone; rerun the `target` stage (dvc repro target)")
    tokenizer = AutoTokenizer.from_pretrained(info.path)
    if placement is None or not placement.split:
        model = AutoModelForCausalLM.from_pretrained(info.path, dtype=dtype)
        model.to(device).eval()
        return model, tokenizer
    device_map = plan_device_map(info.path, placement, device=device, dtype=dtype)
    offload = {} if placement.offload_folder is None else {"offload_folder": str(placement.offload_folder)}
    model = AutoModelForCausalLM.from_pretrained(info.path, dtype=dtype, device_map=device_map, **offload)
    return model.eval(), tokenizer


# ----------------------------------------------------------------------------- the frozen head


class TargetHead(torch.nn.Module):
    """The target's frozen input embedding and LM head (the same tensor when tied)."""

    def __init__(self, embed_weight, lm_head_weight):
        super().__init__()
        self.register_buffer("embed_weight", embed_weight, persistent=False)
        self.register_buffer("lm_head_weight", lm_head_weight, persistent=False)

    def embed(self, ids):
        return torch.nn.functional.embedding(ids, self.embed_weight)

    def logits(self, hidden):
        # One contiguous 2-D matmul: a strided 3-D input takes a batched path ~10x slower on CPU.
        flat = hidden.reshape(-1, hidden.shape[-1]).to(self.lm_head_weight.dtype).contiguous()
        return (flat @ self.lm_head_weight.T).view(*hidden.shape[:-1], -1)


def load_target_head(target: TargetInfo, *, device: str, dtype=None) -> TargetHead:
    """The frozen embedding and LM head, read alone from the weight files (never the whole target),
    in `dtype` (None: the target's own on `device`, `devices.compute_dtype`)."""
    if dtype is None:
        from dflash_pipeline.foundation.devices import compute_dtype

        dtype = compute_dtype(device)
    tensors = read_tensors(target.path, ["embed_tokens.weight", "lm_head.weight"])
    if "embed_tokens.weight" not in tensors:
        raise PipelineError(f"{target.path}: no '*embed_tokens.weight' tensor in the target's safetensors files")
    embed = tensors["embed_tokens.weight"]
    head = tensors.get("lm_head.weight", embed)  # tied embeddings store the head once
    if embed.shape[0] != target.vocab_size:
        raise PipelineError(f"{target.path}: embedding has {embed.shape[0]} rows, target.json says vocab {target.vocab_size}")
    return TargetHead(embed.to(device=device, dtype=dtype), head.to(device=device, dtype=dtype))


# ----------------------------------------------------------------------------- layer taps


def build_target_layer_ids(num_target_layers: int, count: int) -> list[int]:
    """DFlash's default taps: the middle layer for one; else evenly spaced over [1, L - 3]."""
    if count < 1:
        raise PipelineError(f"capture.num_layers must be >= 1, got {count}")
    if count == 1:
        return [num_target_layers // 2]
    first, last = 1, num_target_layers - 3
    return [int(round(first + index * (last - first) / (count - 1))) for index in range(count)]


class LayerTap:
    """Forward hooks that keep the outputs of the selected decoder layers, nothing else.

    Layer id i means the OUTPUT of decoder layer i, i.e. `output_hidden_states[i + 1]` in
    transformers; the last layer's output is taken after the final norm, as transformers reports it.
    """

    def __init__(self, model, layer_ids: list[int]):
        decoder = model.get_decoder()
        self.layer_ids = layer_ids
        self.outputs: dict[int, object] = {}
        self._handles = []
        last = len(decoder.layers) - 1
        for layer_id in layer_ids:
            module = decoder.norm if layer_id == last else decoder.layers[layer_id]
            self._handles.append(module.register_forward_hook(self._keeper(layer_id)))

    def _keeper(self, layer_id: int):
        def keep(module, args, output):
            self.outputs[layer_id] = output[0] if isinstance(output, tuple) else output

        return keep

    def features(self):
        """[B, T, len(layer_ids) * H], in layer_ids order."""
        return torch.cat([self.outputs[i] for i in self.layer_ids], dim=-1)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
