"""dflash-pipeline: turn a causal LM (the target) into a DFlash block-diffusion drafter.

Stages: target -> generate -> capture -> train -> evaluate -> export, driven by DVC (dvc.yaml).
`stages/*.py` are thin click commands; the logic lives in this package's wings, which are layers,
ground up (a wing imports only itself and the wings listed before it; the stage wings never
import each other; tests/test_layering.py keeps it so):

    foundation   errors, atomic files, the safetensors reader, params, devices, torchrun ranks, statistics, progress
    target       the target model: a folder, the embedded GGUF, loading (whole or split) and fingerprinting
    data         prompt sets, answers, Arrow shards, training blocks and their attention masks
    speculation  sampling, draft trees, decoding modes: the math of speculation, no model
    drafters     the drafter family, checkpoints, the serving format, loading a drafter folder
    decoding     the one decoding engine: static caches, graphed steps, plain and speculative decoding
    measure      what train and evaluate share: scoring, typed records, end-to-end runs, verify planning
    generate, capture, train, evaluate, export   the stages; integrity: checking and repairing a run
    cli          the console command `dflash-pipeline`
"""

__version__ = "0.1.0"
