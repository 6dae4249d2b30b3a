"""References the package is tested against: the host decoding loops, the heap tree builder, the
host drafter cache and the one-block scorer (issue #36 moved them out of `src/`).

Each is the obvious, step-by-step version of what the package now does on the device or in batch;
tests compare the two token for token (tests/decoding/test_static_speculation.py, test_device_tree.py,
test_evaluate.py); bench/evaluate.py and the GPU check (bench/gpu/figures.py) time the package
against them. Nothing in `src/` imports them. Tests import them as `oracles.<module>` (tests/ is on
pytest's path); the benches put tests/ on `sys.path` themselves.
"""
