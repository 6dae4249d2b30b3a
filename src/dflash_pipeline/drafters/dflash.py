"""DFlash (arXiv 2602.06036, z-lab/dflash): the family's plain member.

The shared core (`drafters.core`) is DFlash: a few Qwen3-style layers over the target's features
that draft a whole block in one forward, each slot's argmax its draft. It has no options, no
extra loss or scores, and serves as z-lab's `DFlashDraftModel`; every hook keeps the
`Architecture` default.
"""

from dflash_pipeline.drafters import family
from dflash_pipeline.drafters.architecture import Architecture


class DFlash(Architecture):
    name = "dflash"
    title = "DFlash"
    public_class = "DFlashDraftModel"


family.register(DFlash())
