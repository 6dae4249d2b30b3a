"""`dflash-pipeline compare-runs`: the chosen drafters of two evaluate outputs, paired over the
prompts both scored, so the spread between prompts cancels.
"""

from dataclasses import dataclass
from pathlib import Path

from dflash_pipeline.foundation.errors import PipelineError
from dflash_pipeline.foundation.files import check_recorded_digest
from dflash_pipeline.measure.scoring import comparison_verdict


@dataclass(frozen=True)
class RunComparison:
    """The chosen drafters of two evaluate outputs, paired over the prompts both scored."""

    tau_a: float
    tau_b: float
    difference: float  # τ of run a minus τ of run b
    ci95: float
    prompts: int
    same_blocks: bool  # both scored the very same blocks (their greedy answers agree)
    verdict: str


def compare_eval_runs(run_a: Path, run_b: Path) -> RunComparison:
    """The chosen drafters of two `evaluate` outputs (their `data/eval` folders), paired by prompt.

    Two runs of the pipeline (another machine, another CPU) score their own chosen drafter on
    their own val blocks; the prompts both scored pair up, so the spread between prompts cancels
    and the interval says whether the runs differ beyond what their prompts explain. Runs whose
    greedy answers agree score the very same blocks.
    """
    import pandas as pd

    from dflash_pipeline.foundation.files import read_json
    from dflash_pipeline.foundation.stats import mean_ci95_over_prompts
    from dflash_pipeline.foundation.stats import paired_difference as paired_over_prompts

    sides = []
    for folder in (Path(run_a), Path(run_b)):
        if (folder / "best.json").is_file():
            check_recorded_digest(folder / "best.json")
        chosen = read_json(folder / "best.json", missing="no best.json (not an evaluate output folder)")["name"]
        try:
            blocks = pd.read_parquet(folder / "blocks.parquet")
        except (OSError, ValueError) as exc:
            raise PipelineError(f"{folder / 'blocks.parquet'}: cannot be read ({exc})") from None
        if "prompt_id" not in blocks.columns:
            raise PipelineError(f"{folder / 'blocks.parquet'}: has no prompt_id column (written before 2026-12-03); rerun evaluate")
        sides.append((chosen, blocks[blocks["drafter"] == chosen]))
    (name_a, a), (name_b, b) = sides
    mean, half, prompts = paired_over_prompts(a["tau"].to_numpy(), a["prompt_id"].to_numpy(), b["tau"].to_numpy(), b["prompt_id"].to_numpy())
    same_blocks = (len(a) == len(b) and (a["prompt_id"].to_numpy() == b["prompt_id"].to_numpy()).all()
                   and (a["anchor"].to_numpy() == b["anchor"].to_numpy()).all())
    label_a, label_b = f"{run_a} ({name_a})", f"{run_b} ({name_b})"
    tau_a, tau_b = (mean_ci95_over_prompts(side["tau"].to_numpy(), side["prompt_id"].to_numpy())[0] for side in (a, b))
    return RunComparison(tau_a=tau_a, tau_b=tau_b, difference=mean, ci95=half, prompts=prompts, same_blocks=bool(same_blocks),
                         verdict=comparison_verdict(label_a, label_b, mean, half, prompts))
