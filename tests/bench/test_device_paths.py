"""The GPU's code paths, run on the CPU wherever torch allows it.

Inventory of every branch that depends on the device or dtype (grep: cuda, bf16, bfloat16, flex,
compile, autocast, pin_memory, non_blocking, synchron), and where each one runs here:

| branch | where | run on CPU by |
|---|---|---|
| compiled `flex_attention` + BlockMask (train on GPU) | model.flex_attention_fn, to_block_mask | test_compiled_flex_attention_equals_sdpa (forward; the CPU compiles per shape, CUDA with dynamic shapes: inductor's CPU template cannot build dynamic Q != K kernels) |
| flex backward | torch | NOT on CPU: torch 2.13 raises "FlexAttention does not support backward on CPU" (test_flex_backward_is_a_gpu_only_branch) |
| bf16 autocast in the train step and periodic τ | train.train_step, train.validation_tau, devices.autocast | test_a_bf16_autocast_training_step_matches_fp32 |
| bf16 head / target on CUDA | train.setup_run, evaluate.run_evaluate, target.load_target (one line each) | the bf16 tests below build the same bf16 head and target |
| bf16 capture (target forward in bf16) | capture.forward_batch under target.load_target's bf16 | test_bf16_capture_matches_fp32_within_bf16_rounding |
| batched scoring under autocast with a bf16 head | evaluate.score_candidates | test_bf16_batched_scorer_agrees_with_the_one_block_reference |
| speculative decoding, bf16 target + autocast drafter | session.speculative_decode (`bf16`), is_near_tie | test_bf16_speculative_decoding_equals_bf16_greedy_up_to_near_ties |
| bf16 features kept on the device | static_speculation.stored_features | test_as_stored_bf16_equals_the_shard_round_trip |
| synchronised timing | devices.synchronize / timed (engine, bench/*) | tests/foundation/test_devices.py::test_timing_helper (CPU: no-op sync) |
| `non_blocking=True` copies | blocks.Batch.to | every train test (a plain copy on CPU); pinned memory is not used |
| NCCL process group, `cuda:LOCAL_RANK` | train.distributed.init_distributed, capture | NOT on CPU: the same code with gloo runs in test_train / test_capture |
| `bench/gpu/figures.py` | bench | test_gpu_check_dry_run_prints_every_figure_of_the_check (every section at toy sizes, CPU), test_gpu_bench_cuts_a_part_at_its_limit_and_runs_the_rest |
| `bench/gpu/probe.py`, `bench/gpu/check.sh`, `bench/gpu/carry.sh` | bench | test_gpu_check_dry_run_prints_every_figure_of_the_check, test_the_carry_script_parses_and_names_its_commands |
| every other bench's `--dry-run` | bench | tests/bench/test_dry_runs.py |
"""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from oracles.drafting import Proposal
from support.helpers import REPO_ROOT, stage_env

from dflash_pipeline.data.masks import dflash_mask
from dflash_pipeline.drafters import attention as attention_module
from dflash_pipeline.drafters.core import DFlashDrafter
from dflash_pipeline.drafters.config import DrafterConfig
from dflash_pipeline.foundation import devices

# ----------------------------------------------------------------------------- flex attention


def _packed_blocks(drafter, generator):
    """Features, positions and DFlash mask of five blocks over one 40-token context."""
    config = drafter.config
    features = torch.randn(40, config.feature_width, generator=generator)
    anchors = [3, 9, 17, 30, 36]
    embeddings = torch.randn(len(anchors) * config.block_size, config.hidden_size, generator=generator)
    positions = torch.cat([torch.arange(a, a + config.block_size) for a in anchors])
    block_anchor = torch.cat([torch.full((config.block_size,), a) for a in anchors])
    block_index = torch.arange(len(anchors)).repeat_interleave(config.block_size)
    mask = dflash_mask(torch.zeros(40, dtype=torch.long), torch.arange(40), torch.zeros_like(block_anchor), block_anchor, block_index)
    return features, embeddings, positions, mask


def _tiny_drafter(**overrides) -> DFlashDrafter:
    values = dict(hidden_size=32, intermediate_size=64, num_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  vocab_size=97, block_size=4, target_layer_ids=(0, 2, 3), num_target_layers=4, mask_token_id=96, rope_theta=10000.0)
    values.update(overrides)
    torch.manual_seed(0)
    return DFlashDrafter(DrafterConfig(**values)).eval()


@pytest.mark.slow  # torch.compile on the CPU: ~20 s
def test_compiled_flex_attention_equals_sdpa(monkeypatch):
    """The GPU's training attention: flex_attention compiled by torch.compile with a BlockMask
    (here with inductor's CPU backend instead of Triton) against SDPA with the dense mask."""
    monkeypatch.setattr(attention_module, "COMPILE_FLEX_ON", ("cuda", "cpu"))
    monkeypatch.setattr(attention_module, "_COMPILED_FLEX", {})
    drafter = _tiny_drafter()
    features, embeddings, positions, mask = _packed_blocks(drafter, torch.Generator().manual_seed(1))
    with torch.no_grad():
        sdpa = drafter.forward_blocks(features, torch.arange(40), embeddings, positions, mask, attention="sdpa")
        flex = drafter.forward_blocks(features, torch.arange(40), embeddings, positions, mask, attention="flex")
    assert "cpu" in attention_module._COMPILED_FLEX  # the compiled function ran, not the eager one
    torch.testing.assert_close(flex, sdpa, rtol=1e-5, atol=1e-5)


def test_flex_backward_is_a_gpu_only_branch():
    """Flex training (its backward) cannot run on a CPU with this torch: the day it can, this test
    fails and a gradient test against SDPA belongs here."""
    drafter = _tiny_drafter().train()
    features, embeddings, positions, mask = _packed_blocks(drafter, torch.Generator().manual_seed(1))
    with pytest.raises(NotImplementedError, match="backward on CPU"):
        drafter.forward_blocks(features, torch.arange(40), embeddings, positions, mask, attention="flex").sum().backward()


# ----------------------------------------------------------------------------- bf16 training


def _one_step(tiny_run, tmp_path, bf16: bool):
    from support.stage_commands import TINY_TRAIN

    from dflash_pipeline.train.run import setup_run
    from dflash_pipeline.train.step import read_back, train_step

    target, root = tiny_run
    run = setup_run(TINY_TRAIN, target=target, train_dir=root / "hidden" / "train", val_dir=root / "hidden" / "val",
                    out_dir=tmp_path / ("bf16" if bf16 else "fp32"), device="cpu", log=lambda *_: None)
    run.bf16 = bf16
    (row,) = read_back(run, [train_step(run, 0)])
    gradients = torch.cat([p.grad.flatten() for p in run.drafter.parameters() if p.grad is not None])
    return row, gradients


def test_a_bf16_autocast_training_step_matches_fp32(tiny_run, tmp_path):
    """The GPU's train step (bf16 autocast over drafter and head) against fp32: the loss within
    1% and the gradient pointing the same way (cosine > 0.99). bf16 keeps 8 bits of mantissa,
    so per-element equality is not expected."""
    fp32_row, fp32_grad = _one_step(tiny_run, tmp_path, bf16=False)
    bf16_row, bf16_grad = _one_step(tiny_run, tmp_path, bf16=True)
    assert bf16_row["loss"] != fp32_row["loss"]  # autocast really changed the arithmetic
    assert bf16_row["loss"] == pytest.approx(fp32_row["loss"], rel=1e-2)
    cosine = torch.nn.functional.cosine_similarity(bf16_grad, fp32_grad, dim=0)
    assert cosine > 0.99, float(cosine)
    assert bf16_grad.norm() == pytest.approx(float(fp32_grad.norm()), rel=5e-2)


# ----------------------------------------------------------------------------- bf16 capture


def test_bf16_capture_matches_fp32_within_bf16_rounding(tiny_llama_dir):
    """Capture on a GPU runs the target in bf16: features, greedy next tokens and top-k log-probs
    against the fp32 capture of the same sequences."""
    from transformers import AutoModelForCausalLM

    from dflash_pipeline.capture.forward import forward_batch
    from dflash_pipeline.capture.plan import Sequence
    from dflash_pipeline.target.load import LayerTap

    generator = torch.Generator().manual_seed(0)
    batch = [Sequence(id=f"s{i}", input_ids=torch.randint(3, 49152, (n,), generator=generator).tolist(), loss_mask=[0] * (n // 2) + [1] * (n - n // 2))
             for i, n in enumerate([17, 40, 29])]
    captured = {}
    for dtype in (torch.float32, torch.bfloat16):
        target = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=dtype).eval()
        tap = LayerTap(target, [1, 3])
        captured[dtype] = forward_batch(target, tap, batch, pad_id=2, top_k=8)
        tap.remove()
    agree = total = 0
    for exact, rounded in zip(captured[torch.float32], captured[torch.bfloat16]):
        assert rounded.features.dtype == torch.bfloat16
        # Four bf16 layers: a few roundings of 2^-8 relative each, measured against the feature scale.
        scale = exact.features.float().abs().amax(dim=-1, keepdim=True)
        assert ((rounded.features.float() - exact.features.float()).abs() / scale).max() < 0.03
        torch.testing.assert_close(rounded.topk_logprobs[:, 0], exact.topk_logprobs[:, 0], rtol=0.02, atol=0.05)
        agree += int((rounded.target_next == exact.target_next).sum())
        total += rounded.target_next.numel()
    assert agree / total > 0.9  # a random tiny target has near-ties in its argmax; the real one fewer


# ----------------------------------------------------------------------------- bf16 evaluation


def test_bf16_batched_scorer_agrees_with_the_one_block_reference():
    """evaluate on a GPU: bf16 head, drafter under bf16 autocast. The batched scorer against the
    one-block loop in the same arithmetic: different matmul shapes round differently, so blocks
    may flip on near-ties, but the mean τ must agree and most blocks be identical."""
    from oracles.scoring import score_one_block_at_a_time
    from support.targets import small_vocab_setup

    from dflash_pipeline.measure.scoring import score_teacher_forced
    from dflash_pipeline.target.load import TargetHead

    drafter, head, split = small_vocab_setup()
    bf16_head = TargetHead(head.embed_weight.to(torch.bfloat16), head.lm_head_weight.to(torch.bfloat16))
    with devices.autocast("cpu", enabled=True):
        batched = score_teacher_forced(drafter, bf16_head, split, anchors_per_sequence=0, tokens_per_batch=70, tree_budgets=[8])
        plain = score_one_block_at_a_time(drafter, bf16_head, split, anchors_per_sequence=0, tree_budgets=[8])
    exact = score_teacher_forced(drafter, head, split, anchors_per_sequence=0, tokens_per_batch=70, tree_budgets=[8])
    assert np.array_equal(batched.anchor, plain.anchor)
    assert (batched.tau == plain.tau).mean() >= 0.95
    assert abs(batched.tau.mean() - plain.tau.mean()) < 0.05
    assert (batched.tau == exact.tau).mean() >= 0.8  # bf16 really ran, and stays near the fp32 scores


def test_bf16_speculative_decoding_equals_bf16_greedy_up_to_near_ties(tiny_llama_dir):
    """evaluate's end-to-end check on a GPU: bf16 target, fp32 drafter under bf16 autocast, against
    plain greedy decoding of the same bf16 target. A 5-token verify forward and a 1-token decode
    step round differently in bf16, so on an exact or near tie of the target's logits the two may
    pick different tokens (the tiny random target, whose logits span under 1.0, has such ties);
    every other token must be equal, and every parting must be such a tie (`is_near_tie`).
    A rigged drafter that knows the answer gets whole blocks accepted."""
    from oracles.decoding import host_speculative_decode
    from transformers import AutoModelForCausalLM

    from dflash_pipeline.decoding.plain import greedy_decode
    from dflash_pipeline.decoding.session import Speculation
    from dflash_pipeline.measure.end_to_end import (
        EndToEndPrompt,
        RunKey,
        end_to_end,
        first_difference,
        is_near_tie,
        summarize_end_to_end,
    )
    from dflash_pipeline.target.load import LayerTap, TargetHead

    target = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.bfloat16).eval()
    tap = LayerTap(target, [1, 3])
    head = TargetHead(target.get_input_embeddings().weight.detach(), target.get_output_embeddings().weight.detach())
    torch.manual_seed(0)
    drafter = DFlashDrafter(DrafterConfig(hidden_size=64, intermediate_size=128, num_layers=1, num_attention_heads=4,
                                          num_key_value_heads=2, head_dim=16, vocab_size=49152, block_size=5,
                                          target_layer_ids=(1, 3), num_target_layers=4, mask_token_id=0)).eval()
    prompts = [(f"p{seed}", torch.randint(3, 49000, (12,), generator=torch.Generator().manual_seed(seed)).tolist()) for seed in range(4)]

    def knows_the_answer(answer: list[int], prompt_length: int):
        def propose(cache, anchor):
            produced = cache.length - prompt_length  # answer tokens committed before the anchor
            proposal = answer[produced + 1 : produced + 5]
            return Proposal(proposal + [0] * (4 - len(proposal)))

        return propose

    untrained = Speculation(drafter, head)
    results = []
    for prompt_id, ids in prompts:
        answer = greedy_decode(target, ids, max_new_tokens=24, eos_ids={2}).tokens
        (result,) = end_to_end(target, [("untrained", untrained)], [(prompt_id, ids)], max_new_tokens=24, eos_ids={2},
                               feature_dtype="bf16", bf16=True)
        # the rigged drafter proposes through the host oracle loop (a proposal is no tensor-level drafter)
        rigged = host_speculative_decode(target, tap, drafter, knows_the_answer(answer, len(ids)), ids, max_new_tokens=24, eos_ids={2},
                                         feature_dtype="bf16", bf16=True)
        results.append(EndToEndPrompt(result.prompt_id, result.plain, {**result.speculative, RunKey("rigged"): rigged},
                                      {**result.near_ties, RunKey("rigged"): is_near_tie(target, ids, result.plain.tokens, rigged.tokens, position)
                                       if (position := first_difference(result.plain.tokens, rigged.tokens)) is not None else False}))
    for name in ("untrained", "rigged"):
        summary = summarize_end_to_end(results, RunKey(name))
        assert summary.lossless_rate >= 0.5, summary.mismatches
        assert all(mismatch.near_tie for mismatch in summary.mismatches), summary.mismatches
    assert any(5 in r.speculative[RunKey("rigged")].steps for r in results)  # whole blocks accepted

    # The tie test itself: the same token is a tie; the token the target ranks last is not.
    prompt, answer = prompts[0][1], results[0].plain.tokens
    with torch.no_grad():
        worst = int(target(input_ids=torch.tensor([prompt + answer[:3]])).logits[0, -1].argmin())
    assert is_near_tie(target, prompt, answer, answer, 3)
    assert not is_near_tie(target, prompt, answer, answer[:3] + [worst], 3)
    assert not is_near_tie(target, prompt, answer, answer[:3], 3)  # one answer ended: no token to compare


def test_as_stored_bf16_equals_the_shard_round_trip():
    from dflash_pipeline.data.shards import decode_features, encode_features
    from dflash_pipeline.decoding.static_speculation import stored_features as as_stored

    features = torch.randn(9, 24) * 50
    values, scales = encode_features(features, "bf16")
    assert torch.equal(as_stored(features, "bf16").view(torch.int16),
                       decode_features(values, scales, 24, "bf16").view(torch.int16))
    fp8 = as_stored(features, "fp8_e4m3")
    assert fp8.dtype == torch.bfloat16 and not torch.equal(fp8, features.to(torch.bfloat16))


# ----------------------------------------------------------------------------- bench/gpu/


def test_a_decode_figure_from_a_noisy_pair_of_runs_is_never_zero():
    # bench/gpu/figures.py times 2n and n steps and takes the difference; on a loaded machine the n-step
    # run once took as long as the 2n one, the step time came out 0 and a ratio divided by it.
    from bench.gpu.figures import step_seconds

    assert step_seconds(1.0, 1.5, 10) == (0.05, True)
    per_step, from_difference = step_seconds(1.0, 0.9, 10)
    assert (per_step, from_difference) == (0.9 / 20, False) and per_step > 0


@pytest.mark.subprocess
def test_gpu_bench_cuts_a_part_at_its_limit_and_runs_the_rest(tmp_path):
    """A part past its time limit loses its own figures only: here the train section, given 1 s."""
    out = tmp_path / "gpu.json"
    result = subprocess.run([sys.executable, str(REPO_ROOT / "bench" / "gpu" / "figures.py"), "--dry-run", "--work", str(tmp_path / "work"),
                             "--data", "fabricated", "--sections", "train,evaluate", "--limit", "train=1", "--json", str(out)],
                            cwd=tmp_path, env=stage_env(), capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
    figures = json.loads(out.read_text())
    assert figures["sections_done"] == ["data", "train + evaluate"]
    assert "limit of 1 s" in figures["section_errors"]["train step"] or "train_variant_errors" in figures
    assert figures["e2e_lossless_rate"] == 1.0


@pytest.mark.subprocess
def test_gpu_check_dry_run_prints_every_figure_of_the_check(tmp_path):
    """bench/gpu/check.sh's two calls at toy sizes on the CPU: the last line is CHECK {...} with the
    figures of issue #37's table, the decode step's attention backend and the fallback counts; the
    bench and the probe it ran each gave every figure (one run of each serves all three checks)."""
    env = {**stage_env(), "OUT": str(tmp_path / "out"), "PYTHON": sys.executable, "HOME": str(tmp_path)}
    result = subprocess.run(["bash", str(REPO_ROOT / "bench" / "gpu" / "check.sh"), "dry-run"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
    last = result.stdout.rstrip().splitlines()[-1]
    assert last.startswith("CHECK {"), result.stdout
    check = json.loads(last[len("CHECK "):])
    assert check == json.loads((tmp_path / "out" / "check.json").read_text())
    assert check["errors"] == {}, check["errors"]
    for key in ("capture_gpu_path_vs_forward", "writer_vs_disk", "capture_stage_tokens_per_s", "train_tokens_per_s",
                "e2e_speedup", "e2e_decode_speedup", "bench_seconds"):
        assert isinstance(check[key], (int, float)) and check[key] > 0, key
    assert check["decode_attention_backend"]["b1"] and set(check["spec_cost_in_plain_steps"]) == {"chain", "tree8", "sampled"}
    assert check["graph_fallbacks"] == 0 and check["cudagraph_skips"] == 0 and "train_compiled_mfu" in check
    assert check["split_answers_equal"] is True

    # The lent-GPU bench (call 2's bench/gpu/figures.py) end to end at toy sizes: every section runs and prints its row.
    figures = json.loads((tmp_path / "out" / "gpu.json").read_text())
    assert "section_errors" not in figures, figures["section_errors"]
    assert figures["sections_done"] == ["data", "decode", "capture / forward", "train step", "train + evaluate", "scoring", "split target"]
    assert figures["split_answers_equal"] is True and figures["split_devices"] == ["cpu", "disk"] and figures["split_vs_whole"] > 0
    assert set(figures["section_seconds"]) == set(figures["sections_done"]) and figures["limits_s"]["train"] > 0
    assert figures["decode_step_ms_batch1"] > 0 and figures["decode_static_vs_transformers_batch"] > 0
    for key in ("capture_vs_forward", "train_tokens_per_s", "train_mfu", "flex_vs_sdpa_step", "batched_vs_one_block",
                "e2e_speedup", "verify_cost_decode_steps", "pipeline_tau", "scoring_vs_host_dense_mask", "train_host_prepare_ms",
                "capture_gpu_path_vs_forward", "writer_vs_disk", "capture_stage_tokens_per_s", "decode_setup_ms_batch1",
                "pipeline_train_steps"):
        assert key in figures, key
    assert set(figures["train_variants"]) == {"sdpa", "sdpa-compiled"}  # the compiled step runs (inductor on the CPU)
    assert figures["e2e_lossless_rate"] == 1.0 and figures["pipeline_tau"] >= 1.0
    assert figures["scoring_same_tau_as_host_dense_mask"] is True
    assert "capture / forward" in (tmp_path / "out" / "gpu.log").read_text()

    # The probe of the decoding engine (call 1's bench/gpu/probe.py): every part gives its figures.
    probe = json.loads((tmp_path / "out" / "probe.json").read_text())
    for part in ("attention", "plain_shipped", "plain_cudnn_on", "phases_plain", "phases_chain", "phases_tree8", "phases_sampled",
                 "flex", "compiled_b1"):
        assert "error" not in probe[part], (part, probe[part])
    assert probe["plain_shipped"]["b1"]["ms_per_step"] > 0 and probe["compiled_b1"]["compiled_ms"] > 0
    assert set(probe["spec_cost_in_plain_steps"]) == {"chain", "tree8", "sampled"}
    assert probe["graph_fallbacks"] == 0 and (tmp_path / "out" / "probe.log").read_text().rstrip().splitlines()[-1].startswith("PROBE {")


@pytest.mark.subprocess
def test_the_carry_script_parses_and_names_its_commands(tmp_path):
    """bench/gpu/carry.sh needs the network (prepare) and the carried wheels (install, run) to do its
    work, so on a CPU its dry path is bench/gpu/figures.py's, above; here both scripts parse and a
    wrong command gets the usage line, exit 2."""
    for script in ("carry.sh", "check.sh"):
        path = REPO_ROOT / "bench" / "gpu" / script
        assert subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0, script
        env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "OUT": str(tmp_path / "out")}  # the stash and the output: here
        wrong = subprocess.run(["bash", str(path), "no-such-command"], capture_output=True, text=True, env=env)
        assert wrong.returncode == 2 and f"usage: bench/gpu/{script}" in wrong.stderr, (script, wrong.stderr)
