"""drafters/token_columns.py: token ids map to the columns of a vocabulary subset and back, -1 where
the subset lacks a token, and the whole vocabulary maps every id to itself."""

import torch

from dflash_pipeline.drafters.token_columns import TokenColumns


def test_a_subset_maps_token_ids_to_columns_and_back():
    subset = TokenColumns(torch.tensor([4, 17, 30]))
    assert subset.columns(torch.tensor([17, 5, 30, 4, 99])).tolist() == [1, -1, 2, 0, -1]
    assert subset.tokens(torch.tensor([2, 0, 1])).tolist() == [30, 4, 17]


def test_the_whole_vocabulary_is_the_identity():
    ids = torch.tensor([0, 7, 3])
    whole = TokenColumns(None)
    assert torch.equal(whole.columns(ids), ids) and torch.equal(whole.tokens(ids), ids)
