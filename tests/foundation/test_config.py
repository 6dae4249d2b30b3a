"""Strict params: the committed params.yaml loads; typos, gaps and bad values fail with the key, in
one line naming the params file that was read (whatever its name), every value rule the config
layer knows included: each section's checks, each architecture's option checks, and the checks
against the target's sizes that run when the drafter is built."""


import dataclasses
from pathlib import Path

import pytest
import yaml
from support.helpers import REPO_ROOT

from dflash_pipeline.foundation.config import (
    SECTIONS,
    GenerateConfig,
    Params,
    load_params,
)
from dflash_pipeline.foundation.errors import PipelineError


def test_committed_params_load_and_match_the_dataclass_defaults():
    params = load_params(REPO_ROOT / "params.yaml")
    assert isinstance(params, Params)
    for name, section in SECTIONS.items():  # one source of defaults: the file a user edits
        expected = section()
        if name == "train":  # an architecture's options have their defaults in its own module: compare them resolved
            from dataclasses import replace

            from dflash_pipeline.drafters.build import choose_architecture

            resolved, defaults = choose_architecture(params.train), choose_architecture(expected)
            assert (resolved.options, resolved.loss_options) == (defaults.options, defaults.loss_options)
            assert resolved.member.name == params.train.architecture  # the family's default is params.yaml's choice
            expected = replace(expected, architecture=params.train.architecture, options=params.train.options)
        assert getattr(params, name) == expected, name


def _write(tmp_path, mutate):
    raw = yaml.safe_load((REPO_ROOT / "params.yaml").read_text())
    mutate(raw)
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda p: p["generate"].update(max_new_token=5), "unknown key 'generate.max_new_token'"),
        (lambda p: p["generate"].pop("batch_size"), "missing key 'generate.batch_size'"),
        (lambda p: p["generate"].update(batch_size="8"), "key 'generate.batch_size' has str '8'"),
        (lambda p: p["generate"].update(enable_thinking=1), "key 'generate.enable_thinking' has int 1"),
        (lambda p: p["generate"].update(on_bad_row="ignore"), "key 'generate.on_bad_row' must be 'error' or 'skip'"),
        (lambda p: p["generate"].update(val_fraction=1.5), "key 'generate.val_fraction' must be in [0, 1)"),
        (lambda p: p.update(trainn={}), "unknown section 'trainn'"),
        (lambda p: p.pop("target"), "missing section 'target'"),
    ],
)
def test_bad_params_fail_at_load_naming_the_key(tmp_path, mutate, message):
    path = _write(tmp_path, mutate)
    with pytest.raises(PipelineError) as error:
        load_params(path)
    assert message in str(error.value)
    assert str(path) in str(error.value) and "\n" not in str(error.value)


def test_ints_are_accepted_for_float_keys(tmp_path):
    path = _write(tmp_path, lambda p: p["generate"].update(val_fraction=0))
    assert load_params(path).generate.val_fraction == 0.0


def test_config_objects_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        GenerateConfig().batch_size = 3  # type: ignore[misc]


# ----------------------------------------------------------------------------- every invalid value the config layer knows

# One invalid value per key that a rule checks. The cases below are driven by the rules themselves
# (each section's `checks()`, each architecture's `option_checks`), so a new rule without a value
# here fails (`test_every_rule_has_an_invalid_value_here`) instead of going untested.
INVALID = {
    "generate": {"max_prompts": -1, "val_fraction": 1.0, "on_bad_row": "ignore", "max_new_tokens": 0, "max_prompt_tokens": 0,
                 "batch_size": 0},
    "capture": {"num_layers": 0, "target_top_k": -1, "layer_ids": [], "feature_dtype": "fp16", "max_length": 1, "on_too_long": "drop",
                "batch_tokens": 0, "shard_mb": 0},
    "train": {"num_layers": 0, "block_size": 1, "gamma": 0.0, "init": "zeros", "sliding_window": 0, "lr": 0.0, "warmup_fraction": 1.0,
              "grad_clip": 0.0, "max_steps": 0, "tokens_per_step": 0, "anchors_per_sequence": 0, "logits_chunk": 0, "attention": "flash",
              "train_vocab": "some", "feature_norm": "l2", "distill_weight": 1.5, "options": {"dflash2": 3}, "eval_every": 0,
              "eval_blocks": 0, "save_every": 0},
    "evaluate": {"verify_tokens": 0, "temperatures": [-1.0], "sampling_rule": "greedy", "checkpoints": "best", "anchors_per_sequence": -1,
                 "tokens_per_batch": 0, "tree_budgets": [0], "num_prompts": -1, "max_new_tokens": 0},
    "export": {"dtype": "float16"},
    "target": {"device_map": "balanced", "max_memory": {}, "offload_folder": " "},
    "launch": {"processes": 0, "devices_per_replica": 0},
}
INVALID_OPTIONS = {"dflash": {}, "dflash2": {"conv_kernel_size": 0, "conv_group_size": 0, "selector_rank": 0, "selector_top_k": 1,
                                             "selector_weight": -1.0}}
# Valid alone, invalid for the tiny target's sizes (hidden 64, vocabulary 49,152): checked when the drafter is built.
INVALID_FOR_THE_TARGET = {"dflash2": {"conv_group_size": 48, "selector_top_k": 100000}}
OTHER_NAME = "experiment.yaml"  # not params.yaml: the error must name the file that was read


def _rule_keys(section_class) -> list[str]:
    return [key for key, _, _ in section_class().checks()]


def _option_rule_keys(member) -> list[str]:
    return [key for key, _, _ in member.option_checks(member.options_type(), member.loss_options_type())]


def _section_cases():
    return [(name, key) for name, cls in SECTIONS.items() if hasattr(cls, "checks") for key in _rule_keys(cls)]


def _option_cases():
    from dflash_pipeline.drafters import family

    return [(name, key) for name in family.names() for key in _option_rule_keys(family.architecture(name))]


def _write_other(tmp_path, mutate) -> Path:
    raw = yaml.safe_load((REPO_ROOT / "params.yaml").read_text())
    mutate(raw)
    path = tmp_path / OTHER_NAME
    path.write_text(yaml.safe_dump(raw))
    return path


def _assert_one_line_naming(error, path: Path, dotted: str, value) -> None:
    message = str(error)
    assert "\n" not in message, message
    assert message.startswith(f"{path}: key '{dotted}' "), message
    assert message.endswith(f", got {value!r}") or f"got {value!r}" in message, message
    assert "params.yaml" not in message, message


def test_every_rule_has_an_invalid_value_here():
    for name, key in _section_cases():
        assert key in INVALID.get(name, {}), f"{name}.{key} has a rule but no invalid value in INVALID"
    for name, key in _option_cases():
        assert key in INVALID_OPTIONS.get(name, {}), f"train.options.{name}.{key} has a rule but no invalid value in INVALID_OPTIONS"


@pytest.mark.parametrize("section, key", _section_cases(), ids=lambda value: str(value))
def test_every_invalid_section_value_is_one_line_naming_the_file_and_key(tmp_path, section, key):
    value = INVALID[section][key]
    path = _write_other(tmp_path, lambda raw: raw[section].update({key: value}))
    with pytest.raises(PipelineError) as error:
        load_params(path)
    _assert_one_line_naming(error.value, path, f"{section}.{key}", value)


@pytest.mark.parametrize("architecture, key", _option_cases(), ids=lambda value: str(value))
def test_every_invalid_architecture_option_is_one_line_naming_the_file_and_key(tmp_path, architecture, key):
    from dflash_pipeline.drafters.build import choose_architecture

    value = INVALID_OPTIONS[architecture][key]
    path = _write_other(tmp_path, lambda raw: raw["train"].update(architecture=architecture, options={architecture: {key: value}}))
    params = load_params(path)  # the options are checked where the train stage starts: choose_architecture
    with pytest.raises(PipelineError) as error:
        choose_architecture(params.train, source=str(path))
    _assert_one_line_naming(error.value, path, f"train.options.{architecture}.{key}", value)


@pytest.mark.parametrize("architecture, key", [(name, key) for name, keys in INVALID_FOR_THE_TARGET.items() for key in keys])
def test_an_option_the_targets_sizes_refuse_is_one_line_naming_the_file_and_key(tmp_path, tiny_llama_target, architecture, key):
    # Checked inside the drafter's construction (DrafterConfig.__post_init__ -> Architecture.check),
    # which used to end in a ValueError traceback naming two options at once.
    from dflash_pipeline.drafters.build import drafter_config_for

    value = INVALID_FOR_THE_TARGET[architecture][key]
    path = _write_other(tmp_path, lambda raw: raw["train"].update(architecture=architecture, options={architecture: {key: value}}))
    params = load_params(path)
    with pytest.raises(PipelineError) as error:
        drafter_config_for(tiny_llama_target, params.train, layer_ids=[1, 3], mask_token_id=0, extra={}, source=str(path))
    _assert_one_line_naming(error.value, path, f"train.options.{architecture}.{key}", value)
    other = {"conv_group_size": "selector", "selector_top_k": "conv_"}[key]
    assert other not in str(error.value), "one key at a time"


def test_a_layer_choice_the_target_refuses_names_the_params_file(tmp_path):
    from dflash_pipeline.capture.plan import resolve_layer_ids

    path = _write_other(tmp_path, lambda raw: raw["capture"].update(layer_ids=[1, 9]))
    with pytest.raises(PipelineError) as error:
        resolve_layer_ids(load_params(path).capture, 4, source=str(path))
    _assert_one_line_naming(error.value, path, "capture.layer_ids", 9)


# ----------------------------------------------------------------------------- the target's context


@pytest.mark.parametrize("section, key, value, within", [
    ("generate", "max_prompt_tokens", 8000, 7936),  # + generate.max_new_tokens 256 > 8192
    ("capture", "max_length", 8193, 8192),
    ("evaluate", "max_new_tokens", 8192, 8191),
], ids=lambda value: str(value))
def test_settings_past_the_targets_context_are_one_line_naming_the_file_key_and_limit(section, key, value, within):
    # generate.max_prompt_tokens: 20000 was accepted for a target whose max_position_embeddings is 8192.
    config = dataclasses.replace(SECTIONS[section](), **{key: value})
    with pytest.raises(PipelineError) as error:
        config.validate_context(8192, OTHER_NAME)
    message = str(error.value)
    assert message.startswith(f"{OTHER_NAME}: key '{section}.{key}' ") and message.endswith(f", got {value!r}"), message
    assert "8192 tokens (its max_position_embeddings, in target.json)" in message and "\n" not in message
    dataclasses.replace(SECTIONS[section](), **{key: within}).validate_context(8192, OTHER_NAME)
    config.validate_context(None, OTHER_NAME)  # a target.json that records no context: nothing to check against


def test_the_shipped_params_fit_the_embedded_targets_context():
    from dflash_pipeline.foundation.config import load_params

    params = load_params(REPO_ROOT / "params.yaml")
    for section in (params.generate, params.capture, params.evaluate):
        section.validate_context(8192, "params.yaml")  # SmolLM2-135M-Instruct's max_position_embeddings
