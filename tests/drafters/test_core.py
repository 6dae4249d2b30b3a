"""drafters/core.py: a draft vocabulary maps columns to token ids and back, and the feature scale
folds into fc."""

import torch

from dflash_pipeline.drafters.config import DrafterConfig
from dflash_pipeline.drafters.core import DFlashDrafter


def config(**overrides) -> DrafterConfig:
    values = dict(hidden_size=32, intermediate_size=64, num_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  vocab_size=40, block_size=4, target_layer_ids=(0, 2), num_target_layers=3, mask_token_id=39)
    values.update(overrides)
    return DrafterConfig(**values)


def test_a_draft_vocabulary_maps_columns_to_token_ids_and_back():
    drafter = DFlashDrafter(config())
    columns = torch.tensor([0, 1, 2])
    assert not drafter.has_draft_vocab and torch.equal(drafter.vocab_tokens(columns), columns)
    drafter.set_draft_vocab(torch.tensor([30, 4, 17, 4]))
    assert drafter.draft_vocab.tolist() == [4, 17, 30]
    assert drafter.vocab_tokens(columns).tolist() == [4, 17, 30]
    assert drafter.vocab_index(torch.tensor([17, 5, 30])).tolist() == [1, -1, 2]
    lm_head = torch.randn(40, 32)
    assert torch.equal(drafter.draft_head_weight(type("Head", (), {"lm_head_weight": lm_head})()), lm_head[[4, 17, 30]])
    drafter.set_draft_vocab(None)
    assert not drafter.has_draft_vocab


def test_the_feature_scale_folds_into_fc():
    torch.manual_seed(1)
    drafter = DFlashDrafter(config())
    features = torch.randn(3, 64)
    before = drafter.project_context(features * 2.0)
    drafter.feature_scale.fill_(2.0)
    torch.testing.assert_close(drafter.project_context(features), before)
    torch.testing.assert_close(drafter.folded_fc_weight(), drafter.fc.weight * 2.0)
