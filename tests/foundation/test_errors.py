"""errors.py: a PipelineError is the one line a user sees: `error: <message>`, exit status 1."""

import pytest

from dflash_pipeline.foundation.errors import PipelineError
from dflash_pipeline.foundation.runtime import one_line_errors


def test_a_pipeline_error_is_an_exception_whose_text_is_the_message():
    error = PipelineError("params.yaml: unknown key 'train.lrr'")
    assert isinstance(error, Exception) and str(error) == "params.yaml: unknown key 'train.lrr'"
    with pytest.raises(PipelineError, match="train.lrr"):
        raise error


def test_entry_points_print_it_as_one_line_and_exit_1(capsys):
    @one_line_errors
    def stage():
        raise PipelineError("data/x.parquet: no such file")

    with pytest.raises(SystemExit) as exited:
        stage()
    assert exited.value.code == 1
    assert capsys.readouterr().err == "error: data/x.parquet: no such file\n"
