"""What bench/verify_length.py and bench/speculative.py share: their options, and the chosen
drafter's decoding session (`decoding.session`: the real target, its head and layers) with the
val shards and val prompts, loaded as `evaluate` loads them; and `host_oracles`, which puts
tests/ on the path for the benches that measure the engine against the host loops it replaced."""

import sys

from dataclasses import dataclass
from pathlib import Path

import click


def decoding_options(command):
    """The checkpoint / data / prompt options of a decoding benchmark."""
    options = [
        click.option("--checkpoint", type=click.Path(path_type=Path), default=None, help="Default: data/eval/best.json's drafter."),
        click.option("--hidden", type=click.Path(path_type=Path), default="data/hidden", show_default=True),
        click.option("--generated", type=click.Path(path_type=Path), default="data/generated", show_default=True),
        click.option("--target", "target_json", type=click.Path(path_type=Path), default="data/target/target.json", show_default=True),
        click.option("--num-prompts", default=8, show_default=True),
        click.option("--max-new-tokens", default=128, show_default=True),
        click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True),
    ]
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

    # The session's parts under the names the benchmarks use.
    target = property(lambda self: self.session.target)
    drafter = property(lambda self: self.session.drafter)
    head = property(lambda self: self.session.head)
    model = property(lambda self: self.session.model)
    eos_ids = property(lambda self: self.session.eos_ids)


def host_oracles():
    """tests/oracles as an importable package (`oracles.decoding`, `oracles.generate`, ...): the
    references the engine is tested against, which the benches time it against too."""
    tests = str(Path(__file__).resolve().parents[1] / "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)


def load_decoding_setup(checkpoint, hidden: Path, generated: Path, target_json: Path, num_prompts: int, device: str) -> DecodingSetup:
    from dflash_pipeline.data.shards import open_split
    from dflash_pipeline.decoding.session import open_session
    from dflash_pipeline.drafters.checkpoints import load_checkpoint
    from dflash_pipeline.evaluate.run import val_prompts
    from dflash_pipeline.foundation.files import read_json
    from dflash_pipeline.target.load import TargetInfo

    target = TargetInfo.from_json(target_json)
    checkpoint = checkpoint or Path(read_json(Path("data/eval/best.json"), missing="no data/eval/best.json: pass --checkpoint")["path"])
    drafter, _ = load_checkpoint(checkpoint, device=device)
    val_set = open_split(hidden / "val", expected_fingerprint=target.fingerprint)
    return DecodingSetup(checkpoint=checkpoint, session=open_session(target, drafter, device=device), val_set=val_set,
                         prompts=val_prompts(generated / "val.parquet", num_prompts))
