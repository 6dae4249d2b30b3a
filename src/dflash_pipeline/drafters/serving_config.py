"""The serving format's config.json (serving.py describes the format): our DrafterConfig written
into it for export, and any config.json, ours or published, mapped back onto a DrafterConfig;
what our drafter cannot represent exactly is refused with one line naming the file and key.
"""

from pathlib import Path

import torch

from dflash_pipeline.drafters import family
from dflash_pipeline.drafters.config import DrafterConfig
from dflash_pipeline.foundation.errors import PipelineError
from dflash_pipeline.target.load import build_target_layer_ids

# A config.json without `architectures` is read as the plain member's (the format's first drafters).
UNNAMED_CLASS = family.architecture(family.UNNAMED).public_class
MODEL_TYPE = "qwen3"  # what z-lab's released drafters declare: the layers are Qwen3 layers
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def serving_config(config: DrafterConfig, *, dtype: torch.dtype = torch.float32) -> dict:
    """config.json for `config`: every field z-lab's code, SGLang and vLLM read, in both spellings
    where transformers 4.x and 5.x differ (rope_theta / rope_parameters, torch_dtype / dtype)."""
    if config.sliding_window is not None:
        # The format's "sliding_attention" layers are causal inside the block in SGLang and vLLM,
        # and windowed relative to each query; ours see a fixed window before the anchor and the
        # whole block. No published spelling means what we trained, so refuse rather than mislead.
        raise PipelineError(
            f"drafter has sliding_window={config.sliding_window}: the serving format has no equivalent of our "
            "anchor-relative, block-bidirectional window; export a drafter trained with train.sliding_window: null")
    if config.hidden_act != "silu":
        raise PipelineError(f"drafter has hidden_act={config.hidden_act!r}; the serving engines implement silu only")
    dtype_name = DTYPE_NAMES[dtype]
    dflash_config = {"mask_token_id": config.mask_token_id, "target_layer_ids": list(config.target_layer_ids),
                     "block_size": config.block_size}
    dflash_config.update(config.member.serving_fields(config))
    return {
        "architectures": [config.member.public_class],
        "model_type": MODEL_TYPE,
        "block_size": config.block_size,
        "num_target_layers": config.num_target_layers,
        # SGLang reads block_size from here first, z-lab and MLX from the top level: same value.
        "dflash_config": dflash_config,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "vocab_size": config.vocab_size,
        "hidden_act": config.hidden_act,
        "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": config.max_position_embeddings,
        # transformers 4.x (z-lab's pin) and MLX read rope_theta; 5.x and vLLM read rope_parameters.
        "rope_theta": config.rope_theta,
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        # Explicit, so that no reader derives sliding layers from its own defaults (max_window_layers).
        "layer_types": ["full_attention"] * config.num_layers,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": config.num_layers,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "use_cache": True,
        "dtype": dtype_name,
        "torch_dtype": dtype_name,
    }


def _field(config: dict, key: str, where: Path):
    if config.get(key) is None:
        raise PipelineError(f"{where}: no {key}")
    return config[key]


def _rope_theta(config: dict, where: Path) -> float:
    """The RoPE base, from rope_parameters (transformers 5) or rope_theta / rope_scaling (4.x).

    Only plain RoPE is accepted: scaled or partial rotary RoPE would need code we do not have, and a
    missing theta is refused because the readers disagree on its default (HF 1e4, vLLM 1e6).
    """
    parameters = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or {}
    for key, spec in (("rope_parameters", parameters), ("rope_scaling", scaling)):
        kind = spec.get("rope_type", spec.get("type", "default"))
        if kind != "default":
            raise PipelineError(f"{where}: {key}.rope_type is {kind!r}; only plain RoPE (default) is supported")
        if spec.get("partial_rotary_factor", 1.0) != 1.0:
            raise PipelineError(f"{where}: {key}.partial_rotary_factor is {spec['partial_rotary_factor']}; only full RoPE is supported")
    theta = parameters.get("rope_theta", config.get("rope_theta"))
    if theta is None:
        raise PipelineError(f"{where}: no rope_theta (nor rope_parameters.rope_theta)")
    return float(theta)


def _layer_types(config: dict, num_layers: int) -> list[str]:
    """Per-layer attention kinds as Qwen3Config derives them when layer_types is absent."""
    if config.get("layer_types") is not None:
        return list(config["layer_types"])
    window = config.get("sliding_window") if config.get("use_sliding_window") else None
    first_sliding = config.get("max_window_layers", num_layers)
    return ["sliding_attention" if window is not None and i >= first_sliding else "full_attention" for i in range(num_layers)]


def drafter_config_from_serving(config: dict, *, where: Path) -> DrafterConfig:
    """Map a serving config.json (already parsed) onto our DrafterConfig; `where` names it in errors."""
    dflash = config.get("dflash_config") or {}
    known = [family.by_public_class(name) for name in (config.get("architectures") or [UNNAMED_CLASS])]
    known = [member for member in known if member is not None]
    if not known:
        raise PipelineError(f"{where}: architectures is {config['architectures']}, not one of {sorted(family.public_classes())}")
    member = known[0]
    options = member.options_from_serving(dflash, config, where=where)
    # z-lab's drafting reads these too; ours implements their neutral values only (plain embeddings, plain logits).
    for key, neutral in (("input_embedding_scale", 1.0), ("output_multiplier", 1.0), ("final_logit_softcapping", 0.0)):
        value = dflash.get(key, config.get(key))
        if value is not None and float(value) != neutral:
            raise PipelineError(f"{where}: {key} is {value!r}; DFlashDrafter implements only {neutral} (or none)")
    num_layers = int(_field(config, "num_hidden_layers", where))
    hidden_size = int(_field(config, "hidden_size", where))
    heads = int(_field(config, "num_attention_heads", where))

    block_size = config.get("block_size", dflash.get("block_size"))
    if block_size is None:
        raise PipelineError(f"{where}: no block_size")
    if dflash.get("block_size", block_size) != block_size:
        raise PipelineError(f"{where}: dflash_config.block_size {dflash['block_size']} differs from block_size {block_size}")
    num_target_layers = dflash.get("num_target_layers", config.get("num_target_layers"))
    if num_target_layers is None:
        raise PipelineError(f"{where}: no num_target_layers")
    mask_token_id = dflash.get("mask_token_id", config.get("mask_token_id"))
    if mask_token_id is None:
        raise PipelineError(f"{where}: no dflash_config.mask_token_id (a mask token given only by name needs the tokenizer)")

    layer_ids = dflash.get("target_layer_ids")
    if layer_ids is None:
        # z-lab's default: as many taps as drafter layers, spread over the target.
        layer_ids = build_target_layer_ids(int(num_target_layers), num_layers)
    if not layer_ids or any(not 0 <= int(i) < int(num_target_layers) for i in layer_ids):
        raise PipelineError(f"{where}: dflash_config.target_layer_ids {layer_ids} is empty or outside 0..{int(num_target_layers) - 1}")

    layer_types = _layer_types(config, num_layers)
    if len(layer_types) != num_layers:
        raise PipelineError(f"{where}: layer_types has {len(layer_types)} entries for {num_layers} layers")
    unsupported = sorted(set(layer_types) - {"full_attention"})
    if unsupported:
        # SGLang and vLLM run "sliding_attention" draft layers causally inside the block, with a
        # query-relative window; our drafter attends bidirectionally, so it would compute another model.
        raise PipelineError(f"{where}: layer_types has {unsupported[0]!r} layers, which DFlashDrafter does not implement")
    if config.get("attention_bias"):
        raise PipelineError(f"{where}: attention_bias is true; DFlashDrafter has no attention biases")
    hidden_act = config.get("hidden_act", "silu")
    if hidden_act != "silu":
        raise PipelineError(f"{where}: hidden_act is {hidden_act!r}; DFlashDrafter implements silu only")

    try:
        return DrafterConfig(
            hidden_size=hidden_size,
            intermediate_size=int(_field(config, "intermediate_size", where)),
            num_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden_size // heads),
            vocab_size=int(_field(config, "vocab_size", where)),
            block_size=int(block_size),
            target_layer_ids=tuple(int(i) for i in layer_ids),
            num_target_layers=int(num_target_layers),
            mask_token_id=int(mask_token_id),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),  # Qwen3Config's default
            rope_theta=_rope_theta(config, where),
            max_position_embeddings=int(config.get("max_position_embeddings", 32768)),
            sliding_window=None,
            hidden_act=hidden_act,
            architecture=member.name,
            options=options,
        )
    except ValueError as exc:  # sizes DrafterConfig refuses, e.g. a conv_group_size that does not divide hidden_size
        raise PipelineError(f"{where}: {exc}") from None
