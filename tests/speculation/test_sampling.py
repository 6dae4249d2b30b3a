"""Sampling at T > 0: both acceptance rules leave the target's distribution unchanged.

A scripted target over a 6-token vocabulary gives p(first token) and p(second | first); a
scripted drafter gives fixed q rows (as DFlash drafts every slot in parallel). Thousands of
two-token continuations decoded speculatively must follow p(x1) p(x2 | x1) by a chi-square test,
and the same test must reject two planted bugs: accepting the draft without the ratio, and
resampling a rejection from p instead of the residual max(0, p - q). The static speculative
step's rules (`acceptance.accept_sampled`, draws from given uniforms) pass the same test.
"""

import pytest
import torch

from dflash_pipeline.decoding.acceptance import accept_sampled
from dflash_pipeline.speculation.sampling import (
    draw,
    draw_with_uniforms,
    sampling_probs,
    verify_chain,
)

V = 5


def scripted_target():
    generator = torch.Generator().manual_seed(1)
    first = torch.softmax(2.0 * torch.randn(V, generator=generator), -1)
    second = torch.softmax(2.0 * torch.randn(V, V, generator=generator), -1)  # row = the first token
    third = torch.full((V, V, V), 1.0 / V)  # bonus row after two tokens: never looked at
    return first, second, third


def drafter_rows():
    generator = torch.Generator().manual_seed(2)
    return torch.softmax(2.0 * torch.randn(2, V, generator=generator), -1)  # q of slots 1 and 2, far from p


def two_tokens(rule, generator) -> tuple[int, int]:
    """Speculative decoding of two tokens with a 2-slot draft per step, as the engine loops:
    `rule` = (propose(q, generator) -> drafted tokens, verify(rows, drafted, q, generator))."""
    propose, verify = rule
    first, second, third = scripted_target()
    q = drafter_rows()
    committed: list[int] = []
    while len(committed) < 2:
        drafted = propose(q, generator)
        prefixes = [committed + drafted[:i] for i in range(3)]
        rows = torch.stack([first if len(p) == 0 else second[p[0]] if len(p) == 1 else third[p[0], p[1]] for p in prefixes])
        accepted, token = verify(rows, drafted, q, generator)
        committed += drafted[:accepted] + [token]
    return committed[0], committed[1]


def chi_square_p_value(pairs: list[tuple[int, int]]) -> float:
    first, second, _ = scripted_target()
    expected = (first[:, None] * second).flatten() * len(pairs)
    observed = torch.zeros(V * V)
    for a, b in pairs:
        observed[a * V + b] += 1
    statistic = float(((observed - expected) ** 2 / expected).sum())
    degrees = V * V - 1
    return float(torch.special.gammaincc(torch.tensor(degrees / 2, dtype=torch.float64), torch.tensor(statistic / 2, dtype=torch.float64)))


def sample_pairs(rule, count=3000, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [two_tokens(rule, generator) for _ in range(count)]


def sampled_draft(q, generator):
    return [draw(q[0], generator), draw(q[1], generator)]


def argmax_draft(q, generator):
    return [int(q[0].argmax()), int(q[1].argmax())]


def ratio(rows, drafted, q, generator):
    return verify_chain(rows, drafted, q, rule="ratio", generator=generator)


def match(rows, drafted, q, generator):
    return verify_chain(rows, drafted, None, rule="match", generator=generator)


def drawn_from_uniforms(q, generator):  # the static step's drafter: its draws invert q's CDF
    return draw_with_uniforms(q, torch.rand(2, generator=generator)).tolist()


def on_device(rule):
    def verify(rows, drafted, q, generator):
        count, token = accept_sampled(rows, torch.tensor(drafted), q, torch.rand(len(drafted) + 1, generator=generator), rule)
        return int(count), int(token)

    return verify


def accept_without_ratio(rows, drafted, q, generator):  # planted bug 1
    return len(drafted), draw(rows[len(drafted)], generator)


def resample_from_p(rows, drafted, q, generator):  # planted bug 2
    for slot, token in enumerate(drafted):
        if float(torch.rand((), generator=generator)) * float(q[slot, token]) >= float(rows[slot, token]):
            return slot, draw(rows[slot], generator)
    return len(drafted), draw(rows[len(drafted)], generator)


@pytest.mark.parametrize("rule", [(sampled_draft, ratio), (argmax_draft, match), (drawn_from_uniforms, on_device("ratio")),
                                  (argmax_draft, on_device("match"))], ids=["ratio", "match", "static-ratio", "static-match"])
def test_speculative_sampling_keeps_the_target_distribution(rule):
    assert chi_square_p_value(sample_pairs(rule)) > 1e-3


@pytest.mark.parametrize("bug", [accept_without_ratio, resample_from_p])
def test_the_distribution_test_catches_planted_bugs(bug):
    assert chi_square_p_value(sample_pairs((sampled_draft, bug))) < 1e-6


def test_a_drafter_equal_to_the_target_is_always_accepted_and_a_disjoint_one_never():
    generator = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25]])
    for _ in range(200):
        drafted = [draw(p[0], generator), draw(p[1], generator)]
        assert verify_chain(p, drafted, p[:2], rule="ratio", generator=generator)[0] == 2
    disjoint = torch.tensor([[0.0, 0.0, 0.5, 0.5], [0.0, 0.0, 0.0, 1.0]])
    firsts = []
    for _ in range(400):
        drafted = [draw(disjoint[0], generator), draw(disjoint[1], generator)]
        accepted, token = verify_chain(p, drafted, disjoint, rule="ratio", generator=generator)
        assert accepted == 0
        firsts.append(token)
    assert set(firsts) == {0, 1}  # the residual is p itself: only p's tokens, both of them


def test_sampling_probs_temperature_top_k_and_top_p():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    torch.testing.assert_close(sampling_probs(logits, 1.0), torch.softmax(logits, -1))
    torch.testing.assert_close(sampling_probs(logits, 0.5), torch.softmax(logits / 0.5, -1))
    top2 = sampling_probs(logits, 1.0, top_k=2)
    assert top2[2:].sum() == 0 and top2[:2].sum().item() == pytest.approx(1.0)
    # top_p keeps the smallest prefix whose mass reaches p: here the first token (0.64) and the second
    nucleus = sampling_probs(logits, 1.0, top_p=0.7)
    assert (nucleus > 0).tolist() == [True, True, False, False]
    with pytest.raises(ValueError, match="temperature must be > 0"):
        sampling_probs(logits, 0.0)
    with pytest.raises(ValueError, match="unknown acceptance rule 'greedy'"):
        verify_chain(torch.ones(1, 4) / 4, [], None, rule="greedy")
