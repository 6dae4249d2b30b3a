"""Rewrite the `src/` deps of every stage in dvc.yaml from what each stage script runs.

    python tools/sync_dvc_deps.py

A stage's deps must name every package module its script imports, directly or through other
modules (tools/import_graph.py reads that from the source; tests/test_layering.py fails when
dvc.yaml and the imports differ), so that editing any of them makes exactly that stage stale.
Comments and the other deps are kept.
"""

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout, for `tools.*` from a plain `python tools/...`

from tools.import_graph import REPO_ROOT, stage_deps  # noqa: E402


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


def main(argv: list[str] | None = None) -> int:
    if sys.argv[1:] if argv is None else argv:
        print("usage: python tools/sync_dvc_deps.py   (no options)", file=sys.stderr)
        return 2
    print("dvc.yaml: stage deps rewritten" if sync_dvc_yaml() else "dvc.yaml: stage deps already match the imports")
    return 0


if __name__ == "__main__":
    sys.exit(main())
