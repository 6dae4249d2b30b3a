"""The package's import graph, read from the source with `ast` (nothing is imported).

Used by tests/test_layering.py, and run as a script to rewrite the `src/` deps of every stage in
dvc.yaml from what each stage script runs:  python tests/support/imports.py --sync-dvc-yaml
"""

import ast
import re
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PACKAGE = REPO_ROOT / "src" / "dflash_pipeline"


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


def wings() -> set[str]:
    """The package's wings: its subpackages."""
    return {path.name for path in PACKAGE.iterdir() if (path / "__init__.py").is_file()}


def package_imports(path: Path, known: set[str] | None = None) -> set[str]:
    """Package modules a file imports anywhere in it (function-level imports included)."""
    names = set()
    known = package_modules() if known is None else known
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
    """Every package module `path` runs, directly or through other package modules (a wing's
    __init__ included when it imports anything: importing a wing's module runs it first)."""
    known, all_wings = package_modules(), wings()
    seen, todo = set(), list(package_imports(path, known))
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(package_imports(module_path(name), known))
            wing = name.split(".")[0]
            if wing in all_wings and package_imports(module_path(wing), known):
                todo.append(wing)
    return seen


def stage_deps(script: Path) -> list[str]:
    """The `src/` deps a stage running `script` must list in dvc.yaml, sorted."""
    return sorted(str(module_path(name).relative_to(REPO_ROOT)) for name in closure(script))


def sync_dvc_yaml(path: Path = REPO_ROOT / "dvc.yaml") -> bool:
    """Rewrite each stage's run of `src/` deps in place (comments and other deps kept); True if changed."""
    lines, out, stage = path.read_text().splitlines(keepends=True), [], None
    index = 0
    while index < len(lines):
        line = lines[index]
        match = re.match(r"^  (\w+):\s*$", line)
        if match:
            stage = match.group(1)
        if re.match(r"^      - src/dflash_pipeline/", line):
            while index < len(lines) and re.match(r"^      - src/dflash_pipeline/", lines[index]):
                index += 1
            out.extend(f"      - {dep}\n" for dep in stage_deps(REPO_ROOT / "stages" / f"{stage}.py"))
            continue
        out.append(line)
        index += 1
    text = "".join(out)
    changed = text != path.read_text()
    path.write_text(text)
    return changed


if __name__ == "__main__":
    if sys.argv[1:] != ["--sync-dvc-yaml"]:
        sys.exit("usage: python tests/support/imports.py --sync-dvc-yaml")
    print("dvc.yaml: stage deps rewritten" if sync_dvc_yaml() else "dvc.yaml: stage deps already match the imports")
