"""train/loss.py: the block loss adds up across data-parallel ranks, the chunked head's top-K and
hits are the plain logits', and distillation without the target's top-k in the shards is one line."""

import pytest
import torch

from dflash_pipeline.data.blocks import build_batch, valid_anchors
from dflash_pipeline.data.shards import Sample
from dflash_pipeline.drafters.core import DFlashDrafter
from dflash_pipeline.drafters.config import DrafterConfig
from dflash_pipeline.foundation.errors import PipelineError
from dflash_pipeline.target.load import TargetHead
from dflash_pipeline.train.loss import (
    ChunkedHeadCrossEntropy,
    TrainingVocabulary,
    block_loss,
    decay_weights,
    default_gamma,
    training_targets,
)

VOCAB, HIDDEN = 61, 32


@pytest.fixture(scope="module")
def drafter_head_samples():
    torch.manual_seed(0)
    config = DrafterConfig(hidden_size=HIDDEN, intermediate_size=64, num_layers=1, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=8, vocab_size=VOCAB, block_size=4, target_layer_ids=(0, 2), num_target_layers=3,
                           mask_token_id=VOCAB - 1)
    drafter = DFlashDrafter(config)
    head = TargetHead(torch.randn(VOCAB, HIDDEN), torch.randn(VOCAB, HIDDEN))
    samples = []
    for index in range(4):
        ids = torch.randint(0, VOCAB - 1, (24,))
        mask = torch.tensor([0] * 6 + [1] * 18, dtype=torch.uint8)
        samples.append(Sample(f"s{index}", ids, mask, ids, torch.randn(24, config.feature_width)))
    return drafter, head, samples


def batch_of(samples, seeds):
    batch = build_batch(samples, anchors_per_sequence=5, block_size=4, mask_token_id=VOCAB - 1, anchor_seeds=seeds)
    return batch, training_targets(batch, samples, 2.5, block_size=4)


@pytest.mark.parametrize("block_size, gamma", [(16, 7.0), (8, 4.0), (4, 2.5), (12, 5.5), (2, 1.75)])
def test_default_gamma_is_dflashs_and_linear_between(block_size, gamma):
    assert default_gamma(block_size) == gamma
    assert decay_weights(block_size, gamma)[0] == 1.0 and decay_weights(block_size, gamma).shape == (block_size - 1,)



def test_two_ranks_normalised_by_the_global_weight_add_up_to_one_process(drafter_head_samples):
    drafter, head, samples = drafter_head_samples
    whole = batch_of(samples, [0, 1, 2, 3])
    halves = [batch_of(samples[:2], [0, 1]), batch_of(samples[2:], [2, 3])]
    total_weight = whole[1].weights.sum()
    assert sum(targets.weights.sum() for _, targets in halves) == pytest.approx(float(total_weight))
    with torch.no_grad():
        result = block_loss(drafter, head, *whole, logits_chunk=7)
        parts = [block_loss(drafter, head, *half, logits_chunk=7, weight_total=total_weight).loss for half in halves]
    assert float(result.weight_sum) == pytest.approx(float(total_weight))
    assert float(sum(parts)) == pytest.approx(float(result.loss), rel=1e-5)
    assert result.hits.shape == whole[0].labels.shape and result.hits.dtype == torch.bool


def test_the_chunked_heads_top_k_and_hits_are_the_plain_logits(drafter_head_samples):
    _, head, _ = drafter_head_samples
    torch.manual_seed(1)
    hidden, labels, weights = torch.randn(9, HIDDEN), torch.randint(0, VOCAB, (9,)), torch.rand(9)
    logits = hidden @ head.lm_head_weight.T
    for chunk in (1, 4, 9):
        total, hits, top = ChunkedHeadCrossEntropy.apply(hidden, head.lm_head_weight, labels, weights, chunk, None, None, 5)
        assert torch.equal(top, logits.topk(5, dim=-1).indices) and torch.equal(hits, logits.argmax(-1) == labels)
        expected = (torch.nn.functional.cross_entropy(logits, labels, reduction="none") * weights).sum()
        assert float(total) == pytest.approx(float(expected), rel=1e-5)


def test_a_data_vocabulary_maps_absent_tokens_to_minus_one():
    head = TargetHead(torch.randn(10, 4), torch.randn(10, 4))
    vocabulary = TrainingVocabulary.from_tokens(head, torch.tensor([7, 2, 7, 5]))
    assert vocabulary.token_ids.tolist() == [2, 5, 7]
    assert vocabulary.map(torch.tensor([2, 3, 7])).tolist() == [0, -1, 2]
    assert torch.equal(vocabulary.head_rows, head.lm_head_weight[[2, 5, 7]])
    full = TrainingVocabulary.full(head)
    assert full.map(torch.tensor([3])).tolist() == [3] and full.head_rows is head.lm_head_weight


def test_distillation_without_the_targets_top_k_is_one_line(drafter_head_samples):
    drafter, head, samples = drafter_head_samples
    with pytest.raises(PipelineError, match=r"distill_weight > 0 needs the target's top-k in the shards \(capture.target_top_k > 0\)"):
        block_loss(drafter, head, *batch_of(samples[:1], [0]), logits_chunk=8, distill_weight=0.5)


def test_chunked_head_loss_and_gradient_equal_plain_cross_entropy():
    torch.manual_seed(0)
    hidden = torch.randn(37, 16, dtype=torch.float64, requires_grad=True)
    head = torch.randn(50, 16, dtype=torch.float64)
    labels = torch.randint(0, 50, (37,))
    weights = torch.rand(37, dtype=torch.float64)
    reference = (F_cross_entropy(hidden @ head.T, labels) * weights).sum()
    (expected_grad,) = torch.autograd.grad(reference, hidden)
    for chunk in (1, 8, 37, 100):
        total, hits = ChunkedHeadCrossEntropy.apply(hidden, head, labels, weights, chunk)
        (grad,) = torch.autograd.grad(total * 3.0, hidden)
        # Logits are computed in float32 (as on CPU training), hence float32 tolerances.
        torch.testing.assert_close(total.double(), reference, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(grad, expected_grad * 3.0, rtol=1e-5, atol=1e-5)
        assert torch.equal(hits, (hidden @ head.T).argmax(-1) == labels)


def F_cross_entropy(logits, labels):
    return torch.nn.functional.cross_entropy(logits, labels, reduction="none")


def _sample(ids, mask, width=6):
    ids = torch.tensor(ids)
    return Sample("s", ids, torch.tensor(mask, dtype=torch.uint8), ids, torch.zeros(len(ids), width))


def test_anchors_labels_and_weights_follow_the_recipe():
    mask = [0, 0, 1, 1, 1, 0, 1, 1]
    assert valid_anchors(torch.tensor(mask)).tolist() == [2, 3, 6]
    sample = _sample([10, 11, 12, 13, 14, 15, 16, 17], mask)
    batch = build_batch([sample], anchors_per_sequence=10, block_size=4, mask_token_id=99, anchor_seeds=[0])
    assert batch.block_ids.view(-1, 4).tolist() == [[12, 99, 99, 99], [13, 99, 99, 99], [16, 99, 99, 99]]
    assert batch.block_positions.view(-1, 4)[2].tolist() == [6, 7, 8, 9]
    assert batch.labels.tolist()[0] == [13, 14, 15]
    decay = decay_weights(4, 4.0).tolist()
    # Anchor 2: slot 3 predicts position 5, outside the answer; anchor 6: slots past the end weigh 0.
    weights = training_targets(batch, [sample], 4.0, block_size=4).weights
    assert weights.tolist()[0] == pytest.approx([decay[0], decay[1], 0.0])
    assert weights.tolist()[2] == pytest.approx([decay[0], 0.0, 0.0])
    again = build_batch([sample], anchors_per_sequence=2, block_size=4, mask_token_id=99, anchor_seeds=[5])
    assert torch.equal(again.block_ids, build_batch([sample], anchors_per_sequence=2, block_size=4, mask_token_id=99, anchor_seeds=[5]).block_ids)


def test_the_decay_runs_over_the_drafters_block_and_a_batch_of_another_is_refused():
    """The drafter's config is the truth of the block geometry (train.prepare passes its block
    size): the loss weights decay over its B-1 slots, and a batch packed for another drafter is
    refused in one line instead of decaying over the batch's own block."""
    sample = _sample([10, 11, 12, 13, 14, 15, 16, 17], [0, 0, 1, 1, 1, 0, 1, 1])
    batch = build_batch([sample], anchors_per_sequence=10, block_size=4, mask_token_id=99, anchor_seeds=[0])
    assert training_targets(batch, [sample], 4.0, block_size=4).weights.shape == (3, 3)
    with pytest.raises(PipelineError, match=r"^train: a batch of blocks of 4 for a drafter of block size 8$"):
        training_targets(batch, [sample], 4.0, block_size=8)


def test_data_vocabulary_softmax_is_the_full_softmax_restricted_to_those_rows():
    from dflash_pipeline.target.load import TargetHead
    from dflash_pipeline.train.loss import TrainingVocabulary

    torch.manual_seed(5)
    head = TargetHead(torch.randn(30, 8), torch.randn(30, 8))
    vocabulary = TrainingVocabulary.from_tokens(head, torch.tensor([7, 3, 3, 21, 9]))
    assert vocabulary.head_rows.shape == (4, 8)
    labels = torch.tensor([3, 21, 4])
    mapped = vocabulary.map(labels)
    assert mapped.tolist() == [0, 3, -1]  # 4 never occurs in the data
    hidden = torch.randn(2, 8)
    subset_logits = hidden @ head.lm_head_weight[torch.tensor([3, 7, 9, 21])].T
    expected = torch.nn.functional.cross_entropy(subset_logits, mapped[:2], reduction="sum")
    total, _ = ChunkedHeadCrossEntropy.apply(hidden, vocabulary.head_rows, mapped[:2], torch.ones(2), 1)
    torch.testing.assert_close(total, expected)


def test_distillation_loss_and_gradient_equal_a_plain_reference():
    # (1 - a)·CE(answer token) + a·CE(target's renormalised top-K), written out with plain torch ops.
    from dflash_pipeline.target.load import TargetHead
    from dflash_pipeline.train.loss import TrainingVocabulary, distillation_targets

    torch.manual_seed(1)
    rows, hidden_size, vocab, top_k = 29, 16, 60, 5
    hidden = torch.randn(rows, hidden_size, dtype=torch.float64, requires_grad=True)
    head_weight = torch.randn(vocab, hidden_size, dtype=torch.float64)
    labels = torch.randint(0, vocab, (rows,))
    weights = torch.rand(rows, dtype=torch.float64)
    topk_ids = torch.stack([torch.randperm(vocab)[:top_k] for _ in range(rows)])
    topk_logprobs = -torch.rand(rows, top_k) * 6
    vocabulary = TrainingVocabulary.full(TargetHead(head_weight, head_weight))
    for alpha in (0.0, 0.5, 1.0):
        log_q = torch.log_softmax(hidden @ head_weight.T, dim=-1)
        p_target = torch.softmax(topk_logprobs.double(), dim=-1)
        hard = -log_q.gather(1, labels[:, None])[:, 0]
        soft = -(p_target * log_q.gather(1, topk_ids)).sum(1)
        reference = (((1 - alpha) * hard + alpha * soft) * weights).sum()
        (expected_grad,) = torch.autograd.grad(reference, hidden)
        ids, probs = distillation_targets(labels, topk_ids, topk_logprobs, alpha, vocabulary)
        assert ids.shape == probs.shape == (rows, top_k + 1)
        torch.testing.assert_close(probs.sum(1), torch.ones(rows), rtol=1e-6, atol=1e-6)
        for chunk in (1, 7, 100):
            total, hits = ChunkedHeadCrossEntropy.apply(hidden, head_weight, labels, weights, chunk, ids, probs.double())
            (grad,) = torch.autograd.grad(total * 2.0, hidden)
            torch.testing.assert_close(total.double(), reference, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(grad, expected_grad * 2.0, rtol=1e-5, atol=1e-5)
            assert torch.equal(hits, (hidden @ head_weight.T).argmax(-1) == labels)
    # At a = 1 the gradient vanishes exactly where q equals the renormalised top-K.
    target_logits = torch.full((1, vocab), -1e4, dtype=torch.float64)
    target_logits[0, topk_ids[0]] = topk_logprobs[0].double()
    zero_hidden = torch.zeros(1, vocab, dtype=torch.float64, requires_grad=True)
    ids, probs = distillation_targets(labels[:1], topk_ids[:1], topk_logprobs[:1], 1.0, vocabulary)
    total, _ = ChunkedHeadCrossEntropy.apply(zero_hidden + target_logits, torch.eye(vocab, dtype=torch.float64), labels[:1],
                                             torch.ones(1, dtype=torch.float64), 4, ids, probs.double())
    (grad,) = torch.autograd.grad(total, zero_hidden)
    assert grad.abs().max() < 1e-6  # float32 logits: zero up to rounding (a wrong target gives ~0.1)


def test_distillation_targets_drop_tokens_outside_a_restricted_vocabulary():
    from dflash_pipeline.target.load import TargetHead
    from dflash_pipeline.train.loss import TrainingVocabulary, distillation_targets

    head = TargetHead(torch.randn(30, 8), torch.randn(30, 8))
    vocabulary = TrainingVocabulary.from_tokens(head, torch.tensor([3, 7, 9]))
    ids, probs = distillation_targets(vocabulary.map(torch.tensor([7])), torch.tensor([[7, 4, 9]]), torch.log(torch.tensor([[0.5, 0.3, 0.2]])),
                                      0.5, vocabulary)
    assert ids.tolist() == [[1, 1, 0, 2]]  # 7 -> row 1, 4 is absent (probability 0), 9 -> row 2
    torch.testing.assert_close(probs, torch.tensor([[0.5, 0.25, 0.0, 0.1]]))


def test_each_slot_is_distilled_from_the_target_distribution_before_it():
    # Slot k of the block at anchor a predicts token a + k: the target's distribution at a + k - 1.
    ids = list(range(10, 18))
    sample = _sample(ids, [0, 0, 1, 1, 1, 1, 1, 1])
    positions = torch.arange(len(ids), dtype=torch.int32)
    sample.target_topk_ids = torch.stack([positions * 100, positions * 100 + 1], dim=1)
    sample.target_topk_logprobs = -positions.float()[:, None].repeat(1, 2)
    batch = build_batch([sample], anchors_per_sequence=10, block_size=4, mask_token_id=99, anchor_seeds=[0])
    targets = training_targets(batch, [sample], 4.0, block_size=4)
    for block, anchor in enumerate(batch.anchors.tolist()):
        expected = [min(anchor + k, len(ids) - 1) - 1 for k in (1, 2, 3)]
        assert (targets.soft_ids[block, :, 0] // 100).tolist() == expected
        assert (-targets.soft_logprobs[block, :, 0]).tolist() == expected
    assert training_targets(build_batch([_sample(ids, [0, 0, 1, 1, 1, 1, 1, 1])], anchors_per_sequence=2, block_size=4, mask_token_id=99, anchor_seeds=[0]), [_sample(ids, [0, 0, 1, 1, 1, 1, 1, 1])], 4.0, block_size=4).soft_ids is None


def test_selector_loss_is_k_way_cross_entropy_with_the_answer_put_in_when_missing():
    from dflash_pipeline.drafters.dflash2 import CandidateSelector, selector_loss

    torch.manual_seed(0)
    selector = CandidateSelector(hidden_size=8, vocab_size=40, rank=4, top_k=3)
    with torch.no_grad():
        selector.successor_codebook.normal_()
    hidden, head_rows = torch.randn(5, 8, requires_grad=True), torch.randn(12, 8)
    token_ids = torch.arange(12) * 3  # a draft vocabulary: column c is token 3c
    logits = hidden.detach() @ head_rows.T
    columns = logits.topk(3, dim=-1).indices
    labels = torch.tensor([int(columns[0, 0]), int(columns[1, 2]), 0, 0, 0])
    labels[2:] = torch.tensor([c for c in range(12) if c not in columns[2]][0])  # not among row 2's candidates
    labels[3], labels[4] = int(columns[3, 1]), int(columns[4, 0])
    predecessors, weights = torch.tensor([5, 9, 13, 17, 21]), torch.tensor([1.0, 0.5, 0.25, 2.0, 0.0])

    total, covered, hits = selector_loss(selector, hidden, head_rows, columns, labels, predecessors, weights, token_ids=token_ids)
    expected, expected_hits = 0.0, []
    for n in range(5):
        candidates = columns[n].tolist()
        if labels[n] not in candidates:
            candidates[-1] = int(labels[n])
        context = selector.predecessor_codebook[predecessors[n]] * (selector.hidden_projection.weight @ hidden[n])
        scores = torch.stack([hidden[n] @ head_rows[c] + context @ selector.successor_codebook[token_ids[c]] for c in candidates])
        target = candidates.index(int(labels[n]))
        expected = expected + weights[n] * (torch.logsumexp(scores, 0) - scores[target])
        expected_hits.append(int(scores.argmax()) == target)
    torch.testing.assert_close(total, expected)
    assert covered.tolist() == [True, True, False, True, True] and hits.tolist() == expected_hits
    total.backward()
    assert hidden.grad.abs().sum() > 0 and selector.successor_codebook.grad[token_ids[labels[0]]].abs().sum() > 0

    # The candidates come from the same head pass as the loss: each row's top-K, best first.
    _, _, top = ChunkedHeadCrossEntropy.apply(hidden.detach(), head_rows, labels, weights, 2, None, None, 3)
    assert torch.equal(top, columns)


def test_a_tiny_dflash2_drafter_overfits_one_batch_and_its_selector_learns():
    from dflash_pipeline.drafters.core import DFlashDrafter
    from dflash_pipeline.drafters.config import DrafterConfig
    from dflash_pipeline.drafters.dflash2 import DFlash2LossOptions
    from dflash_pipeline.target.load import TargetHead
    from dflash_pipeline.train.loss import block_loss

    torch.manual_seed(0)
    config = DrafterConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=8, vocab_size=50, block_size=4, target_layer_ids=(0, 1), num_target_layers=2, mask_token_id=49,
                           architecture="dflash2", options=dict(conv_group_size=8, selector_rank=8, selector_top_k=4))
    drafter = DFlashDrafter(config).train()
    head = TargetHead(torch.randn(50, 32), torch.randn(50, 32))
    samples = [_sample(torch.randint(0, 48, (24,)).tolist(), [0] * 4 + [1] * 20, width=64) for _ in range(2)]
    for sample in samples:
        sample.features.normal_()
    batch = build_batch(samples, anchors_per_sequence=6, block_size=4, mask_token_id=49, anchor_seeds=[0, 1])
    targets = training_targets(batch, samples, 4.0, block_size=4)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    curve = []
    for _ in range(60):
        result = block_loss(drafter, head, batch, targets, logits_chunk=16, loss_options=DFlash2LossOptions(selector_weight=1.0))
        loss, stats = result.loss, result.extra_stats
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        curve.append((loss.item(), float(stats["selector_loss"]), int(stats["selector_hits"]) / int(stats["selector_slots"])))
    (first_loss, first_selector, _), (last_loss, last_selector, last_hits) = curve[0], curve[-1]
    assert last_loss < 0.3 * first_loss and last_selector < 0.3 * first_selector and last_hits > 0.9, curve[::10]
    assert drafter.layers[0].mlp_conv.kernel_projection.weight.abs().sum() > 0  # the convolution left the identity
    plain = block_loss(drafter, head, batch, targets, logits_chunk=16, loss_options=DFlash2LossOptions(selector_weight=0.0)).loss
    assert plain.item() < loss.item()  # the selector term was part of the loss
