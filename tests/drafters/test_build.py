"""drafters/build.py on the tiny Llama: a new drafter copies the target's shapes, takes a mask
token no answer uses, and starts from the target's top layers when asked."""

import dataclasses

import pytest
import torch

from dflash_pipeline.drafters.build import (
    choose_mask_token,
    drafter_config_for,
    new_drafter,
)
from dflash_pipeline.foundation.config import TrainConfig
from dflash_pipeline.foundation.errors import PipelineError
from dflash_pipeline.target.folder import read_tensors


def test_the_drafter_copies_the_targets_shapes_and_the_run_sets_depth_and_block(tiny_llama_target):
    config = drafter_config_for(tiny_llama_target, TrainConfig(num_layers=2, block_size=8, architecture="dflash"), layer_ids=[1, 3],
                                mask_token_id=0, extra={"mask_token": "test"})
    assert (config.hidden_size, config.intermediate_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim) == \
        (64, 128, 4, 2, 16)
    assert (config.vocab_size, config.num_target_layers, config.target_layer_ids) == (49152, 4, (1, 3))
    assert (config.num_layers, config.block_size, config.architecture, config.extra) == (2, 8, "dflash", {"mask_token": "test"})
    dflash2 = drafter_config_for(tiny_llama_target, TrainConfig(options={"dflash2": dict(conv_group_size=16, selector_top_k=8)}),
                                 layer_ids=[1, 3], mask_token_id=0, extra={})
    assert (dflash2.architecture, dflash2.options.conv_group_size, dflash2.options.selector_top_k) == ("dflash2", 16, 8)
    with pytest.raises(PipelineError, match=r"^params.yaml: key 'train.options.dflash2.conv_group_size' must divide hidden_size 64 "
                                            r"for the target .*, got 48$"):
        drafter_config_for(tiny_llama_target, TrainConfig(options={"dflash2": dict(conv_group_size=48)}), layer_ids=[1, 3], mask_token_id=0,
                           extra={})


def test_the_mask_token_is_a_special_token_absent_from_the_data_never_an_eos(tiny_llama_target):
    token, note = choose_mask_token(tiny_llama_target, used_ids=set())
    assert token not in tiny_llama_target.eos_token_ids and "absent from the data" in note
    other, _ = choose_mask_token(tiny_llama_target, used_ids={token})
    assert other != token and other not in tiny_llama_target.eos_token_ids
    with pytest.raises(PipelineError, match="train.mask_token_id: no unused embedding row"):
        choose_mask_token(tiny_llama_target, used_ids=set(range(49152)))


def test_target_top_layers_init_copies_the_last_layers_and_the_final_norm(tiny_llama_target):
    train = TrainConfig(num_layers=1, architecture="dflash", init="target_top_layers")
    config = drafter_config_for(tiny_llama_target, train, layer_ids=[1, 3], mask_token_id=0, extra={})
    drafter, note = new_drafter(train, tiny_llama_target, config)
    assert note == "target layers [3] and final norm"
    tensors = read_tensors(tiny_llama_target.path, ["layers.3.mlp.down_proj.weight", "layers.3.self_attn.q_proj.weight", "norm.weight"])
    assert torch.equal(drafter.layers[0].mlp.down_proj.weight, tensors["layers.3.mlp.down_proj.weight"])
    assert torch.equal(drafter.layers[0].self_attn.q_proj.weight, tensors["layers.3.self_attn.q_proj.weight"])
    assert torch.equal(drafter.norm.weight, tensors["norm.weight"])
    random, how = new_drafter(dataclasses.replace(train, init="random"), tiny_llama_target, config)
    assert how == "random" and not torch.equal(random.layers[0].mlp.down_proj.weight, tensors["layers.3.mlp.down_proj.weight"])
