"""Speculative decoding's entry: the target, its frozen head, the layer tap and a drafter, put together once.

Speculative decoding needs things that must agree: the target model (and its tokenizer), the
target's frozen embedding and LM head (the drafter drafts through them), the decoder layers the
drafter was trained on (the engine records their outputs itself), the drafter, and its decoding
mode (`speculation.modes.DecodingMode`). The `decode` command, the evaluate stage's end-to-end
decoding and the decoding benches all take them from here:

    session = open_session(target, drafter, device="cpu")
    chain = session.speculation()                             # greedy chain, all B-1 tokens
    chain = session.speculation(DecodingMode.chain(2))        # a chain verifying its first 2 tokens
    tree = session.speculation(DecodingMode.tree(8))          # greedy DDTree of 8 nodes
    run = session.decode(prompt_ids, chain, max_new_tokens=128)
    run = session.decode(prompt_ids, chain, max_new_tokens=128, sampling=Sampling(0.7, rule="ratio"))

Several drafters that read the same layers share one session (`with_drafter`): one target load.
Code that holds a model and a drafter already (the measurement wing, tests) decodes a
`Speculation` with `speculative_decode`. With `plain` (the target alone) this module is the
wing's only entry; the steps, the loop and the graph runner behind it are internal.
"""

from dataclasses import dataclass, replace

import torch

from dflash_pipeline.decoding.loop import DecodeRun
from dflash_pipeline.decoding.plain import engine_name, greedy_decode
from dflash_pipeline.decoding.static_speculation import Speculation
from dflash_pipeline.drafters.core import DFlashDrafter
from dflash_pipeline.foundation.errors import PipelineError
from dflash_pipeline.speculation.modes import DecodingMode
from dflash_pipeline.speculation.sampling import Sampling
from dflash_pipeline.target.load import TargetHead, TargetInfo, load_target, load_target_head
from dflash_pipeline.target.placement import TargetPlacement

__all__ = ["DecodingSession", "Speculation", "open_session", "speculative_decode"]


def speculative_decode(model, speculation: Speculation, prompt_ids: list[int], *, max_new_tokens: int, eos_ids: set[int],
                       feature_dtype: str = "bf16", bf16: bool | None = None, sampling: Sampling | None = None,
                       on_tokens=None) -> DecodeRun:
    """Lossless speculative decoding of one prompt in `speculation`'s mode (a chain verifying
    `verify_tokens`, or a DDTree of `tree_budget` nodes): greedy at T = 0, or a sampled chain with
    `sampling`, whose committed tokens are distributed exactly as `plain.greedy_decode(...,
    sampling=...)` samples them. A sampled tree is refused in one line (`DecodingMode.check_sampling`).

    Each step drafts after the anchor (the last committed token), verifies [anchor, draft] in one
    target forward, commits the accepted prefix (the longest agreeing tree path) and the target's
    bonus token, and writes the committed positions' features (the tapped layers' outputs,
    rounded as the shards store them: `feature_dtype`) into the drafter's context cache. The
    drafter's work runs under bf16 autocast when `bf16` says so (default: on CUDA); the target
    runs in its own dtype, exactly as in `greedy_decode`. `on_tokens(list)` sees committed tokens.
    """
    engine_name(model)
    return speculation.decode(model, prompt_ids, max_new_tokens=max_new_tokens, eos_ids=eos_ids, feature_dtype=feature_dtype, bf16=bf16,
                              sampling=sampling, on_tokens=on_tokens)


@dataclass(frozen=True)
class DecodingSession:
    """The target side of speculative decoding, loaded once, and the drafter that drafts for it."""

    target: TargetInfo
    model: torch.nn.Module  # the target causal LM, eval mode, on `device`
    tokenizer: object
    head: TargetHead  # the target's frozen embedding and LM head (bf16 on CUDA, fp32 on CPU)
    layer_ids: tuple[int, ...]  # the target layers the drafter reads (its target_layer_ids)
    drafter: DFlashDrafter
    device: str

    @property
    def eos_ids(self) -> set[int]:
        return set(self.target.eos_token_ids)

    @property
    def engine(self) -> str:
        """The engine this session decodes on, as records name it (`plain.engine_name`)."""
        return engine_name(self.model)

    def with_drafter(self, drafter: DFlashDrafter) -> "DecodingSession":
        """This session with another drafter on the same target and head (it must read the same layers)."""
        _check_taps(drafter, list(self.layer_ids))
        return replace(self, drafter=drafter.eval())

    def speculation(self, mode: DecodingMode = DecodingMode.chain()) -> Speculation:
        """The drafter in `mode` for `decode`:

        chain (default)   B-1 drafted tokens per step: greedy, or sampled when `decode` is given a
                          `sampling` (the drafter's argmax under the "match" rule, a draw from its
                          distribution under "ratio")
        chain(k)          a chain cut to its first k drafted tokens (at most B-1: `for_block`)
        tree(N)           a DDTree of the N most probable drafted prefixes (greedy only)
        """
        return Speculation(self.drafter, self.head, mode.for_block(self.drafter.config.block_size))

    def decode(self, prompt_ids: list[int], speculation: Speculation, *, max_new_tokens: int, sampling: Sampling | None = None,
               feature_dtype: str = "bf16", on_tokens=None) -> DecodeRun:
        """Speculative decoding of one prompt in `speculation`'s mode (`speculative_decode`)."""
        return speculative_decode(self.model, speculation, prompt_ids, max_new_tokens=max_new_tokens, eos_ids=self.eos_ids,
                                  feature_dtype=feature_dtype, sampling=sampling, on_tokens=on_tokens)

    def plain(self, prompt_ids: list[int], *, max_new_tokens: int, sampling: Sampling | None = None) -> DecodeRun:
        """The target alone on one prompt (greedy, or sampled with `sampling`): the reference."""
        return greedy_decode(self.model, prompt_ids, max_new_tokens=max_new_tokens, eos_ids=self.eos_ids, sampling=sampling)


def _check_taps(drafter: DFlashDrafter, layer_ids: list[int]) -> None:
    if list(drafter.config.target_layer_ids) != list(layer_ids):
        raise PipelineError(f"drafter reads target layers {list(drafter.config.target_layer_ids)}, "
                            f"but the session taps {list(layer_ids)}")


def open_session(target: TargetInfo, drafter: DFlashDrafter, *, device: str, layer_ids: list[int] | None = None,
                 head: TargetHead | None = None, placement: TargetPlacement | None = None) -> DecodingSession:
    """Load the target (model, tokenizer, frozen head) on `device` for a drafter of the layers it reads.

    `layer_ids`, when given (e.g. the shards' layers), must be the drafter's own; `head`, when the
    caller has already loaded it, is reused instead of being read again. The drafter is put in eval
    mode; its contract with the target is the caller's to check (`evaluate.run.load_candidates`).
    `placement`: the target split over devices (`target.placement`; None: whole on `device`).
    """
    taps = list(drafter.config.target_layer_ids) if layer_ids is None else list(layer_ids)
    _check_taps(drafter, taps)
    if head is None:
        head = load_target_head(target, device=device)
    model, tokenizer = load_target(target, device=device, placement=placement)
    return DecodingSession(target=target, model=model, tokenizer=tokenizer, head=head, layer_ids=tuple(taps), drafter=drafter.eval(),
                           device=device)
