"""decoding/session.py: one decoding session on the tiny Llama, decoding losslessly in every mode,
sharing its target between drafters, refusing a sampled tree by the mode's one rule, and refusing
a drafter that reads other layers."""

import pytest
import torch

from dflash_pipeline.decoding.session import open_session
from dflash_pipeline.drafters.core import DFlashDrafter
from dflash_pipeline.drafters.config import DrafterConfig
from dflash_pipeline.foundation.errors import PipelineError
from dflash_pipeline.speculation.modes import DecodingMode
from dflash_pipeline.speculation.sampling import Sampling


def tiny_drafter(layer_ids=(1, 3), seed=0) -> DFlashDrafter:
    torch.manual_seed(seed)
    return DFlashDrafter(DrafterConfig(hidden_size=64, intermediate_size=128, num_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                       head_dim=16, vocab_size=49152, block_size=5, target_layer_ids=tuple(layer_ids),
                                       num_target_layers=4, mask_token_id=0))


@pytest.fixture(scope="module")
def target(tiny_llama_target):
    return tiny_llama_target


@pytest.fixture(scope="module")
def session(target):
    return open_session(target, tiny_drafter(), device="cpu")


PROMPT = [1, 504, 3112, 314, 253, 1345, 30, 2]


def test_a_session_holds_the_target_its_head_and_the_drafters_layers(session, target):
    assert session.layer_ids == (1, 3) and session.eos_ids == set(target.eos_token_ids)
    assert session.head.embed_weight.shape == (target.vocab_size, target.hidden_size) and session.head.embed_weight.dtype == torch.float32
    assert not session.drafter.training and not session.model.training
    # the engine records the drafter's layers itself: a session hangs no hooks on the target
    assert not any(module._forward_hooks for module in session.model.modules())


@pytest.mark.parametrize("mode", [DecodingMode.chain(), DecodingMode.chain(2), DecodingMode.tree(6)], ids=["chain", "chain-2", "tree-6"])
def test_every_greedy_mode_decodes_what_the_target_alone_decodes(session, mode):
    plain = session.plain(PROMPT, max_new_tokens=12)
    run = session.decode(PROMPT, session.speculation(mode), max_new_tokens=12)
    assert run.tokens == plain.tokens and len(run.tokens) == 12
    assert run.steps and 1 + sum(run.steps) >= len(run.tokens)  # the prefill makes the first token


def test_a_chain_verifies_b_minus_1_tokens_or_the_verified_prefix(session):
    assert session.speculation().mode == DecodingMode.chain()  # all B-1
    assert session.speculation(DecodingMode.chain(99)).mode == DecodingMode.chain(4)  # at most B-1 (block size 5)
    run = session.decode(PROMPT, session.speculation(DecodingMode.chain(1)), max_new_tokens=12)
    assert run.drafted == len(run.steps) and max(run.steps) <= 2  # one drafted token and the bonus per step


def test_sampled_chains_repeat_with_the_seed(session):
    for rule in ("ratio", "match"):
        runs = [session.decode(PROMPT, session.speculation(), max_new_tokens=8, sampling=Sampling(1.0, rule=rule, seed=7)).tokens
                for _ in range(2)]
        assert runs[0] == runs[1] and len(runs[0]) == 8


def test_tree_decoding_is_greedy_only_by_the_modes_one_rule_from_every_entry(session):
    """One rule (`modes.check_tree_rule`), one error line, wherever a sampled tree comes in: the
    session, `speculative_decode`, `Speculation.decode` and the step itself (the console command's
    wording of it: tests/cli/test_decode.py)."""
    from dflash_pipeline.decoding.session import speculative_decode
    from dflash_pipeline.decoding.static_speculation import SpeculativeStep

    tree, sampling = session.speculation(DecodingMode.tree(4)), Sampling(1.0)
    line = r"^tree_budget: tree verification is greedy and verifies the whole tree \(drop sampling\)$"
    entries = [lambda: session.decode(PROMPT, tree, max_new_tokens=4, sampling=sampling),
               lambda: speculative_decode(session.model, tree, PROMPT, max_new_tokens=4, eos_ids=session.eos_ids, sampling=sampling),
               lambda: tree.decode(session.model, PROMPT, max_new_tokens=4, eos_ids=session.eos_ids, sampling=sampling),
               lambda: SpeculativeStep(session.model, session.drafter, session.head, capacity=16, max_new_tokens=4, eos_ids={2},
                                       mode=tree.mode, sampling=sampling)]
    for entry in entries:
        with pytest.raises(PipelineError, match=line):
            entry()
    with pytest.raises(PipelineError, match=r"^tree_budget: tree verification .* \(drop verify_tokens\)$"):
        DecodingMode(tree_budget=4, verify_tokens=2)
    assert session.decode(PROMPT, tree, max_new_tokens=4).tokens == session.plain(PROMPT, max_new_tokens=4).tokens  # greedy: fine


def test_drafters_that_read_the_same_layers_share_one_session(session):
    other = session.with_drafter(tiny_drafter(seed=1))
    assert other.model is session.model and other.head is session.head
    assert other.drafter is not session.drafter
    assert other.decode(PROMPT, other.speculation(), max_new_tokens=8).tokens == session.plain(PROMPT, max_new_tokens=8).tokens


def test_a_drafter_of_other_layers_is_refused_naming_both(session, target):
    with pytest.raises(PipelineError, match=r"drafter reads target layers \[0, 2\], but the session taps \[1, 3\]"):
        session.with_drafter(tiny_drafter(layer_ids=(0, 2)))
    with pytest.raises(PipelineError, match=r"drafter reads target layers \[1, 3\], but the session taps \[1, 2\]"):
        open_session(target, tiny_drafter(), device="cpu", layer_ids=[1, 2])
