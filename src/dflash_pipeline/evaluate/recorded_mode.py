"""Evaluate's best-mode record read back for one drafter: where it is (an export's provenance file,
or the run's data/eval/best.json beside a checkpoint) and the greedy mode `dflash-pipeline decode`
decodes with because of it.

    evaluate_record_of  (found, the `best_mode` section, the file and key it is in, or why none)
    choose_decode_mode  the options' mode, else the one evaluate measured fastest, else the whole chain
"""

from pathlib import Path

from dflash_pipeline.drafters.serving import PROVENANCE_FILE
from dflash_pipeline.foundation.errors import PipelineError
from dflash_pipeline.foundation.files import check_recorded_digest, read_json
from dflash_pipeline.measure.record import BestMode
from dflash_pipeline.speculation.modes import DecodingMode


def evaluate_record_of(drafter_dir: Path, kind: str) -> tuple[bool, object, str]:
    """(True, evaluate's `best_mode` section for this drafter, the file and key it is in), or
    (False, None, why there is none). `kind` is `drafters.loading.drafter_folder_kind`'s:
    "checkpoint" or "export".

    An export of the pipeline carries it in its provenance file (`source.best_mode`, copied there
    by the export stage from best.json). A checkpoint of a pipeline run (data/checkpoints/step_N)
    has the evaluate stage's data/eval/best.json two folders up, which counts only when it chose
    this very folder. A published drafter has no record.
    """
    if kind == "export":
        path = drafter_dir / PROVENANCE_FILE
        if not path.is_file():
            return False, None, f"{drafter_dir} has no {PROVENANCE_FILE} (not exported by this pipeline)"
        provenance = read_json(path, missing="unreadable")
        source = (provenance.get("source") or {}) if isinstance(provenance, dict) else None
        if not isinstance(source, dict):
            raise PipelineError(f"{path}: source is not a mapping (a damaged provenance file)")
        if "best_mode" not in source:
            return False, None, f"{path} records no source.best_mode (exported by `dflash-pipeline export`, or before evaluate recorded one)"
        return True, source["best_mode"], f"{path}: source.best_mode"
    best_json = drafter_dir.parent.parent / "eval" / "best.json"
    if not best_json.is_file():
        return False, None, f"no {best_json} beside this checkpoint's run"
    check_recorded_digest(best_json)
    best = read_json(best_json, missing="unreadable")
    if not isinstance(best, dict) or not isinstance(best.get("path"), str):
        raise PipelineError(f"{best_json}: no path of the chosen drafter (not evaluate's best.json)")
    chosen = Path(best["path"])
    chosen = chosen if chosen.is_absolute() else best_json.parent.parent.parent / chosen  # the stage writes it relative to the repository
    if chosen.resolve() != drafter_dir.resolve():
        return False, None, f"{best_json} chose {best.get('name')!r}, not this checkpoint"
    if "best_mode" not in best:
        return False, None, f"{best_json} records no best_mode (written before evaluate recorded one)"
    return True, best["best_mode"], f"{best_json}: best_mode"


def choose_decode_mode(*, drafter_dir: Path, kind: str, block_size: int, requested: DecodingMode, explicit: set[str],
                       machine: str) -> tuple[DecodingMode, str]:
    """(the mode, the line saying which mode and why) for greedy `decode`: the `requested` mode
    when the options named in `explicit` chose it; else the mode evaluate measured fastest for this
    drafter (`evaluate_record_of`); else `requested` as the options' defaults make it (a chain of
    all B-1 drafted tokens)."""
    if explicit:
        flags = " and ".join(f"--{name.replace('_', '-')}" for name in sorted(explicit))
        return requested, f"mode: {requested.describe(block_size)} ({flags})"
    found, section, where = evaluate_record_of(drafter_dir, kind)
    default = requested
    if not found:
        return default, f"mode: {default.describe(block_size)} (no evaluate record of this drafter: {where})"
    if section is None:
        return default, f"mode: {default.describe(block_size)} (evaluate decoded nothing end to end: {where} is null)"
    evaluated = BestMode.from_json(section, where)
    if evaluated.decoding_mode is None:
        return default, f"mode: {default.describe(block_size)} (evaluate found no lossless greedy mode: {where})"

    def rate(speedup) -> str:
        return f"{speedup:.2f}x" if isinstance(speedup, (int, float)) else "n/a"

    mode = evaluated.decoding_mode
    others = ", ".join(f"{name} {rate(value)}" for name, value in evaluated.speedups.items() if name != mode.name)
    line = (f"mode: {mode.describe(block_size)}: evaluate measured {rate(evaluated.speedup)}"
            f"{' vs ' + others if others else ''} on {evaluated.machine}{', engine ' + evaluated.engine if evaluated.engine else ''} ({where})")
    if evaluated.machine != machine:
        line += f"; this is {machine}, where another mode may pay better (--tree-budget, --verify-tokens)"
    return mode, line
