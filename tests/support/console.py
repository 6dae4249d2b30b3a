"""What the console command's tests (tests/cli/) share: the commands' names, a tiny captured and
trained run for them to work on (built once a session by the `cli_run` fixture, tests/conftest.py),
invoking the command group, and the one-line error check."""

from pathlib import Path
from types import SimpleNamespace

import torch
from click.testing import CliRunner

CYCLE = [101, 202, 303, 404, 505]  # every answer repeats it, so a few training steps already draft some tokens right
# The listed commands; `generate`, decode's old name, is hidden and kept apart.
SUBCOMMANDS = ["evaluate", "verify-shards", "verify", "show", "export", "plots", "compare-runs", "decode"]


def write_cycle_generated(folder: Path, rows_per_split: dict[str, int], seed: int = 0) -> Path:
    """A generate-stage output whose answers cycle through CYCLE (prompts are random ids)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from dflash_pipeline.data.prompts import GENERATED_SCHEMA

    generator = torch.Generator().manual_seed(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for split, count in rows_per_split.items():
        rows = []
        for index in range(count):
            prompt = torch.randint(3, 49152, (int(torch.randint(6, 16, (1,), generator=generator)),), generator=generator).tolist()
            start = int(torch.randint(0, len(CYCLE), (1,), generator=generator))
            length = int(torch.randint(16, 40, (1,), generator=generator))
            rows.append({"prompt_id": f"{split}{index:04d}", "category": ("code", "math")[index % 2], "split": split,
                         "messages": [{"role": "user", "content": "x"}], "prompt_ids": prompt,
                         "answer_ids": [CYCLE[(start + k) % len(CYCLE)] for k in range(length)], "finish_reason": "length"})
        pq.write_table(pa.Table.from_pylist(rows, schema=GENERATED_SCHEMA), folder / f"{split}.parquet")
    return folder


def build_cli_run(root: Path, model_dir: Path) -> SimpleNamespace:
    """Target fingerprint, generated val prompts, captured shards and one checkpoint (step 4) on the
    tiny Llama at `model_dir`, plus a float32 export of that checkpoint, all under `root`."""
    from dflash_pipeline.capture.run import run_capture
    from dflash_pipeline.export.run import export_checkpoint
    from dflash_pipeline.foundation.config import CaptureConfig, TargetConfig, TrainConfig
    from dflash_pipeline.target.load import TargetInfo, prepare_target
    from dflash_pipeline.train.run import run_train

    prepare_target(TargetConfig(model=str(model_dir)), out_dir=root / "target")
    target = TargetInfo.from_json(root / "target" / "target.json")
    generated = write_cycle_generated(root / "generated", {"train": 12, "val": 3})
    run_capture(CaptureConfig(layer_ids=[1, 3]), target=target, generated_dir=generated, out_dir=root / "hidden", device="cpu")
    train = TrainConfig(num_layers=1, block_size=4, max_steps=4, tokens_per_step=400, anchors_per_sequence=8, eval_every=4,
                        save_every=4, eval_blocks=16, logits_chunk=64, lr=2e-2)
    run_train(train, target=target, train_dir=root / "hidden" / "train", val_dir=root / "hidden" / "val", out_dir=root / "checkpoints",
              device="cpu", log=lambda *_: None)
    checkpoint = root / "checkpoints" / "step_000004"
    export = export_checkpoint(checkpoint, root / "export")
    return SimpleNamespace(root=root, target_json=root / "target" / "target.json", model_dir=model_dir, generated=generated,
                           hidden=root / "hidden", val=root / "hidden" / "val", checkpoint=checkpoint, export=export)


def invoke(*args):
    """`dflash-pipeline ARGS` in this process (exceptions other than the one-line exits propagate)."""
    from dflash_pipeline.cli import main

    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def assert_one_line_error(result, *fragments: str) -> str:
    """The command failed with exit status 1 and one line `error: ...` naming every fragment, and printed nothing else."""
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert result.stdout == "", result.stdout
    for fragment in fragments:
        assert fragment in lines[0], f"{fragment!r} not in {lines[0]!r}"
    return lines[0]
