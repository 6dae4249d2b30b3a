"""drafters/flops.py: the parameter count and the training FLOPs of a small drafter, counted by hand."""

import pytest

from dflash_pipeline.drafters.config import DrafterConfig
from dflash_pipeline.drafters.core import DFlashDrafter
from dflash_pipeline.drafters.flops import count_parameters, training_flops


def test_training_flops_count_every_weight_a_token_passes_and_the_head():
    drafter = DFlashDrafter(DrafterConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                          head_dim=8, vocab_size=50, block_size=4, target_layer_ids=(0, 2), num_target_layers=3,
                                          mask_token_id=49))
    # one layer: q and o 32x32, k and v 32x16, q/k norms 8 each, SwiGLU 3 x 32x64, two layer norms 32 each
    layer = 2 * 32 * 32 + 2 * 32 * 16 + 2 * 8 + 3 * 32 * 64 + 2 * 32
    assert count_parameters(drafter.layers) == layer == 9296
    context_weights = 64 * 32 + 2 * 32 * 16  # fc (two taps of 32), the layer's k and v
    # 30 trained slots are 10 blocks of 4 tokens (anchor included)
    expected = 6 * layer * 40 + 6 * context_weights * 100 + 2 * 2 * 30 * 32 * 50
    assert training_flops(drafter, trained_positions=30, context_tokens=100, vocab_rows=50) == pytest.approx(expected)
