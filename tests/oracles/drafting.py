"""The drafter's host-side drafting: the references the engine's tensor-level drafting is tested against.

    DraftCache / draft_hidden / draft_block   the context keys/values of one sequence, grown by
                                              concatenation, and one block drafted over them
    select_block                              DFlash2's selector walk of one block over that cache
    chain_proposer / tree_proposer            `propose(cache, anchor) -> Proposal` of the host loop
                                              (`oracles.decoding`): a chain from the member's one
                                              drafting hook (`Architecture.draft_chain`), a DDTree
                                              from the heap builder (`oracles.trees`)
    verified_prefix                           a proposer cut to its first k tokens

These once lived in the package beside `decoding.static_speculation`; they stay here, obvious by
inspection, so that the static step and the batched scorer can be checked against them.
"""

from dataclasses import dataclass
from typing import Any

import torch

from dflash_pipeline.drafters.core import DFlashDrafter, draft_logits
from dflash_pipeline.drafters.dflash2 import SelectedPath, select_paths
from dflash_pipeline.speculation.sampling import Sampling
from dflash_pipeline.speculation.trees import ranked_candidates
from oracles.trees import build_draft_tree


@dataclass
class Proposal:
    """What a drafter proposes for one speculative step: a chain of tokens (with, for the "ratio"
    rule at T > 0, the drafter's distribution q [k, V] of each drafted slot), or a draft tree."""

    tokens: list[int]
    q: torch.Tensor | None = None
    tree: Any = None  # an `oracles.trees.DraftTree` in tree decoding (then `tokens` are its nodes')


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
    known yet). `head` is the target's frozen embedding and LM head (`target.load.TargetHead`)."""
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



@torch.no_grad()
def draft_block(drafter: DFlashDrafter, head, cache: DraftCache, anchor_token: int) -> torch.Tensor:
    """Logits [B-1, V] for the tokens after `anchor_token`, which sits at position cache.length.

    V is the drafter's draft vocabulary (`drafter.vocab_tokens` maps columns to token ids), the
    whole vocabulary unless it has one.

    `head` is the target's frozen embedding and LM head (`target.load.TargetHead`).
    The context is every position < cache.length (the anchor's own features are not known yet).
    """
    return draft_logits(drafter, head, draft_hidden(drafter, head, cache, anchor_token))



@torch.no_grad()
def select_block(drafter: DFlashDrafter, head, cache: DraftCache, anchor_token: int, *, temperature: float = 0.0,
                 generator: torch.Generator | None = None) -> SelectedPath:
    """One block after `anchor_token` (at position cache.length): the selector's path through each
    slot's top-K (`select_paths`), with leading dimension 1."""
    hidden = draft_hidden(drafter, head, cache, anchor_token)
    logits = draft_logits(drafter, head, hidden)
    anchors = torch.tensor([anchor_token], device=hidden.device)
    return select_paths(drafter.candidate_selector, hidden[None], logits[None], anchors, to_token_ids=drafter.vocab_tokens,
                        temperature=temperature, generator=generator)




def chain_proposer(drafter: DFlashDrafter, head, sampling: Sampling | None = None, generator: torch.Generator | None = None):
    """`propose(cache, anchor) -> Proposal` of the B-1 tokens after the anchor, through the
    member's own drafting hook (`Architecture.draft_chain`) over the host cache; sampled chains
    draw with uniforms from `generator` (the drafter's own stream)."""
    member = drafter.architecture

    def propose(cache: DraftCache, anchor: int) -> Proposal:
        hidden = draft_hidden(drafter, head, cache, anchor)
        uniforms = None
        if sampling is not None and sampling.rule == "ratio":
            uniforms = torch.rand(hidden.shape[0], generator=generator).to(hidden.device)
        tokens, q = member.draft_chain(drafter, head, hidden, torch.tensor([anchor], device=hidden.device), sampling, uniforms)
        return Proposal(tokens.tolist(), None if q is None else q.float().cpu())

    return propose


def drafter_proposer(drafter: DFlashDrafter, head, sampling: Sampling | None = None):
    """`chain_proposer` with the drafter's own random stream (the sampling seed's offset 1)."""
    return chain_proposer(drafter, head, sampling, sampling.generator(offset=1) if sampling else None)


def tree_proposer(drafter: DFlashDrafter, head, budget: int):
    """`propose(cache, anchor) -> Proposal` holding the DDTree of the `budget` most probable
    drafted prefixes of the block (the heap builder over `ranked_candidates`)."""

    def propose(cache: DraftCache, anchor: int) -> Proposal:
        logprobs, columns = ranked_candidates(draft_block(drafter, head, cache, anchor), budget)
        tree = build_draft_tree(logprobs.double().cpu().tolist(), drafter.vocab_tokens(columns).cpu().tolist(), budget)
        return Proposal(tree.tokens, tree=tree)

    return propose


def verified_prefix(propose, tokens: int):
    """`propose` cut to its first `tokens` drafted tokens: the target then verifies tokens + 1 positions per step."""

    def shorter(cache: DraftCache, anchor: int):
        proposal = propose(cache, anchor)
        return Proposal(proposal.tokens[:tokens], None if proposal.q is None else proposal.q[:tokens])

    return shorter
