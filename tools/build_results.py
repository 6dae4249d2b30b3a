"""Build docs/results.md, every table of numbers in the docs, from the committed results.

    python tools/build_results.py              # (re)write docs/results.md from the files committed at HEAD
    python tools/build_results.py --check      # exit 1 when docs/results.md is not what it would write
    python tools/build_results.py --workspace  # from the files as they are in the workspace (a run not yet committed)

Sources: the committed run's metrics (`data/metrics/*.json`), its plot data (`data/plots/*.csv`),
its `dvc.lock` (output sizes), the benchmarks' and studies' results (`bench/results/*.json`) and the
test suite's record (`tests/durations.json`),
read through git at HEAD: a run of the pipeline rewrites `data/metrics` and `data/plots` in the
workspace (another machine, another `-S` setting), and the page describes the committed run, not
whichever run the workspace holds. To commit a new run: commit its metrics, plots and dvc.lock, then
build (or build with `--workspace` and commit the page with them).
Nothing here is typed by hand: a table is a spec, `Table(title, source, columns)`, with each
column a (label, dotted key path, format), and the few lines at the bottom render it. A metrics key
that is renamed is a one-line edit of its path; a path that no row has fails loudly, so a stale
spec cannot pass `--check`.

Key paths: `a.b.c` walks dicts (and list indices); in `Table.rows`, a `*` takes every item of a
dict or list, one table row each, and the column path `@` is that item's key. A tuple of paths
feeds several values to one format (`("tau", "tau_ci95")` with "{:.3f} ± {:.3f}"). A format is a
`str.format` string or a function of the value(s). A value that is null, or a key that some rows
lack, is a blank cell. `Grid` is the one other shape: a table whose every cell names its own path
in a single record (the decoding modes of eval.json, one row per mode).
"""

import argparse
import csv
import difflib
import functools
import io
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import yaml

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "docs" / "results.md"
COMMITTED_AT = "HEAD"  # the git revision the sources are read at (None: the workspace files)

Path_ = str | tuple[str, ...] | None  # a dotted key path, several of them, or None for a fixed text
Format = str | Callable


@dataclass(frozen=True)
class Table:
    """One row per record: the records at `rows` in `source` (a dict there is a single row)."""
    title: str
    source: str
    columns: list[tuple[str, Path_, Format]]
    rows: str = ""
    note: str = ""


@dataclass(frozen=True)
class Grid:
    """One record (`source` at `rows`), its cells laid out by hand: rows of (label, [(path, format)])."""
    title: str
    source: str
    header: list[str]
    cells: list[tuple[str, list[tuple[Path_, Format]]]]
    rows: str = ""
    note: str = ""


# ----------------------------------------------------------------------------- formats

F2, F3, F4 = "{:.2f}", "{:.3f}", "{:.4f}"


def with_interval(mean: float, ci95: float | None) -> str:
    """A value and its 95% interval; one prompt leaves no interval (null), spelled as the console does."""
    return f"{mean:.3f} ± " + ("n/a" if ci95 is None else f"{ci95:.3f}")


PM3 = with_interval

PAIRED = "{:+.3f} ± {:.3f}"    # a paired difference and its 95% interval
INT = "{:,}"
S1 = "{:.1f} s"


def yes_no(value) -> str:
    return "yes" if value else "no"


def mib(value: float) -> str:
    return f"{value / 1024:.1f} GiB" if value >= 1024 else f"{value:.0f} MiB"


def megabytes(value: int) -> str:
    return f"{value / 1e6:,.1f} MB" if value >= 1e6 else f"{value / 1e3:.1f} kB"


def hours(value: float) -> str:
    """A duration given in hours, in the unit that reads best."""
    seconds = value * 3600
    return f"{value:.1f} h" if value >= 1 else f"{seconds / 60:.0f} min" if seconds >= 60 else f"{seconds:.1f} s"


def gib(value: float) -> str:
    return f"{value / 1024:.0f} TiB" if value >= 1024 else f"{value:.0f} GiB"


# ----------------------------------------------------------------------------- the tables

EVAL = "data/metrics/eval.json"  # nested by section (docs/metrics-keys.md); details.json is a DVC output, not in git
TAU = ("tau", "tau_ci95")

COMMITTED = [
    Table("The committed run at a glance", EVAL, [
        ("chosen checkpoint", "chosen.name", "{}"),
        ("teacher-forced τ", ("teacher_forced.tau", "teacher_forced.tau_ci95"), PM3),
        ("best mode", "best_mode.mode", "`{}`"),
        ("speedup", "best_mode.speedup", F3),
        ("best mode's lossless rate", "best_mode.lossless_rate", "{}"),
        ("val prompts", "teacher_forced.prompts", "{}"),
        ("blocks", "teacher_forced.blocks", INT),
    ], note="The chosen drafter's teacher-forced τ (val prompts), and the fastest lossless greedy decoding mode "
            "against plain decoding of the same prompts, in the same process (`best_mode`)."),
    Table("generate", "data/metrics/generate.json", [
        ("prompts", "prompts", INT),
        ("answer tokens made", "new_tokens", INT),
        ("answers reused", "reused_answers", INT),
        ("seconds", "seconds", "{:.1f}"),
        ("tokens/s", "tokens_per_s", "{:.1f}"),
    ]),
    Table("capture", "data/metrics/capture.json", [
        ("split", "@", "{}"),
        ("tokens", "tokens_written", INT),
        ("shards written", "shards_written", "{}"),
        ("shards kept", "shards_kept", "{}"),
        ("seconds", "seconds", "{:.1f}"),
        ("tokens/s", "tokens_per_s", "{:.1f}"),
    ], rows="*"),
    Table("train", "data/metrics/train.json", [
        ("steps", "steps", INT),
        ("seconds", "seconds", "{:.1f}"),
        ("context tokens/s", "tokens_per_s", "{:,.1f}"),
        ("final loss", "loss", F4),
        ("periodic τ (last)", ("tau_tf", "tau_tf_ci95"), PM3),
        ("slot 1 acc", "slot1_acc", F3),
        ("slot 2 acc", "slot2_acc", F3),
        ("slot 3 acc", "slot3_acc", F3),
        ("mask token id", "mask_token_id", "{}"),
    ], note="The periodic τ is `evaluate`'s scorer on `train.eval_blocks` val blocks."),
    Table("τ by checkpoint (evaluate)", "data/plots/eval_tau_by_step.csv", [
        ("step", "step", "{}"),
        ("teacher-forced τ", TAU, "{} ± {}"),
        ("DDTree-8 streak", "ddtree8_streak", "{}"),
    ], rows="*"),
    Table("Acceptance by slot", "data/plots/eval_slots.csv", [
        ("slot", "slot", "{}"),
        ("P(correct), given the slots before it accepted", "acceptance", F3),
        ("P(slot correct)", "acceptance_unconditional", F3),
    ], rows="*", note="The chosen checkpoint, teacher-forced."),
    Table("Greedy chain decoding end to end", EVAL, [
        ("verify k", "chain.verify_tokens", "{}"),
        ("τ per step (e2e)", ("chain.tau", "chain.tau_ci95"), PM3),
        ("speedup", "chain.speedup", F3),
        ("break-even τ", "chain.break_even_tau", F3),
        ("lossless rate", "chain.lossless_rate", "{}"),
        ("near-tie partings", "chain.near_tie_mismatches", "{}"),
    ], note="`evaluate.num_prompts` val prompts x `evaluate.max_new_tokens`, against plain decoding of the same "
            "prompts in the same process; the time split, tokens/s and per-category τ are in `data/eval/details.json`."),
    Table("DDTree trees by node budget", EVAL, [
        ("node budget", "@", "{}"),
        ("teacher-forced streak", "streak", F3),
        ("τ per step (e2e)", "tau", F3),
        ("speedup", "speedup", F3),
    ], rows="tree.*", note="The end-to-end tree τ is to be read against 1 + the teacher-forced DDTree streak, "
                           "as the chain's against τ."),
    Table("Sampled chain decoding", EVAL, [
        ("temperature", "@", "{}"),
        ("τ per step (e2e)", "tau", F3),
        ("speedup", "speedup", F3),
    ], rows="sampled.*", note="At T > 0 under `evaluate.sampling_rule`."),
    Table("Cached outputs of the committed run", "dvc.lock", [
        ("stage", "@", "{}"),
        ("output", "path", "`{}`"),
        ("size", "size", megabytes),
        ("files", "nfiles", "{}"),
    ], rows="stages.*.outs.*"),
]

STUDY = "bench/results"
EVALUATED = [  # the columns of a study row scored as `evaluate` scores (bench/studies/train_study.py)
    ("τ (evaluate)", TAU, PM3),
    ("vs first recipe, paired", ("tau_vs_first", "tau_vs_first_ci95"), PAIRED),
    ("DDTree-8", "ddtree8_streak", F3),
]

STUDIES = [
    Table("Fourth study: three levers (5 minutes each, block 4)", f"{STUDY}/study_levers.json", [
        ("recipe", "recipe", "`{}`"), ("steps", "steps", "{}"), ("train s", "train_seconds", "{:.0f}"), *EVALUATED,
        ("slot 1..3", ("slot1_acc", "slot2_acc", "slot3_acc"), "{:.3f} {:.3f} {:.3f}"),
    ], rows="*", note="`norm`: `feature_norm: channel_rms`; `distill`: `distill_weight: 0.5`; `data-vocab`: "
                      "`train_vocab: data`. Findings: [studies](studies.md#fourth-study-three-levers)."),
    Table("Fifth study: anchors and depth on top of the three levers", f"{STUDY}/study_ndv.json", [
        ("recipe", "recipe", "`{}`"), ("steps", "steps", "{}"), *EVALUATED,
    ], rows="*", note="`NDV`: draft vocabulary + distillation + feature scale, 16 anchors/seq, 1 layer; "
                      "`a32`: 32 anchors/seq; `2L`: 2 layers."),
    Table("How τ grows with training (10,000 steps, one checkpoint every 500)", f"{STUDY}/compute_curve_long.json", [
        ("step", "step", "{}"), ("train min", "train_minutes", "{:.0f}"), ("τ", TAU, PM3),
        ("DDTree-8", "ddtree8_streak", F3), ("verify k", "verify_tokens", "{}"),
        ("tokens/step", "e2e_tau", F3), ("speedup", "speedup", F3), ("break-even τ", "break_even_tau", F3),
    ], rows="*", note="End-to-end decoding on every fourth checkpoint; minutes are steps x 0.240 s."),
    Table("DFlash or DFlash2 (6 minutes each)", f"{STUDY}/dflash2_study.json", [
        ("recipe", "recipe", "`{}`"), ("steps", "steps", "{:,}"), *EVALUATED, ("slot-1 acc", "slot1_acc", F3),
        ("τ with per-slot argmax", "tau_argmax", F3), ("oracle over top-16", "tau_oracle", F3),
    ], rows="*", note="`default` was params.yaml's train section that day: DFlash."),
    Table("The selector's sizes (1,200 steps each)", f"{STUDY}/selector_study.json", [
        ("recipe", "recipe", "`{}`"), *EVALUATED[:2], ("τ with per-slot argmax", "tau_argmax", F3),
        ("selector gain", ("tau_selector_gain", "tau_selector_gain_ci95"), PAIRED),
        ("oracle over top-16", "tau_oracle", F3), ("DDTree-8", "ddtree8_streak", F3),
        ("train s", "train_seconds", "{:.0f}"),
    ], rows="*", note="`default`: `selector_weight` 1, `selector_rank` 64."),
]

COSTS = [  # bench/studies/dvc_costs.py: 3 GiB of shards per row, seconds
    ("row", "name", "`{}`"), ("cache.type", "link_types", "`{}`"), ("files", "files", "{:,}"),
    ("workspace file", "workspace_link", "{}"), ("read-only", "read_only", yes_no),
    ("commit", "commit_s", F2), ("first hash", "first_hash_s", F2), ("no-op status", "noop_status_s", F2),
    ("no-op repro", "noop_repro_s", F2), ("push", "push_s", "{:.1f}"), ("pull", "pull_s", "{:.1f}"),
    ("checkout", "checkout_s", F2), ("unprotect", "unprotect_s", F2), ("workspace + cache", "disk_mib", mib),
]
PROJECTION = [
    ("size", "tib", "{} TiB"), ("256 MB files", "files", "{:,}"), ("first hash", "first_hash_h", hours),
    ("commit", "commit_h", hours), ("no-op status", "noop_status_s", S1), ("push", "push_h", hours),
    ("pull", "pull_h", hours), ("checkout", "checkout_h", hours), ("unprotect (if persisted)", "unprotect_h", hours),
    ("workspace + cache", "disk_gib", gib), ("with reflink-first on ext4", "disk_reflink_first_gib", gib),
]
DVC_COSTS = [
    Table("What DVC costs on 3 GiB of shards (2026-12-03)", f"{STUDY}/dvc_costs.json", COSTS, rows="rows.*",
          note="Seconds; `python bench/studies/dvc_costs.py --gb 3`. The committed `.dvc/config` is `hardlink,copy` "
               "with 256 MB shards."),
    Table("Projected to 1 and 10 TiB (2026-12-03)", f"{STUDY}/dvc_costs.json", PROJECTION, rows="projection.*"),
    Table("Rechecked the next day (2026-12-04)", f"{STUDY}/dvc_costs_recheck.json", COSTS, rows="rows.*"),
    Table("Projected from the recheck (2026-12-04)", f"{STUDY}/dvc_costs_recheck.json", PROJECTION, rows="projection.*"),
]

def retired(bench_at_commit: str, compared: str) -> str:
    """The note of a table whose bench was a one-off comparison, retired once it had answered (issue #46:
    bench/ by purpose); `bench_at_commit` names it as the last commit that had it, "6dfc1ff:bench/static_engine.py"."""
    return f"`{bench_at_commit}` ({compared}) was retired after that commit; `git show {bench_at_commit}` is the bench as it ran."


HOST_PATHS_RETIRED = retired("6dfc1ff:bench/host_paths.py", "the code before issue #27, kept in tests/oracles")
STATIC_ENGINE_RETIRED = retired("6dfc1ff:bench/static_engine.py", "the engine against the host loops it replaced")
ENGINES_RETIRED = "`--engines` of " + retired("6dfc1ff:bench/generate.py", "the stage's loop against the transformers loop it replaced")

HOST_PATHS = [
    Table("A GPU train step's host work, 16K context tokens, block 16 (6dfc1ff:bench/host_paths.py)", f"{STUDY}/host_paths.json", [
        ("machine", "machine", "{}"), ("sequences", "train.sequences", "{}"), ("blocks", "train.blocks", INT),
        ("dense mask", "train.dense_mask_mb", "{:.0f} MB"), ("metadata", "train.metadata_kb", "{:.0f} KB"),
        ("per-anchor batch + mask ms", "train.per_anchor_with_dense_mask_ms", "{:.0f}"), ("vectorised ms", "train.vectorised_ms", "{:.1f}"),
        ("speedup", "train.speedup_batch_building", "{:.1f}x"), ("BlockMask from metadata ms", "train.block_mask_from_metadata_ms", "{:.1f}"),
        ("tensors equal", "train.tensors_equal", yes_no),
    ], note=HOST_PATHS_RETIRED),
    Table("The capture writer (6dfc1ff:bench/host_paths.py)", f"{STUDY}/host_paths.json", [
        ("tokens", "capture_writer.tokens", INT), ("element by element µs/token", "capture_writer.elementwise_us_per_token", F2),
        ("zero-copy, hashed while written µs/token", "capture_writer.zero_copy_us_per_token", F2),
        ("speedup", "capture_writer.speedup", "{:.2f}x"), ("same sha256", "capture_writer.same_sha256", yes_no),
    ], note=HOST_PATHS_RETIRED),
    Table("The CPU stages against the commit before (6dfc1ff:bench/cpu_before_after.py)", f"{STUDY}/cpu_before_after.json", [
        ("machine", "machine", "{}"), ("baseline", "baseline", "`{}`"), ("sequences", "sequences", "{}"), ("rounds", "rounds", "{}"),
        ("capture tokens/s, now / before", "capture_tokens_per_s_ratio", F3), ("train ms/step, now / before", "train_step_time_ratio", F3),
        ("shards byte-identical", "shards_identical", yes_no), ("largest loss difference", "max_relative_loss_difference", "{:.1e}"),
    ], note="The real target, a fabricated generate output of the default run's lengths, params.yaml's settings; each version "
            "in its own process, alternating. Goals: both ratios no worse than 1 (capture >= 1, train <= 1), within noise. "
            + retired("6dfc1ff:bench/cpu_before_after.py", "this tree against an earlier commit")),
]

STATIC_COLUMNS = [
        ("mode", "@", "`{}`"), ("host tokens/s", "host_tokens_per_s", "{:.1f}"), ("static tokens/s", "static_tokens_per_s", "{:.1f}"),
        ("static / host", "static_over_host", "{:.3f}x"), ("host ms/step", "host_ms_per_step", "{:.1f}"),
        ("static ms/step", "static_ms_per_step", "{:.1f}"), ("host speedup over plain", "host_speedup_over_plain", F3),
        ("static speedup over plain", "static_speedup_over_plain", F3), ("same answers", "identical_answers", "{}"),
        ("same steps", "identical_steps", "{}"),
    ]
STATIC_ENGINE = [
    Table("Before the one engine: the hand-written Llama step (6dfc1ff:bench/static_engine.py, 2026-12-06)",
          f"{STUDY}/static_engine_before_36.json", STATIC_COLUMNS, rows="modes.*",
          note="The real SmolLM2 target in fp32 on the 2-core Intel Xeon (torch threads 1), the committed DFlash2 step 1600, 4 val "
               "prompts x 64 tokens x 2 rounds, each (mode, prompt) on both loops back to back, alternating which goes first; the "
               "chain verifies all 3 drafted tokens (a slowdown on a CPU, see decoding.md). Each loop's speedup is over its own plain "
               "decoding. The host loop is transformers' forward with a DynamicCache. "
               + STATIC_ENGINE_RETIRED),
    Table("The one engine: transformers' layers over the static cache (6dfc1ff:bench/static_engine.py, 2026-12-06)",
          f"{STUDY}/static_engine_after_36.json", STATIC_COLUMNS, rows="modes.*",
          note="The same bench, prompts and machine, run right after the one above. (An earlier table here, from the EPYC, compared "
               "the static step with itself: the bench's host side had called the dispatching functions; see gpu.md.) "
               + STATIC_ENGINE_RETIRED),
    Table("Issue #36 part 2, before: the code before the host loops left the package (46e3be4:bench/static_engine.py)",
          f"{STUDY}/static_engine_before_36b.json", STATIC_COLUMNS, rows="modes.*",
          note="The same bench, prompts and machine as above, each version's bench from its own checkout, one after the other on "
               "the quiet machine (2026-12-06); the host loop is the same code in both (moved to tests/oracles in part 2), so the "
               "static / host ratios compare the two engines. "
               + STATIC_ENGINE_RETIRED),
    Table("Issue #36 part 2, after: one plain step, one loop, one graph runner (6dfc1ff:bench/static_engine.py)",
          f"{STUDY}/static_engine_after_36b.json", STATIC_COLUMNS, rows="modes.*",
          note="Run right after the table above. Plain decoding records no steps now (as the host loop), hence 8/8 same steps. "
               + STATIC_ENGINE_RETIRED),
    Table("The step's forward: transformers' layers against hand-written Llama layers (6dfc1ff:bench/engine_forward.py)",
          f"{STUDY}/engine_forward_cpu.json", [
              ("batch", "@", "{}"), ("transformers ms/step", "transformers_ms_per_step", F2),
              ("hand-written ms/step", "hand_written_ms_per_step", F2), ("ratio", "transformers_over_hand_written", F3),
              ("same tokens", "identical_tokens", yes_no),
          ], rows="batches.*",
          note="SmolLM2 (LlamaForCausalLM, 30 layers) in fp32 on the 2-core Intel Xeon, torch threads 1, 64 greedy decode steps "
               "after the first val prompts (at most 256 tokens each), both over the whole cache length, median of 5 alternating "
               "rounds (2026-12-06). " + retired("6dfc1ff:bench/engine_forward.py", "against the hand-written layers the engine dropped")),
    Table("The generate stage's loop: the static step against transformers' loop (6dfc1ff:bench/generate.py --engines)",
          f"{STUDY}/generate_engines.json", [
              ("machine", "machine", "{}"), ("date", "date", "{}"), ("prompts", "prompts", "{}"),
              ("max new tokens", "max_new_tokens", "{}"), ("static tokens/s", "tokens_per_s.static KV", "{:.1f}"),
              ("transformers tokens/s", "tokens_per_s.transformers", "{:.1f}"), ("static / transformers", "static_vs_transformers", F3),
              ("same answers", "answers_identical", yes_no),
          ], note="Batch 64 of the default prompts, 2 alternating rounds; the static step on a CPU attends over the written columns "
                  "only and drops ended rows after every step. " + ENGINES_RETIRED),
    Table("The generate stage's loop before and after it became the engine's plain step (6dfc1ff:bench/generate.py --engines, issue #36)",
          f"{STUDY}/generate_engines_36b.json", [
              ("run", "run", "{}"), ("code", "code", "{}"), ("static tokens/s", "static_tokens_per_s", "{:.1f}"),
              ("transformers tokens/s", "transformers_tokens_per_s", "{:.1f}"), ("static / transformers", "static_vs_transformers", F3),
              ("same answers", "answers_identical", yes_no),
          ], rows="runs.*",
          note="Batch 64 x 128 tokens on the 2-core Xeon, torch threads 1, 2026-12-06; each run is one version's bench (2 alternating "
               "rounds against tests/oracles' transformers loop, the same code in both), the four runs one after the other in the "
               "order listed. Mean static / transformers: 0.996 before, 0.972 after; the same version moved by 1.5-2.5% between its "
               "runs (and measured 1.093 on the same machine the day's first run), so the difference is within that spread. "
               + ENGINES_RETIRED),
]

SCALE = [
    Table("generate and capture at 1 and 2 processes on a CPU (bench/scale.py)", f"{STUDY}/scale_cpu.json", [
        ("stage", "@", "`{}`"), ("1 process x 1 thread s", "1 process x 1 thread.seconds", "{:.1f}"),
        ("1 process x all cores s", "1 process x all cores.seconds", "{:.1f}"),
        ("2 processes x 1 thread s", "2 processes x 1 thread.seconds", "{:.1f}"),
        ("all cores / 1 thread", "1 process x all cores.speedup_vs_1x1", "{:.2f}x"),
        ("2 processes / 1 thread", "2 processes x 1 thread.speedup_vs_1x1", "{:.2f}x"),
        ("stage tokens/s (1 x 1, all cores, 2 x 1)", ("1 process x 1 thread.stage_tokens_per_s", "1 process x all cores.stage_tokens_per_s",
                                                      "2 processes x 1 thread.stage_tokens_per_s"), "{:.0f}, {:.0f}, {:.0f}"),
    ], rows="stages.*",
       note="The default SmolLM2 target in fp32, the first prompts of the default set; each way the whole stage command as "
            "`dvc repro` runs it (`stages/launch.py --processes N`), start-up and model load included, best of the rounds; "
            "the stage's tokens/s is its own count over its own seconds (capture: both splits). Machine, sizes and whether each "
            "way wrote the bytes of one process with one thread: the JSON file."),
    Table("What a run costs at scale: a model, not a measurement (bench/studies/scale_costs.py)", f"{STUDY}/scale_costs.json", [
        ("target", "target", "{}"), ("prompts", "prompts", "{:,}"), ("generate GPU-h", "generate_gpu_hours", "{:,.1f}"),
        ("capture GPU-h", "capture_gpu_hours", "{:,.1f}"), ("capture bound by", "capture_bound", "{}"),
        ("train GPU-h (6 epochs)", "train_gpu_hours", "{:,.1f}"), ("8-GPU node-hours", "node_hours_8_gpus", "{:,.1f}"),
        ("shards TB (bf16)", "shards_tb", "{:,.1f}"), ("shards TB (fp8)", "shards_tb_fp8", "{:,.1f}"),
    ], rows="rows.*",
       note="Every input is an assumption stated in the script and in [scale.md](scale.md#what-a-run-costs): H100 datasheet "
            "peaks, 50% of HBM bandwidth per decode step at batch 64, 40% MFU for capture's forward, 20% MFU for train (the "
            "issue-#37 goal, unmeasured), 4 GB/s of disk per node, 200 + 800 tokens per sample, 512 anchors x block 16, 6 epochs."),
]

DURATIONS = "tests/durations.json"  # `make test-record` (tests/support/durations.py)

SUITE = [
    Table("The whole suite", DURATIONS, [
        ("date", "date", "{}"), ("machine", "machine", "{}"), ("tests", "tests", INT), ("passed", "outcomes.passed", INT),
        ("skipped", "outcomes.skipped", INT), ("failed", "outcomes.failed", INT),
        ("minutes", "seconds", lambda seconds: f"{seconds / 60:.1f}"),
    ], note="`make test-record` on a clean clone, alone on the machine: `make test` with the record written; "
            "the README quotes its count and minutes."),
    Table("Its 30 slowest tests", DURATIONS, [
        ("rank", "rank", "{}"), ("test", "test", "`{}`"), ("seconds", "seconds", "{:.1f}"),
    ], rows="slowest", note="Setup, call and teardown together, as `pytest --durations` counts them; the session's one "
                            "`dvc repro` of the tiny pipeline from nothing falls in the setup of the first test that copies it."),
]

SECTIONS = [
    ("The committed run", "`make repro` of the commit's code: its `data/metrics`, `data/plots` and `dvc.lock`.", COMMITTED),
    ("Training studies", "`bench/studies/train_study.py` and `bench/studies/compute_curve.py`; what they showed is in "
                         "[studies.md](studies.md).", STUDIES),
    ("What DVC costs", "`bench/studies/dvc_costs.py`; what it showed is in [team-setup.md](team-setup.md#big-outputs-what-dvc-costs-and-the-cheap-defaults).",
     DVC_COSTS),
    ("The GPU path's host work", "What a GPU train step and capture batch waited for, before and after issue #27, measured on a CPU; "
                                 "what changed is in [gpu.md](gpu.md#the-train-step-and-capture-without-host-waits).", HOST_PATHS),
    ("Decoding without host waits", "Issue #28's speculative step kept on the device and issue #36's one engine, measured on a CPU "
                                    "against the host loops; what they are is in [gpu.md](gpu.md#decoding-without-host-waits-issue-28) "
                                    "and [decoding.md](decoding.md#the-steps-forward-transformers-layers).", STATIC_ENGINE),
    ("Scale", "Several processes measured on a CPU, and the cost of 8B and 70B runs modelled; how to launch them is in "
              "[scale.md](scale.md).", SCALE),
    ("The test suite", "What `make test` costs and where its time goes (README, [Tests](../README.md#tests)).", SUITE),
]


# ----------------------------------------------------------------------------- rendering

def load(source: str, revision: str | None = COMMITTED_AT):
    text = source_text(REPO, revision, source)
    suffix = Path(source).suffix
    if suffix == ".csv":
        return [{k: _number(v) for k, v in row.items()} for row in csv.DictReader(io.StringIO(text, newline=""))]
    return json.loads(text) if suffix == ".json" else yaml.safe_load(text)


@functools.cache
def source_text(repo: Path, revision: str | None, source: str) -> str:
    """A source file's text as committed at `revision` (`git show`), or as the workspace holds it."""
    if revision is None:
        return (repo / source).read_text()
    shown = subprocess.run(["git", "-C", str(repo), "show", f"{revision}:./{source}"], capture_output=True, text=True)
    if shown.returncode != 0:
        raise FileNotFoundError(f"{source} is not committed at {revision} ({shown.stderr.strip().splitlines()[-1:]}): "
                                "commit it, or build from the workspace with --workspace")
    return shown.stdout


def _number(text: str):
    """A CSV cell as the number it spells (as written, so 1.0 stays a float), or None when empty."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text or None


def get(node, path: str):
    for part in path.split(".") if path else []:
        node = node[int(part)] if isinstance(node, list) else node[part]
    return node


def records(node, path: str, key=None) -> list[tuple[object, object]]:
    """(key, record) for every record at `path`; `*` expands a dict or list, the first `*` names the key."""
    head, star, rest = path.partition("*")
    node = get(node, head.strip("."))
    if not star:
        return [(key, node)] if isinstance(node, dict) else [(key, item) for item in node]
    items = _in_order(node.items()) if isinstance(node, dict) else enumerate(node)
    return [row for k, item in items for row in records(item, rest.strip("."), k if key is None else key)]


def _in_order(items):
    """A dict's items, numerically ordered when every key is a number (tree budgets "4", "8", "16")."""
    items = list(items)
    try:
        return sorted(items, key=lambda item: float(item[0]))
    except ValueError:
        return items


def cell(record, key, path: Path_, fmt: Format) -> str:
    if path is None:
        return fmt
    paths = (path,) if isinstance(path, str) else path
    try:
        values = [key if p == "@" else get(record, p) for p in paths]
    except (KeyError, IndexError, TypeError):
        return ""
    if values[0] is None or (not callable(fmt) and any(v is None for v in values)):
        return ""  # a format function spells its own undefined companions (an interval's "n/a")
    return fmt(*values) if callable(fmt) else fmt.format(*values)


def render(table: Table | Grid, revision: str | None = COMMITTED_AT) -> str:
    data = load(table.source, revision)
    if isinstance(table, Grid):
        (key, record), = records(data, table.rows)
        header, body = table.header, [[label] + [cell(record, key, p, f) for p, f in row] for label, row in table.cells]
        paths = [p for _, row in table.cells for p, _ in row]
    else:
        rows = records(data, table.rows)
        header, body = [c[0] for c in table.columns], [[cell(r, k, p, f) for _, p, f in table.columns] for k, r in rows]
        paths = [p for _, p, _ in table.columns]
    for path in paths:  # a key that no row has is a stale spec, not a blank column
        for p in (path,) if isinstance(path, str) else path or ():
            if p != "@" and not any(_has(r, p) for _, r in records(data, table.rows)):
                raise KeyError(f"{table.source}: no row has the key '{p}' (table '{table.title}')")
    lines = [f"### {table.title}", "", f"From `{table.source}`." + (f" {table.note}" if table.note else ""), "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in body]
    return "\n".join(lines) + "\n"


def _has(record, path: str) -> bool:
    try:
        get(record, path)
        return True
    except (KeyError, IndexError, TypeError):
        return False


def slug(title: str) -> str:
    """GitHub's heading anchor: lower case, punctuation dropped, spaces to hyphens."""
    return "".join(c for c in title.lower() if c.isalnum() or c in " -_").replace(" ", "-")


def build(revision: str | None = COMMITTED_AT) -> str:
    parts = ["# Results", "",
             "<!-- Generated by tools/build_results.py from the committed results; edit the script, not this file. -->", "",
             "Every table of numbers in the docs, generated from the committed files it names "
             "(`python tools/build_results.py`; `tests/test_docs.py` fails when this file is stale). "
             "The prose that reads them is in [studies.md](studies.md), [decoding.md](decoding.md) and "
             "[team-setup.md](team-setup.md).", ""]
    parts += [f"- [{title}](#{slug(title)})" for title, _, _ in SECTIONS] + [""]
    for title, intro, tables in SECTIONS:
        parts += [f"## {title}", "", intro, ""] + [render(table, revision) for table in tables]
    return "\n".join(parts).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when docs/results.md differs from what would be written")
    parser.add_argument("--workspace", action="store_true", help="read the sources as they are in the workspace, not at HEAD")
    args = parser.parse_args(argv)
    text = build(None if args.workspace else COMMITTED_AT)
    if not args.check:
        OUT.write_text(text)
        print(f"wrote {OUT.relative_to(REPO)}")
        return 0
    current = OUT.read_text() if OUT.exists() else ""
    if current == text:
        return 0
    diff = difflib.unified_diff(current.splitlines(), text.splitlines(), "docs/results.md", "would write", lineterm="", n=0)
    print("\n".join(list(diff)[:40]))
    print("docs/results.md is stale: run python tools/build_results.py", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
