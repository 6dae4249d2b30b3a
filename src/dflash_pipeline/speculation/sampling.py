"""Verifying a drafted chain at temperature T > 0 without changing the target's distribution.

Two acceptance rules, both lossless (every committed token is distributed as the target samples it):

- "match": the drafter proposes its argmax (a one-hot q); the target samples each verified
  position in turn and the draft is accepted while it equals the target's sample. The first
  sample that differs is committed as the target's own token. DFlash's and DDTree's reference
  decoders and vLLM's default use this rule.
- "ratio": speculative sampling. The drafter samples x_i from its q_i; x_i is accepted with
  probability min(1, p_i(x_i) / q_i(x_i)); on a rejection the committed token is drawn from the
  normalised max(0, p_i - q_i). DFlash drafts every slot in parallel, so q_i does not depend on
  x_1..x_{i-1}; the rule stays exact, since x_i is drawn independently of the earlier slots.

If every drafted token is accepted, a bonus token is drawn from the target at the next position.
p and q are taken at the same temperature, top-k and top-p (`sampling_probs`).
"""

import torch

RULES = ("match", "ratio")


def sampling_probs(logits: torch.Tensor, temperature: float, *, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Probabilities [..., V] of sampling from `logits` at `temperature` (> 0), keeping the `top_k`
    most probable tokens (0: all) and the smallest set whose mass reaches `top_p` (1: all)."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 to sample, got {temperature}")
    scores = logits.float() / temperature
    if 0 < top_k < scores.shape[-1]:
        kth = scores.topk(top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if top_p < 1.0:
        ordered, order = probs.sort(dim=-1, descending=True)
        before = ordered.cumsum(-1) - ordered  # mass of the tokens ranked above each one
        ordered = ordered.masked_fill(before >= top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, ordered)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from a [V] distribution."""
    return int(torch.multinomial(probs, 1, generator=generator))


def draw_with_uniforms(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Token ids [...] drawn from distributions probs [..., V] by inverting their CDFs at uniforms
    [...] in [0, 1). The randomness is an input (filled by a seeded generator outside), so a
    compiled or graph-captured step can sample without a generator object and without a read
    back. The CDF is summed in float64; a draw never lands past the last token with mass."""
    cdf = probs.double().cumsum(-1)
    threshold = uniforms.double()[..., None] * cdf[..., -1:]
    index = torch.searchsorted(cdf, threshold, right=True)[..., 0]
    columns = torch.arange(probs.shape[-1], device=probs.device)
    last_with_mass = torch.where(probs > 0, columns, -1).amax(-1)
    return torch.minimum(index, last_with_mass)


def verify_chain(target_probs: torch.Tensor, drafted: list[int], draft_probs: torch.Tensor | None, *, rule: str,
                 generator: torch.Generator | None = None) -> tuple[int, int]:
    """(accepted, next_token) for one verify step.

    `target_probs` [k+1, V]: the target's sampling distribution after the anchor and after each
    drafted prefix (one target forward over [anchor, drafted]); `drafted` the k drafted tokens;
    `draft_probs` [k, V] the drafter's q for each slot (rule "ratio"; unused by "match").
    The committed tokens are drafted[:accepted] + [next_token].
    """
    if rule not in RULES:
        raise ValueError(f"unknown acceptance rule {rule!r} (known: {', '.join(RULES)})")
    for slot, token in enumerate(drafted):
        p = target_probs[slot]
        if rule == "match":
            sampled = draw(p, generator)
            if sampled != token:
                return slot, sampled
            continue
        q = draft_probs[slot]
        uniform = float(torch.rand((), generator=generator))
        if uniform * float(q[token]) < float(p[token]):  # u < p/q, without dividing by a zero q
            continue
        residual = (p - q).clamp(min=0.0)
        total = float(residual.sum())
        # total is 0 only where p <= q everywhere, i.e. p == q up to rounding: then p itself
        return slot, draw(residual / total if total > 0 else p, generator)
    return len(drafted), draw(target_probs[len(drafted)], generator)


class Sampling:
    """How to sample: temperature (> 0), acceptance rule, top-k / top-p, and the seed of the
    decode's own random stream (a run with the same seed samples the same tokens)."""

    def __init__(self, temperature: float, *, rule: str = "match", top_k: int = 0, top_p: float = 1.0, seed: int = 0):
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0 to sample, got {temperature} (0 means greedy: pass no Sampling)")
        if rule not in RULES:
            raise ValueError(f"unknown acceptance rule {rule!r} (known: {', '.join(RULES)})")
        if top_k < 0 or not 0 < top_p <= 1:
            raise ValueError(f"top_k must be >= 0 and top_p in (0, 1], got {top_k} and {top_p}")
        self.temperature, self.rule, self.top_k, self.top_p, self.seed = temperature, rule, top_k, top_p, seed

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """Sampling distributions of logits [..., V], on the CPU (where the seeded draws happen)."""
        return sampling_probs(logits.float().cpu(), self.temperature, top_k=self.top_k, top_p=self.top_p)

    def reseeded(self, seed: int) -> "Sampling":
        return Sampling(self.temperature, rule=self.rule, top_k=self.top_k, top_p=self.top_p, seed=seed)

    def generator(self, offset: int = 0) -> torch.Generator:
        return torch.Generator().manual_seed(self.seed + offset)
