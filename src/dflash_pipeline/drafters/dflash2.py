"""DFlash2's two additions to the DFlash drafter: a block-local convolution and a candidate selector.

References: z-lab/dflash (`DFlash2DraftModel`, the public checkpoint contract), SGLang and vLLM's
DFlash2 support, SpecForge's DFlash2 trainer (the selector loss). Our own code.

Grouped dynamic causal convolution (`GroupedDynamicCausalConv`), around every attention and MLP
sublayer of a drafter layer, over the positions of ONE block (taps never reach into another block
or into the context, so a block drafted alone and a block in a packed batch see the same values):

    out[t, c] = sum over taps o of (base[o, c] + dynamic[t, o, group(c)]) * x[t - o, c]
                (x[t - o] is zero for t - o < 0: the block boundary)

`base_kernel` [2, K, H] holds a static per-channel kernel for each side (0: before the sublayer,
1: after it); `kernel_projection` (H -> 2*K*groups) turns the sublayer's normed input into the
content-adaptive part of both, shared by the `group_size` channels of a group. It starts as the
identity (tap 0 is one, the rest and the projection zero), so an untrained DFlash2 layer computes
exactly the DFlash layer it wraps.

Candidate selector (`CandidateSelector`): each drafted slot keeps its top-K tokens by the head's
logits (the unary scores) and scores a candidate c after predecessor p as

    score(p -> c) = unary[c] + < predecessor_codebook[p] * hidden_projection(h_slot), successor_codebook[c] >

then walks from the anchor slot by slot: argmax at T = 0; at T > 0 a draw from softmax(score / T)
over the K, whose probabilities q go to the lossless verification. Codebooks are indexed by the
target's token ids (the full vocabulary), whatever vocabulary the drafter's head drafts over.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


def block_causal_conv(x: torch.Tensor, base: torch.Tensor, dynamic: torch.Tensor, group_size: int) -> torch.Tensor:
    """x [blocks, L, H], base [K, H], dynamic [blocks, L, K, groups] -> [blocks, L, H].

    Tap o multiplies x shifted o positions later within its block; positions before the block's
    first one contribute zero.
    """
    blocks, length, hidden = x.shape
    groups = hidden // group_size
    grouped = x.view(blocks, length, groups, group_size)
    out = torch.zeros_like(grouped)
    for tap in range(min(base.shape[0], length)):
        shifted = grouped if tap == 0 else F.pad(grouped[:, : length - tap], (0, 0, 0, 0, tap, 0))
        static = base[tap].to(x.dtype).view(groups, group_size)
        out = out + (static + dynamic[:, :, tap, :, None].to(x.dtype)) * shifted
    return out.view(blocks, length, hidden)


class GroupedDynamicCausalConv(nn.Module):
    """The convolution around one sublayer: `prepare` before it, `finish` after it."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int):
        super().__init__()
        if hidden_size % group_size:
            raise ValueError(f"conv_group_size {group_size} does not divide hidden_size {hidden_size}")
        self.kernel_size, self.group_size, self.groups = kernel_size, group_size, hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden_size))  # [side, tap, channel]
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.groups, bias=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The identity: tap 0 passes each channel through, every other tap and the projection are zero."""
        self.base_kernel.zero_()
        self.base_kernel[:, 0] = 1.0
        self.kernel_projection.weight.zero_()

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [blocks, L, H] (the sublayer's normed input) -> (x convolved, the after-side dynamic kernel)."""
        dynamic = self.kernel_projection(x).view(*x.shape[:-1], 2, self.kernel_size, self.groups)
        return block_causal_conv(x, self.base_kernel[0], dynamic[..., 0, :, :], self.group_size), dynamic[..., 1, :, :]

    def finish(self, y: torch.Tensor, dynamic: torch.Tensor) -> torch.Tensor:
        """y [blocks, L, H] (the sublayer's output) convolved with the kernel `prepare` returned."""
        return block_causal_conv(y, self.base_kernel[1], dynamic, self.group_size)


class CandidateSelector(nn.Module):
    """Reranks each slot's top-K candidates by how well they follow the previous slot's token."""

    def __init__(self, hidden_size: int, vocab_size: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        # Plain parameters, not nn.Embedding: their names are the public checkpoint's
        # (`candidate_selector.predecessor_codebook`, no `.weight`).
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Pair scores start at zero (successor codebook zero), so an untrained selector walks the
        per-slot argmax; the other two factors are random, so the successors' gradient is not."""
        nn.init.normal_(self.predecessor_codebook, std=1.0)
        self.successor_codebook.zero_()
        nn.init.normal_(self.hidden_projection.weight, std=0.02)

    def pair_scores(self, hidden: torch.Tensor, unary: torch.Tensor, candidates: torch.Tensor,
                    predecessors: torch.Tensor) -> torch.Tensor:
        """Scores [..., K] (float32) of the candidates [..., K] (token ids) of slots with hidden
        states [..., H], unary scores [..., K] and predecessor token ids [...]."""
        context = self.predecessor_codebook[predecessors] * self.hidden_projection(hidden)  # [..., r]
        pair = torch.einsum("...r,...kr->...k", context.float(), self.successor_codebook[candidates].float())
        return unary.float() + pair

    def walk(self, hidden: torch.Tensor, unary: torch.Tensor, candidates: torch.Tensor, anchors: torch.Tensor, *,
             temperature: float = 0.0, generator: torch.Generator | None = None):
        """The path through the candidates, one slot after another, from each block's anchor token.

        hidden [blocks, n, H], unary / candidates [blocks, n, K], anchors [blocks] (token ids).
        Returns (tokens [blocks, n], q [blocks, n, K] or None): at temperature 0 the best candidate
        of each slot given the path so far; above it a draw from softmax(score / T) (with
        `generator`), and q, those probabilities, for the verification's ratio test.
        """
        predecessor, path, q_rows = anchors, [], []
        for slot in range(hidden.shape[1]):
            scores = self.pair_scores(hidden[:, slot], unary[:, slot], candidates[:, slot], predecessor)
            if temperature > 0:
                q = torch.softmax(scores / temperature, dim=-1)
                choice = torch.multinomial(q, 1, generator=generator)[:, 0]
                q_rows.append(q)
            else:
                choice = scores.argmax(dim=-1)
            predecessor = candidates[:, slot].gather(-1, choice[:, None])[:, 0]
            path.append(predecessor)
        return torch.stack(path, dim=1), (torch.stack(q_rows, dim=1) if q_rows else None)


@dataclass
class SelectedPath:
    """DFlash2 drafts of one or more blocks (leading dimension: blocks)."""

    tokens: torch.Tensor  # [blocks, n] token ids of the walked path (n = B-1 drafted slots)
    candidates: torch.Tensor  # [blocks, n, K] each slot's top-K token ids, best unary score first
    unary: torch.Tensor  # [blocks, n, K] their logits
    q: torch.Tensor | None  # [blocks, n, K] draw probabilities over the candidates (T > 0), else None


def slot_candidates(logits: torch.Tensor, top_k: int, to_token_ids=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each slot's top-K by logit: (unary [..., K], token ids [..., K]), best first. K is `top_k`,
    or the number of logit columns where that is smaller; `to_token_ids` maps columns to token ids
    for a drafter that drafts over a subset of the vocabulary."""
    unary, columns = logits.topk(min(top_k, logits.shape[-1]), dim=-1)
    return unary, columns if to_token_ids is None else to_token_ids(columns)


@torch.no_grad()
def select_paths(selector: CandidateSelector, hidden: torch.Tensor, logits: torch.Tensor, anchors: torch.Tensor, *,
                 to_token_ids=None, temperature: float = 0.0, generator: torch.Generator | None = None) -> SelectedPath:
    """The selector's drafts from drafted hidden states [blocks, n, H], their logits [blocks, n, V]
    and the blocks' anchor token ids [blocks]: a walk through each slot's top-K, argmax at T = 0,
    sampled (with q) at T > 0."""
    unary, candidates = slot_candidates(logits, selector.top_k, to_token_ids)
    tokens, q = selector.walk(hidden, unary, candidates, anchors.to(candidates.device), temperature=temperature,
                              generator=generator)
    return SelectedPath(tokens=tokens, candidates=candidates, unary=unary, q=q)
