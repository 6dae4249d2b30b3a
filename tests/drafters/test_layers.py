"""drafters/layers.py: RoPE is a rotation, the identity at position zero, and relative."""

import pytest
import torch

from dflash_pipeline.drafters.layers import apply_rope, rope_cos_sin


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
