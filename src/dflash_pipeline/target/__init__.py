"""The target wing: a model folder read as files, the embedded default, and the loaded target (fingerprint, taps, frozen head)."""
