"""dflash-pipeline: turn a causal LM (the target) into a DFlash block-diffusion drafter.

Stages: target -> generate -> capture -> train -> evaluate -> export, driven by DVC (dvc.yaml).
Each stage's logic lives in a module of this package; `stages/*.py` are thin click commands.
"""

__version__ = "0.1.0"
