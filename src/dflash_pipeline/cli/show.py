"""`dflash-pipeline show`: the contract of a checkpoint, a serving-format drafter or a shard split
folder printed as `key: value` lines, from the folder's records and the safetensors headers (the
weights are not loaded; their recorded sha256 is checked where the folder has one)."""

from dataclasses import replace
from pathlib import Path

import click

from dflash_pipeline.cli.group import EXISTING_DIR, folder_kind, main, split_folders
from dflash_pipeline.foundation.errors import PipelineError
from dflash_pipeline.foundation.files import format_bytes
from dflash_pipeline.foundation.runtime import one_line_errors


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
    from dflash_pipeline.drafters.config import DrafterConfig
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
    if isinstance(source.get("best_mode"), dict):  # what `decode` decodes with at T = 0, read as it reads it
        from dflash_pipeline.measure.record import BestMode

        best = BestMode.from_json(source["best_mode"], f"{folder / PROVENANCE_FILE}: source.best_mode")
        lines.append(("best decoding mode", f"{best.mode or 'none lossless'}, speedup {best.speedup} on {best.machine} "
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
