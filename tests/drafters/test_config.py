"""drafters/config.py: a config round-trips with the member's options nested under its name, a
DFlash one records what it did before the family existed, records of the old flat layout read
back the same, a shared field and an option of the same name stay apart, and bad sizes or keys are
refused naming them."""

from dataclasses import asdict, dataclass, fields

import pytest

from dflash_pipeline.drafters import family
from dflash_pipeline.drafters.architecture import Architecture
from dflash_pipeline.drafters.config import DrafterConfig, DrafterOptions, nested_record
from dflash_pipeline.drafters.dflash2 import DFlash2Options

DFLASH2 = dict(conv_kernel_size=3, conv_group_size=8, selector_rank=6, selector_top_k=5)


SIZES = dict(hidden_size=32, intermediate_size=64, num_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
             vocab_size=40, block_size=4, target_layer_ids=(0, 2), num_target_layers=3, mask_token_id=39)


def config(**overrides) -> DrafterConfig:
    return DrafterConfig(**{**SIZES, **overrides})


def old_flat_record(config: DrafterConfig) -> dict:
    """The layout checkpoint.json and the export's provenance held before the options were nested:
    the member's options beside the shared fields."""
    data = {f.name: getattr(config, f.name) for f in fields(config) if f.name not in ("architecture", "options")}
    data["target_layer_ids"] = list(config.target_layer_ids)
    return {**data, "architecture": config.architecture, **{f.name: getattr(config.options, f.name) for f in fields(config.options)}}


def test_a_dflash_config_records_no_architecture_and_round_trips():
    plain = config()
    data = plain.to_dict()
    assert data["target_layer_ids"] == [0, 2] and plain.feature_width == 64
    assert not {"architecture", "dflash", "options", "selector_rank"} & set(data)
    assert DrafterConfig.from_dict(data) == plain


def test_a_members_options_are_typed_and_nested_under_its_name():
    dflash2 = config(architecture="dflash2", options=dict(conv_group_size=8, selector_top_k=5))
    assert dflash2.options == DFlash2Options(conv_group_size=8, selector_top_k=5)  # the rest its defaults
    assert isinstance(dflash2.options, DrafterOptions)
    data = dflash2.to_dict()
    assert data["architecture"] == "dflash2" and data["dflash2"] == {**asdict(DFlash2Options()), "conv_group_size": 8, "selector_top_k": 5}
    assert not {"conv_group_size", "selector_top_k", "options"} & set(data)
    assert DrafterConfig.from_dict(data) == dflash2
    assert DrafterConfig.from_dict(data).options == dflash2.options


@pytest.mark.parametrize("architecture, options", [("dflash", None), ("dflash2", DFLASH2)])
def test_a_record_of_the_old_flat_layout_reads_back_the_same_config(architecture, options):
    ours = config(architecture=architecture, options=options, extra={"mask_token": "row 39"})
    old = old_flat_record(ours)
    if architecture == "dflash":
        old.pop("architecture")  # plain DFlash wrote no name
        assert old == ours.to_dict()  # and its record did not change
    assert DrafterConfig.from_dict(old) == ours
    assert nested_record(old) == ours.to_dict()


def test_a_shared_field_named_like_an_option_is_not_read_as_the_option():
    """A later version adds a shared field `selector_rank`: a record it writes keeps the field and
    DFlash2's option apart, and an old flat record's `selector_rank` is still the option."""

    @dataclass(frozen=True)
    class LaterConfig(DrafterConfig):
        selector_rank: int = 0

    later = LaterConfig(**SIZES, selector_rank=3, architecture="dflash2", options=DFLASH2)
    data = later.to_dict()
    assert data["selector_rank"] == 3 and data["dflash2"]["selector_rank"] == 6
    back = LaterConfig.from_dict(data)
    assert back == later and (back.selector_rank, back.options.selector_rank) == (3, 6)
    old = old_flat_record(config(architecture="dflash2", options=DFLASH2))
    read = LaterConfig.from_dict(old)
    assert (read.selector_rank, read.options.selector_rank) == (0, 6)


@dataclass(frozen=True)
class ClashingOptions(DrafterOptions):
    block_size: int = 2  # named like a shared field


class Clashing(Architecture):
    name = "clashing-test"
    public_class = "ClashingTestDraftModel"
    options_type = ClashingOptions


def test_an_option_named_like_a_shared_field_keeps_both():
    with family.registered(Clashing()):
        clashing = config(architecture="clashing-test", options={"block_size": 7})
        data = clashing.to_dict()
        assert (data["block_size"], data["clashing-test"]) == (4, {"block_size": 7})
        assert DrafterConfig.from_dict(data) == clashing


def test_a_member_declares_frozen_drafter_options_and_a_name_that_is_no_field():
    @dataclass(frozen=True)
    class Loose:
        width: int = 1

    with pytest.raises(TypeError, match="options_type must be a frozen dataclass subclassing DrafterOptions"):
        type("LooseMember", (Architecture,), {"name": "loose-test", "options_type": Loose})
    with pytest.raises(TypeError, match="name 'extra' is a DrafterConfig field"):
        type("ExtraMember", (Architecture,), {"name": "extra"})


@pytest.mark.parametrize("overrides, message", [
    ({"architecture": "medusa"}, "architecture must be one of"),
    ({"architecture": "dflash2", "options": {"conv_group_size": 5}}, "conv_group_size 5 must divide hidden_size 32"),
    ({"architecture": "dflash2", "options": {"selector_top_k": 41}}, r"selector_top_k 41 must be in 1..vocab_size \(40\)"),
    ({"architecture": "dflash2", "options": {"rank": 4}}, "dflash2 has no option 'rank'"),
    ({"architecture": "dflash", "options": DFlash2Options()}, "dflash takes NoOptions, got DFlash2Options"),
])
def test_bad_sizes_and_options_are_refused_naming_them(overrides, message):
    with pytest.raises(ValueError, match=message):
        config(**overrides)


@pytest.mark.parametrize("edit, message", [
    (lambda data: data.update(architecture="medusa"), "architecture must be one of"),
    (lambda data: data.update(hidden_sizes=32), "no drafter config key 'hidden_sizes'"),
    (lambda data: data["dflash2"].update(rank=4), "dflash2 has no option 'rank'"),
])
def test_a_record_with_an_unknown_key_is_refused_naming_it(edit, message):
    data = config(architecture="dflash2", options=DFLASH2).to_dict()
    edit(data)
    with pytest.raises(ValueError, match=message):
        DrafterConfig.from_dict(data)
