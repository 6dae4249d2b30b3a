"""Benchmark: a train step's host preparation before and after issue #37 item 2, side by side.

    python bench/train_prep.py [--rounds 4] [--steps 6]

Old: `prepare_step` as it was (tests/oracles/train_prep.py: anchors drawn sequence by sequence,
the whole step's top-K concatenated and converted before its slots' rows are gathered). New: the
stage's `prepare_step` (one step-wide anchor draw, only the slots' top-K rows converted). Both
prepare the same steps of the same plan, alternating round by round in this one process, and the
same drafter then trains on them (the CPU stage prepares inline, so a step's time is preparation
plus step). Also the share of a step spent in the LM-head loss (`ChunkedHeadCrossEntropy`), and batch
building alone at the GPU bench's shapes (`--host-tokens`, block 16), old against new.

Data: synthetic sequences at the committed run's shapes (SmolLM2-135M: hidden 576, 5 taps x 576
bf16 features, top-K 32; lengths 60-376; answers over a ~9K-token vocabulary, the training
softmax's size), with params.yaml's train recipe (block 4, 2,048 tokens per step, 16 anchors
per sequence, DFlash2, distillation). `--tokens-per-step 16384 --block-size 16` gives the GPU
bench's host shapes. Writes bench/results/train_prep_cpu.json.
"""

import json
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import click

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the reference implementation lives beside the tests that pin it


def _samples(count: int, *, width: int, top_k: int, answer_vocab, seed: int = 0):
    import torch

    from dflash_pipeline.data.shards import Sample

    generator = torch.Generator().manual_seed(seed)
    samples = []
    for number in range(count):
        length = int(torch.randint(60, 377, (1,), generator=generator))
        prompt = int(torch.randint(10, max(11, length // 3), (1,), generator=generator))
        mask = torch.cat([torch.zeros(prompt, dtype=torch.uint8), torch.ones(length - prompt, dtype=torch.uint8)])
        ids = answer_vocab[torch.randint(0, answer_vocab.shape[0], (length,), generator=generator)].to(torch.int32)
        samples.append(Sample(f"s{number}", ids, mask, ids, torch.randn(length, width, generator=generator).to(torch.bfloat16),
                              target_topk_ids=torch.randint(0, 49152, (length, top_k), generator=generator, dtype=torch.int32),
                              target_topk_logprobs=-torch.rand(length, top_k, generator=generator) * 10))
    return samples


def _old_prepare(run, step):
    from dflash_pipeline.data.blocks import training_anchor_seed
    from dflash_pipeline.train.prepare import PreparedStep
    from oracles.train_prep import gathered_training_targets, per_sequence_build_batch

    config, indices = run.config, run.plan[step]
    samples = [run.train_set[index] for index in indices]
    batch = per_sequence_build_batch(samples, anchors_per_sequence=config.anchors_per_sequence, block_size=run.drafter.config.block_size,
                                     mask_token_id=run.mask_token_id,
                                     anchor_seeds=[training_anchor_seed(config.seed, step, i) for i in range(len(indices))],
                                     sliding_window=run.drafter.config.sliding_window)
    targets = gathered_training_targets(batch, samples, run.gamma)
    return PreparedStep(step, batch, targets, sum(run.lengths[i] for i in indices), int(batch.exists.sum()))


def _make_run(config, samples, head, vocabulary, drafter_config, drafter_state):
    import torch

    from dflash_pipeline.drafters.build import choose_architecture
    from dflash_pipeline.drafters.core import DFlashDrafter
    from dflash_pipeline.train.loss import default_gamma
    from dflash_pipeline.train.step import loss_function
    from dflash_pipeline.train.state import TrainingRun
    from dflash_pipeline.train.schedule import plan_steps

    drafter = DFlashDrafter(drafter_config)
    drafter.load_state_dict(drafter_state)
    drafter.train()
    lengths = [sample.input_ids.shape[0] for sample in samples]
    run = TrainingRun(config=config, drafter=drafter, head=head, vocabulary=vocabulary,
                      optimizer=torch.optim.AdamW(drafter.parameters(), lr=config.lr, betas=(0.9, 0.95), fused=True),
                      train_set=samples, val_set=None,
                      plan=plan_steps(lengths, tokens_per_step=config.tokens_per_step, max_steps=config.max_steps, seed=config.seed),
                      mask_token_id=drafter_config.mask_token_id, gamma=default_gamma(config.block_size), record={}, device="cpu",
                      attention="sdpa", loss_options=choose_architecture(config).loss_options, lengths=lengths)
    run.loss_fn = loss_function(run)
    return run


def _host_only(tokens: int, *, rounds: int) -> dict:
    """Batch and targets built alone at a GPU step's shapes (block 16, 16 anchors per sequence), old
    and new alternating, with the features packed (a GPU whose free memory the split does not fit)
    or left resident on the device (`feature_starts`, the usual GPU case): medians in ms."""
    import torch

    from dflash_pipeline.data.blocks import build_batch
    from dflash_pipeline.train.loss import training_targets
    from oracles.train_prep import gathered_training_targets, per_sequence_build_batch

    samples = _samples(400, width=5 * 576, top_k=32, answer_vocab=torch.arange(3, 9003))
    packed, count = [], 0
    for sample in samples:
        if count + sample.input_ids.shape[0] > tokens:
            break
        packed.append(sample)
        count += sample.input_ids.shape[0]
    settings = dict(anchors_per_sequence=16, block_size=16, mask_token_id=0, anchor_seeds=list(range(len(packed))))
    figures = {"tokens_per_step": count, "sequences": len(packed)}
    for layout, starts in (("features_packed", None), ("features_resident", [0] * len(packed))):
        times = {"old": [], "new": []}
        for round_number in range(rounds):
            for name in (("old", "new") if round_number % 2 == 0 else ("new", "old")):
                began = time.perf_counter()
                if name == "old":
                    gathered_training_targets(per_sequence_build_batch(packed, **settings, feature_starts=starts), packed, 7.0)
                else:
                    batch = build_batch(packed, **settings, feature_starts=starts)
                    training_targets(batch, packed, 7.0, block_size=settings["block_size"], resident_rows=starts is not None)
                times[name].append(time.perf_counter() - began)
        old, new = (round(1000 * statistics.median(times[name]), 3) for name in ("old", "new"))
        figures[layout] = {"old_ms": old, "new_ms": new, "new_vs_old": round(new / old, 3)}
    return figures


@click.command()
@click.option("--rounds", default=4, show_default=True, help="Alternating old/new rounds.")
@click.option("--steps", default=6, show_default=True, help="Steps per round.")
@click.option("--tokens-per-step", default=None, type=int, help="Default: params.yaml's.")
@click.option("--block-size", default=None, type=int, help="Default: params.yaml's.")
@click.option("--host-tokens", default=16384, show_default=True, help="Also time batch building alone at this many tokens per step, block 16 (the GPU bench's shapes); 0: skip.")
@click.option("--out", "out_path", type=click.Path(path_type=Path), default=ROOT / "bench" / "results" / "train_prep_cpu.json", show_default=True)
def main(rounds, steps, tokens_per_step, block_size, host_tokens, out_path):
    import torch

    import dflash_pipeline.train.loss as loss_module
    from dflash_pipeline.foundation.config import load_params
    from dflash_pipeline.foundation.devices import machine_description
    from dflash_pipeline.drafters.build import choose_architecture
    from dflash_pipeline.drafters.core import DFlashDrafter
    from dflash_pipeline.drafters.config import DrafterConfig
    from dflash_pipeline.target.load import TargetHead
    from dflash_pipeline.train.loss import TrainingVocabulary
    from dflash_pipeline.train.step import read_back, train_step
    from dflash_pipeline.train.prepare import prepare_step

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    params = load_params(ROOT / "params.yaml")
    config = params.train
    config = replace(config, tokens_per_step=tokens_per_step or config.tokens_per_step, block_size=block_size or config.block_size,
                     max_steps=rounds * steps + 1)
    hidden, top_k, taps = 576, 32, 5
    generator = torch.Generator().manual_seed(1)
    answer_vocab = torch.randperm(49152, generator=generator)[:9000].sort().values
    samples = _samples(max(400, 3 * config.tokens_per_step * (rounds * steps + 1) // 200), width=taps * hidden, top_k=top_k,
                       answer_vocab=answer_vocab)
    head_weight = torch.randn(49152, hidden, generator=generator) * 0.02
    head = TargetHead(head_weight, head_weight)
    vocabulary = TrainingVocabulary.from_tokens(head, answer_vocab) if config.train_vocab == "data" else TrainingVocabulary.full(head)
    architecture = choose_architecture(config)
    drafter_config = DrafterConfig(hidden_size=hidden, intermediate_size=1536, num_layers=config.num_layers, num_attention_heads=9,
                                   num_key_value_heads=3, head_dim=64, vocab_size=49152, block_size=config.block_size,
                                   target_layer_ids=(1, 7, 14, 20, 27), num_target_layers=30, mask_token_id=0,
                                   architecture=config.architecture, options=architecture.options)
    torch.manual_seed(0)
    drafter_state = DFlashDrafter(drafter_config).state_dict()
    if config.train_vocab == "data":
        drafter_state = {**drafter_state, "draft_vocab": vocabulary.token_ids}

    runs = {name: _make_run(config, samples, head, vocabulary, drafter_config, drafter_state) for name in ("old", "new")}
    prepares = {"old": _old_prepare, "new": prepare_step}
    head_seconds = [0.0]
    apply = loss_module.ChunkedHeadCrossEntropy.apply

    def timed_apply(*args):
        began = time.perf_counter()
        try:
            return apply(*args)
        finally:
            head_seconds[0] += time.perf_counter() - began

    loss_module.ChunkedHeadCrossEntropy.apply = timed_apply
    totals = {name: {"prepare_s": [], "step_s": [], "head_s": 0.0, "losses": []} for name in runs}
    # one untimed step each: allocator, first-call costs
    for name, run in runs.items():
        read_back(run, [train_step(run, 0, prepares[name](run, 0))])
    for round_number in range(rounds):
        order = ("old", "new") if round_number % 2 == 0 else ("new", "old")
        for name in order:
            run, total = runs[name], totals[name]
            for step in range(1 + round_number * steps, 1 + (round_number + 1) * steps):
                began = time.perf_counter()
                prepared = prepares[name](run, step)
                prepared_at = time.perf_counter()
                head_seconds[0] = 0.0
                result = train_step(run, step, prepared)
                row = read_back(run, [result])[0]
                ended = time.perf_counter()
                total["prepare_s"].append(prepared_at - began)
                total["step_s"].append(ended - began)
                total["head_s"] += head_seconds[0]
                total["losses"].append(row["loss_value"])
    loss_module.ChunkedHeadCrossEntropy.apply = apply

    figures = {}
    for name, total in totals.items():
        # Medians beside the means: the machine's cores are shared, and a median ignores the
        # steps another process happened to slow down.
        figures[name] = {"host_prepare_ms": round(1000 * statistics.mean(total["prepare_s"]), 3),
                         "host_prepare_ms_median": round(1000 * statistics.median(total["prepare_s"]), 3),
                         "step_ms_including_prepare": round(1000 * statistics.mean(total["step_s"]), 2),
                         "step_ms_including_prepare_median": round(1000 * statistics.median(total["step_s"]), 2),
                         "head_loss_share_of_step": round(total["head_s"] / (sum(total["step_s"]) - sum(total["prepare_s"])), 3)}
    host_shapes = _host_only(host_tokens, rounds=rounds * 2) if host_tokens else None
    result = {
        "machine": machine_description(), "torch_threads": torch.get_num_threads(), "rounds": rounds, "steps_per_round": steps,
        "shapes": {"tokens_per_step": config.tokens_per_step, "block_size": config.block_size, "anchors_per_sequence": config.anchors_per_sequence,
                   "architecture": config.architecture, "feature_width": taps * hidden, "target_top_k": top_k,
                   "softmax_rows": int(vocabulary.head_rows.shape[0]), "distill_weight": config.distill_weight},
        "old": figures["old"], "new": figures["new"],
        "prepare_new_vs_old_median": round(figures["new"]["host_prepare_ms_median"] / figures["old"]["host_prepare_ms_median"], 3),
        "step_new_vs_old_median": round(figures["new"]["step_ms_including_prepare_median"] / figures["old"]["step_ms_including_prepare_median"], 3),
        "host_only_gpu_shapes": host_shapes,
        "losses_identical": totals["old"]["losses"] == totals["new"]["losses"],
        "note": "CPU, synthetic data at the committed run's shapes; the stage prepares inline on a CPU (prefetch thread on a GPU only). "
                "head_loss_share_of_step: time in ChunkedHeadCrossEntropy (forward, which also computes the hidden gradient) over "
                "the step without its preparation.",
    }
    print(json.dumps(result, indent=2))
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
