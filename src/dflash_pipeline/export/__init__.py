"""The export stage: a checkpoint in the public DFlash serving format."""
