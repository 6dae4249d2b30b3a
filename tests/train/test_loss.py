"""train/loss.py: the block loss adds up across data-parallel ranks, the chunked head's top-K and
hits are the plain logits', and distillation without the target's top-k in the shards is one line."""

import pytest
import torch

from dflash_pipeline.data.blocks import build_batch
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
    return batch, training_targets(batch, samples, 2.5)


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
