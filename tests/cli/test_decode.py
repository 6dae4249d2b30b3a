"""cli/decode.py: `dflash-pipeline decode` streams an answer equal to plain decoding at T = 0, takes
the mode evaluate measured fastest for the drafter, refuses a prompt past the target's context, and
`generate`, its old name, still runs it after a one-line notice."""

import json
import re

import pytest
from click.testing import CliRunner
from support.best_records import EPYC, pipeline_run, tree4_record
from support.console import assert_one_line_error, invoke
from support.helpers import REPO_ROOT

from dflash_pipeline.cli import main
from dflash_pipeline.cli.decode import RENAMED_NOTICE
from dflash_pipeline.drafters.serving import PROVENANCE_FILE


def test_decode_defaults_are_params_yaml_values():
    from dflash_pipeline.foundation.config import load_params

    params = load_params(REPO_ROOT / "params.yaml")
    defaults = {p.name: p.default for p in main.commands["decode"].params}
    assert defaults["rule"] == params.evaluate.sampling_rule
    assert defaults["seed"] == params.evaluate.seed
    assert defaults["verify_tokens"] == params.evaluate.verify_tokens
    assert defaults["max_new_tokens"] == params.generate.max_new_tokens
    assert defaults["temperature"] == 0.0 and 0.0 in params.evaluate.temperatures  # greedy, always part of evaluate
    assert defaults["device"] == "auto"


def test_decode_streams_the_answer_and_at_t0_equals_plain_decoding(cli_run, tiny_qwen3_dir):
    for drafter in (cli_run.checkpoint, cli_run.export):
        result = invoke("decode", "Explain recursion.", "--target", cli_run.target_json, "--drafter", drafter, "--max-new-tokens", 24,
                        "--compare")
        assert result.exit_code == 0, result.output
        lines = result.stdout.strip().splitlines()
        assert re.match(r"speculative \(greedy\): 24 tokens, [\d.]+ tokens per step, [\d.]+ tokens/s", lines[-2]), lines
        assert lines[-1].startswith("plain (greedy): 24 tokens") and lines[-1].endswith("identical answers"), lines
    tree = invoke("decode", "Explain recursion.", "--target", cli_run.target_json, "--drafter", cli_run.export, "--max-new-tokens", 24,
                  "--tree-budget", 6, "--compare")
    assert tree.exit_code == 0, tree.output
    assert "speculative (greedy, tree of 6): 24 tokens" in tree.stdout and tree.stdout.strip().endswith("identical answers"), tree.stdout
    # the mode's one rule of a tree, worded by the options given (`modes.check_tree_rule`)
    assert_one_line_error(invoke("decode", "hi", "--target", cli_run.target_json, "--drafter", cli_run.export, "--tree-budget", 4,
                                 "--temperature", 1), "--tree-budget: tree verification is greedy", "(drop --temperature)")
    assert_one_line_error(invoke("decode", "hi", "--target", cli_run.target_json, "--drafter", cli_run.export, "--tree-budget", 4,
                                 "--verify-tokens", 2, "--temperature", 1), "(drop --temperature / --verify-tokens)")
    sampled = [invoke("decode", "Explain recursion.", "--target", cli_run.target_json, "--drafter", cli_run.checkpoint, "--max-new-tokens", 16,
                      "--temperature", "0.8", "--rule", rule, "--seed", 3).stdout for rule in ("ratio", "ratio", "match")]
    assert sampled[0].splitlines()[:-1] == sampled[1].splitlines()[:-1]  # the same seed samples the same answer
    assert "speculative (T=0.8, ratio rule): 16 tokens" in sampled[0] and "T=0.8, match rule" in sampled[2]
    # a drafter trained for another target is refused with one line naming the field
    assert_one_line_error(invoke("decode", "hi", "--target", tiny_qwen3_dir, "--drafter", cli_run.checkpoint),
                          "checkpoint.json: target_fingerprint")
    assert_one_line_error(invoke("decode", "hi", "--target", cli_run.target_json, "--drafter", cli_run.val), "not a drafter: no checkpoint.json")


def test_decode_refuses_a_prompt_that_with_its_answer_runs_past_the_targets_context(cli_run):
    # An 8,500-token prompt was decoded past an 8192-token context without a word.
    prompt = "word " * 3950
    result = invoke("decode", prompt, "--target", cli_run.target_json, "--drafter", cli_run.export, "--max-new-tokens", 200, "--device", "cpu")
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    line = result.stderr.strip().splitlines()[-1]  # after transformers' own weight-loading bar
    assert line.startswith("error: PROMPT is ") and "tokens in the target's chat template; with --max-new-tokens 200" in line, line
    assert "past the target's context of 4096 tokens (max_position_embeddings in " in line
    assert int(line.split("PROMPT is ")[1].split()[0]) + 200 > 4096 and "speculative" not in result.stdout


@pytest.mark.slow  # four generate runs and an export: ~30 s on two cores
def test_decode_decodes_with_the_evaluated_mode_of_a_checkpoint_and_of_its_export(cli_run, tmp_path):
    import importlib.util

    step = pipeline_run(tmp_path, cli_run.checkpoint, best_mode=tree4_record(tree_budget=3, mode="tree3", speedups={"chain": 0.97, "tree3": 1.08}))
    result = invoke("decode", "Explain recursion.", "--target", cli_run.target_json, "--drafter", step, "--max-new-tokens", 16, "--compare",
                    "--device", "cpu")
    assert result.exit_code == 0, result.output
    lines = result.stdout.strip().splitlines()
    assert lines[0].startswith("mode: DDTree budget 3: evaluate measured 1.08x vs chain 0.97x"), lines[0]
    assert lines[-2].startswith("speculative (greedy, tree of 3): 16 tokens") and lines[-1].endswith("identical answers"), lines
    flagged = invoke("decode", "Explain recursion.", "--target", cli_run.target_json, "--drafter", step, "--max-new-tokens", 16,
                     "--verify-tokens", 1, "--device", "cpu")
    assert flagged.stdout.startswith("mode: chain verifying 1 of 3 drafted tokens (--verify-tokens)\n"), flagged.stdout
    assert "speculative (greedy): 16 tokens" in flagged.stdout
    sampled = invoke("decode", "hi", "--target", cli_run.target_json, "--drafter", step, "--max-new-tokens", 4, "--temperature", 1,
                     "--device", "cpu")
    assert "mode:" not in sampled.stdout and "speculative (T=1.0, ratio rule)" in sampled.stdout  # a greedy measurement: T = 0 only

    # the export stage carries best.json's mode into the exported folder's provenance file
    spec = importlib.util.spec_from_file_location("export_stage", REPO_ROOT / "stages" / "export.py")
    stage = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(stage)
    best_json = tmp_path / "data" / "eval" / "best.json"
    best_json.write_text(json.dumps({**json.loads(best_json.read_text()), "path": str(step)}))
    exported = CliRunner().invoke(stage.main, ["--params", str(REPO_ROOT / "params.yaml"), "--best", str(best_json),
                                               "--out", str(tmp_path / "drafter")], catch_exceptions=False)
    assert exported.exit_code == 0 and "best mode tree3, speedup 1.08" in exported.stdout, exported.output
    assert json.loads((tmp_path / "drafter" / PROVENANCE_FILE).read_text())["source"]["best_mode"]["tree_budget"] == 3
    assert "best decoding mode: tree3, speedup 1.08" in invoke("show", tmp_path / "drafter").stdout
    result = invoke("decode", "Explain recursion.", "--target", cli_run.target_json, "--drafter", tmp_path / "drafter", "--max-new-tokens",
                    16, "--device", "cpu")
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith(f"mode: DDTree budget 3: evaluate measured 1.08x vs chain 0.97x on {EPYC} "
                                    f"({tmp_path / 'drafter' / PROVENANCE_FILE}: source.best_mode)")
    assert "speculative (greedy, tree of 3): 16 tokens" in result.stdout


# ----------------------------------------------------------------------------- `generate`, the old name


def test_generate_is_decode_under_its_old_name_hidden_from_the_list():
    old, new = main.commands["generate"], main.commands["decode"]
    assert old.hidden and not new.hidden and old.params == new.params
    helped = invoke("generate", "--help")
    assert helped.exit_code == 0 and helped.stdout.startswith("Usage: main generate [OPTIONS] PROMPT\n\n  The old name of `dflash-pipeline decode`")
    assert "dflash-pipeline decode \"Write a haiku" in helped.stdout and RENAMED_NOTICE not in helped.output


def test_generate_prints_the_notice_once_then_fails_as_decode_does(tmp_path):
    arguments = ["hi", "--target", tmp_path, "--drafter", tmp_path, "--device", "cpu"]
    line = assert_one_line_error(invoke("decode", *arguments), "neither a target.json")
    old = invoke("generate", *arguments)
    assert old.exit_code == 1 and old.stdout == "" and old.stderr.splitlines() == [RENAMED_NOTICE, line], old.stderr


def test_generate_decodes_as_decode_does_after_the_notice(cli_run):
    arguments = ["Explain recursion.", "--target", cli_run.target_json, "--drafter", cli_run.export, "--max-new-tokens", 12, "--device", "cpu"]
    new, old = invoke("decode", *arguments), invoke("generate", *arguments)
    assert new.exit_code == old.exit_code == 0, old.output
    assert old.stderr.count(RENAMED_NOTICE) == 1 and old.stderr.startswith(RENAMED_NOTICE + "\n") and RENAMED_NOTICE not in new.stderr
    # the same mode line and answer; only the timing figures of the last line differ
    assert old.stdout.splitlines()[:-1] == new.stdout.splitlines()[:-1] and "speculative (greedy): 12 tokens" in old.stdout.splitlines()[-1]
