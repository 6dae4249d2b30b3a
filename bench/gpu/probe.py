"""The decoding engine on a lent GPU in about a minute, with no carried wheel: what bench/gpu/figures.py cannot tell apart.

    python bench/gpu/probe.py OUT.json            # CUDA: a random-weight target of SmolLM2-135M's shape, 30 layers
    python bench/gpu/probe.py --dry-run OUT.json  # CPU: 4 layers, toy batches (tests/bench/test_device_paths.py)

Kernel times do not depend on weights, so the target is built from its config in bf16 (the image's
transformers is enough). Parts, each in its own try, the JSON rewritten after each:
  attention     the SDPA backend the engine's attention call gets (`static_decoder.folded_attention`
                on CUDA: equal heads, a boolean mask), with cuDNN SDPA off (as `devices.configure_attention`
                sets it) and on, and the grouped call it replaced, with why the fused kernels refuse
  plain_*       pure replay ms of `loop.PlainStep` at batch 1 / 64 / 512 through `graphs.PhaseRunner`
                (allocation, prefill, warm-up and capture timed apart, never inside the steps), cuDNN off and on;
                the CUDA kernels of one eager step at batch 1
  phases_*      `PhaseRunner` capture of the plain step, the chain, DDTree-8 and the sampled chain with
                a DFlash2 drafter of one layer; each phase's replay ms over 100 steps, and so the speculative
                step's cost in plain steps
  compiled_b1   `torch.compile` of the plain step (inductor; the eager backend in the dry run), captured by
                the same runner, against the graphed eager step (issue #36 item 5: whether fusing norms and RoPE pays)
  flex          whether this torch's flex-attention op has an autocast rule (else bf16 autocast leaves q/k in fp32)
Warnings that a capture failed are counted (`graph_fallbacks`). Prints `PROBE {...}` last.
It is a process of its own, never imported: it builds its model at import and sets process-wide
state (the SDPA backends, `static_decoder.TRIM_ON_CPU`); bench/gpu/check.sh runs it, and its
dry run is tested through `check.sh dry-run`.
"""

import collections
import json
import signal
import sys
import time
import traceback
import warnings
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT / "src"))  # runs from a plain checkout, where the package is not installed

import torch  # noqa: E402

DRY_RUN = "--dry-run" in sys.argv
ARGS = [a for a in sys.argv[1:] if a != "--dry-run"]
OUT = Path(ARGS[0]) if ARGS else None
CUDA = torch.cuda.is_available() and not DRY_RUN
DEVICE = torch.device("cuda" if CUDA else "cpu")
FIGURES: dict = {"device": torch.cuda.get_device_name() if CUDA else "cpu (dry run)", "torch": torch.__version__,
                 "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version() if CUDA else None, "graph_fallbacks": 0}
STARTED = time.perf_counter()


class PartTimeout(Exception):
    pass


def _alarm(signum, frame):
    raise PartTimeout("ran out of its time limit")


def part(name, function, limit_s=60):
    """One part under its own time limit; a failure is recorded as a figure and the next part runs."""
    began = time.perf_counter()
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(limit_s)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            FIGURES[name] = function()
        FIGURES["graph_fallbacks"] += sum("CUDA graph capture" in str(w.message) for w in caught)
    except Exception as error:  # noqa: BLE001 - a part that fails is a figure too
        FIGURES[name] = {"error": f"{type(error).__name__}: {error}"[:500]}
        traceback.print_exc()
    finally:
        signal.alarm(0)
    print(f"[probe {time.perf_counter() - began:5.1f}s] {name}: {json.dumps(FIGURES[name])[:600]}", flush=True)
    save()


def save():
    FIGURES["seconds"] = round(time.perf_counter() - STARTED, 1)
    if OUT:
        OUT.parent.mkdir(parents=True, exist_ok=True)
        OUT.write_text(json.dumps(FIGURES, indent=1) + "\n")


def sync():
    if CUDA:
        torch.cuda.synchronize()


import transformers  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from dflash_pipeline.decoding.graphs import PhaseRunner  # noqa: E402
from dflash_pipeline.decoding.loop import PhaseClock, PlainStep  # noqa: E402
from dflash_pipeline.speculation.modes import DecodingMode  # noqa: E402
from dflash_pipeline.speculation.sampling import Sampling  # noqa: E402
from dflash_pipeline.decoding import static_decoder  # noqa: E402
from dflash_pipeline.decoding.static_decoder import use_static_sdpa  # noqa: E402
from dflash_pipeline.decoding.static_speculation import SpeculativeStep  # noqa: E402
from dflash_pipeline.foundation.devices import compute_dtype, configure_attention  # noqa: E402
from dflash_pipeline.drafters.core import DFlashDrafter
from dflash_pipeline.drafters.config import DrafterConfig
from dflash_pipeline.target.load import TargetHead  # noqa: E402

FIGURES["transformers"] = transformers.__version__
static_decoder.TRIM_ON_CPU = False  # the dry run steps over the whole static length, as a GPU does (one shape, one compile)
LAYERS = 30 if CUDA else 4
TAPS = (1, 8, 14, 20, 27) if CUDA else (0, 1, 2, 3)
DTYPE = compute_dtype(DEVICE)
HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64
BATCHES = ((1, 150), (64, 100), (512, 40)) if CUDA else ((1, 6), (4, 4))
config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                     num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
                     tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2, attn_implementation="sdpa")
torch.manual_seed(0)
with torch.device(DEVICE):
    model = LlamaForCausalLM(config)
model = model.to(DTYPE).eval().requires_grad_(False)
use_static_sdpa(model)  # as load_target
configure_attention(DEVICE)  # as load_target: cuDNN SDPA off on CUDA


def sdpa_choice(batch: int, length: int, *, folded: bool) -> dict:
    """The backend SDPA picks for the engine's attention call at one decode step (T = 1), and on
    CUDA why each fused kernel refuses it."""
    from torch.nn.attention import SDPBackend

    names = {int(value): name for name, value in SDPBackend.__members__.items()}
    heads, rows = (KV_HEADS, HEADS // KV_HEADS) if folded else (HEADS, 1)
    q = torch.zeros(batch, heads, rows, HEAD_DIM, device=DEVICE, dtype=DTYPE)
    k = torch.zeros(batch, KV_HEADS, length, HEAD_DIM, device=DEVICE, dtype=DTYPE)
    mask = torch.ones(batch, 1, rows, length, device=DEVICE, dtype=torch.bool)
    gqa = not folded
    out = {"chosen": names.get(int(torch._fused_sdp_choice(q, k, k, mask, 0.0, False, scale=None, enable_gqa=gqa)), "?")}
    if CUDA:
        import torch.backends.cuda as cuda_backends

        params = cuda_backends.SDPAParams(q, k, k, mask, 0.0, False, gqa)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for name in ("flash", "efficient", "cudnn"):
                check = getattr(cuda_backends, f"can_use_{name}_attention", None)
                out[name] = None if check is None else bool(check(params, True))
        out["why_not"] = sorted({str(w.message).replace("\n", " ")[:150] for w in caught})[:6]
    return out


def attention_backends() -> dict:
    figures = {}
    for cudnn in (False, True):
        if CUDA:
            torch.backends.cuda.enable_cudnn_sdp(cudnn)
        for batch in (1, BATCHES[-1][0]):
            for folded in (True, False):
                figures[f"{'cudnn_on' if cudnn else 'shipped'}_b{batch}_{'folded' if folded else 'grouped'}"] = sdpa_choice(
                    batch, 400, folded=folded)
    configure_attention(DEVICE)
    return figures


def cuda_kernels(function) -> dict | None:
    """Kernel count and the most frequent kernel names of one call (CUDA only)."""
    if not CUDA:
        return None
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        function()
        sync()
    names = collections.Counter(event.name for event in prof.events() if event.device_type == DeviceType.CUDA)
    return {"kernels": sum(names.values()), "top": [[name[:70], count] for name, count in names.most_common(8)]}


def replay_ms(phases, steps: int) -> float:
    """ms per step of `steps` back-to-back replays (one warm replay first), nothing else timed."""
    for phase in phases:
        phase()
    sync()
    began = time.perf_counter()
    for _ in range(steps):
        for phase in phases:
            phase()
    sync()
    return 1000 * (time.perf_counter() - began) / steps


def plain_step(batch: int, steps: int, *, compiled: bool = False) -> dict:
    """PlainStep at `batch` rows of 96-token prompts: setup timed apart, then pure replays."""
    began = time.perf_counter()
    step = PlainStep(model, batch=batch, capacity=96, max_new_tokens=steps + 8, eos_ids={-1})
    ids = torch.randint(3, 49152, (batch, 96), generator=torch.Generator().manual_seed(batch)).to(DEVICE)
    step.prefill_rows(ids, torch.ones_like(ids, dtype=torch.bool))
    sync()
    setup_s = time.perf_counter() - began
    kernels = cuda_kernels(step.step) if batch == 1 and not compiled else None
    # the dry run compiles with the eager backend: the plumbing, without minutes of C++ compiles on a CPU
    phases = (torch.compile(step.step, dynamic=False, backend="inductor" if CUDA else "eager"),) if compiled else step.phases()
    began = time.perf_counter()
    runner = PhaseRunner(phases, state=step.graph_state(), device=step.device)
    sync()
    capture_s = time.perf_counter() - began
    ms = replay_ms(runner.phases, steps)
    return {"ms_per_step": round(ms, 3), "tokens_per_s": round(batch * 1000 / ms, 1), "graphed": runner.graphed,
            "setup_s": round(setup_s, 3), "capture_s": round(capture_s, 3), "length": step.target.length, "eager_step": kernels}


def plain_all(cudnn: bool) -> dict:
    if CUDA:
        torch.backends.cuda.enable_cudnn_sdp(cudnn)
    try:
        out = {}
        for batch, steps in BATCHES:
            try:
                out[f"b{batch}"] = plain_step(batch, steps)
            except PartTimeout:
                raise
            except Exception as error:  # noqa: BLE001 - one batch size failing loses one figure
                out[f"b{batch}"] = {"error": f"{type(error).__name__}: {error}"[:300]}
        return out
    finally:
        configure_attention(DEVICE)
        if CUDA:
            torch.cuda.empty_cache()


head = TargetHead(model.get_input_embeddings().weight.detach(), model.get_output_embeddings().weight.detach())
drafter = DFlashDrafter(DrafterConfig(hidden_size=576, intermediate_size=1536, num_layers=1, num_attention_heads=HEADS,
                                      num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, vocab_size=49152, block_size=16, target_layer_ids=TAPS,
                                      num_target_layers=LAYERS, mask_token_id=0, architecture="dflash2")).to(DEVICE).eval()
drafter.set_draft_vocab(torch.arange(3, 10003))  # a ~10K-token draft vocabulary, as the default run's


TREE8 = DecodingMode.tree(8)
# The step kinds timed: the plain step (no mode), then each speculative mode, the chain also sampled.
STEP_KINDS = {"plain": None, "chain": DecodingMode.chain(), TREE8.name: TREE8, "sampled": DecodingMode.chain()}


def phases(kind: str, steps: int) -> dict:
    """One step kind captured by PhaseRunner (as `loop.cached_step` does), each phase timed by events."""
    sampling = Sampling(1.0, rule="ratio", seed=0) if kind == "sampled" else None
    mode = STEP_KINDS[kind]
    began = time.perf_counter()
    if mode is None:
        step = PlainStep(model, capacity=256, max_new_tokens=256, eos_ids={-1})
    else:
        step = SpeculativeStep(model, drafter, head, capacity=256, max_new_tokens=256, eos_ids={-1}, mode=mode, sampling=sampling)
    step.generator = torch.Generator(device=DEVICE).manual_seed(0) if sampling is not None else None
    step.prefill(list(range(100, 196)), step.generator, 256)
    runner = PhaseRunner(step.phases(), state=step.graph_state(), device=step.device)
    sync()
    setup_s = time.perf_counter() - began
    calls = runner.phases
    clock = PhaseClock(step.device, len(calls))
    for number in range(steps + 3):
        if number == 3:  # the first three steps warm up
            sync()
            clock = PhaseClock(step.device, len(calls))
        if step.sampling is not None:
            step.uniforms.uniform_(generator=step.generator)
        clock.mark()
        for call in calls:
            call()
            clock.mark()
    sync()
    ms = [round(1000 * seconds / steps, 3) for seconds in clock.totals()]
    ended, count = step.read_state()
    return {"graphed": runner.graphed, "setup_s": round(setup_s, 3), "phase_ms": ms, "step_ms": round(sum(ms), 3), "tokens": count}


def compiled_vs_graphed() -> dict:
    graphed = plain_step(1, BATCHES[0][1])
    compiled = plain_step(1, BATCHES[0][1], compiled=True)
    return {"graphed_eager_ms": graphed["ms_per_step"], "compiled_ms": compiled["ms_per_step"], "compiled_graphed": compiled["graphed"],
            "compile_and_capture_s": compiled["capture_s"], "eager_over_compiled": round(graphed["ms_per_step"] / compiled["ms_per_step"], 3)}


def flex_autocast() -> dict:
    """Whether flex attention's operator has an autocast kernel registered (torch >= 2.12 has one
    for CPU and CUDA): without it, bf16 autocast hands flex whatever dtypes q, k and v come in."""
    from torch._higher_order_ops.flex_attention import flex_attention

    keys = [str(key).split(".")[-1] for key in getattr(flex_attention, "py_kernels", {})]
    return {"autocast_rule": any("Autocast" in key for key in keys), "kernels": keys}


def main() -> None:
    scale = 1 if CUDA else 0
    part("attention", attention_backends, 30)
    part("plain_shipped", lambda: plain_all(False), 60)
    part("plain_cudnn_on", lambda: plain_all(True), 60)
    for kind in STEP_KINDS:
        part(f"phases_{kind}", lambda kind=kind: phases(kind, 100 if CUDA else 3), 40)
    done = {k: FIGURES[f"phases_{k}"]["step_ms"] for k in STEP_KINDS if "step_ms" in FIGURES[f"phases_{k}"]}
    if "plain" in done:
        FIGURES["spec_cost_in_plain_steps"] = {k: round(ms / done["plain"], 3) for k, ms in done.items() if k != "plain"}
    part("flex", flex_autocast, 10)
    part("compiled_b1", compiled_vs_graphed, 120 * scale + 60)
    if CUDA:
        FIGURES["max_memory_gb"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    save()
    print("PROBE " + json.dumps(FIGURES, separators=(",", ":"))[:6000], flush=True)


if __name__ == "__main__":
    main()
