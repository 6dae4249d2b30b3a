"""The drafter's layers, Qwen3-style: RMSNorm, rotate-half RoPE, attention over the context's and
the block's keys (`Attention`), the SwiGLU MLP, and the decoder layer that joins them with the
architecture's wrappers around its two sublayers (DFlash2's convolutions).

Their attribute names are the public format's tensor names (`layers.i.self_attn.q_proj.weight`...).
"""

import torch
import torch.nn.functional as F
from torch import nn

from dflash_pipeline.drafters.attention import attention_dtype, flex_attention_fn
from dflash_pipeline.drafters.config import DrafterConfig


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos, sin of shape [*positions.shape, head_dim] for the rotate-half RoPE convention."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    angles = positions.float()[..., None] * inv_freq  # [..., head_dim / 2]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., T, heads, head_dim] rotated by cos/sin [..., T, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[..., None, :] + rotated * sin[..., None, :]


class Attention(nn.Module):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(config.hidden_size, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, config.hidden_size, bias=False)
        self.q_norm = RMSNorm(head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(head_dim, config.rms_norm_eps)

    def keys_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [T, H] -> k, v [T, kv_heads, head_dim] (k normed and rotated)."""
        k = self.k_norm(self.k_proj(x).view(x.shape[0], self.kv_heads, self.head_dim))
        v = self.v_proj(x).view(x.shape[0], self.kv_heads, self.head_dim)
        return apply_rope(k, cos, sin), v

    def queries(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q = self.q_norm(self.q_proj(x).view(x.shape[0], self.heads, self.head_dim))
        return apply_rope(q, cos, sin)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask) -> torch.Tensor:
        """q [Q, heads, d], k/v [K, kv_heads, d] -> [Q, heads * d].

        `mask` is a bool [Q, K] tensor (True = visible) for SDPA, a flex-attention BlockMask
        (which skips the tiles nothing in them may see), or None (everything visible).
        """
        # One dtype for q, k and v, cast here once for every caller (training, scoring, the static
        # inference cache): RMSNorm (fp32 weight) and RoPE promote q and k to fp32 under bf16
        # autocast while v stays bf16, and flex attention then runs its fp32 kernels (several
        # times slower) or SDPA promotes. Without autocast this is v's (the weights') dtype, a no-op.
        dtype = attention_dtype(v)
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        q = q.transpose(0, 1)[None]  # [1, heads, Q, d]
        k, v = k.transpose(0, 1)[None], v.transpose(0, 1)[None]  # [1, kv_heads, K, d]
        if mask is not None and not isinstance(mask, torch.Tensor):
            out = flex_attention_fn(q.device)(q, k, v, block_mask=mask, enable_gqa=True)
        else:
            group = self.heads // self.kv_heads
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=None if mask is None else mask[None, None])
        return self.o_proj(out[0].transpose(0, 1).reshape(q.shape[2], -1))


class MLP(nn.Module):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.block_size = config.block_size
        # The architecture's wrappers around the two sublayers (DFlash2: its convolutions), or None.
        # Their names are the public format's: `layers.i.attention_conv.*`, `layers.i.mlp_conv.*`.
        self.attention_conv, self.mlp_conv = config.member.sublayer_wrappers(config)

    def _around(self, wrapper, sublayer, x: torch.Tensor) -> torch.Tensor:
        """sublayer(x), with `wrapper` (if any) before and after it, block by block (Q = blocks * B):
        `wrapper.prepare(blocks) -> (input, state)`, `wrapper.finish(output, state)`."""
        if wrapper is None:
            return sublayer(x)
        blocks = x.view(-1, self.block_size, x.shape[-1])
        prepared, state = wrapper.prepare(blocks)
        out = sublayer(prepared.view_as(x))
        return wrapper.finish(out.view_as(blocks), state).view_as(out)

    def forward(self, x, context, rope_block, rope_context, mask, cached_kv=None):
        """x [Q, H] block tokens; context [C, H] projected features (or cached_kv); mask [Q, C + Q]."""
        attn = self.self_attn

        def attention(normed):
            q = attn.queries(normed, *rope_block)
            k_block, v_block = attn.keys_values(normed, *rope_block)
            k_ctx, v_ctx = cached_kv if cached_kv is not None else attn.keys_values(context, *rope_context)
            return attn.attend(q, torch.cat([k_ctx, k_block]), torch.cat([v_ctx, v_block]), mask)

        x = x + self._around(self.attention_conv, attention, self.input_layernorm(x))
        return x + self._around(self.mlp_conv, self.mlp, self.post_attention_layernorm(x))
