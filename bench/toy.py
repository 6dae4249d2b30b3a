"""Toy data for the benches: a tiny random target, a fabricated generate output, and a toy run of
the stages on them; the `--dry-run` / `--work` options every bench's dry mode takes.

    tiny_target_folder(folder)          a 4-layer, 64-wide random Llama with the real SmolLM2 tokenizer
    fabricate_generated(folder, ...)    a generate-stage output without running generate (random answers)
    toy_run(work, upto="checkpoints")   target -> fabricated answers -> capture -> a 4-step training, in `work`

A dry run checks that a bench runs end to end on a CPU in seconds (tests/bench/test_dry_runs.py runs
each one); its figures mean nothing. `toy_run` builds only the parts `work` lacks, so benches given
the same `--work` share one toy run.
"""

import functools
import shutil
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

import click

REPO_ROOT = Path(__file__).resolve().parent.parent
PARTS = ("target", "generated", "hidden", "checkpoints")  # each part needs the ones before it

# params.yaml's train section at toy sizes: a few 400-token steps, two checkpoints (a curve of two points).
TOY_TRAIN = dict(max_steps=4, save_every=2, eval_every=2, tokens_per_step=400, anchors_per_sequence=4, eval_blocks=16,
                 logits_chunk=64, resume=False)


def tiny_target_folder(folder: Path) -> Path:
    """A 4-layer, 64-wide random Llama with the real SmolLM2 tokenizer: the dry runs' target."""
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


def fabricate_generated(folder: Path, *, prompts: int, seed: int = 0, prompt_lengths: tuple[int, int] = (20, 120),
                        answer_lengths: tuple[int, int] = (40, 330)) -> None:
    """A generate-stage output without running generate: `prompts` train rows and max(8, prompts / 16)
    val rows, prompts and answers of random lengths in the given ranges (the defaults: the default
    run's) over a 10K-token vocabulary. For figures whose cost does not depend on what the tokens
    say (capture, train); τ on it means nothing."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch

    from dflash_pipeline.data.prompts import GENERATED_SCHEMA

    generator = torch.Generator().manual_seed(seed)
    vocabulary = torch.randperm(49152 - 3, generator=generator)[:10_000] + 3
    folder.mkdir(parents=True, exist_ok=True)
    for split, count in (("train", prompts), ("val", max(8, prompts // 16))):
        rows = []
        for index in range(count):
            lengths = [int(torch.randint(*prompt_lengths, (1,), generator=generator)),
                       int(torch.randint(*answer_lengths, (1,), generator=generator))]
            ids = [vocabulary[torch.randint(0, 10_000, (n,), generator=generator)].tolist() for n in lengths]
            rows.append({"prompt_id": f"{split}{index:014d}", "category": "chat", "split": split, "messages": [{"role": "user", "content": "x"}],
                         "prompt_ids": ids[0], "answer_ids": ids[1], "finish_reason": "stop"})
        pq.write_table(pa.Table.from_pylist(rows, schema=GENERATED_SCHEMA), folder / f"{split}.parquet")


@dataclass(frozen=True)
class ToyRun:
    """The folders of a toy run, laid out as `dvc repro` lays out data/."""

    work: Path

    target_json = property(lambda self: self.work / "target" / "target.json")
    generated = property(lambda self: self.work / "generated")  # train.parquet, val.parquet
    hidden = property(lambda self: self.work / "hidden")  # train/, val/ shards
    checkpoints = property(lambda self: self.work / "checkpoints")  # step_000002, step_000004, state.json

    @property
    def last_checkpoint(self) -> Path:
        return sorted(self.checkpoints.glob("step_*"))[-1]


def toy_run(work: Path, *, upto: str = "checkpoints") -> ToyRun:
    """The stages up to `upto` (one of PARTS) on the tiny target, CPU, in `work`; parts already
    there are kept. Capture taps layers 1 and 3; training is params.yaml's recipe at TOY_TRAIN's sizes."""
    from dflash_pipeline.foundation.config import TargetConfig, load_params
    from dflash_pipeline.target.load import TargetInfo, prepare_target

    run, wanted = ToyRun(Path(work)), PARTS[: PARTS.index(upto) + 1]
    params = load_params(REPO_ROOT / "params.yaml")
    if not run.target_json.is_file():
        prepare_target(TargetConfig(model=str(tiny_target_folder(run.work / "tiny-model"))), out_dir=run.target_json.parent)
    target = TargetInfo.from_json(run.target_json)
    if "generated" in wanted and not (run.generated / "val.parquet").is_file():
        fabricate_generated(run.generated, prompts=16, prompt_lengths=(10, 40), answer_lengths=(20, 80))
    if "hidden" in wanted and not (run.hidden / "val" / "manifest.json").is_file():
        from dflash_pipeline.capture.run import run_capture

        run_capture(replace(params.capture, layer_ids=[1, 3], shard_mb=1), target=target, generated_dir=run.generated,
                    out_dir=run.hidden, device="cpu")
    if "checkpoints" in wanted and not list(run.checkpoints.glob("step_*")):
        from dflash_pipeline.train.run import run_train

        run_train(replace(params.train, **TOY_TRAIN), target=target, train_dir=run.hidden / "train", val_dir=run.hidden / "val",
                  out_dir=run.checkpoints, device="cpu", log=lambda *_: None)
    return run


def dry_run_options(command):
    """`--dry-run` and `--work` for a bench's click command (put it under @click.command() and the
    bench's own options): without `--work` a dry run builds its toy data in a temporary folder that
    is removed when the command ends."""

    @functools.wraps(command)
    def with_work(*args, dry_run: bool, work: Path | None, **kwargs):
        if dry_run and work is None:
            work = Path(tempfile.mkdtemp(prefix="bench-dry-run-"))
            click.get_current_context().call_on_close(lambda: shutil.rmtree(work, ignore_errors=True))
        return command(*args, dry_run=dry_run, work=work, **kwargs)

    with_work = click.option("--work", type=click.Path(path_type=Path), default=None,
                             help="With --dry-run: the folder of its toy data, reused when it holds them (default: a temporary one).")(with_work)
    return click.option("--dry-run", is_flag=True,
                        help="CPU, a tiny random target and toy data (bench/toy.py), toy sizes: checks the bench runs, in seconds.")(with_work)
