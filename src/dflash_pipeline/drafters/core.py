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

The drafter owns no embedding and no LM head: `target.load.TargetHead` holds the target's two frozen
tensors, read straight from its weight files. Training drafts every anchor block of a packed
batch of sequences in one forward (`forward_blocks`, with the DFlash mask of `dflash_mask`, its
sliding window included); decoding keeps the context's keys/values in a static cache
(`decoding.static_speculation.StaticDraftCache`) and drafts one block at a time over it.

This module is the model: `DFlashDrafter` (the layers stacked, its draft vocabulary, `fc` and its
feature scale) and `draft_logits`. Its parts live beside it: `config` (sizes and a member's typed
options), `layers` (norm, RoPE, attention, MLP, decoder layer), `attention` (the backend: dtype,
flex attention, block masks), `token_columns` (token ids <-> head columns), `flops` (cost).
"""

import torch
import torch.nn.functional as F
from torch import nn

from dflash_pipeline.drafters.attention import to_block_mask
from dflash_pipeline.drafters.config import DrafterConfig
from dflash_pipeline.drafters.layers import DecoderLayer, RMSNorm, rope_cos_sin
from dflash_pipeline.drafters.token_columns import TokenColumns


class ArchitectureModule(nn.Module):
    """A module an architecture adds to the core: it sets its own first weights in
    `reset_parameters` (after the generic init of the Linear layers inside it)."""

    def reset_parameters(self) -> None:
        raise NotImplementedError


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


