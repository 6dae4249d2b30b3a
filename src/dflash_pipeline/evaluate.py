"""Stage `evaluate`: score every checkpoint and any baseline drafter, fast and honestly.

Two measurements (definitions in the README and DFLASH.md):

1. Teacher-forced, on the cached val features, no target forward. All blocks of a sequence are
   drafted in ONE forward under the DFlash mask (the training forward), so thousands of blocks
   take seconds. Per block: tau = 1 + leading slots whose argmax equals the target-greedy token;
   per-slot acceptance (unconditional, and conditional on every earlier slot being accepted);
   DDTree-k streaks from the per-slot log-probs. Means carry a 95% confidence interval over
   prompts (blocks of one prompt are not independent), and are split by prompt category.
2. End-to-end speculative decoding at T = 0 with the real target: the output must equal plain
   greedy decoding token for token; tau per decoding step; tokens/s of speculative and plain
   decoding measured alternately in one process; the time split (prefill, target verify,
   drafter, overhead) and from it the break-even tau of this machine.

The best checkpoint is the one with the highest teacher-forced tau (not the lowest loss).
"""

import heapq
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from dflash_pipeline.errors import PipelineError
from dflash_pipeline.model import DFlashDrafter, DraftCache, DrafterConfig, TargetHead, draft_block, mean_ci95
from dflash_pipeline.train import build_batch, valid_anchors

# ----------------------------------------------------------------------------- drafters


@dataclass
class Candidate:
    """One drafter under evaluation: a checkpoint of this run or an external baseline."""

    name: str  # "step_000900" or the baseline folder's name
    kind: str  # "checkpoint" | "baseline"
    path: Path
    drafter: DFlashDrafter
    step: int | None = None


def check_drafter_contract(config: DrafterConfig, *, target, layer_ids: list[int] | None, source: str) -> None:
    """Refuse a drafter that cannot run on this target and these shards, naming the field."""
    expected = [("hidden_size", target.hidden_size, "target"), ("vocab_size", target.vocab_size, "target"),
                ("num_target_layers", target.num_layers, "target")]
    if layer_ids is not None:
        expected.append(("target_layer_ids", list(layer_ids), "shards"))
    for name, value, owner in expected:
        actual = getattr(config, name)
        actual = list(actual) if isinstance(actual, tuple) else actual
        if actual != value:
            raise PipelineError(f"{source}: drafter {name} is {actual!r}, but the {owner} has {value!r}")
    if config.block_size < 2:
        raise PipelineError(f"{source}: drafter block_size is {config.block_size}, it must be >= 2")
    if not 0 <= config.mask_token_id < config.vocab_size:
        raise PipelineError(f"{source}: drafter mask_token_id {config.mask_token_id} is outside the vocabulary (0..{config.vocab_size - 1})")


def select_checkpoints(folders: list[Path], which) -> list[Path]:
    """`which`: "final", "all" or a list of steps (each must exist)."""
    if not folders:
        raise PipelineError("evaluate: no checkpoints found; run the `train` stage first (dvc repro train)")
    if which == "final":
        return folders[-1:]
    if which == "all":
        return folders
    by_step = {int(folder.name.split("_")[1]): folder for folder in folders}
    missing = [step for step in which if step not in by_step]
    if missing:
        raise PipelineError(f"params.yaml: evaluate.checkpoints asks for step {missing[0]}, which has no checkpoint (have {sorted(by_step)})")
    return [by_step[step] for step in which]


# ----------------------------------------------------------------------------- per-block scoring


def acceptance_length(correct: np.ndarray) -> np.ndarray:
    """tau per block: 1 + the number of leading drafted slots that are correct. correct [n, B-1]."""
    return 1 + np.cumprod(correct.astype(np.int64), axis=1).sum(axis=1)


def ddtree_streak(logprobs, token_ids, reference: list[int], budget: int) -> int:
    """DDTree-k streak of one block.

    logprobs / token_ids [D][K]: each drafted depth's K most probable tokens, best first. The tree
    holds the `budget` most probable prefixes, grown best-first over the summed log-probs (each
    pop adds a node, then offers its next sibling and its first child). The streak is how many
    tree nodes the reference walk matches from the root: 0..min(budget, len(reference)).
    """
    depth, width = len(logprobs), len(logprobs[0]) if len(logprobs) else 0
    if budget <= 0 or depth == 0:
        return 0
    children: dict[int, dict[int, int]] = {}
    # heap entries: (-score, tie-break order, depth, rank, parent node, parent score)
    heap = [(-logprobs[0][0], 0, 0, 0, -1, 0.0)]
    pushed, nodes = 1, 0
    while heap and nodes < budget:
        negative, _, d, rank, parent, parent_score = heapq.heappop(heap)
        node = nodes
        children.setdefault(parent, {})[token_ids[d][rank]] = node
        nodes += 1
        if rank + 1 < width:
            heapq.heappush(heap, (-(parent_score + logprobs[d][rank + 1]), pushed, d, rank + 1, parent, parent_score))
            pushed += 1
        if d + 1 < depth:
            heapq.heappush(heap, (negative - logprobs[d + 1][0], pushed, d + 1, 0, node, -negative))
            pushed += 1
    streak, node = 0, -1
    for token in reference:
        node = children.get(node, {}).get(token)
        if node is None:
            break
        streak += 1
    return streak


@dataclass
class BlockScores:
    """Teacher-forced results of every evaluated block of one drafter."""

    sequence: np.ndarray  # [n] index of the val sequence
    anchor: np.ndarray  # [n] anchor position
    correct: np.ndarray  # [n, B-1] drafted argmax == target-greedy token (and the slot exists)
    valid: np.ndarray  # [n, B-1] the slot holds an answer token to compare with
    streaks: dict[int, np.ndarray] = field(default_factory=dict)  # budget -> [n]

    @property
    def tau(self) -> np.ndarray:
        return acceptance_length(self.correct)


def ddtree_streaks(logprobs: np.ndarray, token_ids: np.ndarray, reference: np.ndarray, reference_length: np.ndarray,
                   budgets: list[int]) -> dict[int, np.ndarray]:
    """`ddtree_streak` for many blocks at once, for every budget: {budget: streaks [n]}.

    logprobs [n, D, K] float64 and token_ids [n, D, K]: each depth's K best tokens, best first;
    reference [n, D]: the target's tokens, of which the first reference_length [n] count.
    The same best-first growth as `ddtree_streak`, run for all blocks in lockstep, ties broken
    the same way (by push order). Pops come in the same order whatever the budget, so one growth
    to the largest budget serves them all: the tree of budget k is the first k pops.
    """
    n, depth, width = logprobs.shape
    top = max([0, *budgets])
    result = {budget: np.zeros(n, dtype=np.int64) for budget in budgets}
    if n == 0 or top <= 0 or depth == 0:
        return result
    capacity = 2 * top + 1  # the root, then at most two pushes per pop
    rows = np.arange(n)
    alive = np.zeros((n, capacity), dtype=bool)
    score = np.full((n, capacity), -np.inf)
    parent_score = np.zeros((n, capacity))
    node_depth = np.zeros((n, capacity), dtype=np.int64)
    node_rank = np.zeros((n, capacity), dtype=np.int64)
    parent = np.full((n, capacity), -1, dtype=np.int64)
    alive[:, 0], score[:, 0] = True, logprobs[:, 0, 0]
    pushed = np.ones(n, dtype=np.int64)
    on_path = np.zeros((n, top), dtype=bool)  # pop t is a node of the reference walk

    def push(which, entry_score, entry_parent_score, entry_depth, entry_rank, entry_parent):
        chosen = rows[which]
        slot = pushed[chosen]
        alive[chosen, slot], score[chosen, slot], parent_score[chosen, slot] = True, entry_score[which], entry_parent_score[which]
        node_depth[chosen, slot], node_rank[chosen, slot], parent[chosen, slot] = entry_depth[which], entry_rank[which], entry_parent[which]
        pushed[chosen] += 1

    for step in range(top):
        popped = alive.any(axis=1)
        if not popped.any():
            break  # every tree is complete (a tiny vocabulary)
        masked = np.where(alive, score, -np.inf)
        best = masked.max(axis=1, keepdims=True)
        pick = np.argmax(alive & (masked == best), axis=1)  # slots are in push order: the first is the heap's pick
        d, r, p = node_depth[rows, pick], node_rank[rows, pick], parent[rows, pick]
        s, ps = score[rows, pick], parent_score[rows, pick]
        alive[rows, pick] &= ~popped
        parent_on_path = np.where(p < 0, True, on_path[rows, np.maximum(p, 0)])
        matches = token_ids[rows, d, r] == reference[rows, d]
        on_path[:, step] = popped & parent_on_path & (d < reference_length) & matches
        sibling = np.minimum(r + 1, width - 1)
        push(popped & (r + 1 < width), ps + logprobs[rows, d, sibling], ps, d, r + 1, p)
        child = np.minimum(d + 1, depth - 1)
        push(popped & (d + 1 < depth), s + logprobs[rows, child, 0], s, d + 1, np.zeros_like(r), np.full_like(p, step))
    reached = np.cumsum(on_path, axis=1)
    for budget in budgets:
        if budget > 0:
            result[budget] = reached[:, budget - 1]
    return result


def _score_logits(logits: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor, budgets: list[int]):
    """logits [n, B-1, V] (overwritten when float32) -> correct [n, B-1] and streaks {budget: [n]}.

    The log-sum-exp the tree needs is taken in place: a fresh vocabulary-sized tensor per chunk
    costs more in page faults than the arithmetic. One block (the reference loop) walks the
    obvious scalar tree; many blocks take the lockstep `ddtree_streaks`.
    """
    if not budgets:
        return ((logits.argmax(-1).cpu() == labels) & valid).numpy(), {}
    logits = logits.float()  # a bf16 head's logits (GPU) are scored in fp32, in a copy
    values, ids = logits.topk(min(max(budgets), logits.shape[-1]), dim=-1)
    correct = (ids[..., 0].cpu() == labels) & valid
    top1 = values[..., :1]
    lse = logits.sub_(top1).exp_().sum(-1, keepdim=True).log_().add_(top1)
    logprobs, ids = (values - lse).cpu().double().numpy(), ids.cpu().numpy()
    reference_length = valid.int().cumprod(1).sum(1).numpy()
    if logits.shape[0] > 1:
        return correct.numpy(), ddtree_streaks(logprobs, ids, labels.numpy(), reference_length, budgets)
    streaks = {budget: np.zeros(logits.shape[0], dtype=np.int64) for budget in budgets}
    for block in range(logits.shape[0]):
        reference = labels[block][: reference_length[block]].tolist()
        for budget in budgets:
            streaks[budget][block] = ddtree_streak(logprobs[block].tolist(), ids[block].tolist(), reference, budget)
    return correct.numpy(), streaks


def logits_into(head: TargetHead, hidden: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
    """The head's logits [..., V] of hidden [..., H], written into `buffer` (>= rows x V elements).

    On CPU a fresh vocabulary-sized result is first touched page by page: its matmul ran at
    150-180 GFLOP/s here against ~400 in a reused buffer. Valid until the buffer is reused.
    """
    flat = hidden.reshape(-1, hidden.shape[-1]).to(head.lm_head_weight.dtype).contiguous()
    result = buffer.view(-1)[: flat.shape[0] * head.lm_head_weight.shape[0]].view(flat.shape[0], -1)
    torch.mm(flat, head.lm_head_weight.T, out=result)
    return result.view(*hidden.shape[:-1], -1)


def _joined(parts: dict[str, list], streak_parts: dict[int, list]) -> BlockScores:
    """One BlockScores from the per-batch (or per-block) pieces."""
    return BlockScores(**{name: np.concatenate(pieces) for name, pieces in parts.items()},
                       streaks={budget: np.concatenate(pieces) for budget, pieces in streak_parts.items()})


def _anchors_cap(anchors_per_sequence: int) -> int:
    return anchors_per_sequence if anchors_per_sequence > 0 else 1 << 30


def _anchor_seed(seed: int, sequence: int) -> int:
    # Per sequence, so every drafter (and the one-block-at-a-time reference) sees the same anchors.
    return seed * 1_000_003 + 7919 + sequence


@torch.no_grad()
def score_teacher_forced(drafter: DFlashDrafter, head: TargetHead, dataset, *, anchors_per_sequence: int, tokens_per_batch: int,
                         tree_budgets: list[int], seed: int = 0, sequences: list[int] | None = None, logits_chunk: int = 1024,
                         blocks_per_forward: int = 64, progress: bool = False) -> BlockScores:
    """Teacher-forced scores of one drafter, all blocks of a packed group of sequences per forward."""
    from tqdm import tqdm

    drafter.eval()
    config = drafter.config
    block_size, cap = config.block_size, _anchors_cap(anchors_per_sequence)
    indices = list(range(len(dataset))) if sequences is None else list(sequences)
    lengths = dataset.lengths()
    anchors = {index: min(cap, max(0, int(dataset[index].loss_mask.sum()) - 1)) for index in indices}  # an upper bound
    # Pack sequences up to a context budget and a block budget: the dense DFlash mask costs
    # blocks x (context + blocks), so packing too many blocks wastes attention on masked keys.
    groups, current, tokens, blocks = [], [], 0, 0
    for index in indices:
        if current and (tokens + lengths[index] > tokens_per_batch or blocks + anchors[index] > blocks_per_forward):
            groups.append(current)
            current, tokens, blocks = [], 0, 0
        current.append(index)
        tokens += lengths[index]
        blocks += anchors[index]
    if current:
        groups.append(current)
    device = head.embed_weight.device
    parts = {"sequence": [], "anchor": [], "correct": [], "valid": []}
    streak_parts: dict[int, list] = {budget: [] for budget in tree_budgets}
    # The head runs on chunks of `chunk` blocks gathered across forwards (a forward holds few
    # blocks, to keep its dense mask small), in one reused buffer (see `logits_into`).
    chunk = max(1, logits_chunk // (block_size - 1))
    logits_buffer = torch.empty(chunk * (block_size - 1) * head.lm_head_weight.shape[0], device=device, dtype=head.lm_head_weight.dtype)
    pending: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # drafted, not yet through the head

    def score_pending(everything: bool) -> None:
        hidden, labels, valid = (torch.cat(piece) for piece in zip(*pending))
        pending.clear()
        ready = hidden.shape[0] if everything else hidden.shape[0] // chunk * chunk
        for start in range(0, ready, chunk):
            stop = min(start + chunk, ready)
            logits = logits_into(head, hidden[start:stop], logits_buffer)
            correct, streaks = _score_logits(logits, labels[start:stop], valid[start:stop], tree_budgets)
            parts["correct"].append(correct)
            for budget in tree_budgets:
                streak_parts[budget].append(streaks[budget])
        if ready < hidden.shape[0]:
            pending.append((hidden[ready:], labels[ready:], valid[ready:]))

    for group in tqdm(groups, desc=f"evaluate {drafter_label(drafter)}", unit="batch", disable=not progress, leave=False):
        samples = [dataset[index] for index in group]
        counts = [min(cap, valid_anchors(sample.loss_mask).numel()) for sample in samples]
        if sum(counts) == 0:
            continue
        batch = build_batch(samples, anchors_per_sequence=cap, block_size=block_size, mask_token_id=config.mask_token_id,
                            gamma=1.0, anchor_seeds=[_anchor_seed(seed, index) for index in group])
        embeddings = head.embed(batch.block_ids.to(device)).to(drafter.fc.weight.dtype)
        hidden = drafter.forward_blocks([f.to(device) for f in batch.features], batch.context_positions.to(device), embeddings,
                                        batch.block_positions.to(device), batch.mask.to(device))
        valid = batch.weights > 0
        pending.append((hidden.view(-1, block_size, hidden.shape[-1])[:, 1:], batch.labels, valid))
        if sum(piece[0].shape[0] for piece in pending) >= chunk:
            score_pending(everything=False)
        parts["valid"].append(valid.numpy())
        parts["sequence"].append(np.repeat(np.array(group), counts))
        parts["anchor"].append(batch.block_positions.view(-1, block_size)[:, 0].numpy())
    if pending:
        score_pending(everything=True)
    if not parts["correct"]:
        raise PipelineError("evaluate: the val shards hold no answer with two tokens in a row to anchor a block")
    return _joined(parts, streak_parts)


@torch.no_grad()
def score_one_block_at_a_time(drafter: DFlashDrafter, head: TargetHead, dataset, *, anchors_per_sequence: int, tree_budgets: list[int],
                              seed: int = 0, sequences: list[int] | None = None, reuse_context: bool = True) -> BlockScores:
    """The plain reference: one block per drafter forward through the inference KV cache.

    Same anchors and scoring as `score_teacher_forced`; obvious by inspection, and slow (the
    vocabulary head runs on B-1 rows at a time). `reuse_context=False` rebuilds the context
    cache for every block, as a script that drafts each block from scratch does. Used by the
    tests and the benchmark.
    """
    drafter.eval()
    config = drafter.config
    block_size, cap = config.block_size, _anchors_cap(anchors_per_sequence)
    parts = {"sequence": [], "anchor": [], "correct": [], "valid": []}
    streak_parts: dict[int, list] = {budget: [] for budget in tree_budgets}
    for index in (range(len(dataset)) if sequences is None else sequences):
        sample = dataset[index]
        ids, mask, length = sample.input_ids.long(), sample.loss_mask.bool(), sample.input_ids.shape[0]
        candidates = valid_anchors(sample.loss_mask)
        if candidates.numel() == 0:
            continue
        take = min(cap, candidates.numel())
        generator = torch.Generator().manual_seed(_anchor_seed(seed, index))
        anchors = candidates[torch.randperm(candidates.numel(), generator=generator)[:take]].sort().values.tolist()
        cache = DraftCache(drafter)
        for anchor in anchors:
            if not reuse_context:
                cache = DraftCache(drafter)
            cache.extend(sample.features[cache.length : anchor].to(head.embed_weight.device))
            logits = draft_block(drafter, head, cache, int(ids[anchor]))
            slots = torch.arange(anchor + 1, anchor + block_size)
            inside = slots < length
            labels = ids[slots.clamp(max=length - 1)]
            valid = inside & mask[slots.clamp(max=length - 1)]
            correct, streaks = _score_logits(logits[None], labels[None], valid[None], tree_budgets)
            parts["correct"].append(correct)
            parts["valid"].append(valid[None].numpy())
            parts["sequence"].append(np.array([index]))
            parts["anchor"].append(np.array([anchor]))
            for budget in tree_budgets:
                streak_parts[budget].append(streaks[budget])
    return _joined(parts, streak_parts)


def drafter_label(drafter: DFlashDrafter) -> str:
    config = drafter.config
    return f"{config.num_layers}L/B{config.block_size}"


# ----------------------------------------------------------------------------- summaries


def per_slot_acceptance(scores: BlockScores) -> tuple[list[float], list[float]]:
    """(unconditional, conditional) acceptance per drafted slot.

    Unconditional: P(slot k correct) over blocks where slot k exists. Conditional: the same over
    blocks whose slots 1..k-1 were all accepted, i.e. the chance that speculation continues.
    """
    correct, valid = scores.correct, scores.valid
    reached = np.concatenate([np.ones((correct.shape[0], 1), dtype=bool), np.cumprod(correct, axis=1)[:, :-1].astype(bool)], axis=1)
    unconditional, conditional = [], []
    for k in range(correct.shape[1]):
        exists = valid[:, k]
        unconditional.append(float(correct[exists, k].mean()) if exists.any() else float("nan"))
        got_there = exists & reached[:, k]
        conditional.append(float(correct[got_there, k].mean()) if got_there.any() else float("nan"))
    return unconditional, conditional


def _per_prompt_mean(values: np.ndarray, sequence: np.ndarray) -> list[float]:
    return [float(values[sequence == s].mean()) for s in np.unique(sequence)]


def summarize_blocks(scores: BlockScores, categories: list[str] | None = None) -> dict:
    """Flat metrics of one drafter: means over prompts (each prompt's blocks averaged first)."""
    tau, ci = mean_ci95(_per_prompt_mean(scores.tau.astype(np.float64), scores.sequence))
    unconditional, conditional = per_slot_acceptance(scores)
    summary = {"tau": round(tau, 4), "tau_ci95": round(ci, 4), "blocks": int(scores.tau.shape[0]),
               "prompts": int(np.unique(scores.sequence).shape[0]), "tau_per_block": round(float(scores.tau.mean()), 4)}
    for budget, streak in sorted(scores.streaks.items()):
        mean, half = mean_ci95(_per_prompt_mean(streak.astype(np.float64), scores.sequence))
        summary[f"ddtree{budget}_streak"] = round(mean, 4)
        summary[f"ddtree{budget}_streak_ci95"] = round(half, 4)
    for k, (u, c) in enumerate(zip(unconditional, conditional)):
        summary[f"slot{k + 1}_acc"] = round(u, 4)
        summary[f"slot{k + 1}_acc_cond"] = round(c, 4)
    if categories is not None:
        labels = np.array([categories[s] for s in scores.sequence])
        for category in sorted(set(labels.tolist())):
            chosen = labels == category
            mean, half = mean_ci95(_per_prompt_mean(scores.tau[chosen].astype(np.float64), scores.sequence[chosen]))
            summary[f"tau_{category}"] = round(mean, 4)
            summary[f"tau_{category}_ci95"] = round(half, 4)
    return summary


def paired_difference(scores: BlockScores, reference: BlockScores) -> tuple[float, float, int]:
    """tau of `scores` minus tau of `reference`, paired by prompt: mean and 95% CI half-width over
    the prompts both scored (each prompt's blocks averaged first), and how many prompts.

    Every drafter is scored on the same anchors of the same prompts, so the spread between
    prompts (math answers are easy for any drafter, chat answers hard) cancels in the difference:
    its interval is much narrower than either drafter's own, and it is the one that says whether
    one drafter beats another.
    """
    shared = np.intersect1d(np.unique(scores.sequence), np.unique(reference.sequence))
    ours, theirs = (_per_prompt_mean(b.tau[np.isin(b.sequence, shared)].astype(np.float64), b.sequence[np.isin(b.sequence, shared)])
                    for b in (scores, reference))
    differences = [a - b for a, b in zip(ours, theirs)]
    mean, half = mean_ci95(differences)
    return mean, half, len(differences)


def comparison_verdict(name: str, reference: str, mean: float, half: float, prompts: int) -> str:
    """One line: is `name` better or worse than `reference`, or can 95% not tell them apart."""
    if not np.isfinite(half) or abs(mean) <= half:
        verdict = "not distinguishable at 95%"
    else:
        verdict = f"{name} is {'better' if mean > 0 else 'worse'}"
    return f"{name} vs {reference}: tau difference {mean:+.4f} +- {half:.4f} (paired over {prompts} prompts): {verdict}"


# ----------------------------------------------------------------------------- end to end


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _crop(cache, length: int) -> None:
    """Keep the first `length` positions of a transformers KV cache."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


@dataclass
class DecodeRun:
    tokens: list[int]
    seconds: float
    prefill_seconds: float
    steps: list[int] = field(default_factory=list)  # tau of each speculative step (accepted + bonus)
    verify_seconds: float = 0.0
    draft_seconds: float = 0.0


@torch.inference_mode()
def greedy_decode(model, prompt_ids: list[int], *, max_new_tokens: int, eos_ids: set[int]) -> DecodeRun:
    """Plain greedy decoding of one prompt with a KV cache: the reference output and timing."""
    from transformers import DynamicCache

    device = next(model.parameters()).device
    cache = DynamicCache(config=model.config)
    _sync(device)
    started = time.perf_counter()
    out = model(input_ids=torch.tensor([prompt_ids], device=device), cache=cache, use_cache=True, logits_to_keep=1)
    token = int(out.logits[0, -1].argmax())
    _sync(device)
    prefilled = time.perf_counter()
    tokens, position = [token], len(prompt_ids)
    while token not in eos_ids and len(tokens) < max_new_tokens:
        out = model(input_ids=torch.tensor([[token]], device=device), position_ids=torch.tensor([[position]], device=device),
                    cache=cache, use_cache=True)
        token = int(out.logits[0, -1].argmax())
        tokens.append(token)
        position += 1
    _sync(device)
    return DecodeRun(tokens=tokens, seconds=time.perf_counter() - started, prefill_seconds=prefilled - started)


def as_stored(features: torch.Tensor, feature_dtype: str) -> torch.Tensor:
    """Live target features rounded exactly as the shards store them, so the drafter sees at
    inference what it saw in training."""
    from dflash_pipeline.shards import decode_features, encode_features

    values, scales = encode_features(features, feature_dtype)
    return decode_features(values, scales, features.shape[-1], feature_dtype).to(features.device)


def drafter_proposer(drafter: DFlashDrafter, head: TargetHead):
    """The proposal function of a drafter: B-1 greedy tokens after the anchor."""

    def propose(cache: DraftCache, anchor: int) -> list[int]:
        return draft_block(drafter, head, cache, anchor).argmax(-1).tolist()

    return propose


@torch.inference_mode()
def speculative_decode(model, tap, drafter: DFlashDrafter, propose, prompt_ids: list[int], *, max_new_tokens: int, eos_ids: set[int],
                       feature_dtype: str = "bf16") -> DecodeRun:
    """Lossless speculative decoding of one prompt at T = 0.

    Loop: the drafter proposes B-1 tokens after the anchor (the last committed token); the target
    verifies [anchor, proposal] in one forward; the matching prefix plus the target's own next
    token (the bonus) are committed; the target KV cache is cropped to the committed length and
    the drafter's context cache is extended with the committed positions' features only.
    `tap` is the capture stage's LayerTap on `model`, so features come from the same layers as
    the shards. `propose(cache, anchor) -> list[int]` is the drafter (replaceable in tests).
    """
    from transformers import DynamicCache

    device = next(model.parameters()).device
    block_size = drafter.config.block_size
    cache, draft_cache = DynamicCache(config=model.config), DraftCache(drafter)
    _sync(device)
    started = time.perf_counter()
    out = model(input_ids=torch.tensor([prompt_ids], device=device), cache=cache, use_cache=True, logits_to_keep=1)
    anchor = int(out.logits[0, -1].argmax())
    draft_cache.extend(as_stored(tap.features()[0], feature_dtype).to(drafter.fc.weight.device))
    _sync(device)
    run = DecodeRun(tokens=[anchor], seconds=0.0, prefill_seconds=time.perf_counter() - started)
    position = len(prompt_ids)  # where the anchor sits
    finished = anchor in eos_ids or len(run.tokens) >= max_new_tokens
    while not finished:
        began = time.perf_counter()
        proposal = propose(draft_cache, anchor)
        _sync(device)
        drafted = time.perf_counter()
        out = model(input_ids=torch.tensor([[anchor] + proposal], device=device),
                    position_ids=torch.arange(position, position + block_size, device=device)[None], cache=cache, use_cache=True)
        choice = out.logits[0].argmax(-1).tolist()  # the target's token after each block position
        accepted = 0
        while accepted < block_size - 1 and proposal[accepted] == choice[accepted]:
            accepted += 1
        _crop(cache, position + accepted + 1)
        _sync(device)
        verified = time.perf_counter()
        draft_cache.extend(as_stored(tap.features()[0, : accepted + 1], feature_dtype).to(drafter.fc.weight.device))
        _sync(device)
        extended = time.perf_counter()
        committed = proposal[:accepted] + [choice[accepted]]
        for token in committed:
            run.tokens.append(token)
            # An EOS accepted inside the block ends the answer even though the block goes on.
            if token in eos_ids or len(run.tokens) >= max_new_tokens:
                finished = True
                break
        run.steps.append(accepted + 1)
        position += accepted + 1
        anchor = committed[-1]
        run.verify_seconds += verified - drafted
        run.draft_seconds += (drafted - began) + (extended - verified)  # proposing + extending the context cache
    _sync(device)
    run.seconds = time.perf_counter() - started
    return run


def first_difference(a: list[int], b: list[int]) -> int | None:
    for position, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return position
    return None if len(a) == len(b) else min(len(a), len(b))


@dataclass
class EndToEndPrompt:
    prompt_id: str
    plain: DecodeRun
    speculative: dict[str, DecodeRun]  # candidate name -> run


def end_to_end(model, tap, candidates: list[tuple[str, DFlashDrafter, object]], prompts: list[tuple[str, list[int]]], *, max_new_tokens: int,
               eos_ids: set[int], feature_dtype: str, progress: bool = False) -> list[EndToEndPrompt]:
    """Plain greedy and speculative decoding of each prompt, alternating which goes first so
    drift in machine speed (turbo, other load) falls on both sides alike."""
    from tqdm import tqdm

    if prompts:  # warm-up: first-call allocations and kernel selection are not part of either side
        greedy_decode(model, prompts[0][1], max_new_tokens=4, eos_ids=eos_ids)
        for _, drafter, propose in candidates:
            speculative_decode(model, tap, drafter, propose, prompts[0][1], max_new_tokens=4, eos_ids=eos_ids, feature_dtype=feature_dtype)
    results = []
    for number, (prompt_id, prompt_ids) in enumerate(tqdm(prompts, desc="end-to-end", unit="prompt", disable=not progress)):
        runs: dict[str, DecodeRun] = {}

        def plain():
            runs["__plain__"] = greedy_decode(model, prompt_ids, max_new_tokens=max_new_tokens, eos_ids=eos_ids)

        def speculative():
            for name, drafter, propose in candidates:
                runs[name] = speculative_decode(model, tap, drafter, propose, prompt_ids, max_new_tokens=max_new_tokens,
                                                eos_ids=eos_ids, feature_dtype=feature_dtype)

        for part in ((plain, speculative) if number % 2 == 0 else (speculative, plain)):
            part()
        plain_run = runs.pop("__plain__")
        results.append(EndToEndPrompt(prompt_id=prompt_id, plain=plain_run, speculative=runs))
    return results


def summarize_end_to_end(results: list[EndToEndPrompt], name: str) -> dict:
    """Lossless rate, tau per step, tokens/s, speedup, time split and break-even tau of one drafter.

    Break-even tau = (cost of one speculative step) / (cost of one plain decode step), both
    measured here: a drafter whose tau is below it makes decoding slower on this machine.
    """
    mismatches = []
    per_prompt_tau, plain_tokens, plain_seconds, spec_tokens, spec_seconds = [], 0, 0.0, 0, 0.0
    plain_decode_seconds, plain_decode_tokens = 0.0, 0
    steps = verify = draft = overhead = prefill = 0.0
    for result in results:
        run, plain = result.speculative[name], result.plain
        difference = first_difference(run.tokens, plain.tokens)
        if difference is not None:
            mismatches.append(f"{result.prompt_id} at answer token {difference}")
        per_prompt_tau.append(float(np.mean(run.steps)) if run.steps else 1.0)
        plain_tokens += len(plain.tokens)
        plain_seconds += plain.seconds
        plain_decode_seconds += plain.seconds - plain.prefill_seconds
        plain_decode_tokens += len(plain.tokens) - 1
        spec_tokens += len(run.tokens)
        spec_seconds += run.seconds
        steps += len(run.steps)
        verify += run.verify_seconds
        draft += run.draft_seconds
        prefill += run.prefill_seconds
        overhead += run.seconds - run.prefill_seconds - run.verify_seconds - run.draft_seconds
    tau, ci = mean_ci95(per_prompt_tau)
    decode_step = plain_decode_seconds / max(1, plain_decode_tokens)
    per_step = (verify + draft + overhead) / max(1.0, steps)
    plain_rate, spec_rate = plain_tokens / max(plain_seconds, 1e-9), spec_tokens / max(spec_seconds, 1e-9)
    return {
        "e2e_prompts": len(results),
        "lossless_rate": round(1.0 - len(mismatches) / max(1, len(results)), 4),
        "mismatches": mismatches,
        "e2e_tau": round(tau, 4),
        "e2e_tau_ci95": round(ci, 4),
        "plain_tokens_per_s": round(plain_rate, 2),
        "spec_tokens_per_s": round(spec_rate, 2),
        "speedup": round(spec_rate / plain_rate, 4) if plain_rate > 0 else None,
        "decode_step_ms": round(1000 * decode_step, 3),
        "verify_cost_steps": round(verify / max(1.0, steps) / decode_step, 3) if decode_step > 0 else None,
        "draft_cost_steps": round(draft / max(1.0, steps) / decode_step, 3) if decode_step > 0 else None,
        "break_even_tau": round(per_step / decode_step, 3) if decode_step > 0 else None,
        "time_prefill": round(prefill / max(spec_seconds, 1e-9), 4),
        "time_verify": round(verify / max(spec_seconds, 1e-9), 4),
        "time_draft": round(draft / max(spec_seconds, 1e-9), 4),
        "time_overhead": round(overhead / max(spec_seconds, 1e-9), 4),
    }



# ----------------------------------------------------------------------------- the stage


def sequence_categories(dataset, generated_val: Path | None) -> list[str]:
    """The prompt category of each val sequence (from the generate stage's table), else "all"."""
    by_id = {}
    if generated_val is not None and Path(generated_val).is_file():
        import pyarrow.parquet as pq

        table = pq.read_table(generated_val, columns=["prompt_id", "category"])
        by_id = dict(zip(table.column("prompt_id").to_pylist(), table.column("category").to_pylist()))
    return [by_id.get(dataset[index].sequence_id) or "all" for index in range(len(dataset))]


def load_candidates(*, checkpoint_folders: list[Path], baseline_dirs: list[Path], target, layer_ids: list[int], device: str) -> list[Candidate]:
    """Every drafter to score, each checked against the target and the shards first."""
    from dflash_pipeline.train import load_checkpoint

    candidates = []
    for folder in checkpoint_folders:
        drafter, info = load_checkpoint(folder, device=device)
        if info.get("target_fingerprint") != target.fingerprint:
            raise PipelineError(f"{folder}/checkpoint.json: target_fingerprint {str(info.get('target_fingerprint'))[:12]}... "
                                f"is not this target's {target.fingerprint[:12]}...")
        check_drafter_contract(drafter.config, target=target, layer_ids=layer_ids, source=str(folder / "checkpoint.json"))
        name = folder.name if folder.name not in {c.name for c in candidates} else str(folder)  # two runs' step_000900
        candidates.append(Candidate(name=name, kind="checkpoint", path=folder, drafter=drafter, step=int(info["step"])))
    names = {c.name for c in candidates}
    if baseline_dirs:
        from dflash_pipeline.export import load_dflash_drafter
    for directory in baseline_dirs:
        directory = Path(directory)
        drafter, _ = load_dflash_drafter(directory, device=device)
        check_drafter_contract(drafter.config, target=target, layer_ids=layer_ids, source=str(directory / "config.json"))
        name = directory.name if directory.name not in names else str(directory)
        names.add(name)
        candidates.append(Candidate(name=name, kind="baseline", path=directory, drafter=drafter))
    return candidates


def choose_best(rows: list[dict]) -> dict:
    """The checkpoint with the highest teacher-forced tau (the later step on a tie)."""
    checkpoints = [row for row in rows if row["kind"] == "checkpoint"]
    return max(checkpoints, key=lambda row: (row["tau"], row["step"]))


def val_prompts(generated_val: Path, count: int) -> list[tuple[str, list[int]]]:
    """`count` val prompts of the generate stage's table as (prompt id, token ids), taken round
    robin over the categories (file order within each), so a few prompts still cover the mix."""
    import pyarrow.parquet as pq

    table = pq.read_table(generated_val, columns=["prompt_id", "category", "prompt_ids"]).to_pylist()
    by_category: dict[str, list] = {}
    for row in table:
        by_category.setdefault(row["category"] or "", []).append((row["prompt_id"], row["prompt_ids"]))
    queues = list(by_category.values())
    chosen = []
    while len(chosen) < count and any(queues):
        for queue in queues:
            if queue and len(chosen) < count:
                chosen.append(queue.pop(0))
    return chosen


def run_evaluate(config, *, target, hidden_val_dir: Path, generated_val: Path | None, checkpoints_dir: Path | None = None,
                 checkpoint_folders: list[Path] | None = None, baseline_dirs: list[Path] | None = None, device: str = "cpu",
                 log=print) -> dict:
    """Score checkpoints and baselines; return everything the outputs need.

    Checkpoints: `checkpoint_folders` when given (any folders with checkpoint.json), else those of
    `checkpoints_dir` chosen by `config.checkpoints`. Baselines: `baseline_dirs`, else `config.baselines`.
    """
    from dflash_pipeline.capture import LayerTap
    from dflash_pipeline.shards import open_split
    from dflash_pipeline.target import load_target
    from dflash_pipeline.train import list_checkpoints, load_target_head

    val_set = open_split(hidden_val_dir, expected_fingerprint=target.fingerprint)
    manifest = val_set.manifest
    if checkpoint_folders is not None:
        folders = [Path(folder) for folder in checkpoint_folders]
    else:
        folders = select_checkpoints(list_checkpoints(checkpoints_dir), config.checkpoints) if checkpoints_dir is not None else []
    baselines = [Path(b) for b in (baseline_dirs if baseline_dirs is not None else config.baselines)]
    candidates = load_candidates(checkpoint_folders=folders, baseline_dirs=baselines, target=target, layer_ids=manifest.layer_ids,
                                 device=device)
    if not candidates:
        raise PipelineError("evaluate: nothing to evaluate (no checkpoint selected and no baseline)")
    head = load_target_head(target, device=device, dtype=torch.bfloat16 if device.startswith("cuda") else torch.float32)
    categories = sequence_categories(val_set, generated_val)

    rows, blocks = [], {}
    started = time.perf_counter()
    for candidate in candidates:
        began = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.startswith("cuda")):
            scores = score_teacher_forced(candidate.drafter, head, val_set, anchors_per_sequence=config.anchors_per_sequence,
                                          tokens_per_batch=config.tokens_per_batch, tree_budgets=list(config.tree_budgets),
                                          seed=config.seed, progress=True)
        summary = summarize_blocks(scores, categories)
        summary.update(name=candidate.name, kind=candidate.kind, step=candidate.step, path=str(candidate.path),
                       block_size=candidate.drafter.config.block_size, num_layers=candidate.drafter.config.num_layers,
                       seconds=round(time.perf_counter() - began, 2))
        rows.append(summary)
        blocks[candidate.name] = scores
        log(f"evaluate: {candidate.name}: tau {summary['tau']:.3f} +- {summary['tau_ci95']:.3f} over {summary['blocks']} blocks "
            f"of {summary['prompts']} prompts ({summary['seconds']:.1f} s)")
    teacher_forced_seconds = time.perf_counter() - started

    has_checkpoints = any(row["kind"] == "checkpoint" for row in rows)
    best = choose_best(rows) if has_checkpoints else rows[0]
    for row in rows:
        mean, half, prompts = paired_difference(blocks[row["name"]], blocks[best["name"]])
        row.update(tau_vs_best=round(mean, 4), tau_vs_best_ci95=round(half, 4))
        if row["kind"] == "baseline":
            log(f"evaluate: {comparison_verdict(row['name'], best['name'], mean, half, prompts)}")
    e2e_names = [best["name"]] + [row["name"] for row in rows if row["kind"] == "baseline" and row["name"] != best["name"]]
    e2e, e2e_results = {}, []
    if config.num_prompts > 0 and generated_val is not None:
        model, _ = load_target(target, device=device)
        tap = LayerTap(model, manifest.layer_ids)
        by_name = {c.name: c for c in candidates}
        runners = [(name, by_name[name].drafter, drafter_proposer(by_name[name].drafter, head)) for name in e2e_names]
        prompts = val_prompts(generated_val, config.num_prompts)
        e2e_results = end_to_end(model, tap, runners, prompts, max_new_tokens=config.max_new_tokens, eos_ids=set(target.eos_token_ids),
                                 feature_dtype=manifest.feature_dtype, progress=True)
        tap.remove()
        e2e = {name: summarize_end_to_end(e2e_results, name) for name in e2e_names}
        for row in rows:
            if row["name"] in e2e:
                row.update({k: v for k, v in e2e[row["name"]].items() if k != "mismatches"})
        for name, summary in e2e.items():
            for mismatch in summary["mismatches"]:
                log(f"evaluate: NOT LOSSLESS: {name} differs from plain greedy decoding on prompt {mismatch}")
    return {"rows": rows, "best": best, "blocks": blocks, "categories": categories, "e2e": e2e, "e2e_results": e2e_results,
            "teacher_forced_seconds": round(teacher_forced_seconds, 2), "layer_ids": manifest.layer_ids}


def flat_metrics(result: dict, tree_budgets: list[int]) -> dict:
    """eval.json: stable flat keys for the chosen drafter, plus a short entry per baseline."""
    best = result["best"]
    keep = ["tau", "tau_ci95", "blocks", "prompts", "e2e_tau", "e2e_tau_ci95", "lossless_rate", "speedup", "plain_tokens_per_s",
            "spec_tokens_per_s", "break_even_tau", "verify_cost_steps", "draft_cost_steps", "decode_step_ms", "e2e_prompts",
            "time_prefill", "time_verify", "time_draft", "time_overhead"]
    keep += [f"ddtree{b}_streak" for b in tree_budgets] + [f"ddtree{b}_streak_ci95" for b in tree_budgets]
    categories = sorted(set(result["categories"]))
    keep += sorted([k for k in best if k.startswith("slot")] + [f"tau_{c}" for c in categories] + [f"tau_{c}_ci95" for c in categories])
    metrics = {key: best[key] for key in keep if key in best}
    metrics.update(chosen=best["name"], chosen_step=best["step"], teacher_forced_seconds=result["teacher_forced_seconds"])
    baselines = {row["name"]: {k: row.get(k) for k in ("tau", "tau_ci95", "tau_vs_best", "tau_vs_best_ci95", "ddtree8_streak", "e2e_tau",
                                                    "speedup", "lossless_rate") if k in row}
                 for row in result["rows"] if row["kind"] == "baseline"}
    if baselines:
        metrics["baselines"] = baselines
    return metrics


def write_outputs(result: dict, *, out_dir: Path, metrics_path: Path, plots_dir: Path, tree_budgets: list[int]) -> dict:
    """comparison.csv/json, blocks.parquet, e2e.json, best.json, eval.json, plot CSVs and PNGs."""
    import pandas as pd

    from dflash_pipeline.files import write_json_atomic

    out_dir.mkdir(parents=True, exist_ok=True)
    plots_dir.mkdir(parents=True, exist_ok=True)
    table = pd.DataFrame(result["rows"])
    table.to_csv(out_dir / "comparison.csv", index=False)
    write_json_atomic(out_dir / "comparison.json", result["rows"])
    frames = []
    for name, scores in result["blocks"].items():
        frame = pd.DataFrame({"drafter": name, "sequence": scores.sequence, "category": [result["categories"][s] for s in scores.sequence],
                              "anchor": scores.anchor, "tau": scores.tau})
        for budget, streak in scores.streaks.items():
            frame[f"ddtree{budget}_streak"] = streak
        frames.append(frame)
    pd.concat(frames).to_parquet(out_dir / "blocks.parquet", index=False)
    e2e_detail = [{"prompt_id": r.prompt_id, "plain_tokens": len(r.plain.tokens), "plain_seconds": round(r.plain.seconds, 4),
                   **{name: {"tokens": len(run.tokens), "seconds": round(run.seconds, 4), "steps": run.steps,
                             "identical": run.tokens == r.plain.tokens} for name, run in r.speculative.items()}}
                  for r in result["e2e_results"]]
    write_json_atomic(out_dir / "e2e.json", {"summary": result["e2e"], "prompts": e2e_detail})
    best = result["best"]
    write_json_atomic(out_dir / "best.json", {"name": best["name"], "kind": best["kind"], "step": best["step"], "path": best["path"],
                                              "tau": best["tau"], "tau_ci95": best["tau_ci95"], "chosen_by": "teacher-forced tau"})
    metrics = flat_metrics(result, tree_budgets)
    metrics_path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(metrics_path, metrics)
    write_plots(result, plots_dir)
    return metrics


def write_plots(result: dict, plots_dir: Path) -> None:
    """CSV series for `dvc plots` and PNGs that need no browser: tau by step, acceptance by slot,
    ours against the baselines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd

    rows = result["rows"]
    checkpoints = sorted((r for r in rows if r["kind"] == "checkpoint"), key=lambda r: r["step"])
    baselines = [r for r in rows if r["kind"] == "baseline"]
    by_step = pd.DataFrame([{"step": r["step"], "tau": r["tau"], "tau_ci95": r["tau_ci95"], "ddtree8_streak": r.get("ddtree8_streak")}
                            for r in checkpoints], columns=["step", "tau", "tau_ci95", "ddtree8_streak"])
    by_step.to_csv(plots_dir / "eval_tau_by_step.csv", index=False)
    shown = [result["best"]] + [r for r in baselines if r["name"] != result["best"]["name"]]
    best_slots = range(1, result["best"]["block_size"])  # the chosen drafter's; baselines are in the PNG
    pd.DataFrame({"slot": list(best_slots), "acceptance": [result["best"].get(f"slot{k}_acc_cond") for k in best_slots],
                  "acceptance_unconditional": [result["best"].get(f"slot{k}_acc") for k in best_slots]}
                 ).to_csv(plots_dir / "eval_slots.csv", index=False)

    figure, axis = plt.subplots(figsize=(6, 4))
    if checkpoints:
        axis.errorbar(by_step["step"], by_step["tau"], yerr=by_step["tau_ci95"], marker="o", capsize=3, label="checkpoints")
    for r in baselines:
        axis.axhline(r["tau"], ls="--", lw=1, label=f"baseline {r['name']}")
    axis.set(xlabel="training step", ylabel="teacher-forced tau", title="acceptance length by checkpoint (95% CI over prompts)")
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(plots_dir / "eval_tau.png", dpi=110)
    plt.close(figure)

    figure, axis = plt.subplots(figsize=(6, 4))
    for r in shown:
        k = list(range(1, r["block_size"]))
        axis.plot(k, [r.get(f"slot{i}_acc_cond") for i in k], marker="o", label=f"{r['name']} (given earlier slots accepted)")
        axis.plot(k, [r.get(f"slot{i}_acc") for i in k], marker=".", ls=":", label=f"{r['name']} (unconditional)")
    axis.set_xticks(range(1, max(r["block_size"] for r in shown)))
    axis.set(xlabel="drafted slot", ylabel="acceptance", ylim=(0, 1), title="acceptance by slot")
    axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(plots_dir / "eval_slots.png", dpi=110)
    plt.close(figure)

    figure, axis = plt.subplots(figsize=(6, 4))
    names = [r["name"] for r in shown]
    x = np.arange(len(shown))
    axis.bar(x - 0.2, [r["tau"] for r in shown], 0.4, yerr=[r["tau_ci95"] for r in shown], capsize=3, label="teacher-forced tau")
    axis.bar(x + 0.2, [r.get("e2e_tau") or 0 for r in shown], 0.4, yerr=[r.get("e2e_tau_ci95") or 0 for r in shown], capsize=3,
             label="end-to-end tau")
    axis.set_xticks(x, names, rotation=15, fontsize=8)
    axis.set(ylabel="tau", title="ours (best checkpoint) vs baselines")
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(plots_dir / "eval_baselines.png", dpi=110)
    plt.close(figure)


def summary_table(result: dict) -> str:
    """The printed comparison: one row per drafter."""
    import pandas as pd

    columns = ["name", "kind", "tau", "tau_ci95", "vs_best", "ddtree8_streak", "slot1_acc", "e2e_tau", "speedup", "lossless_rate",
               "break_even_tau"]
    table = pd.DataFrame(result["rows"])
    if "tau_vs_best" in table.columns:  # the paired difference to the chosen drafter, with its 95% CI
        table["vs_best"] = [f"{m:+.4f}+-{h:.4f}" for m, h in zip(table["tau_vs_best"], table["tau_vs_best_ci95"])]
    table = table[[c for c in columns if c in table.columns]]
    table.loc[table["name"] == result["best"]["name"], "name"] += " *"
    return table.to_string(index=False)
