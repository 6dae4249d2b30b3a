"""drafters/attention.py: q, k and v reach attention (SDPA and flex, the training forward and the
static inference cache) in one dtype, autocast's, and keep theirs without autocast."""

import pytest
import torch

from dflash_pipeline.drafters.config import DrafterConfig
from dflash_pipeline.drafters.core import DFlashDrafter


def config(**overrides) -> DrafterConfig:
    values = dict(hidden_size=32, intermediate_size=64, num_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  vocab_size=40, block_size=4, target_layer_ids=(0, 2), num_target_layers=3, mask_token_id=39)
    values.update(overrides)
    return DrafterConfig(**values)


def _record_attention_inputs(monkeypatch):
    """The dtypes of q, k, v at the attention functions `Attention.attend` calls (SDPA and flex)."""
    import dflash_pipeline.drafters.layers as layers

    seen = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recording_sdpa(q, k, v, *args, **kwargs):
        seen.append(("sdpa", q.dtype, k.dtype, v.dtype))
        return sdpa(q, k, v, *args, **kwargs)

    flex_fn = layers.flex_attention_fn

    def recording_flex_fn(device):
        flex = flex_fn(device)

        def recording_flex(q, k, v, **kwargs):
            seen.append(("flex", q.dtype, k.dtype, v.dtype))
            return flex(q, k, v, **kwargs)

        return recording_flex

    monkeypatch.setattr(layers.F, "scaled_dot_product_attention", recording_sdpa)
    monkeypatch.setattr(layers, "flex_attention_fn", recording_flex_fn)
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
