"""The tree's shape, kept by tests: the package's wings are layers, each importing only itself and
the wings below it; the stage wings never import each other; code outside the decoding wing enters it
through its two entry modules only; no import circle anywhere in the tree (src/, bench/, tools/,
stages/, tests/support, tests/oracles); and every module a DVC stage runs is one of that stage's
`deps` (so editing any of them makes exactly the stages that run it stale)."""

import pytest
import yaml
from support.helpers import REPO_ROOT

from tools.import_graph import (
    closure,
    cycles,
    module_path,
    package_imports,
    package_modules,
    stage_deps,
    tree_graph,
    wings,
)

# The wings, ground up (README "Where things live"; src/dflash_pipeline/__init__.py). A wing imports
# only itself and wings of earlier rows; the wings of one row never import each other.
LAYERS = [
    ["foundation"],   # errors, files, params, devices, statistics, progress
    ["target"],       # the target model: a folder, the embedded GGUF, loading and fingerprinting
    ["data"],         # prompt sets, answer tables, Arrow shards, training blocks and their masks
    ["speculation"],  # sampling, draft trees, decoding modes: tensors, no model
    ["drafters"],     # the drafter family, its checkpoints and serving format, loading a drafter folder
    ["decoding"],     # the decoding engine: static caches, graphed steps, plain and speculative decoding
    ["measure"],      # shared by train and evaluate: scoring, typed records, end-to-end runs, verify planning
    ["generate", "capture", "train", "evaluate", "export", "integrity"],  # the stages (and run checks)
    ["cli"],          # the console command
]


def layer_of() -> dict[str, int]:
    return {wing: number for number, row in enumerate(LAYERS) for wing in row}


def wing_imports() -> dict[str, set[str]]:
    """Wing -> the other wings its modules import (anywhere in the module, function-level included)."""
    known, graph = package_modules(), {}
    for name in known:
        wing = name.split(".")[0]
        imported = {other.split(".")[0] for other in package_imports(module_path(name), known)}
        graph.setdefault(wing, set()).update(imported - {wing})
    return graph


def upward_imports(graph: dict[str, set[str]], layers: dict[str, int]) -> list[str]:
    """Every wing-to-wing import that does not run strictly downwards."""
    return sorted(f"{wing} -> {other}" for wing, others in graph.items() for other in others
                  if layers.get(other, len(LAYERS)) >= layers.get(wing, -1))


# The decoding wing's entries for outside code: the target alone (generate's batched answers, plain
# decoding, forward costs) and speculation (the session, `Speculation`, `speculative_decode`).
DECODING_ENTRIES = {"decoding.plain", "decoding.session"}
# Outside code that reaches past them on purpose, each file with why: benches that time the
# engine's own parts, and tests of a part's contract that no entry shows. The wing's own tests
# (tests/decoding/) and the host loops it replaced (tests/oracles/) may import any of its modules.
DECODING_INTERNALS_USED_BY = {
    "bench/gpu/probe.py": "times the steps' phases and the graph runner on a GPU",
    "tests/conftest.py": "`gpu_shaped_steps` switches the static decoder's CPU trim off",
    "tests/support/speculation.py": "patches the speculative step's draft logits with an oracle",
    "tests/evaluate/test_run.py": "fakes the loop's clock and the steps' prefill to time the prefill apart",
    "tests/drafters/test_attention.py": "the static draft cache attends in the autocast dtype, as training does",
    "tests/speculation/test_sampling.py": "the step's device acceptance passes the sampling rule's own test",
    "tests/bench/test_device_paths.py": "the step's feature rounding equals the shards' round trip",
}
FREE_TO_IMPORT_DECODING = ("src/dflash_pipeline/decoding/", "tests/decoding/", "tests/oracles/")


def decoding_internals_imported() -> dict[str, list[str]]:
    """File (relative to the repository) -> the decoding modules other than the entries it imports,
    for every Python file of src/, stages/, scripts/, bench/ and tests/ outside FREE_TO_IMPORT_DECODING."""
    known, found = package_modules(), {}
    for folder in ("src", "stages", "scripts", "bench", "tests"):
        for path in sorted((REPO_ROOT / folder).rglob("*.py")):
            relative = path.relative_to(REPO_ROOT).as_posix()
            if relative.startswith(FREE_TO_IMPORT_DECODING):
                continue
            internal = sorted(name for name in package_imports(path, known)
                              if name.split(".")[0] == "decoding" and name not in DECODING_ENTRIES)
            if internal:
                found[relative] = internal
    return found


def test_outside_code_enters_decoding_through_its_two_entries():
    """Issue #46: outside code entered the decoding wing through five modules. Now through two
    (`plain`, `session`); the rest of the wing is internal, so its steps, loop and graph runner can
    change without their callers. A file listed in DECODING_INTERNALS_USED_BY must still need to be."""
    found = decoding_internals_imported()
    unlisted = {path: names for path, names in found.items() if path not in DECODING_INTERNALS_USED_BY}
    assert unlisted == {}, f"import these through decoding.plain or decoding.session, or list the file with why: {unlisted}"
    assert sorted(set(DECODING_INTERNALS_USED_BY) - set(found)) == [], "listed, but imports only the entries now: drop it from the list"
    assert all(module_path(entry).is_file() for entry in DECODING_ENTRIES)


def test_the_entry_check_sees_an_internal_imported_every_way(tmp_path):
    known = package_modules()
    for line in ("from dflash_pipeline.decoding.loop import run_steps", "from dflash_pipeline.decoding import graphs",
                 "import dflash_pipeline.decoding.static_speculation as static"):
        (tmp_path / "user.py").write_text(f"def main():\n    {line}\n")
        assert [name for name in package_imports(tmp_path / "user.py", known) if name not in DECODING_ENTRIES] != [], line
    (tmp_path / "user.py").write_text("from dflash_pipeline.decoding.session import open_session\nfrom dflash_pipeline.decoding import plain\n")
    assert package_imports(tmp_path / "user.py", known) == DECODING_ENTRIES


def test_every_module_lives_in_a_wing_that_has_a_layer():
    layers = layer_of()
    loose = sorted(name for name in package_modules() if "." not in name and name not in wings())
    assert not loose, f"modules outside any wing: {loose} (src/dflash_pipeline/<wing>/<module>.py)"
    assert wings() == set(layers), f"wings without a layer, or layers without a wing: {wings() ^ set(layers)}"


def test_imports_run_downwards_and_no_wing_cycle():
    graph = wing_imports()
    assert upward_imports(graph, layer_of()) == []
    assert cycles(graph) == []


def test_the_checks_see_an_upward_import_a_sideways_one_and_a_cycle():
    layers = layer_of()
    graph = {"data": {"drafters"}, "train": {"evaluate", "measure"}, "measure": {"decoding"}}
    assert upward_imports(graph, layers) == ["data -> drafters", "train -> evaluate"]
    assert cycles({"drafters": {"decoding"}, "decoding": {"drafters"}, "data": {"foundation"}}) == [["decoding", "drafters", "decoding"]]


def test_no_import_circle_anywhere_in_the_tree():
    """Module by module, function-level imports included: a circle between two bench files (one
    importing the other's toy data, the other its figures) is as much a circle as one in src/."""
    circles = [" -> ".join(circle) for circle in cycles(tree_graph())]
    assert not circles, f"import circles: {circles}"


def test_the_tree_graph_sees_function_level_sibling_and_relative_imports(tmp_path):
    (tmp_path / "bench" / "gpu").mkdir(parents=True)
    (tmp_path / "tools").mkdir()
    (tmp_path / "bench" / "__init__.py").write_text("")
    (tmp_path / "bench" / "toy.py").write_text("def main():\n    from bench.gpu.figures import table\n")
    (tmp_path / "bench" / "gpu" / "__init__.py").write_text("from . import figures\n")
    (tmp_path / "bench" / "gpu" / "figures.py").write_text("def f():\n    import probe\n")  # run as a script: its folder first
    (tmp_path / "bench" / "gpu" / "probe.py").write_text("from bench.toy import main\nfrom ..toy import main\n")
    (tmp_path / "tools" / "report.py").write_text("import json\nfrom bench import toy\n")
    graph = tree_graph(tmp_path, {"bench": ".", "tools": "."})
    assert graph == {"bench": set(), "bench.toy": {"bench.gpu.figures"}, "bench.gpu": {"bench.gpu.figures"},
                     "bench.gpu.figures": {"bench.gpu.probe"}, "bench.gpu.probe": {"bench.toy"}, "tools.report": {"bench.toy"}}
    assert cycles(graph) == [["bench.gpu.figures", "bench.gpu.probe", "bench.toy", "bench.gpu.figures"]]


LAUNCHER = "stages/launch.py"


def _stages():
    return yaml.safe_load((REPO_ROOT / "dvc.yaml").read_text())["stages"]


@pytest.mark.parametrize("stage", sorted(_stages()))
def test_a_stage_depends_on_every_package_module_it_runs(stage):
    spec = _stages()[stage]
    words = spec["cmd"].split()
    script = next((word for word in words if word.startswith("stages/") and word != LAUNCHER), None)
    assert script == f"stages/{stage}.py", f"{stage}: cmd runs {script}"
    deps = set(spec["deps"])
    assert script in deps, f"dvc.yaml: stage {stage} does not depend on its own script {script}"
    if LAUNCHER in words:  # run through the launcher (launch.processes): editing it reruns the stage too
        assert LAUNCHER in deps, f"dvc.yaml: stage {stage} runs {LAUNCHER} but does not list it in deps"
    needed = set(stage_deps(REPO_ROOT / script))
    fix = "(python tools/sync_dvc_deps.py rewrites them)"
    missing = sorted(needed - deps)
    assert not missing, f"dvc.yaml: stage {stage} runs {missing} but does not list them in deps {fix}"
    extra = sorted(d for d in deps if d.startswith("src/") and d not in needed)
    assert not extra, f"dvc.yaml: stage {stage} lists {extra}, which it never imports {fix}"


def test_the_dependency_check_sees_function_level_and_indirect_imports(tmp_path):
    # evaluate's script imports the package inside main(); the drafter model comes in through scoring.
    evaluate = closure(REPO_ROOT / "stages" / "evaluate.py")
    assert {"evaluate.run", "measure.scoring", "decoding.session", "drafters.core", "data.blocks", "drafters.checkpoints",
            "drafters.serving", "target.load"} <= evaluate
    script = tmp_path / "stage.py"
    script.write_text("def main():\n    from dflash_pipeline.drafters.checkpoints import load_checkpoint\n")
    assert closure(script) >= {"drafters.checkpoints", "drafters.core", "foundation.errors", "foundation.files"}


@pytest.mark.parametrize("module, stage", [("evaluate.report", "evaluate"), ("train.report", "train")])
def test_a_stage_report_is_a_dependency_of_its_own_stage_alone(module, stage):
    # Editing evaluate's tables or plots (or train's curve) makes that stage stale and no other:
    # its report module is in that stage's deps alone, and no other stage's script runs it.
    path = str(module_path(module).relative_to(REPO_ROOT))
    stages = _stages()
    listed = {name for name, spec in stages.items() if path in spec["deps"]}
    runs = {name for name in stages if module in closure(REPO_ROOT / "stages" / f"{name}.py")}
    assert listed == runs == {stage}, f"{path}: listed in the deps of {sorted(listed)}, run by {sorted(runs)}"
