"""cli/compare_runs.py: `dflash-pipeline compare-runs` pairs two runs' chosen drafters by val prompt."""

import json

from support.console import assert_one_line_error, invoke


def _eval_folder(folder, tau_by_prompt: dict[str, list[int]], chosen="step_000100", with_prompt_ids=True):
    import pandas as pd

    folder.mkdir(parents=True)
    (folder / "best.json").write_text(json.dumps({"name": chosen}))
    rows = [{"drafter": name, "sequence": s, "prompt_id": prompt, "category": "chat", "anchor": a, "tau": tau + (name != chosen)}
            for name in (chosen, "step_000050") for s, (prompt, taus) in enumerate(tau_by_prompt.items()) for a, tau in enumerate(taus)]
    frame = pd.DataFrame(rows)
    (frame if with_prompt_ids else frame.drop(columns="prompt_id")).to_parquet(folder / "blocks.parquet", index=False)
    return folder


def test_compare_runs_pairs_the_chosen_drafters_by_prompt(tmp_path):
    taus = {"p1": [1, 2, 1, 3], "p2": [4, 4, 3], "p3": [1, 1, 2], "p4": [2, 3, 2, 2]}
    committed = _eval_folder(tmp_path / "committed", taus)
    same = invoke("compare-runs", committed, _eval_folder(tmp_path / "again", taus))
    assert same.exit_code == 0 and "on the same val blocks" in same.stdout
    assert "difference +0.0000 ± 0.0000 (paired over 4 prompts): not distinguishable at 95%" in same.stdout
    # another machine: one prompt's answer (so its blocks) differs, another prompt is missing
    drifted = {"p1": [1, 2, 2, 3], "p2": [4, 4, 3, 1], "p3": [1, 1, 2]}
    other = invoke("compare-runs", committed, _eval_folder(tmp_path / "other", drifted))
    assert "different val blocks" in other.stdout and "paired over 3 prompts" in other.stdout
    assert "not distinguishable at 95%" in other.stdout
    better = invoke("compare-runs", _eval_folder(tmp_path / "better", {p: [t + 1 for t in v] for p, v in taus.items()}), committed)
    assert "difference +1.0000 ± 0.0000" in better.stdout and "is better" in better.stdout
    assert_one_line_error(invoke("compare-runs", committed, _eval_folder(tmp_path / "old", taus, with_prompt_ids=False)),
                          "old/blocks.parquet: has no prompt_id column")
    (tmp_path / "empty").mkdir()
    assert_one_line_error(invoke("compare-runs", committed, tmp_path / "empty"), "empty/best.json", "no best.json")
