"""The decoding engine: plain greedy and lossless speculative decoding with the real target.

    greedy_decode       the target alone over the static KV cache: the reference output and timing
    speculative_decode  draft B-1 tokens (a chain) or a DDTree of them, verify them in one target
                        forward, commit the matching prefix (the longest agreeing tree path) and
                        the target's bonus token; the output equals greedy decoding
    forward_costs       the target's forward of n new tokens, timed as a verify step runs it

Measuring the two against each other (`measure.end_to_end`) and planning the verify length
(`measure.verify_plan`) live in the measurement wing, above this one.

There is one engine: `static_speculation`'s steps, kept whole on the device over static caches,
for every target transformers loads (`static_decoder`). A target it cannot serve is refused in
one line naming its model type (`speculation_engine`); nothing falls back to another loop. The
host loops it replaced live on under tests/oracles/, as the references it is tested against.
"""



from dflash_pipeline.decoding.loop import DecodeRun, engine_name, static_plain_decode
from dflash_pipeline.speculation.sampling import Sampling
from dflash_pipeline.decoding.static_speculation import Speculation, static_forward_costs

# ----------------------------------------------------------------------------- decoding


def speculation_engine(model) -> str:
    """The engine that decodes with this target, as records name it (`loop.engine_name`:
    "static-kv", "static-kv-cuda-graph" on a GPU); a target it cannot serve is refused in one line."""
    return engine_name(model)


def greedy_decode(model, prompt_ids: list[int], *, max_new_tokens: int, eos_ids: set[int], sampling: Sampling | None = None,
                  on_tokens=None) -> DecodeRun:
    """Plain decoding of one prompt, greedy (or sampled with `sampling`): the reference output and
    timing. `on_tokens(list)` sees the new tokens as they are made."""
    speculation_engine(model)
    return static_plain_decode(model, prompt_ids, max_new_tokens=max_new_tokens, eos_ids=eos_ids, sampling=sampling, on_tokens=on_tokens)


def speculative_decode(model, speculation: Speculation, prompt_ids: list[int], *, max_new_tokens: int, eos_ids: set[int],
                       feature_dtype: str = "bf16", bf16: bool | None = None, sampling: Sampling | None = None,
                       on_tokens=None) -> DecodeRun:
    """Lossless speculative decoding of one prompt in `speculation`'s mode (a chain verifying
    `verify_tokens`, or a DDTree of `tree_budget` nodes; `session.DecodingSession.speculation`):
    greedy at T = 0, or a sampled chain with `sampling`, whose committed tokens are distributed
    exactly as `greedy_decode(..., sampling=...)` samples them.

    Each step drafts after the anchor (the last committed token), verifies [anchor, draft] in one
    target forward, commits the accepted prefix (the longest agreeing tree path) and the target's
    bonus token, and writes the committed positions' features (the tapped layers' outputs,
    rounded as the shards store them: `feature_dtype`) into the drafter's context cache. The
    drafter's work runs under bf16 autocast when `bf16` says so (default: on CUDA); the target
    runs in its own dtype, exactly as in `greedy_decode`. `on_tokens(list)` sees committed tokens.
    """
    speculation_engine(model)
    return speculation.decode(model, prompt_ids, max_new_tokens=max_new_tokens, eos_ids=eos_ids, feature_dtype=feature_dtype, bf16=bf16,
                              sampling=sampling, on_tokens=on_tokens)


def forward_costs(model, prompt_ids: list[int], lengths: list[int], *, repeats: int = 5) -> dict[int, float]:
    """Median seconds of one target forward of n new tokens (with the argmax of each position's
    logits, as a verify step takes it) after the KV cache of `prompt_ids`, for each n in `lengths`,
    on the static cache; the lengths take turns, so drift in machine speed falls on all alike."""
    speculation_engine(model)
    return static_forward_costs(model, prompt_ids, lengths, repeats=repeats)


