"""The target's decode step over a static KV cache: one shape for every step, nothing read back.

Transformers' `DynamicCache` grows by concatenation (copying the whole cache every step), its mask
is rebuilt every step and checked on the host (a device read per forward), and every decode step
has a new key length, so attention plans anew each time: on an H200 the step was 54-72 ms of host
work for ~2 ms of GPU work. Here the keys and values of a fixed batch live in preallocated tensors
[layers, batch, kv heads, length, head dim], each forward writes its columns in place at
device-side column indices (`ColumnCache`, the cache object transformers' attention layers
update), and attention reads the whole length under a 4-D visibility mask, so every step has the
same shapes and the same kernels: it can be captured once as a CUDA graph and replayed
(`graphs.PhaseRunner`).

The forward is the target's own (`model.model(...)`): transformers maintains every architecture's
layers (Llama, Qwen2/3 with their q/k norms and biases, Mistral, Gemma3, rope scaling), and this
module supplies only the cache, the positions and the mask (boolean for SDPA, additive for eager
attention), with a sliding-window mask for the layers that have one. A target this cannot serve
is refused in one line naming its model type (`check_servable`); nothing falls back silently.

Left padding: row r's prompt sits right-aligned in columns [0, W); a padding column is never
visible to another query, but sees itself, so no query row is empty (an empty row is NaN, and a
NaN key or value poisons every row that multiplies it by a zero weight).
"""

import functools
import inspect

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.cache_utils import Cache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

from dflash_pipeline.foundation.errors import PipelineError
from dflash_pipeline.target.placement import execution_device

LAYER_TYPES = ("full_attention", "sliding_attention")  # the attention layouts the mask covers
# Rope types whose frequencies depend on the sequence length seen so far: transformers updates them
# with a host read of the longest position, which a captured step cannot make.
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")
# The engine's own registration of scaled-dot-product attention (`static_sdpa`), which a target
# loaded with transformers' "sdpa" is switched to when a static decoder is built on it.
STATIC_SDPA = "static_kv_sdpa"  # no "flash" in the name: transformers reads that as a flash-attention kernel
# The attention implementations whose masks this module builds: a boolean mask for SDPA, an
# additive one for the eager softmax. Flash and flex attention take no dense 4-D mask.
MASK_KINDS = {"sdpa": "bool", STATIC_SDPA: "bool", "eager": "additive"}
# Whether a step on a CPU attends over the written columns only (`StaticDecoder.trim`). Tests of
# the GPU's shape contract (no read inside a step, one compiled graph) turn it off on their CPU.
TRIM_ON_CPU = True
# Whether every target keeps one cache tensor per layer, as a target split over devices does (a
# layer's keys live where it runs). Tests turn it on to run that path on a CPU's single device.
PER_LAYER_CACHE = False


def static_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers' SDPA attention with grouped query heads served without copying keys and values.

    For the boolean 4-D masks the engine passes, query [B, H, T, D] attends to key/value
    [B, KVH, L, D] as they are: on a CPU through SDPA's own grouped-query path, on CUDA with the
    query heads that share a KV head folded into the query length (equal head counts: flash
    attention takes no mask and memory-efficient attention no GQA, so a masked grouped call would
    fall to the math kernel). transformers' own function repeats every key and value to all query
    heads over the whole cache length first. Any other call (no mask, a float mask, dropout, attention
    sinks) is transformers' function unchanged, so a model switched to this one answers exactly as
    before outside the engine."""
    if (attention_mask is None or attention_mask.dtype != torch.bool or attention_mask.dim() != 4 or dropout
            or kwargs.get("s_aux") is not None):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    heads, kv_heads = query.shape[1], key.shape[1]
    folded_mask = attention_mask.shape[-2] == heads // kv_heads * query.shape[2] != query.shape[2]  # `StaticDecoder.fold_heads`
    if heads != kv_heads and (folded_mask or query.device.type == "cuda"):
        return folded_attention(query, key, value, attention_mask, scaling), None
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling, enable_gqa=heads != kv_heads)
    return out.transpose(1, 2).contiguous(), None


def folded_attention(query, key, value, mask, scaling):
    """Grouped-query attention as equal heads: the `group` query heads that share a KV head (heads
    k*group .. k*group+group-1, as transformers' `repeat_kv` pairs them) become `group` blocks of
    query rows of that KV head, each block seeing what its step sees. query [B, H, T, D], key/value
    [B, KVH, L, D], mask [B, 1, T, L], or already folded [B, 1, group * T, L] (built once per
    forward by `StaticDecoder`, not once per layer) -> [B, T, H, D]."""
    batch, heads, steps, dim = query.shape
    kv_heads = key.shape[1]
    group = heads // kv_heads
    rows = mask if mask.shape[-2] == group * steps else mask.expand(batch, 1, steps, -1).repeat(1, 1, group, 1)  # row r*T + t: step t
    out = F.scaled_dot_product_attention(query.reshape(batch, kv_heads, group * steps, dim), key, value, attn_mask=rows, scale=scaling)
    return out.view(batch, heads, steps, dim).transpose(1, 2).contiguous()


@functools.cache
def _register_static_sdpa() -> None:
    AttentionInterface.register(STATIC_SDPA, static_sdpa)
    # the target's own forwards (outside the engine) keep SDPA's boolean masks; with no mask
    # function registered transformers would build none and ignore padding
    AttentionMaskInterface.register(STATIC_SDPA, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


def use_static_sdpa(model) -> None:
    """Switch a target loaded with transformers' "sdpa" attention to `static_sdpa` (registered once):
    the attention kernel of the engine, chosen here and nowhere else."""
    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return
    _register_static_sdpa()
    model.set_attn_implementation(STATIC_SDPA)


def _rope_types(config) -> set[str]:
    """The rope types a config names: one spelling for the model, or one per layer type."""
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if not rope or "rope_type" in rope:
        return {rope.get("rope_type", "default")}
    return {value.get("rope_type", "default") for value in rope.values() if isinstance(value, dict)}


def unservable_reason(model) -> str | None:
    """Why `StaticDecoder` cannot run this target, or None when it can."""
    config = getattr(model, "config", None)
    decoder = model.get_decoder() if callable(getattr(model, "get_decoder", None)) else None
    if config is None or decoder is None or not hasattr(decoder, "layers") or not hasattr(model, "lm_head"):
        return f"{type(model).__name__} is not a decoder-only transformers causal LM"
    model_type = getattr(config, "model_type", "?")
    if getattr(config, "is_encoder_decoder", False):
        return f"model type '{model_type}' is an encoder-decoder"
    layer_types = set(getattr(config, "layer_types", None) or ())
    if layer_types - set(LAYER_TYPES):
        return f"model type '{model_type}' has layer types {sorted(layer_types - set(LAYER_TYPES))} (only {list(LAYER_TYPES)} are masked)"
    if getattr(config, "attn_logit_softcapping", None) is not None:
        return f"model type '{model_type}' soft-caps attention logits, which scaled-dot-product attention cannot"
    rope_types = _rope_types(config)
    if rope_types & set(LENGTH_DEPENDENT_ROPE):
        return f"model type '{model_type}' uses rope type {sorted(rope_types & set(LENGTH_DEPENDENT_ROPE))}, whose frequencies change with the length decoded"
    implementation = getattr(config, "_attn_implementation", None) or "eager"
    if implementation not in MASK_KINDS:
        return f"model type '{model_type}' was loaded with attention '{implementation}' (the engine's masks serve {sorted(MASK_KINDS)})"
    if "position_ids" not in inspect.signature(decoder.forward).parameters:
        return f"model type '{model_type}': its decoder's forward takes no position_ids"
    return None


def supports(model) -> bool:
    """Whether `StaticDecoder` can run this target."""
    return unservable_reason(model) is None


def check_servable(model) -> None:
    """Refuse, in one line naming the model type, a target the static engine cannot decode."""
    reason = unservable_reason(model)
    if reason is not None:
        raise PipelineError(f"static decoder: {reason}; no other decoding path is taken")


@functools.cache
def _cache_keyword_of(forward) -> str:
    parameters = inspect.signature(forward).parameters
    for keyword in ("cache", "past_key_values"):
        if keyword in parameters:
            return keyword
    raise PipelineError(f"{forward.__qualname__} takes neither 'cache' nor 'past_key_values': this transformers release is not supported")


def cache_keyword(module) -> str:
    """The keyword the installed transformers' forward of `module` (a causal LM or its decoder)
    takes its KV cache by: `cache` from 5.24 on, `past_key_values` before (5.24 still accepts it,
    with a warning). An older release swallows an unknown `cache=` in **kwargs and decodes with an
    empty cache, wrong logits and no error, so every forward that passes a cache takes its keyword
    from here and nowhere else."""
    return _cache_keyword_of(type(module).forward)


def cache_argument(module, cache) -> dict:
    """`{keyword: cache}` for `module(...)`: see `cache_keyword`."""
    return {cache_keyword(module): cache}


class ColumnCache(Cache):
    """The cache object handed to transformers' forward: every layer's `update` writes the new keys
    and values at the decoder's current columns and returns that layer's whole static buffers.

    Cache's own constructor is not called: it allocates per-layer objects this cache has none of,
    and its signature changes between releases. Only the methods a forward calls are defined."""

    is_compileable = True

    def __init__(self, decoder: "StaticDecoder"):  # noqa: super().__init__ deliberately not called
        self.decoder = decoder
        self.layers = []

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        decoder = self.decoder
        keys, values = decoder.keys[layer_idx], decoder.values[layer_idx]
        columns = decoder.columns_now if decoder.layer_devices is None else decoder.columns_on[keys.device]
        keys.index_copy_(2, columns, key_states)
        values.index_copy_(2, columns, value_states)
        if decoder.filled is not None:
            return keys[:, :, : decoder.filled], values[:, :, : decoder.filled]
        return keys, values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions and columns are always passed explicitly; never read from the cache

    def __len__(self) -> int:
        return len(self.decoder.keys)


class StaticDecoder:
    """A fixed batch of sequences decoded over a preallocated cache of `length` columns."""

    def __init__(self, model, *, batch: int, length: int, tap_layers: tuple[int, ...] = (), trim: bool | None = None,
                 fold_heads: bool | None = None):
        check_servable(model)
        use_static_sdpa(model)
        decoder = model.get_decoder()
        config = model.config
        self.model, self.decoder = model, decoder
        # A target split over devices (`target.placement`) computes each layer on its execution
        # device: the state lives where the embedding runs, each layer's keys and values where the
        # layer runs (None: every layer runs where the state lives, one stacked cache).
        self.device, self.dtype = execution_device(model.get_input_embeddings()), next(model.parameters()).dtype
        layer_devices = [execution_device(layer) for layer in decoder.layers]
        uniform = all(d == self.device for d in layer_devices) and not PER_LAYER_CACHE
        self.layer_devices = None if uniform else layer_devices
        heads = config.num_attention_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        shape = (len(decoder.layers), batch, config.num_key_value_heads, length, self.head_dim)
        if self.layer_devices is None:
            self.keys = torch.zeros(shape, dtype=self.dtype, device=self.device)
            self.values = torch.zeros(shape, dtype=self.dtype, device=self.device)
        else:
            self.keys = [torch.zeros(shape[1:], dtype=self.dtype, device=d) for d in self.layer_devices]
            self.values = [torch.zeros(shape[1:], dtype=self.dtype, device=d) for d in self.layer_devices]
        self.columns_on: dict[torch.device, torch.Tensor] = {}  # `columns_now` on each layer device (split targets)
        self.valid = torch.zeros(batch, length, dtype=torch.bool, device=self.device)  # keys that hold a real token
        self.key_positions = torch.zeros(batch, length, dtype=torch.long, device=self.device)  # each key's token position
        self.positions = torch.zeros(batch, dtype=torch.long, device=self.device)  # next position of each row
        self.column = torch.zeros((), dtype=torch.long, device=self.device)  # next cache column, shared by the rows
        self.key_columns = torch.arange(length, device=self.device)
        self.columns_now = self.key_columns[:1]  # the columns the running forward writes (`ColumnCache.update`)
        # On a CPU attention reads only the columns written so far: no key past the forward's last
        # column is ever visible, a CPU step is compute-bound (the whole length would cost in
        # proportion), reading a CPU tensor costs nothing and no graph is captured. On a GPU every
        # step keeps the whole length: one shape, one captured graph. (Default: trim on a CPU.)
        self.trim = (self.device.type == "cpu" and TRIM_ON_CPU) if trim is None else trim
        self.filled: int | None = None  # the columns attention reads in the running forward (None: all)
        self.batch, self.length = batch, length
        self.cache = ColumnCache(self)
        self.cache_keyword = cache_keyword(decoder)
        self.takes_cache_position = "cache_position" in inspect.signature(decoder.forward).parameters
        # One mask per attention layout. A config that lists layer types takes a dict keyed by them;
        # one without applies its sliding window (if any) to every layer and takes a single mask.
        self.layer_types = getattr(config, "layer_types", None)
        window = getattr(config, "sliding_window", None)
        self.sliding_window = window if window is not None and getattr(config, "use_sliding_window", True) else None
        if self.layer_types is not None and "sliding_attention" in self.layer_types and window is None:
            raise PipelineError(f"static decoder: model type '{config.model_type}' has sliding layers but no sliding_window")
        self.logit_softcap = getattr(config, "final_logit_softcapping", None)
        self.mask_kind = MASK_KINDS[getattr(config, "_attn_implementation", None) or "eager"]
        # Grouped query heads folded into equal heads (`folded_attention`, the engine's attention on
        # CUDA): the masks then come folded, built once per forward rather than in every layer.
        groups = heads // config.num_key_value_heads
        fold = self.device.type == "cuda" if fold_heads is None else fold_heads
        self.fold_groups = groups if fold and groups > 1 and config._attn_implementation == STATIC_SDPA else 1
        # The layers whose outputs the drafter reads (`target.load.LayerTap`'s ids: the output of
        # layer i, the last one after the final norm): transformers' own hidden-state outputs,
        # entry i + 1 for layer i and the final-norm state last, which its hooks record inside a
        # compiled or captured step as well.
        self.tap_layers = tuple(tap_layers)
        self.features: torch.Tensor | None = None  # [B, T, len(tap_layers) * H] of the last forward

    def _masks(self, positions, visible):
        """The attention mask(s) transformers' forward takes: [B, 1, T, length], True (or 0.0) where
        a query sees a key."""
        full = visible[:, None]
        sliding = None
        if self.sliding_window is not None:
            near = positions[:, :, None] - self.key_positions[:, None, : visible.shape[-1]] < self.sliding_window
            sliding = (visible & near)[:, None]
        if self.mask_kind == "additive":  # eager attention adds the mask to its scores
            hidden = torch.finfo(self.dtype).min
            full = torch.where(full, 0.0, hidden).to(self.dtype)
            sliding = None if sliding is None else torch.where(sliding, 0.0, hidden).to(self.dtype)
        elif self.fold_groups > 1:  # query row r * T + t of a folded head is step t
            full = full.repeat(1, 1, self.fold_groups, 1)
            sliding = None if sliding is None else sliding.repeat(1, 1, self.fold_groups, 1)
        if self.layer_types is None:
            return sliding if sliding is not None else full
        masks = {"full_attention": full}
        if sliding is not None:
            masks["sliding_attention"] = sliding
        return masks

    def causal_visibility(self, columns: torch.Tensor) -> torch.Tensor:
        """[B, T, length]: a query at cache column c sees the valid keys up to c, and itself."""
        before = self.key_columns[None, :] <= columns[:, None]  # [T, length]
        return (self.valid[:, None, :] & before[None]) | (self.key_columns[None, None, :] == columns[None, :, None])

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's next-token logits of final-norm hidden states (its final soft-cap, if any)."""
        logits = self.model.lm_head(hidden).to(self.device)  # the head may run elsewhere on a split target
        if self.logit_softcap is not None:
            logits = torch.tanh(logits / self.logit_softcap) * self.logit_softcap
        return logits

    def forward(self, input_ids, positions, columns, visible) -> torch.Tensor:
        """Final-norm hidden states [B, T, H] of tokens [B, T] at `positions` [B, T], written at
        cache `columns` [T], each query seeing the keys `visible` [B, T, length] marks; the tap
        layers' outputs land in `self.features`."""
        self.columns_now = columns
        if self.layer_devices is not None:
            self.columns_on = {device: columns.to(device) for device in set(self.layer_devices)}
        self.key_positions.index_copy_(1, columns, positions)
        if self.trim:
            self.filled = int(columns.max()) + 1
            visible = visible[..., : self.filled]
        keywords = {self.cache_keyword: self.cache}
        if self.takes_cache_position:
            keywords["cache_position"] = columns
        out = self.decoder(input_ids=input_ids, position_ids=positions, attention_mask=self._masks(positions, visible),
                           use_cache=True, output_hidden_states=bool(self.tap_layers), **keywords)
        if self.tap_layers:
            self.features = torch.cat([out.hidden_states[i + 1].to(self.device) for i in self.tap_layers], dim=-1)
        return out.last_hidden_state.to(self.device)

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Left-padded prompts [B, W] with their real-token mask [B, W] -> the next-token logits [B, V]."""
        width = input_ids.shape[1]
        self.valid.zero_()
        self.valid[:, :width] = valid
        positions = (valid.long().cumsum(-1) - 1).clamp(min=0)
        columns = self.key_columns[:width]
        hidden = self.forward(input_ids, positions, columns, self.causal_visibility(columns))
        self.positions.copy_(valid.sum(-1))
        self.column.fill_(width)
        return self.logits(hidden[:, -1])

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Only these batch rows from now on (a smaller batch: new tensors, so not under a graph)."""
        if self.layer_devices is None:
            self.keys, self.values = self.keys[:, rows], self.values[:, rows]
        else:
            self.keys = [keys[rows.to(keys.device)] for keys in self.keys]
            self.values = [values[rows.to(values.device)] for values in self.values]
        self.valid, self.positions, self.key_positions = self.valid[rows], self.positions[rows], self.key_positions[rows]
        self.batch = rows.shape[0]

    def move_columns(self, into: torch.Tensor, source: torch.Tensor) -> None:
        """Copy the keys, values and key positions at cache columns `source` to `into` (a tree's
        accepted path moved into place)."""
        if self.layer_devices is None:
            for cache in (self.keys, self.values):
                cache.index_copy_(3, into, cache.index_select(3, source))
        else:
            for cache in (*self.keys, *self.values):
                cache.index_copy_(2, into.to(cache.device), cache.index_select(2, source.to(cache.device)))
        self.key_positions.index_copy_(1, into, self.key_positions.index_select(1, source))

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """One token per row [B] at the next column -> next-token logits [B, V]. Every tensor it
        touches has a fixed shape and address (what a CUDA graph replays)."""
        with torch.no_grad():  # not inference_mode: its tensors cannot enter a compiled graph
            columns = self.column.view(1)
            self.valid.index_fill_(1, columns, True)
            hidden = self.forward(tokens[:, None], self.positions[:, None], columns, self.causal_visibility(columns))
            self.positions.add_(1)
            self.column.add_(1)
            return self.logits(hidden[:, -1])
