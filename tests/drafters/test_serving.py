"""drafters/serving.py without weights: the serving format's tensor names of each architecture
(export and load with weights: tests/export/test_export.py)."""

from dflash_pipeline.drafters.serving import public_weight_names


def test_the_public_weight_names_of_each_architecture():
    dflash = public_weight_names(2)
    assert dflash[:3] == ["fc.weight", "hidden_norm.weight", "norm.weight"] and len(dflash) == 3 + 2 * 11
    dflash2 = public_weight_names(2, "dflash2")
    assert set(dflash) < set(dflash2) and "candidate_selector.predecessor_codebook" in dflash2
    assert "layers.1.mlp_conv.base_kernel" in dflash2 and len(dflash2) == len(dflash) + 3 + 2 * 4
