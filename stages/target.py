"""DVC stage `target`: make the target model available locally and write its fingerprint.

    python stages/target.py --params params.yaml --out data/target
"""

from pathlib import Path

import click

from dflash_pipeline.foundation.runtime import OneLineCommand, offline_by_default, one_line_errors


@click.command(cls=OneLineCommand)
@click.option("--params", "params_path", type=click.Path(path_type=Path), default="params.yaml", show_default=True)
@click.option("--out", "out_dir", type=click.Path(path_type=Path), default="data/target", show_default=True,
              help="Folder for target.json (and the converted embedded model).")
@one_line_errors
def main(params_path: Path, out_dir: Path) -> None:
    """Resolve `target.model` and fingerprint it into OUT/target.json."""
    offline_by_default()
    from dflash_pipeline.foundation.config import load_params
    from dflash_pipeline.target.load import check_watch, prepare_target

    params = load_params(params_path)
    check_watch(params.target, source=str(params_path))
    info = prepare_target(params.target, out_dir=out_dir)
    window = f", sliding window {info['sliding_window']}" if info["sliding_window"] else ""
    click.echo(
        f"target: {info['model']} ({info['architecture']}, {info['num_layers']} layers, hidden {info['hidden_size']}, "
        f"vocab {info['vocab_size']}, {info['dtype']}{window}) fingerprint {info['fingerprint'][:12]}"
    )


if __name__ == "__main__":
    main()
