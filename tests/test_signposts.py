"""Signposts stay true: every file, module, function and class that a docstring, a console line, the
README or a page under docs/ names exists (tests/support/signposts.py says what counts)."""

import subprocess

from support.helpers import REPO_ROOT
from support.signposts import Project, stale_signposts


def test_every_named_file_module_and_function_exists():
    stale = stale_signposts(REPO_ROOT)
    assert not stale, f"{len(stale)} names of things that do not exist:\n" + "\n".join(map(str, stale))


def _git(repo, *args):
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True)


def test_the_check_finds_moved_modules_renamed_functions_and_missing_files_but_not_settings(tmp_path):
    package = tmp_path / "src" / "dflash_pipeline" / "decoding"
    package.mkdir(parents=True)
    (package.parent / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "loop.py").write_text('"""The loop (`loop.run_steps`, `decoding.loop.PlainStep.advance`, `loop.gone`)."""\n\n'
                                      "def run_steps():\n    pass\n\n\nclass PlainStep:\n    def advance(self):\n        pass\n")
    (tmp_path / "params.yaml").write_text("decoding:\n  lr: 1\n")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "page.md").write_text(
        "See `decoding.loop.run_steps`, `PlainStep.advance`, `decoding.lr` (a setting), `torch.float32`, src/dflash_pipeline/decoding/loop.py\n"
        "and the stale `decoding.engine.speculative_decode`, `PlainStep.retreat`, tests/oracles/gone.py, decoding/engine.py.\n")
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", "-A")
    _git(tmp_path, "-c", "user.email=t@example.com", "-c", "user.name=t", "commit", "-qm", "one")
    commit = subprocess.run(["git", "-C", str(tmp_path), "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    (tmp_path / "docs" / "page.md").write_text((tmp_path / "docs" / "page.md").read_text()
                                               + f"A file as it was: {commit}:docs/page.md, and one it never had: {commit}:docs/never.md.\n")
    stale = {(s.where, s.name) for s in stale_signposts(tmp_path)}
    assert stale == {("src/dflash_pipeline/decoding/loop.py:1", "loop.gone"),
                     ("docs/page.md:2", "decoding.engine.speculative_decode"), ("docs/page.md:2", "PlainStep.retreat"),
                     ("docs/page.md:2", "tests/oracles/gone.py"), ("docs/page.md:2", "decoding/engine.py"),
                     ("docs/page.md:3", f"{commit}:docs/never.md")}, stale
    assert Project(tmp_path).path_exists("docs/page.md") and not Project(tmp_path).path_exists("docs/other.md")
