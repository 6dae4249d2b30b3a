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
    ["errors", "files", "tensor_files", "config", "devices", "runtime", "stats", "progress"],
    ["data.prompts", "data.shards", "target.folder", "target.embedded", "target.load", "decoding.sampling", "decoding.trees", "decoding.static_decoder", "decoding.graphs", "decoding.loop", "decoding.modes",
     "evaluate.record", "drafters.family", "drafters.core", "drafters.architecture", "drafters.dflash", "drafters.dflash2",
     "drafters.serving", "decoding.static_speculation"],
    ["data.blocks", "drafters.checkpoints", "drafters.build", "decoding.engine", "decoding.session", "evaluate.scoring", "train.loss",
     "integrity"],
    ["generate", "capture", "train.run", "evaluate.run", "export"],
    ["train.report", "evaluate.report"],
    ["cli"],
]
STAGE_MODULES = set(LAYERS[3])
WINGS = {"data", "target", "drafters", "decoding", "train", "evaluate"}


def module_path(name: str) -> Path:
    """The file of a package module named relative to the package ("data.shards", "cli", "drafters")."""
    path = PACKAGE.joinpath(*name.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def package_modules() -> set[str]:
    """Every module of the package, named relative to it; a wing's __init__ counts as the wing."""
    names = set()
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if parts:
            names.add(".".join(parts))
    return names


def package_imports(path: Path) -> set[str]:
    """Package modules a file imports anywhere in it (function-level imports included)."""
    names = set()
    known = package_modules()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module.startswith("dflash_pipeline"):
            base = node.module[len("dflash_pipeline."):] if node.module != "dflash_pipeline" else ""
            for alias in node.names:  # `from package.wing import module` names a module; else the names are attributes
                candidate = f"{base}.{alias.name}" if base else alias.name
                names.add(candidate if candidate in known else base)
        elif isinstance(node, ast.Import):
            names.update(alias.name[len("dflash_pipeline."):] for alias in node.names if alias.name.startswith("dflash_pipeline."))
    return {name for name in names if name}


def closure(path: Path) -> set[str]:
    """Every package module `path` runs, directly or through other package modules."""
    seen, todo = set(), list(package_imports(path))
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(package_imports(module_path(name)))
            wing = name.split(".")[0]
            if wing in WINGS and package_imports(module_path(wing)):  # importing a wing's module runs its __init__ first
                todo.append(wing)
    return seen


def _position():
    """(layer, place in its row) of every module: the order imports must follow."""
    return {name: (number, place) for number, names in enumerate(LAYERS) for place, name in enumerate(names)}


def test_every_module_has_a_layer_and_imports_only_from_below():
    position = _position()
    modules = package_modules() - WINGS - {""}
    assert modules == set(position), f"modules without a layer, or layers without a module: {modules ^ set(position)}"
    for name in sorted(modules):
        for imported in package_imports(module_path(name)) - {name}:
            assert imported in position or imported in WINGS, f"{name} imports {imported}, which has no layer"
            if imported in WINGS:
                continue  # a wing's __init__ is checked on its own below
            # Within a layer, a module imports only the modules listed before it in the row (the
            # README's table order); stage modules never import each other.
            assert position[imported] < position[name] and not (position[imported][0] == position[name][0] == 3), \
                f"{name} (layer {position[name][0]}, place {position[name][1]}) imports {imported} (layer {position[imported][0]}, place {position[imported][1]})"


def test_the_layer_check_sees_an_import_from_later_in_the_same_row():
    position = _position()
    assert position["data.prompts"] < position["data.shards"]
    assert not position["drafters.serving"] < position["drafters.core"]  # serving may import core, not the reverse


def test_no_stage_module_imports_another():
    for name in sorted(STAGE_MODULES):
        others = package_imports(module_path(name)) & (STAGE_MODULES - {name})
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
    needed = {str(module_path(name).relative_to(REPO_ROOT)) for name in closure(REPO_ROOT / script)}
    missing = sorted(needed - deps)
    assert not missing, f"dvc.yaml: stage {stage} runs {missing} but does not list them in deps"
    extra = sorted(d for d in deps if d.startswith("src/") and d not in needed)
    assert not extra, f"dvc.yaml: stage {stage} lists {extra}, which it never imports"


def test_the_dependency_check_sees_function_level_and_indirect_imports(tmp_path):
    # evaluate's script imports the package inside main(); the drafter model comes in through scoring.
    evaluate = closure(REPO_ROOT / "stages" / "evaluate.py")
    assert {"evaluate.run", "evaluate.scoring", "decoding.engine", "drafters.core", "data.blocks", "drafters.checkpoints",
            "drafters.serving", "target.load"} <= evaluate
    script = tmp_path / "stage.py"
    script.write_text("def main():\n    from dflash_pipeline.drafters.checkpoints import load_checkpoint\n")
    assert closure(script) >= {"drafters.checkpoints", "drafters.core", "errors", "files"}


@pytest.mark.parametrize("module, stage", [("evaluate.report", "evaluate"), ("train.report", "train")])
def test_a_stage_report_is_a_dependency_of_its_own_stage_alone(module, stage):
    # Editing evaluate's tables or plots (or train's curve) makes that stage stale and no other:
    # its report module is in that stage's deps alone, and no other stage's script runs it.
    path = str(module_path(module).relative_to(REPO_ROOT))
    stages = _stages()
    listed = {name for name, spec in stages.items() if path in spec["deps"]}
    runs = {name for name in stages if module in closure(REPO_ROOT / "stages" / f"{name}.py")}
    assert listed == runs == {stage}, f"{path}: listed in the deps of {sorted(listed)}, run by {sorted(runs)}"

