"""`dflash-pipeline verify`: a whole run checked against the digests its files carry, and with
--repair the damage removed (`integrity.checks`)."""

from pathlib import Path

import click

from dflash_pipeline.cli.group import EXISTING_DIR, main
from dflash_pipeline.foundation.errors import PipelineError
from dflash_pipeline.foundation.runtime import one_line_errors


@main.command(short_help="Check a whole run for damage; --repair removes it.")
@click.argument("root", metavar="DIR", type=EXISTING_DIR, default=".")
@click.option("--target", "target_json", type=click.Path(path_type=Path), default=None,
              help="The target stage's target.json (default: DIR/data/target/target.json).")
@click.option("--generated", "generated_dir", type=click.Path(path_type=Path), default=None,
              help="The generate output (default: DIR/data/generated).")
@click.option("--hidden", "hidden_dir", type=click.Path(path_type=Path), default=None,
              help="The capture output (default: DIR/data/hidden).")
@click.option("--checkpoints", "checkpoints_dir", type=click.Path(path_type=Path), default=None,
              help="The train output (default: DIR/data/checkpoints).")
@click.option("--eval", "eval_dir", type=click.Path(path_type=Path), default=None,
              help="The evaluate output (default: DIR/data/eval).")
@click.option("--export", "export_dir", type=click.Path(path_type=Path), default=None,
              help="The export output (default: DIR/data/export/drafter).")
@click.option("--repair", is_flag=True,
              help="Remove damaged files with their DVC cache objects (and restore cache objects from good copies), "
                   "and leftover staging folders; then `dvc pull` or `dvc repro` brings good copies back.")
@one_line_errors
def verify(root, target_json, generated_dir, hidden_dir, checkpoints_dir, eval_dir, export_dir, repair):
    """Check a whole run against the digests its files carry: the converted target (target.json),
    generate's answers and resume chunks (their .sha256 records), the shards (each split's
    manifest), every checkpoint's weights and resume state (checkpoint.json), evaluate's best.json
    (its .sha256 record), the export (dflash_pipeline.json), leftover staging folders, and every DVC
    cache object dvc.lock's outputs name (each must hash to its name: with hard links a flipped bit
    in an output is in its cache object too, which DVC trusts without rehashing).

    DIR is the pipeline's repository (default: here). Prints one line per problem and exits 1
    when there are any. --repair removes each damaged file with the cache objects that are the same
    file (for a checkpoint, also every newer step: train writes them again, from the newest step left
    with its resume state, which only the newest two steps keep, else from the start; it says
    which), restores a damaged
    cache object from a good copy in the workspace or removes it, and removes leftovers; then
    `dvc pull` (from a remote) or `dvc repro` brings good copies back. `make repro` runs it.

    \b
    Example:
      dflash-pipeline verify
      dflash-pipeline verify --repair && dvc repro
    """
    from dflash_pipeline.integrity.checks import RunPaths, check_run
    from dflash_pipeline.integrity.repair import repair as repair_run

    paths = RunPaths.at(root, target=target_json, generated=generated_dir, hidden=hidden_dir, checkpoints=checkpoints_dir, eval=eval_dir,
                        export=export_dir)
    findings = check_run(paths)
    for finding in findings:
        click.echo(f"verify: {finding.problem}")
    if not findings:
        click.echo(f"verify: {root}: no damage found (target, generated answers, shards, checkpoints, best choice, export, DVC cache) "
                   "and no leftover")
        return
    if not repair:
        raise PipelineError(f"{root}: {len(findings)} problem(s) found; `dflash-pipeline verify --repair`, then `dvc pull` or "
                            "`dvc repro` (README, Recovery)")
    for line in repair_run(paths, findings):
        click.echo(f"verify: {line}")
    if any(finding.kind != "leftover" for finding in findings):
        click.echo("verify: repaired; now `dvc pull` (a pushed run) or `dvc repro` (recomputed) brings good copies back")
