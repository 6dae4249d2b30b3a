"""The engine's speculative step against an oracle drafter that knows the answer (`install_oracle`),
and the host oracles' proposer for the same mode (`host_proposer`)."""

import torch
from oracles.drafting import drafter_proposer, tree_proposer, verified_prefix

import dflash_pipeline.decoding.static_speculation as static
from dflash_pipeline.speculation.modes import DecodingMode


def install_oracle(monkeypatch, prompt_length: int, answer: list[int], vocab: int) -> "Oracle":
    """Patch the draft logits of the engine and of the host oracle loop with an oracle over
    `answer` (the prompt's greedy answer)."""
    import oracles.drafting as host_drafting

    import dflash_pipeline.drafters.architecture as architecture

    table = Oracle(prompt_length, answer, vocab)
    hidden = static.StaticDraftCache.hidden
    host_hidden = host_drafting.draft_hidden

    def static_hidden(self, head, anchor, start):
        table.position = start
        return hidden(self, head, anchor, start)

    def host_hidden_at(drafter, head, cache, anchor):
        table.position = cache.length
        return host_hidden(drafter, head, cache, anchor)

    def host_block(drafter, head, cache, anchor):
        table.position = cache.length
        return table.logits(drafter.config.block_size - 1)

    def oracle_logits(drafter, head, hidden):
        return table.logits(hidden.shape[0])

    monkeypatch.setattr(static.StaticDraftCache, "hidden", static_hidden)
    monkeypatch.setattr(static, "draft_logits", oracle_logits)
    monkeypatch.setattr(architecture, "draft_logits", oracle_logits)
    monkeypatch.setattr(host_drafting, "draft_hidden", host_hidden_at)
    monkeypatch.setattr(host_drafting, "draft_block", host_block)
    return table

def host_proposer(drafter, head, mode: DecodingMode):
    """The host loop's proposer of a decoding mode."""
    if mode.is_tree:
        return tree_proposer(drafter, head, mode.tree_budget)
    propose = drafter_proposer(drafter, head)
    return verified_prefix(propose, mode.verify_tokens) if mode.verify_tokens is not None else propose


class Oracle:
    """Draft logits from a table over answer positions: row j scores the answer token j."""

    def __init__(self, prompt_length: int, answer: list[int], vocab: int, seed: int = 0):
        generator = torch.Generator().manual_seed(seed)
        rows = len(answer) + 8
        self.table = torch.rand(rows, vocab, generator=generator)  # noise below 1
        ranks = torch.randint(0, 3, (rows,), generator=generator)  # 0: top, 1: behind a decoy, 2: lost in the noise
        for j, token in enumerate(answer + [answer[-1]] * 8):
            decoy = (token + 1 + j) % vocab
            if ranks[j] == 0:
                self.table[j, token] = 20.0
            elif ranks[j] == 1:
                self.table[j, decoy], self.table[j, token] = 20.0, 19.5
        self.prompt_length = prompt_length
        self.position = None  # the anchor's position: a device tensor (static path) or an int (host path)

    def logits(self, slots: int) -> torch.Tensor:
        rows = self.position + 1 + torch.arange(slots) - self.prompt_length
        return self.table[rows.clamp(0, self.table.shape[0] - 1)]
