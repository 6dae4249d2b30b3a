"""The drafter family: the shared core, one module per architecture, the registry, serving format and checkpoints."""
