"""`dflash-pipeline`: the console command for work outside the DVC pipeline.

    dflash-pipeline evaluate data/checkpoints/step_000900 path/to/zlab-drafter \\
        --target data/target/target.json --shards data/hidden/val --prompts data/generated/val.parquet
    dflash-pipeline verify-shards data/hidden/val --target data/target/target.json
    dflash-pipeline verify --repair
    dflash-pipeline show data/checkpoints/step_000900
    dflash-pipeline export data/checkpoints/step_000900 out/drafter --dtype bfloat16
    dflash-pipeline compare-runs data/eval other-clone/data/eval
    dflash-pipeline decode "Explain recursion." --target data/target/target.json --drafter data/export/drafter --compare
    dflash-pipeline plots HEAD

Each subcommand is a thin shell over the library, like the stage scripts: it resolves paths, builds
a config from its options (never params.yaml), calls the library and prints. Option defaults are the
config dataclasses' defaults (config.py), which equal params.yaml's. Every failure, usage mistakes
included, is one line `error: ...` on stderr and exit status 1.

The group and what the commands share are in `cli.group`; each command is a module of this
package that registers itself on the group when imported, as this module does for all of them.
The console script is `dflash_pipeline.cli:main` (pyproject.toml).
"""

# Each command module registers its command on `main` when imported.
from dflash_pipeline.cli import compare_runs, decode, evaluate, export, plots, show, verify, verify_shards  # noqa: F401
from dflash_pipeline.cli.group import main

__all__ = ["main"]
