"""train/features.py: the channel-RMS feature scale, and how it folds into the export."""

from dataclasses import replace

import torch
from support.stage_commands import TINY_TRAIN, train_tiny_run

from dflash_pipeline.drafters.checkpoints import load_checkpoint


def test_the_feature_scale_is_one_over_channel_rms_and_folds_into_the_export(tiny_run, tmp_path):
    from dflash_pipeline.data.shards import open_split
    from dflash_pipeline.drafters.serving import export_drafter, load_dflash_drafter
    from dflash_pipeline.train.features import channel_rms_scale

    target, root = tiny_run
    result = train_tiny_run(tiny_run, tmp_path / "ck", replace(TINY_TRAIN, feature_norm="channel_rms", max_steps=2, eval_every=2, save_every=2))
    plain = train_tiny_run(tiny_run, tmp_path / "plain", replace(TINY_TRAIN, feature_norm="none", max_steps=2, eval_every=2, save_every=2))
    assert result.curve[0]["loss"] != plain.curve[0]["loss"]
    train_set = open_split(root / "hidden" / "train")
    features = torch.cat([train_set[i].features.float() for i in range(len(train_set))])
    expected = 1.0 / features.double().pow(2).mean(0).sqrt()
    drafter, _ = load_checkpoint(tmp_path / "ck" / "step_000002")
    torch.testing.assert_close(drafter.feature_scale, expected.float(), rtol=1e-6, atol=0)
    assert torch.equal(channel_rms_scale(train_set), drafter.feature_scale)
    exported, _ = load_dflash_drafter(export_drafter(drafter, tmp_path / "export"))
    assert torch.equal(exported.feature_scale, torch.ones_like(exported.feature_scale))
    assert not torch.equal(exported.fc.weight, drafter.fc.weight)
    sample = features[:9]
    torch.testing.assert_close(exported.project_context(sample), drafter.project_context(sample), rtol=1e-6, atol=1e-6)
