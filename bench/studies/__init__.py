"""The studies behind the defaults and the docs' cost tables: each writes a result into bench/results/
that tools/build_results.py renders into docs/results.md."""
