"""Helpers the tests share: the repo root, prompt and answer files, tiny GGUF targets, subprocesses
(through the lanes' guard), kill -9, and byte-level damage."""

import json
import os
import subprocess
import sys
from pathlib import Path

from support.lanes import SPAWN_MARKERS, _running, require_marker, require_spawn_marker

REPO_ROOT = Path(__file__).resolve().parents[2]

def write_tiny_gguf(path: Path, *, architecture: str = "llama", seed: int = 0, chat_template: bool = True) -> Path:
    """A 2-layer, 64-wide random `architecture` ("llama", or "qwen2" with its q/k/v biases) as an
    F32 GGUF file, with the embedded SmolLM2 GGUF's tokenizer (vocabulary, merges, special ids and,
    unless `chat_template` is false, chat template): what llama.cpp's converter writes, at the size
    of a test."""
    import gguf
    import numpy as np

    from dflash_pipeline.target.embedded import embedded_gguf_path

    hidden, ffn, heads, kv_heads, layers, vocab = 64, 128, 4, 2, 2, 49152
    writer = gguf.GGUFWriter(str(path), architecture)
    for key, value in {"block_count": layers, "context_length": 4096, "embedding_length": hidden, "feed_forward_length": ffn,
                       "attention.head_count": heads, "attention.head_count_kv": kv_heads, "vocab_size": vocab,
                       "rope.dimension_count": hidden // heads}.items():
        writer.add_uint32(f"{architecture}.{key}", value)
    writer.add_float32(f"{architecture}.rope.freq_base", 100000.0)
    writer.add_float32(f"{architecture}.attention.layer_norm_rms_epsilon", 1e-5)
    for key, field in gguf.GGUFReader(embedded_gguf_path()).fields.items():
        if key == "tokenizer.ggml.pre":  # the pre-tokenizer of the family, as a real file of it names it
            writer.add_string(key, {"llama": field.contents(), "qwen2": "qwen2"}[architecture])
        elif key.startswith("tokenizer.") and (chat_template or key != "tokenizer.chat_template"):
            writer.add_key_value(key, field.contents(), field.types[0], sub_type=field.types[1] if len(field.types) > 1 else None)
    generator = np.random.default_rng(seed)

    def tensor(name, *shape):  # [out, in] as numpy holds it; norms are ones
        values = generator.standard_normal(shape) * 0.02 if len(shape) > 1 or name.endswith(".bias") else np.ones(shape)
        writer.add_tensor(name, values.astype(np.float32))

    tensor("token_embd.weight", vocab, hidden)
    tensor("output_norm.weight", hidden)
    for i in range(layers):
        for name, shape in [("attn_norm", (hidden,)), ("ffn_norm", (hidden,)), ("attn_q", (hidden, hidden)),
                            ("attn_k", (kv_heads * hidden // heads, hidden)), ("attn_v", (kv_heads * hidden // heads, hidden)),
                            ("attn_output", (hidden, hidden)), ("ffn_gate", (ffn, hidden)), ("ffn_up", (ffn, hidden)),
                            ("ffn_down", (hidden, ffn))]:
            tensor(f"blk.{i}.{name}.weight", *shape)
        if architecture == "qwen2":
            for name, width in [("attn_q", hidden), ("attn_k", kv_heads * hidden // heads), ("attn_v", kv_heads * hidden // heads)]:
                tensor(f"blk.{i}.{name}.bias", width)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path

SAMPLE_PROMPTS = [
    {"prompt": "Write a Python function fizzbuzz(n) that returns the FizzBuzz sequence.", "category": "coding"},
    {"prompt": "What is 17 times 23?", "category": "math"},
    {"messages": [{"role": "user", "content": "Explain recursion in one paragraph."}], "category": "explain"},
    {"conversations": [{"from": "human", "value": "Suggest a name for a cat."}, {"from": "gpt", "value": "Tom"}], "category": "chat"},
    {"prompt": "Implement binary search over a sorted list.", "category": "coding", "split": "val"},
    {"prompt": "A train travels 120 km in 1.5 hours. What is its average speed?", "category": "math"},
    {"prompt": "List three uses of a paperclip.", "category": "chat"},
    {"prompt": "Implement an LRU cache class with get and put.", "category": "coding", "split": "val"},
]

def write_jsonl(path: Path, rows: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        for row in rows:
            handle.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    return path

def stage_threads() -> int | None:
    """Torch threads for a stage command a test spawns: under pytest-xdist the machine's cores divided
    by the workers (two one-thread stages on two cores beat two oversubscribed two-thread ones);
    otherwise None, torch's own default. OMP_NUM_THREADS set by the user wins."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    return max(1, (os.cpu_count() or 1) // workers) if workers > 1 else None


def stage_env() -> dict:
    """Environment for subprocesses: this interpreter's bin first, so `python` is the venv's."""
    require_marker(_running["item"], "builds a subprocess environment (stage_env)", SPAWN_MARKERS)
    env = dict(os.environ)
    threads = stage_threads()
    if threads is not None:
        env.setdefault("OMP_NUM_THREADS", str(threads))
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env["HF_HUB_OFFLINE"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    return env

def run(cmd: list[str], cwd: Path, check: bool = True, timeout: float = 600) -> subprocess.CompletedProcess:
    require_spawn_marker(cmd)
    result = subprocess.run(cmd, cwd=cwd, env=stage_env(), capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, cmd))} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
    return result

def set_params(repo: Path, **sections) -> None:
    """Update params.yaml sections in `repo` with the given keys."""
    import yaml

    params_path = repo / "params.yaml"
    params = yaml.safe_load(params_path.read_text())
    for section, values in sections.items():
        params[section].update(values)
    params_path.write_text(yaml.safe_dump(params, sort_keys=False))

def flip_a_byte(path: Path, offset: int | None = None) -> None:
    """Bit rot: one byte of `path` inverted in place (same inode, so a hard-linked DVC cache file
    flips with it; mode and mtime kept, as a disk error leaves them). Default: the middle byte, which
    lies in the tensor data of a safetensors file and in the buffers of an Arrow shard."""
    path = Path(path)
    status = path.stat()
    os.chmod(path, status.st_mode | 0o200)
    with open(path, "r+b") as handle:
        handle.seek(status.st_size // 2 if offset is None else offset)
        byte = handle.read(1)
        handle.seek(-1, os.SEEK_CUR)
        handle.write(bytes([byte[0] ^ 0xFF]))
    os.chmod(path, status.st_mode)
    os.utime(path, ns=(status.st_atime_ns, status.st_mtime_ns))

def strict_json_load(path: Path):
    """A JSON file parsed as strict readers do: a bare NaN, Infinity or -Infinity fails the test."""
    def refuse(constant):
        raise AssertionError(f"{path}: bare {constant} (not strict JSON)")

    return json.loads(Path(path).read_text(encoding="utf-8"), parse_constant=refuse)

def folder_bytes(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` by relative path: two equal results mean byte-identical trees."""
    return {str(path.relative_to(folder)): path.read_bytes() for path in sorted(Path(folder).rglob("*")) if path.is_file()}

def write_generated(folder, rows_per_split, *, seed=0, prompt_len=(20, 60), answer_len=(10, 200)):
    """A fabricated generate-stage output (random ids) so capture tests control the shapes."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch

    from dflash_pipeline.data.prompts import GENERATED_SCHEMA

    generator = torch.Generator().manual_seed(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for split, count in rows_per_split.items():
        rows = []
        for index in range(count):
            p = int(torch.randint(*prompt_len, (1,), generator=generator))
            a = int(torch.randint(*answer_len, (1,), generator=generator))
            rows.append({"prompt_id": f"{split}{index:014d}", "category": "chat", "split": split,
                         "messages": [{"role": "user", "content": "x"}],
                         "prompt_ids": torch.randint(3, 49152, (p,), generator=generator).tolist(),
                         "answer_ids": torch.randint(3, 49152, (a,), generator=generator).tolist(),
                         "finish_reason": "length"})
        pq.write_table(pa.Table.from_pylist(rows, schema=GENERATED_SCHEMA), folder / f"{split}.parquet")
    return folder

def start_then_kill_9(cmd: list[str], cwd: Path, ready, *, process_group: bool = False, timeout: float = 300) -> None:
    """Start `cmd`, wait until `ready()` is true while it still runs, then SIGKILL it (and its group)."""
    import signal
    import time

    require_spawn_marker(cmd)

    process = subprocess.Popen(cmd, cwd=cwd, env=stage_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               start_new_session=process_group)
    deadline = time.time() + timeout
    while time.time() < deadline and not ready():
        assert process.poll() is None, f"{cmd[0]} finished before it could be killed; make the run longer"
        time.sleep(0.01)
    if process_group:
        os.killpg(process.pid, signal.SIGKILL)
    else:
        process.send_signal(signal.SIGKILL)
    process.wait()
