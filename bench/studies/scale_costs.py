"""What each stage costs for an 8B and a 70B target at 100K and 800K prompts: GPU-hours and disk.

    python bench/studies/scale_costs.py             # writes bench/results/scale_costs.json (docs/results.md renders it)
    python bench/studies/scale_costs.py --dry-run   # prints the rows, writes only --out if given (tests/bench/test_dry_runs.py)

No GPU figure of these targets has been measured with this pipeline, so this is a model, and every
input is stated below with why it was chosen: the targets' sizes (their published configs), the
H100's datasheet peaks, the efficiency assumed for each kind of work, the data's shape. A stage's
rate is the smaller of its compute (or memory) bound and, for capture, the disk it writes. Replace
an assumption by a measurement as one comes in (docs/scale.md, "What the next GPU run must check");
the rates measured on a CPU are in bench/results/scale_cpu.json.
"""

import argparse
import json
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "results" / "scale_costs.json"

# The two targets: published configs (Qwen3-8B; Llama-3.1-70B). Parameters in billions.
TARGETS = {
    "8B (Qwen3-8B)": {"params_b": 8.19, "layers": 36, "hidden": 4096, "vocab": 151936, "layer_params_b": 0.193,
                      "devices_per_replica": 1},
    # 141 GB of bf16 weights: two 80 GB GPUs per replica (target.device_map: auto, launch.devices_per_replica: 2)
    "70B (Llama-3.1-70B)": {"params_b": 70.6, "layers": 80, "hidden": 8192, "vocab": 128256, "layer_params_b": 0.856,
                            "devices_per_replica": 2},
}
PROMPTS = (100_000, 800_000)

ASSUMED = {
    "gpu": "H100 SXM 80 GB",
    "bf16_peak_tflops": 989.0,  # dense, datasheet
    "hbm_tb_per_s": 3.35,  # datasheet
    "gpus_per_node": 8,
    "node_disk_write_gb_per_s": 4.0,  # a node's local NVMe array, sustained (assumed)
    # generate: a decode step reads every weight once; the step runs at this share of HBM bandwidth
    # (KV reads, small kernels, host work). Our static engine at batch 64 (generate.batch_size).
    "decode_bandwidth_efficiency": 0.5,
    "decode_batch": 64,
    # capture: one prefill forward per sequence, compute-bound, at this model FLOPs utilisation.
    "prefill_mfu": 0.4,
    # train: the issue-#37 goal for the compiled flex step, not yet measured on a GPU.
    "train_mfu": 0.2,
    "prompt_tokens": 200,  # per sample (assumed; a chat prompt set)
    "answer_tokens": 800,  # per sample (assumed; the reference recipe caps sequences at 3072)
    "capture_taps": 5,  # capture.num_layers
    "capture_top_k": 32,  # capture.target_top_k: 8 bytes per token per k
    "block_size": 16,  # as released
    "anchors_per_sample": 512,  # the reference recipe (DFLASH.md)
    "epochs": 6,  # the reference recipe
    "drafter_layers": 1,
}


def costs(target: dict, prompts: int) -> dict:
    a = ASSUMED
    replica = target["devices_per_replica"]
    weight_bytes = target["params_b"] * 1e9 * 2  # bf16
    tokens = prompts * (a["prompt_tokens"] + a["answer_tokens"])
    answers = prompts * a["answer_tokens"]

    # generate: a pipeline split over `replica` GPUs runs its layers one after the other (no
    # parallelism inside a replica), so a step reads all weights at one GPU's bandwidth.
    step_s = weight_bytes / (a["hbm_tb_per_s"] * 1e12 * a["decode_bandwidth_efficiency"])
    generate_tokens_per_s_per_replica = a["decode_batch"] / step_s
    generate_gpu_h = answers / generate_tokens_per_s_per_replica * replica / 3600

    # capture: compute bound per replica, disk bound per node; the smaller wins.
    flops_per_token = 2 * target["params_b"] * 1e9
    forward_tokens_per_s_per_replica = a["prefill_mfu"] * a["bf16_peak_tflops"] * 1e12 / flops_per_token
    bytes_per_token = a["capture_taps"] * target["hidden"] * 2 + a["capture_top_k"] * 8
    replicas_per_node = a["gpus_per_node"] // replica
    node_forward = forward_tokens_per_s_per_replica * replicas_per_node
    node_disk = a["node_disk_write_gb_per_s"] * 1e9 / bytes_per_token
    node_capture = min(node_forward, node_disk)
    capture_gpu_h = tokens / node_capture * a["gpus_per_node"] / 3600

    # train: per sample per epoch, the block tokens through the drafter's layers and the LM head
    # (forward + backward = 3x the forward's 2 FLOPs per weight), the context through the fc.
    block_tokens = a["anchors_per_sample"] * a["block_size"]
    head = 6 * target["hidden"] * target["vocab"] * block_tokens
    layers = 6 * target["layer_params_b"] * 1e9 * a["drafter_layers"] * block_tokens
    fc = 6 * a["capture_taps"] * target["hidden"] * target["hidden"] * (a["prompt_tokens"] + a["answer_tokens"])
    train_flops = (head + layers + fc) * prompts * a["epochs"]
    train_gpu_h = train_flops / (a["train_mfu"] * a["bf16_peak_tflops"] * 1e12) / 3600

    return {
        "tokens": tokens,
        "generate_gpu_hours": round(generate_gpu_h, 1),
        "generate_tokens_per_s_per_gpu": round(generate_tokens_per_s_per_replica / replica),
        "capture_gpu_hours": round(capture_gpu_h, 1),
        "capture_bound": "disk" if node_disk < node_forward else "forward",
        "capture_tokens_per_s_per_node": round(node_capture),
        "shard_bytes_per_token": bytes_per_token,
        "shards_tb": round(tokens * bytes_per_token / 1e12, 1),
        "shards_tb_fp8": round(tokens * (bytes_per_token - a["capture_top_k"] * 8) / 2e12 + tokens * a["capture_top_k"] * 8 / 1e12, 1),
        "train_gpu_hours": round(train_gpu_h, 1),
        "total_gpu_hours": round(generate_gpu_h + capture_gpu_h + train_gpu_h, 1),
        "node_hours_8_gpus": round((generate_gpu_h + capture_gpu_h + train_gpu_h) / a["gpus_per_node"], 1),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help=f"where the rows go (default: {OUT.relative_to(OUT.parents[2])})")
    parser.add_argument("--dry-run", action="store_true", help="the same arithmetic; the committed result is never written")
    args = parser.parse_args(argv)
    out = args.out or (None if args.dry_run else OUT)
    rows = [{"target": name, "prompts": prompts, **costs(target, prompts)} for name, target in TARGETS.items() for prompts in PROMPTS]
    for row in rows:
        print(row)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"assumed": ASSUMED, "targets": TARGETS, "rows": rows}, indent=2) + "\n")
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
