"""How held-out τ and the end-to-end speedup grow with training compute, checkpoint by checkpoint.

    python bench/studies/compute_curve.py --checkpoints data/checkpoints --out bench/results/compute_curve
    python bench/studies/compute_curve.py --dry-run      # a toy run's two checkpoints (tests/bench/test_dry_runs.py)

Needs a training run's folder (its checkpoints and `state.json`, whose curve gives the training
seconds at each checkpoint), the val shards and the generated val answers. Every checkpoint is
scored as `evaluate` scores the chosen one: teacher-forced τ (95% CI over prompts) and DDTree-8
on the same val blocks, then lossless speculative decoding against plain greedy on the same
`evaluate.num_prompts` val prompts, all checkpoints in one pass per prompt (they share the plain
run, alternating which side goes first). Writes `<out>.csv` / `<out>.json` and `<out>.png`
(τ and speedup against training minutes) and prints the table.
"""

import csv
import json
import os
import sys
from pathlib import Path

import click

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: `bench.*` from a plain `python bench/...`

from bench.toy import REPO_ROOT, dry_run_options, toy_run  # noqa: E402


@click.command()
@click.option("--checkpoints", "checkpoints_dir", type=click.Path(path_type=Path), default="data/checkpoints", show_default=True)
@click.option("--hidden", type=click.Path(path_type=Path), default="data/hidden", show_default=True)
@click.option("--generated", type=click.Path(path_type=Path), default="data/generated", show_default=True)
@click.option("--target", "target_json", type=click.Path(path_type=Path), default="data/target/target.json", show_default=True)
@click.option("--num-prompts", default=None, type=int, help="End-to-end prompts (default: evaluate.num_prompts).")
@click.option("--e2e-every", default=1, show_default=True, help="End-to-end decoding for every Nth checkpoint (and the last).")
@click.option("--seconds-per-step", default=None, type=float,
              help="Training minutes = step x this (a rate measured without other load), instead of the run's wall clock.")
@click.option("--out", type=click.Path(path_type=Path), default="bench/results/compute_curve", show_default=True)
@dry_run_options
def main(checkpoints_dir, hidden, generated, target_json, num_prompts, e2e_every, seconds_per_step, out, dry_run, work):
    from dataclasses import replace

    from dflash_pipeline.drafters.checkpoints import list_checkpoints
    from dflash_pipeline.foundation.config import load_params
    from dflash_pipeline.evaluate.run import decode_end_to_end, load_candidates, score_candidates, sequence_categories
    from dflash_pipeline.foundation.files import read_json
    from dflash_pipeline.data.shards import open_split
    from dflash_pipeline.target.load import TargetInfo, load_target_head

    import torch

    config = load_params(REPO_ROOT / "params.yaml").evaluate
    if dry_run:  # the study's plumbing on a toy run; its curve beside it, never in bench/results
        toy = toy_run(work)
        checkpoints_dir, hidden, generated, target_json, out = toy.checkpoints, toy.hidden, toy.generated, toy.target_json, work / "compute_curve"
        config, num_prompts = replace(config, max_new_tokens=8), 1
    if num_prompts is not None:
        config = replace(config, num_prompts=num_prompts)
    target = TargetInfo.from_json(target_json)
    val_set = open_split(hidden / "val", expected_fingerprint=target.fingerprint)
    seconds_at = {row["step"]: row["seconds"] if seconds_per_step is None else row["step"] * seconds_per_step
                  for row in read_json(checkpoints_dir / "state.json", missing="no state.json")["curve"]}
    folders = list_checkpoints(checkpoints_dir)
    candidates = load_candidates(checkpoint_folders=folders, baseline_dirs=[], target=target, layer_ids=val_set.manifest.layer_ids,
                                 device="cpu")
    head = load_target_head(target, device="cpu", dtype=torch.float32)
    categories = sequence_categories(val_set, generated / "val.parquet")
    records, _ = score_candidates(candidates, head, val_set, categories, config, device="cpu")
    e2e_names = [c.name for i, c in enumerate(candidates) if (i + 1) % e2e_every == 0 or i == len(candidates) - 1]
    e2e, _ = decode_end_to_end(e2e_names, candidates, head, target=target, layer_ids=val_set.manifest.layer_ids,
                               feature_dtype=val_set.manifest.feature_dtype, generated_val=generated / "val.parquet", config=config,
                               device="cpu", acceptance={r.name: r.teacher_forced.slot_acceptance_conditional for r in records
                                                         if r.name in e2e_names})
    table = []
    for record in records:
        scored, chain = record.teacher_forced, e2e[record.name].chain if record.name in e2e else None
        streak = scored.ddtree_streak.get(8)
        table.append({"step": record.step, "train_minutes": round(seconds_at.get(record.step, float("nan")) / 60, 2),
                      "tau": scored.tau.mean, "tau_ci95": scored.tau.ci95, "ddtree8_streak": streak.mean if streak else None,
                      "e2e_tau": chain.tau.mean if chain else None, "verify_tokens": chain.verify_tokens if chain else None,
                      "speedup": chain.speedup if chain else None, "break_even_tau": chain.break_even_tau if chain else None,
                      "lossless_rate": chain.lossless_rate if chain else None})
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(table, indent=2) + "\n")
    with open(out.with_suffix(".csv"), "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(table[0]))
        writer.writeheader()
        writer.writerows(table)
    print(f"{'step':>6} {'train min':>9} {'tau':>15} {'ddtree8':>8} {'verify k':>8} {'e2e tau':>8} {'speedup':>8} {'break-even':>10} lossless")
    for r in table:
        e2e_part = (f"{r['e2e_tau']:8.3f} {r['speedup']:8.3f} {r['break_even_tau']:10.3f} {r['lossless_rate']}" if r["e2e_tau"] is not None
                    else f"{'-':>8} {'-':>8} {'-':>10} -")
        print(f"{r['step']:6d} {r['train_minutes']:9.1f} {r['tau']:7.3f} +- {r['tau_ci95']:.3f} {r['ddtree8_streak']:8.3f} "
              f"{r['verify_tokens']!s:>8} {e2e_part}")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    minutes = [r["train_minutes"] for r in table]
    figure, tau_axis = plt.subplots(figsize=(8, 5))
    tau_axis.errorbar(minutes, [r["tau"] for r in table], yerr=[r["tau_ci95"] for r in table], marker="o", capsize=3,
                      label="held-out teacher-forced tau (95% CI)")
    decoded = [r for r in table if r["e2e_tau"] is not None]
    decoded_minutes = [r["train_minutes"] for r in decoded]
    tau_axis.plot(decoded_minutes, [r["e2e_tau"] for r in decoded], marker=".", label="end-to-end tokens per step (verify length k)")
    tau_axis.plot(decoded_minutes, [r["break_even_tau"] for r in decoded], linestyle="--", color="grey", label="break-even tokens per step")
    tau_axis.set(xlabel="training minutes (this machine)", ylabel="tau")
    speed_axis = tau_axis.twinx()
    speed_axis.plot(decoded_minutes, [r["speedup"] for r in decoded], marker="s", color="tab:red", label="speedup vs plain greedy")
    speed_axis.axhline(1.0, color="tab:red", linewidth=0.5)
    speed_axis.set_ylabel("end-to-end speedup", color="tab:red")
    lines = tau_axis.get_legend_handles_labels()
    more = speed_axis.get_legend_handles_labels()
    tau_axis.legend(lines[0] + more[0], lines[1] + more[1], fontsize=8, loc="lower right")
    figure.tight_layout()
    figure.savefig(out.with_suffix(".png"), dpi=110)


if __name__ == "__main__":
    main()
