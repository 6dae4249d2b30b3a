"""The shards a run trains on, checked before step 1: both splits opened against the target's
fingerprint, their manifests checked against the target and the drafter (`check_contract`), the
token ids they use (for choosing a mask token), and the data part of the run record by content
(`shards_record`)."""

from pathlib import Path

import torch

from dflash_pipeline.data.shards import ShardDataset, open_split
from dflash_pipeline.drafters.config import DrafterConfig
from dflash_pipeline.foundation.errors import PipelineError
from dflash_pipeline.foundation.files import sha256_file
from dflash_pipeline.target.load import TargetInfo


def check_contract(manifest, *, target: TargetInfo, drafter_config: DrafterConfig | None = None, source: str) -> None:
    """Stop before step 1 when the shards disagree with the target or the drafter, naming the field."""
    expected = {"target_fingerprint": target.fingerprint, "hidden_size": target.hidden_size, "num_target_layers": target.num_layers}
    if drafter_config is not None:
        expected["layer_ids"] = list(drafter_config.target_layer_ids)
        expected["feature_width"] = drafter_config.feature_width
    for name, value in expected.items():
        actual = getattr(manifest, name)
        if actual != value:
            raise PipelineError(f"{source}: manifest {name} is {actual!r}, but the {'drafter' if name in ('layer_ids', 'feature_width') else 'target'} has {value!r}")


def used_token_ids(*datasets: ShardDataset) -> set[int]:
    used: set[int] = set()
    for dataset in datasets:
        for index in range(len(dataset)):
            used.update(torch.unique(dataset[index].input_ids).tolist())
    return used


def open_shards(target: TargetInfo, train_dir: Path, val_dir: Path) -> tuple[ShardDataset, ShardDataset]:
    train_set = open_split(train_dir, expected_fingerprint=target.fingerprint)
    val_set = open_split(val_dir, expected_fingerprint=target.fingerprint)
    check_contract(train_set.manifest, target=target, source=str(train_dir / "manifest.json"))
    check_contract(val_set.manifest, target=target, source=str(val_dir / "manifest.json"))
    if val_set.manifest.layer_ids != train_set.manifest.layer_ids:
        raise PipelineError(f"{val_dir / 'manifest.json'}: layer_ids {val_set.manifest.layer_ids} differ from train's "
                            f"{train_set.manifest.layer_ids}")
    for name, dataset, folder in (("train", train_set, train_dir), ("val", val_set, val_dir)):
        # Found here, before step 1: the val split is scored every eval_every steps, and an empty
        # one would otherwise stop the run there (generate and capture refuse one when they make it).
        if len(dataset) == 0:
            raise PipelineError(f"train: {folder / 'manifest.json'}: the {name} split holds no sequence; rerun generate with "
                                f"more prompts (or pin some to {name} with a \"split\" field)")
    return train_set, val_set


def shards_record(train_set: ShardDataset, val_set: ShardDataset, *, train_dir: Path, val_dir: Path) -> dict:
    """The data part of the run record, by content: each split's manifest sha256 (the manifest
    lists every shard's sha256, so any change of what a shard holds changes it, at equal counts
    too), beside the capture settings that decide a shard's content, spelled out so the line that
    starts a run afresh names the one that changed (`record_changes`)."""
    manifest = train_set.manifest
    return {"train": {"tokens": manifest.tokens, "manifest_sha256": sha256_file(Path(train_dir) / "manifest.json")},
            "val": {"tokens": val_set.manifest.tokens, "manifest_sha256": sha256_file(Path(val_dir) / "manifest.json")},
            "layer_ids": manifest.layer_ids, "feature_dtype": manifest.feature_dtype, "target_top_k": manifest.target_top_k}
