"""decoding/acceptance.py: the greedy rule walks a draft tree on the device (the sampled rule's
distribution test, beside the host rules: tests/speculation/test_sampling.py)."""

import torch

from dflash_pipeline.decoding.acceptance import accept_greedy
from dflash_pipeline.speculation.trees import PADDING


def test_accept_greedy_walks_the_tree_and_skips_padding():
    # tree: node 0 (depth 0) and node 1 (its sibling), node 2 under node 1, node 3 under node 2, node 4 padding
    tokens = torch.tensor([5, 6, 7, 8, 9])
    parents = torch.tensor([-1, -1, 1, 2, PADDING])
    depths = torch.tensor([0, 0, 1, 2, -1])
    choice = torch.tensor([6, 0, 7, 8, 4, 0])  # after anchor: 6 (node 1), after node 1: 7 (node 2), after node 2: 8 (node 3), after node 3: 4
    count, path, bonus = accept_greedy(choice, tokens, parents, depths, 3)
    assert int(count) == 3 and path.tolist() == [1, 2, 3] and bonus.tolist() == [4]
    choice[0] = 9  # the padding node's token: nothing is accepted
    count, path, bonus = accept_greedy(choice, tokens, parents, depths, 3)
    assert int(count) == 0 and bonus.tolist() == [9]
