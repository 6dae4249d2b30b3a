"""drafters/core.py: its config round-trips and refuses bad DFlash2 sizes, RoPE is a rotation, a
draft vocabulary maps columns to token ids and back, the feature scale folds into fc, and q, k, v
reach attention in one dtype (autocast's)."""

import pytest
import torch

from dflash_pipeline.drafters.core import (
    DFlashDrafter,
    DrafterConfig,
    apply_rope,
    rope_cos_sin,
)


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


def _record_attention_inputs(monkeypatch):
    """The dtypes of q, k, v at the attention functions `Attention.attend` calls (SDPA and flex)."""
    import dflash_pipeline.drafters.core as core

    seen = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recording_sdpa(q, k, v, *args, **kwargs):
        seen.append(("sdpa", q.dtype, k.dtype, v.dtype))
        return sdpa(q, k, v, *args, **kwargs)

    flex_fn = core.flex_attention_fn

    def recording_flex_fn(device):
        flex = flex_fn(device)

        def recording_flex(q, k, v, **kwargs):
            seen.append(("flex", q.dtype, k.dtype, v.dtype))
            return flex(q, k, v, **kwargs)

        return recording_flex

    monkeypatch.setattr(core.F, "scaled_dot_product_attention", recording_sdpa)
    monkeypatch.setattr(core, "flex_attention_fn", recording_flex_fn)
    return seen


@pytest.mark.parametrize("attention", ["sdpa", "flex"])
def test_q_k_and_v_reach_attention_in_the_autocast_dtype(monkeypatch, attention):
    """Under bf16 autocast the drafter's RMSNorm (fp32 weight) and RoPE make q and k fp32 while v
    is bf16; attention must get all three in bf16 (on a GPU an fp32 q/k runs flex's fp32 kernels).
    The CPU's autocast stands in for the GPU's. The static inference cache attends the same way."""
    from support.device_reads import random_samples

    from dflash_pipeline.data.blocks import build_batch
    from dflash_pipeline.decoding.static_speculation import StaticDraftCache

    torch.manual_seed(0)
    drafter_config = DrafterConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   head_dim=8, vocab_size=100, block_size=4, target_layer_ids=(0, 1), num_target_layers=2, mask_token_id=99)
    drafter = DFlashDrafter(drafter_config).eval()
    samples = random_samples(1, count=3, width=drafter_config.feature_width)
    batch = build_batch(samples, anchors_per_sequence=3, block_size=4, mask_token_id=99, anchor_seeds=[0, 1, 2])
    embeddings = torch.randn(batch.block_ids.shape[0], 32)
    seen = _record_attention_inputs(monkeypatch)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        drafter.forward_blocks(batch.features, batch.context_positions, embeddings, batch.block_positions,
                               batch.attention_mask(attention), attention=attention)
    assert [entry[0] for entry in seen] == [attention] * 2
    assert all(entry[1:] == (torch.bfloat16,) * 3 for entry in seen), seen

    seen.clear()

    class Head:
        def embed(self, ids):
            return torch.randn(ids.shape[0], 32)

    cache = StaticDraftCache(drafter, length=16, device="cpu", dtype=torch.bfloat16)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        cache.write(samples[0].features[:8], torch.tensor(0))
        cache.hidden(Head(), torch.tensor([5]), torch.tensor(8))
    assert len(seen) == 2 and all(entry[1:] == (torch.bfloat16,) * 3 for entry in seen), seen


def test_without_autocast_attention_inputs_keep_their_dtype(monkeypatch):
    """fp32 (the CPU default): the cast is a no-op, so CPU training results stay bit-identical."""
    from support.device_reads import random_samples

    from dflash_pipeline.data.blocks import build_batch

    torch.manual_seed(0)
    drafter = DFlashDrafter(config()).eval()
    samples = random_samples(2, count=2, width=drafter.config.feature_width)
    batch = build_batch(samples, anchors_per_sequence=2, block_size=drafter.config.block_size, mask_token_id=1, anchor_seeds=[0, 1])
    seen = _record_attention_inputs(monkeypatch)
    with torch.no_grad():
        drafter.forward_blocks(batch.features, batch.context_positions, torch.randn(batch.block_ids.shape[0], drafter.config.hidden_size),
                               batch.block_positions, batch.dense_mask())
    assert seen and all(entry[1:] == (torch.float32,) * 3 for entry in seen), seen
