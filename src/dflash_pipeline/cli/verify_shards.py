"""`dflash-pipeline verify-shards`: a capture split folder (or each split of a capture output)
checked against its manifest, and with --target against that target's fingerprint."""

from pathlib import Path

import click

from dflash_pipeline.cli.group import EXISTING_DIR, main, split_folders, target_info
from dflash_pipeline.foundation.errors import PipelineError
from dflash_pipeline.foundation.files import format_bytes
from dflash_pipeline.foundation.runtime import one_line_errors


@main.command("verify-shards", short_help="Verify a shard split folder against its manifest.")
@click.argument("folder", metavar="DIR", type=EXISTING_DIR)
@click.option("--target", "target_path", type=click.Path(exists=True, path_type=Path), default=None,
              help="Also check the shards were captured from this target: its target.json (or the target stage's folder, "
                   "or a Hugging Face model folder).")
@one_line_errors
def verify_shards(folder, target_path):
    """Check a capture split folder: manifest, every shard's size, sha256, schema and row lengths,
    and with --target that the manifest's target fingerprint is that target's.

    DIR is a split folder (manifest.json + shard-NNNNN.arrow) or a capture output holding split
    folders (each is checked). Prints one summary line per split; the first problem stops with one
    line naming the file.

    \b
    Example:
      dflash-pipeline verify-shards data/hidden/val
      dflash-pipeline verify-shards data/hidden --target data/target/target.json
    """
    from dflash_pipeline.data.shards import Manifest, verify_split

    folders = split_folders(folder)
    if not folders:
        raise PipelineError(f"{folder}: no manifest.json here or in its subfolders (not a capture split folder)")
    # Without --target a split captured from another model verifies fine: its shards match its own
    # manifest. Only the fingerprint ties them to the target train and evaluate will use.
    target = target_info(target_path) if target_path is not None else None
    for split in folders:
        manifest = Manifest.load(split)
        if target is not None and manifest.target_fingerprint != target.fingerprint:
            raise PipelineError(f"{split / 'manifest.json'}: target_fingerprint {manifest.target_fingerprint[:12]} is not the "
                                f"fingerprint of {target_path} ({target.fingerprint[:12]}): captured from another target")
        verify_split(split, manifest)
        checked = " (matches --target)" if target is not None else ""
        click.echo(f"{split}: ok, {manifest.sequences} sequences, {manifest.tokens} tokens ({manifest.loss_tokens} answer) in "
                   f"{len(manifest.shards)} shard(s) of {format_bytes(sum(s.bytes for s in manifest.shards))}; layers {manifest.layer_ids} "
                   f"x {manifest.hidden_size} in {manifest.feature_dtype}; target {manifest.target_fingerprint[:12]}{checked}")
