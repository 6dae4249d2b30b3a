"""The DFlash drafter: a few Qwen3-style layers that draft a whole block in one forward.

References: DFlash (arXiv 2602.06036, z-lab/dflash), SpecForge's trainer.

    features [S, N*H] --fc--> hidden_norm --> context c [S, H]      (target layers' outputs)
    block ids [B] = [anchor, mask, ..., mask] --frozen embed--> x [B, H]
    each layer:  q = q_proj(norm(x));  k, v = [k/v_proj(c) ; k/v_proj(norm(x))]
                 q_norm / k_norm per head, RoPE at absolute positions (context 0..S-1,
                 block a..a+B-1), attention bidirectional inside the block, SwiGLU MLP
    norm(x) --frozen lm_head--> logits of slots 1..B-1

DFlash2 (`architecture: dflash2`) wraps every attention and MLP sublayer in a block-local
convolution and adds a candidate selector that walks one path through each slot's top-K
(`dflash2`); `select_block` drafts a block that way.

The drafter owns no embedding and no LM head: `target.TargetHead` holds the target's two frozen
tensors, read straight from its weight files. Training drafts every anchor block of a packed
batch of sequences in one forward (`forward_blocks`, with the DFlash mask of `dflash_mask`, its
sliding window included); inference keeps a KV cache of the context (`DraftCache`, `draft_block`).
"""

from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from dflash_pipeline.drafters.dflash2 import CandidateSelector, GroupedDynamicCausalConv, SelectedPath, select_paths

ARCHITECTURES = ("dflash", "dflash2")
# DrafterConfig fields only DFlash2 reads; a DFlash config leaves them out of `to_dict`, so its
# serialised form (checkpoint.json, provenance) is what it was before DFlash2 existed.
DFLASH2_FIELDS = ("architecture", "conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


@dataclass(frozen=True)
class DrafterConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    block_size: int  # B: slot 0 is the anchor, slots 1..B-1 are drafted
    target_layer_ids: tuple[int, ...]  # id i = output of target decoder layer i
    num_target_layers: int
    mask_token_id: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 32768
    sliding_window: int | None = None  # context keys further back than this are not attended
    hidden_act: str = "silu"
    extra: dict = field(default_factory=dict)  # recorded, not used: e.g. how the mask token was chosen
    architecture: str = "dflash"  # "dflash" | "dflash2" (the fields below are DFlash2's; dflash ignores them)
    conv_kernel_size: int = 2  # taps of the block-local convolution (2, as released: a slot and its predecessor)
    conv_group_size: int = 16  # channels sharing one dynamic kernel; must divide hidden_size
    selector_rank: int = 64  # codebook width (released: 256, for a 27B target; 2 x vocab x rank weights)
    selector_top_k: int = 16  # candidates per slot the selector chooses among

    def __post_init__(self):
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"architecture must be one of {ARCHITECTURES}, got {self.architecture!r}")
        if self.architecture == "dflash2":
            if self.conv_kernel_size < 1 or self.conv_group_size < 1 or self.hidden_size % self.conv_group_size:
                raise ValueError(f"conv_kernel_size {self.conv_kernel_size} must be >= 1 and conv_group_size "
                                 f"{self.conv_group_size} must divide hidden_size {self.hidden_size}")
            if self.selector_rank < 1 or not 1 <= self.selector_top_k <= self.vocab_size:
                raise ValueError(f"selector_rank {self.selector_rank} must be >= 1 and selector_top_k "
                                 f"{self.selector_top_k} in 1..vocab_size")

    @property
    def feature_width(self) -> int:
        return len(self.target_layer_ids) * self.hidden_size

    def to_dict(self) -> dict:
        data = asdict(self)
        data["target_layer_ids"] = list(self.target_layer_ids)
        if self.architecture == "dflash":
            for name in DFLASH2_FIELDS:
                del data[name]
        return data

    @classmethod
    def from_dict(cls, data: dict) -> "DrafterConfig":
        data = dict(data)
        data["target_layer_ids"] = tuple(data["target_layer_ids"])
        return cls(**data)


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
        q = q.transpose(0, 1)[None]  # [1, heads, Q, d]
        k, v = k.transpose(0, 1)[None], v.transpose(0, 1)[None]  # [1, kv_heads, K, d]
        if mask is not None and not isinstance(mask, torch.Tensor):
            out = flex_attention_fn(q.device)(q, k, v, block_mask=mask, enable_gqa=True)
        else:
            group = self.heads // self.kv_heads
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=None if mask is None else mask[None, None])
        return self.o_proj(out[0].transpose(0, 1).reshape(q.shape[2], -1))


# Device types where flex_attention runs compiled. CPU runs it eager by default (compiling costs
# ~20 s and cannot train: torch has no flex backward on CPU); tests add "cpu" to run the compiled path.
COMPILE_FLEX_ON = ("cuda",)
_COMPILED_FLEX = {}


def flex_attention_fn(device: torch.device):
    """flex_attention, compiled (one fused kernel) on the device types in COMPILE_FLEX_ON, eager elsewhere."""
    from torch.nn.attention.flex_attention import flex_attention

    if device.type not in COMPILE_FLEX_ON:
        return flex_attention
    if device.type not in _COMPILED_FLEX:
        # Dynamic shapes on CUDA (every batch packs a different length). Inductor's CPU flex template
        # fails to build dynamic kernels when Q != K (torch 2.13), so the CPU compiles per shape.
        _COMPILED_FLEX[device.type] = torch.compile(flex_attention, dynamic=device.type == "cuda")
    return _COMPILED_FLEX[device.type]


def to_block_mask(mask: torch.Tensor):
    """A dense [Q, K] DFlash mask as a flex-attention BlockMask (built once per forward)."""
    import warnings

    from torch.nn.attention.flex_attention import create_block_mask

    def visible(batch, head, query, key):
        return mask[query, key]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager flex on CPU warns that it is unfused; it is only for tests there
        return create_block_mask(visible, B=None, H=None, Q_LEN=mask.shape[0], KV_LEN=mask.shape[1], device=mask.device)


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
        self.attention_conv = self.mlp_conv = None  # DFlash2's convolutions around the two sublayers
        if config.architecture == "dflash2":
            self.attention_conv = GroupedDynamicCausalConv(config.hidden_size, config.conv_kernel_size, config.conv_group_size)
            self.mlp_conv = GroupedDynamicCausalConv(config.hidden_size, config.conv_kernel_size, config.conv_group_size)

    def _around(self, conv, sublayer, x: torch.Tensor) -> torch.Tensor:
        """sublayer(x), with `conv` (if any) before and after it, block by block (Q = blocks * B)."""
        if conv is None:
            return sublayer(x)
        blocks = x.view(-1, self.block_size, x.shape[-1])
        prepared, dynamic = conv.prepare(blocks)
        out = sublayer(prepared.view_as(x))
        return conv.finish(out.view_as(blocks), dynamic).view_as(out)

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


class DFlashDrafter(nn.Module):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.config = config
        self.fc = nn.Linear(config.feature_width, config.hidden_size, bias=False)
        # A fixed per-channel scale on the features before `fc` (`train.feature_norm`): ones, or
        # one over each channel's RMS on the train shards. Being linear it folds into fc.weight
        # on export (`folded_fc_weight`), so the public format never sees it.
        self.register_buffer("feature_scale", torch.ones(config.feature_width))
        # The token ids (ascending) the drafter drafts over, or empty for the whole vocabulary
        # (`train.train_vocab: data`). A small draft vocabulary makes the head, most of a small
        # drafter's cost, that much cheaper; verification by the target keeps decoding lossless.
        self.register_buffer("draft_vocab", torch.zeros(0, dtype=torch.long))
        self._draft_rows: tuple | None = None  # (key, head rows) cache for `draft_head_weight`
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.layers = nn.ModuleList([DecoderLayer(config) for _ in range(config.num_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if config.architecture == "dflash2":
            self.candidate_selector = CandidateSelector(config.hidden_size, config.vocab_size, config.selector_rank,
                                                        config.selector_top_k)
        self.apply(self._init_weights)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        # Public folders (and checkpoints written before the scale existed) carry fc.weight already
        # folded: their scale is one.
        if "feature_scale" not in state_dict:
            state_dict = {**state_dict, "feature_scale": torch.ones_like(self.feature_scale)}
        # The draft vocabulary's length is the stored one's (none stored: the whole vocabulary).
        draft_vocab = state_dict.get("draft_vocab", torch.zeros(0, dtype=torch.long))
        self.draft_vocab = torch.zeros_like(draft_vocab, device=self.draft_vocab.device)
        self._draft_rows = None
        return super().load_state_dict({**state_dict, "draft_vocab": draft_vocab}, strict=strict, assign=assign)

    def set_draft_vocab(self, token_ids: torch.Tensor | None) -> None:
        """Draft over these token ids only (None or empty: the whole vocabulary)."""
        ids = torch.zeros(0, dtype=torch.long) if token_ids is None else torch.unique(token_ids.long().cpu())
        self.draft_vocab = ids.to(self.draft_vocab.device)
        self._draft_rows = None

    @property
    def has_draft_vocab(self) -> bool:
        return self.draft_vocab.numel() > 0

    def draft_head_weight(self, head) -> torch.Tensor:
        """The LM-head rows the drafter's logits use: all, or its draft vocabulary's (cached)."""
        weight = head.lm_head_weight
        if not self.has_draft_vocab:
            return weight
        key = (weight.data_ptr(), weight.device, weight.dtype, self.draft_vocab.data_ptr(), self.draft_vocab.numel())
        if self._draft_rows is None or self._draft_rows[0] != key:
            self._draft_rows = (key, weight[self.draft_vocab.to(weight.device)].contiguous())
        return self._draft_rows[1]

    def vocab_index(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Token ids -> columns of the drafter's logits (-1 where the draft vocabulary lacks it)."""
        if not self.has_draft_vocab:
            return token_ids
        vocab = self.draft_vocab.to(token_ids.device)
        column = torch.searchsorted(vocab, token_ids.long()).clamp(max=vocab.numel() - 1)
        return torch.where(vocab[column] == token_ids, column, torch.full_like(column, -1))

    def vocab_tokens(self, columns: torch.Tensor) -> torch.Tensor:
        """Columns of the drafter's logits -> token ids."""
        return columns if not self.has_draft_vocab else self.draft_vocab.to(columns.device)[columns]

    def folded_fc_weight(self) -> torch.Tensor:
        """fc.weight with the feature scale multiplied in: what a drafter without the scale uses."""
        return self.fc.weight * self.feature_scale.to(self.fc.weight.dtype)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
        elif isinstance(module, (GroupedDynamicCausalConv, CandidateSelector)):
            module.reset_parameters()  # after its Linear children (apply visits them first)

    def project_context(self, features) -> torch.Tensor:
        """features [C, N*H] (any float dtype), or a list of per-sequence pieces -> context [C, H].

        Pieces are projected one by one and only the H-wide results concatenated, so the
        N*H-wide features (zero-copy views of memory-mapped shards) are never copied into a batch.
        """
        if isinstance(features, (list, tuple)):
            return torch.cat([self.project_context(piece) for piece in features])
        weight = self.folded_fc_weight()
        return self.hidden_norm(F.linear(features.to(weight.dtype), weight))

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype):
        return rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, dtype)

    def forward_blocks(
        self,
        features: torch.Tensor,
        context_positions: torch.Tensor,
        block_embeddings: torch.Tensor,
        block_positions: torch.Tensor,
        mask: torch.Tensor,
        attention: str = "sdpa",
    ) -> torch.Tensor:
        """Draft many blocks in one forward.

        features [C, N*H] (or per-sequence pieces) and context_positions [C]: every sequence's
        context, packed;
        block_embeddings [Q, H] and block_positions [Q]: all blocks, flattened (Q = blocks * B);
        mask [Q, C + Q] bool: which keys each block query may see (see `dflash_mask`).
        attention: "sdpa" (dense mask) or "flex" (block-sparse flex_attention, for GPUs).
        Returns the final-norm hidden states [Q, H]; slots 1..B-1 of each block feed the head.
        """
        if attention == "flex" and mask is not None:
            mask = to_block_mask(mask)
        context = self.project_context(features)
        dtype = block_embeddings.dtype
        rope_context, rope_block = self._rope(context_positions, dtype), self._rope(block_positions, dtype)
        x = block_embeddings
        for layer in self.layers:
            x = layer(x, context, rope_block, rope_context, mask)
        return self.norm(x)


def dflash_mask(
    context_sequence: torch.Tensor,
    context_positions: torch.Tensor,
    block_sequence: torch.Tensor,
    block_anchor: torch.Tensor,
    block_index: torch.Tensor,
    *,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """The DFlash training mask [Q, C + Q] (True = visible), built with tensor ops.

    A block query (its block drafted from anchor a of sequence s) sees the context keys of
    sequence s at positions j < a (the anchor's own features do not exist yet at inference),
    and every key of its own block (bidirectional); nothing of other blocks or sequences.
    """
    same_sequence = block_sequence[:, None] == context_sequence[None, :]
    before_anchor = context_positions[None, :] < block_anchor[:, None]
    visible_context = same_sequence & before_anchor
    if sliding_window is not None:
        visible_context &= context_positions[None, :] >= block_anchor[:, None] - sliding_window
    same_block = block_index[:, None] == block_index[None, :]
    return torch.cat([visible_context, same_block], dim=1)


class DraftCache:
    """Per-layer context keys/values of one sequence for inference, extended as tokens commit.

    Context K/V depend only on the target features and their positions, never on a block, so
    they are computed once per committed token and reused by every later block.
    """

    def __init__(self, drafter: DFlashDrafter):
        self.drafter = drafter
        self.keys = [None] * len(drafter.layers)
        self.values = [None] * len(drafter.layers)
        self.length = 0

    def extend(self, features: torch.Tensor) -> None:
        """Add the features [n, N*H] of the next n committed positions."""
        drafter = self.drafter
        positions = torch.arange(self.length, self.length + features.shape[0], device=features.device)
        context = drafter.project_context(features)
        cos, sin = drafter._rope(positions, context.dtype)
        for index, layer in enumerate(drafter.layers):
            k, v = layer.self_attn.keys_values(context, cos, sin)
            self.keys[index] = k if self.keys[index] is None else torch.cat([self.keys[index], k])
            self.values[index] = v if self.values[index] is None else torch.cat([self.values[index], v])
        self.length += features.shape[0]

    def crop(self, length: int) -> None:
        """Forget context positions >= length (after a rejected speculation)."""
        self.keys = [k[:length] if k is not None else None for k in self.keys]
        self.values = [v[:length] if v is not None else None for v in self.values]
        self.length = min(self.length, length)


@torch.no_grad()
def draft_hidden(drafter: DFlashDrafter, head, cache: DraftCache, anchor_token: int) -> torch.Tensor:
    """Final-norm hidden states [B-1, H] of the slots after `anchor_token`, which sits at position
    cache.length. The context is every position < cache.length (the anchor's own features are not
    known yet). `head` is the target's frozen embedding and LM head (`target.TargetHead`)."""
    config = drafter.config
    device = head.embed_weight.device
    ids = torch.full((config.block_size,), config.mask_token_id, dtype=torch.long, device=device)
    ids[0] = anchor_token
    x = head.embed(ids).to(drafter.fc.weight.dtype)
    positions = torch.arange(cache.length, cache.length + config.block_size, device=device)
    rope_block = drafter._rope(positions, x.dtype)
    mask = None
    if config.sliding_window is not None and cache.length > config.sliding_window:
        mask = torch.ones(config.block_size, cache.length + config.block_size, dtype=torch.bool, device=device)
        mask[:, : cache.length - config.sliding_window] = False
    for index, layer in enumerate(drafter.layers):
        if cache.keys[index] is None:
            empty = torch.zeros(0, config.num_key_value_heads, config.head_dim, dtype=x.dtype, device=device)
            kv = (empty, empty)
        else:
            kv = (cache.keys[index], cache.values[index])
        x = layer(x, None, rope_block, None, mask, cached_kv=kv)
    return drafter.norm(x)[1:]


def draft_logits(drafter: DFlashDrafter, head, hidden: torch.Tensor) -> torch.Tensor:
    """Logits [..., V] of drafted hidden states [..., H] over the drafter's draft vocabulary."""
    weight = drafter.draft_head_weight(head)
    return hidden.to(weight.dtype).contiguous() @ weight.T


@torch.no_grad()
def draft_block(drafter: DFlashDrafter, head, cache: DraftCache, anchor_token: int) -> torch.Tensor:
    """Logits [B-1, V] for the tokens after `anchor_token`, which sits at position cache.length.

    V is the drafter's draft vocabulary (`drafter.vocab_tokens` maps columns to token ids), the
    whole vocabulary unless it has one.

    `head` is the target's frozen embedding and LM head (`target.TargetHead`).
    The context is every position < cache.length (the anchor's own features are not known yet).
    """
    return draft_logits(drafter, head, draft_hidden(drafter, head, cache, anchor_token))


@torch.no_grad()
def select_block(drafter: DFlashDrafter, head, cache: DraftCache, anchor_token: int, *, temperature: float = 0.0,
                 generator: torch.Generator | None = None) -> SelectedPath:
    """One DFlash2 block after `anchor_token` (at position cache.length): the selector's path through
    each slot's top-K (`dflash2.select_paths`), with leading dimension 1."""
    if drafter.config.architecture != "dflash2":
        raise ValueError(f"select_block needs a dflash2 drafter, not a {drafter.config.architecture} one")
    hidden = draft_hidden(drafter, head, cache, anchor_token)
    logits = draft_logits(drafter, head, hidden)
    anchors = torch.tensor([anchor_token], device=hidden.device)
    return select_paths(drafter.candidate_selector, hidden[None], logits[None], anchors, to_token_ids=drafter.vocab_tokens,
                        temperature=temperature, generator=generator)


def count_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def training_flops(drafter: "DFlashDrafter", *, trained_positions: int, context_tokens: int, vocab_rows: int) -> float:
    """Model FLOPs of training steps that drafted `trained_positions` slots over `context_tokens`
    context positions: 6 per weight per token it touches (forward + backward), where block tokens
    (one anchor per B-1 trained slots) pass every layer and context tokens pass fc and each layer's
    k/v projections; plus the frozen head's two matmuls per slot (logits, and the hidden state's
    gradient) over `vocab_rows` rows. Attention scores are left out (small at these lengths)."""
    block_tokens = trained_positions * drafter.config.block_size / (drafter.config.block_size - 1)
    context_weights = drafter.fc.weight.numel() + sum(layer.self_attn.k_proj.weight.numel() + layer.self_attn.v_proj.weight.numel()
                                                      for layer in drafter.layers)
    return (6 * count_parameters(drafter.layers) * block_tokens + 6 * context_weights * context_tokens
            + 2 * 2 * trained_positions * drafter.config.hidden_size * vocab_rows)
