"""Every file a stage reports: metrics JSON, comparison tables, plot CSVs and PNGs.

Metrics files are strict JSON, written atomically: a value that is not a finite number (a slot no
block reached, the interval of a single prompt) is written as null, never as NaN or Infinity,
which strict readers (DVC's metrics diff among them in some versions, jq, JavaScript) reject.
PNGs are drawn with matplotlib's Agg backend, so plots need no browser and no network.
"""

import csv
import math
from pathlib import Path

import numpy as np

from dflash_pipeline.files import atomic_path, write_json_atomic


def strict_json(value):
    """`value` with every NaN or infinite float replaced by None (JSON null), recursively."""
    if isinstance(value, float) or isinstance(value, np.floating):
        return float(value) if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: strict_json(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(item) for item in value]
    return value


def write_metrics(path: Path, metrics: dict) -> None:
    """A metrics JSON file (strict JSON, atomic), its folder created if needed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, strict_json(metrics))


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save_figure(plt, figure, path: Path) -> None:
    figure.tight_layout()
    with atomic_path(path) as tmp:
        figure.savefig(tmp, dpi=110)
    plt.close(figure)


# ----------------------------------------------------------------------------- train


def write_train_outputs(result: dict, *, metrics_path: Path, plots_dir: Path) -> dict:
    """train.json (the final metrics, flat) and the curves (`write_curves`); returns the metrics."""
    write_curves(result["curve"], plots_dir)
    flat = {key: value for key, value in result.items() if not isinstance(value, list)}
    flat.update({f"slot{k + 1}_acc": a for k, a in enumerate((result.get("slot_accuracy") or [])[:4])})
    write_metrics(metrics_path, flat)
    return flat


def write_curves(curve: list[dict], plots_dir: Path) -> None:
    """CSV curves for `dvc plots` (loss per step; τ per evaluation) and a PNG of both."""
    plots_dir.mkdir(parents=True, exist_ok=True)
    with atomic_path(plots_dir / "train_loss.csv") as tmp, open(tmp, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["step", "loss", "slot1_acc"])
        writer.writerows([row["step"], row["loss"], row["slot1_acc"]] for row in curve)
    evaluated = [row for row in curve if "tau" in row]
    with atomic_path(plots_dir / "train_tau.csv") as tmp, open(tmp, "w", newline="") as handle:
        writer = csv.writer(handle)
        slots = len(evaluated[0]["slot_accuracy"]) if evaluated else 0
        writer.writerow(["step", "tau", "tau_ci95"] + [f"acc_slot{k + 1}" for k in range(slots)])
        writer.writerows([row["step"], row["tau"], row["tau_ci95"], *row["slot_accuracy"]] for row in evaluated)
    plt = _pyplot()
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.plot([r["step"] for r in curve], [r["loss"] for r in curve], lw=0.8)
    left.set(xlabel="step", ylabel="decayed CE loss", title="training loss")
    if evaluated:
        right.errorbar([r["step"] for r in evaluated], [r["tau"] for r in evaluated], yerr=[r["tau_ci95"] for r in evaluated],
                       marker="o", capsize=3)
    right.set(xlabel="step", ylabel="held-out teacher-forced tau", title="acceptance length (95% CI over prompts)")
    figure.tight_layout()
    _save_figure(plt, figure, plots_dir / "train.png")


# ----------------------------------------------------------------------------- evaluate


def flat_metrics(result, tree_budgets: list[int]) -> dict:
    """eval.json: stable flat keys for the chosen drafter, plus a short entry per baseline."""
    best = result.best
    keep = ["tau", "tau_ci95", "blocks", "prompts", "e2e_tau", "e2e_tau_ci95", "lossless_rate", "near_tie_mismatches", "speedup", "plain_tokens_per_s",
            "spec_tokens_per_s", "break_even_tau", "verify_tokens", "verify_cost_steps", "draft_cost_steps", "decode_step_ms", "e2e_prompts",
            "time_prefill", "time_verify", "time_draft", "time_overhead"]
    keep += [f"ddtree{b}_streak" for b in tree_budgets] + [f"ddtree{b}_streak_ci95" for b in tree_budgets]
    keep += ["acceptance_rate"] + [f"{prefix}{b}_{key}" for b in tree_budgets for prefix, key in
                                   (("e2e_tree", "tau"), ("e2e_tree", "tau_ci95"), ("tree", "speedup"), ("tree", "verify_cost_steps"),
                                    ("tree", "lossless_rate"), ("tree", "near_tie_mismatches"))]
    keep += sorted(k for k in best if k.startswith(("e2e_tau_t", "speedup_t", "acceptance_t")))  # per sampling temperature
    keep += [k for k in ("tau_argmax", "tau_argmax_ci95", "tau_oracle", "tau_oracle_ci95", "tau_selector_gain", "tau_selector_gain_ci95")
             if k in best]  # DFlash2's selector against each slot's argmax; slotK_topk_recall comes with the slots
    categories = sorted(set(result.categories))
    keep += sorted([k for k in best if k.startswith("slot")] + [f"tau_{c}" for c in categories] + [f"tau_{c}_ci95" for c in categories])
    metrics = {key: best[key] for key in keep if key in best}
    metrics.update(chosen=best["name"], chosen_step=best["step"], teacher_forced_seconds=result.teacher_forced_seconds)
    baselines = {row["name"]: {k: row.get(k) for k in ("tau", "tau_ci95", "tau_vs_best", "tau_vs_best_ci95", "ddtree8_streak", "e2e_tau",
                                                    "speedup", "lossless_rate") if k in row}
                 for row in result.rows if row["kind"] == "baseline"}
    if baselines:
        metrics["baselines"] = baselines
    return metrics


def write_outputs(result, *, out_dir: Path, metrics_path: Path, plots_dir: Path, tree_budgets: list[int]) -> dict:
    """comparison.csv/json, blocks.parquet, e2e.json, best.json, eval.json, plot CSVs and PNGs."""
    import pandas as pd

    out_dir.mkdir(parents=True, exist_ok=True)
    plots_dir.mkdir(parents=True, exist_ok=True)
    table = pd.DataFrame(result.rows)
    with atomic_path(out_dir / "comparison.csv") as tmp:
        table.to_csv(tmp, index=False)
    write_json_atomic(out_dir / "comparison.json", strict_json(result.rows))
    frames = []
    for name, scores in result.blocks.items():
        frame = pd.DataFrame({"drafter": name, "sequence": scores.sequence, "category": [result.categories[s] for s in scores.sequence],
                              "anchor": scores.anchor, "tau": scores.tau})
        if result.prompt_ids:
            frame.insert(2, "prompt_id", [result.prompt_ids[s] for s in scores.sequence])
        for budget, streak in scores.streaks.items():
            frame[f"ddtree{budget}_streak"] = streak
        frames.append(frame)
    with atomic_path(out_dir / "blocks.parquet") as tmp:
        pd.concat(frames).to_parquet(tmp, index=False)
    e2e_detail = [{"prompt_id": r.prompt_id, "plain_tokens": len(r.plain.tokens), "plain_seconds": round(r.plain.seconds, 4),
                   **{name: {"tokens": len(run.tokens), "seconds": round(run.seconds, 4), "steps": run.steps,
                             "identical": run.tokens == r.plain.tokens} for name, run in r.speculative.items()}}
                  for r in result.e2e_results]
    write_json_atomic(out_dir / "e2e.json", strict_json({"summary": result.e2e, "prompts": e2e_detail}))
    best = result.best
    write_json_atomic(out_dir / "best.json", {"name": best["name"], "kind": best["kind"], "step": best["step"], "path": best["path"],
                                              "tau": best["tau"], "tau_ci95": best["tau_ci95"], "chosen_by": "teacher-forced tau"})
    metrics = strict_json(flat_metrics(result, tree_budgets))
    write_metrics(metrics_path, metrics)
    write_plots(result, plots_dir)
    return metrics


def write_plots(result, plots_dir: Path) -> None:
    """CSV series for `dvc plots` and PNGs that need no browser: tau by step, acceptance by slot,
    ours against the baselines."""
    import pandas as pd

    plt = _pyplot()
    rows = result.rows
    checkpoints = sorted((r for r in rows if r["kind"] == "checkpoint"), key=lambda r: r["step"])
    baselines = [r for r in rows if r["kind"] == "baseline"]
    by_step = pd.DataFrame([{"step": r["step"], "tau": r["tau"], "tau_ci95": r["tau_ci95"], "ddtree8_streak": r.get("ddtree8_streak")}
                            for r in checkpoints], columns=["step", "tau", "tau_ci95", "ddtree8_streak"])
    with atomic_path(plots_dir / "eval_tau_by_step.csv") as tmp:
        by_step.to_csv(tmp, index=False)
    shown = [result.best] + [r for r in baselines if r["name"] != result.best["name"]]
    best_slots = range(1, result.best["block_size"])  # the chosen drafter's; baselines are in the PNG
    slots = pd.DataFrame({"slot": list(best_slots), "acceptance": [result.best.get(f"slot{k}_acc_cond") for k in best_slots],
                          "acceptance_unconditional": [result.best.get(f"slot{k}_acc") for k in best_slots]})
    with atomic_path(plots_dir / "eval_slots.csv") as tmp:
        slots.to_csv(tmp, index=False)

    figure, axis = plt.subplots(figsize=(6, 4))
    if checkpoints:
        axis.errorbar(by_step["step"], by_step["tau"], yerr=by_step["tau_ci95"], marker="o", capsize=3, label="checkpoints")
    for r in baselines:
        axis.axhline(r["tau"], ls="--", lw=1, label=f"baseline {r['name']}")
    axis.set(xlabel="training step", ylabel="teacher-forced tau", title="acceptance length by checkpoint (95% CI over prompts)")
    axis.legend(fontsize=8)
    _save_figure(plt, figure, plots_dir / "eval_tau.png")

    figure, axis = plt.subplots(figsize=(6, 4))
    for r in shown:
        k = list(range(1, r["block_size"]))
        axis.plot(k, [r.get(f"slot{i}_acc_cond") for i in k], marker="o", label=f"{r['name']} (given earlier slots accepted)")
        axis.plot(k, [r.get(f"slot{i}_acc") for i in k], marker=".", ls=":", label=f"{r['name']} (unconditional)")
    axis.set_xticks(range(1, max(r["block_size"] for r in shown)))
    axis.set(xlabel="drafted slot", ylabel="acceptance", ylim=(0, 1), title="acceptance by slot")
    axis.legend(fontsize=7)
    _save_figure(plt, figure, plots_dir / "eval_slots.png")

    figure, axis = plt.subplots(figsize=(6, 4))
    names = [r["name"] for r in shown]
    x = np.arange(len(shown))
    axis.bar(x - 0.2, [r["tau"] for r in shown], 0.4, yerr=[r["tau_ci95"] for r in shown], capsize=3, label="teacher-forced tau")
    axis.bar(x + 0.2, [r.get("e2e_tau") or 0 for r in shown], 0.4, yerr=[r.get("e2e_tau_ci95") or 0 for r in shown], capsize=3,
             label="end-to-end tau")
    axis.set_xticks(x, names, rotation=15, fontsize=8)
    axis.set(ylabel="tau", title="ours (best checkpoint) vs baselines")
    axis.legend(fontsize=8)
    _save_figure(plt, figure, plots_dir / "eval_baselines.png")


def summary_table(result) -> str:
    """The printed comparison: one row per drafter."""
    import pandas as pd

    columns = ["name", "kind", "tau", "tau_ci95", "vs_best", "ddtree8_streak", "slot1_acc", "e2e_tau", "speedup", "lossless_rate",
               "break_even_tau"]
    table = pd.DataFrame(result.rows)
    if "tau_vs_best" in table.columns:  # the paired difference to the chosen drafter, with its 95% CI
        table["vs_best"] = [f"{m:+.4f}+-{h:.4f}" for m, h in zip(table["tau_vs_best"], table["tau_vs_best_ci95"])]
    table = table[[c for c in columns if c in table.columns]]
    table.loc[table["name"] == result.best["name"], "name"] += " *"
    return table.to_string(index=False)
