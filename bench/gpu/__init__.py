"""The GPU check (check.sh: two calls of a lent GPU) and its parts: carry.sh takes the wheels there,
probe.py times the decoding engine, figures.py runs every stage's figures, capture_figures.py the
capture ones."""
