"""DFlash2, the family member that adds a block-local convolution and a candidate selector to DFlash.

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

The member (`DFlash2`) owns the options that size both (`train.options.dflash2`), the selector's
loss term (`selector_loss`, beside the drafted slots' cross-entropy), its walk as its drafting
hook (`draft_chain`), the scores of what the selector buys over each slot's own argmax (τ_argmax, τ_oracle,
the selector's gain, top-K recall) and its serving names (`DFlash2DraftModel`).
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dflash_pipeline.drafters import family
from dflash_pipeline.drafters.architecture import Architecture, correct_argmax
from dflash_pipeline.drafters.config import DrafterConfig, DrafterOptions
from dflash_pipeline.drafters.core import ArchitectureModule, draft_logits
from dflash_pipeline.foundation.errors import PipelineError
from dflash_pipeline.foundation.stats import acceptance_length, mean_ci95_over_prompts, paired_difference
from dflash_pipeline.speculation.sampling import draw_with_uniforms


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


class GroupedDynamicCausalConv(ArchitectureModule):
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


class CandidateSelector(ArchitectureModule):
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
             temperature: float = 0.0, generator: torch.Generator | None = None, uniforms: torch.Tensor | None = None):
        """The path through the candidates, one slot after another, from each block's anchor token.

        hidden [blocks, n, H], unary / candidates [blocks, n, K], anchors [blocks] (token ids).
        Returns (tokens [blocks, n], q [blocks, n, K] or None): at temperature 0 the best candidate
        of each slot given the path so far; above it a draw from softmax(score / T) (with
        `generator`, or by inverting the CDF at `uniforms` [blocks, n] where given), and q, those
        probabilities, for the verification's ratio test.
        """
        predecessor, path, q_rows = anchors, [], []
        for slot in range(hidden.shape[1]):
            scores = self.pair_scores(hidden[:, slot], unary[:, slot], candidates[:, slot], predecessor)
            if temperature > 0:
                q = torch.softmax(scores / temperature, dim=-1)
                choice = (torch.multinomial(q, 1, generator=generator)[:, 0] if uniforms is None
                          else draw_with_uniforms(q, uniforms[:, slot]))
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
                 to_token_ids=None, temperature: float = 0.0, generator: torch.Generator | None = None,
                 uniforms: torch.Tensor | None = None) -> SelectedPath:
    """The selector's drafts from drafted hidden states [blocks, n, H], their logits [blocks, n, V]
    and the blocks' anchor token ids [blocks]: a walk through each slot's top-K, argmax at T = 0,
    sampled (with q) at T > 0."""
    unary, candidates = slot_candidates(logits, selector.top_k, to_token_ids)
    tokens, q = selector.walk(hidden, unary, candidates, anchors.to(candidates.device), temperature=temperature,
                              generator=generator, uniforms=uniforms)
    return SelectedPath(tokens=tokens, candidates=candidates, unary=unary, q=q)


def selector_loss(selector: CandidateSelector, hidden: torch.Tensor, head_rows: torch.Tensor, columns: torch.Tensor,
                  labels: torch.Tensor, predecessors: torch.Tensor, weights: torch.Tensor, *, token_ids: torch.Tensor | None = None):
    """sum(w * CE) of the answer among each slot's candidates, and whether it was among them.

    hidden [N, H] drafted slots; head_rows [V', H] the head rows the columns index; columns [N, K]
    each slot's top-K columns, best first; labels [N] the answer's column; predecessors [N] the
    token id before the answer (the anchor for slot 1); weights [N]; token_ids [V'] column ->
    token id (None: columns are token ids). Returns (total, covered [N], hits [N]): covered =
    the answer was in the top-K as drafted, hits = the selector ranks it first (teacher-forced).
    """
    covered = (columns == labels[:, None]).any(dim=1)
    # The answer replaces the weakest candidate where it is missing (a select, not a boolean index:
    # no read-back of how many rows miss it).
    columns = torch.cat([columns[:, :-1], torch.where(covered, columns[:, -1], labels)[:, None]], dim=1)
    target = (columns == labels[:, None]).int().argmax(dim=1)
    rows = head_rows[columns]  # [N, K, H]; differentiable through hidden only (the head is frozen)
    unary = torch.einsum("nh,nkh->nk", hidden.to(rows.dtype), rows).float()
    candidates = columns if token_ids is None else token_ids[columns]
    scores = selector.pair_scores(hidden, unary, candidates, predecessors)
    cross_entropy = torch.logsumexp(scores, dim=1) - scores.gather(1, target[:, None])[:, 0]
    return (cross_entropy * weights).sum(), covered, scores.argmax(dim=1) == target


# ----------------------------------------------------------------------------- the member


@dataclass(frozen=True)
class DFlash2Options(DrafterOptions):
    conv_kernel_size: int = 2  # taps of the block-local convolution (2, as released: a slot and its predecessor)
    conv_group_size: int = 16  # channels sharing one dynamic kernel; must divide hidden_size
    selector_rank: int = 64  # codebook width (released: 256, for a 27B target; 2 x vocab x rank weights)
    selector_top_k: int = 16  # candidates per slot the selector chooses among


@dataclass(frozen=True)
class DFlash2LossOptions:
    selector_weight: float = 1.0  # weight of the selector's K-way cross-entropy beside the slots' loss


SERVING_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


class DFlash2(Architecture):
    name = "dflash2"
    title = "DFlash2"
    public_class = "DFlash2DraftModel"
    options_type = DFlash2Options
    loss_options_type = DFlash2LossOptions
    # Published spellings of the codebooks that name the same tensors as ours.
    weight_aliases = {f"candidate_selector.{name}.weight": f"candidate_selector.{name}"
                      for name in ("predecessor_codebook", "successor_codebook")}

    def option_checks(self, options: DFlash2Options, loss_options: DFlash2LossOptions) -> list[tuple[str, bool, str]]:
        return [("conv_kernel_size", options.conv_kernel_size >= 1, "must be >= 1"),
                ("conv_group_size", options.conv_group_size >= 1, "must be >= 1"),
                ("selector_rank", options.selector_rank >= 1, "must be >= 1"),
                ("selector_top_k", options.selector_top_k >= 2, "must be >= 2"),
                ("selector_weight", loss_options.selector_weight >= 0.0, "must be >= 0")]

    def check(self, config: DrafterConfig) -> tuple[str, str] | None:
        options = config.options
        sizes = [("conv_kernel_size", options.conv_kernel_size >= 1, "must be >= 1"),
                 ("conv_group_size", options.conv_group_size >= 1 and config.hidden_size % options.conv_group_size == 0,
                  f"must divide hidden_size {config.hidden_size}"),
                 ("selector_rank", options.selector_rank >= 1, "must be >= 1"),
                 ("selector_top_k", 1 <= options.selector_top_k <= config.vocab_size, f"must be in 1..vocab_size ({config.vocab_size})")]
        return next(((key, why) for key, ok, why in sizes if not ok), None)

    # layers
    def sublayer_wrappers(self, config: DrafterConfig) -> tuple:
        options = config.options
        return tuple(GroupedDynamicCausalConv(config.hidden_size, options.conv_kernel_size, options.conv_group_size) for _ in range(2))

    def extra_modules(self, config: DrafterConfig) -> dict:
        options = config.options
        return {"candidate_selector": CandidateSelector(config.hidden_size, config.vocab_size, options.selector_rank,
                                                        options.selector_top_k)}

    # drafting
    def draft_chain(self, drafter, head, hidden, anchor, sampling=None, uniforms=None):
        """The selector's walk through each slot's top-K (`select_paths`): greedy at T = 0 and under
        "match"; under "ratio" sampled at the sampling temperature, with q each slot's draw
        probabilities over its K candidates (zero elsewhere). A slot's q depends on the token drawn
        before it, which the ratio test allows (as for any autoregressive drafter)."""
        logits = draft_logits(drafter, head, hidden)
        sampled = sampling is not None and sampling.rule == "ratio"
        path = select_paths(drafter.candidate_selector, hidden[None], logits[None], anchor.view(1), to_token_ids=drafter.vocab_tokens,
                            temperature=sampling.temperature if sampled else 0.0, uniforms=uniforms[None] if sampled else None)
        if not sampled:
            return path.tokens[0], None
        q = torch.zeros(path.q.shape[1], head.lm_head_weight.shape[0], device=hidden.device)
        return path.tokens[0], q.scatter_(1, path.candidates[0], path.q[0].float())

    # Trees: the shared builder over the head's per-slot logits (the selector walks one path, not a tree).

    # training
    def loss_top_k(self, config: DrafterConfig, loss_options: DFlash2LossOptions) -> int:
        return config.options.selector_top_k if loss_options.selector_weight > 0 else 0

    def extra_loss(self, drafter, *, hidden, head_rows, top_columns, labels, predecessors, weights, token_ids, loss_options):
        if loss_options.selector_weight <= 0:
            return None, {}
        term, covered, hits = selector_loss(drafter.candidate_selector, hidden, head_rows, top_columns, labels, predecessors, weights,
                                            token_ids=token_ids)
        counted = weights > 0  # slots of zero weight (past the end, padding) are not slots
        stats = {"selector_loss": term.detach(), "selector_covered": (covered & counted).sum(), "selector_hits": (hits & counted).sum(),
                 "selector_slots": counted.sum()}
        return loss_options.selector_weight * term, stats

    def curve_fields(self, stats: dict) -> dict:
        """Teacher-forced: how often the answer is among the drafted top-K, and ranked first by the selector."""
        if not stats:
            return {}
        slots = max(int(stats["selector_slots"]), 1)
        return {"selector_coverage": round(int(stats["selector_covered"]) / slots, 4),
                "selector_acc": round(int(stats["selector_hits"]) / slots, 4)}

    # scoring
    def score_blocks(self, drafter, *, hidden, logits, anchors, labels, valid):
        """The selector walk's slots are what decoding commits; each slot's own argmax and whether
        the label is among its top-K say what the selector had to pick from."""
        path = select_paths(drafter.candidate_selector, hidden, logits, anchors, to_token_ids=drafter.vocab_tokens)
        labels, valid = labels.to(path.tokens.device), valid.to(path.tokens.device)
        walked = ((path.tokens == labels) & valid).cpu().numpy()
        in_top_k = ((path.candidates == labels[..., None]).any(-1) & valid).cpu().numpy()
        return walked, {"argmax_correct": correct_argmax(drafter, logits, labels, valid), "in_top_k": in_top_k}

    def summarize_extras(self, scores) -> dict[str, float]:
        """τ of each slot's own argmax (DFlash's rule) and of an oracle that picks the label whenever
        it is among the K, the selector's gain over the argmax paired by prompt, and top-K recall per slot."""
        extras = scores.extras
        summary = {}
        argmax_tau = acceptance_length(extras["argmax_correct"])
        for key, values in (("tau_argmax", argmax_tau), ("tau_oracle", acceptance_length(extras["in_top_k"]))):
            mean, half = mean_ci95_over_prompts(values, scores.sequence)
            summary[key], summary[f"{key}_ci95"] = round(mean, 4), round(half, 4)
        mean, half, _ = paired_difference(scores.tau, scores.sequence, argmax_tau, scores.sequence)
        summary["tau_selector_gain"], summary["tau_selector_gain_ci95"] = round(mean, 4), round(half, 4)
        in_top_k = extras["in_top_k"]
        for k in range(in_top_k.shape[1]):
            exists = scores.valid[:, k]
            summary[f"slot{k + 1}_topk_recall"] = round(float(in_top_k[exists, k].mean()), 4) if exists.any() else float("nan")
        return summary

    # serving
    def public_weight_names(self, num_layers: int) -> tuple[list[str], list[str]]:
        per_layer = [f"{side}_conv.{name}" for side in ("attention", "mlp") for name in ("base_kernel", "kernel_projection.weight")]
        return per_layer, [f"candidate_selector.{name}" for name in ("predecessor_codebook", "successor_codebook", "hidden_projection.weight")]

    def serving_fields(self, config: DrafterConfig) -> dict:
        return {key: getattr(config.options, key) for key in SERVING_KEYS}

    def options_from_serving(self, dflash_config: dict, config: dict, *, where) -> dict:
        options = {}
        for key in SERVING_KEYS:  # dflash_config first, then the top level, as z-lab reads them
            value = dflash_config.get(key, config.get(key))
            if value is None:
                raise PipelineError(f"{where}: no dflash_config.{key} (a {self.public_class} needs it)")
            options[key] = int(value)
        return options


family.register(DFlash2())
