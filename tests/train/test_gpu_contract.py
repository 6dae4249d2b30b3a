"""The GPU contract of a train step, checked on a CPU (issue #27): the batch, the mask and the
loss equal the per-anchor code they replaced; a steady-state step reads nothing back from the
device; the compiled step has one graph and never recompiles.

References: `tests/oracles/blocks.py` (the per-anchor `build_batch` of commit 0121fa1) and
`tests/golden/train_curves_before_27.json` (the tiny runs' curves before the step was made
sync-free: boolean selection of slots, per-step reads, the single-tensor AdamW)."""

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from oracles.blocks import per_anchor_build_batch
from support.device_reads import DeviceReads, Paused, random_samples
from support.stage_commands import TINY_TRAIN, train_tiny_run
from torch.nn.attention.flex_attention import create_mask

from dflash_pipeline.data.blocks import build_batch
from dflash_pipeline.drafters.core import DFlashDrafter
from dflash_pipeline.drafters.attention import to_block_mask
from dflash_pipeline.drafters.config import DrafterConfig

GOLDEN = Path(__file__).parents[1] / "golden" / "train_curves_before_27.json"
GOLDEN_CONFIGS = {
    "dflash": TINY_TRAIN,
    "dflash2": replace(TINY_TRAIN, architecture="dflash2"),
    "dflash2_window": replace(TINY_TRAIN, architecture="dflash2", sliding_window=6),
    "dflash2_full_plain": replace(TINY_TRAIN, architecture="dflash2", train_vocab="full", distill_weight=0.0),
}


@pytest.mark.parametrize("seed", range(6))
def test_the_vectorised_batch_equals_the_per_anchor_one_tensor_for_tensor(seed):
    samples = random_samples(seed, count=1 + seed * 3)
    window = [None, 3, 40][seed % 3]
    block_size = [2, 4, 16][seed % 3]
    settings = dict(anchors_per_sequence=[1, 5, 64][seed % 3], block_size=block_size, mask_token_id=7,
                    anchor_seeds=[seed * 100 + i for i in range(len(samples))], sliding_window=window)
    new, old = build_batch(samples, **settings), per_anchor_build_batch(samples, **settings)
    for name in ("context_positions", "block_ids", "block_positions", "labels", "exists", "block_sequence"):
        assert getattr(new, name).dtype == old[name].dtype, name
        assert torch.equal(getattr(new, name), old[name]), name
    assert new.context_tokens == old["context_tokens"]
    assert torch.equal(new.features, torch.cat(old["features"]))
    assert torch.equal(new.dense_mask(), old["mask"])


@pytest.mark.parametrize("seed", range(8))
def test_the_block_mask_from_metadata_is_the_dense_mask_exactly(seed):
    """The flex BlockMask's rule equals `dflash_mask` at every (query, key), sliding window and
    padding included, and its tiles cover every visible pair."""
    samples = random_samples(seed, count=2 + seed)
    block_size = [2, 4, 16, 8][seed % 4]
    batch = build_batch(samples, anchors_per_sequence=[3, 40][seed % 2], block_size=block_size, mask_token_id=7,
                        anchor_seeds=list(range(len(samples))), sliding_window=[None, 5, 60][seed % 3])
    if seed % 2:
        batch = batch.padded(context_tokens=batch.features.shape[0] + 77, blocks=batch.block_sequence.shape[0] + 9, mask_token_id=7)
    dense = batch.dense_mask()
    block_mask = batch.block_mask()
    queries, keys = dense.shape
    assert torch.equal(create_mask(block_mask.mask_mod, None, None, queries, keys, device="cpu")[0, 0], dense)
    tiles = block_mask.to_dense()[0, 0].bool()
    tile = block_mask.BLOCK_SIZE[0]
    covered = tiles[torch.arange(queries) // tile][:, torch.arange(keys) // tile]
    assert not (dense & ~covered).any()
    assert (dense.sum(1) > 0).all()  # padding blocks see themselves: no query row is empty (NaN)
    # no more tiles than a mask built from the dense matrix, beyond a tile per row of slack
    assert tiles.sum() <= to_block_mask(dense).to_dense().sum() + tiles.shape[0]


def test_flex_attention_over_the_metadata_mask_equals_sdpa_over_the_dense_one():
    torch.manual_seed(0)
    config = DrafterConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=8, vocab_size=100, block_size=4, target_layer_ids=(0, 1), num_target_layers=2, mask_token_id=99,
                           sliding_window=20)
    drafter = DFlashDrafter(config).eval()
    samples = random_samples(3, count=5, width=config.feature_width)
    batch = build_batch(samples, anchors_per_sequence=6, block_size=4, mask_token_id=99, anchor_seeds=list(range(5)), sliding_window=20)
    embeddings = torch.randn(batch.block_ids.shape[0], 32)
    with torch.no_grad():
        sdpa = drafter.forward_blocks(batch.features, batch.context_positions, embeddings, batch.block_positions, batch.attention_mask("sdpa"))
        flex = drafter.forward_blocks(batch.features, batch.context_positions, embeddings, batch.block_positions, batch.attention_mask("flex"),
                                      attention="flex")
    assert torch.allclose(sdpa, flex, atol=2e-5), (sdpa - flex).abs().max()


@pytest.mark.slow
def test_cpu_losses_equal_the_ones_before_the_step_was_made_sync_free(tiny_run, tmp_path):
    golden = json.loads(GOLDEN.read_text())
    for name, config in GOLDEN_CONFIGS.items():
        curve = train_tiny_run(tiny_run, tmp_path / name, config).curve
        assert len(curve) == len(golden[name])
        for row, before in zip(curve, golden[name]):
            assert set(row) - {"seconds"} == set(before), name
            for key, value in before.items():
                assert row[key] == pytest.approx(value, rel=2e-5, abs=1e-4), (name, row["step"], key)


def test_the_read_counter_sees_each_kind_of_read():
    x = torch.arange(6.0)
    with DeviceReads() as reads:
        x.sum().item(), x.tolist(), bool(x[0] > 1), x[x > 2], x.nonzero(), float(x.max()), x.cpu()
        torch.where(x > 2, x, 0).sum()  # not a read
    assert reads.calls == ["item", "tolist", "__bool__", "__getitem__[bool]", "nonzero", "__float__", "cpu"]


@pytest.mark.slow
@pytest.mark.parametrize("architecture", ["dflash", "dflash2"])
def test_a_steady_state_train_step_reads_nothing_back_from_the_device(tiny_run, tmp_path, monkeypatch, architecture):
    """Over 40 steps the training loop reads device values only when the curve is read back:
    once every READ_EVERY steps and at the end (validation and checkpoints, which are not
    steady-state steps, and the host's batch building are left out of the count)."""
    import dflash_pipeline.train.prepare as prepare_module
    import dflash_pipeline.train.run as train_run

    target, root = tiny_run
    reads = DeviceReads()
    monkeypatch.setattr(prepare_module, "prepare_step", Paused(reads, prepare_module.prepare_step))  # what the prefetcher calls
    for name in ("validation_tau", "save_checkpoint", "setup_run"):
        monkeypatch.setattr(train_run, name, Paused(reads, getattr(train_run, name)))
    read_back = train_run.read_back
    flushes = []
    monkeypatch.setattr(train_run, "read_back", lambda run, results: flushes.append(len(results)) or read_back(run, results))
    config = replace(TINY_TRAIN, architecture=architecture, max_steps=40, eval_every=40, save_every=40)
    with reads:
        train_run.run_train(config, target=target, train_dir=root / "hidden" / "train", val_dir=root / "hidden" / "val",
                            out_dir=tmp_path / "ck", device="cpu", log=lambda *_: None)
    assert flushes == [16, 16, 8]
    assert reads.calls == ["tolist"] * 3


@pytest.mark.slow
def test_the_compiled_step_is_one_graph_that_never_recompiles(tiny_run, tmp_path):
    """train.compile: forward, loss and backward (through AOTAutograd) compile with fullgraph=True
    over the static padded shape; 32 steps of different batches reuse the one graph, and give the
    eager step's losses. (The "aot_eager" backend: the graph capture and guards are dynamo's, the
    same as inductor's, without minutes of CPU code generation.)"""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from dflash_pipeline.train.prepare import prepare_step
    from dflash_pipeline.train.run import setup_run
    from dflash_pipeline.train.step import loss_function, read_back, train_step

    target, root = tiny_run
    config = replace(TINY_TRAIN, architecture="dflash2", max_steps=32, eval_every=32, save_every=32)
    losses = {}
    for compiled in (False, True):
        run = setup_run(replace(config, compile=compiled), target=target, train_dir=root / "hidden" / "train",
                        val_dir=root / "hidden" / "val", out_dir=tmp_path / f"ck{compiled}", device="cpu", log=lambda *_: None)
        if compiled:
            run.compile_backend = "aot_eager"
            run.loss_fn = loss_function(run)
            torch._dynamo.reset()
            counters.clear()
        shapes = set()
        with torch._dynamo.config.patch(error_on_recompile=True):
            results = []
            for step in range(32):
                prepared = prepare_step(run, step)
                shapes.add((tuple(prepared.batch.features.shape), tuple(prepared.batch.block_ids.shape)))
                results.append(train_step(run, step, prepared))
        losses[compiled] = [row["loss"] for row in read_back(run, results)]
        if compiled:
            assert len(shapes) == 1  # padded to the static shape
            assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
            assert not counters["graph_break"], dict(counters["graph_break"])
        else:
            assert len(shapes) > 10  # the batches do change
    assert losses[True] == pytest.approx(losses[False], rel=1e-4)


def test_the_block_mask_is_built_without_reading_the_device():
    samples = random_samples(5, count=6)
    batch = build_batch(samples, anchors_per_sequence=8, block_size=4, mask_token_id=7, anchor_seeds=list(range(6)), sliding_window=30)
    with DeviceReads() as reads:
        batch.block_mask()
        batch.dense_mask()
    assert reads.calls == []


def test_the_flex_forward_compiles_whole_with_the_mask_built_inside():
    """The GPU's path: the BlockMask is built from the metadata inside the compiled region, and
    flex attention runs over it, with fullgraph=True and no recompile across padded batches.
    (Forward only: torch has no flex backward on a CPU.)"""
    import torch._dynamo
    from torch._dynamo.utils import counters

    config = DrafterConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=8, vocab_size=100, block_size=4, target_layer_ids=(0, 1), num_target_layers=2, mask_token_id=99,
                           sliding_window=20)
    drafter = DFlashDrafter(config).eval()

    def forward(batch, embeddings):
        return drafter.forward_blocks(batch.features, batch.context_positions, embeddings, batch.block_positions,
                                      batch.attention_mask("flex"), attention="flex")

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(forward, fullgraph=True, dynamic=False, backend="aot_eager")
    with torch.no_grad(), torch._dynamo.config.patch(error_on_recompile=True):
        for seed in range(3):
            samples = random_samples(seed, count=5, width=config.feature_width)
            batch = build_batch(samples, anchors_per_sequence=6, block_size=4, mask_token_id=99, anchor_seeds=list(range(5)),
                                sliding_window=20).padded(context_tokens=768, blocks=40, mask_token_id=99)
            embeddings = torch.randn(batch.block_ids.shape[0], 32)
            assert torch.allclose(compiled(batch, embeddings), forward(batch, embeddings), atol=1e-6)
    assert not counters["graph_break"], dict(counters["graph_break"])


@pytest.mark.slow
@pytest.mark.parametrize("compiled", [False, True])
def test_a_resident_split_gives_the_same_steps_as_packed_features(tiny_run, tmp_path, compiled):
    """On a GPU the train split's features live on the device and a step gathers its rows; the
    steps equal those over features packed on the host (forced here on the CPU), padded or not."""
    from dflash_pipeline.train.features import ResidentFeatures
    from dflash_pipeline.train.prepare import prepare_step
    from dflash_pipeline.train.run import setup_run
    from dflash_pipeline.train.step import loss_function, read_back, train_step

    target, root = tiny_run
    config = replace(TINY_TRAIN, architecture="dflash2", max_steps=5, compile=compiled)
    losses = {}
    for resident in (False, True):
        run = setup_run(config, target=target, train_dir=root / "hidden" / "train", val_dir=root / "hidden" / "val",
                        out_dir=tmp_path / f"ck{resident}", device="cpu", log=lambda *_: None)
        run.compile_backend = "aot_eager"
        run.loss_fn = loss_function(run)
        if resident:
            run.resident = ResidentFeatures.upload(run.train_set, run.lengths, "cpu", budget_bytes=1 << 30)
            assert ResidentFeatures.upload(run.train_set, run.lengths, "cpu", budget_bytes=1000) is None  # too big: none
        prepared = [prepare_step(run, step) for step in range(5)]
        assert all((p.batch.features is None) == resident for p in prepared)
        losses[resident] = [row["loss_value"] for row in read_back(run, [train_step(run, s, prepared[s]) for s in range(5)])]
    assert losses[True] == losses[False]
