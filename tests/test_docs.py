"""The docs stay true: docs/results.md is what tools/build_results.py writes from the committed results,
the README is short with a working contents list, every relative link in README.md and docs/*.md
resolves (files and heading anchors), and tables of numbers live only in the generated page."""

import importlib.util
import io
import json
import re
from pathlib import Path

import pytest
from support.helpers import REPO_ROOT

PAGES = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
NUMBER_CELL = re.compile(r"^\**[-+−]?\d[\d,.]*( ± [\d.]+)?( ?[a-zA-Z%]{0,3})?\**$")
TYPED_HISTORY = "<!-- typed history"


def load_builder():
    spec = importlib.util.spec_from_file_location("build_results", REPO_ROOT / "tools" / "build_results.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def builder():
    return load_builder()


def prose(text: str) -> str:
    """The text without fenced code blocks and inline code, where links and headings do not count."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def anchors(path: Path, slug) -> set[str]:
    """GitHub's heading anchors of a page (a repeated heading gets -1, -2, ...)."""
    seen, found = {}, set()
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)
    for title in re.findall(r"^#{1,6} +(.+?) *#*$", text, flags=re.M):
        base = slug(title)
        found.add(base if base not in seen else f"{base}-{seen[base]}")
        seen[base] = seen.get(base, 0) + 1
    return found


# ----------------------------------------------------------------------------- the generated page

def test_results_md_is_what_the_builder_writes(builder, capsys):
    assert builder.main(["--check"]) == 0, (
        "docs/results.md is stale: run `python tools/build_results.py` and commit it\n" + capsys.readouterr().out)


def test_the_check_fails_on_a_stale_page_and_names_the_fix(builder, tmp_path, monkeypatch, capsys):
    stale = tmp_path / "results.md"
    stale.write_text(builder.build().replace("| step_0", "| step_9", 1).replace("1.", "9.", 1))
    monkeypatch.setattr(builder, "OUT", stale)
    assert builder.main(["--check"]) == 1
    assert "python tools/build_results.py" in capsys.readouterr().err
    monkeypatch.setattr(builder, "OUT", tmp_path / "missing.md")
    assert builder.main(["--check"]) == 1


def test_a_renamed_metrics_key_fails_loudly_instead_of_leaving_a_blank_column(builder):
    table = builder.Table("t", "data/metrics/train.json", [("τ", "no_such_key", "{}")])
    with pytest.raises(KeyError, match="no_such_key"):
        builder.render(table)


def test_key_paths_walk_nested_sections_lists_and_wildcards(builder, tmp_path, monkeypatch):
    (tmp_path / "m.json").write_text(json.dumps({"teacher_forced": {"tau": 1.5, "tau_ci95": 0.1},
                                                 "tree": {"4": {"tau": 1.7}, "8": {"tau": 1.8}}}))
    monkeypatch.setattr(builder, "REPO", tmp_path)
    one = builder.render(builder.Table("t", "m.json", [("τ", ("teacher_forced.tau", "teacher_forced.tau_ci95"), "{} ± {}")]), None)
    assert "| 1.5 ± 0.1 |" in one
    trees = builder.render(builder.Table("t", "m.json", [("K", "@", "{}"), ("τ", "tau", "{:.2f}")], rows="tree.*"), None)
    assert "| 4 | 1.70 |" in trees and "| 8 | 1.80 |" in trees


def test_tree_budgets_are_rows_in_numeric_order_and_a_missing_interval_reads_n_a(builder, tmp_path, monkeypatch):
    (tmp_path / "m.json").write_text(json.dumps({"tree": {"16": {"tau": 2.0}, "4": {"tau": 1.5}, "8": {"tau": 1.75}},
                                                 "chain": {"tau": 1.25, "tau_ci95": None}}))
    monkeypatch.setattr(builder, "REPO", tmp_path)
    trees = builder.render(builder.Table("t", "m.json", [("K", "@", "{}")], rows="tree.*"), None)
    assert [line.split("|")[1].strip() for line in trees.splitlines()[6:]] == ["4", "8", "16"]
    chain = builder.render(builder.Table("t", "m.json", [("τ", ("chain.tau", "chain.tau_ci95"), builder.PM3)]), None)
    assert "| 1.250 ± n/a |" in chain


def git(repo: Path, *args: str) -> None:
    import subprocess

    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True)


def test_the_page_reads_the_committed_files_not_the_workspace(builder, tmp_path, monkeypatch):
    """A user's own run rewrites data/metrics in the workspace; the page and its check still read HEAD."""
    git(tmp_path, "init", "-q")
    git(tmp_path, "-c", "user.email=t@example.com", "-c", "user.name=t", "commit", "-q", "--allow-empty", "-m", "empty")
    (tmp_path / "m.json").write_text(json.dumps({"tau": 1.5}))
    git(tmp_path, "add", "m.json")
    git(tmp_path, "-c", "user.email=t@example.com", "-c", "user.name=t", "commit", "-qm", "a run")
    (tmp_path / "m.json").write_text(json.dumps({"tau": 2.5}))  # the workspace's own run, not committed
    monkeypatch.setattr(builder, "REPO", tmp_path)
    builder.source_text.cache_clear()
    table = builder.Table("t", "m.json", [("τ", "tau", "{}")])
    assert "| 1.5 |" in builder.render(table) and "| 2.5 |" in builder.render(table, None)
    (tmp_path / "new.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="new.json is not committed at HEAD.*--workspace"):
        builder.render(builder.Table("t", "new.json", [("τ", "tau", "{}")]))


def test_the_readme_headline_is_the_committed_run(builder):
    """The README's measured τ and speedup are the ones of the committed eval metrics."""
    table = builder.render(builder.COMMITTED[0]).splitlines()
    header, row = ([c.strip() for c in line.strip("|").split("|")] for line in (table[4], table[6]))
    cells = dict(zip(header, row))
    readme = (REPO_ROOT / "README.md").read_text()
    assert f"τ = {cells['teacher-forced τ']}" in readme
    assert f"speedup {cells['speedup']}" in readme


# ----------------------------------------------------------------------------- the README

def test_the_readme_is_under_250_lines():
    lines = (REPO_ROOT / "README.md").read_text().count("\n")
    assert lines < 250, f"README.md has {lines} lines: move detail into docs/"


def test_the_readme_contents_list_names_every_section_and_each_anchor_resolves(builder):
    text = (REPO_ROOT / "README.md").read_text()
    contents = re.search(r"^## Contents\n(.*?)^## ", text, flags=re.S | re.M)
    assert contents, "README.md has no '## Contents' section"
    listed = re.findall(r"\]\(#([^)]+)\)", contents.group(1))
    sections = [builder.slug(t) for t in re.findall(r"^## +(.+)$", prose_headings(text), flags=re.M)]
    assert set(listed) <= anchors(REPO_ROOT / "README.md", builder.slug), f"unresolved: {set(listed) - set(sections)}"
    assert listed == [s for s in sections if s != "contents"], "the contents list and the ## sections differ"


def prose_headings(text: str) -> str:
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def test_slug_follows_github(builder):
    assert builder.slug("The `dflash-pipeline` command") == "the-dflash-pipeline-command"
    assert builder.slug("How τ grows with training (10,000 steps)") == "how-τ-grows-with-training-10000-steps"
    assert builder.slug("The selector's sizes") == "the-selectors-sizes"


# ----------------------------------------------------------------------------- every page

@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO_ROOT).as_posix())
def test_every_relative_link_resolves(page, builder):
    broken = []
    for target in LINK.findall(prose(page.read_text())):
        if re.match(r"^[a-z]+:", target):
            continue  # https:, mailto:
        path, _, fragment = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif fragment and file.suffix == ".md" and fragment not in anchors(file, builder.slug):
            broken.append(f"{target}: no heading with that anchor in {file.name}")
    assert not broken, f"{page.relative_to(REPO_ROOT)}: " + "; ".join(broken)


@pytest.mark.parametrize("page", [p for p in PAGES if p.name != "results.md"], ids=lambda p: p.relative_to(REPO_ROOT).as_posix())
def test_tables_of_numbers_are_generated_not_typed(page):
    """A table with a number in a cell belongs in docs/results.md, generated from a committed result
    file; an old study that kept no such file says so in a `<!-- typed history ... -->` line above."""
    lines = prose_headings(page.read_text()).splitlines()
    typed = []
    for i, line in enumerate(lines):
        if not line.startswith("|") or line.startswith("|---"):
            continue
        start = i
        while start > 0 and lines[start - 1].startswith("|"):
            start -= 1
        if start > 0 and lines[start - 1].startswith(TYPED_HISTORY):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if any(NUMBER_CELL.match(c) for c in cells):
            typed.append(f"line {i + 1}: {line[:80]}")
    assert not typed, f"{page.name}: hand-typed numbers in a table (generate it in tools/build_results.py): {typed}"


# ----------------------------------------------------------------------------- the README's two commands, in order

# What a run rewrites in the workspace, and what the docs check reads of it from the committed files.
RUN_FILES = ("dvc.lock", "data/metrics", "data/plots")
COMMITTED_RUN = ("README.md", "docs", "tools", "bench/results", "tests/durations.json", *RUN_FILES)


def files_under(repo: Path, paths) -> dict[str, bytes]:
    """Every file at or under `paths` in `repo`'s workspace, by path relative to it."""
    found = {}
    for name in paths:
        top = repo / name
        for file in [top] if top.is_file() else sorted(p for p in top.rglob("*") if p.is_file()):
            found[file.relative_to(repo).as_posix()] = file.read_bytes()
    return found


def write_files(repo: Path, files: dict[str, bytes], *, replacing=()) -> None:
    """`files` written into `repo`, after removing every file under `replacing` (a run's outputs replace the last run's)."""
    for name in replacing:
        top = repo / name
        for file in [top] if top.is_file() else [p for p in top.rglob("*") if p.is_file()] if top.is_dir() else []:
            file.unlink()
    for name, data in files.items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_bytes(data)


def test_the_committed_run_is_read_from_head_while_the_workspace_holds_another_run(tmp_path):
    """The defect of issue #46: after `make repro` a fresh clone's workspace holds its own run (dvc.lock's
    sizes, the metrics' timings), and what stood for the committed run was copied from the workspace."""
    clone = tmp_path / "clone"
    git(tmp_path, "clone", "-q", "--shared", str(REPO_ROOT), str(clone))
    committed = files_under(clone, COMMITTED_RUN)
    write_files(clone, {"dvc.lock": b"stages: {}\n", "data/metrics/eval.json": b"{}"}, replacing=RUN_FILES)
    assert committed_files(clone, COMMITTED_RUN) == committed != files_under(clone, COMMITTED_RUN)


def committed_files(repo: Path, paths) -> dict[str, bytes]:
    """Every file at or under `paths` as committed at `repo`'s HEAD (`git archive`), never the workspace's."""
    import subprocess
    import tarfile

    listed = subprocess.run(["git", "-C", str(repo), "archive", "--format=tar", "HEAD", "--", *paths], check=True, capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(listed)) as archive:
        return {member.name: archive.extractfile(member).read() for member in archive.getmembers() if member.isfile()}


@pytest.mark.slow
@pytest.mark.dvc
def test_a_pipeline_run_in_the_workspace_leaves_the_docs_check_passing(reproduced_tiny_pipeline, tmp_path):
    """`make repro` then `make test` in one fresh clone: the run rewrites dvc.lock, data/metrics and
    data/plots in the workspace, and the docs check still passes, since the page is the committed run's.
    Here the user's clone holds another run in its workspace (as after `make repro`), the committed run
    is taken from its HEAD into a copy of the tiny pipeline's run and committed, and the tiny run's own
    files are put back in the workspace (a state `dvc status` calls clean); built from the workspace,
    the nested metrics of the tiny run fill every table of the spec."""
    from support.helpers import run

    user = tmp_path / "user-clone"
    git(tmp_path, "clone", "-q", "--shared", str(REPO_ROOT), str(user))
    repo = reproduced_tiny_pipeline
    tiny_run = files_under(repo, RUN_FILES)
    write_files(user, tiny_run, replacing=RUN_FILES)  # the user's `make repro`: another run in the workspace

    write_files(repo, committed_files(user, COMMITTED_RUN), replacing=RUN_FILES)
    run(["git", "add", "-A"], repo)
    run(["git", "commit", "-qm", "the committed run"], repo)
    write_files(repo, tiny_run, replacing=RUN_FILES)  # the workspace holds the tiny run again, as `dvc repro` wrote it
    assert run(["dvc", "status"], repo).stdout.strip().endswith("Data and pipelines are up to date.")
    assert run(["git", "status", "--porcelain"], repo).stdout.strip()  # ... and it differs from the committed run

    run(["python", "tools/build_results.py", "--check"], repo)
    run(["python", "tools/build_results.py", "--workspace"], repo)
    page = (repo / "docs" / "results.md").read_text()
    assert "| step_000004 |" in page and "| 4 |" in page
