"""Shared fixtures: tiny random-weight targets with the real SmolLM2 tokenizer, prompt files, a repo;
and the test lanes' guard.

The tiny targets have the real 49,152-token vocabulary and chat template (so token ids, padding and
EOS handling are the real ones) but only a few narrow layers, so a stage runs in seconds on CPU.

Test lanes (markers in pyproject.toml): `slow` (the real target, or more than ~10 s), `dvc` (runs
dvc commands), `subprocess` (spawns stage scripts, torchrun, the console script, servers).
`make test-fast` deselects all three; `make test` (CI) runs everything. A test that runs dvc or
spawns a process through `run`, `start_then_kill_9` or `stage_env`, or builds `pipeline_repo` /
`tiny_pipeline`, without its marker fails, naming the marker (tests/support/lanes.py; the hooks
below feed it). Helpers the tests import live in tests/support/helpers.py.
"""

import importlib.util
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from support.helpers import (
    REPO_ROOT,
    SAMPLE_PROMPTS,
    run,
    set_params,
    write_generated,
    write_jsonl,
)
from support import durations
from support.lanes import _running, check_lane_fixtures

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_configure(config):
    """One torch thread for this process, each pytest-xdist worker alike (`DFLASH_TEST_THREADS` to
    choose another count): its models are a few layers 64 wide, too small to gain from a second
    thread, and on a busy 2-core machine two threads per process made the unit lane 9x slower. The
    stage commands the tests spawn get theirs from `helpers.stage_env`."""
    import torch

    torch.set_num_threads(int(os.environ.get("DFLASH_TEST_THREADS", "1")))
    durations.register(config)


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


# ----------------------------------------------------------------------------- test lanes (support/lanes.py)


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
    check_lane_fixtures(item)


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


@pytest.fixture
def sample_prompts(tmp_path) -> Path:
    return write_jsonl(tmp_path / "prompts.jsonl", SAMPLE_PROMPTS)


def new_pipeline_repo(repo: Path) -> Path:
    """A fresh git + DVC repo at `repo` holding this project's pipeline files (not its data or venv)."""
    repo.mkdir(parents=True)
    for name in ("dvc.yaml", "params.yaml", ".gitignore", ".dvcignore"):
        shutil.copy(REPO_ROOT / name, repo / name)
    for folder in ("stages", "src", ".dvc"):
        shutil.copytree(REPO_ROOT / folder, repo / folder, ignore=shutil.ignore_patterns("__pycache__", "tmp", "cache", "*.egg-info"))
    (repo / "data" / "prompts").mkdir(parents=True)
    run(["git", "init", "-q", "-b", "main"], repo)
    run(["git", "config", "user.email", "test@example.com"], repo)
    run(["git", "config", "user.name", "test"], repo)
    return repo


def set_tiny_params(repo: Path, tiny_llama_dir: Path) -> Path:
    """The tiny Llama as the target, with params small enough for a whole `dvc repro` in seconds."""
    prompts = [{"prompt": f"Give me fact number {i} about the number {i * 7}.", "category": "chat"} for i in range(30)]
    write_jsonl(repo / "data" / "prompts" / "small.jsonl", SAMPLE_PROMPTS + prompts)
    set_params(
        repo,
        target={"model": str(tiny_llama_dir), "watch": str(tiny_llama_dir)},
        generate={"prompts": "data/prompts/small.jsonl", "max_prompts": 8, "max_new_tokens": 8, "batch_size": 4},
        capture={"layer_ids": [1, 3], "shard_mb": 1},
        # The tiny random target answers every prompt with token 198 repeated: a draft vocabulary of
        # that one token makes every loss exactly 0, so these DVC tests train over the full vocabulary.
        train={"max_steps": 4, "eval_every": 2, "save_every": 2, "eval_blocks": 16, "tokens_per_step": 256, "train_vocab": "full"},
        evaluate={"anchors_per_sequence": 4, "num_prompts": 1, "max_new_tokens": 6},
    )
    return repo


@pytest.fixture
def pipeline_repo(tmp_path) -> Path:
    """A fresh git + DVC repo holding this project's pipeline files (not its data or venv)."""
    return new_pipeline_repo(tmp_path / "repo")


@pytest.fixture
def tiny_pipeline(pipeline_repo, tiny_llama_dir):
    """`pipeline_repo` on the tiny Llama with params small enough for a whole `dvc repro` in seconds."""
    return set_tiny_params(pipeline_repo, tiny_llama_dir)


@dataclass(frozen=True)
class ReproducedPipeline:
    """The tiny pipeline after one `dvc repro` from nothing, committed: the repo and what the run printed."""

    repo: Path
    first_repro: subprocess.CompletedProcess


@pytest.fixture(scope="session")
def tiny_pipeline_reproduced_once(tmp_path_factory, tiny_llama_dir) -> ReproducedPipeline:
    """The one `dvc repro` of the tiny pipeline from nothing per test session (then `git commit`).
    Tests never touch it: each takes a copy (`reproduced_tiny_pipeline`). A whole run costs about a
    minute of process starts on two cores, and nine DVC tests began with the same one."""
    repo = set_tiny_params(new_pipeline_repo(tmp_path_factory.mktemp("reproduced") / "repo"), tiny_llama_dir)
    first = run(["dvc", "repro"], repo)
    run(["git", "add", "-A"], repo)
    run(["git", "commit", "-qm", "the tiny run"], repo)
    return ReproducedPipeline(repo, first)


@pytest.fixture
def reproduced_tiny_pipeline(tiny_pipeline_reproduced_once, tmp_path) -> Path:
    """A copy of the tiny pipeline as one `dvc repro` from nothing left it, committed: the git repo,
    its DVC cache and the workspace's outputs, hard links and read-only modes kept (`cp -a`), so the
    copy is the run itself, not a checkout of it. DVC's own state (.dvc/tmp: locks, the queue) stays
    behind; it is rebuilt on first use."""
    copy = tmp_path / "repo"
    subprocess.run(["cp", "-a", str(tiny_pipeline_reproduced_once.repo), str(copy)], check=True)
    shutil.rmtree(copy / ".dvc" / "tmp", ignore_errors=True)
    return copy


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
def cli_run(tiny_llama_dir, tmp_path_factory):
    """For the console command's tests: target fingerprint, generated val prompts, captured shards and
    one checkpoint (step 4) on the tiny Llama, plus a float32 export of it (support/console.py)."""
    from support.console import build_cli_run

    return build_cli_run(tmp_path_factory.mktemp("cli"), tiny_llama_dir)


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
    from dflash.model import (
        DFlashDraftModel,  # an import error here (e.g. a transformers break) fails the test
    )

    if path and not os.path.abspath(sys.modules["dflash.model"].__file__).startswith(os.path.abspath(path) + os.sep):
        pytest.fail(f"DFLASH_ZLAB_PATH={path} has no dflash/model.py; imported {sys.modules['dflash.model'].__file__}")
    return DFlashDraftModel


@pytest.fixture(scope="session")
def tiny_target(tiny_llama_dir):
    """The tiny Llama with taps on layers 1 and 3, its head, an untrained block-5 drafter for it and a prompt."""
    import torch
    from transformers import AutoModelForCausalLM

    from dflash_pipeline.drafters.core import DFlashDrafter
    from dflash_pipeline.drafters.config import DrafterConfig
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
