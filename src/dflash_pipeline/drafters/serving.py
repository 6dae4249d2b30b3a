"""The public DFlash serving format: export our drafter into it, load any drafter out of it.

A drafter folder, as z-lab publishes them and as z-lab/dflash's `DFlashDraftModel.from_pretrained`
(`DFlash2DraftModel` for DFlash2), SGLang (`--speculative-algorithm DFLASH`) and vLLM
(`method: dflash`) read it:

    config.json            a Qwen3 config plus architectures ["DFlashDraftModel"], block_size,
                           num_target_layers, dflash_config {mask_token_id, target_layer_ids};
                           DFlash2: ["DFlash2DraftModel"] and dflash_config also {conv_kernel_size,
                           conv_group_size, selector_rank, selector_top_k} (vLLM reads them there only)
    model.safetensors      the drafter's own weights only: fc, hidden_norm, layers.*, norm
                           (no embedding, no LM head: those are the target's); large published
                           drafters may shard it (model.safetensors.index.json). DFlash2 adds
                           layers.*.{attention,mlp}_conv.{base_kernel, kernel_projection.weight} and
                           candidate_selector.{predecessor_codebook, successor_codebook,
                           hidden_projection.weight} (the codebooks without ".weight", as published;
                           z-lab's from_pretrained maps them onto its nn.Embedding)
    dflash_pipeline.json   ours, optional: our DrafterConfig, the source checkpoint and target, and
                           the sha256 of every other file of the folder (`files`): our loader
                           refuses a folder whose files differ from them, naming the file
    draft_vocab.safetensors ours, optional: `token_ids`, the draft vocabulary of a drafter trained
                           with `train.train_vocab: data`; a server that ignores it drafts over
                           the whole vocabulary (still lossless, a dearer head, lower τ). A
                           DFlash2 selector's codebooks always cover the whole vocabulary (they
                           are indexed by token id), so such a server runs it unchanged; only
                           its top-K may then hold tokens the drafter never learnt to rank

Input of `export_drafter`: a drafter (`export.run.export_checkpoint` exports a training checkpoint).
Output: the folder above, renamed into place when complete. `load_dflash_drafter` reads any such
folder (ours or a published one) into a `DFlashDrafter` with fp32 weights; whatever it cannot
represent exactly is refused with one line naming the file and key, never approximated.
This module writes and reads the folder's weights, draft vocabulary and provenance; config.json's
mapping onto our DrafterConfig and back is `serving_config`'s.
"""

import json
import os
import shutil
from dataclasses import replace
from pathlib import Path

import torch

from dflash_pipeline.foundation.errors import PipelineError
from dflash_pipeline.foundation.files import digest_problem, read_json, sha256_file, write_json_atomic
from dflash_pipeline.drafters import family
from dflash_pipeline.drafters.core import DFlashDrafter
from dflash_pipeline.drafters.config import DrafterConfig, nested_record
from dflash_pipeline.target.folder import weight_files
from dflash_pipeline.drafters.serving_config import DTYPE_NAMES, drafter_config_from_serving, serving_config

WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
PROVENANCE_FILE = "dflash_pipeline.json"
DRAFT_VOCAB_FILE = "draft_vocab.safetensors"
PROVENANCE_VERSION = 1


def public_weight_names(num_layers: int, architecture: str = family.UNNAMED) -> list[str]:
    """The tensor names of the serving format, independent of how core.py names things: the shared
    DFlash tensors and what the architecture adds (`Architecture.public_weight_names`)."""
    per_layer = [f"self_attn.{p}_proj.weight" for p in "qkvo"] + [f"self_attn.{n}_norm.weight" for n in "qk"]
    per_layer += [f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
    per_layer += ["input_layernorm.weight", "post_attention_layernorm.weight"]
    names = ["fc.weight", "hidden_norm.weight", "norm.weight"]
    extra_per_layer, extra_global = family.architecture(architecture).public_weight_names(num_layers)
    per_layer, names = per_layer + extra_per_layer, names + extra_global
    return names + [f"layers.{i}.{name}" for i in range(num_layers) for name in per_layer]


def _public_state(drafter: DFlashDrafter) -> dict[str, torch.Tensor]:
    """The drafter's state_dict under the public names. Ours are the same names by design; this
    check keeps a rename in model.py from silently producing folders no server can load."""
    state = drafter.state_dict()
    state["fc.weight"] = drafter.folded_fc_weight().detach()  # the feature scale folded in
    del state["feature_scale"], state["draft_vocab"]  # the one is folded in, the other has its own file
    public = public_weight_names(drafter.config.num_layers, drafter.config.architecture)
    if set(state) != set(public):
        raise PipelineError(f"DFlashDrafter weights {sorted(set(state) ^ set(public))[:3]} differ from the serving format's names")
    return {name: state[name] for name in public}


# ----------------------------------------------------------------------------- export


def _is_drafter_folder(folder: Path) -> bool:
    try:
        names = json.loads((folder / "config.json").read_text()).get("architectures", [])
        return any(family.by_public_class(name) is not None for name in names)
    except (OSError, ValueError, AttributeError):
        return False


def export_drafter(drafter: DFlashDrafter, out_dir: Path, *, dtype: torch.dtype = torch.float32,
                   source: dict | None = None) -> Path:
    """Write `drafter` to `out_dir` in the serving format; `source` goes into the provenance file."""
    from safetensors.torch import save_file

    if dtype not in DTYPE_NAMES:
        raise PipelineError(f"export dtype must be one of {sorted(DTYPE_NAMES.values())}, got {dtype}")
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()) and not _is_drafter_folder(out_dir):
        # Replacing means deleting: never do that to a folder this function did not write.
        raise PipelineError(f"{out_dir}: exists and is not a DFlash drafter folder; refusing to replace it")
    config = serving_config(drafter.config, dtype=dtype)
    weights = {name: tensor.detach().to("cpu", dtype).contiguous() for name, tensor in _public_state(drafter).items()}
    provenance = {"format_version": PROVENANCE_VERSION, "drafter": drafter.config.to_dict(), "dtype": DTYPE_NAMES[dtype],
                  "source": source or {}}

    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write_json_atomic(tmp / "config.json", config, sort_keys=False)  # the order of the published configs
    save_file(weights, tmp / WEIGHTS_FILE, metadata={"format": "pt"})
    if drafter.has_draft_vocab:
        # Beside the public files, which servers read unchanged (and then draft over the whole
        # vocabulary); our loader and FR-Spec-style servers draft over these token ids only.
        save_file({"token_ids": drafter.draft_vocab.detach().to("cpu").contiguous()}, tmp / DRAFT_VOCAB_FILE)
        provenance["draft_vocab_size"] = int(drafter.draft_vocab.numel())
    # What the folder's files are, so that a flipped bit in the shipped weights is found before it is served or scored.
    provenance["files"] = {path.name: sha256_file(path) for path in sorted(tmp.iterdir()) if path.is_file()}
    write_json_atomic(tmp / PROVENANCE_FILE, provenance)
    # Never a half-written folder under the final name: the old one is moved aside, not overwritten.
    old = out_dir.with_name(out_dir.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if out_dir.exists():
        os.replace(out_dir, old)
    os.replace(tmp, out_dir)
    shutil.rmtree(old, ignore_errors=True)
    return out_dir


# ----------------------------------------------------------------------------- load


def read_serving_weights(directory: Path, expected_shapes: dict[str, tuple[int, ...]], aliases: dict | None = None) -> tuple[dict, dict]:
    """Read the drafter's tensors as fp32, after checking names and shapes against `expected_shapes`.

    Returns (tensors, {name: stored dtype}). Every problem is one line naming the file and tensor.
    """
    from dflash_pipeline.foundation.tensor_files import load_safetensors, safetensors_header

    directory = Path(directory)
    single, index = directory / WEIGHTS_FILE, directory / WEIGHTS_INDEX
    if not single.is_file() and not index.is_file():
        raise PipelineError(f"{directory}: no {WEIGHTS_FILE} (nor {WEIGHTS_INDEX})")
    # A single file wins over an index, as the loaders of the format read it.
    indexed = {} if single.is_file() else weight_files(directory)
    files = sorted(set(indexed.values())) if indexed else [single]
    tensors, stored = {}, {}
    for file in files:
        if not file.is_file():
            raise PipelineError(f"{index}: names shard {file.name}, which does not exist")
        header = safetensors_header(file)  # names and shapes checked before any data is read
        for stored_name, entry in header.items():
            name = (aliases or {}).get(stored_name, stored_name)  # a published spelling of one of ours
            if name in tensors or name in stored:
                raise PipelineError(f"{file}: holds {name!r} twice (as {stored_name!r} and another spelling)")
            if name not in expected_shapes:
                raise PipelineError(f"{file}: unexpected tensor {name!r} (not a DFlash drafter weight)")
            if indexed and indexed.get(stored_name) != file:
                raise PipelineError(f"{file}: holds {stored_name!r}, which {WEIGHTS_INDEX} places elsewhere")
            if entry.shape != expected_shapes[name]:
                raise PipelineError(f"{file}: tensor {name!r} has shape {list(entry.shape)}, config.json implies {list(expected_shapes[name])}")
            stored[name] = None
        for stored_name, tensor in load_safetensors(file).items():
            name = (aliases or {}).get(stored_name, stored_name)
            stored[name] = str(tensor.dtype).removeprefix("torch.")
            tensors[name] = tensor.to(torch.float32)
    missing = [name for name in expected_shapes if name not in tensors]
    if missing:
        where = directory / WEIGHTS_INDEX if indexed else directory / WEIGHTS_FILE
        raise PipelineError(f"{where}: missing tensor {missing[0]!r}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    return tensors, stored


def provenance_problems(directory: Path, provenance: dict) -> list[str]:
    """Each file of an export whose sha256 is not the one its dflash_pipeline.json records, as a
    line naming the file (empty: all match, or the folder records none, as before digests)."""
    recorded = provenance.get("files") or {}
    if not isinstance(recorded, dict):
        return [f"{directory / PROVENANCE_FILE}: files is {type(recorded).__name__}, expected a mapping of file name to sha256"]
    found = (digest_problem(directory / name, digest, recorded_in=directory / PROVENANCE_FILE) for name, digest in sorted(recorded.items()))
    return [problem for problem in found if problem]


def _provenance(directory: Path, config: DrafterConfig) -> tuple[dict | None, DrafterConfig]:
    """Our provenance file if present, and the config with its `extra` notes restored.

    config.json is what every server reads, so it wins; provenance that disagrees with it means one
    of the two was edited by hand, and the drafter's origin is then unknown.
    """
    path = directory / PROVENANCE_FILE
    if not path.is_file():
        return None, config
    provenance = read_json(path, missing="unreadable")
    recorded = nested_record(provenance.get("drafter") or {})  # an export's from before the options were nested too
    extra = recorded.pop("extra", {})
    derived = config.to_dict()
    for key, value in recorded.items():
        if key not in derived:
            continue
        if isinstance(value, dict) and isinstance(derived[key], dict):  # the member's options, key by key
            pairs = [(f"{key}.{option}", v, derived[key][option]) for option, v in value.items() if option in derived[key]]
        else:
            pairs = [(key, value, derived[key])]
        for name, ours, theirs in pairs:
            if ours != theirs:
                raise PipelineError(f"{path}: drafter.{name} is {ours!r}, but config.json gives {theirs!r}")
    return provenance, replace(config, extra=extra)


def _read_draft_vocab(path: Path, vocab_size: int) -> torch.Tensor:
    from dflash_pipeline.foundation.tensor_files import load_safetensors

    token_ids = load_safetensors(path, ["token_ids"]).get("token_ids")
    if token_ids is None:
        raise PipelineError(f"{path}: no token_ids tensor (not a draft vocabulary)")
    if token_ids.dim() != 1 or token_ids.numel() == 0 or token_ids.min() < 0 or token_ids.max() >= vocab_size:
        raise PipelineError(f"{path}: token_ids must be a non-empty list of ids in 0..{vocab_size - 1}")
    return token_ids


def load_dflash_drafter(directory: Path, *, device: str = "cpu") -> tuple[DFlashDrafter, dict]:
    """A DFlashDrafter (fp32) from a serving-format folder, ours or published.

    The info dict holds `config` (config.json as read), `provenance` (ours, or None) and
    `stored_dtype` (the dtype of the weight files, e.g. "bfloat16"). A folder of ours whose files
    are not the ones its provenance records (`provenance_problems`) is refused, naming the file.
    """
    directory = Path(directory)
    config_path = directory / "config.json"
    raw = read_json(config_path, missing="no config.json (not a DFlash drafter folder)")
    drafter_config = drafter_config_from_serving(raw, where=config_path)
    provenance, drafter_config = _provenance(directory, drafter_config)
    drafter = DFlashDrafter(drafter_config)
    expected = {name: tuple(tensor.shape) for name, tensor in _public_state(drafter).items()}
    tensors, stored = read_serving_weights(directory, expected, drafter_config.member.weight_aliases)
    drafter.load_state_dict(tensors)
    if (directory / DRAFT_VOCAB_FILE).is_file():
        drafter.set_draft_vocab(_read_draft_vocab(directory / DRAFT_VOCAB_FILE, drafter_config.vocab_size))
    # Ours: what still parses must also be what was exported (a flipped bit in a weight parses).
    # Checked last, so that an edit a reader would trip over is named by what it breaks.
    problems = provenance_problems(directory, provenance) if provenance is not None else []
    if problems:
        raise PipelineError(problems[0])
    stored_dtypes = sorted(set(stored.values()))
    info = {"config": raw, "provenance": provenance,
            "stored_dtype": stored_dtypes[0] if len(stored_dtypes) == 1 else stored_dtypes}
    return drafter.to(device), info
