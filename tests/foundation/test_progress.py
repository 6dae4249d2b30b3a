"""Progress output: a redrawn bar on a terminal, a bounded number of plain lines anywhere else."""

import io

from dflash_pipeline.foundation.progress import PlainProgress, progress, progress_iter


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_a_long_run_off_a_terminal_writes_a_line_per_interval_with_rate_and_eta():
    clock, stream = FakeClock(), io.StringIO()
    bar = PlainProgress(total=100_000, desc="train", unit="step", stream=stream, interval=30.0, clock=clock)
    for _ in range(100_000):  # 100K steps over 1,000 simulated seconds
        clock.now += 0.01
        bar.update(1)
    bar.set_postfix_str("loss 1.234")
    bar.close()
    lines = stream.getvalue().splitlines()
    assert 1000 / 30 - 1 <= len(lines) <= 1000 / 30 + 2  # one line per 30 s and a last one, not 100K redraws
    assert "\r" not in stream.getvalue()
    assert lines[0].startswith("train: 3,00") and "100.00 step/s" in lines[0] and "ETA 16:" in lines[0]
    assert lines[-1].startswith("train: 100,000/100,000 step (100%)") and "ETA" not in lines[-1] and lines[-1].endswith("loss 1.234")


def test_a_stream_that_is_not_a_terminal_gets_plain_lines_and_a_disabled_bar_nothing():
    stream = io.StringIO()
    assert isinstance(progress(total=3, desc="x", stream=stream), PlainProgress)
    quiet = progress(total=3, desc="x", stream=stream, disable=True)
    quiet.update(3)
    quiet.close()
    assert list(progress_iter(range(3), desc="y")) == [0, 1, 2]
    assert stream.getvalue() == ""
