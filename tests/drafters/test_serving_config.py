"""drafters/serving_config.py: config.json maps onto DrafterConfig and back, published
spellings read alike (rope_theta / rope_parameters, the z-lab default taps), and what our drafter
cannot compute is refused with one line naming the key."""

from pathlib import Path

import pytest

from dflash_pipeline.drafters.config import DrafterConfig
from dflash_pipeline.drafters.serving_config import drafter_config_from_serving, serving_config
from dflash_pipeline.foundation.errors import PipelineError

WHERE = Path("drafter/config.json")


def config(**overrides) -> DrafterConfig:
    values = dict(hidden_size=32, intermediate_size=64, num_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  vocab_size=40, block_size=4, target_layer_ids=(1, 3), num_target_layers=6, mask_token_id=39, rope_theta=1e6)
    values.update(overrides)
    return DrafterConfig.from_dict(values)  # keys that are not shared fields are the architecture's options


@pytest.mark.parametrize("architecture", ["dflash", "dflash2"])
def test_config_json_maps_back_onto_the_same_drafter_config(architecture):
    ours = config(architecture=architecture, **({"conv_group_size": 8} if architecture == "dflash2" else {}))
    written = serving_config(ours)
    assert written["architectures"] == [{"dflash": "DFlashDraftModel", "dflash2": "DFlash2DraftModel"}[architecture]]
    assert written["dflash_config"]["target_layer_ids"] == [1, 3] and written["rope_parameters"]["rope_theta"] == written["rope_theta"]
    assert drafter_config_from_serving(written, where=WHERE) == ours


def test_a_published_config_without_taps_or_rope_parameters_reads_as_z_lab_reads_it():
    written = serving_config(config())
    del written["rope_parameters"], written["dflash_config"]["target_layer_ids"], written["layer_types"]
    read = drafter_config_from_serving(written, where=WHERE)
    assert read.rope_theta == 1e6 and read.target_layer_ids == (1, 3)  # z-lab's default taps for 2 layers of a 6-layer target


@pytest.mark.parametrize("edit, message", [
    (lambda c: c.pop("block_size") and c["dflash_config"].pop("block_size"), "no block_size"),
    (lambda c: c.update(architectures=["LlamaForCausalLM"]), "architectures is ['LlamaForCausalLM'], not one of"),
    (lambda c: c.update(rope_parameters={"rope_type": "yarn", "rope_theta": 1e6}), "rope_parameters.rope_type is 'yarn'"),
    (lambda c: c.update(attention_bias=True), "attention_bias is true"),
    (lambda c: c.update(layer_types=["full_attention", "sliding_attention"]), "layer_types has 'sliding_attention' layers"),
    (lambda c: c["dflash_config"].update(target_layer_ids=[1, 9]), "target_layer_ids [1, 9] is empty or outside 0..5"),
])
def test_what_the_drafter_cannot_compute_is_one_line_naming_the_key(edit, message):
    written = serving_config(config())
    edit(written)
    with pytest.raises(PipelineError) as caught:
        drafter_config_from_serving(written, where=WHERE)
    assert str(caught.value).startswith(f"{WHERE}: ") and message in str(caught.value)
