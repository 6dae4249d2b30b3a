"""The target's decode step over a static KV cache: one shape for every step, nothing read back.

Transformers' own forward grows a `DynamicCache` by concatenation (copying the whole cache every
step), rebuilds the attention mask every step, checks the mask on the host (a device read per
forward) and gives every decode step a new key length, so cuDNN attention plans anew each time: on
an H200 the step was 54-72 ms of host work for ~2 ms of GPU work. This step keeps the keys and
values of a fixed batch in preallocated tensors [layers, batch, kv heads, length, head dim],
writes each step's column in place at a device-side column index, and attends over the whole
length under a validity mask, so every step has the same shapes and the same kernels: it can be
captured once as a CUDA graph and replayed (`GraphedStep`).

The layers' own modules compute everything but attention (norms, projections, rotary embedding,
MLP, head), so the arithmetic is transformers' except for how the keys are masked. Targets whose
layers are not Llama's (`supports`) keep transformers' forward.

Left padding: row r's prompt sits right-aligned in columns [0, W); a padding column is never
visible to another query, but sees itself, so no query row is empty (an empty row is NaN, and a
NaN key or value poisons every row that multiplies it by a zero weight).
"""

import torch
import torch.nn.functional as F

# Model types whose decoder layers are (RMSNorm, attention with rotate-half RoPE, RMSNorm, MLP),
# transformers' Llama layout (SmolLM2 is one); others run transformers' own forward.
SUPPORTED_MODEL_TYPES = ("llama",)


def supports(model) -> bool:
    """Whether `StaticDecoder` can run this target (else transformers' forward serves it)."""
    config = getattr(model, "config", None)
    if config is None or not callable(getattr(model, "get_decoder", None)):  # not a transformers model (a test's stand-in)
        return False
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return (config.model_type in SUPPORTED_MODEL_TYPES and rope.get("rope_type", "default") == "default"
            and not getattr(config, "attention_bias", False) and getattr(config, "sliding_window", None) is None)


class StaticDecoder:
    """A fixed batch of sequences decoded over a preallocated cache of `length` columns."""

    def __init__(self, model, *, batch: int, length: int, tap_layers: tuple[int, ...] = ()):
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        self.apply_rope = apply_rotary_pos_emb
        decoder = model.get_decoder()
        config = model.config
        self.model, self.decoder = model, decoder
        parameter = next(model.parameters())
        self.device, self.dtype = parameter.device, parameter.dtype
        heads = config.num_attention_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        shape = (len(decoder.layers), batch, config.num_key_value_heads, length, self.head_dim)
        self.keys = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.values = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.valid = torch.zeros(batch, length, dtype=torch.bool, device=self.device)  # keys that hold a real token
        self.positions = torch.zeros(batch, dtype=torch.long, device=self.device)  # next position of each row
        self.column = torch.zeros((), dtype=torch.long, device=self.device)  # next cache column, shared by the rows
        self.key_columns = torch.arange(length, device=self.device)
        self.batch, self.length = batch, length
        # The layers whose outputs the drafter reads (`target.load.LayerTap`'s ids: the output of
        # layer i, the last one after the final norm). This forward calls the layers' submodules,
        # not the layers, so the tap's hooks never fire: each forward records them itself.
        self.tap_layers = tuple(tap_layers)
        self.features: torch.Tensor | None = None  # [B, T, len(tap_layers) * H] of the last forward

    def _attention(self, index: int, attention, hidden, cos, sin, columns, visible):
        """Self-attention of `hidden` [B, T, H] written at cache `columns` [T], reading the whole
        cache under `visible` [B, T, length]."""
        batch, steps = hidden.shape[:2]
        shape = (batch, steps, -1, self.head_dim)
        query = attention.q_proj(hidden).view(shape).transpose(1, 2)
        key = attention.k_proj(hidden).view(shape).transpose(1, 2)
        value = attention.v_proj(hidden).view(shape).transpose(1, 2)
        query, key = self.apply_rope(query, key, cos, sin)
        self.keys[index].index_copy_(2, columns, key)
        self.values[index].index_copy_(2, columns, value)
        out = F.scaled_dot_product_attention(query, self.keys[index], self.values[index], attn_mask=visible[:, None],
                                             scale=attention.scaling, enable_gqa=True)
        return attention.o_proj(out.transpose(1, 2).reshape(batch, steps, -1))

    def causal_visibility(self, columns: torch.Tensor) -> torch.Tensor:
        """[B, T, length]: a query at cache column c sees the valid keys up to c, and itself."""
        before = self.key_columns[None, :] <= columns[:, None]  # [T, length]
        return (self.valid[:, None, :] & before[None]) | (self.key_columns[None, None, :] == columns[None, :, None])

    def forward(self, input_ids, positions, columns, visible) -> torch.Tensor:
        """Final-norm hidden states [B, T, H] of tokens [B, T] at `positions` [B, T], written at
        cache `columns` [T], each query seeing the keys `visible` [B, T, length] marks; the tap
        layers' outputs land in `self.features`."""
        hidden = self.decoder.embed_tokens(input_ids)
        cos, sin = self.decoder.rotary_emb(hidden, positions)
        last = len(self.decoder.layers) - 1
        recorded = {}
        for index, layer in enumerate(self.decoder.layers):
            hidden = hidden + self._attention(index, layer.self_attn, layer.input_layernorm(hidden), cos, sin, columns, visible)
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
            if index in self.tap_layers and index != last:
                recorded[index] = hidden
        hidden = self.decoder.norm(hidden)
        if self.tap_layers:
            recorded[last] = hidden
            self.features = torch.cat([recorded[i] for i in self.tap_layers], dim=-1)
        return hidden

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
        return self.model.lm_head(hidden[:, -1])

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Only these batch rows from now on (a smaller batch: new tensors, so not under a graph)."""
        self.keys, self.values = self.keys[:, rows], self.values[:, rows]
        self.valid, self.positions = self.valid[rows], self.positions[rows]
        self.batch = rows.shape[0]

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """One token per row [B] at the next column -> next-token logits [B, V]. Every tensor it
        touches has a fixed shape and address (what a CUDA graph replays)."""
        with torch.no_grad():  # not inference_mode: its tensors cannot enter a compiled graph
            columns = self.column.view(1)
            self.valid.index_fill_(1, columns, True)
            hidden = self.forward(tokens[:, None], self.positions[:, None], columns, self.causal_visibility(columns))
            self.positions.add_(1)
            self.column.add_(1)
            return self.model.lm_head(hidden[:, -1])


class GraphedStep:
    """`StaticDecoder.step` captured once as a CUDA graph and replayed: one launch per decode step
    instead of ~1,000 (the step's tensors never move, its column and positions live on the device)."""

    def __init__(self, decoder: StaticDecoder):
        self.decoder = decoder
        self.tokens = torch.zeros(decoder.batch, dtype=torch.long, device=decoder.device)
        state = (decoder.valid.clone(), decoder.positions.clone(), decoder.column.clone())
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up outside the graph: lazy initialisation, kernel choice
            for _ in range(2):
                decoder.step(self.tokens)
        torch.cuda.current_stream().wait_stream(stream)
        self._restore(state)  # the warm-up wrote columns the real steps will overwrite; undo its bookkeeping
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = decoder.step(self.tokens)
        self._restore(state)

    def _restore(self, state) -> None:
        valid, positions, column = state
        self.decoder.valid.copy_(valid)
        self.decoder.positions.copy_(positions)
        self.decoder.column.copy_(column)

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        self.tokens.copy_(tokens)
        self.graph.replay()
        return self.logits
