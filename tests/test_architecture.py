"""The package's shape, kept by tests: layers import downwards only, no stage module imports
another, and every module a DVC stage runs is one of that stage's `deps` (so editing any of them
makes exactly the stages that run it stale)."""

import ast
from pathlib import Path

import pytest
import yaml

from conftest import REPO_ROOT

PACKAGE = REPO_ROOT / "src" / "dflash_pipeline"
# The layer table of the README's "Where things live": a module imports only from lower layers
# (and, within its own layer, only where the table's order allows: earlier entries first).
LAYERS = [
    ["errors", "files", "config", "runtime", "devices", "stats", "progress"],
    ["prompts", "shards", "hf_folder", "embedded", "target", "dflash2", "model", "serving", "sampling", "trees"],
    ["blocks", "checkpoints", "drafters", "engine", "scoring", "loss"],
    ["generate", "capture", "train", "evaluate", "export"],
    ["report"],
    ["cli"],
]
STAGE_MODULES = set(LAYERS[3])


def package_imports(path: Path) -> set[str]:
    """Package modules a file imports anywhere in it (function-level imports included)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "dflash_pipeline":
                names.update(alias.name for alias in node.names)
            elif node.module.startswith("dflash_pipeline."):
                names.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            names.update(alias.name.split(".")[1] for alias in node.names if alias.name.startswith("dflash_pipeline."))
    return names - {"__init__"}


def closure(path: Path) -> set[str]:
    """Every package module `path` runs, directly or through other package modules."""
    seen, todo = set(), list(package_imports(path))
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(package_imports(PACKAGE / f"{name}.py"))
    return seen


def test_every_module_has_a_layer_and_imports_only_from_below():
    layer_of = {name: number for number, names in enumerate(LAYERS) for name in names}
    modules = {p.stem for p in PACKAGE.glob("*.py")} - {"__init__"}
    assert modules == set(layer_of), f"modules without a layer, or layers without a module: {modules ^ set(layer_of)}"
    for name in sorted(modules):
        for imported in package_imports(PACKAGE / f"{name}.py"):
            assert layer_of[imported] < layer_of[name] or (layer_of[imported] == layer_of[name] and imported != name
                                                            and layer_of[name] != 3), \
                f"{name}.py (layer {layer_of[name]}) imports {imported}.py (layer {layer_of[imported]})"


def test_no_stage_module_imports_another():
    for name in sorted(STAGE_MODULES):
        others = package_imports(PACKAGE / f"{name}.py") & (STAGE_MODULES - {name})
        assert not others, f"{name}.py imports the stage module(s) {sorted(others)}"


def _stages():
    return yaml.safe_load((REPO_ROOT / "dvc.yaml").read_text())["stages"]


@pytest.mark.parametrize("stage", sorted(_stages()))
def test_a_stage_depends_on_every_package_module_it_runs(stage):
    spec = _stages()[stage]
    script = spec["cmd"].split()[1]
    assert script == f"stages/{stage}.py", f"{stage}: cmd runs {script}"
    deps = set(spec["deps"])
    assert script in deps, f"dvc.yaml: stage {stage} does not depend on its own script {script}"
    needed = {f"src/dflash_pipeline/{name}.py" for name in closure(REPO_ROOT / script)}
    missing = sorted(needed - deps)
    assert not missing, f"dvc.yaml: stage {stage} runs {missing} but does not list them in deps"
    extra = sorted(d for d in deps if d.startswith("src/") and d not in needed)
    assert not extra, f"dvc.yaml: stage {stage} lists {extra}, which it never imports"


def test_the_dependency_check_sees_function_level_and_indirect_imports(tmp_path):
    # evaluate's script imports the package inside main(); the drafter model comes in through scoring.
    evaluate = closure(REPO_ROOT / "stages" / "evaluate.py")
    assert {"evaluate", "scoring", "engine", "model", "blocks", "checkpoints", "serving", "target"} <= evaluate
    script = tmp_path / "stage.py"
    script.write_text("def main():\n    from dflash_pipeline.checkpoints import load_checkpoint\n")
    assert closure(script) >= {"checkpoints", "model", "errors", "files"}
