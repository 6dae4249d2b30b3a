"""The evaluate stage's report: the record (`record.Evaluation`) written as files. Only
`evaluate` runs this module, so editing a table or a plot here makes no other stage stale.

    to_metrics     THE one function that names metric keys: the record as nested JSON by section
    write_outputs  data/metrics/eval.json (the headline), data/eval/details.json (every figure),
                   comparison.csv, blocks.parquet, e2e.json, best.json, plot CSVs and PNGs
    summary_table  the printed comparison, one row per drafter
    console_lines  the lines printed after it: the chosen drafter, its best mode, trees and samples

eval.json holds the chosen checkpoint's headline figures (and a short entry per baseline) so that
`dvc metrics show` stays a table a person can scan; its headline speedup is `best_mode.speedup`,
that of the fastest lossless greedy mode, named in `best_mode.mode` ("chain" or "tree<budget>"),
beside the chain's own `chain.speedup`; details.json holds every figure under the same
paths, plus per slot, per category, the cost and time split of each decoding mode, the structured
mismatches, the architecture's extras and every candidate in full. Nothing reads the keys back:
readers take the record, or the JSON by section. A value that does not exist is null in the JSON
files, an empty cell in the CSV files and `n/a` on the console (`files.csv_cell`, `stats.console_value`);
the DDTree columns are those of the budgets scored (`evaluate.tree_budgets`).
"""

from dataclasses import asdict
from pathlib import Path

import numpy as np

from dflash_pipeline.measure.record import BestMode, CandidateRecord, EndToEnd, Evaluation, Interval
from dflash_pipeline.evaluate.best_mode import describe_best_mode
from dflash_pipeline.foundation.files import atomic_path, pyplot, save_figure, write_csv_atomic, write_json_recorded, write_metrics
from dflash_pipeline.foundation.stats import console_value, format_interval
from dflash_pipeline.speculation.modes import DecodingMode

# What eval.json keeps of each section (details.json keeps everything, under the same paths).
HEADLINE = {"teacher_forced": ("tau", "tau_ci95", "blocks", "prompts"),
            "best_mode": ("mode", "speedup", "tau", "lossless_rate"),  # the speedup to quote, and which mode it is
            "chain": ("tau", "tau_ci95", "speedup", "lossless_rate", "near_tie_mismatches", "break_even_tau", "verify_tokens"),
            "tree": ("streak", "tau", "speedup"),  # per node budget
            "sampled": ("tau", "speedup")}  # per temperature
BASELINE_HEADLINE = {"teacher_forced": ("tau", "tau_ci95"), "vs_chosen": ("tau", "tau_ci95"), "chain": ("tau", "speedup", "lossless_rate"),
                     "best_mode": ("mode", "speedup")}
PER_KEY = {"tree", "sampled"}  # sections keyed by node budget or temperature


def to_metrics(evaluation: Evaluation, *, detail: bool = False) -> dict:
    """The evaluation as nested JSON by section, for the chosen checkpoint:

        chosen          name and step
        teacher_forced  τ and its 95% interval, blocks and prompts; (detail) τ per block,
                        seconds, per slot acceptance (unconditional, conditional), τ per category
        best_mode       the fastest lossless greedy mode: its name ("chain", "tree<budget>"), speedup,
                        τ per step, lossless rate; (detail) τ's interval, its verify length or tree
                        budget, every greedy mode's speedup, the modes refused and why
                        (`best_mode.choose_decoding_mode`), the machine measured on
        tree.<budget>   the teacher-forced DDTree streak; end to end: τ per step, speedup, lossless
                        rate, mismatches and costs of greedy tree decoding
        chain           greedy chain decoding end to end: τ per step, speedup, lossless rate,
                        near-tie mismatches, break-even τ, verify length; (detail) tokens/s both
                        sides, decode step, verify and draft cost in steps, time split, mismatches
                        as {prompt_id, position, near_tie}, the verify-length plan
        sampled.<T>     sampled chain decoding at temperature T: τ per step, speedup, acceptance
        extras          (detail) the drafter architecture's own figures
        decoding_skipped why end-to-end decoding did not run (the target fits neither whole nor split here)
        baselines.<name> teacher-forced τ, τ paired against the chosen, chain τ, speedup, lossless rate,
                        the best mode and its speedup

    eval.json is `detail=False`: the `HEADLINE` figures of each section. `detail=True` adds every
    figure, the total teacher-forced seconds and `candidates` (each drafter in full, with `vs_chosen`).
    """
    def interval(name: str, value: Interval) -> dict:
        return {name: value.mean, f"{name}_ci95": value.ci95}

    def decoded(run: EndToEnd) -> dict:
        figures = {"prompts": run.prompts, **interval("tau", run.tau), "speedup": run.speedup, "acceptance_rate": run.acceptance_rate,
                   "plain_tokens_per_s": run.plain_tokens_per_s, "spec_tokens_per_s": run.spec_tokens_per_s,
                   "decode_step_ms": run.decode_step_ms, "verify_cost_steps": run.verify_cost_steps, "draft_cost_steps": run.draft_cost_steps,
                   "break_even_tau": run.break_even_tau, "time": asdict(run.time),
                   # the prefill left out on both sides (`EndToEnd.decode_speedup`), and apart
                   "decode_speedup": run.decode_speedup, "plain_decode_tokens_per_s": run.plain_decode_tokens_per_s,
                   "spec_decode_tokens_per_s": run.spec_decode_tokens_per_s, "plain_prefill_ms": run.plain_prefill_ms,
                   "spec_prefill_ms": run.spec_prefill_ms}
        if run.lossless_rate is not None:  # greedy: checked token for token against plain decoding
            figures.update(lossless_rate=run.lossless_rate, near_tie_mismatches=run.near_tie_mismatches,
                           mismatches=[asdict(mismatch) for mismatch in run.mismatches])
        if run.verify_tokens is not None:
            figures.update(verify_tokens=run.verify_tokens, forward_cost_steps=run.forward_cost_steps,
                           expected_tokens_per_step_cost=run.expected_tokens_per_step_cost)
        return figures

    def sections(candidate: CandidateRecord) -> dict:
        scored = candidate.teacher_forced
        slots = zip(scored.slot_acceptance, scored.slot_acceptance_conditional)
        result = {"teacher_forced": {**interval("tau", scored.tau), "blocks": scored.blocks, "prompts": scored.prompts,
                                     "tau_per_block": scored.tau_per_block, "seconds": scored.seconds,
                                     "slots": {str(k): {"acceptance": u, "acceptance_cond": c} for k, (u, c) in enumerate(slots, start=1)},
                                     "categories": {name: interval("tau", value) for name, value in scored.categories.items()}},
                  "tree": {str(budget): interval("streak", streak) for budget, streak in scored.ddtree_streak.items()}}
        if candidate.vs_chosen is not None:
            result["vs_chosen"] = {**interval("tau", Interval(candidate.vs_chosen.mean, candidate.vs_chosen.ci95)),
                                   "prompts": candidate.vs_chosen.prompts}
        if candidate.decoding is not None:
            result["chain"] = decoded(candidate.decoding.chain)
            for budget, run in candidate.decoding.trees.items():
                result["tree"].setdefault(str(budget), {}).update(decoded(run))
            result["sampled"] = {str(float(temperature)): decoded(run) for temperature, run in candidate.decoding.sampled.items()}
            if candidate.decoding.best is not None:
                result["best_mode"] = best_mode_figures(candidate.decoding.best)
            if candidate.decoding.engine:
                result["chain"]["engine"] = candidate.decoding.engine
        if scored.extras:
            result["extras"] = dict(scored.extras)
        return result

    def headline(full: dict, keep: dict) -> dict:
        picked = {}
        for section, names in keep.items():
            if section not in full:
                continue
            if section in PER_KEY:
                picked[section] = {key: {n: v for n, v in figures.items() if n in names} for key, figures in full[section].items()}
            else:
                picked[section] = {n: v for n, v in full[section].items() if n in names}
        return picked

    chosen = evaluation.chosen_record
    full = {section: figures for section, figures in sections(chosen).items() if section != "vs_chosen"}  # 0 +- 0 against itself
    metrics = {"chosen": {"name": chosen.name, "step": chosen.step}, **(full if detail else headline(full, HEADLINE))}
    baselines = {baseline.name: headline(sections(baseline), BASELINE_HEADLINE) for baseline in evaluation.baselines}
    if baselines:
        metrics["baselines"] = baselines
    if evaluation.decoding_skipped is not None:
        metrics["decoding_skipped"] = evaluation.decoding_skipped
    if detail:
        metrics["teacher_forced_seconds"] = evaluation.teacher_forced_seconds
        metrics["candidates"] = [{"name": c.name, "kind": c.kind, "step": c.step, "path": c.path, "block_size": c.block_size,
                                  "num_layers": c.num_layers, **sections(c)} for c in evaluation.candidates]
    return metrics


def best_mode_figures(best: BestMode) -> dict:
    """The best greedy mode as JSON: the section `best_mode` of eval.json and details.json, and of
    best.json, where `dflash-pipeline decode` reads it (through the export's provenance file)."""
    tau, tau_ci95 = (best.tau.mean, best.tau.ci95) if best.tau is not None else (None, None)
    mode = DecodingMode.dict_of(best.decoding_mode)
    figures = {"speedup": best.speedup, "tau": tau, "tau_ci95": tau_ci95, "lossless_rate": best.lossless_rate}
    # The mode's name, the figures, then its numbers: the order of comparison.csv's columns.
    return {"mode": mode.pop("mode"), **figures, **mode, "speedups": dict(best.speedups), "refused": dict(best.refused),
            "machine": best.machine, "engine": best.engine}


def _flat_row(figures: dict, prefix: str = "") -> dict:
    """One CSV row of nested figures: paths joined by ".", lists left out (they stay in details.json)."""
    row = {}
    for key, value in figures.items():
        if isinstance(value, dict):
            row.update(_flat_row(value, f"{prefix}{key}."))
        elif not isinstance(value, list):
            row[f"{prefix}{key}"] = value
    return row


def write_outputs(result, *, out_dir: Path, metrics_path: Path, plots_dir: Path) -> dict:
    """eval.json (returned), details.json, comparison.csv, blocks.parquet, e2e.json, best.json, plot CSVs and PNGs.
    `result`: an `evaluate.run.EvaluationResult`."""
    import pandas as pd

    evaluation = result.record
    out_dir.mkdir(parents=True, exist_ok=True)
    plots_dir.mkdir(parents=True, exist_ok=True)
    details = to_metrics(evaluation, detail=True)
    write_metrics(out_dir / "details.json", details)
    rows = [_flat_row(candidate) for candidate in details["candidates"]]
    write_csv_atomic(out_dir / "comparison.csv", list(dict.fromkeys(key for row in rows for key in row)), rows)
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
                   "plain_prefill_seconds": round(r.plain.prefill_seconds, 4),
                   **{key.name: {"tokens": len(run.tokens), "seconds": round(run.seconds, 4), "prefill_seconds": round(run.prefill_seconds, 4),
                                 "steps": run.steps,
                                 "identical": run.tokens == r.plain.tokens} for key, run in r.speculative.items()}}
                  for r in result.e2e_results]
    write_metrics(out_dir / "e2e.json", {"prompts": e2e_detail})
    best = evaluation.chosen_record
    best_mode = best.decoding.best if best.decoding is not None else None
    # export acts on best.json (which checkpoint to publish): it carries its sha256 (best.json.sha256)
    write_json_recorded(out_dir / "best.json", {"name": best.name, "kind": best.kind, "step": best.step, "path": best.path,
                                                "tau": best.teacher_forced.tau.mean, "tau_ci95": best.teacher_forced.tau.ci95,
                                                "chosen_by": "teacher-forced tau",
                                                "best_mode": best_mode_figures(best_mode) if best_mode is not None else None})
    metrics = to_metrics(evaluation)
    write_metrics(metrics_path, metrics)
    write_plots(evaluation, plots_dir)
    return metrics


def tree_budgets(evaluation: Evaluation) -> list[int]:
    """The DDTree budgets the drafters were scored at (`evaluate.tree_budgets`, in its order)."""
    return list(dict.fromkeys(budget for c in evaluation.candidates for budget in c.teacher_forced.ddtree_streak))


def write_plots(evaluation: Evaluation, plots_dir: Path) -> None:
    """CSV series for `dvc plots` and PNGs that need no browser: tau by step (with the DDTree
    streak of each scored budget), acceptance by slot, ours against the baselines."""
    plt = pyplot()
    checkpoints = sorted(evaluation.checkpoints, key=lambda c: c.step)
    best = evaluation.chosen_record
    shown = [best] + [b for b in evaluation.baselines if b.name != best.name]
    streaks = {f"ddtree{budget}_streak": budget for budget in tree_budgets(evaluation)}
    by_step = [{"step": c.step, "tau": c.teacher_forced.tau.mean, "tau_ci95": c.teacher_forced.tau.ci95,
                **{column: _streak(c, budget) for column, budget in streaks.items()}} for c in checkpoints]
    write_csv_atomic(plots_dir / "eval_tau_by_step.csv", ["step", "tau", "tau_ci95", *streaks], by_step)
    slots = [{"slot": k, "acceptance": conditional, "acceptance_unconditional": unconditional}  # the chosen drafter's; baselines: the PNG
             for k, (conditional, unconditional) in enumerate(zip(best.teacher_forced.slot_acceptance_conditional,
                                                                  best.teacher_forced.slot_acceptance), start=1)]
    write_csv_atomic(plots_dir / "eval_slots.csv", ["slot", "acceptance", "acceptance_unconditional"], slots)

    figure, axis = plt.subplots(figsize=(6, 4))
    if checkpoints:
        axis.errorbar([row["step"] for row in by_step], [row["tau"] for row in by_step], yerr=[row["tau_ci95"] for row in by_step],
                      marker="o", capsize=3, label="checkpoints")
    for b in evaluation.baselines:
        axis.axhline(b.teacher_forced.tau.mean, ls="--", lw=1, label=f"baseline {b.name}")
    axis.set(xlabel="training step", ylabel="teacher-forced tau", title="acceptance length by checkpoint (95% CI over prompts)")
    axis.legend(fontsize=8)
    save_figure(figure, plots_dir / "eval_tau.png")

    figure, axis = plt.subplots(figsize=(6, 4))
    for c in shown:
        k = list(range(1, c.block_size))
        axis.plot(k, c.teacher_forced.slot_acceptance_conditional, marker="o", label=f"{c.name} (given earlier slots accepted)")
        axis.plot(k, c.teacher_forced.slot_acceptance, marker=".", ls=":", label=f"{c.name} (unconditional)")
    axis.set_xticks(range(1, max(c.block_size for c in shown)))
    axis.set(xlabel="drafted slot", ylabel="acceptance", ylim=(0, 1), title="acceptance by slot")
    axis.legend(fontsize=7)
    save_figure(figure, plots_dir / "eval_slots.png")

    figure, axis = plt.subplots(figsize=(6, 4))
    x = np.arange(len(shown))
    chains = [c.decoding.chain.tau if c.decoding else Interval(0, 0) for c in shown]
    axis.bar(x - 0.2, [c.teacher_forced.tau.mean for c in shown], 0.4, yerr=[c.teacher_forced.tau.ci95 for c in shown], capsize=3,
             label="teacher-forced tau")
    axis.bar(x + 0.2, [t.mean for t in chains], 0.4, yerr=[t.ci95 for t in chains], capsize=3, label="end-to-end tau")
    axis.set_xticks(x, [c.name for c in shown], rotation=15, fontsize=8)
    axis.set(ylabel="tau", title="ours (best checkpoint) vs baselines")
    axis.legend(fontsize=8)
    save_figure(figure, plots_dir / "eval_baselines.png")


def _streak(candidate: CandidateRecord, budget: int) -> float | None:
    streak = candidate.teacher_forced.ddtree_streak.get(budget)
    return None if streak is None else streak.mean


def summary_table(evaluation: Evaluation) -> str:
    """The printed comparison: one row per drafter, the chosen one starred."""
    import pandas as pd

    rows = []
    for c in evaluation.candidates:
        scored, paired = c.teacher_forced, c.vs_chosen
        row = {"name": c.name + (" *" if c.name == evaluation.chosen else ""), "kind": c.kind, "tau": scored.tau.mean,
               "tau_ci95": scored.tau.ci95}
        if paired is not None:  # the paired difference to the chosen drafter, with its 95% CI
            row["vs_best"] = format_interval(paired.mean, paired.ci95, digits=4, signed=True)
        row.update({f"ddtree{budget}_streak": streak.mean for budget, streak in scored.ddtree_streak.items()})
        row["slot1_acc"] = scored.slot_acceptance[0]
        if c.decoding is not None:
            chain = c.decoding.chain
            row.update(e2e_tau=chain.tau.mean, speedup=chain.speedup, lossless_rate=chain.lossless_rate, break_even_tau=chain.break_even_tau)
            if c.decoding.best is not None:  # the fastest lossless greedy mode, which may be the chain itself
                row.update(best_mode=c.decoding.best.mode or "none", best_speedup=c.decoding.best.speedup)
        rows.append({key: console_value(value) for key, value in row.items()})  # one prompt: no interval, "n/a"
    return pd.DataFrame(rows, columns=list(dict.fromkeys(key for row in rows for key in row))).to_string(index=False)


def console_lines(evaluation: Evaluation) -> list[str]:
    """What the stage prints after the table: the chosen drafter with its teacher-forced τ and
    greedy chain; its best decoding mode; each tree budget's and each temperature's end-to-end
    figures, each part only where something was decoded."""
    chosen = evaluation.chosen_record
    scored, decoding = chosen.teacher_forced, chosen.decoding
    line = f"evaluate: chosen {chosen.name} (teacher-forced tau {format_interval(scored.tau.mean, scored.tau.ci95, digits=4)})"
    if decoding is not None:
        chain = decoding.chain
        line += (f"; end-to-end tau {console_value(chain.tau.mean)}, speedup {console_value(chain.speedup)} (break-even tau on this "
                 f"machine {console_value(chain.break_even_tau)}), lossless rate {console_value(chain.lossless_rate)}")
    lines = [line]
    if decoding is not None and decoding.best is not None:
        lines.append(f"evaluate: chosen {chosen.name}: {describe_best_mode(decoding.best)} on {decoding.best.machine}")
    if decoding is not None:
        parts = []
        if decoding.trees:
            parts.append("trees at budget " + "; ".join(
                f"{budget}: tau {console_value(run.tau.mean)}, speedup {console_value(run.speedup)}, verify cost "
                f"{console_value(run.verify_cost_steps)} steps" for budget, run in decoding.trees.items()))
        if decoding.sampled:
            parts.append("sampled at " + "; ".join(f"T={temperature:g}: tau {console_value(run.tau.mean)}, speedup {console_value(run.speedup)}"
                                                   for temperature, run in decoding.sampled.items()))
        if parts:
            lines.append("evaluate: " + " | ".join(parts))
    return lines
