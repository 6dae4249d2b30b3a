"""Progress reporting for long work: a live bar on a terminal, a few plain lines anywhere else.

On a terminal, a tqdm bar redraws in place. When stdout/stderr is a file or a pipe (CI, `dvc repro
> log`, a cluster job), redraws would pile up as thousands of lines (2,245 in one default run), so
the same progress is written as one plain line at most every `interval` seconds, with the count,
the rate and the ETA, plus a last line at the end.
"""

import sys
import time

PLAIN_INTERVAL_S = 30.0


def _is_terminal(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


class PlainProgress:
    """The tqdm calls the pipeline uses (update, set_postfix_str, close), as occasional lines."""

    def __init__(self, *, total: int | None, initial: int = 0, desc: str = "", unit: str = "it", stream=None,
                 interval: float = PLAIN_INTERVAL_S, clock=time.monotonic):
        self.total, self.n, self.desc, self.unit = total, initial, desc, unit
        self.stream = stream if stream is not None else sys.stderr
        self.interval, self.clock = interval, clock
        self.started = self.last_line = clock()
        self.initial = initial
        self.postfix = ""
        self.closed = False

    def _line(self, final: bool = False) -> None:
        elapsed = max(self.clock() - self.started, 1e-9)
        rate = (self.n - self.initial) / elapsed
        parts = [f"{self.desc}: {self.n:,}" + (f"/{self.total:,}" if self.total else "") + f" {self.unit}"]
        if self.total:
            parts[0] += f" ({100.0 * self.n / self.total:.0f}%)"
        parts.append(f"{rate:.2f} {self.unit}/s")
        if self.total and not final:
            remaining = (self.total - self.n) / rate if rate > 0 else float("inf")
            parts.append(f"ETA {_duration(remaining)}")
        parts.append(f"elapsed {_duration(elapsed)}")
        if self.postfix:
            parts.append(self.postfix)
        print(", ".join(parts), file=self.stream, flush=True)
        self.last_line = self.clock()

    def update(self, count: int = 1) -> None:
        self.n += count
        if self.clock() - self.last_line >= self.interval:
            self._line()

    def set_postfix_str(self, text: str, refresh: bool = False) -> None:
        self.postfix = text

    def close(self) -> None:
        if not self.closed and self.n > self.initial:
            self._line(final=True)
        self.closed = True

    def __iter__(self):  # pragma: no cover - iteration goes through `progress_iter`
        raise TypeError("wrap iterables with progress_iter")


def _duration(seconds: float) -> str:
    if seconds != seconds or seconds == float("inf"):
        return "?"
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


class _Disabled:
    n = 0

    def update(self, count: int = 1) -> None:
        pass

    def set_postfix_str(self, text: str, refresh: bool = False) -> None:
        pass

    def close(self) -> None:
        pass


def progress(*, total: int | None, desc: str, unit: str = "it", initial: int = 0, disable: bool = False, stream=None,
             leave: bool = True, unit_scale: bool = False):
    """A progress reporter: tqdm on a terminal, `PlainProgress` elsewhere, nothing when disabled."""
    if disable:
        return _Disabled()
    stream = stream if stream is not None else sys.stderr
    if _is_terminal(stream):
        from tqdm import tqdm

        return tqdm(total=total, initial=initial, desc=desc, unit=unit, dynamic_ncols=True, smoothing=0.1, leave=leave,
                    unit_scale=unit_scale, file=stream)
    return PlainProgress(total=total, initial=initial, desc=desc, unit=unit, stream=stream)


def progress_iter(items, *, desc: str, unit: str = "it", disable: bool = False, leave: bool = True):
    """Iterate `items`, reporting progress as `progress` does."""
    items = list(items)
    bar = progress(total=len(items), desc=desc, unit=unit, disable=disable, leave=leave)
    try:
        for item in items:
            yield item
            bar.update(1)
    finally:
        bar.close()
