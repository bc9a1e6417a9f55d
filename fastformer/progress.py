"""Progress on stderr: tqdm's bar where someone watches it, plain lines where a log keeps it.

    with progress_bar(total=len(loader), desc="Train 1/5", unit=" batch") as bar:
        for batch in loader:
            ...
            bar.update(1)
            bar.set_postfix_str("loss 0.512 acc 0.781 3,210 tok/s")

On a terminal, or in a notebook (tqdm.auto's widget), the bar is tqdm's. Where stderr is a file or
a pipe, a bar redrawn after a carriage return ten times a second fills the log with frames nobody
reads; there the bar is a LogLines, which writes a line when it shows, one every LOG_INTERVAL
seconds and one when it closes, so that a log says which step runs and how far it is:

    Train 1/5: 0/480 batch (0%), 00:00 elapsed
    Train 1/5: 120/480 batch (25%), 00:30 elapsed, 01:30 left, loss 0.512 acc 0.781 3,210 tok/s
"""

import sys
import time

from tqdm.auto import tqdm

LOG_INTERVAL = 30.0  # seconds between two lines of one bar in a log


def progress_bar(total=None, *, desc=None, unit="it", unit_scale=False, disable=False, delay=0.0):
    """A progress bar on stderr that leaves nothing on the screen when it closes, with tqdm's
    arguments: tqdm's own where stderr is watched (a terminal, a notebook), else a LogLines.
    `unit_scale`: counts with SI prefixes (1.05MB); `disable`: show nothing (a torchrun job's
    processes but rank 0); `delay`: show nothing before that many seconds."""
    options = dict(desc=desc, unit=unit, unit_scale=unit_scale, disable=disable, delay=delay)
    if _watched(sys.stderr):
        return tqdm(total=total, leave=False, **options)
    return LogLines(total, **options)


def _watched(stream):
    """Whether someone watches `stream` as it is written: a terminal, or a notebook's cell."""
    notebook = sys.modules.get("tqdm.notebook")  # tqdm.auto imports it only to draw in a notebook
    if notebook is not None and issubclass(tqdm, notebook.tqdm):
        return True
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no stream (pythonw), or a closed one
        return False


class LogLines:
    """A progress bar for a log: tqdm's interface as fastformer's bars use it (update,
    set_description, set_postfix_str, refresh, close, `with`; n, total, desc, disable, delay,
    start_t), written as lines (`line`): one when it shows (at once, or at the first update or
    refresh once `delay` seconds have passed, as tqdm's), then one when `interval` seconds have
    passed since the last, checked at each update and refresh, and one when it closes unless the
    last said it all. A bar that closes within `delay` seconds of its start writes nothing, as
    tqdm's shows nothing. `clock` gives the time in seconds (time.time, as tqdm's start_t)."""

    def __init__(
        self,
        total=None,
        *,
        desc=None,
        unit="it",
        unit_scale=False,
        disable=False,
        delay=0.0,
        interval=LOG_INTERVAL,
        file=None,
        clock=None,
    ):
        self.total, self.desc, self.unit, self.unit_scale = total, desc, unit.strip(), unit_scale
        self.disable, self.delay, self.interval = disable, delay, interval
        self.file = sys.stderr if file is None else file
        self.clock = clock or time.time
        self.n, self.postfix, self.closed = 0, "", False
        self.last_t = self.written = None  # the time and the (n, desc, postfix) of the last line
        self.start_t = self.clock()
        self.refresh()

    def update(self, n=1):
        self.n += n
        self.refresh()

    def set_description(self, desc=None, refresh=True):
        self.desc = desc

    def set_postfix_str(self, s="", refresh=True):
        self.postfix = s

    def refresh(self):
        """A line, once `delay` seconds have passed since the start, if it is the first or `interval`
        seconds have passed since the last."""
        now = self.clock()
        if now - self.start_t >= self.delay and (self.last_t is None or now - self.last_t >= self.interval):
            self._write(now)

    def close(self):
        if self.closed:
            return
        self.closed = True
        now = self.clock()
        if now - self.start_t >= self.delay and self.written != (self.n, self.desc, self.postfix):
            self._write(now)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def line(self, now):
        """The bar at time `now`: "desc: n/total unit (percent), elapsed, left, postfix", with the
        total, the time left and the postfix where they are known."""
        elapsed = now - self.start_t
        if self.total and self.unit_scale:  # "1.05MB/10.0MB (10%)"
            parts = [f"{self._count(self.n)}/{self._count(self.total)} ({self.n / self.total:.0%})"]
        elif self.total:  # "120/480 batch (25%)"
            parts = [f"{self.n:,}/{self.total:,} {self.unit} ({self.n / self.total:.0%})"]
        else:
            parts = [self._count(self.n)]
        parts.append(f"{tqdm.format_interval(elapsed)} elapsed")
        if self.total and 0 < self.n < self.total:
            parts.append(f"{tqdm.format_interval(elapsed * (self.total - self.n) / self.n)} left")
        if self.postfix:
            parts.append(self.postfix)
        return f"{self.desc}: {', '.join(parts)}" if self.desc else ", ".join(parts)

    def _count(self, n):
        """`n` with the unit: "1,234 batch", or with unit_scale "1.23MB" (tqdm's format_sizeof)."""
        return f"{tqdm.format_sizeof(n)}{self.unit}" if self.unit_scale else f"{n:,} {self.unit}"

    def _write(self, now):
        self.last_t, self.written = now, (self.n, self.desc, self.postfix)
        if not self.disable:
            print(self.line(now), file=self.file, flush=True)
