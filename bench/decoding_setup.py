"""What bench/verify_length.py and bench/speculative.py share: their options, and the chosen
drafter with the real target, its head, taps and val prompts, loaded as `evaluate` loads them."""

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
        click.option("--device", default="cpu", show_default=True),
    ]
    for option in reversed(options):
        command = option(command)
    return command


@dataclass
class DecodingSetup:
    checkpoint: Path
    target: object
    drafter: object
    head: object
    model: object
    tap: object
    val_set: object
    prompts: list
    eos_ids: set


def load_decoding_setup(checkpoint, hidden: Path, generated: Path, target_json: Path, num_prompts: int, device: str) -> DecodingSetup:
    import torch

    from dflash_pipeline.drafters.checkpoints import load_checkpoint
    from dflash_pipeline.devices import bf16_by_default
    from dflash_pipeline.evaluate.run import val_prompts
    from dflash_pipeline.files import read_json
    from dflash_pipeline.data.shards import open_split
    from dflash_pipeline.target.load import LayerTap, TargetInfo, load_target, load_target_head

    target = TargetInfo.from_json(target_json)
    checkpoint = checkpoint or Path(read_json(Path("data/eval/best.json"), missing="no data/eval/best.json: pass --checkpoint")["path"])
    drafter, _ = load_checkpoint(checkpoint, device=device)
    val_set = open_split(hidden / "val", expected_fingerprint=target.fingerprint)
    head = load_target_head(target, device=device, dtype=torch.bfloat16 if bf16_by_default(device) else torch.float32)
    model, _ = load_target(target, device=device)
    return DecodingSetup(checkpoint=checkpoint, target=target, drafter=drafter, head=head, model=model,
                         tap=LayerTap(model, list(drafter.config.target_layer_ids)), val_set=val_set,
                         prompts=val_prompts(generated / "val.parquet", num_prompts), eos_ids=set(target.eos_token_ids))
