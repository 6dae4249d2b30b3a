"""Shared fixtures: tiny random-weight targets with the real SmolLM2 tokenizer, prompt files, a repo;
and the test lanes' guard.

The tiny targets have the real 49,152-token vocabulary and chat template (so token ids, padding and
EOS handling are the real ones) but only a few narrow layers, so a stage runs in seconds on CPU.

Test lanes (markers in pyproject.toml): `slow` (the real target, or more than ~10 s), `dvc` (runs
dvc commands), `subprocess` (spawns stage scripts, torchrun, the console script, servers).
`make test-fast` deselects all three; `make test` (CI) runs everything. A test that runs dvc or
spawns a process through `run`, `start_then_kill_9` or `stage_env`, or builds `pipeline_repo` /
`tiny_pipeline`, without its marker fails here, naming the marker.
"""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


# ----------------------------------------------------------------------------- test lanes
# `make test-fast` deselects the markers `slow`, `dvc` and `subprocess` (pyproject.toml). A test that
# drives DVC or spawns a process through the helpers below without its marker would slip into the
# fast lane, so it fails, naming the marker. The markers a test may carry for each:
LANE_FIXTURES = {"pipeline_repo": ("dvc",), "tiny_pipeline": ("dvc",)}
DVC_MARKERS = ("dvc",)
SPAWN_MARKERS = ("subprocess", "dvc")  # a dvc test spawns git, dvc and the stage scripts by nature
_running: dict = {"item": None}


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _running["item"] = item
    try:
        return (yield)
    finally:
        _running["item"] = None


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Before any fixture is built: a test using a DVC fixture must carry the dvc marker."""
    for fixture, markers in LANE_FIXTURES.items():
        if fixture in item.fixturenames:
            require_marker(item, f"uses the fixture {fixture}", markers)


def require_marker(item, what: str, markers: tuple[str, ...]) -> None:
    if item is not None and not any(item.get_closest_marker(name) for name in markers):
        pytest.fail(f"{item.nodeid} {what}: mark it @pytest.mark.{markers[0]} (test lanes, tests/conftest.py)", pytrace=False)


def require_spawn_marker(cmd) -> None:
    """The running test may spawn `cmd`: a `dvc` command needs the dvc marker, any other subprocess or dvc."""
    program = Path(str(cmd[0])).name if cmd else ""
    is_dvc = program == "dvc" or [str(part) for part in cmd[1:3]] == ["-m", "dvc"]
    require_marker(_running["item"], "runs dvc" if is_dvc else f"spawns {program or 'a process'}",
                   DVC_MARKERS if is_dvc else SPAWN_MARKERS)


@pytest.fixture(scope="session")
def smollm2_gguf_tokenizer():
    """The real SmolLM2 tokenizer (vocabulary and chat template), loaded from the embedded GGUF."""
    from transformers import AutoTokenizer

    from dflash_pipeline.target.embedded import embedded_gguf_path

    gguf = embedded_gguf_path()
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


@pytest.fixture(scope="session")
def smollm2_tokenizer_dir(tmp_path_factory, smollm2_gguf_tokenizer) -> Path:
    """The real SmolLM2 tokenizer, read from the embedded GGUF and saved as transformers saves it."""
    folder = tmp_path_factory.mktemp("smollm2-tokenizer")
    smollm2_gguf_tokenizer.save_pretrained(folder)
    return folder


def _save_tiny(folder: Path, config, tokenizer_dir: Path) -> Path:
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder)
    for file in tokenizer_dir.iterdir():
        shutil.copy(file, folder / file.name)
    return folder


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, smollm2_tokenizer_dir) -> Path:
    """A 4-layer, 64-wide random Llama with the SmolLM2 tokenizer (the default target's family)."""
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2,
        architectures=["LlamaForCausalLM"],
    )
    return _save_tiny(tmp_path_factory.mktemp("tiny-llama"), config, smollm2_tokenizer_dir)


@pytest.fixture(scope="session")
def tiny_llama_target(tiny_llama_dir, tmp_path_factory):
    """The tiny Llama's TargetInfo, as the `target` stage fingerprints it (its folder referenced, not copied)."""
    from dflash_pipeline.foundation.config import TargetConfig
    from dflash_pipeline.target.load import TargetInfo, prepare_target

    out = tmp_path_factory.mktemp("tiny-llama-target")
    prepare_target(TargetConfig(model=str(tiny_llama_dir)), out_dir=out)
    return TargetInfo.from_json(out / "target.json")


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory, smollm2_tokenizer_dir) -> Path:
    """A 4-layer random Qwen3 (q/k norms, untied head) with the SmolLM2 tokenizer."""
    from transformers import Qwen3Config

    config = Qwen3Config(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=2,
        architectures=["Qwen3ForCausalLM"],
    )
    return _save_tiny(tmp_path_factory.mktemp("tiny-qwen3"), config, smollm2_tokenizer_dir)


@pytest.fixture(scope="session")
def tiny_sliding_dir(tmp_path_factory, smollm2_tokenizer_dir) -> Path:
    """A 4-layer random Qwen2 whose last two layers attend through a sliding window of 512 (Gemma3-
    style layer types: full, full, sliding, sliding), with the SmolLM2 tokenizer."""
    from transformers import Qwen2Config

    config = Qwen2Config(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
        use_sliding_window=True, sliding_window=512, max_window_layers=2,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2,
        architectures=["Qwen2ForCausalLM"],
    )
    return _save_tiny(tmp_path_factory.mktemp("tiny-sliding"), config, smollm2_tokenizer_dir)


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


@pytest.fixture
def sample_prompts(tmp_path) -> Path:
    return write_jsonl(tmp_path / "prompts.jsonl", SAMPLE_PROMPTS)


def stage_env() -> dict:
    """Environment for subprocesses: this interpreter's bin first, so `python` is the venv's."""
    require_marker(_running["item"], "builds a subprocess environment (stage_env)", SPAWN_MARKERS)
    env = dict(os.environ)
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


@pytest.fixture
def pipeline_repo(tmp_path) -> Path:
    """A fresh git + DVC repo holding this project's pipeline files (not its data or venv)."""
    repo = tmp_path / "repo"
    repo.mkdir()
    for name in ("dvc.yaml", "params.yaml", ".gitignore", ".dvcignore"):
        shutil.copy(REPO_ROOT / name, repo / name)
    for folder in ("stages", "src", ".dvc"):
        shutil.copytree(REPO_ROOT / folder, repo / folder, ignore=shutil.ignore_patterns("__pycache__", "tmp", "cache", "*.egg-info"))
    (repo / "data" / "prompts").mkdir(parents=True)
    run(["git", "init", "-q", "-b", "main"], repo)
    run(["git", "config", "user.email", "test@example.com"], repo)
    run(["git", "config", "user.name", "test"], repo)
    return repo


def set_params(repo: Path, **sections) -> None:
    """Update params.yaml sections in `repo` with the given keys."""
    import yaml

    params_path = repo / "params.yaml"
    params = yaml.safe_load(params_path.read_text())
    for section, values in sections.items():
        params[section].update(values)
    params_path.write_text(yaml.safe_dump(params, sort_keys=False))


@pytest.fixture
def tiny_pipeline(pipeline_repo, tiny_llama_dir):
    """`pipeline_repo` on the tiny Llama with params small enough for a whole `dvc repro` in seconds."""
    prompts = [{"prompt": f"Give me fact number {i} about the number {i * 7}.", "category": "chat"} for i in range(30)]
    write_jsonl(pipeline_repo / "data" / "prompts" / "small.jsonl", SAMPLE_PROMPTS + prompts)
    set_params(
        pipeline_repo,
        target={"model": str(tiny_llama_dir), "watch": str(tiny_llama_dir)},
        generate={"prompts": "data/prompts/small.jsonl", "max_prompts": 8, "max_new_tokens": 8, "batch_size": 4},
        capture={"layer_ids": [1, 3], "shard_mb": 1},
        # The tiny random target answers every prompt with token 198 repeated: a draft vocabulary of
        # that one token makes every loss exactly 0, so these DVC tests train over the full vocabulary.
        train={"max_steps": 4, "eval_every": 2, "save_every": 2, "eval_blocks": 16, "tokens_per_step": 256, "train_vocab": "full"},
        evaluate={"anchors_per_sequence": 4, "num_prompts": 1, "max_new_tokens": 6},
    )
    return pipeline_repo


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


@pytest.fixture(scope="session")
def tiny_run(tiny_llama_dir, tmp_path_factory):
    """Target fingerprint + captured shards of fabricated sequences on the tiny Llama."""
    from dflash_pipeline.capture.run import run_capture
    from dflash_pipeline.foundation.config import CaptureConfig, TargetConfig
    from dflash_pipeline.target.load import TargetInfo, prepare_target

    root = tmp_path_factory.mktemp("train")
    prepare_target(TargetConfig(model=str(tiny_llama_dir)), out_dir=root / "target")
    target = TargetInfo.from_json(root / "target" / "target.json")
    generated = write_generated(root / "generated", {"train": 24, "val": 6}, answer_len=(10, 60))
    run_capture(CaptureConfig(layer_ids=[1, 3]), target=target, generated_dir=generated, out_dir=root / "hidden", device="cpu")
    return target, root


@pytest.fixture(scope="session")
def zlab_draft_model_class():
    """z-lab's DFlashDraftModel: the `dflash` package from PyPI (dflash==0.1.0, which `make install` puts in
    the venv), or, when DFLASH_ZLAB_PATH is set, the z-lab/dflash checkout it names (put first on sys.path).

    Without either the test skips, except under CI=true, where it fails: CI must run the comparison.
    """
    path = os.environ.get("DFLASH_ZLAB_PATH")
    if path:
        sys.path.insert(0, os.path.abspath(path))
    if importlib.util.find_spec("dflash") is None:
        message = ("z-lab's reference is not installed: `pip install --no-deps dflash==0.1.0` (make install does), "
                   "or set DFLASH_ZLAB_PATH to a z-lab/dflash checkout")
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(message)
        pytest.skip(message)
    from dflash.model import DFlashDraftModel  # an import error here (e.g. a transformers break) fails the test

    if path and not os.path.abspath(sys.modules["dflash.model"].__file__).startswith(os.path.abspath(path) + os.sep):
        pytest.fail(f"DFLASH_ZLAB_PATH={path} has no dflash/model.py; imported {sys.modules['dflash.model'].__file__}")
    return DFlashDraftModel


@pytest.fixture(scope="session")
def tiny_target(tiny_llama_dir):
    """The tiny Llama with taps on layers 1 and 3, its head, an untrained block-5 drafter for it and a prompt."""
    import torch
    from transformers import AutoModelForCausalLM

    from dflash_pipeline.drafters.core import DFlashDrafter, DrafterConfig
    from dflash_pipeline.target.load import LayerTap, TargetHead

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    tap = LayerTap(model, [1, 3])
    head = TargetHead(model.get_input_embeddings().weight.detach(), model.get_output_embeddings().weight.detach())
    torch.manual_seed(0)
    drafter = DFlashDrafter(DrafterConfig(hidden_size=64, intermediate_size=128, num_layers=1, num_attention_heads=4,
                                          num_key_value_heads=2, head_dim=16, vocab_size=49152, block_size=5,
                                          target_layer_ids=(1, 3), num_target_layers=4, mask_token_id=0)).eval()
    prompt = [1, 504, 3112, 314, 253, 1345, 30, 2]
    return model, tap, head, drafter, prompt


@pytest.fixture
def gpu_shaped_steps(monkeypatch):
    """Static decode steps built as on a GPU (attention over the whole cache length, no read of the
    written length), so a CPU test can check the GPU's contract: nothing read, one graph."""
    from dflash_pipeline.decoding import static_decoder

    monkeypatch.setattr(static_decoder, "TRIM_ON_CPU", False)
