"""Study: held-out teacher-forced tau against training time for several drafter recipes.

    python bench/studies/train_study.py --minutes 4 --out bench/results/train_study
    python bench/studies/train_study.py --dry-run      # two recipes, 2 steps each, on toy shards (tests/bench/test_dry_runs.py)

Needs the `capture` stage's shards (dvc repro capture). Each recipe trains from scratch on the
same shards for the same wall-clock budget (sized from a 6-step probe of its step time), or with
--steps for the same number of steps, in this one process, one after another; tau is
measured on the same fixed validation blocks every --eval-every steps. Each recipe's final drafter
is then scored as `evaluate` scores it (every val prompt, `evaluate.anchors_per_sequence` anchors,
DDTree-8) and compared with the FIRST recipe by the paired difference over prompts (same blocks),
so "better" means clear of zero at 95%. Prints a table and writes `<out>.csv` (recipe, step,
seconds, loss, tau, tau_ci95), `<out>.json` (the final comparison) and `<out>.png`.
"""

import csv
import os
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import click

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: `bench.*` from a plain `python bench/...`

from bench.toy import REPO_ROOT, TOY_TRAIN, dry_run_options, toy_run  # noqa: E402

RECIPES = {
    # params.yaml's train section as it stands, and the same with DFlash2's additions (issue 16):
    #   python bench/studies/train_study.py --recipes default,dflash2 --minutes 6 --out bench/results/dflash2_study
    "default": {},
    "dflash2": {"architecture": "dflash2"},
    "dflash2 rank16 k8": {"architecture": "dflash2", "options": {"dflash2": {"selector_rank": 16, "selector_top_k": 8}}},
    # the DFlash2 selector's sizes around the default (params.yaml is dflash2 now, so "default" is their baseline),
    # at equal steps: a weight costs nothing per step, and a cold first probe misjudges the step time
    #   python bench/studies/train_study.py --recipes default,"selector w0.5","selector w2","selector rank128" --steps 1200 \
    #       --out bench/results/selector_study
    "selector w0.5": {"options": {"dflash2": {"selector_weight": 0.5}}},
    "selector w2": {"options": {"dflash2": {"selector_weight": 2.0}}},
    "selector rank128": {"options": {"dflash2": {"selector_rank": 128}}},
    "baseline B16 lr6e-4 a16": {},
    "data vocab": {"train_vocab": "data"},
    "B8 lr2e-3": {"block_size": 8, "lr": 2e-3},
    "B16 lr2e-3": {"lr": 2e-3},
    "B8 lr2e-3 init-top": {"block_size": 8, "lr": 2e-3, "init": "target_top_layers"},
    "B8 lr2e-3 a48": {"block_size": 8, "lr": 2e-3, "anchors_per_sequence": 48},
    "B4 lr2e-3": {"block_size": 4, "lr": 2e-3},
    "B8 lr2e-3 a8 t4096": {"block_size": 8, "lr": 2e-3, "anchors_per_sequence": 8, "tokens_per_step": 4096},
    "B4 lr2e-3 a32": {"block_size": 4, "lr": 2e-3, "anchors_per_sequence": 32},
    "B4 lr2e-3 a8 t4096": {"block_size": 4, "lr": 2e-3, "anchors_per_sequence": 8, "tokens_per_step": 4096},
    "B4 norm": {"block_size": 4, "lr": 2e-3, "feature_norm": "channel_rms"},
    "B4 distill": {"block_size": 4, "lr": 2e-3, "distill_weight": 0.5},
    "B4 distill1": {"block_size": 4, "lr": 2e-3, "distill_weight": 1.0},
    "B4 norm distill": {"block_size": 4, "lr": 2e-3, "feature_norm": "channel_rms", "distill_weight": 0.5},
    "B4 data-vocab": {"block_size": 4, "lr": 2e-3, "train_vocab": "data"},
    "B4 norm distill data-vocab": {"block_size": 4, "lr": 2e-3, "feature_norm": "channel_rms", "distill_weight": 0.5,
                                   "train_vocab": "data"},
    "NDV": {"block_size": 4, "lr": 2e-3, "feature_norm": "channel_rms", "distill_weight": 0.5, "train_vocab": "data"},
    "NDV a32": {"block_size": 4, "lr": 2e-3, "feature_norm": "channel_rms", "distill_weight": 0.5, "train_vocab": "data",
                "anchors_per_sequence": 32},
    "NDV 2L": {"block_size": 4, "lr": 2e-3, "feature_norm": "channel_rms", "distill_weight": 0.5, "train_vocab": "data",
               "num_layers": 2},
    "DV a32": {"block_size": 4, "lr": 2e-3, "train_vocab": "data", "anchors_per_sequence": 32},
    "DV a64 t4096": {"block_size": 4, "lr": 2e-3, "train_vocab": "data", "anchors_per_sequence": 64, "tokens_per_step": 4096},
    "DV 2L": {"block_size": 4, "lr": 2e-3, "train_vocab": "data", "num_layers": 2},
    "DV lr4e-3": {"block_size": 4, "lr": 4e-3, "train_vocab": "data"},
    "DV B6": {"block_size": 6, "lr": 2e-3, "train_vocab": "data"},
    "B4 norm distill data-vocab 2L": {"block_size": 4, "lr": 2e-3, "feature_norm": "channel_rms", "distill_weight": 0.5,
                                      "train_vocab": "data", "num_layers": 2},
}


@click.command()
@click.option("--hidden", type=click.Path(path_type=Path), default="data/hidden", show_default=True)
@click.option("--target", "target_json", type=click.Path(path_type=Path), default="data/target/target.json", show_default=True)
@click.option("--minutes", default=4.0, show_default=True, help="Training budget per recipe.")
@click.option("--steps", "fixed_steps", type=int, default=None,
              help="Train every recipe this many steps instead (equal steps, not equal time: for recipes whose step costs the same).")
@click.option("--eval-every", default=25, show_default=True)
@click.option("--recipes", default=",".join(RECIPES), show_default=True, help="Comma-separated recipe names.")
@click.option("--out", type=click.Path(path_type=Path), default="bench/results/train_study", show_default=True)
@dry_run_options
def main(hidden, target_json, minutes, fixed_steps, eval_every, recipes, out, dry_run, work):
    import json

    import torch

    from dflash_pipeline.drafters.checkpoints import list_checkpoints, load_checkpoint
    from dflash_pipeline.foundation.config import load_params
    from dflash_pipeline.measure.scoring import comparison_verdict, paired_difference, score_teacher_forced, summarize_blocks
    from dflash_pipeline.data.shards import open_split
    from dflash_pipeline.target.load import TargetInfo, load_target_head
    from dflash_pipeline.train import run as train_module

    params = load_params(REPO_ROOT / "params.yaml")
    base, evaluate = params.train, params.evaluate
    if dry_run:  # the study's plumbing on toy shards; its results beside them, never in bench/results
        toy = toy_run(work, upto="hidden")
        hidden, target_json, fixed_steps, eval_every, recipes, out = toy.hidden, toy.target_json, 2, 1, "default,dflash2", work / "train_study"
        base = replace(base, **TOY_TRAIN)
    target = TargetInfo.from_json(target_json)
    head = load_target_head(target, device="cpu", dtype=torch.float32)
    val_set = open_split(hidden / "val", expected_fingerprint=target.fingerprint)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows, finals, reference = [], [], None
    for name in recipes.split(","):
        overrides = RECIPES[name]
        if fixed_steps:
            steps = fixed_steps
        else:  # steps sized from a measured step time so the cosine schedule ends near the budget
            probe = replace(base, max_steps=6, eval_every=10**6, save_every=10**6, **overrides)
            with tempfile.TemporaryDirectory() as scratch:
                curve = train_module.run_train(probe, target=target, train_dir=hidden / "train", val_dir=hidden / "val",
                                               out_dir=Path(scratch), device="cpu", log=lambda *_: None).curve
            step_seconds = (curve[-1]["seconds"] - curve[0]["seconds"]) / (len(curve) - 1)
            steps = max(10, int(minutes * 60 / step_seconds))
        config = replace(base, max_steps=steps, eval_every=eval_every, save_every=10**6, **overrides)
        with tempfile.TemporaryDirectory() as scratch:
            result = train_module.run_train(config, target=target, train_dir=hidden / "train", val_dir=hidden / "val",
                                            out_dir=Path(scratch), device="cpu", log=lambda *_: None)
            drafter, _ = load_checkpoint(list_checkpoints(Path(scratch))[-1])
        scores = score_teacher_forced(drafter, head, val_set, anchors_per_sequence=evaluate.anchors_per_sequence,
                                      tokens_per_batch=evaluate.tokens_per_batch, tree_budgets=[8], seed=evaluate.seed)
        scored = summarize_blocks(scores)
        final = {"recipe": name, "steps": steps, "train_seconds": result.seconds, "tau": scored.tau.mean, "tau_ci95": scored.tau.ci95,
                 "blocks": scored.blocks, "prompts": scored.prompts, "ddtree8_streak": scored.ddtree_streak[8].mean,
                 "slot_acceptance": scored.slot_acceptance, "slot_acceptance_conditional": scored.slot_acceptance_conditional,
                 "extras": scored.extras}
        if reference is None:
            reference = (name, scores)
        else:
            mean, half, prompts = paired_difference(scores, reference[1])
            final.update(tau_vs_first=round(mean, 4), tau_vs_first_ci95=round(half, 4))
            print(comparison_verdict(name, reference[0], mean, half, prompts), flush=True)
        finals.append(final)
        for row in result.curve:
            if "tau" in row:
                rows.append({"recipe": name, "step": row["step"], "seconds": row["seconds"], "loss": row["loss"],
                             "tau": row["tau"], "tau_ci95": row["tau_ci95"]})
        held_out = result.held_out
        print(f"{name:32s} {steps:5d} steps  tau {held_out.tau.mean:.3f} +- {held_out.tau.ci95:.3f}  "
              f"loss {result.loss:.3f}  slots {[round(a, 3) for a in held_out.slot_accuracy[:4]]}", flush=True)
    out.with_suffix(".json").write_text(json.dumps(finals, indent=2) + "\n")
    print(f"{'recipe':32s} {'steps':>5s} {'tau (evaluate)':>16s} {'vs first':>18s} {'ddtree8':>8s} slot1")
    for final in finals:
        versus = f"{final['tau_vs_first']:+.3f} +- {final['tau_vs_first_ci95']:.3f}" if "tau_vs_first" in final else "(reference)"
        print(f"{final['recipe']:32s} {final['steps']:5d} {final['tau']:8.3f} +- {final['tau_ci95']:.3f} {versus:>18s} "
              f"{final['ddtree8_streak']:8.3f} {final['slot_acceptance'][0]:.3f}")
    for final in (f for f in finals if f["extras"]):  # the architecture's own figures (DFlash2: what its selector buys)
        print(f"{final['recipe']}: " + ", ".join(f"{key} {value}" for key, value in final["extras"].items()))
    with open(out.with_suffix(".csv"), "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(8, 5))
    for name in dict.fromkeys(r["recipe"] for r in rows):
        points = [r for r in rows if r["recipe"] == name]
        axis.plot([p["seconds"] / 60 for p in points], [p["tau"] for p in points], marker=".", label=name)
    axis.set(xlabel="training minutes (2-core CPU)", ylabel="held-out teacher-forced tau", title="drafter recipes")
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(out.with_suffix(".png"), dpi=110)


if __name__ == "__main__":
    main()
