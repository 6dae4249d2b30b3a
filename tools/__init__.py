"""The project's own tools, run from the checkout: tools/build_results.py writes docs/results.md,
tools/sync_dvc_deps.py rewrites dvc.yaml's `src/` deps, tools/import_graph.py reads the import graph
both of those and tests/test_layering.py use."""
