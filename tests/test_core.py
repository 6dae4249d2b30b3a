"""drafters/core.py: its config round-trips and refuses bad DFlash2 sizes, RoPE is a rotation, a
draft vocabulary maps columns to token ids and back, and the feature scale folds into fc."""

import pytest
import torch

from dflash_pipeline.drafters.core import DFlashDrafter, DrafterConfig, apply_rope, rope_cos_sin


def config(**overrides) -> DrafterConfig:
    values = dict(hidden_size=32, intermediate_size=64, num_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  vocab_size=40, block_size=4, target_layer_ids=(0, 2), num_target_layers=3, mask_token_id=39)
    values.update(overrides)
    return DrafterConfig.from_dict(values)  # keys that are not shared fields are the architecture's options


def test_a_config_round_trips_and_a_dflash_one_records_no_dflash2_sizes():
    plain = config()
    data = plain.to_dict()
    assert data["target_layer_ids"] == [0, 2] and "selector_rank" not in data and plain.feature_width == 64
    assert DrafterConfig.from_dict(data) == plain
    second = config(architecture="dflash2", conv_group_size=8, selector_top_k=5)
    assert DrafterConfig.from_dict(second.to_dict()) == second and second.to_dict()["selector_top_k"] == 5


@pytest.mark.parametrize("overrides, message", [
    ({"architecture": "medusa"}, "architecture must be one of"),
    ({"architecture": "dflash2", "conv_group_size": 5}, "conv_group_size 5 must divide hidden_size 32"),
    ({"architecture": "dflash2", "selector_top_k": 41}, r"selector_top_k 41 must be in 1..vocab_size \(40\)"),
])
def test_bad_sizes_are_refused_naming_them(overrides, message):
    with pytest.raises(ValueError, match=message):
        config(**overrides)


def test_rope_is_a_rotation_and_the_identity_at_position_zero():
    torch.manual_seed(0)
    x = torch.randn(5, 2, 8)  # [T, heads, head_dim]
    cos, sin = rope_cos_sin(torch.arange(5), 8, 10000.0, torch.float32)
    rotated = apply_rope(x, cos, sin)
    torch.testing.assert_close(rotated.norm(dim=-1), x.norm(dim=-1))
    torch.testing.assert_close(rotated[0], x[0])
    # relative: the dot product of a query at p and a key at q depends on p - q only
    q, k = torch.randn(8), torch.randn(8)
    cos, sin = rope_cos_sin(torch.arange(10), 8, 10000.0, torch.float32)
    at = lambda v, p: apply_rope(v[None, None], cos[p:p + 1], sin[p:p + 1])[0, 0]  # noqa: E731
    assert float(at(q, 5) @ at(k, 3)) == pytest.approx(float(at(q, 7) @ at(k, 5)), rel=1e-5)


def test_a_draft_vocabulary_maps_columns_to_token_ids_and_back():
    drafter = DFlashDrafter(config())
    columns = torch.tensor([0, 1, 2])
    assert not drafter.has_draft_vocab and torch.equal(drafter.vocab_tokens(columns), columns)
    drafter.set_draft_vocab(torch.tensor([30, 4, 17, 4]))
    assert drafter.draft_vocab.tolist() == [4, 17, 30]
    assert drafter.vocab_tokens(columns).tolist() == [4, 17, 30]
    assert drafter.vocab_index(torch.tensor([17, 5, 30])).tolist() == [1, -1, 2]
    lm_head = torch.randn(40, 32)
    assert torch.equal(drafter.draft_head_weight(type("Head", (), {"lm_head_weight": lm_head})()), lm_head[[4, 17, 30]])
    drafter.set_draft_vocab(None)
    assert not drafter.has_draft_vocab


def test_the_feature_scale_folds_into_fc():
    torch.manual_seed(1)
    drafter = DFlashDrafter(config())
    features = torch.randn(3, 64)
    before = drafter.project_context(features * 2.0)
    drafter.feature_scale.fill_(2.0)
    torch.testing.assert_close(drafter.project_context(features), before)
    torch.testing.assert_close(drafter.folded_fc_weight(), drafter.fc.weight * 2.0)
