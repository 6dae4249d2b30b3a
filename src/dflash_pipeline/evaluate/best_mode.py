"""A decoded drafter's best greedy mode: of the chain and each tree budget measured end to end,
the fastest lossless one (what the headline speedup reports and `dflash-pipeline generate` decodes
with), and the line that describes the choice.
"""

from dflash_pipeline.measure.record import BestMode, EndToEnd
from dflash_pipeline.speculation.modes import DecodingMode


def choose_decoding_mode(chain: EndToEnd, trees: dict[int, EndToEnd], *, machine: str = "", engine: str = "") -> BestMode:
    """The greedy mode with the highest measured speedup: the chain (at its verify length) or a tree
    of one of `trees`' node budgets.

    Only a lossless mode may win, as evaluate records it (`end_to_end.summarize_end_to_end`): a mode with
    a mismatch that is not a near-tie (a real difference from plain greedy decoding) is refused, and
    so is a tree whose lossless rate is below the chain's (near-tie partings are rounding, which
    every mode meets alike; more of them than the chain has is not evidence of rounding alone). A
    mode without a measured speedup cannot win either. On a tie the chain wins, then the smaller
    tree: the same speed for less verify work. When nothing qualifies, `decoding_mode` is None and `refused`
    says why for each mode.
    """
    modes = [(DecodingMode.chain(chain.verify_tokens), chain)] + [(DecodingMode.tree(budget), run) for budget, run in sorted(trees.items())]
    refused = {}
    for mode, run in modes:
        real_mismatches = len(run.mismatches) - run.near_tie_mismatches
        if run.speedup is None:
            refused[mode.name] = "no speedup measured"
        elif run.lossless_rate is None:
            refused[mode.name] = "not checked against plain greedy decoding"
        elif real_mismatches:
            refused[mode.name] = f"{real_mismatches} answer(s) part from plain greedy decoding not at a near-tie"
        elif chain.lossless_rate is not None and run.lossless_rate < chain.lossless_rate:
            refused[mode.name] = f"lossless rate {run.lossless_rate} below the chain's {chain.lossless_rate}"
    speedups = {mode.name: run.speedup for mode, run in modes}
    eligible = [(mode, run) for mode, run in modes if mode.name not in refused]
    if not eligible:
        return BestMode(decoding_mode=None, speedup=None, tau=None, lossless_rate=None, speedups=speedups, refused=refused, machine=machine,
                        engine=engine)
    mode, run = max(eligible, key=lambda item: item[1].speedup)  # max keeps the first of equals: the chain, then smaller trees
    return BestMode(decoding_mode=mode, speedup=run.speedup, tau=run.tau, lossless_rate=run.lossless_rate, speedups=speedups,
                    refused=refused, machine=machine, engine=engine)


def describe_best_mode(best: BestMode | None) -> str:
    """One line: the best greedy mode, its speedup against the other modes', and what was refused."""
    if best is None:
        return "no best mode recorded"
    others = ", ".join(f"{name} {speedup}" for name, speedup in best.speedups.items() if name != best.mode)
    refused = "; refused " + ", ".join(f"{name} ({why})" for name, why in best.refused.items()) if best.refused else ""
    if best.mode is None:
        return f"no greedy mode qualifies as the best{refused}"
    return f"best mode {best.mode}, speedup {best.speedup} (vs {others or 'no other mode'}){refused}"
