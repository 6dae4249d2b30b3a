"""Drafters for tests: random weights where the tests need them."""

import torch

from dflash_pipeline.drafters.core import DFlashDrafter
from dflash_pipeline.drafters.config import DrafterConfig


def randomize(drafter: DFlashDrafter, seed: int = 0) -> DFlashDrafter:
    """Every DFlash2 weight away from its identity / zero start, so a misplaced tap or a tap that
    crosses a block boundary changes the output visibly."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, weight in drafter.named_parameters():
            if "conv" in name or "candidate_selector" in name:
                weight.copy_(torch.randn(weight.shape, generator=generator) * (0.3 if "kernel_projection" in name else 1.0))
            elif name.endswith("norm.weight"):
                weight.uniform_(0.5, 1.5, generator=generator)
    return drafter.eval()


def random_drafter(config: DrafterConfig, seed: int = 0) -> DFlashDrafter:
    """Unit-variance projections and uneven norms: attention is peaked and every norm weight matters,
    so a misplaced norm, a shifted position or a wrong RoPE changes the logits visibly."""
    torch.manual_seed(seed)
    drafter = DFlashDrafter(config).eval()
    with torch.no_grad():
        for name, weight in drafter.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                weight.uniform_(1.0, 3.0)
            elif weight.dim() == 1:
                weight.uniform_(0.5, 1.5)
            else:
                weight.normal_(0.0, weight.shape[1] ** -0.5)
    return drafter
