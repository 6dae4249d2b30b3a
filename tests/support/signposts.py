"""Signposts: the files, modules, functions and classes that the project's own words name.

Docstrings, console lines (every string literal of the code under src/, stages/, bench/, tools/ and
scripts/), the test files' docstrings, README.md and the pages under docs/ and bench/ name where
things live ("`measure.end_to_end`", "tests/oracles/decoding.py", "`loop.PlainStep`"). When code
moves, those names go stale silently. This module finds every such name and says which do not exist:

- a path whose first folder is one of the repository's source folders (src/, tests/, bench/, tools/,
  docs/, stages/, scripts/, .ci/), or a path inside the package (`decoding/session.py`): it must be
  a file or folder git knows (tracked, or new and not ignored); a path as it was at a commit,
  `6dfc1ff:bench/static_engine.py` (a retired file), must be in that commit;
- a dotted name in a code span (between backticks) or a docstring's backticks, whose first part is
  the package, one of its wings, one of its modules or one of its classes: the module must exist,
  and every further part must be defined there (a top-level name, or an attribute of one of its
  classes); `params.yaml` keys (`train.lr`) and metrics keys (`best_mode.speedup`) are not code.

Data files under data/ are outputs of runs, not signposts, and are not checked.
"""

import ast
import json
import re
import subprocess
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import yaml

SOURCE_FOLDERS = ("src", "tests", "bench", "tools", "docs", "stages", "scripts", ".ci")
CODE_FOLDERS = ("src", "stages", "bench", "tools", "scripts")  # every string literal is read
PAGES = ("README.md", "docs", "bench")  # *.md under these
FILE_SUFFIXES = {"py", "sh", "md", "json", "yaml", "yml", "jsonl", "csv", "png", "txt", "toml", "lock", "safetensors", "parquet",
                 "arrow", "jinja", "gguf", "html", "bin", "log", "tar", "gz", "sha256"}
PATH = re.compile(r"(?<![\w./$~-])((?:%s)/[\w./-]*[\w/])" % "|".join(re.escape(f) for f in SOURCE_FOLDERS))
REVISION_PATH = re.compile(r"\b([0-9a-f]{7,40}):((?:%s)/[\w./-]*\w)" % "|".join(re.escape(f) for f in SOURCE_FOLDERS))
CODE_SPAN = re.compile(r"`([^`\n]+)`")
DOTTED = re.compile(r"(?<![\w./$-])([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)")
# Names of other tools that share a first part with a module here: DVC's config options, z-lab's package.
OTHER_TOOLS = ("cache.type", "cache.dir", "cache.shared", "core.checksum_jobs", "core.remote", "core.analytics", "dflash.model")
PLACEHOLDERS = {"i", "j", "k", "n", "N", "L", "K"}  # layers.i.self_attn: a tensor's name, not code


@dataclass(frozen=True)
class Signpost:
    where: str  # file:line
    name: str
    problem: str

    def __str__(self) -> str:
        return f"{self.where}: `{self.name}` {self.problem}"


class Project:
    """What exists: git's files, the package's modules and the names each defines."""

    def __init__(self, root: Path):
        self.root = root
        self.package = root / "src" / "dflash_pipeline"

    @cached_property
    def files(self) -> set[str]:
        listed = subprocess.run(["git", "-C", str(self.root), "ls-files", "--cached", "--others", "--exclude-standard"],
                                capture_output=True, text=True, check=True).stdout.split("\n")
        present = {name for name in listed if name and (self.root / name).exists()}  # a deleted, not yet staged file is gone
        folders = {str(Path(name).parents[i]) for name in present for i in range(len(Path(name).parents) - 1)}
        return present | folders

    def path_exists(self, path: str) -> bool:
        path = path.rstrip("/.")
        if path in self.files:
            return True
        # an output stem (`--out bench/results/compute_curve` writes compute_curve.json, .csv, .png)
        return "." not in Path(path).name and any(name.startswith((path + ".", path + "_") if not path.endswith("_") else path)
                                                   for name in self.files)

    def existed_at(self, revision: str, path: str) -> bool:
        return subprocess.run(["git", "-C", str(self.root), "cat-file", "-e", f"{revision}:{path}"], capture_output=True).returncode == 0

    @cached_property
    def wings(self) -> set[str]:
        return {p.name for p in self.package.iterdir() if (p / "__init__.py").is_file()}

    @cached_property
    def modules(self) -> dict[str, Path]:
        """Dotted module name (relative to the package) -> file; a wing is its __init__.py."""
        found = {}
        for file in self.package.rglob("*.py"):
            parts = file.relative_to(self.package).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = file
        return found

    @cached_property
    def by_basename(self) -> dict[str, list[str]]:
        found: dict[str, list[str]] = {}
        for name in self.modules:
            if name:
                found.setdefault(name.split(".")[-1], []).append(name)
        return found

    def defined(self, module: str) -> dict[str, set[str]]:
        """A module's top-level names, each with the attributes it defines when it is a class."""
        return _definitions(self.modules[module])

    @cached_property
    def classes(self) -> dict[str, list[str]]:
        """Class name -> the modules defining it."""
        found: dict[str, list[str]] = {}
        for module in self.modules:
            for name, attributes in self.defined(module).items():
                if attributes is not None:
                    found.setdefault(name, []).append(module)
        return found

    @cached_property
    def metrics_sections(self) -> set[str]:
        return {key for metrics in (self.root / "data" / "metrics").glob("*.json") for key in json.loads(metrics.read_text())}

    @cached_property
    def data_keys(self) -> set[str]:
        """Every dotted key path of params.yaml and the committed metrics: names of settings and figures, not of code."""
        keys: set[str] = set()

        def walk(node, prefix):
            if isinstance(node, dict):
                for key, value in node.items():
                    path = f"{prefix}.{key}" if prefix else str(key)
                    keys.add(path)
                    walk(value, path)

        walk(yaml.safe_load((self.root / "params.yaml").read_text()), "")
        for metrics in (self.root / "data" / "metrics").glob("*.json"):
            walk(json.loads(metrics.read_text()), "")
        return keys


def _definitions(file: Path) -> dict[str, set[str] | None]:
    """Top-level names of a module (None for a non-class, the class's attribute names for a class);
    a package's __init__ also counts the names it imports (its re-exports)."""
    tree = ast.parse(file.read_text())
    names: dict[str, set[str] | None] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            attributes = set()
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    attributes.add(item.name)
                elif isinstance(item, ast.Assign):
                    attributes |= {t.id for t in item.targets if isinstance(t, ast.Name)}
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    attributes.add(item.target.id)
            for item in ast.walk(node):  # self.x = ... in its methods
                if isinstance(item, ast.Attribute) and isinstance(item.value, ast.Name) and item.value.id == "self":
                    attributes.add(item.attr)
            names[node.name] = attributes
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names[node.name] = None
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                for name in ast.walk(target):
                    if isinstance(name, ast.Name):
                        names[name.id] = None
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names[node.target.id] = None
        elif isinstance(node, (ast.Import, ast.ImportFrom)) and file.name == "__init__.py":
            for alias in node.names:
                names[(alias.asname or alias.name).split(".")[0]] = None
    return names


# ----------------------------------------------------------------------------- reading the texts

def texts(project: Project):
    """(where, text, whole) for every text that may name code: `whole` texts are checked for dotted
    names only inside backticks; paths are checked anywhere in every text."""
    root = project.root
    for folder in CODE_FOLDERS:
        for file in sorted((root / folder).rglob("*.py")):
            if _tracked(project, file):
                yield from _strings(file, root, docstrings_only=False)
    for file in sorted((root / "tests").rglob("*.py")):
        if _tracked(project, file):
            yield from _strings(file, root, docstrings_only=True)
    for page in PAGES:
        top = root / page
        for file in [top] if top.is_file() else sorted(top.rglob("*.md")):
            if _tracked(project, file):
                for number, line in enumerate(file.read_text().splitlines(), 1):
                    yield f"{file.relative_to(root)}:{number}", line
    for file in sorted((root / "bench").rglob("*.sh")) + [root / "Makefile", root / ".ci" / "run"]:
        if file.is_file() and _tracked(project, file):
            for number, line in enumerate(file.read_text().splitlines(), 1):
                if line.lstrip().startswith("#") or "echo" in line:
                    yield f"{file.relative_to(root)}:{number}", line


def _tracked(project: Project, file: Path) -> bool:
    return str(file.relative_to(project.root)) in project.files


def _strings(file: Path, root: Path, *, docstrings_only: bool):
    tree = ast.parse(file.read_text())
    where = str(file.relative_to(root))
    nodes = []
    if docstrings_only:
        for node in [tree, *ast.walk(tree)]:
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
                first = node.body[0]
                if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                    nodes.append(first.value)
    else:
        nodes = [node for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)]
    for node in nodes:
        for offset, line in enumerate(node.value.splitlines()):
            yield f"{where}:{node.lineno + offset}", line


# ----------------------------------------------------------------------------- checking

def stale_signposts(root: Path) -> list[Signpost]:
    project = Project(root)
    found: list[Signpost] = []
    seen: set[tuple[str, str]] = set()
    for where, line in texts(project):
        for revision, path in REVISION_PATH.findall(line):  # a file as it was at a commit (a retired bench)
            if not project.existed_at(revision, path) and (where, path) not in seen:
                seen.add((where, path))
                found.append(Signpost(where, f"{revision}:{path}", "names no file that commit had"))
        line = REVISION_PATH.sub("", line)
        for path in PATH.findall(re.sub(r"--(?:out|json) +\S+", "", line)):  # what a command will write is not there yet
            if _is_path_to_check(path) and not project.path_exists(path) and (where, path) not in seen:
                seen.add((where, path))
                found.append(Signpost(where, path, "names no file or folder git knows"))
        for wing_path in re.findall(r"(?<![\w./-])((?:%s)/[\w/]*\w\.py)\b" % "|".join(sorted(project.wings)), line):
            if not (project.package / wing_path).is_file() and not project.path_exists(wing_path) and (where, wing_path) not in seen:
                seen.add((where, wing_path))
                found.append(Signpost(where, wing_path, "names no module of the package"))
        for span in CODE_SPAN.findall(line):
            for name in DOTTED.findall(span):
                problem = _dotted_problem(project, name)
                if problem and (where, name) not in seen:
                    seen.add((where, name))
                    found.append(Signpost(where, name, problem))
    return found


def _is_path_to_check(path: str) -> bool:
    parts = path.split("/")
    if any(part in ("...", "..") or "<" in part for part in parts):
        return False
    if path.startswith("bench/results/") and "." not in parts[-1]:
        return False  # a bench's output stem (its --out default), written when it runs
    return not path.startswith(("bench/work/", "tests/<"))  # bench/work/: the benches' git-ignored work folders


def _dotted_problem(project: Project, name: str) -> str | None:
    parts = name.split(".")
    if set(parts[1:]) & FILE_SUFFIXES:
        return None  # a file name (config.json, train.parquet.sha256), checked as a path where it has a folder
    if PLACEHOLDERS & set(parts) or any(name == other or name.startswith(other + ".") for other in OTHER_TOOLS):
        return None
    if any(key == name or key.startswith(name + ".") for key in project.data_keys):
        return None  # a params.yaml or metrics key (train.lr, teacher_forced.tau)
    if parts[0] in project.metrics_sections and parts[0] not in project.wings:
        return None  # a key of a metrics section, some only in data/eval/details.json (best_mode.refused)
    qualified = parts[0] == "dflash_pipeline"
    if qualified:
        parts = parts[1:]
    first = parts[0]
    # A name starts at a wing (decoding.loop.run_steps), a module's basename (loop.run_steps) or a class (DecodingMode.parse).
    attempts = [(module, parts[len(module.split(".")):]) for module in project.modules
                if first in project.wings and module and module.split(".") == parts[: len(module.split("."))]]
    attempts += [(module, parts[1:]) for module in project.by_basename.get(first, [])]
    classes = project.classes.get(first, [])
    if not attempts and not classes:
        return "names no wing or module of the package" if qualified else None  # not this project's code (torch.float32, self.x)
    if any(_resolves(project, module, rest) for module, rest in attempts):
        return None
    if any(_resolves_in_class(project, module, first, parts[1:]) for module in classes):
        return None
    return "names nothing the package defines"


def _resolves(project: Project, module: str, rest: list[str]) -> bool:
    """`rest` is defined in `module`: a top-level name (and an attribute of it, when a class), or, as
    `session.plain` names a method through an instance, an attribute of one of the module's classes."""
    if not rest:
        return True
    names = project.defined(module)
    if rest[0] not in names:
        return len(rest) == 1 and any(attributes and rest[0] in attributes for attributes in names.values())
    attributes = names[rest[0]]
    if len(rest) == 1:
        return True
    return attributes is not None and rest[1] in attributes and len(rest) == 2


def _resolves_in_class(project: Project, module: str, cls: str, rest: list[str]) -> bool:
    attributes = project.defined(module).get(cls)
    return attributes is not None and (not rest or (rest[0] in attributes and len(rest) == 1))
