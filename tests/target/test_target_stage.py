"""Stage `target` (stages/target.py): a bad target.model is one error line and exit status 1.

The stage's library is target/: tests/target/test_load.py, tests/target/test_folder.py, tests/target/test_embedded.py."""

import pytest
from support.helpers import REPO_ROOT, run


@pytest.mark.subprocess
def test_stage_command_prints_one_error_line_and_exits_1(tmp_path):
    params = tmp_path / "params.yaml"
    params.write_text((REPO_ROOT / "params.yaml").read_text().replace("model: smollm2-135m-instruct", "model: /no/such/model"))
    result = run(["python", str(REPO_ROOT / "stages" / "target.py"), "--params", str(params), "--out", str(tmp_path / "t")],
                 cwd=tmp_path, check=False)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == ["error: target.model '/no/such/model': no such folder, not a hub id (org/name), "
                                                  "and not the embedded 'smollm2-135m-instruct'"]
