"""recorded_mode.py: evaluate's best-mode record read back for one drafter (best.json beside a
checkpoint, an export's provenance file), and the mode `dflash-pipeline decode` takes from it: the
options win, else the measured fastest, else the whole chain, and the line says which and why."""

import hashlib
import re
import shutil
from pathlib import Path

import pytest
from support.best_records import EPYC, pipeline_run, tree4_record

from dflash_pipeline.evaluate.recorded_mode import choose_decode_mode
from dflash_pipeline.speculation.modes import DecodingMode


def decode_mode(folder: Path, kind: str = "checkpoint", *, explicit=(), tree_budget=None, verify_tokens=None, machine=EPYC):
    """(tree budget, verify tokens, the line) `decode` takes for a drafter of block size 16 at `folder`,
    given the options' mode (`tree_budget`, `verify_tokens`)."""
    requested = DecodingMode(tree_budget=tree_budget, verify_tokens=verify_tokens)
    mode, line = choose_decode_mode(drafter_dir=folder, kind=kind, block_size=16, requested=requested, explicit=set(explicit),
                                    machine=machine)
    return mode.tree_budget, mode.verify_tokens, line


def test_decode_takes_the_mode_evaluate_measured_fastest_and_says_why(tmp_path):
    step = pipeline_run(tmp_path, best_mode=tree4_record())
    budget, verify, line = decode_mode(step)
    assert (budget, verify) == (4, None)
    assert line == (f"mode: DDTree budget 4: evaluate measured 1.08x vs chain 0.97x, tree8 1.02x on {EPYC} "
                    f"({tmp_path / 'data' / 'eval' / 'best.json'}: best_mode)")
    assert "another mode may pay better" in decode_mode(step, machine="cuda on an H200")[2]  # measured elsewhere: said so
    # where the chain won, at the verify length evaluate planned
    chain = tree4_record(mode="chain", speedup=1.15, tree_budget=None, verify_tokens=2, speedups={"chain": 1.15, "tree4": 0.95})
    shutil.rmtree(tmp_path / "data")
    step = pipeline_run(tmp_path, best_mode=chain)
    budget, verify, line = decode_mode(step)
    assert (budget, verify) == (None, 2)
    assert line.startswith("mode: chain verifying 2 of 15 drafted tokens: evaluate measured 1.15x vs tree4 0.95x")


def test_decode_flags_override_the_evaluated_mode(tmp_path):
    step = pipeline_run(tmp_path, best_mode=tree4_record())
    assert decode_mode(step, explicit={"verify_tokens"}, verify_tokens=3) == (None, 3, "mode: chain verifying 3 of 15 drafted tokens "
                                                                                         "(--verify-tokens)")
    assert decode_mode(step, explicit={"tree_budget"}, tree_budget=8) == (8, None, "mode: DDTree budget 8 (--tree-budget)")


def test_decode_without_an_evaluate_record_keeps_the_whole_chain_and_says_so(tmp_path):
    alone = tmp_path / "alone" / "checkpoints" / "step_000004"
    alone.mkdir(parents=True)
    assert decode_mode(alone) == (None, None, f"mode: chain of all 15 drafted tokens (no evaluate record of this drafter: "
                                                f"no {tmp_path / 'alone' / 'eval' / 'best.json'} beside this checkpoint's run)")
    other = pipeline_run(tmp_path / "other", best_mode=tree4_record()).with_name("step_000002")
    other.mkdir()
    assert decode_mode(other)[:2] == (None, None) and "chose 'step_000004', not this checkpoint" in decode_mode(other)[2]
    old = pipeline_run(tmp_path / "old")  # a best.json of before the best mode
    assert decode_mode(old)[:2] == (None, None) and "records no best_mode" in decode_mode(old)[2]
    lossy = pipeline_run(tmp_path / "lossy", best_mode=tree4_record(mode=None, speedup=None, tree_budget=None))
    assert decode_mode(lossy) == (None, None, f"mode: chain of all 15 drafted tokens (evaluate found no lossless greedy mode: "
                                                f"{tmp_path / 'lossy' / 'data' / 'eval' / 'best.json'}: best_mode)")
    undecoded = pipeline_run(tmp_path / "undecoded", best_mode=None)  # evaluate ran without --prompts / num_prompts 0
    assert decode_mode(undecoded)[:2] == (None, None) and "evaluate decoded nothing end to end" in decode_mode(undecoded)[2]
    published = tmp_path / "published"
    published.mkdir()
    assert "has no dflash_pipeline.json" in decode_mode(published, "export")[2]


@pytest.mark.parametrize("changes, fragment", [({"mode": "beam"}, "best_mode.mode is 'beam'"),
                                               ({"tree_budget": "4"}, "best_mode.tree_budget is '4', expected an integer >= 1"),
                                               ({"tree_budget": 8}, "best_mode: mode 'tree4' and tree_budget 8 disagree"),
                                               ({"speedups": [1.0]}, "best_mode.speedups is list")])
def test_a_malformed_evaluate_record_is_one_error_naming_the_file_and_key(tmp_path, changes, fragment):
    from dflash_pipeline.foundation.errors import PipelineError

    step = pipeline_run(tmp_path, best_mode=tree4_record(**changes))
    with pytest.raises(PipelineError, match=re.escape(f"{tmp_path / 'data' / 'eval' / 'best.json'}: {fragment}")):
        decode_mode(step)


def test_decode_refuses_an_evaluate_record_that_differs_from_its_sha256(tmp_path):
    # best.json decides the mode `generate` decodes with; a flipped bit in it was taken as measured.
    from dflash_pipeline.foundation.errors import PipelineError

    step = pipeline_run(tmp_path, best_mode=tree4_record())
    best_json = tmp_path / "data" / "eval" / "best.json"
    (best_json.parent / "best.json.sha256").write_text(f"{hashlib.sha256(best_json.read_bytes()).hexdigest()}  best.json\n")
    assert decode_mode(step)[:2] == (4, None)
    best_json.write_text(best_json.read_text().replace('"speedup": 1.08', '"speedup": 1.88'))
    with pytest.raises(PipelineError, match=re.escape(f"{best_json}: damaged (sha256 ")):
        decode_mode(step)
