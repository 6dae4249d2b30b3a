"""The tree's import graph, read from the source with `ast` (nothing is imported).

Two readings. The package's: which `dflash_pipeline` modules a file imports (`package_imports`), and
every package module a stage script runs (`closure`, `stage_deps`: what tools/sync_dvc_deps.py writes
into dvc.yaml and tests/test_layering.py checks). The whole tree's: every Python file of src/, bench/,
tools/, stages/, tests/support and tests/oracles as a module (`tree_modules`), each edge an import
anywhere in a file, function-level ones included (`tree_imports`), and the circles in it (`cycles`).
"""

import ast
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
PACKAGE = REPO_ROOT / "src" / "dflash_pipeline"

# Where each part of the tree is imported from: the folder its module names start at (src/ is on the
# path as the installed package, tests/ as pytest's `pythonpath`, the checkout for bench, tools, stages).
TREE = {"src": "src", "bench": ".", "tools": ".", "stages": ".", "tests/support": "tests", "tests/oracles": "tests"}


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


# ----------------------------------------------------------------------------- the whole tree


def tree_modules(root: Path = REPO_ROOT, parts: dict[str, str] = TREE) -> dict[str, Path]:
    """Module name -> file for every Python file under the folders of `parts` (a package's
    __init__.py under the package's name)."""
    modules = {}
    for folder, base in parts.items():
        for path in sorted((root / folder).rglob("*.py")):
            names = path.relative_to(root / base).with_suffix("").parts
            if names[-1] == "__init__":
                names = names[:-1]
            if names:
                modules[".".join(names)] = path
    return modules


def _known(name: str, modules: dict[str, Path]) -> str | None:
    """`name` or the closest enclosing module of it that is in the tree (an attribute's module)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def tree_imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The tree's modules that module `name` (file `path`) imports anywhere in it. A bare name that
    is a file beside this one means that file: run as a script, a file's own folder is first on
    sys.path, so `from gpu import x` in 6dfc1ff:bench/capture_figures.py meant 6dfc1ff:bench/gpu.py."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    beside = package if path.name != "__init__.py" else ""

    def resolve(imported: str) -> str | None:  # `a.b.c`, or the closest module enclosing it (`from a.b import C`)
        if beside and f"{beside}.{imported.split('.')[0]}" in modules:
            return _known(f"{beside}.{imported}", modules)
        return _known(imported, modules)

    edges = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            edges.update(resolve(alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level:  # from . import x, from ..y import z
            parts = package.split(".")
            base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            edges.update(_known(f"{base}.{alias.name}", modules) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):  # `from a import b`: the module a.b, or a when b is a name in it
            edges.update(resolve(f"{node.module}.{alias.name}") for alias in node.names)
    return {edge for edge in edges if edge and edge != name}


def tree_graph(root: Path = REPO_ROOT, parts: dict[str, str] = TREE) -> dict[str, set[str]]:
    """Module -> the tree's modules it imports, for every module of the tree."""
    modules = tree_modules(root, parts)
    return {name: tree_imports(name, path, modules) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle per strongly connected group of `graph`, as a path from its first node in sorted
    order back to it (["a", "b", "a"]), the groups in sorted order; [] when the graph has none."""
    order, low, stack, on_stack, groups = {}, {}, [], set(), []

    def connect(node):  # Tarjan's algorithm; the graphs are a few hundred nodes, recursion is fine
        order[node] = low[node] = len(order)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph.get(node, ())):
            if other not in order:
                connect(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], order[other])
        if low[node] == order[node]:
            group = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.add(member)
                if member == node:
                    break
            if len(group) > 1 or node in graph.get(node, ()):
                groups.append(group)

    for node in sorted(graph):
        if node not in order:
            connect(node)
    return sorted((_circle(graph, group) for group in groups), key=lambda circle: circle[0])


def _circle(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    """The shortest path inside `group` from its first node back to it (breadth first)."""
    start = min(group)
    came_from, frontier = {start: None}, [start]
    while frontier:
        following = []
        for node in frontier:
            for other in sorted(graph.get(node, ())):
                if other == start:
                    path = [node]
                    while came_from[path[-1]] is not None:
                        path.append(came_from[path[-1]])
                    return [*reversed(path), start]
                if other in group and other not in came_from:
                    came_from[other] = node
                    following.append(other)
        frontier = following
    raise AssertionError(f"{sorted(group)} is no circle")
