"""A train step's host preparation, vectorised (issue #37 item 2): the batch and targets equal the
per-sequence code they replaced tensor for tensor (`tests/oracles/train_prep.py`), a few steps on
them give exactly the same fp32 losses, the top-K targets resident beside the features give the
same losses, and pinned memory is asked for only on a GPU."""

from dataclasses import replace

import pytest
import torch
from oracles.train_prep import gathered_training_targets, per_sequence_build_batch
from support.device_reads import random_samples
from support.stage_commands import TINY_TRAIN

import dflash_pipeline.train.prepare as prepare_module
from dflash_pipeline.data.blocks import build_batch, draw_anchors, training_anchor_seed
from dflash_pipeline.train.features import ResidentFeatures
from dflash_pipeline.train.loss import training_targets
from dflash_pipeline.train.prepare import PreparedStep, prepare_step
from dflash_pipeline.train.run import setup_run
from dflash_pipeline.train.step import read_back, train_step

BATCH_FIELDS = ("features", "context_positions", "context_sequence", "block_ids", "block_positions", "labels", "exists", "block_sequence",
                "feature_rows")


def _assert_equal_batches(new, old):
    for name in BATCH_FIELDS:
        a, b = getattr(new, name), getattr(old, name)
        assert (a is None) == (b is None), name
        if a is not None:
            assert a.dtype == b.dtype and torch.equal(a, b), name
    assert (new.context_tokens, new.block_size, new.sliding_window) == (old.context_tokens, old.block_size, old.sliding_window)


def _assert_equal_targets(new, old):
    for name in ("weights", "soft_ids", "soft_logprobs"):
        a, b = getattr(new, name), getattr(old, name)
        assert (a is None) == (b is None), name
        if a is not None:
            assert a.dtype == b.dtype and torch.equal(a, b), name


@pytest.mark.parametrize("seed", range(8))
def test_the_step_wide_anchor_draw_equals_the_per_sequence_draw(seed):
    from dflash_pipeline.data.blocks import draw_step_anchors

    samples = random_samples(seed, count=1 + seed * 4)
    count = [1, 3, 16, 200][seed % 4]
    seeds = [seed * 1_000_003 + 10_007 * seed + i for i in range(len(samples))]
    lengths = torch.tensor([sample.input_ids.shape[0] for sample in samples])
    anchors, block_sequence = draw_step_anchors(torch.cat([s.loss_mask.bool() for s in samples]), lengths, count, seeds)
    expected = [draw_anchors(sample.loss_mask, count, s) for sample, s in zip(samples, seeds)]
    assert anchors.tolist() == [anchor for chosen in expected for anchor in chosen]
    assert block_sequence.tolist() == [number for number, chosen in enumerate(expected) for _ in chosen]


@pytest.mark.parametrize("seed", range(6))
def test_prepared_batches_and_targets_equal_the_per_sequence_preparation(seed):
    samples = random_samples(seed, count=2 + seed * 3, top_k=[0, 4][seed % 2])
    settings = dict(anchors_per_sequence=[1, 5, 64][seed % 3], block_size=[2, 4, 16][seed % 3], mask_token_id=7,
                    anchor_seeds=[seed * 100 + i for i in range(len(samples))], sliding_window=[None, 3, 40][seed % 3])
    _assert_equal_batches(build_batch(samples, **settings), per_sequence_build_batch(samples, **settings))
    new, old = build_batch(samples, **settings), per_sequence_build_batch(samples, **settings)
    _assert_equal_targets(training_targets(new, samples, 2.5, block_size=settings["block_size"]), gathered_training_targets(old, samples, 2.5))
    starts = [5 * i for i in range(len(samples))]
    resident = build_batch(samples, **settings, feature_starts=starts)
    _assert_equal_batches(resident, per_sequence_build_batch(samples, **settings, feature_starts=starts))


def _setup(tiny_run, tmp_path, name, config):
    target, root = tiny_run
    return setup_run(replace(config, resume=False), target=target, train_dir=root / "hidden" / "train",
                     val_dir=root / "hidden" / "val", out_dir=tmp_path / name, device="cpu", log=lambda *_: None)


def _reference_prepare(run, step):
    """`prepare_step` as it was: per-sequence anchors, the whole step's top-K gathered on the host."""
    config = run.config
    indices = run.plan[step]
    samples = [run.train_set[index] for index in indices]
    batch = per_sequence_build_batch(samples, anchors_per_sequence=config.anchors_per_sequence, block_size=run.drafter.config.block_size,
                                     mask_token_id=run.mask_token_id,
                                     anchor_seeds=[training_anchor_seed(config.seed, step, i) for i in range(len(indices))],
                                     sliding_window=run.drafter.config.sliding_window)
    return PreparedStep(step, batch, gathered_training_targets(batch, samples, run.gamma),
                        sum(run.lengths[i] for i in indices), int(batch.exists.sum()))


def _losses(run, prepare, steps):
    results = [train_step(run, step, prepare(run, step)) for step in range(steps)]
    return [row["loss_value"] for row in read_back(run, results)]


@pytest.mark.parametrize("architecture", ["dflash", "dflash2"])
def test_steps_on_the_new_preparation_give_exactly_the_old_losses(tiny_run, tmp_path, architecture):
    """fp32 on a CPU: the vectorised preparation, and the top-K held beside the features in a
    resident table (a GPU's layout, here in host memory), give bit-identical losses to the
    per-sequence preparation fed to the same step (distillation on, so the top-K is used)."""
    config = replace(TINY_TRAIN, architecture=architecture, distill_weight=0.5, max_steps=5)
    reference = _losses(_setup(tiny_run, tmp_path, "reference", config), _reference_prepare, 5)
    assert _losses(_setup(tiny_run, tmp_path, "new", config), prepare_step, 5) == reference
    run = _setup(tiny_run, tmp_path, "resident", config)
    run.resident = ResidentFeatures.upload(run.train_set, run.lengths, "cpu", budget_bytes=1 << 30)
    assert run.resident is not None and run.resident.topk_ids is not None
    prepared = prepare_step(run, 0)
    assert prepared.batch.features is None and prepared.targets.soft_ids is None and prepared.targets.soft_rows is not None
    assert _losses(run, prepare_step, 5) == reference


def test_targets_are_pinned_only_for_a_gpu(tiny_run, tmp_path, monkeypatch):
    """Pageable host-to-GPU copies hold the host until done: on CUDA the targets are packed into
    pinned memory (copied non-blocking); on a CPU nothing is pinned. (Pinning is recorded, not
    done: this machine has no CUDA.)"""
    pinned = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *a, **k: pinned.append(tuple(self.shape)) or self)
    samples = random_samples(1, count=3, top_k=4)
    batch = build_batch(samples, anchors_per_sequence=3, block_size=4, mask_token_id=7, anchor_seeds=[0, 1, 2])
    training_targets(batch, samples, 2.5, block_size=4)
    assert pinned == []
    targets = training_targets(batch, samples, 2.5, block_size=4, pin_memory=True)
    assert pinned == [tuple(targets.weights.shape), tuple(targets.soft_ids.shape), tuple(targets.soft_logprobs.shape)]

    seen = []
    original = prepare_module.training_targets
    monkeypatch.setattr(prepare_module, "training_targets", lambda *a, **k: seen.append(k["pin_memory"]) or original(*a, **{**k, "pin_memory": False}))
    batch_pinned = []
    original_build = prepare_module.build_batch
    monkeypatch.setattr(prepare_module, "build_batch", lambda *a, **k: batch_pinned.append(k["pin_memory"]) or original_build(*a, **{**k, "pin_memory": False}))
    run = _setup(tiny_run, tmp_path, "pin", replace(TINY_TRAIN, distill_weight=0.5))
    prepare_step(run, 0)
    run.device = "cuda:0"  # prepare_step only reads the name; nothing touches a device here
    prepare_step(run, 0)
    assert seen == batch_pinned == [False, True]

