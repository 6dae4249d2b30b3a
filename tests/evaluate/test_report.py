"""Reported files: the typed evaluation record written by its one function (`to_metrics`), with
every figure the old flat keys held, strict JSON whatever the numbers, structured mismatches, and
the best greedy decoding mode as the headline speedup."""

import json
import re
from dataclasses import replace

import numpy as np
import pytest
from support.helpers import REPO_ROOT

from dflash_pipeline.decoding.plain import DecodeRun
from dflash_pipeline.evaluate.report import (
    console_lines,
    summary_table,
    to_metrics,
    write_outputs,
)
from dflash_pipeline.evaluate.run import EvaluationResult, choose_and_pair, summarize_decoding
from dflash_pipeline.evaluate.best_mode import choose_decoding_mode
from dflash_pipeline.foundation.files import write_metrics
from dflash_pipeline.measure.end_to_end import EndToEndPrompt, RunKey, summarize_end_to_end
from dflash_pipeline.measure.record import (
    CandidateRecord,
    Evaluation,
    Interval,
    Mismatch,
)
from dflash_pipeline.measure.scoring import BlockScores, summarize_blocks
from dflash_pipeline.measure.verify_plan import VerifyPlan
from dflash_pipeline.speculation.modes import DecodingMode

# ----------------------------------------------------------------------------- a fixed evaluation

CATEGORIES = ["code", "math", "code", "chat"]  # of val sequences 0..3
BUDGETS = [4, 8]
TEMPERATURES = [0.6, 1.0]
CHAINS = {"step_000200": RunKey("step_000200", DecodingMode.chain(3)), "zlab": RunKey("zlab", DecodingMode.chain(4))}  # their verify lengths
# The golden file: the old flat eval.json, comparison rows and mismatch strings, written by the code
# of a88b90c (report.flat_metrics and the summaries of that time) from exactly this fixture.
GOLDEN = REPO_ROOT / "tests" / "golden" / "eval_before_record.json"


def fixed_blocks() -> dict[str, BlockScores]:
    """Teacher-forced scores of two checkpoints (the later one a DFlash2 drafter) and a baseline,
    on the same 22 blocks of 4 prompts (block size 5): fixed draws, slot 4 never reached twice in a row."""
    generator = np.random.default_rng(7)
    sequence = np.repeat([0, 1, 2, 3], [6, 5, 7, 4])
    anchor = np.concatenate([np.arange(n) * 3 for n in (6, 5, 7, 4)])
    valid = np.ones((22, 4), dtype=bool)
    valid[[5, 10, 17], 2:] = False  # the answer ends inside these blocks
    blocks = {}
    for number, (name, rate) in enumerate((("step_000100", 0.45), ("step_000200", 0.6), ("zlab", 0.55))):
        correct = (generator.random((22, 4)) < rate) & valid
        correct[:, 3] &= ~correct[:, 2]  # slot 4 is reached (slots 1-3 right) by no block
        streaks = {budget: np.minimum(np.cumprod(correct, axis=1).sum(axis=1) + generator.integers(0, 2, 22), budget) for budget in BUDGETS}
        scores = BlockScores(sequence=sequence, anchor=anchor, correct=correct, valid=valid, streaks=streaks)
        if name == "step_000200":  # DFlash2: each slot's own argmax, and the top-K candidates
            argmax_correct = (generator.random((22, 4)) < 0.55) & valid
            scores.architecture = "dflash2"
            scores.extras = {"argmax_correct": argmax_correct,
                             "in_top_k": scores.correct | argmax_correct | ((generator.random((22, 4)) < 0.3) & valid)}
        blocks[name] = scores
    return blocks


def _run(tokens, seconds, prefill, steps=(), verify=0.0, draft=0.0, drafted=0) -> DecodeRun:
    return DecodeRun(tokens=list(tokens), seconds=seconds, prefill_seconds=prefill, steps=list(steps), verify_seconds=verify,
                     draft_seconds=draft, drafted=drafted)


def fixed_decoding() -> tuple[list[EndToEndPrompt], dict[float, list[EndToEndPrompt]]]:
    """Greedy runs (chains and trees of the chosen checkpoint and the baseline) and sampled chains of
    three prompts: the chosen's chain parts from plain decoding on p1 at a near-tie, its tree of 8
    on p2 at a real difference."""
    answer = [[5, 6, 7, 8, 9, 10, 11], [3, 4, 4, 4, 5, 2], [9, 8, 7, 6, 5, 4, 3, 2]]
    ours, zlab = CHAINS["step_000200"], CHAINS["zlab"]
    tree4, tree8 = (RunKey("step_000200", DecodingMode.tree(budget)) for budget in BUDGETS)
    greedy, sampled = [], {t: [] for t in TEMPERATURES}
    for p, tokens in enumerate(answer):
        plain = _run(tokens, 0.71 + 0.13 * p, 0.052 + 0.01 * p)
        off = list(tokens)
        off[3] = 1
        runs = {ours: _run(off if p == 1 else tokens, 0.523 + 0.07 * p, 0.05, [3, 2, 1 + p], 0.301 + 0.05 * p, 0.117, 9),
                tree4: _run(tokens, 0.611 + 0.03 * p, 0.05, [4, 2], 0.397, 0.121, 8),
                tree8: _run(off if p == 2 else tokens, 0.689, 0.051, [4, 3], 0.463 + 0.02 * p, 0.122, 16),
                zlab: _run(tokens, 0.55 + 0.05 * p, 0.049, [2, 2, 2], 0.33, 0.109, 12),
                RunKey("zlab", DecodingMode.tree(4)): _run(tokens, 0.65, 0.05, [3, 3], 0.41, 0.12, 8),
                RunKey("zlab", DecodingMode.tree(8)): _run(tokens, 0.7, 0.05, [3, 4], 0.47, 0.125, 16)}
        greedy.append(EndToEndPrompt(f"p{p}", plain, runs, near_ties={ours: True} if p == 1 else ({tree8: False} if p == 2 else {})))
        for number, temperature in enumerate(TEMPERATURES):
            spec = {key: _run(tokens[: 5 + number], 0.5 + 0.1 * number + 0.01 * p, 0.05, [2, 1 + number, 1], 0.3 + 0.02 * number, 0.11,
                              9 + number) for key in (ours, zlab)}
            sampled[temperature].append(EndToEndPrompt(f"p{p}", _run(tokens[: 4 + p], 0.6 + 0.1 * p, 0.05), spec))
    return greedy, sampled


def fixed_evaluation() -> tuple[Evaluation, dict[str, BlockScores], list[EndToEndPrompt]]:
    """The record evaluate builds from the fixed scores and runs: the same steps as `run_evaluate`
    (summaries, choose and pair, one `Decoding` for the chosen checkpoint and the baseline)."""
    blocks = fixed_blocks()
    records = [CandidateRecord(name=name, kind="baseline" if name == "zlab" else "checkpoint", path=f"/runs/{name}",
                               step=None if name == "zlab" else int(name[5:]), block_size=5, num_layers=1,
                               teacher_forced=replace(summarize_blocks(scores, CATEGORIES), seconds=1.25)) for name, scores in blocks.items()]
    evaluation = choose_and_pair(records, blocks, teacher_forced_seconds=3.77)
    greedy, sampled = fixed_decoding()
    plan = VerifyPlan(tokens=3, forward_cost_steps={1: 1.0, 2: 1.041, 3: 1.103, 4: 1.187}, draft_cost_steps=0.2,
                      expected_rates=[1.3331, 1.4127, 1.3909, 1.3512])
    decodings = {name: summarize_decoding(name, greedy, sampled, tree_budgets=BUDGETS, chain_mode=key.mode,
                                          plan=plan if name == evaluation.chosen else None) for name, key in CHAINS.items()}
    candidates = [replace(c, decoding=decodings.get(c.name)) for c in evaluation.candidates]
    return replace(evaluation, candidates=candidates), blocks, greedy


def strict(path):
    return json.loads(path.read_text(), parse_constant=lambda constant: pytest.fail(f"{path} holds a bare {constant}"))


def at(tree, path: str):
    """The value at a dotted path of nested JSON ("tree.8.streak"; a temperature key keeps its dot,
    "sampled.1.0.tau"; "candidates[zlab].tree.8.streak" picks a candidate by name)."""
    if path.startswith("sampled."):
        temperature, leaf = path[len("sampled."):].rsplit(".", 1)
        return tree["sampled"][temperature][leaf]
    for part in path.split("."):
        if match := re.fullmatch(r"candidates\[(.+)\]", part):
            tree = next(c for c in tree["candidates"] if c["name"] == match[1])
        else:
            tree = tree[part]
    return tree


def mapping_rows(section: str) -> list[tuple[str, str, str]]:
    """(old key, new key, where) of each row of a table in docs/metrics-keys.md ("eval" or
    "comparison"); a row naming several keys ("the same" on the right) counts as one row each."""
    text = (REPO_ROOT / "docs" / "metrics-keys.md").read_text()
    part = text.split("## comparison.json rows")[0 if section == "eval" else 1]
    rows = []
    for line in part.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if line.startswith("| `"):
            old = re.findall(r"`([^`]+)`", cells[0])
            new = old if cells[1] == "the same" else re.findall(r"`([^`]+)`", cells[1])
            rows += [(o, n, cells[2] if len(cells) > 2 else "") for o, n in zip(old, new, strict=True)]
    return rows


def expand(old: str, new: str, *, baselines: list[str], slots: int) -> list[tuple[str, str]]:
    """Every (old key, new key) pair a mapping row stands for in the fixed evaluation."""
    choices = {"B": [(str(b), str(b)) for b in BUDGETS], "K": [(str(k), str(k)) for k in range(1, slots + 1)],
               "category": [(c, c) for c in sorted(set(CATEGORIES))], "name": [(n, n) for n in baselines],
               "t": [("1", "1.0"), ("0_6", "0.6")]}
    pairs = [(old, new)]
    for name, values in choices.items():
        if "{" + name + "}" in old:
            target = "T" if name == "t" else name
            pairs = [(o.replace("{" + name + "}", a), n.replace("{" + target + "}", b)) for o, n in pairs for a, b in values]
    return pairs


# ----------------------------------------------------------------------------- the same numbers


def test_the_nested_metrics_hold_exactly_the_numbers_of_the_old_flat_keys(tmp_path):
    golden = json.loads(GOLDEN.read_text())
    evaluation, blocks, greedy = fixed_evaluation()
    eval_path = tmp_path / "eval.json"
    write_metrics(eval_path, to_metrics(evaluation))
    write_metrics(tmp_path / "details.json", to_metrics(evaluation, detail=True))
    headline, details = strict(eval_path), strict(tmp_path / "details.json")
    old = {key: value for key, value in golden["eval"].items() if key != "baselines"}
    old |= {f"baselines.{name}.{key}": value for name, entry in golden["eval"]["baselines"].items() for key, value in entry.items()}
    covered = set()
    for old_pattern, new_pattern, where in mapping_rows("eval"):
        for old_key, new_key in expand(old_pattern, new_pattern, baselines=["zlab"], slots=4):
            if old_key not in old:
                assert old_pattern != old_key, f"docs/metrics-keys.md maps {old_key}, which the old eval.json never held"
                continue  # a placeholder value this fixture does not produce
            covered.add(old_key)
            assert at(details, new_key) == old[old_key], (old_key, new_key)
            if where == "yes":
                assert at(headline, new_key) == old[old_key], (old_key, new_key)
            else:
                with pytest.raises((KeyError, StopIteration)):
                    at(headline, new_key)
    assert covered == set(old), f"old keys without a row in docs/metrics-keys.md: {sorted(set(old) - covered)}"

    # comparison.json's rows (every drafter) are details.json's candidates, by both tables
    rows = [(o, n) for o, n, _ in mapping_rows("eval") if not o.startswith(("baselines.", "chosen", "teacher_forced_seconds"))]
    rows += [(o, n) for o, n, _ in mapping_rows("comparison")]
    for row in golden["rows"]:
        candidate = next(c for c in details["candidates"] if c["name"] == row["name"])
        seen = set()
        for old_pattern, new_pattern in rows:
            for old_key, new_key in expand(old_pattern, new_pattern, baselines=[], slots=4):
                if old_key in row:
                    seen.add(old_key)
                    assert at(candidate, new_key) == row[old_key], (row["name"], old_key, new_key)
        assert seen == set(row), f"{row['name']}: comparison keys without a row: {sorted(set(row) - seen)}"


def test_runs_keyed_by_candidate_and_mode_are_written_under_the_names_they_always_had(tmp_path):
    """Issue #46 item 3: evaluate keys its runs by `RunKey` (candidate, `DecodingMode`), not by
    "name/tree8" strings; the files keep the names and the columns they had (e2e.json's per-prompt
    keys, best_mode's columns in comparison.csv)."""
    evaluation, blocks, greedy = fixed_evaluation()
    assert all(isinstance(key, RunKey) for prompt in greedy for key in prompt.speculative)
    result = EvaluationResult(record=evaluation, blocks=blocks, categories=CATEGORIES, prompt_ids=["a", "b", "c", "d"], e2e_results=greedy)
    write_outputs(result, out_dir=tmp_path / "eval", metrics_path=tmp_path / "eval.json", plots_dir=tmp_path / "plots")
    prompts = strict(tmp_path / "eval" / "e2e.json")["prompts"]
    runs = {"step_000200", "step_000200/tree4", "step_000200/tree8", "zlab", "zlab/tree4", "zlab/tree8"}
    assert all(set(prompt) - {"prompt_id", "plain_tokens", "plain_seconds", "plain_prefill_seconds"} == runs for prompt in prompts)
    assert prompts[1]["step_000200"]["identical"] is False and prompts[2]["step_000200/tree8"]["identical"] is False
    header = (tmp_path / "eval" / "comparison.csv").read_text().splitlines()[0].split(",")
    best = [column for column in header if column.startswith("best_mode.")]
    assert best[:7] == ["best_mode.mode", "best_mode.speedup", "best_mode.tau", "best_mode.tau_ci95", "best_mode.lossless_rate",
                        "best_mode.verify_tokens", "best_mode.tree_budget"]


def test_mismatches_are_structured_with_their_near_tie_flag(tmp_path):
    golden = json.loads(GOLDEN.read_text())
    evaluation, _, greedy = fixed_evaluation()
    decoding = evaluation.chosen_record.decoding
    assert decoding.chain.mismatches == [Mismatch(prompt_id="p1", position=3, near_tie=True)]
    assert decoding.trees[8].mismatches == [Mismatch(prompt_id="p2", position=3, near_tie=False)]
    assert (decoding.chain.near_tie_mismatches, decoding.trees[8].near_tie_mismatches) == (1, 0)
    # what the old strings said, now as fields
    assert golden["mismatches"]["step_000200"] == ["p1 at answer token 3, a near-tie of the target's logits", "p2 at answer token 3 (tree 8)"]
    assert all(not run.mismatches and run.lossless_rate is None for run in decoding.sampled.values())  # samples part by design
    details = to_metrics(evaluation, detail=True)
    assert details["chain"]["mismatches"] == [{"prompt_id": "p1", "position": 3, "near_tie": True}]
    assert details["tree"]["8"]["mismatches"] == [{"prompt_id": "p2", "position": 3, "near_tie": False}]
    assert "mismatches" not in to_metrics(evaluation)["chain"]  # eval.json keeps the counts
    summary = summarize_end_to_end(greedy, CHAINS["step_000200"])
    assert summary.mismatches[0].near_tie and summary.lossless_rate == pytest.approx(2 / 3, abs=1e-4)


def test_eval_json_is_the_headline_of_details_json_under_the_same_paths():
    evaluation, _, _ = fixed_evaluation()
    headline, details = to_metrics(evaluation), to_metrics(evaluation, detail=True)

    def leaves(tree, prefix=()):
        for key, value in tree.items():
            yield from leaves(value, prefix + (key,)) if isinstance(value, dict) else [(prefix + (key,), value)]

    full = dict(leaves(details))
    assert all(full[path] == value for path, value in leaves(headline))
    assert sorted(headline) == ["baselines", "best_mode", "chain", "chosen", "sampled", "teacher_forced", "tree"]
    assert len(list(leaves(headline))) < len(full) / 4
    assert headline["tree"]["8"] == {"streak": 1.597, "tau": 3.5, "speedup": 1.2192}
    assert set(details["extras"]) >= {"tau_argmax", "tau_oracle", "tau_selector_gain", "slot1_topk_recall"}
    dflash = replace(evaluation, candidates=[replace(c, teacher_forced=replace(c.teacher_forced, extras={})) for c in evaluation.candidates])
    assert "extras" not in to_metrics(dflash, detail=True)  # an architecture without extras writes no section


# ----------------------------------------------------------------------------- strict JSON


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # matplotlib, drawing the infinite tau
def test_eval_metrics_with_missing_values_are_strict_json_with_null(tmp_path):
    # A tiny run leaves slots no block reached (NaN) and an interval over one prompt; a bare NaN
    # in eval.json breaks jq, JavaScript and some DVC versions' metrics diff.
    evaluation, blocks, greedy = fixed_evaluation()
    nan = float("nan")
    chosen = evaluation.chosen_record
    scored = replace(chosen.teacher_forced, tau=Interval(1.25, nan), slot_acceptance=[0.5, 0.4, nan, np.float32("nan")],
                     slot_acceptance_conditional=[0.5, nan, nan, nan], extras={"slot4_topk_recall": nan})
    chain = replace(chosen.decoding.chain, tau=Interval(float("inf"), nan), speedup=None)
    broken = replace(chosen, teacher_forced=scored, decoding=replace(chosen.decoding, chain=chain))
    baseline = evaluation.candidate("zlab")
    baseline = replace(baseline, teacher_forced=replace(baseline.teacher_forced, tau=Interval(float("-inf"), 0.1)))
    evaluation = replace(evaluation, candidates=[broken if c.name == chosen.name else baseline if c.name == "zlab" else c
                                                 for c in evaluation.candidates], teacher_forced_seconds=nan)
    result = EvaluationResult(record=evaluation, blocks=blocks, categories=CATEGORIES, prompt_ids=["a", "b", "c", "d"], e2e_results=greedy)
    metrics_path = tmp_path / "metrics" / "eval.json"
    write_outputs(result, out_dir=tmp_path / "eval", metrics_path=metrics_path, plots_dir=tmp_path / "plots")
    metrics, details = strict(metrics_path), strict(tmp_path / "eval" / "details.json")
    assert metrics["teacher_forced"]["tau_ci95"] is None and metrics["chain"]["tau"] is None and metrics["chain"]["speedup"] is None
    assert metrics["baselines"]["zlab"]["teacher_forced"]["tau"] is None and details["teacher_forced_seconds"] is None
    assert details["teacher_forced"]["slots"]["3"] == {"acceptance": None, "acceptance_cond": None}
    assert details["teacher_forced"]["slots"]["4"]["acceptance"] is None and details["extras"]["slot4_topk_recall"] is None
    assert (metrics["teacher_forced"]["tau"], metrics["teacher_forced"]["blocks"], metrics["chosen"]) == (1.25, 22, {"name": "step_000200",
                                                                                                                       "step": 200})
    for name in ("e2e.json", "best.json"):
        strict(tmp_path / "eval" / name)
    assert (tmp_path / "eval" / "comparison.csv").read_text().startswith("name,kind,step,path,block_size,num_layers,teacher_forced.tau,")
    assert {p.name for p in (tmp_path / "plots").iterdir()} == {"eval_tau_by_step.csv", "eval_slots.csv", "eval_tau.png", "eval_slots.png",
                                                                 "eval_baselines.png"}


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # matplotlib, drawing the infinite tau
def test_an_undefined_value_is_empty_in_every_csv_null_in_json_and_n_a_on_the_console(tmp_path):
    # One val prompt in a category (or in all): its interval is infinite in memory. The CSVs wrote
    # `inf`, which pandas and `dvc plots` read as a number, while the JSON had null and the console n/a.
    import pandas as pd

    evaluation, blocks, greedy = fixed_evaluation()
    inf, nan = float("inf"), float("nan")
    chosen = evaluation.chosen_record
    scored = replace(chosen.teacher_forced, tau=Interval(1.25, inf), slot_acceptance=[0.5, 0.4, nan, nan],
                     slot_acceptance_conditional=[0.5, nan, nan, nan], categories={"chat": Interval(1.5, inf)},
                     ddtree_streak={**chosen.teacher_forced.ddtree_streak, 8: Interval(nan, inf)})
    chain = replace(chosen.decoding.chain, speedup=None, break_even_tau=inf)
    broken = replace(chosen, teacher_forced=scored, decoding=replace(chosen.decoding, chain=chain))
    evaluation = replace(evaluation, candidates=[broken if c.name == chosen.name else c for c in evaluation.candidates])
    result = EvaluationResult(record=evaluation, blocks=blocks, categories=CATEGORIES, prompt_ids=["a", "b", "c", "d"], e2e_results=greedy)
    write_outputs(result, out_dir=tmp_path / "eval", metrics_path=tmp_path / "eval.json", plots_dir=tmp_path / "plots")

    csvs = [tmp_path / "eval" / "comparison.csv", *sorted((tmp_path / "plots").glob("*.csv"))]
    assert {path.name for path in csvs} == {"comparison.csv", "eval_tau_by_step.csv", "eval_slots.csv"}
    for path in csvs:
        text = path.read_text()
        assert not re.search(r"(^|,)-?(inf|nan|NaN|None)(,|$)", text, re.MULTILINE), f"{path.name}:\n{text}"
        frame = pd.read_csv(path)
        numbers = frame.select_dtypes("number")
        assert not np.isinf(numbers.to_numpy(dtype=float)).any(), path.name
    rows = pd.read_csv(csvs[0]).set_index("name")
    for column in ("teacher_forced.tau_ci95", "teacher_forced.categories.chat.tau_ci95", "tree.8.streak", "chain.speedup",
                   "chain.break_even_tau"):
        assert np.isnan(rows.loc["step_000200", column]), column
    assert rows.loc["step_000200", "teacher_forced.tau"] == 1.25
    by_step = pd.read_csv(tmp_path / "plots" / "eval_tau_by_step.csv").set_index("step")
    assert np.isnan(by_step.loc[200, "tau_ci95"]) and np.isnan(by_step.loc[200, "ddtree8_streak"])
    assert pd.read_csv(tmp_path / "plots" / "eval_slots.csv")["acceptance"].isna().tolist() == [False, True, True, True]

    details = strict(tmp_path / "eval" / "details.json")
    assert details["teacher_forced"]["categories"]["chat"]["tau_ci95"] is None and details["chain"]["speedup"] is None
    chosen_row = next(line for line in summary_table(evaluation).splitlines() if "step_000200" in line)
    assert "inf" not in chosen_row and "nan" not in chosen_row.lower().replace("n/a", "") and chosen_row.count("n/a") >= 3
    line = console_lines(evaluation)[0]
    assert "± n/a" in line and "speedup n/a" in line and "break-even tau on this machine n/a" in line and "None" not in line


def with_budgets(evaluation: Evaluation, budgets: list[int], *, trees: bool = True) -> Evaluation:
    """The fixture scored (and, with `trees`, decoded) at these DDTree budgets instead of 4 and 8."""
    def rebudget(candidate):
        streak = {budget: Interval(1.0 + budget / 10, 0.1) for budget in budgets}
        decoding = candidate.decoding
        if decoding is not None:
            run = next(iter(decoding.trees.values()))
            decoding = replace(decoding, trees={budget: run for budget in budgets} if trees else {}, best=None)
        return replace(candidate, teacher_forced=replace(candidate.teacher_forced, ddtree_streak=streak), decoding=decoding)

    return replace(evaluation, candidates=[rebudget(c) for c in evaluation.candidates])


@pytest.mark.parametrize("budgets", [[4, 16], []], ids=["4,16", "none"])
def test_the_ddtree_columns_follow_the_configured_tree_budgets(budgets, tmp_path):
    evaluation, blocks, greedy = fixed_evaluation()
    evaluation = with_budgets(evaluation, budgets)
    result = EvaluationResult(record=evaluation, blocks=blocks, categories=CATEGORIES, prompt_ids=["a", "b", "c", "d"], e2e_results=greedy)
    write_outputs(result, out_dir=tmp_path / "eval", metrics_path=tmp_path / "eval.json", plots_dir=tmp_path / "plots")
    header = (tmp_path / "plots" / "eval_tau_by_step.csv").read_text().splitlines()[0]
    assert header == ",".join(["step", "tau", "tau_ci95"] + [f"ddtree{budget}_streak" for budget in budgets])
    table_header = summary_table(evaluation).splitlines()[0].split()
    assert [column for column in table_header if column.startswith("ddtree")] == [f"ddtree{budget}_streak" for budget in budgets]
    comparison = (tmp_path / "eval" / "comparison.csv").read_text().splitlines()[0].split(",")
    assert sorted({column.split(".")[1] for column in comparison if column.startswith("tree.")}, key=int) == [str(b) for b in budgets]


def test_the_console_names_only_the_modes_that_were_decoded():
    evaluation, _, _ = fixed_evaluation()
    lines = console_lines(evaluation)
    assert lines[-1].startswith("evaluate: trees at budget 4: tau ") and " | sampled at T=0.6: tau " in lines[-1]
    untreed = console_lines(with_budgets(evaluation, [], trees=False))
    assert untreed[-1].startswith("evaluate: sampled at T=0.6: tau ") and not any("trees at budget" in line for line in untreed)
    chosen = evaluation.chosen_record
    plain = replace(evaluation, candidates=[replace(c, decoding=replace(c.decoding, trees={}, sampled={}, best=None))
                                            if c.name == chosen.name else c for c in evaluation.candidates])
    assert len(console_lines(plain)) == 1 and "trees" not in console_lines(plain)[0] and "sampled" not in console_lines(plain)[0]


def test_an_evaluation_of_baselines_alone_chooses_the_first_and_decodes_nothing():
    blocks = fixed_blocks()
    records = [CandidateRecord(name=name, kind="baseline", path=name, step=None, block_size=5, num_layers=1,
                               teacher_forced=summarize_blocks(scores)) for name, scores in blocks.items()]
    evaluation = choose_and_pair(records, blocks, teacher_forced_seconds=1.0)
    assert evaluation.chosen == "step_000100" and evaluation.chosen_record.vs_chosen.mean == 0
    metrics = to_metrics(evaluation)
    assert metrics["chosen"] == {"name": "step_000100", "step": None} and "chain" not in metrics and "sampled" not in metrics
    assert metrics["tree"]["8"] == {"streak": evaluation.chosen_record.teacher_forced.ddtree_streak[8].mean}
    assert evaluation.chosen_record.decoding is None  # nothing decoded: no end-to-end sections


# ----------------------------------------------------------------------------- the best greedy mode


def with_speedups(decoding, chain: float | None, **trees: float | None):
    """The fixture's chain and trees with these speedups (trees by "tree<budget>"), all else kept."""
    return (replace(decoding.chain, speedup=chain),
            {budget: replace(run, speedup=trees.get(f"tree{budget}", run.speedup)) for budget, run in decoding.trees.items()})


def test_the_best_mode_is_the_fastest_lossless_greedy_mode():
    evaluation, _, _ = fixed_evaluation()
    decoding = evaluation.candidate("zlab").decoding  # every greedy mode of the baseline is lossless
    # a CPU where the chain is break-even and a small tree pays (the 2-core EPYC)
    chain, trees = with_speedups(decoding, 0.97, tree4=1.08, tree8=1.02)
    best = choose_decoding_mode(chain, trees, machine="cpu on EPYC", engine="static-kv")
    assert (best.mode, best.speedup, best.decoding_mode.tree_budget, best.decoding_mode.verify_tokens) == ("tree4", 1.08, 4, None)
    assert (best.tau, best.lossless_rate, best.machine, best.engine) == (trees[4].tau, 1.0, "cpu on EPYC", "static-kv")
    # the record names the engine it was measured on, and reads back the same (best.json, the export's provenance)
    from dflash_pipeline.evaluate.report import best_mode_figures
    from dflash_pipeline.measure.record import BestMode

    assert best_mode_figures(best)["engine"] == "static-kv" and BestMode.from_json(best_mode_figures(best), "best.json") == best
    assert best.speedups == {"chain": 0.97, "tree4": 1.08, "tree8": 1.02} and best.refused == {}
    # where the chain pays best it wins, at its verify length
    chain, trees = with_speedups(decoding, 1.4, tree4=1.29, tree8=1.2)
    best = choose_decoding_mode(chain, trees)
    assert (best.mode, best.speedup, best.decoding_mode.verify_tokens, best.decoding_mode.tree_budget) == ("chain", 1.4, 4, None)
    # equal speedups: the chain, then the smaller tree (the same speed for less verify work)
    assert choose_decoding_mode(*with_speedups(decoding, 1.1, tree4=1.1, tree8=1.1)).mode == "chain"
    assert choose_decoding_mode(*with_speedups(decoding, 1.0, tree4=1.1, tree8=1.1)).mode == "tree4"
    # a mode without a measured speedup cannot win; with none measured nothing does
    best = choose_decoding_mode(*with_speedups(decoding, None, tree4=1.05, tree8=None))
    assert best.mode == "tree4" and best.refused == {"chain": "no speedup measured", "tree8": "no speedup measured"}
    nothing = choose_decoding_mode(*with_speedups(decoding, None, tree4=None, tree8=None))
    assert (nothing.mode, nothing.speedup, nothing.tau) == (None, None, None) and set(nothing.refused) == {"chain", "tree4", "tree8"}


def test_a_lossy_mode_never_wins_however_fast():
    evaluation, _, _ = fixed_evaluation()
    decoding = evaluation.chosen_record.decoding  # its chain parts at a near-tie on p1, its tree of 8 on p2 for real
    chain, trees = with_speedups(decoding, 1.0, tree4=1.1, tree8=3.0)
    best = choose_decoding_mode(chain, trees)
    assert best.mode == "tree4" and best.refused == {"tree8": "1 answer(s) part from plain greedy decoding not at a near-tie"}
    # near-tie partings only, but more of them than the chain's: not rounding alone, refused too
    tied = replace(trees[8], mismatches=[Mismatch("p1", 3, True), Mismatch("p2", 3, True)], lossless_rate=0.3333)
    best = choose_decoding_mode(chain, {4: trees[4], 8: tied})
    assert best.mode == "tree4" and best.refused == {"tree8": "lossless rate 0.3333 below the chain's 0.6667"}
    # as many near-tie partings as the chain: rounding, as the chain meets it; it may win
    tied = replace(tied, mismatches=[Mismatch("p1", 3, True)], lossless_rate=0.6667)
    assert choose_decoding_mode(chain, {4: trees[4], 8: tied}).mode == "tree8"
    # the chain itself parting for real is refused: a tree that stays lossless wins though slower
    lossy_chain = replace(chain, speedup=2.0, mismatches=[Mismatch("p1", 3, False)])
    best = choose_decoding_mode(lossy_chain, trees)
    assert best.mode == "tree4" and set(best.refused) == {"chain", "tree8"}


def test_the_headline_speedup_is_the_best_modes_and_names_it(tmp_path):
    evaluation, blocks, greedy = fixed_evaluation()
    chosen = evaluation.chosen_record
    chain, trees = with_speedups(chosen.decoding, 0.97, tree4=1.08)
    decoding = replace(chosen.decoding, chain=chain, trees=trees, best=choose_decoding_mode(chain, trees, machine="cpu on EPYC"))
    evaluation = replace(evaluation, candidates=[replace(c, decoding=decoding) if c.name == chosen.name else c for c in evaluation.candidates])
    headline = to_metrics(evaluation)
    assert headline["best_mode"] == {"mode": "tree4", "speedup": 1.08, "tau": trees[4].tau.mean, "lossless_rate": 1.0}
    assert headline["chain"]["speedup"] == 0.97 and headline["tree"]["4"]["speedup"] == 1.08  # each mode's own figures stay
    assert headline["baselines"]["zlab"]["best_mode"] == {"mode": "chain", "speedup": 1.4}
    details = to_metrics(evaluation, detail=True)["best_mode"]
    assert details["speedups"] == {"chain": 0.97, "tree4": 1.08, "tree8": 1.2192} and set(details["refused"]) == {"tree8"}
    assert (details["tree_budget"], details["verify_tokens"]) == (4, None)

    result = EvaluationResult(record=evaluation, blocks=blocks, categories=CATEGORIES, prompt_ids=["a", "b", "c", "d"], e2e_results=greedy)
    write_outputs(result, out_dir=tmp_path / "eval", metrics_path=tmp_path / "eval.json", plots_dir=tmp_path / "plots")
    assert strict(tmp_path / "eval.json")["best_mode"]["mode"] == "tree4"
    best = strict(tmp_path / "eval" / "best.json")["best_mode"]  # what the export stage passes on to `generate`
    assert (best["mode"], best["tree_budget"], best["speedups"]["chain"], best["machine"]) == ("tree4", 4, 0.97, "cpu on EPYC")
    import pandas as pd

    rows = pd.read_csv(tmp_path / "eval" / "comparison.csv").set_index("name")
    assert rows.loc["step_000200", "best_mode.mode"] == "tree4" and rows.loc["zlab", "best_mode.speedup"] == 1.4
    table = summary_table(evaluation).splitlines()
    assert table[0].split()[-2:] == ["best_mode", "best_speedup"]
    assert re.search(r" tree4 +1\.08", next(line for line in table if "step_000200" in line))


def test_no_qualifying_mode_is_written_as_null_and_the_chain_keeps_its_figures(tmp_path):
    evaluation, blocks, greedy = fixed_evaluation()
    chosen = evaluation.chosen_record
    chain, trees = with_speedups(chosen.decoding, None, tree4=None, tree8=None)
    decoding = replace(chosen.decoding, chain=chain, trees=trees, best=choose_decoding_mode(chain, trees))
    evaluation = replace(evaluation, candidates=[replace(c, decoding=decoding) if c.name == chosen.name else c for c in evaluation.candidates])
    result = EvaluationResult(record=evaluation, blocks=blocks, categories=CATEGORIES, prompt_ids=["a", "b", "c", "d"], e2e_results=greedy)
    write_outputs(result, out_dir=tmp_path / "eval", metrics_path=tmp_path / "eval.json", plots_dir=tmp_path / "plots")
    headline = strict(tmp_path / "eval.json")
    assert headline["best_mode"] == {"mode": None, "speedup": None, "tau": None, "lossless_rate": None}
    assert headline["chain"]["tau"] == chain.tau.mean
    assert strict(tmp_path / "eval" / "best.json")["best_mode"]["mode"] is None
