"""A Hugging Face model folder read as files, without loading the model: config.json's two
spellings, tokenizer_config.json's, and the safetensors weights.

transformers 4.x and 5.x spell some config fields that change the forward differently: the RoPE
base and scaling (top-level rope_theta / rope_scaling in 4.x, rope_parameters in 5.x) and the
dtype (torch_dtype / dtype). A reader that finds only the other spelling falls back to a default
without a word, and so loads another model. `forward_fields` reads a config as each version does;
`spelling_conflict` says where two spellings that are both present disagree (refused in any folder:
readers that prefer one or the other load different models), `fallback_difference` where 4.x,
finding only 5.x's spelling, would fall back to another value (a folder transformers 5.x saved:
accepted, since the pipeline runs on 5.x, but never in the embedded conversion, which promises both);
`with_both_spellings` writes both.

tokenizer_config.json differs too: 5.x names its generic tokenizer class, the one that builds the
tokenizer from tokenizer.json as it is, "TokenizersBackend", which 4.x's AutoTokenizer does not
know (it raises), and lists further special tokens under `extra_special_tokens`, a key 4.x reads
as a dict and fails on. `tokenizer_config_for_both` writes the names both read alike,
`tokenizer_config_conflict` says where a tokenizer_config.json still has a 5.x-only name.

`weight_files` is the one place that knows how a folder lays out its safetensors weights (one
file, or shards named by model.safetensors.index.json); `read_tensors` reads a few tensors alone.
"""

from pathlib import Path

from dflash_pipeline.foundation.errors import PipelineError
from dflash_pipeline.foundation.files import read_json
from dflash_pipeline.foundation.tensor_files import load_safetensors, safetensors_header

# The RoPE base transformers 4.x and 5.x assume when a config names none (a few model classes set their own).
DEFAULT_ROPE_THETA = 10_000.0
# Keys of a RoPE spec that are not the scaling method: the base and the rotary fraction have their
# own top-level spellings in 4.x, and "type" is the older spelling of "rope_type".
_ROPE_SPEC_EXTRAS = {"rope_theta", "partial_rotary_factor", "type", "rope_type"}
# Each field whose 4.x and 5.x spellings differ: (4.x spelling, 5.x spelling), as messages name them.
_SPELLINGS = {
    "rope_theta": ("rope_theta", "rope_parameters.rope_theta"),
    "rope_scaling": ("rope_scaling", "rope_parameters"),
    "partial_rotary_factor": ("partial_rotary_factor", "rope_parameters.partial_rotary_factor"),
    "dtype": ("torch_dtype", "dtype"),
}

# tokenizer_config.json: 5.x-only spellings and the name both 4.x and 5.x read alike. 4.x calls the
# generic class PreTrainedTokenizerFast; 5.x keeps that name as an alias of TokenizersBackend, so the
# same class loads the same tokenizer.json in both. `additional_special_tokens` is the list both read
# (5.x as its extra_special_tokens). Checked with 4.57.1 and 5.24.0: same ids, special tokens and
# their ids, added tokens, length and chat template.
_TOKENIZER_CLASS_RENAMES = {"TokenizersBackend": "PreTrainedTokenizerFast"}
TOKENIZER_CLASSES_BOTH = ("PreTrainedTokenizerFast",)
# What 5.x stores about where the tokenizer was loaded from, not what it is.
_TOKENIZER_LOAD_STATE = ("is_local", "local_files_only")


def _given(config: dict, key: str):
    """`config[key]`, with an explicit null read as absent (the readers then use their defaults)."""
    return config.get(key) if isinstance(config, dict) else None


def _rope_method(spec: dict | None) -> dict:
    """The scaling method of a RoPE spec (rope_scaling or rope_parameters), in one canonical form."""
    spec = spec if isinstance(spec, dict) else {}
    method = {key: value for key, value in spec.items() if key not in _ROPE_SPEC_EXTRAS}
    return {"rope_type": spec.get("rope_type", spec.get("type", "default")), **dict(sorted(method.items()))}


def _is_per_layer_type(rope_parameters) -> bool:
    # 5.x nests one spec per layer type (Gemma-style); 4.x spells those with model-specific keys.
    return isinstance(rope_parameters, dict) and any(isinstance(value, dict) for value in rope_parameters.values())


def _dtype_name(dtype) -> str | None:
    return None if dtype is None else str(dtype).replace("torch.", "")


def forward_fields(config: dict, *, reader: str) -> dict:
    """The config values that change a forward pass, as transformers `reader` ("4.x" or "5.x") reads them.

    4.x reads the RoPE base and rotary fraction from the top level only (default 10000.0 and 1.0)
    and the method from rope_scaling; it never looks at rope_parameters. 5.x (as of 5.24) lets a
    non-null rope_scaling replace rope_parameters, then takes the base and fraction from that spec
    and only then from the top level. For the dtype, 4.x releases before the rename to dtype (4.56)
    read torch_dtype only, while 4.56+ prefer dtype like 5.x; torch_dtype stands first here. Per-layer-type RoPE
    (nested rope_parameters) has model-specific 4.x keys and is not modelled: its RoPE fields read
    None under both readers.
    """
    if reader == "4.x":
        spec = _given(config, "rope_scaling")
        theta = _given(config, "rope_theta")
        fraction = _given(config, "partial_rotary_factor")
        dtype = _given(config, "torch_dtype") or _given(config, "dtype")
    elif reader == "5.x":
        spec = _given(config, "rope_scaling") or _given(config, "rope_parameters") or {}
        theta = spec.get("rope_theta") if isinstance(spec, dict) else None
        theta = theta if theta is not None else _given(config, "rope_theta")
        fraction = spec.get("partial_rotary_factor") if isinstance(spec, dict) else None
        fraction = fraction if fraction is not None else _given(config, "partial_rotary_factor")
        dtype = _given(config, "dtype") or _given(config, "torch_dtype")
    else:
        raise ValueError(f"reader must be '4.x' or '5.x', not {reader!r}")
    fields = {
        "rope_theta": float(theta if theta is not None else DEFAULT_ROPE_THETA),
        "rope_scaling": _rope_method(spec),
        "partial_rotary_factor": float(fraction if fraction is not None else 1.0),
        "rms_norm_eps": _given(config, "rms_norm_eps"),
        "tie_word_embeddings": _given(config, "tie_word_embeddings"),
        "vocab_size": _given(config, "vocab_size"),
        "dtype": _dtype_name(dtype),
    }
    if _is_per_layer_type(_given(config, "rope_parameters")):
        fields.update(rope_theta=None, rope_scaling=None, partial_rotary_factor=None)
    return fields


def _scopes(config: dict) -> list[tuple[str, dict]]:
    scopes = [("", config)]
    if isinstance(config.get("text_config"), dict):
        scopes.append(("text_config.", config["text_config"]))
    return scopes


def spelling_conflict(config: dict) -> str | None:
    """Where two spellings of one field are both present and disagree, or None.

    They must agree even where 4.57 and 5.24 happen to read the same one (5.24 prefers a non-null
    rope_scaling over rope_parameters): readers that take rope_parameters first, as 5.x documents,
    would compute another forward. A spelling that is absent is `fallback_difference`'s matter.
    """
    for prefix, scope in _scopes(config):
        parameters = _given(scope, "rope_parameters")
        nested = _is_per_layer_type(parameters)
        parameters = parameters if isinstance(parameters, dict) and not nested else {}
        pairs = [
            ("dtype", _dtype_name(_given(scope, "torch_dtype")), _dtype_name(_given(scope, "dtype"))),
            ("rope_theta", _given(scope, "rope_theta"), parameters.get("rope_theta")),
            ("partial_rotary_factor", _given(scope, "partial_rotary_factor"), parameters.get("partial_rotary_factor")),
            # A null rope_scaling is 4.x's plain RoPE, so it is compared as soon as the key is there.
            ("rope_scaling", _rope_method(scope["rope_scaling"]) if "rope_scaling" in scope else None,
             _rope_method(parameters) if parameters else None),
        ]
        for field, old, new in pairs:
            if old is not None and new is not None and old != new:
                old_name, new_name = _SPELLINGS[field]
                return (f"{prefix}{old_name} ({old!r}) and {prefix}{new_name} ({new!r}) disagree; "
                        "transformers 4.x and 5.x would load different models, so give both the same value")
    return None


def fallback_difference(config: dict) -> str | None:
    """Where transformers 4.x, missing a spelling, would fall back to another value than 5.x reads, or None.

    E.g. a non-default rope_parameters.rope_theta with no top-level rope_theta, which 4.x reads as
    10000.0: what transformers 5.x saves for a model of its own. The pipeline reads it as 5.x does.
    """
    for prefix, scope in _scopes(config):
        old_reading, new_reading = forward_fields(scope, reader="4.x"), forward_fields(scope, reader="5.x")
        for field, (old_name, new_name) in _SPELLINGS.items():
            if old_reading[field] != new_reading[field]:
                absent = "" if old_name in scope else ", absent"
                return (f"transformers 4.x reads {prefix}{field} as {old_reading[field]!r} (from {prefix}{old_name}{absent}) "
                        f"but 5.x as {new_reading[field]!r} (from {prefix}{new_name}); write both spellings with the same value")
    return None


def both_versions_problem(config: dict) -> str | None:
    """Why transformers 4.x and 5.x would load `config` as different models, or None if they agree
    (what the embedded conversion promises)."""
    return spelling_conflict(config) or fallback_difference(config)


def check_config_spellings(model_dir: Path) -> None:
    """Refuse a model folder whose config.json has two spellings of one field that disagree.

    A folder with 5.x's spelling alone (what transformers 5.x saves) is accepted: the pipeline runs
    on 5.x and reads it as 5.x does (target.json records the RoPE it read), though 4.x would not.
    """
    config_path = model_dir / "config.json"
    config = read_json(config_path, missing="not found")
    if not isinstance(config, dict):
        raise PipelineError(f"{config_path}: not a JSON object")
    conflict = spelling_conflict(config)
    if conflict:
        raise PipelineError(f"{config_path}: {conflict}")


def with_both_spellings(config: dict, *, where: Path, keep_per_layer_type: bool = False) -> dict:
    """`config` as transformers 5 writes it, plus the 4.x spelling of every field 4.x names differently.

    The values 5.x reads stay the same: a null rope_scaling leaves rope_parameters in charge, and a
    non-null one (a scaled RoPE) carries the same method while the top-level rope_theta supplies the
    base 5.x then looks for. torch_dtype is ignored by 5.x when dtype is set. A per-layer-type
    rope_parameters (Gemma-style) has no generic 4.x spelling: refused, or with `keep_per_layer_type`
    left as 5.x wrote it.
    """
    spelled = dict(config)
    parameters = _given(config, "rope_parameters")
    if parameters and _is_per_layer_type(parameters) and keep_per_layer_type:
        parameters = None
    if parameters:
        if _is_per_layer_type(parameters):
            raise PipelineError(f"{where}: rope_parameters is per layer type; transformers 4.x has no generic spelling for it")
        spelled["rope_theta"] = parameters.get("rope_theta", DEFAULT_ROPE_THETA)
        method = _rope_method(parameters)
        spelled["rope_scaling"] = None if method == {"rope_type": "default"} else method
        if parameters.get("partial_rotary_factor") is not None:
            spelled["partial_rotary_factor"] = parameters["partial_rotary_factor"]
    if _given(config, "dtype") is not None:
        spelled["torch_dtype"] = config["dtype"]
    if isinstance(config.get("text_config"), dict):
        spelled["text_config"] = with_both_spellings(config["text_config"], where=where, keep_per_layer_type=keep_per_layer_type)
    return spelled


def weight_files(model_dir: Path) -> dict[str, Path]:
    """tensor name -> safetensors file, from the shard index, else from every file's header.

    The one place that knows how a Hugging Face folder lays out its safetensors weights; a missing
    index shard or a folder without weights is one line naming it.
    """
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index, missing="unreadable").get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise PipelineError(f"{index}: no weight_map")
        return {name: model_dir / file for name, file in weight_map.items()}
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise PipelineError(f"{model_dir}: no safetensors weights")
    names = {}
    for file in files:
        names.update({name: file for name in safetensors_header(file)})
    return names


def read_tensors(model_dir: Path, suffixes: list[str]) -> dict:
    """Only the named tensors (matched by name suffix), read from a model folder's weight files."""
    names = weight_files(model_dir)
    found = {}
    for suffix in suffixes:
        matches = sorted(n for n in names if n == suffix or n.endswith("." + suffix))
        if matches:
            if not names[matches[0]].is_file():
                raise PipelineError(f"{model_dir}/model.safetensors.index.json: names {names[matches[0]].name}, which does not exist")
            found[suffix] = load_safetensors(names[matches[0]], [matches[0]])[matches[0]]
    return found


def tokenizer_config_conflict(config: dict) -> str | None:
    """Why transformers 4.x would not load the tokenizer that 5.x loads from `config`
    (tokenizer_config.json's content), or None if both load the same."""
    cls = config.get("tokenizer_class")
    if cls not in TOKENIZER_CLASSES_BOTH:
        return (f"tokenizer_class {cls!r} is not one that transformers 4.x and 5.x both load from tokenizer.json "
                f"as it is ({', '.join(TOKENIZER_CLASSES_BOTH)})")
    if isinstance(config.get("extra_special_tokens"), list):
        return ("extra_special_tokens is a list (5.x's spelling); transformers 4.x fails on it, "
                "both read additional_special_tokens")
    return None


def tokenizer_config_for_both(config: dict, *, where: Path) -> dict:
    """tokenizer_config.json as transformers 5 writes it, respelled so that 4.x loads the same tokenizer.

    Keys come out sorted, so the file it makes is byte-stable. A tokenizer class other than 5.x's
    generic one is refused rather than guessed at: a model-specific class may rebuild parts of the
    tokenizer in its own way in each version.
    """
    spelled = {key: value for key, value in config.items() if key not in _TOKENIZER_LOAD_STATE}
    cls = spelled.get("tokenizer_class")
    spelled["tokenizer_class"] = _TOKENIZER_CLASS_RENAMES.get(cls, cls)
    if isinstance(spelled.get("extra_special_tokens"), list):  # a dict (named tokens) is 4.x's spelling too
        extra = spelled.pop("extra_special_tokens")
        if spelled.get("additional_special_tokens") not in (None, extra):
            raise PipelineError(f"{where}: extra_special_tokens and additional_special_tokens disagree")
        if extra:
            spelled["additional_special_tokens"] = extra
    conflict = tokenizer_config_conflict(spelled)
    if conflict:
        raise PipelineError(f"{where}: {conflict}")
    return dict(sorted(spelled.items()))
