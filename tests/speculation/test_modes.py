"""The one decoding-mode type (issue #36): its name, parse, JSON form and checks."""

import pytest

from dflash_pipeline.foundation.errors import PipelineError
from dflash_pipeline.speculation.modes import DecodingMode


def test_a_mode_is_named_parsed_and_written_and_read_back_as_itself():
    for mode in (DecodingMode.chain(), DecodingMode.chain(2), DecodingMode.tree(1), DecodingMode.tree(16)):
        assert DecodingMode.from_dict(mode.as_dict(), "best_mode") == mode
        assert DecodingMode.parse(mode.name, verify_tokens=mode.verify_tokens) == mode
    assert DecodingMode.tree(8).name == "tree8" and DecodingMode.chain(2).name == "chain"
    assert DecodingMode.tree(8).as_dict() == {"mode": "tree8", "verify_tokens": None, "tree_budget": 8}


@pytest.mark.parametrize("name", ["tree", "tree0", "tree08", "tree-1", "tree 4", "trees4", "beam", "", None, 4, "tree٤"])
def test_anything_but_chain_or_tree_and_a_budget_is_one_error_naming_where(name):
    with pytest.raises(PipelineError, match=r"^best\.json: best_mode\.mode is .*expected 'chain' or 'tree<budget>'$"):
        DecodingMode.from_dict({"mode": name}, "best.json: best_mode")


def test_a_mode_is_a_chain_or_a_tree_never_both_and_its_numbers_are_whole():
    with pytest.raises(ValueError, match="not both"):
        DecodingMode(tree_budget=4, verify_tokens=2)
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match="expected an integer >= 1"):
            DecodingMode(tree_budget=bad)
    with pytest.raises(PipelineError, match="mode 'tree4' and tree_budget 8 disagree"):
        DecodingMode.from_dict({"mode": "tree4", "tree_budget": 8}, "x")
    with pytest.raises(PipelineError, match=r"x\.verify_tokens is '2', expected an integer >= 1"):
        DecodingMode.from_dict({"mode": "chain", "verify_tokens": "2"}, "x")


def test_a_mode_in_words():
    assert DecodingMode.tree(4).describe(16) == "DDTree budget 4"
    assert DecodingMode.chain().describe(16) == "chain of all 15 drafted tokens"
    assert DecodingMode.chain(15).describe(16) == "chain of all 15 drafted tokens"
    assert DecodingMode.chain(2).describe(4) == "chain verifying 2 of 3 drafted tokens"


def test_no_module_but_the_modes_module_spells_or_parses_a_mode_name():
    """The strings "chain"/"tree<budget>" were parsed by slicing in evaluate and by a regex in the CLI."""
    import re
    from pathlib import Path

    import dflash_pipeline

    package = Path(dflash_pipeline.__file__).parent
    spelled = re.compile(r'f"tree\{|len\("tree"\)|startswith\("tree"\)|chain\|tree')
    offenders = [f"{path.relative_to(package)}:{number}" for path in sorted(package.rglob("*.py")) if path.name != "modes.py"
                 for number, line in enumerate(path.read_text().splitlines(), 1) if spelled.search(line)]
    assert offenders == []
