"""Draft trees (DDTree): the `budget` most probable drafted continuations of a block, built with
static shapes and no read back to the host, so a GPU decode step runs them inside one graph:

    ranked_candidates           each slot's top-K tokens and log-probs, in a deterministic tie
                                order (`ranked_candidates_on_device`: the same without its one read)
    build_draft_tree_tensors    best-first growth of the most probable drafted prefixes: a fixed
                                `budget` of argmax pops over a fixed frontier of 2 * budget + 1
                                candidates (DraftTreeTensors, padded), for one block or n in lockstep
    tree_streaks                how far a continuation walks down n such trees from the anchor,
                                for every budget at once (the `ddtreeK_streak` metric)
    tree_attention_visibility   each node sees the context, the anchor, its ancestors and itself,
                                from `parents` by at most D - 1 hops up the tree

One builder: the static decode step grows one block's tree with it, and the scorer (`scoring`)
grows every scored block's and walks them with `tree_streaks`, so the teacher-forced streak and
the end-to-end tree acceptance describe the same tree. The obvious heap it replaced
(`build_draft_tree`, with `DraftTree.walk` and the additive tree mask) lives on in
tests/oracles/trees.py as the reference it is tested against.
"""

from dataclasses import dataclass

import torch

ANCHOR = -1  # the parent of the first drafted slot's nodes: the block's anchor token
PADDING = -2  # the parent of DraftTreeTensors' padding nodes: neither a node nor the anchor, so no walk enters them


@dataclass
class DraftTreeTensors:
    """A draft tree as device tensors of a fixed length, `budget`: nodes [0, count) in the order
    they were grown (a parent before its children); the rest are padding (token 0, parent PADDING,
    depth -1), which no walk enters and no node of the tree sees. A batch of n trees has a leading
    [n] on every field (fields [n, budget], count [n])."""

    tokens: torch.Tensor  # [budget], token_ids' dtype
    parents: torch.Tensor  # [budget] int64: parent node, ANCHOR for depth 0, PADDING past count
    depths: torch.Tensor  # [budget] int64: drafted slot - 1, -1 past count
    count: torch.Tensor  # 0-dim int64: how many nodes the tree has (< budget when candidates run out)


@dataclass(frozen=True)
class RankPathKeys:
    """An exact integer encoding of rank paths that orders them as Python tuples do.

    A path (r_0, ..., r_d) is the digit string (r_0 + 1, ..., r_d + 1, 0, ..., 0) of `slots` digits
    in base `base`: the trailing zeros make a prefix smaller than its extensions. The digits are
    cut into `chunks` int64 keys of `digits` digits each, most significant first, so comparing
    the keys chunk by chunk compares the paths lexicographically.

    Bounds: an offered rank is <= width (rank width: a sibling past the last candidate, never
    opened), and a candidate offered by the t-th pop (t < budget) has rank <= t + 1 <= budget (its
    r earlier siblings were popped first), so every frontier row's digit is <= min(width, budget) + 1
    and base = min(width, budget) + 2. `digits` is the largest n with base**n < 2**63, so no key
    overflows or reaches int64's maximum (kept as the "not a candidate" sentinel). With D = 15:
    one key while min(width, budget) <= 16, two up to 232 (width = budget = 64: base 66, 10
    digits a key), three beyond. Any sizes fit: the number of keys grows with the base.
    """

    slots: int
    base: int
    digits: int

    @classmethod
    def for_sizes(cls, slots: int, width: int, budget: int) -> "RankPathKeys":
        base = min(width, budget) + 2
        digits = 1
        while base ** (digits + 1) < 2**63:
            digits += 1
        assert base**digits < 2**63, f"rank digits in base {base} do not fit an int64 key"
        return cls(slots=slots, base=base, digits=digits)

    @property
    def chunks(self) -> int:
        return -(-self.slots // self.digits)

    def encode(self, path: tuple[int, ...]) -> tuple[int, ...]:
        """The keys of one rank path, on the host (what the device's frontier rows hold)."""
        digits = [rank + 1 for rank in path] + [0] * (self.chunks * self.digits - len(path))
        return tuple(sum(digit * self.base ** (self.digits - 1 - place) for place, digit in enumerate(digits[start : start + self.digits]))
                     for start in range(0, len(digits), self.digits))

    def place_values(self, device) -> torch.Tensor:
        """[slots + 1, chunks] int64: row s adds one to slot s's digit. The extra zero row serves the
        child offered past the last slot (never opened)."""
        values = [[0] * self.chunks for _ in range(self.slots + 1)]
        for slot in range(self.slots):
            values[slot][slot // self.digits] = self.base ** (self.digits - 1 - slot % self.digits)
        return torch.tensor(values, dtype=torch.int64, device=device)


NOT_A_CANDIDATE = torch.iinfo(torch.int64).max  # above every RankPathKeys key

# The frontier's integer fields (each a column of one row per offered candidate); its key chunks follow.
SLOT, RANK, PARENT, KEYS = 0, 1, 2, 3
# Its float64 fields.
SCORE, PARENT_SCORE = 0, 1


def build_draft_tree_tensors(logprobs: torch.Tensor, token_ids: torch.Tensor, budget: int, *, place: torch.Tensor | None = None) -> DraftTreeTensors:
    """The DDTree of the `budget` most probable drafted prefixes, for one block or n blocks at once,
    with static shapes and no read back to the host.

    Growth is best-first over the summed log-probs: each pop adds a node, then offers its next
    sibling and its first child. Ties follow the DDTree reference (liranringel/ddtree), made
    deterministic: each slot's candidates are ordered by fp32 logit descending, then token id
    ascending (`ranked_candidates`), a candidate's rank is its place there; a prefix's score is
    the sum of its log-probs in float64; of equal scores the prefix whose rank path (r1, r2, ...)
    is lexicographically smaller pops first. So the tree of budget k is the first k prefixes in
    (score desc, rank path asc) order, and the top-K candidates serve every budget <= K. The
    obvious heap of the same rules (tests/oracles/trees.py) is what the tests compare it with.

    logprobs / token_ids [D, K] (one block: DraftTreeTensors of [budget] fields) or [n, D, K]
    (fields [n, budget], count [n]), on any device, each slot's K best tokens in
    `ranked_candidates`' order. Growth pops at most `budget` times and each pop offers at
    most two candidates (the next sibling and the first child), so a frontier of 2 * budget + 1
    rows per block holds every candidate ever offered: row 0 the root, rows 2t + 1 and 2t + 2 the
    t-th pop's offers. Each of the `budget` iterations (a Python loop over a fixed int: it unrolls
    under torch.compile) takes, in every block at once, the open row of the highest score, of those
    the smallest rank path (`RankPathKeys`), and closes it. Once a block has no open row its
    remaining iterations write padding. Log-probs may be -inf (such candidates tie and go by rank
    path), not NaN. `place`: the `RankPathKeys.place_values` of these sizes, made
    beforehand by a caller whose step is captured as a CUDA graph (a capture cannot copy from the
    host).
    """
    assert logprobs.dim() in (2, 3) and tuple(logprobs.shape) == tuple(token_ids.shape), \
        f"logprobs {tuple(logprobs.shape)} and token_ids {tuple(token_ids.shape)} must both be [D, K] or [n, D, K]"
    if logprobs.dim() == 2:  # one block: the batched growth over a batch of one
        tree = _grow_draft_trees(logprobs[None], token_ids[None], budget, place)
        return DraftTreeTensors(tokens=tree.tokens[0], parents=tree.parents[0], depths=tree.depths[0], count=tree.count[0])
    return _grow_draft_trees(logprobs, token_ids, budget, place)


def _grow_draft_trees(logprobs: torch.Tensor, token_ids: torch.Tensor, budget: int, place: torch.Tensor | None) -> DraftTreeTensors:
    """`build_draft_tree_tensors` of logprobs / token_ids [n, D, K]: every block's frontier grown in
    lockstep (one pop per block per iteration)."""
    # One function on purpose (~60 lines): the pop loop reads and writes the same four frontier
    # tensors; split up, each piece would take and return all of them.
    blocks, slots, width = logprobs.shape
    device = logprobs.device
    budget = max(budget, 0)
    if slots == 0 or width == 0 or budget == 0:
        return DraftTreeTensors(tokens=torch.zeros(blocks, budget, dtype=token_ids.dtype, device=device),
                                parents=torch.full((blocks, budget), PADDING, dtype=torch.int64, device=device),
                                depths=torch.full((blocks, budget), -1, dtype=torch.int64, device=device),
                                count=torch.zeros(blocks, dtype=torch.int64, device=device))
    keys = RankPathKeys.for_sizes(slots, width, budget)
    place = keys.place_values(device) if place is None else place
    flat_scores = logprobs.double().reshape(blocks, slots * width)  # float64 like the host's Python floats: the sums agree bit for bit
    flat_ids = token_ids.reshape(blocks, slots * width)
    rows = 2 * budget + 1

    # Every block's frontier: a field (SLOT, ...; SCORE, ...) by a row per offered candidate by a
    # block ([fields, rows, n]): the pops reduce over the rows, and a reduction over a leading
    # dimension runs across the contiguous blocks, several times faster on a CPU than one over each
    # block's few rows. A closed row's SCORE is -inf, so the best score needs no masked copy. The
    # root candidate of every block: slot 0, rank 0, under the anchor, its score the first log-prob.
    integers = torch.zeros(KEYS + keys.chunks, rows, blocks, dtype=torch.int64, device=device)
    integers[PARENT, 0] = ANCHOR
    integers[KEYS:, 0] = place[0][:, None]
    floats = torch.zeros(2, rows, blocks, dtype=torch.float64, device=device)
    floats[SCORE, 0] = flat_scores[:, 0]
    open_rows = torch.zeros(rows, blocks, dtype=torch.bool, device=device)
    open_rows[0] = True
    open_count = torch.ones(blocks, dtype=torch.int64, device=device)  # open_rows.sum(0), kept up to date: cheaper than a reduction

    tokens, parents, depths, grown = [], [], [], []
    for pop in range(budget):
        # each block's host heap minimum: highest score, then smallest rank path (rank paths are
        # unique), among the 2 * pop + 1 rows offered so far (a static slice per unrolled pop)
        offered_so_far = 2 * pop + 1
        scores, open_so_far = floats[SCORE, :offered_so_far], open_rows[:offered_so_far]
        best_score = scores.amax(dim=0, keepdim=True)  # a closed row scores -inf (an open one may too)
        best = first_rank_path(integers[KEYS:, :offered_so_far], open_so_far & (scores == best_score))  # [1, n]
        any_open = open_count > 0
        popped = integers.gather(1, best.expand(integers.shape[0], 1, blocks))[:, 0]  # [fields, n]
        popped_floats = floats.gather(1, best.expand(2, 1, blocks))[:, 0]
        slot, rank, parent, path_key = popped[SLOT], popped[RANK], popped[PARENT], popped[KEYS:]
        score, parent_score = popped_floats[SCORE], popped_floats[PARENT_SCORE]

        tokens.append(torch.where(any_open, flat_ids.gather(1, (slot * width + rank)[:, None])[:, 0], 0))
        parents.append(torch.where(any_open, parent, PADDING))
        depths.append(torch.where(any_open, slot, -1))
        grown.append(any_open)

        # offers: the next sibling (same parent, rank + 1) and the first child (next slot, rank 0);
        # indices are clamped where an offer does not exist, and such a row stays closed (scored -inf)
        sibling_rank = rank + 1
        sibling_score = parent_score + flat_scores.gather(1, (slot * width + sibling_rank.clamp(max=width - 1))[:, None])[:, 0]
        sibling = torch.cat([torch.stack([slot, sibling_rank, parent]), path_key + place.index_select(0, slot).T])
        child_slot = slot + 1
        child_score = score + flat_scores.gather(1, (child_slot.clamp(max=slots - 1) * width)[:, None])[:, 0]
        child = torch.cat([torch.stack([child_slot, torch.zeros_like(rank), torch.full_like(parent, pop)]),
                           path_key + place.index_select(0, child_slot).T])
        offered = torch.stack([any_open & (sibling_rank < width), any_open & (child_slot < slots)])
        integers[:, 2 * pop + 1 : 2 * pop + 3] = torch.stack([sibling, child], dim=1)
        floats[:, 2 * pop + 1 : 2 * pop + 3] = torch.stack([torch.where(offered, torch.stack([sibling_score, child_score]), -torch.inf),
                                                             torch.stack([parent_score, score])])
        # close the popped row (a block with nothing open "pops" a row closed already)
        open_rows.scatter_(0, best, False)
        floats[SCORE].scatter_(0, best, -torch.inf)
        open_rows[2 * pop + 1 : 2 * pop + 3] = offered
        open_count = open_count - any_open.long() + offered.long().sum(dim=0)

    return DraftTreeTensors(tokens=torch.stack(tokens, dim=1), parents=torch.stack(parents, dim=1), depths=torch.stack(depths, dim=1),
                            count=torch.stack(grown, dim=1).sum(dim=1))


def first_rank_path(path_keys: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """[1, n]: in each block, the row of the lexicographically smallest rank path among its
    candidates (path_keys [C, N, n] int64: key chunk c of block b's row r at [c, r, b]; candidates
    bool [N, n]); a row of no candidate when there is none. Narrows the candidates one key chunk at
    a time, then takes a minimum of the last chunk (distinct paths: a single row)."""
    for chunk in range(path_keys.shape[0] - 1):
        column = path_keys[chunk]
        candidates = candidates & (column == column.masked_fill(~candidates, NOT_A_CANDIDATE).amin(dim=0, keepdim=True))
    return path_keys[-1].masked_fill(~candidates, NOT_A_CANDIDATE).argmin(dim=0, keepdim=True)


def tree_streaks(tree: DraftTreeTensors, reference: torch.Tensor, reference_length: torch.Tensor, budgets) -> dict[int, torch.Tensor]:
    """The DDTree streak of n trees for every budget: {budget: int64 [n]}, how many nodes of the
    tree of that budget (its first `budget` nodes in build order) the reference walks down from
    the anchor.

    tree: a batched DraftTreeTensors ([n, size] fields) of size >= every budget (the tree of a
    smaller budget is its first nodes: the pops come in the same order whatever the budget);
    reference [n, >= D]: each block's reference token per drafted slot, of which the first
    reference_length [n] count. A node is on the walk when its depth is below the reference
    length, its token is the reference's at its depth, and its parent is the anchor or on the walk;
    with token ids distinct within a slot (as any top-K's are) that is the one path a walk down
    the tree follows (tests/oracles' `DraftTree.walk`). No read back to the host.
    """
    tokens, parents, depths = tree.tokens, tree.parents, tree.depths
    blocks, size = tokens.shape
    assert max([0, *budgets]) <= size, f"budgets {list(budgets)} need a tree grown to the largest of them, not {size}"
    reference = reference.to(tokens.device)
    reference_length = reference_length.to(tokens.device)
    # every node that matches the reference at its own depth (padding, depth -1, never does)
    at_depth = reference.gather(1, depths.clamp(0, reference.shape[1] - 1)) if reference.shape[1] else torch.zeros_like(tokens)
    matches = (depths >= 0) & (depths < reference_length[:, None]) & (tokens == at_depth)
    # and whose ancestors all match: a node of depth d has d ancestors, and a matching node's
    # depth is below the reference's width, so width - 1 hops up the tree check every one
    on_walk, ancestor = matches, parents
    for _ in range(max(min(reference.shape[1], size) - 1, 0)):
        has_ancestor = ancestor >= 0
        ancestor_node = ancestor.clamp(min=0)
        on_walk = on_walk & (matches.gather(1, ancestor_node) | ~has_ancestor)
        ancestor = torch.where(has_ancestor, parents.gather(1, ancestor_node), ancestor)
    walked = on_walk.long().cumsum(dim=1)  # the ancestors of a node come before it: budget k walks the first k's
    return {budget: walked[:, budget - 1] if budget > 0 else torch.zeros(blocks, dtype=torch.int64, device=tokens.device)
            for budget in budgets}


def ranked_candidates(logits: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's `width` best tokens: (log-probs [..., width] fp32, ids [..., width]), ordered by
    logit descending, then token id ascending (also for which tokens tied at the cut make it),
    which torch.topk leaves unspecified among ties.

    `logits` [..., V] is overwritten when it is float32 (the log-sum-exp is taken in place: a fresh
    vocabulary-sized tensor per chunk costs more in page faults than the arithmetic).
    """
    logits = logits.float()
    vocab = logits.shape[-1]
    width = min(width, vocab)
    values, ids = logits.topk(min(width + 1, vocab), dim=-1)
    if width < vocab:  # the (width+1)-th value shows whether a tie straddles the cut
        cut = values[..., width - 1]
        straddles = values[..., width] == cut
        values, ids = values[..., :width], ids[..., :width]
        if straddles.any():  # there the tokens equal to the cut value with the lowest ids make it
            at_cut = (values == cut[..., None]) & straddles[..., None]  # the tail of a straddling row
            tied = logits == torch.where(straddles, cut, torch.nan)[..., None]  # bool [.., V]: NaN matches nothing
            row, token = tied.flatten(0, -2).nonzero(as_tuple=True)  # row-major: ids ascending in a row
            first = torch.searchsorted(row, torch.arange(tied.shape[:-1].numel(), device=row.device))
            need = at_cut.flatten(0, -2).sum(-1)
            ids[at_cut] = token[torch.arange(row.numel(), device=row.device) - first[row] < need[row]]
    # tied values inside the selection: ascending token id (sort by id, then a stable sort by value)
    ids, order = ids.sort(dim=-1)
    values, order = values.gather(-1, order).sort(dim=-1, descending=True, stable=True)
    ids = ids.gather(-1, order)
    top1 = values[..., :1]
    lse = logits.sub_(top1).exp_().sum(-1, keepdim=True).log_().add_(top1)
    return values - lse, ids


def ranked_candidates_on_device(logits: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`ranked_candidates` without its one read back (whether a tie straddles the cut): the same
    log-probs and ids, in the same order, ties at the cut included, with static shapes.

    Each row keeps the tokens above its `width`-th best value and, of those equal to it, the
    lowest ids that fill the row; a running count places the kept ids in ascending order. Costs a
    few passes over the vocabulary, where the host version pays them only when a tie straddles.
    `logits` [..., V] is overwritten when it is float32, as there.
    """
    logits = logits.float()
    vocab = logits.shape[-1]
    width = min(width, vocab)
    cut = logits.topk(width, dim=-1).values[..., -1:]
    above, at_cut = logits > cut, logits == cut
    kept = above | (at_cut & (at_cut.cumsum(-1) <= width - above.sum(-1, keepdim=True)))  # exactly `width` per row
    place = torch.where(kept, kept.cumsum(-1) - 1, width)  # column `width` takes what is not kept, then goes
    token_ids = torch.arange(vocab, device=logits.device).expand_as(logits)
    ids = torch.zeros(*logits.shape[:-1], width + 1, dtype=torch.long, device=logits.device).scatter_(-1, place, token_ids)[..., :width]
    values, order = logits.gather(-1, ids).sort(dim=-1, descending=True, stable=True)  # ids ascending among tied values
    ids = ids.gather(-1, order)
    top1 = values[..., :1]
    lse = logits.sub_(top1).exp_().sum(-1, keepdim=True).log_().add_(top1)
    return values - lse, ids


def tree_attention_visibility(parents: torch.Tensor, past: int, max_depth: int) -> torch.Tensor:
    """Which keys each row of a tree's verify forward sees, on the device: bool [1 + n, past + 1 + n] over
    rows [anchor, node 0, ..., node n-1] and columns [cache, anchor, nodes], from parents [n]
    (a DraftTreeTensors' or any tree's: ANCHOR for depth 0) with no read back. Every row sees the
    cache and the anchor; a node also sees its ancestors and itself. A padding node (parent PADDING)
    sees the cache, the anchor and itself only, so its row is never empty; no node sees it.

    A node of depth d has d ancestors among the nodes, so max_depth - 1 hops (max_depth: the
    number of drafted slots D) reach every one of them; more are harmless.
    """
    count = parents.shape[0]
    device = parents.device
    nodes = torch.arange(count, device=device)
    sees = nodes[:, None] == nodes[None, :]  # itself
    parents = parents.to(torch.int64)
    ancestor = parents
    for _ in range(max(min(max_depth, count) - 1, 0)):
        sees = sees | (ancestor[:, None] == nodes[None, :])  # ANCHOR and PADDING match no node
        ancestor = torch.where(ancestor >= 0, parents.gather(0, ancestor.clamp(min=0)), ancestor)
    anchor_row = torch.cat([torch.ones(1, past + 1, dtype=torch.bool, device=device),
                            torch.zeros(1, count, dtype=torch.bool, device=device)], dim=1)
    node_rows = torch.cat([torch.ones(count, past + 1, dtype=torch.bool, device=device), sees], dim=1)
    return torch.cat([anchor_row, node_rows])
