"""Strict params: the committed params.yaml loads; typos, gaps and bad values fail with the key."""


import dataclasses

import pytest
import yaml

from conftest import REPO_ROOT
from dflash_pipeline.config import SECTIONS, GenerateConfig, Params, load_params
from dflash_pipeline.errors import PipelineError


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
