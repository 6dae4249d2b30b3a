"""The benchmarks (bench/README.md): what a user runs at the top, the GPU check in gpu/, the studies
behind the defaults in studies/, their toy data in toy.py and the results in results/.

Run them by path (`python bench/generate.py`); each puts the checkout on sys.path, so `bench.*` and
`dflash_pipeline` import from a plain checkout too."""
