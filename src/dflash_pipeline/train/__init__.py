"""The train wing: the training objective and the `train` stage's loop."""
