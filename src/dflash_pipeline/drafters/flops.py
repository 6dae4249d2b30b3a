"""How much a drafter costs to train: its parameter count and the model FLOPs of training steps
(the MFU `bench/gpu/figures.py` and `bench/train.py` report against the chip's dense bf16 peak)."""

from torch import nn

from dflash_pipeline.drafters.core import DFlashDrafter


def count_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def training_flops(drafter: DFlashDrafter, *, trained_positions: int, context_tokens: int, vocab_rows: int) -> float:
    """Model FLOPs of training steps that drafted `trained_positions` slots over `context_tokens`
    context positions: 6 per weight per token it touches (forward + backward), where block tokens
    (one anchor per B-1 trained slots) pass every layer and context tokens pass fc and each layer's
    k/v projections; plus the frozen head's two matmuls per slot (logits, and the hidden state's
    gradient) over `vocab_rows` rows. Attention scores are left out (small at these lengths)."""
    block_tokens = trained_positions * drafter.config.block_size / (drafter.config.block_size - 1)
    context_weights = drafter.fc.weight.numel() + sum(layer.self_attn.k_proj.weight.numel() + layer.self_attn.v_proj.weight.numel()
                                                      for layer in drafter.layers)
    return (6 * count_parameters(drafter.layers) * block_tokens + 6 * context_weights * context_tokens
            + 2 * 2 * trained_positions * drafter.config.hidden_size * vocab_rows)
