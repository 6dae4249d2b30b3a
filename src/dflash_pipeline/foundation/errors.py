"""The one exception type the pipeline raises for bad input: its message is the one line a user sees."""


class PipelineError(Exception):
    """A user-facing failure: bad params, a missing model, a malformed prompt row, a corrupt file.

    The message names the file, row or key at fault and fits on one line; stage entry points print
    it as `error: <message>` and exit with status 1, without a traceback.
    """
