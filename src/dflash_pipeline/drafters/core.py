"""The DFlash drafter: a few Qwen3-style layers that draft a whole block in one forward.

References: DFlash (arXiv 2602.06036, z-lab/dflash), SpecForge's trainer.

    features [S, N*H] --fc--> hidden_norm --> context c [S, H]      (target layers' outputs)
    block ids [B] = [anchor, mask, ..., mask] --frozen embed--> x [B, H]
    each layer:  q = q_proj(norm(x));  k, v = [k/v_proj(c) ; k/v_proj(norm(x))]
                 q_norm / k_norm per head, RoPE at absolute positions (context 0..S-1,
                 block a..a+B-1), attention bidirectional inside the block, SwiGLU MLP
    norm(x) --frozen lm_head--> logits of slots 1..B-1

An architecture of the family (`drafters.family`, one module per member) may wrap the attention
and MLP sublayers of every layer (DFlash2's block-local convolution) and add modules of its own
(DFlash2's candidate selector); the core asks the member, it never tests a name.

The drafter owns no embedding and no LM head: `target.TargetHead` holds the target's two frozen
tensors, read straight from its weight files. Training drafts every anchor block of a packed
batch of sequences in one forward (`forward_blocks`, with the DFlash mask of `dflash_mask`, its
sliding window included); decoding keeps the context's keys/values in a static cache
(`decoding.static_speculation.StaticDraftCache`) and drafts one block at a time over it.
"""

from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dflash_pipeline.drafters import family


class DrafterSizeError(ValueError):
    """An architecture option that does not fit the drafter's sizes (`Architecture.check`): the
    option's key, why, and its value, so that a caller can name the key where it was set."""

    def __init__(self, key: str, why: str, value):
        super().__init__(f"{key} {value} {why}")
        self.key, self.why, self.value = key, why, value


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
    architecture: str = family.UNNAMED  # a member of `drafters.family`
    # The architecture's own options (its `options_type`): None or a mapping is resolved to it,
    # with the member's defaults for what is not given.
    options: Any = None

    def __post_init__(self):
        member = family.architecture(self.architecture)
        object.__setattr__(self, "options", member.options_from(self.options))
        problem = member.check(self)
        if problem:
            key, why = problem
            raise DrafterSizeError(key, why, getattr(self.options, key, None))

    @property
    def member(self):
        """The architecture (`drafters.architecture.Architecture`) this config belongs to."""
        return family.architecture(self.architecture)

    @property
    def feature_width(self) -> int:
        return len(self.target_layer_ids) * self.hidden_size

    def to_dict(self) -> dict:
        """Flat: the shared fields, then the architecture's name and options (a DFlash config
        leaves both out, so its record is what it was before the family existed)."""
        data = asdict(self)
        data["target_layer_ids"] = list(self.target_layer_ids)
        del data["architecture"], data["options"]
        if self.architecture != family.UNNAMED or asdict(self.options):
            data["architecture"] = self.architecture
            data.update(asdict(self.options))
        return data

    @classmethod
    def from_dict(cls, data: dict) -> "DrafterConfig":
        """The inverse of `to_dict`: keys that are not shared fields are the architecture's options."""
        shared = {f.name for f in fields(cls)} - {"architecture", "options"}
        data = dict(data)
        data["target_layer_ids"] = tuple(data["target_layer_ids"])
        options = {key: data.pop(key) for key in list(data) if key not in shared | {"architecture"}}
        return cls(**data, options=options)


@dataclass(frozen=True)
class TokenColumns:
    """The one map between token ids and the columns of a head restricted to a subset of the
    vocabulary (a drafter's draft vocabulary, training's softmax vocabulary), or the whole one."""

    token_ids: torch.Tensor | None  # [V'] the columns' token ids, ascending; None: column = token id

    def columns(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Token ids -> columns (-1 where the subset lacks the token)."""
        if self.token_ids is None:
            return token_ids
        vocab = self.token_ids.to(token_ids.device)
        column = torch.searchsorted(vocab, token_ids.long()).clamp(max=vocab.numel() - 1)
        return torch.where(vocab[column] == token_ids, column, torch.full_like(column, -1))

    def tokens(self, columns: torch.Tensor) -> torch.Tensor:
        """Columns -> token ids."""
        return columns if self.token_ids is None else self.token_ids.to(columns.device)[columns]


class ArchitectureModule(nn.Module):
    """A module an architecture adds to the core: it sets its own first weights in
    `reset_parameters` (after the generic init of the Linear layers inside it)."""

    def reset_parameters(self) -> None:
        raise NotImplementedError


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


def attention_dtype(v: torch.Tensor) -> torch.dtype:
    """The dtype attention computes in: autocast's when it is on for v's device type, else v's."""
    device_type = v.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return v.dtype


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
        self._draft_rows: tuple | None = None  # (key, head rows, head weight) cache for `draft_head_weight`
        # A captured draft graph reads `draft_vocab` and the cached head rows at fixed addresses, so
        # a new vocabulary of the same length is copied into them; one of another length cannot
        # be, and bumps `draft_layout`, on which kept speculative steps are keyed.
        self.draft_layout = 0
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.layers = nn.ModuleList([DecoderLayer(config) for _ in range(config.num_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        for name, module in config.member.extra_modules(config).items():  # DFlash2: candidate_selector
            self.add_module(name, module)
        self.apply(self._init_weights)

    @property
    def architecture(self):
        """The member of the family this drafter is (`drafters.architecture.Architecture`)."""
        return self.config.member

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        # Public folders (and checkpoints written before the scale existed) carry fc.weight already
        # folded: their scale is one.
        if "feature_scale" not in state_dict:
            state_dict = {**state_dict, "feature_scale": torch.ones_like(self.feature_scale)}
        # The draft vocabulary's length is the stored one's (none stored: the whole vocabulary).
        draft_vocab = state_dict.get("draft_vocab", torch.zeros(0, dtype=torch.long))
        if draft_vocab.numel() != self.draft_vocab.numel():  # same length: loaded in place, below
            self._new_draft_layout(torch.zeros_like(draft_vocab, device=self.draft_vocab.device))
        result = super().load_state_dict({**state_dict, "draft_vocab": draft_vocab}, strict=strict, assign=assign)
        if assign:  # the state's own tensors replace the module's: nothing a graph read is current
            self._new_draft_layout(self.draft_vocab)
        self._refresh_draft_rows()
        return result

    def set_draft_vocab(self, token_ids: torch.Tensor | None) -> None:
        """Draft over these token ids only (None or empty: the whole vocabulary)."""
        ids = torch.zeros(0, dtype=torch.long) if token_ids is None else torch.unique(token_ids.long().cpu())
        if ids.numel() == self.draft_vocab.numel():
            self.draft_vocab.copy_(ids)
        else:
            self._new_draft_layout(ids.to(self.draft_vocab.device))
        self._refresh_draft_rows()

    def _new_draft_layout(self, draft_vocab: torch.Tensor) -> None:
        """A draft vocabulary of another length: new tensors, and steps built for the old one are stale."""
        self.draft_vocab = draft_vocab
        self._draft_rows = None
        self.draft_layout += 1

    def _refresh_draft_rows(self) -> None:
        """The cached head rows rewritten in place for the current draft vocabulary (their length is
        its length: a new layout dropped them), so a graph that reads them reads the new rows."""
        if self._draft_rows is None:
            return
        key, rows, weight = self._draft_rows
        if self.has_draft_vocab and weight.data_ptr() == key[0] and rows.shape[0] == self.draft_vocab.numel():
            with torch.no_grad():
                rows.copy_(weight[self.draft_vocab.to(weight.device)])
            self._draft_rows = (self._draft_rows_key(weight), rows, weight)
        else:
            self._draft_rows = None

    @property
    def has_draft_vocab(self) -> bool:
        return self.draft_vocab.numel() > 0

    def draft_head_weight(self, head) -> torch.Tensor:
        """The LM-head rows the drafter's logits use: all, or its draft vocabulary's (cached)."""
        weight = head.lm_head_weight
        if not self.has_draft_vocab:
            return weight
        key = self._draft_rows_key(weight)
        if self._draft_rows is None or self._draft_rows[0] != key:
            self._draft_rows = (key, weight[self.draft_vocab.to(weight.device)].contiguous(), weight)
        return self._draft_rows[1]

    def _draft_rows_key(self, weight: torch.Tensor) -> tuple:
        return (weight.data_ptr(), weight.device, weight.dtype, self.draft_vocab.data_ptr(), self.draft_vocab.numel())

    @property
    def token_columns(self) -> TokenColumns:
        """Token ids <-> columns of the drafter's logits (its draft vocabulary, or the whole one)."""
        return TokenColumns(self.draft_vocab if self.has_draft_vocab else None)

    def vocab_index(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Token ids -> columns of the drafter's logits (-1 where the draft vocabulary lacks it)."""
        return self.token_columns.columns(token_ids)

    def vocab_tokens(self, columns: torch.Tensor) -> torch.Tensor:
        """Columns of the drafter's logits -> token ids."""
        return self.token_columns.tokens(columns)

    def folded_fc_weight(self) -> torch.Tensor:
        """fc.weight with the feature scale multiplied in: what a drafter without the scale uses."""
        return self.fc.weight * self.feature_scale.to(self.fc.weight.dtype)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
        elif isinstance(module, ArchitectureModule):
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
        mask [Q, C + Q] bool: which keys each block query may see (see `dflash_mask`), or a
        flex-attention BlockMask of the same (`dflash_block_mask`);
        attention: "sdpa" (dense mask) or "flex" (block-sparse flex_attention, for GPUs).
        Returns the final-norm hidden states [Q, H]; slots 1..B-1 of each block feed the head.
        """
        if attention == "flex" and isinstance(mask, torch.Tensor):
            mask = to_block_mask(mask)
        context = self.project_context(features)
        dtype = block_embeddings.dtype
        rope_context, rope_block = self._rope(context_positions, dtype), self._rope(block_positions, dtype)
        x = block_embeddings
        for layer in self.layers:
            x = layer(x, context, rope_block, rope_context, mask)
        return self.norm(x)


def draft_logits(drafter: DFlashDrafter, head, hidden: torch.Tensor) -> torch.Tensor:
    """Logits [..., V] of drafted hidden states [..., H] over the drafter's draft vocabulary."""
    weight = drafter.draft_head_weight(head)
    return hidden.to(weight.dtype).contiguous() @ weight.T


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
