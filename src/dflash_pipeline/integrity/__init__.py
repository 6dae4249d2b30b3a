"""Checking a run's outputs and repairing damage (`dflash-pipeline verify --repair`)."""
