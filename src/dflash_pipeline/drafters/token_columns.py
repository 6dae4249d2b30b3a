"""The map between token ids and the columns of a head restricted to a subset of the vocabulary
(a drafter's draft vocabulary, training's softmax vocabulary), or the whole one."""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenColumns:
    """The one map between token ids and the columns of a head restricted to a subset of the
    vocabulary (a drafter's draft vocabulary, training's softmax vocabulary), or the whole one."""

    token_ids: torch.Tensor | None  # [V'] the columns' token ids, ascending; None: column = token id

    def columns(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Token ids -> columns (-1 where the subset lacks the token)."""
        if self.token_ids is None:
            return token_ids
        vocab = self.token_ids.to(token_ids.device)
        column = torch.searchsorted(vocab, token_ids.long()).clamp(max=vocab.numel() - 1)
        return torch.where(vocab[column] == token_ids, column, torch.full_like(column, -1))

    def tokens(self, columns: torch.Tensor) -> torch.Tensor:
        """Columns -> token ids."""
        return columns if self.token_ids is None else self.token_ids.to(columns.device)[columns]
