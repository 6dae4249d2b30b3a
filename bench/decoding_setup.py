"""What bench/verify_length.py and bench/speculative.py share: their options, and the chosen
drafter's decoding session (`decoding.session`: the real target, its head and layers) with the
val shards and val prompts, loaded as `evaluate` loads them; in a dry run, the toy run's
(bench/toy.py)."""

from dataclasses import dataclass
from pathlib import Path

import click

from bench.toy import dry_run_options, toy_run


def decoding_options(command):
    """The checkpoint / data / prompt options of a decoding benchmark, and its dry run."""
    options = [
        click.option("--checkpoint", type=click.Path(path_type=Path), default=None, help="Default: data/eval/best.json's drafter."),
        click.option("--hidden", type=click.Path(path_type=Path), default="data/hidden", show_default=True),
        click.option("--generated", type=click.Path(path_type=Path), default="data/generated", show_default=True),
        click.option("--target", "target_json", type=click.Path(path_type=Path), default="data/target/target.json", show_default=True),
        click.option("--num-prompts", default=8, show_default=True),
        click.option("--max-new-tokens", default=128, show_default=True),
        click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True),
    ]
    command = dry_run_options(command)
    for option in reversed(options):
        command = option(command)
    return command


@dataclass
class DecodingSetup:
    """A benchmark's inputs: the checkpoint's decoding session, the val shards and the val prompts."""

    checkpoint: Path
    session: object  # decoding.session.DecodingSession
    val_set: object
    prompts: list  # (prompt id, token ids)
    max_new_tokens: int

    # The session's parts under the names the benchmarks use.
    target = property(lambda self: self.session.target)
    drafter = property(lambda self: self.session.drafter)
    head = property(lambda self: self.session.head)
    model = property(lambda self: self.session.model)
    eos_ids = property(lambda self: self.session.eos_ids)


def load_decoding_setup(checkpoint, hidden: Path, generated: Path, target_json: Path, num_prompts: int, max_new_tokens: int,
                        device: str, *, dry_run: bool = False, work: Path | None = None) -> DecodingSetup:
    """The setup of the options above; a dry run takes the toy run's last checkpoint, 2 val prompts
    of 8 new tokens, on the CPU."""
    from dflash_pipeline.data.shards import open_split
    from dflash_pipeline.decoding.session import open_session
    from dflash_pipeline.drafters.checkpoints import load_checkpoint
    from dflash_pipeline.evaluate.run import val_prompts
    from dflash_pipeline.foundation.files import read_json
    from dflash_pipeline.target.load import TargetInfo

    if dry_run:
        toy = toy_run(work)
        checkpoint, hidden, generated, target_json = toy.last_checkpoint, toy.hidden, toy.generated, toy.target_json
        num_prompts, max_new_tokens, device = 2, 8, "cpu"
    target = TargetInfo.from_json(target_json)
    checkpoint = checkpoint or Path(read_json(Path("data/eval/best.json"), missing="no data/eval/best.json: pass --checkpoint")["path"])
    drafter, _ = load_checkpoint(checkpoint, device=device)
    val_set = open_split(hidden / "val", expected_fingerprint=target.fingerprint)
    return DecodingSetup(checkpoint=checkpoint, session=open_session(target, drafter, device=device), val_set=val_set,
                         prompts=val_prompts(generated / "val.parquet", num_prompts), max_new_tokens=max_new_tokens)
