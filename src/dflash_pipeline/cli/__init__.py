"""`dflash-pipeline`: the console command for work outside the DVC pipeline.

    dflash-pipeline evaluate data/checkpoints/step_000900 path/to/zlab-drafter \\
        --target data/target/target.json --shards data/hidden/val --prompts data/generated/val.parquet
    dflash-pipeline verify-shards data/hidden/val --target data/target/target.json
    dflash-pipeline verify --repair
    dflash-pipeline show data/checkpoints/step_000900
    dflash-pipeline export data/checkpoints/step_000900 out/drafter --dtype bfloat16
    dflash-pipeline compare-runs data/eval other-clone/data/eval
    dflash-pipeline generate "Explain recursion." --target data/target/target.json --drafter data/export/drafter --compare
    dflash-pipeline plots HEAD

Each subcommand is a thin shell over the library, like the stage scripts: it resolves paths, builds
a config from its options (never params.yaml), calls the library and prints. Option defaults are the
config dataclasses' defaults (config.py), which equal params.yaml's. Every failure, usage mistakes
included, is one line `error: ...` on stderr and exit status 1.
"""

import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import click
from click.core import ParameterSource

from dflash_pipeline import __version__
from dflash_pipeline.foundation.config import EvaluateConfig, GenerateConfig, TargetConfig
from dflash_pipeline.speculation.modes import DecodingMode
from dflash_pipeline.foundation.errors import PipelineError
from dflash_pipeline.foundation.files import format_bytes
from dflash_pipeline.foundation.runtime import OneLineUsage, device_option, offline_by_default, one_line_errors

DEFAULTS = EvaluateConfig()
GENERATE_DEFAULTS = GenerateConfig()
EXISTING_DIR = click.Path(exists=True, file_okay=False, path_type=Path)


class OneLineGroup(OneLineUsage, click.Group):
    """The command group: usage mistakes are one line `error: ...` and exit 1 (`runtime.OneLineUsage`)."""


@click.group(cls=OneLineGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "-V", "--version", prog_name="dflash-pipeline")
def main():
    """DFlash drafter tools outside the DVC pipeline: score and compare drafters, decode with one,
    verify and inspect shards and checkpoints, export, and plot experiments.

    Hub downloads stay off unless HF_HUB_OFFLINE=0 is set. `dflash-pipeline COMMAND --help` shows
    a command's options and an example.
    """
    offline_by_default()


# ----------------------------------------------------------------------------- folders


def folder_kind(folder: Path) -> str:
    """What `folder` holds: a training "checkpoint" (checkpoint.json), a serving-format "drafter"
    (config.json), a capture "split" (manifest.json) or "splits" (a capture output of split folders)."""
    if (folder / "checkpoint.json").is_file():
        return "checkpoint"
    if (folder / "config.json").is_file():
        return "drafter"
    if (folder / "manifest.json").is_file():
        return "split"
    if split_folders(folder):
        return "splits"
    hint = " (a training run folder: name one of its step_NNNNNN folders)" if any(folder.glob("step_*/checkpoint.json")) else ""
    raise PipelineError(f"{folder}: not a checkpoint folder (checkpoint.json), a DFlash drafter folder (config.json) "
                        f"or a shard split folder (manifest.json){hint}")


def split_folders(folder: Path) -> list[Path]:
    """The split folders at `folder`: itself when it holds a manifest, else its subfolders that do."""
    if (folder / "manifest.json").is_file():
        return [folder]
    return sorted(p for p in folder.iterdir() if (p / "manifest.json").is_file()) if folder.is_dir() else []


def target_info(path: Path):
    """A target.json (or the target stage's folder holding one), or a local Hugging Face model
    folder, fingerprinted now exactly as the `target` stage would."""
    from dflash_pipeline.target.load import TargetInfo, prepare_target

    if path.is_file():
        return TargetInfo.from_json(path)
    if (path / "target.json").is_file():
        return TargetInfo.from_json(path / "target.json")
    if (path / "config.json").is_file():
        with tempfile.TemporaryDirectory(prefix="dflash-target-") as scratch:
            prepare_target(TargetConfig(model=str(path.resolve())), out_dir=Path(scratch))
            return TargetInfo.from_json(Path(scratch) / "target.json")  # it records the model's absolute path
    raise PipelineError(f"{path}: neither a target.json nor a Hugging Face model folder (config.json)")


def generated_val(path: Path | None) -> Path | None:
    """The generate stage's val.parquet (given as the file or its folder), its schema checked."""
    from dflash_pipeline.data.prompts import read_generated

    if path is None:
        return None
    path = path / "val.parquet" if path.is_dir() else path
    read_generated(path)
    return path


def comma_separated(kind: type, minimum: float, example: str):
    """A click callback parsing "a,b,c" into a list of `kind`, each at least `minimum`."""

    def parse(context, option, value: str) -> list:
        try:
            items = [kind(part) for part in value.split(",") if part.strip()]
        except ValueError:
            raise click.BadParameter(f"{value!r} is not a comma-separated list of {kind.__name__}s, e.g. {example}") from None
        if any(item < minimum for item in items):
            raise click.BadParameter(f"{value!r}: every value must be >= {minimum:g}")
        return items

    return parse


# ----------------------------------------------------------------------------- evaluate


@main.command(short_help="Score checkpoints and baseline drafters side by side.")
@click.argument("drafters", metavar="DRAFTER...", nargs=-1, required=True, type=EXISTING_DIR)
@click.option("--target", "target_path", required=True, type=click.Path(exists=True, path_type=Path),
              help="The target stage's target.json, or a local Hugging Face model folder (fingerprinted on the fly).")
@click.option("--shards", "shards_dir", required=True, type=EXISTING_DIR,
              help="A capture split folder (data/hidden/val), scored teacher-forced; a capture output folder means its val/.")
@click.option("--prompts", "prompts_path", type=click.Path(exists=True, path_type=Path), default=None,
              help="The generate stage's val.parquet (or its folder): prompts for end-to-end decoding and prompt "
                   "categories. Without it, end-to-end decoding is skipped.")
@click.option("--anchors", type=click.IntRange(min=0), default=DEFAULTS.anchors_per_sequence, show_default=True,
              help="Teacher-forced blocks per val sequence (0: every anchor).")
@click.option("--tree-budgets", callback=comma_separated(int, 1, "4,8,16"), default=",".join(map(str, DEFAULTS.tree_budgets)), show_default=True,
              help="DDTree node budgets, comma-separated.")
@click.option("--temperatures", callback=comma_separated(float, 0, "0,1"),
              default=",".join(f"{t:g}" for t in DEFAULTS.temperatures), show_default=True,
              help="End-to-end sampling temperatures (0: greedy, always run), comma-separated.")
@click.option("--e2e-prompts", type=click.IntRange(min=0), default=DEFAULTS.num_prompts, show_default=True,
              help="Val prompts decoded end to end (0 skips it).")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=DEFAULTS.max_new_tokens, show_default=True,
              help="Answer length of each end-to-end decode.")
@click.option("--tokens-per-batch", type=click.IntRange(min=1), default=DEFAULTS.tokens_per_batch, show_default=True,
              help="Context tokens per batched teacher-forced forward.")
@click.option("--seed", type=int, default=DEFAULTS.seed, show_default=True,
              help="Seed of the anchor draw (the same anchors for every drafter).")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Also write the evaluate stage's outputs here (eval.json, details.json, comparison.csv, blocks.parquet, "
                   "e2e.json, best.json, plots/).")
@device_option
@one_line_errors
def evaluate(drafters, target_path, shards_dir, prompts_path, anchors, tree_budgets, temperatures, e2e_prompts, max_new_tokens,
             tokens_per_batch, seed, out_dir, device):
    """Score drafters side by side on one target's captured val shards, without params.yaml.

    Each DRAFTER is a training checkpoint folder (step_NNNNNN, from one run) or a folder in the
    DFlash serving format (an export of ours or a published drafter), scored as a baseline. Every
    drafter is checked against the target and the shards first. Prints the comparison table; the
    best checkpoint (highest teacher-forced tau) is starred and decoded end to end with --prompts.

    \b
    Example:
      dflash-pipeline evaluate data/checkpoints/step_000900 ~/drafters/zlab-qwen3-8b \\
          --target data/target/target.json --shards data/hidden/val \\
          --prompts data/generated/val.parquet --e2e-prompts 4 --out /tmp/eval-900
    """
    from dflash_pipeline.evaluate.report import summary_table, write_outputs
    from dflash_pipeline.evaluate.run import run_evaluate

    kinds = {folder: folder_kind(folder) for folder in drafters}
    for folder, kind in kinds.items():
        if kind not in ("checkpoint", "drafter"):
            raise PipelineError(f"{folder}: a shard folder, not a drafter (checkpoint.json or config.json); pass it as --shards")
    checkpoints = list(dict.fromkeys(folder.resolve() for folder, kind in kinds.items() if kind == "checkpoint"))
    baselines = list(dict.fromkeys(folder.resolve() for folder, kind in kinds.items() if kind == "drafter"))
    config = replace(DEFAULTS, baselines=[str(b) for b in baselines], anchors_per_sequence=anchors,
                     tokens_per_batch=tokens_per_batch, tree_budgets=tree_budgets, temperatures=temperatures, num_prompts=e2e_prompts,
                     max_new_tokens=max_new_tokens, seed=seed)
    config.validate("command line")
    capture_output = not (shards_dir / "manifest.json").is_file() and (shards_dir / "val" / "manifest.json").is_file()
    split = shards_dir / "val" if capture_output else shards_dir
    result = run_evaluate(config, target=target_info(target_path), hidden_val_dir=split, generated_val=generated_val(prompts_path),
                          checkpoint_folders=checkpoints, baseline_dirs=baselines, device=device, log=click.echo,
                          source="command line")
    if out_dir is not None:
        write_outputs(result, out_dir=out_dir, metrics_path=out_dir / "eval.json", plots_dir=out_dir / "plots")
        click.echo(f"evaluate: wrote {out_dir}")
    click.echo(summary_table(result.record))


# ----------------------------------------------------------------------------- verify-shards


@main.command("compare-runs", short_help="Compare two runs' chosen drafters, paired by val prompt.")
@click.argument("run_a", type=EXISTING_DIR)
@click.argument("run_b", type=EXISTING_DIR)
@one_line_errors
def compare_runs(run_a, run_b):
    """Compare the chosen drafters of two evaluate outputs (each run's data/eval folder), e.g. the
    committed run against a recomputation on another machine: τ of each, their difference paired
    over the val prompts both scored, and whether 95% tells them apart.

    \b
    Example:
      dflash-pipeline compare-runs data/eval ../other-clone/data/eval
    """
    from dflash_pipeline.evaluate.compare import compare_eval_runs

    result = compare_eval_runs(run_a, run_b)
    blocks = "the same val blocks" if result.same_blocks else "different val blocks (the runs' answers differ)"
    click.echo(f"tau {result.tau_a:.4f} vs {result.tau_b:.4f} on {blocks}")
    click.echo(result.verdict)


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


# ----------------------------------------------------------------------------- show


def drafter_lines(config) -> list[tuple[str, object]]:
    mask_note = config.extra.get("mask_token")
    return [
        ("drafter layers", config.num_layers),
        ("hidden size", config.hidden_size),
        ("intermediate size", config.intermediate_size),
        ("attention heads", f"{config.num_attention_heads} query, {config.num_key_value_heads} key/value, head_dim {config.head_dim}"),
        ("vocab size", config.vocab_size),
        ("block size", f"{config.block_size} (drafts {config.block_size - 1} tokens per forward)"),
        ("mask token id", f"{config.mask_token_id}" + (f" ({mask_note})" if mask_note else "")),
        ("target layer ids", list(config.target_layer_ids)),
        ("target layers", config.num_target_layers),
        ("feature width", f"{config.feature_width} ({len(config.target_layer_ids)} x {config.hidden_size})"),
        ("rope theta", config.rope_theta),
        ("sliding window", config.sliding_window),
    ]


def weights_line(files: list[Path]) -> str:
    """Stored dtype(s), parameter count and size of safetensors files, from their headers only."""
    from dflash_pipeline.foundation.tensor_files import safetensors_header

    dtypes, parameters = set(), 0
    for file in files:
        for entry in safetensors_header(file).values():
            if entry.dtype[0] in "IUB":  # token ids (a draft vocabulary), not weights
                continue
            dtypes.add(entry.dtype)
            parameters += entry.numel
    names = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
    kinds = ", ".join(sorted(names.get(d, d) for d in dtypes)) or "no tensors"
    return f"{kinds}, {parameters / 1e6:.2f} M parameters, {format_bytes(sum(f.stat().st_size for f in files))} in {len(files)} file(s)"


def checkpoint_contract(folder: Path) -> list[tuple[str, object]]:
    from dflash_pipeline.drafters.checkpoints import weights_problem
    from dflash_pipeline.drafters.core import DrafterConfig
    from dflash_pipeline.foundation.files import read_json

    info = read_json(folder / "checkpoint.json", missing="unreadable")
    if "drafter" not in info:
        raise PipelineError(f"{folder / 'checkpoint.json'}: no drafter config (not a training checkpoint)")
    problem = weights_problem(folder, info)  # the weights a later `evaluate` or `export` would read
    if problem:
        raise PipelineError(problem)
    metrics = info.get("metrics") or {}
    config = DrafterConfig.from_dict(info["drafter"])
    lines = [("kind", f"training checkpoint of a {config.member.title} drafter"), ("step", info.get("step")),
             ("target fingerprint", info.get("target_fingerprint"))]
    lines += drafter_lines(config)
    checked = "; sha256 matches checkpoint.json" if info.get("weights_sha256") else ""
    lines += [("weights", weights_line([folder / "model.safetensors"]) + checked),
              ("metrics", ", ".join(f"{k} {v}" for k, v in sorted(metrics.items())) or None),
              ("git revision", info.get("git_revision"))]
    return lines


def drafter_contract(folder: Path) -> list[tuple[str, object]]:
    from dflash_pipeline.drafters.serving import PROVENANCE_FILE, provenance_problems
    from dflash_pipeline.drafters.serving_config import drafter_config_from_serving
    from dflash_pipeline.foundation.files import read_json

    config_path = folder / "config.json"
    config = drafter_config_from_serving(read_json(config_path, missing="unreadable"), where=config_path)
    provenance = read_json(folder / PROVENANCE_FILE, missing="unreadable") if (folder / PROVENANCE_FILE).is_file() else None
    problems = provenance_problems(folder, provenance) if provenance is not None else []
    if problems:
        raise PipelineError(problems[0])
    source = (provenance or {}).get("source") or {}
    if provenance is not None:
        config = replace(config, extra=(provenance.get("drafter") or {}).get("extra") or {})
    lines = [("kind", f"{config.member.title} drafter (serving format)"),
             ("target fingerprint", source.get("target_fingerprint") or "unknown (not exported by this pipeline)")]
    if source.get("checkpoint"):
        lines.append(("exported from", f"{source['checkpoint']} (step {source.get('step')})"))
    if isinstance(source.get("best_mode"), dict):  # what `generate` decodes with at T = 0
        best = source["best_mode"]
        lines.append(("best decoding mode", f"{best.get('mode') or 'none lossless'}, speedup {best.get('speedup')} on {best.get('machine')} "
                                            "(measured by evaluate)"))
    lines += drafter_lines(config)
    recorded = (provenance or {}).get("files") or {}
    checked = f"; sha256 of {len(recorded)} file(s) match {PROVENANCE_FILE}" if recorded else ""
    lines.append(("weights", weights_line(sorted(folder.glob("*.safetensors"))) + checked))
    return lines


def split_contract(folder: Path) -> list[tuple[str, object]]:
    from dflash_pipeline.data.shards import Manifest

    manifest = Manifest.load(folder)
    stats = ", ".join(f"{k} {v}" for k, v in sorted(manifest.stats.items()))
    return [
        ("kind", f"shard split {manifest.split!r} (not verified; dflash-pipeline verify-shards checks it)"),
        ("target fingerprint", manifest.target_fingerprint),
        ("target layer ids", manifest.layer_ids),
        ("target layers", manifest.num_target_layers),
        ("hidden size", manifest.hidden_size),
        ("feature dtype", manifest.feature_dtype),
        ("feature width", manifest.feature_width),
        ("sequences", manifest.sequences),
        ("tokens", f"{manifest.tokens} ({manifest.loss_tokens} answer tokens)"),
        ("shards", f"{len(manifest.shards)} ({format_bytes(sum(s.bytes for s in manifest.shards))})"),
        ("capture stats", stats or None),
    ]


@main.command(short_help="Print the contract of a checkpoint, drafter or shard folder.")
@click.argument("folder", metavar="DIR", type=EXISTING_DIR)
@one_line_errors
def show(folder):
    """Print the contract of a checkpoint, a DFlash drafter folder or a shard split folder.

    The kind is detected from the folder's files: checkpoint.json (a training checkpoint),
    config.json (the serving format, ours or published), manifest.json (a capture split; a capture
    output shows each of its splits). Printed: target fingerprint, target layer ids, hidden size,
    block size, mask token, dtype and counts. The weights are not loaded; where the folder records
    their sha256 (checkpoints and exports of this pipeline) it is checked, and a damaged file is
    one error line naming it.

    \b
    Examples:
      dflash-pipeline show data/checkpoints/step_000900
      dflash-pipeline show data/export/drafter
      dflash-pipeline show data/hidden
    """
    kind = folder_kind(folder)
    contracts = {"checkpoint": checkpoint_contract, "drafter": drafter_contract, "split": split_contract}
    for number, one in enumerate(split_folders(folder) if kind == "splits" else [folder]):
        lines = contracts["split" if kind == "splits" else kind](one)
        if number:
            click.echo()
        click.echo(f"{one}")
        for key, value in lines:
            click.echo(f"  {key + ':':<20}{value}")


# ----------------------------------------------------------------------------- export


@main.command(short_help="Export a checkpoint to the DFlash serving format.")
@click.argument("checkpoint", type=EXISTING_DIR)
@click.argument("out", type=click.Path(file_okay=False, path_type=Path))
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default="float32", show_default=True,
              help="Weights dtype: float32 is the checkpoint bit for bit; bfloat16 halves the files, as published drafters ship.")
@one_line_errors
def export(checkpoint, out, dtype):
    """Export a training checkpoint to the DFlash serving format (config.json + model.safetensors).

    OUT is replaced only if it is absent, empty or an earlier drafter export. The written folder is
    loaded back before the command reports success. It loads in z-lab's DFlashDraftModel, SGLang
    (--speculative-algorithm DFLASH) and vLLM (method: dflash).

    \b
    Example:
      dflash-pipeline export data/checkpoints/step_000900 out/drafter --dtype bfloat16
    """
    import torch

    from dflash_pipeline.export.run import export_checkpoint
    from dflash_pipeline.drafters.serving import load_dflash_drafter

    folder = export_checkpoint(checkpoint, out, dtype={"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype])
    drafter, _ = load_dflash_drafter(folder)
    config = drafter.config
    click.echo(f"export: {checkpoint} -> {folder} ({dtype}; drafter layers {config.num_layers}, block size {config.block_size}, "
               f"target layer ids {list(config.target_layer_ids)})")


# ----------------------------------------------------------------------------- generate


def evaluate_record_of(drafter_dir: Path, kind: str) -> tuple[bool, object, str]:
    """(True, evaluate's `best_mode` section for this drafter, the file and key it is in), or
    (False, None, why there is none).

    An export of the pipeline carries it in its provenance file (`source.best_mode`, copied there
    by the export stage from best.json). A checkpoint of a pipeline run (data/checkpoints/step_N)
    has the evaluate stage's data/eval/best.json two folders up, which counts only when it chose
    this very folder. A published drafter has no record.
    """
    from dflash_pipeline.drafters.serving import PROVENANCE_FILE
    from dflash_pipeline.foundation.files import check_recorded_digest, read_json

    if kind == "drafter":
        path = drafter_dir / PROVENANCE_FILE
        if not path.is_file():
            return False, None, f"{drafter_dir} has no {PROVENANCE_FILE} (not exported by this pipeline)"
        provenance = read_json(path, missing="unreadable")
        source = (provenance.get("source") or {}) if isinstance(provenance, dict) else None
        if not isinstance(source, dict):
            raise PipelineError(f"{path}: source is not a mapping (a damaged provenance file)")
        if "best_mode" not in source:
            return False, None, f"{path} records no source.best_mode (exported by `dflash-pipeline export`, or before evaluate recorded one)"
        return True, source["best_mode"], f"{path}: source.best_mode"
    best_json = drafter_dir.parent.parent / "eval" / "best.json"
    if not best_json.is_file():
        return False, None, f"no {best_json} beside this checkpoint's run"
    check_recorded_digest(best_json)
    best = read_json(best_json, missing="unreadable")
    if not isinstance(best, dict) or not isinstance(best.get("path"), str):
        raise PipelineError(f"{best_json}: no path of the chosen drafter (not evaluate's best.json)")
    chosen = Path(best["path"])
    chosen = chosen if chosen.is_absolute() else best_json.parent.parent.parent / chosen  # the stage writes it relative to the repository
    if chosen.resolve() != drafter_dir.resolve():
        return False, None, f"{best_json} chose {best.get('name')!r}, not this checkpoint"
    if "best_mode" not in best:
        return False, None, f"{best_json} records no best_mode (written before evaluate recorded one)"
    return True, best["best_mode"], f"{best_json}: best_mode"


def choose_generate_mode(*, drafter_dir: Path, kind: str, block_size: int, tree_budget: int | None, verify_tokens: int | None,
                         explicit: set[str], machine: str) -> tuple[DecodingMode, str]:
    """(the mode, the line saying which mode and why) for greedy `generate`: the options named in
    `explicit` as given; else the mode evaluate measured fastest for this drafter
    (`evaluate_record_of`); else today's default, a chain of all B-1 drafted tokens."""
    from dflash_pipeline.measure.record import BestMode

    if explicit:
        flags = " and ".join(f"--{name.replace('_', '-')}" for name in sorted(explicit))
        mode = DecodingMode(tree_budget=tree_budget, verify_tokens=verify_tokens)
        return mode, f"mode: {mode.describe(block_size)} ({flags})"
    found, section, where = evaluate_record_of(drafter_dir, kind)
    default = DecodingMode.chain(verify_tokens)
    if not found:
        return default, f"mode: {default.describe(block_size)} (no evaluate record of this drafter: {where})"
    if section is None:
        return default, f"mode: {default.describe(block_size)} (evaluate decoded nothing end to end: {where} is null)"
    evaluated = BestMode.from_json(section, where)
    if evaluated.decoding_mode is None:
        return default, f"mode: {default.describe(block_size)} (evaluate found no lossless greedy mode: {where})"

    def rate(speedup) -> str:
        return f"{speedup:.2f}x" if isinstance(speedup, (int, float)) else "n/a"

    mode = evaluated.decoding_mode
    others = ", ".join(f"{name} {rate(value)}" for name, value in evaluated.speedups.items() if name != mode.name)
    line = (f"mode: {mode.describe(block_size)}: evaluate measured {rate(evaluated.speedup)}"
            f"{' vs ' + others if others else ''} on {evaluated.machine}{', engine ' + evaluated.engine if evaluated.engine else ''} ({where})")
    if evaluated.machine != machine:
        line += f"; this is {machine}, where another mode may pay better (--tree-budget, --verify-tokens)"
    return mode, line


@main.command("generate", short_help="Answer a prompt with speculative decoding, streaming.")
@click.argument("prompt")
@click.option("--target", "target_path", required=True, type=click.Path(exists=True, path_type=Path),
              help="The target stage's target.json, or a local Hugging Face model folder.")
@click.option("--drafter", "drafter_dir", required=True, type=EXISTING_DIR,
              help="A training checkpoint (step_NNNNNN), an export, or a published DFlash drafter folder.")
@click.option("--temperature", type=click.FloatRange(min=0.0), default=0.0, show_default=True, help="0: greedy.")
@click.option("--rule", type=click.Choice(["ratio", "match"]), default=DEFAULTS.sampling_rule, show_default=True,
              help="Acceptance rule at T > 0: speculative sampling, or the drafter's argmax matched against the target's sample "
                   "(params.yaml evaluate.sampling_rule).")
@click.option("--top-k", type=click.IntRange(min=0), default=0, show_default=True)
@click.option("--top-p", type=click.FloatRange(min=0.0, max=1.0, min_open=True), default=1.0, show_default=True)
@click.option("--seed", type=int, default=DEFAULTS.seed, show_default=True)
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=GENERATE_DEFAULTS.max_new_tokens, show_default=True,
              help="Answer length cap (params.yaml generate.max_new_tokens).")
@click.option("--verify-tokens", type=click.IntRange(min=1), default=DEFAULTS.verify_tokens,
              help="Drafted tokens verified per chain step (default at T = 0: the mode evaluate measured fastest for this drafter; "
                   "else all B-1).")
@click.option("--tree-budget", type=click.IntRange(min=1), default=None,
              help="Verify a DDTree of this many drafted nodes per step instead of a chain (greedy only; default at T = 0: "
                   "the mode evaluate measured fastest).")
@click.option("--compare", is_flag=True, help="Also decode without the drafter and report both.")
@device_option
@one_line_errors
def generate(prompt, target_path, drafter_dir, temperature, rule, top_k, top_p, seed, max_new_tokens, verify_tokens, tree_budget, compare,
             device):
    """Answer PROMPT (one user turn, in the target's chat template) with the drafter, streaming the
    text, then one line: tokens, tokens per step, tokens/s. --compare adds plain decoding of the
    same prompt; at T = 0 the two answers must be identical. A prompt that with --max-new-tokens
    would run past the target's context (its max_position_embeddings) is refused.

    At T = 0 without --tree-budget or --verify-tokens, the mode is the one evaluate measured fastest
    for this drafter (the chain at its verify length or a DDTree budget): recorded in an export's
    dflash_pipeline.json by the export stage, or, for a checkpoint of a pipeline run, in its
    data/eval/best.json. Without a record it is a chain of all B-1 drafted tokens. The first line
    says which mode and why.

    \b
    Example:
      dflash-pipeline generate "Write a haiku about autumn." --target data/target/target.json \\
          --drafter data/export/drafter --temperature 0.7 --compare
    """
    from dflash_pipeline.data.prompts import Prompt
    from dflash_pipeline.speculation.sampling import Sampling
    from dflash_pipeline.decoding.engine import speculation_engine
    from dflash_pipeline.decoding.session import open_session
    from dflash_pipeline.evaluate.run import load_candidates
    from dflash_pipeline.generate.run import render_prompt

    if tree_budget is not None and (temperature > 0 or verify_tokens is not None):
        raise PipelineError("--tree-budget: tree verification is greedy and verifies the whole tree (drop --temperature / --verify-tokens)")
    target = target_info(target_path)
    kind = folder_kind(drafter_dir)
    if kind not in ("checkpoint", "drafter"):
        raise PipelineError(f"{drafter_dir}: a shard folder, not a drafter (checkpoint.json or config.json)")
    (candidate,) = load_candidates(checkpoint_folders=[drafter_dir] if kind == "checkpoint" else [],
                                   baseline_dirs=[drafter_dir] if kind == "drafter" else [], target=target, layer_ids=None, device=device)
    sampling = Sampling(temperature, rule=rule, top_k=top_k, top_p=top_p, seed=seed) if temperature > 0 else None
    if sampling is None:  # the mode that pays best is a greedy measurement: evaluate's, unless the options choose
        from dflash_pipeline.foundation.devices import machine_description

        context = click.get_current_context()
        explicit = {name for name in ("tree_budget", "verify_tokens")
                    if context.get_parameter_source(name) not in (None, ParameterSource.DEFAULT)}
        chosen, line = choose_generate_mode(
            drafter_dir=drafter_dir, kind=kind, block_size=candidate.drafter.config.block_size, tree_budget=tree_budget,
            verify_tokens=verify_tokens, explicit=explicit, machine=f"{device} on {machine_description()}")
        tree_budget, verify_tokens = chosen.tree_budget, chosen.verify_tokens
        click.echo(line)
    session = open_session(target, candidate.drafter, device=device)
    prompt_ids = render_prompt(session.tokenizer, Prompt(id="cli", messages=(("user", prompt),), category="cli", split="val", source_line=0),
                               system_prompt=GENERATE_DEFAULTS.system_prompt, enable_thinking=GENERATE_DEFAULTS.enable_thinking)
    context = target.max_position_embeddings
    if context and len(prompt_ids) + max_new_tokens > context:  # decoding on past it runs off what the target was built for
        raise PipelineError(f"PROMPT is {len(prompt_ids)} tokens in the target's chat template; with --max-new-tokens {max_new_tokens} "
                            f"that is {len(prompt_ids) + max_new_tokens}, past the target's context of {context} tokens "
                            f"(max_position_embeddings in {target_path}): shorten the prompt or lower --max-new-tokens")
    speculation = session.speculation(tree_budget=tree_budget, verify_tokens=verify_tokens)
    if compare:  # first-call allocations and kernel choice would otherwise fall on the side that runs first
        session.plain(prompt_ids, max_new_tokens=4)
    shown: list[int] = []

    def stream(tokens: list[int]) -> None:
        before = session.tokenizer.decode(shown, skip_special_tokens=True)
        shown.extend(tokens)
        click.echo(session.tokenizer.decode(shown, skip_special_tokens=True)[len(before):], nl=False)

    run = session.decode(prompt_ids, speculation, max_new_tokens=max_new_tokens, sampling=sampling, on_tokens=stream)
    click.echo()
    steps = sum(run.steps) / len(run.steps) if run.steps else 1.0
    mode = ("greedy" if tree_budget is None else f"greedy, tree of {tree_budget}") if sampling is None else f"T={temperature}, {rule} rule"
    click.echo(f"speculative ({mode}): {len(run.tokens)} tokens, {steps:.2f} tokens per step, {len(run.tokens) / run.seconds:.1f} tokens/s on the {speculation_engine(session.model)} engine")
    if compare:
        plain = session.plain(prompt_ids, max_new_tokens=max_new_tokens, sampling=sampling)
        rate = len(plain.tokens) / plain.seconds
        mode = "greedy" if sampling is None else mode
        same = "identical answers" if plain.tokens == run.tokens else (
            "different answers: NOT LOSSLESS" if sampling is None else "different samples (expected at T > 0: same distribution)")
        click.echo(f"plain ({mode}): {len(plain.tokens)} tokens, {rate:.1f} tokens/s; speedup {len(run.tokens) / run.seconds / rate:.2f}; {same}")


# ----------------------------------------------------------------------------- plots


def _xy_fields(spec) -> tuple[str | None, str | None]:
    """The x and y fields of a DVC vega-lite plot spec (its first plain, non-aggregated encodings)."""
    found = {"x": None, "y": None}

    def walk(node):
        if isinstance(node, dict):
            encoding = node.get("encoding")
            if isinstance(encoding, dict):
                for axis in ("x", "y"):
                    channel = encoding.get(axis)
                    if found[axis] is None and isinstance(channel, dict) and "field" in channel and "aggregate" not in channel:
                        found[axis] = channel["field"]
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(spec)
    return found["x"], found["y"]


def render_plots_diff(payload: dict, out_dir: Path) -> list[Path]:
    """PNGs of `dvc plots diff --json` output: one per plot, one line per revision."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, plots in sorted((payload.get("data") or {}).items()):
        for plot in plots:
            if plot.get("type") != "vega":
                continue  # image plots (our PNGs) are already pictures
            spec = plot["content"]
            x_field, y_field = _xy_fields(spec)
            values = spec.get("data", {}).get("values", [])
            if not values or x_field is None or y_field is None:
                continue
            figure, axis = plt.subplots(figsize=(6, 4))
            for revision in dict.fromkeys(row.get("rev") for row in values):
                rows = [row for row in values if row.get("rev") == revision and row.get(y_field) not in (None, "")]
                axis.plot([float(r[x_field]) for r in rows], [float(r[y_field]) for r in rows], marker=".", label=str(revision))
            axis.set(xlabel=x_field, ylabel=y_field, title=name)
            axis.legend(fontsize=8)
            figure.tight_layout()
            path = out_dir / (name.replace("/", "_").rsplit(".", 1)[0] + ".png")
            figure.savefig(path, dpi=110)
            plt.close(figure)
            written.append(path)
    return written


@main.command(short_help="Draw `dvc plots diff` of revisions to PNGs (offline).")
@click.argument("revisions", nargs=-1)
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default="data/plots/diff", show_default=True)
@one_line_errors
def plots(revisions, out_dir):
    """`dvc plots diff REVISIONS` drawn to PNG files, one line per revision.

    DVC's own HTML loads its chart scripts from a CDN and stays blank offline; this asks DVC for
    the same data (`dvc plots diff --json`, so git revisions, tags and `dvc exp` names all work)
    and draws it with matplotlib. Without REVISIONS: the workspace against HEAD. Run it in the
    pipeline's repository.

    \b
    Example:
      dvc exp run -S train.lr=0.001
      dflash-pipeline plots HEAD            # workspace (the experiment) vs HEAD
      dflash-pipeline plots main exp-1a2b3 --out /tmp/plots
    """
    import json
    import subprocess

    command = [sys.executable, "-m", "dvc", "plots", "diff", "--json", *revisions]
    result = subprocess.run(command, capture_output=True, text=True)
    try:
        payload = json.loads(result.stdout)
    except json.JSONDecodeError:
        detail = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise PipelineError(f"dvc plots diff {' '.join(revisions)}: {detail}") from None
    for error in payload.get("errors", []) or []:
        click.echo(f"plots: {error.get('rev')}: {error.get('name')}: {error.get('msg')}", err=True)
    written = render_plots_diff(payload, out_dir)
    if not written:
        raise PipelineError(f"dvc plots diff {' '.join(revisions)}: no plot data to draw (is this the pipeline's repository?)")
    for path in written:
        click.echo(f"plots: wrote {path}")


if __name__ == "__main__":
    main()
