"""Benchmark: a training step fed by the shard loader vs the same step on samples already in memory.

    python bench/train.py [--steps 12] [--rounds 2]
    python bench/train.py --dry-run      # toy shards of the tiny random target, 2 steps (tests/bench/test_dry_runs.py)

Needs the `capture` stage's shards. Both variants run the same steps (same sequences, anchors,
drafter initialisation and recipe from params.yaml) in this one process, alternating round by
round; the only difference is where each step's samples come from: memory-mapped shards opened
for the run (`open_split`), or tensors copied into memory beforehand. Prints the step-time ratio
(goal <= 1.05), context and trained tokens per second, and on a GPU the model FLOP utilisation.
"""

import os
import sys
from dataclasses import replace
from pathlib import Path

import click

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout: `bench.*` from a plain `python bench/...`

from bench.toy import REPO_ROOT, TOY_TRAIN, dry_run_options, toy_run  # noqa: E402


class _Source:
    """Sample i of a source function, as the training run indexes its train set."""

    def __init__(self, sample):
        self.sample = sample

    def __getitem__(self, index):
        return self.sample(index)


def _run(sample, plan, config, drafter_state, head, vocabulary, mask_token_id, gamma, device, attention, lengths):
    """The stage's own `train_step` over `plan`, with samples from `sample(i)`."""
    import torch

    from dflash_pipeline.foundation.devices import timed
    from dflash_pipeline.drafters.core import DFlashDrafter
    from dflash_pipeline.drafters.build import choose_architecture
    from dflash_pipeline.train.step import loss_function, read_back, train_step
    from dflash_pipeline.train.state import TrainingRun

    drafter = DFlashDrafter(drafter_state["config"]).to(device)
    drafter.load_state_dict(drafter_state["weights"])
    run = TrainingRun(config=replace(config, max_steps=len(plan)), drafter=drafter, head=head, vocabulary=vocabulary,
                      optimizer=torch.optim.AdamW(drafter.parameters(), lr=config.lr, betas=(0.9, 0.95), fused=True),
                      train_set=_Source(sample), val_set=None, plan=plan, mask_token_id=mask_token_id, gamma=gamma, record={}, device=device,
                      attention=attention, loss_options=choose_architecture(config).loss_options, lengths=lengths)
    run.loss_fn = loss_function(run)
    rows, seconds = timed(lambda: read_back(run, [train_step(run, step) for step in range(len(plan))]), device)
    return seconds, sum(row["context_tokens"] for row in rows), sum(row["trained_positions"] for row in rows), drafter


def in_memory_copy(sample):
    """`sample` with every tensor copied out of the mapped shard (the distillation targets too)."""
    from dataclasses import fields

    copied = {field.name: getattr(sample, field.name) for field in fields(sample)}
    return type(sample)(**{name: value.clone() if hasattr(value, "clone") else value for name, value in copied.items()})


@click.command()
@click.option("--hidden", type=click.Path(path_type=Path), default="data/hidden", show_default=True)
@click.option("--target", "target_json", type=click.Path(path_type=Path), default="data/target/target.json", show_default=True)
@click.option("--steps", default=12, show_default=True)
@click.option("--rounds", default=2, show_default=True)
@click.option("--device", default=None)
@dry_run_options
def main(hidden, target_json, steps, rounds, device, dry_run, work):
    import torch

    from dflash_pipeline.train.loss import default_gamma
    from dflash_pipeline.foundation.devices import bf16_peak_tflops
    from dflash_pipeline.foundation.config import load_params
    from dflash_pipeline.drafters.core import DFlashDrafter
    from dflash_pipeline.drafters.flops import count_parameters, training_flops
    from dflash_pipeline.data.shards import open_split
    from dflash_pipeline.target.load import TargetInfo, load_target_head
    from dflash_pipeline.train.loss import TrainingVocabulary
    from dflash_pipeline.drafters.build import drafter_config_for
    from dflash_pipeline.train.schedule import plan_steps

    device = device or ("cuda" if torch.cuda.is_available() and not dry_run else "cpu")
    config = load_params(REPO_ROOT / "params.yaml").train
    if dry_run:
        toy = toy_run(work, upto="hidden")
        hidden, target_json, steps, rounds, config = toy.hidden, toy.target_json, 2, 1, replace(config, **TOY_TRAIN)
    target = TargetInfo.from_json(target_json)
    dataset = open_split(hidden / "train", expected_fingerprint=target.fingerprint)
    plan = plan_steps(dataset.lengths(), tokens_per_step=config.tokens_per_step, max_steps=steps, seed=config.seed)
    gamma = config.gamma or default_gamma(config.block_size)
    mask_token_id = config.mask_token_id if config.mask_token_id is not None else 0
    drafter_config = drafter_config_for(target, replace(config), layer_ids=dataset.manifest.layer_ids, mask_token_id=mask_token_id, extra={})
    torch.manual_seed(0)
    initial = DFlashDrafter(drafter_config)
    state = {"config": drafter_config, "weights": {k: v.clone() for k, v in initial.state_dict().items()}}
    head = load_target_head(target, device=device)
    if config.train_vocab == "data":
        vocabulary = TrainingVocabulary.from_tokens(head, torch.cat([dataset[i].input_ids[dataset[i].loss_mask.bool()].long() for i in range(len(dataset))]))
    else:
        vocabulary = TrainingVocabulary.full(head)
    attention = config.attention if config.attention != "auto" else ("flex" if device.startswith("cuda") else "sdpa")
    needed = sorted({i for step in plan for i in step})
    in_memory = {i: in_memory_copy(dataset[i]) for i in needed}
    print(f"{steps} steps of ~{config.tokens_per_step} context tokens, {config.anchors_per_sequence} anchors/sequence, block "
          f"{config.block_size}, {config.num_layers} layer(s) ({count_parameters(initial) / 1e6:.1f}M params), softmax over "
          f"{vocabulary.head_rows.shape[0]} tokens, {attention} attention, {device}, torch threads {torch.get_num_threads()}")

    loader = open_split(hidden / "train", verify="none")
    lengths = dataset.lengths()
    sources = {"shard loader": lambda i: loader[i], "in memory": lambda i: in_memory[i]}
    _run(sources["in memory"], plan[:2], config, state, head, vocabulary, mask_token_id, gamma, device, attention, lengths)  # warm-up
    totals = {name: [0.0, 0, 0] for name in sources}
    for round_index in range(rounds):
        for name, source in sources.items():
            seconds, context_tokens, trained, drafter = _run(source, plan, config, state, head, vocabulary, mask_token_id, gamma, device, attention, lengths)
            totals[name][0] += seconds
            totals[name][1] += context_tokens
            totals[name][2] += trained
            print(f"round {round_index + 1}: {name:12s} {seconds / steps * 1e3:7.1f} ms/step")
    loader_s, memory_s = totals["shard loader"][0], totals["in memory"][0]
    print(f"step time, shard loader / in memory = {loader_s / memory_s:.3f} (goal <= 1.05)")
    seconds, context_tokens, trained = totals["shard loader"]
    print(f"throughput: {context_tokens / seconds:.0f} context tokens/s, {trained / seconds:.0f} trained positions/s")
    peak = bf16_peak_tflops(device)
    if peak:
        flops = training_flops(initial, trained_positions=trained, context_tokens=context_tokens, vocab_rows=vocabulary.head_rows.shape[0])
        print(f"model FLOP utilisation ~{flops / seconds / (peak * 1e12) * 100:.1f}% of {peak:.0f} TFLOP/s (dense bf16)")

if __name__ == "__main__":
    main()
