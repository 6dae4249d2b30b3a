"""The speculative step's acceptance rules, on the device and without a read back to the host:
the longest drafted path the target's argmax agrees with (T = 0, chains and trees), and a chain's
sampled acceptance at T > 0 with its randomness given as uniforms (`static_speculation` runs them
in its verify phase).
"""

import torch

from dflash_pipeline.speculation.sampling import draw_with_uniforms
from dflash_pipeline.speculation.trees import ANCHOR


def accept_greedy(choice: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor, depth: int):
    """The longest drafted path the target's argmax agrees with, on the device.

    choice [1 + n]: the target's argmax after the anchor (row 0) and after each node (row 1 + i);
    tokens / parents / depths [n]: the draft tree (a chain: parent i - 1, depth i; padding nodes:
    parent `trees.PADDING`); depth: the most levels a path can have. A node is accepted when its
    parent is (the anchor always is) and its token is the target's choice after its parent;
    siblings carry distinct tokens, so the accepted nodes form one path.
    Returns (accepted count, the path's nodes by depth [depth] (entries past the count are 0),
    the target's bonus token after the path's end [1]).
    """
    after_parent = choice.gather(0, (parents + 1).clamp(min=0))
    agrees = (tokens == after_parent) & (parents >= ANCHOR)  # padding nodes never
    accepted = torch.zeros_like(agrees)
    for _ in range(depth):  # one level per hop
        accepted = agrees & torch.where(parents >= 0, accepted.gather(0, parents.clamp(min=0)), parents == ANCHOR)
    count = accepted.sum()
    nodes = torch.arange(tokens.shape[0], device=tokens.device)
    by_depth = torch.zeros(depth + 1, dtype=torch.long, device=tokens.device)  # the last entry takes what is not accepted
    path = by_depth.scatter_(0, torch.where(accepted, depths.clamp(min=0, max=depth), depth), nodes)[:depth]
    deepest = torch.where(count > 0, path.gather(0, (count - 1).clamp(min=0).view(1)) + 1, 0)
    return count, path, choice.gather(0, deepest)


def accept_sampled(p: torch.Tensor, tokens: torch.Tensor, q: torch.Tensor | None, uniforms: torch.Tensor, rule: str):
    """`sampling.verify_chain` on the device, its randomness the `uniforms` [k + 1] it is given.

    p [k + 1, V]: the target's sampling distribution after the anchor and after each drafted
    prefix; tokens [k]: the drafted chain; q [k, V]: the drafter's distributions (rule "ratio").
    "match" compares the target's own draws with the drafted tokens; "ratio" accepts x with
    probability min(1, p(x) / q(x)) and draws a rejected slot's token from the normalised
    max(0, p - q). Returns (accepted count, the committed token after them [1]).
    """
    k = tokens.shape[0]
    if rule == "match":
        draws = draw_with_uniforms(p, uniforms[: k + 1])
        count = torch.cumprod((draws[:k] == tokens).long(), 0).sum()
        return count, draws.gather(0, count.view(1))
    p_token, q_token = p[:k].gather(1, tokens[:, None])[:, 0], q.gather(1, tokens[:, None])[:, 0]
    count = torch.cumprod((uniforms[:k] * q_token < p_token).long(), 0).sum()  # u < p/q without dividing by a zero q
    residual = (p[:k] - q).clamp(min=0.0)
    total = residual.sum(-1, keepdim=True)
    # total is 0 only where p <= q everywhere, i.e. p == q up to rounding: then p itself
    rows = torch.cat([torch.where(total > 0, residual / total.clamp(min=torch.finfo(total.dtype).tiny), p[:k]), p[k:]])
    return count, draw_with_uniforms(rows.index_select(0, count.view(1)), uniforms[k : k + 1])
