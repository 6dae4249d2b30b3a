"""The one decoding-mode type (issues #36, #46): its name, parse, JSON form, run names, the one
rule of a tree and what a step verifies in each mode."""

import pytest

from dflash_pipeline.foundation.errors import PipelineError
from dflash_pipeline.speculation.modes import DecodingMode


def test_a_mode_is_named_parsed_and_written_and_read_back_as_itself():
    for mode in (DecodingMode.chain(), DecodingMode.chain(2), DecodingMode.tree(1), DecodingMode.tree(16)):
        assert DecodingMode.from_dict(mode.as_dict(), "best_mode") == mode
        assert DecodingMode.parse(mode.name, verify_tokens=mode.verify_tokens) == mode
    assert DecodingMode.tree(8).name == "tree8" and DecodingMode.chain(2).name == "chain"
    assert DecodingMode.tree(8).as_dict() == {"mode": "tree8", "verify_tokens": None, "tree_budget": 8}
    # no mode (a record that found none) is the same keys, null, and reads back as None
    assert DecodingMode.dict_of(None) == {"mode": None, "verify_tokens": None, "tree_budget": None}
    assert DecodingMode.from_dict(DecodingMode.dict_of(None), "best_mode", optional=True) is None
    assert DecodingMode.from_dict(DecodingMode.dict_of(DecodingMode.chain(2)), "best_mode", optional=True) == DecodingMode.chain(2)
    with pytest.raises(PipelineError, match=r"^best_mode\.mode is None"):
        DecodingMode.from_dict(DecodingMode.dict_of(None), "best_mode")


def test_a_candidates_runs_are_named_by_its_name_and_a_trees_budget():
    """e2e.json's per-prompt keys, as evaluate wrote them before runs were keyed by (candidate, mode)."""
    assert DecodingMode.chain().run_name("step_001600") == DecodingMode.chain(3).run_name("step_001600") == "step_001600"
    assert DecodingMode.tree(8).run_name("step_001600") == "step_001600/tree8"


@pytest.mark.parametrize("name", ["tree", "tree0", "tree08", "tree-1", "tree 4", "trees4", "beam", "", None, 4, "tree٤"])
def test_anything_but_chain_or_tree_and_a_budget_is_one_error_naming_where(name):
    with pytest.raises(PipelineError, match=r"^best\.json: best_mode\.mode is .*expected 'chain' or 'tree<budget>'$"):
        DecodingMode.from_dict({"mode": name}, "best.json: best_mode")


def test_a_mode_is_a_chain_or_a_tree_never_both_and_its_numbers_are_whole():
    with pytest.raises(PipelineError, match=r"^tree_budget: tree verification is greedy and verifies the whole tree \(drop verify_tokens\)$"):
        DecodingMode(tree_budget=4, verify_tokens=2)
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match="expected an integer >= 1"):
            DecodingMode(tree_budget=bad)
    with pytest.raises(PipelineError, match="mode 'tree4' and tree_budget 8 disagree"):
        DecodingMode.from_dict({"mode": "tree4", "tree_budget": 8}, "x")
    with pytest.raises(PipelineError, match=r"x\.verify_tokens is '2', expected an integer >= 1"):
        DecodingMode.from_dict({"mode": "chain", "verify_tokens": "2"}, "x")


def test_the_one_rule_of_a_tree_checks_sampling_and_names_the_settings_as_given():
    sampling = object()  # any sampling setting: only whether there is one counts
    DecodingMode.chain(2).check_sampling(sampling)
    DecodingMode.tree(4).check_sampling(None)
    with pytest.raises(PipelineError, match=r"^tree_budget: .* \(drop sampling\)$"):
        DecodingMode.tree(4).check_sampling(sampling)
    options = ("--tree-budget", "--verify-tokens", "--temperature")
    assert DecodingMode.of(tree_budget=4, verify_tokens=None, sampled=False, names=options) == DecodingMode.tree(4)
    assert DecodingMode.of(tree_budget=None, verify_tokens=2, sampled=True, names=options) == DecodingMode.chain(2)
    with pytest.raises(PipelineError, match=r"^--tree-budget: tree verification is greedy and verifies the whole tree "
                                            r"\(drop --temperature / --verify-tokens\)$"):
        DecodingMode.of(tree_budget=4, verify_tokens=2, sampled=True, names=options)
    with pytest.raises(PipelineError, match=r"\(drop --temperature\)$"):
        DecodingMode.of(tree_budget=4, verify_tokens=None, sampled=True, names=options)


def test_what_a_step_verifies_in_each_mode_for_a_block():
    assert DecodingMode.chain().verified(3) == (3, 3) and DecodingMode.chain(2).verified(3) == (2, 2)
    assert DecodingMode.chain(9).verified(3) == (3, 3)  # at most B-1
    assert DecodingMode.tree(8).verified(3) == (8, 3) and DecodingMode.tree(2).verified(15) == (2, 2)
    assert DecodingMode.chain(9).for_block(4) == DecodingMode.chain(3) and DecodingMode.chain(2).for_block(4) == DecodingMode.chain(2)
    assert DecodingMode.chain().for_block(4) == DecodingMode.chain() and DecodingMode.tree(32).for_block(4) == DecodingMode.tree(32)


def test_a_mode_in_words():
    assert DecodingMode.tree(4).describe(16) == "DDTree budget 4"
    assert DecodingMode.chain().describe(16) == "chain of all 15 drafted tokens"
    assert DecodingMode.chain(15).describe(16) == "chain of all 15 drafted tokens"
    assert DecodingMode.chain(2).describe(4) == "chain verifying 2 of 3 drafted tokens"


def test_no_module_but_the_modes_module_spells_or_parses_a_mode_name():
    """The strings "chain"/"tree<budget>" were parsed by slicing in evaluate and by a regex in the
    CLI; evaluate keyed its runs by f"{name}/tree{budget}" strings and benches compared kinds with
    "tree8" (issue #46): outside modes.py a mode is a `DecodingMode`, its name made by `.name`."""
    import re

    from support.helpers import REPO_ROOT

    spelled = re.compile(r'f"tree\{|len\("tree"\)|startswith\("tree"\)|chain\|tree|"[^"]*/tree|\}/\{[^}]*(mode|tree)|["\']tree\d+["\']')
    files = [path for folder in ("src", "bench", "stages") for path in sorted((REPO_ROOT / folder).rglob("*.py"))]
    offenders = [f"{path.relative_to(REPO_ROOT)}:{number}" for path in files if path.name != "modes.py"
                 for number, line in enumerate(path.read_text().splitlines(), 1) if spelled.search(line)]
    assert offenders == []
