"""The host decoding loops: the references the static engine is tested against token for token.

    host_greedy_decode        plain decoding over transformers' forward and a DynamicCache, one
                              token and one read back per step
    host_speculative_decode   speculative decoding with the proposal, acceptance and both caches
                              handled step by step in Python (any `propose`, any target that
                              answers like a transformers causal LM: a scripted stand-in too)
    verify_tree / keep_path   a DDTree verified in one forward under the tree mask, the cache
                              then kept to exactly the accepted path
    verify_chain_step         a chain verified in one forward (greedy, or `sampling.verify_chain`)

They left the package when `decoding.static_speculation` became its one engine (issue #36); the
package never runs them.
"""

import time

import torch

from dflash_pipeline.decoding.loop import DecodeRun
from dflash_pipeline.decoding.static_decoder import cache_argument
from dflash_pipeline.decoding.static_speculation import stored_features as as_stored
from dflash_pipeline.drafters.core import DFlashDrafter
from dflash_pipeline.foundation.devices import autocast, synchronize
from dflash_pipeline.speculation.sampling import Sampling, draw, verify_chain
from oracles.drafting import DraftCache, Proposal
from oracles.trees import DraftTree, tree_attention_mask, tree_positions


def _crop(cache, length: int) -> None:
    """Keep the first `length` positions of a transformers KV cache."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


@torch.inference_mode()
def host_greedy_decode(model, prompt_ids: list[int], *, max_new_tokens: int, eos_ids: set[int], sampling: Sampling | None = None,
                       on_tokens=None) -> DecodeRun:
    """Plain decoding with transformers' forward and a DynamicCache, any target: one token and one
    read back per step."""
    from transformers import DynamicCache

    device = next(model.parameters()).device
    generator = sampling.generator() if sampling else None

    def next_token(logits) -> int:
        return int(logits.argmax()) if sampling is None else draw(sampling.probs(logits), generator)

    cache = DynamicCache(config=model.config)
    synchronize(device)
    started = time.perf_counter()
    out = model(input_ids=torch.tensor([prompt_ids], device=device), **cache_argument(model, cache), use_cache=True, logits_to_keep=1)
    token = next_token(out.logits[0, -1])
    synchronize(device)
    prefilled = time.perf_counter()
    tokens, position = [token], len(prompt_ids)
    if on_tokens:
        on_tokens([token])
    while token not in eos_ids and len(tokens) < max_new_tokens:
        out = model(input_ids=torch.tensor([[token]], device=device), position_ids=torch.tensor([[position]], device=device),
                    **cache_argument(model, cache), use_cache=True)
        token = next_token(out.logits[0, -1])
        tokens.append(token)
        position += 1
        if on_tokens:
            on_tokens([token])
    synchronize(device)
    return DecodeRun(tokens=tokens, seconds=time.perf_counter() - started, prefill_seconds=prefilled - started)


def keep_path(cache, start: int, path: list[int]) -> None:
    """After a tree verify forward: of the cache entries from `start` (node 0 onward), keep the
    accepted path's nodes, in order, and drop the rest (siblings, rejected branches)."""
    if path != list(range(len(path))):  # a prefix of the node order is already in place
        for layer in cache.layers:
            if getattr(layer, "is_sliding", False):
                raise ValueError("tree verification needs a full-attention KV cache (this target has sliding-window layers)")
            index = torch.tensor([start + node for node in path], device=layer.keys.device)
            layer.keys[..., start : start + len(path), :] = layer.keys[..., index, :]  # the gather copies first: overlap is safe
            layer.values[..., start : start + len(path), :] = layer.values[..., index, :]
    _crop(cache, start + len(path))


def verify_tree(model, cache, tree: DraftTree, anchor: int, position: int) -> tuple[list[int], int]:
    """Verify every node of `tree` in ONE target forward: input [anchor, nodes...], each node at
    position anchor + depth + 1, under `oracles.trees.tree_attention_mask` (a node sees the cache, the
    anchor and its ancestors only). Walks the target's argmax from the anchor down the tree and
    returns (accepted nodes, the target's bonus token). The cache (`position` entries before the
    call, the anchor at `position`) then holds exactly the prefix, the anchor and the accepted path.
    """
    parameter = next(model.parameters())
    out = model(input_ids=torch.tensor([[anchor] + tree.tokens], device=parameter.device),
                position_ids=torch.tensor([tree_positions(tree, position)], device=parameter.device),
                attention_mask=tree_attention_mask(tree, position, parameter.dtype, parameter.device), **cache_argument(model, cache), use_cache=True)
    choice = out.logits[0].argmax(-1).tolist()  # the target's token after the anchor (0) and after each node (1 + node)
    path, bonus = tree.walk(lambda node: choice[node + 1])
    keep_path(cache, position + 1, path)
    return path, bonus


@torch.inference_mode()
def host_speculative_decode(model, tap, drafter: DFlashDrafter, propose, prompt_ids: list[int], *, max_new_tokens: int, eos_ids: set[int],
                            feature_dtype: str = "bf16", bf16: bool | None = None, sampling: Sampling | None = None,
                            on_tokens=None) -> DecodeRun:
    """`speculative_decode`'s loop on the host: transformers' forward and DynamicCache, the
    proposal, acceptance and caches handled step by step in Python (any target, any `propose`)."""
    from transformers import DynamicCache

    device = next(model.parameters()).device
    cache, draft_cache = DynamicCache(config=model.config), DraftCache(drafter)
    synchronize(device)
    started = time.perf_counter()
    generator = sampling.generator() if sampling else None
    out = model(input_ids=torch.tensor([prompt_ids], device=device), **cache_argument(model, cache), use_cache=True, logits_to_keep=1)
    anchor = int(out.logits[0, -1].argmax()) if sampling is None else draw(sampling.probs(out.logits[0, -1]), generator)
    with autocast(device, bf16):
        draft_cache.extend(as_stored(tap.features()[0], feature_dtype).to(drafter.fc.weight.device))
    synchronize(device)
    run = DecodeRun(tokens=[anchor], seconds=0.0, prefill_seconds=time.perf_counter() - started)
    if on_tokens:
        on_tokens([anchor])
    position = len(prompt_ids)  # where the anchor sits
    finished = anchor in eos_ids or len(run.tokens) >= max_new_tokens
    while not finished:
        began = time.perf_counter()
        with autocast(device, bf16):
            proposal = propose(draft_cache, anchor)
        synchronize(device)
        drafted = time.perf_counter()
        if proposal.tree is not None:
            if sampling is not None:
                raise ValueError("tree verification is lossless at T = 0 only: sample with a chain")
            path, bonus = verify_tree(model, cache, proposal.tree, anchor, position)
            accepted_tokens, feature_rows = [proposal.tokens[node] for node in path], [0] + [1 + node for node in path]
        else:
            accepted, bonus = verify_chain_step(model, cache, proposal, anchor, position, sampling, generator)
            accepted_tokens, feature_rows = proposal.tokens[:accepted], list(range(accepted + 1))
        accepted = len(accepted_tokens)
        run.drafted += len(proposal.tokens)
        synchronize(device)
        verified = time.perf_counter()
        with autocast(device, bf16):
            features = tap.features()[0]
            rows = torch.tensor(feature_rows, device=features.device)
            draft_cache.extend(as_stored(features.index_select(0, rows), feature_dtype).to(drafter.fc.weight.device))
        synchronize(device)
        extended = time.perf_counter()
        committed = accepted_tokens + [bonus]
        kept = []
        for token in committed:
            kept.append(token)
            # An EOS accepted inside the block ends the answer even though the block goes on.
            if token in eos_ids or len(run.tokens) + len(kept) >= max_new_tokens:
                finished = True
                break
        run.tokens += kept
        if on_tokens:
            on_tokens(kept)
        run.steps.append(accepted + 1)
        position += accepted + 1
        anchor = committed[-1]
        run.verify_seconds += verified - drafted
        run.draft_seconds += (drafted - began) + (extended - verified)  # proposing + extending the context cache
    synchronize(device)
    run.seconds = time.perf_counter() - started
    return run


def verify_chain_step(model, cache, proposal: Proposal, anchor: int, position: int, sampling: Sampling | None,
                      generator) -> tuple[int, int]:
    """Verify a drafted chain in one target forward over [anchor, tokens...] (the anchor at
    `position`): the longest prefix the target's argmax agrees with at T = 0, or the lossless rule
    of `sampling` (`sampling.verify_chain`). Returns (accepted tokens, the target's bonus token);
    the cache then holds the prefix, the anchor and the accepted tokens."""
    tokens = proposal.tokens
    device = next(model.parameters()).device
    out = model(input_ids=torch.tensor([[anchor] + tokens], device=device),
                position_ids=torch.arange(position, position + len(tokens) + 1, device=device)[None], **cache_argument(model, cache), use_cache=True)
    if sampling is None:
        choice = out.logits[0].argmax(-1).tolist()  # the target's token after each verified position
        accepted = 0
        while accepted < len(tokens) and tokens[accepted] == choice[accepted]:
            accepted += 1
        bonus = choice[accepted]
    else:
        accepted, bonus = verify_chain(sampling.probs(out.logits[0]), tokens, proposal.q, rule=sampling.rule, generator=generator)
    _crop(cache, position + accepted + 1)
    return accepted, bonus
