"""The drafter family: the shared core, one module per architecture, the registry, serving format and checkpoints.

Importing the wing imports every member, so the registry (`family`) knows them all: adding an
architecture is one module here and one name on the line below.
"""

from dflash_pipeline.drafters import dflash, dflash2  # noqa: F401  (the members register themselves)
