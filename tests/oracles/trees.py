"""The host DDTree: the heap builder, the walk and the tree mask the package's tensor builder is
tested against (`speculation.trees.build_draft_tree_tensors`, `tree_streaks`, `tree_attention_visibility`).

    build_draft_tree     best-first growth of the most probable drafted prefixes, a Python heap
    DraftTree.walk       follow a continuation down the tree from the anchor: the teacher-forced
                         streak (the target's answer) and tree verification (the target's argmax
                         at each verified node) are the same walk
    tree_attention_mask  the additive mask of one verify forward: each node sees the context,
                         the anchor, its ancestors and itself
"""

import heapq
from dataclasses import dataclass, field

import torch

from dflash_pipeline.speculation.trees import ANCHOR, DraftTreeTensors


@dataclass
class DraftTree:
    """Nodes in the order they were grown (a parent always comes before its children)."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)  # index of the parent node, ANCHOR for depth 0
    depths: list[int] = field(default_factory=list)  # drafted slot - 1

    def __len__(self) -> int:
        return len(self.tokens)

    def children(self) -> dict[int, dict[int, int]]:
        """parent node -> {token: child node}."""
        table: dict[int, dict[int, int]] = {}
        for node, (token, parent) in enumerate(zip(self.tokens, self.parents)):
            table.setdefault(parent, {})[token] = node
        return table

    def walk(self, token_after) -> tuple[list[int], int | None]:
        """Follow the tree from the anchor while `token_after(node)` (ANCHOR for the anchor) names a
        child of the current node. Returns the nodes walked and the token that left the tree
        (None when `token_after` gave none)."""
        children, path, node = self.children(), [], ANCHOR
        while True:
            token = token_after(node)
            child = None if token is None else children.get(node, {}).get(token)
            if child is None:
                return path, token
            path.append(child)
            node = child

    def streak(self, reference: list[int]) -> int:
        """How many nodes the reference continuation (reference[d] for drafted slot d + 1) walks down."""

        def token_after(node: int) -> int | None:
            slot = 0 if node == ANCHOR else self.depths[node] + 1
            return reference[slot] if slot < len(reference) else None

        return len(self.walk(token_after)[0])

    @classmethod
    def from_tensors(cls, tree: DraftTreeTensors) -> "DraftTree":
        """The nodes [0, count) of a device-built tree, read back (this waits for the device)."""
        count = int(tree.count)
        return cls(tokens=tree.tokens[:count].tolist(), parents=tree.parents[:count].tolist(),
                   depths=tree.depths[:count].tolist())


def build_draft_tree(logprobs, token_ids, budget: int) -> DraftTree:
    """The tree of the `budget` most probable drafted prefixes.

    logprobs / token_ids [D][K]: each drafted slot's K best tokens in `ranked_candidates`' order.
    Growth is best-first over the summed log-probs: each pop adds a node, then offers its next
    sibling and its first child. Ties follow the DDTree reference (liranringel/ddtree,
    `build_ddtree_tree`), made deterministic:
    - candidates: each slot's vocabulary ordered by fp32 logit descending, then token id ascending;
      a token's rank is its place there;
    - a prefix's score is the sum of its log-probs in float64;
    - of equal scores, the prefix whose rank path (r1, r2, ...) is lexicographically smaller pops
      first. So the tree of budget k is the first k prefixes in (score desc, rank path asc) order,
      and the top-K candidates serve every budget <= K.
    """
    tree = DraftTree()
    depth, width = len(logprobs), len(logprobs[0]) if len(logprobs) else 0
    if budget <= 0 or depth == 0:
        return tree
    # heap entries: (-score, rank path, parent node, parent score); the path's length - 1 is the depth
    heap = [(-logprobs[0][0], (0,), ANCHOR, 0.0)]
    while heap and len(tree) < budget:
        negative, path, parent, parent_score = heapq.heappop(heap)
        slot, rank = len(path) - 1, path[-1]
        node = len(tree)
        tree.tokens.append(int(token_ids[slot][rank]))
        tree.parents.append(parent)
        tree.depths.append(slot)
        if rank + 1 < width:
            heapq.heappush(heap, (-(parent_score + logprobs[slot][rank + 1]), path[:-1] + (rank + 1,), parent, parent_score))
        if slot + 1 < depth:
            heapq.heappush(heap, (negative - logprobs[slot + 1][0], path + (0,), node, -negative))
    return tree


def tree_attention_mask(tree: DraftTree, past: int, dtype: torch.dtype, device) -> torch.Tensor:
    """The additive attention mask [1, 1, 1 + n, past + 1 + n] of one verify forward over
    [anchor, node 0, ..., node n-1] after `past` cached positions: every row sees the cache and the
    anchor; a node also sees its ancestors and itself, never a sibling's branch."""
    n = len(tree)
    visible = torch.zeros(1 + n, past + 1 + n, dtype=torch.bool)
    visible[:, : past + 1] = True
    for node, parent in enumerate(tree.parents):
        if parent != ANCHOR:
            visible[1 + node] = visible[1 + parent]
        visible[1 + node, past + 1 + node] = True
    mask = torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, torch.finfo(dtype).min)
    return mask[None, None].to(device)


def tree_positions(tree: DraftTree, past: int) -> list[int]:
    """Position ids of [anchor, nodes...]: a node sits at anchor + its depth + 1."""
    return [past] + [past + 1 + depth for depth in tree.depths]
