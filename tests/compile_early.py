"""tests/test_compile.py's harness begun as the test run begins (tests/conftest.py's hooks), for
the test's `results`, as tests/sm90_early.py begins the sm_90a matrix: one subprocess,
`python -m tests.compile_harness`, started at nice 19 when collection ends, and the test module
run last, so that the harness compiles on CPU the tests leave idle (after the oldest lane's tests
end, CI's second core) instead of on the newest lane's test process, CI's critical path. In CI's
rehearsal of 2026-12-08 the harness was the newest lane's slowest setup, 513 s of a 52-minute run
(its 2,149 s to 3,156 s were the newest lane's alone). When the module's tests come, the fixture
sets the harness back to the default niceness (where the system lets it) and waits for it. Begun
only where a selected test takes `results`, and not by --collect-only."""

import contextlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

HARNESS = pytest.StashKey()
NICE = 19  # the lowest priority: a core no test wants
ROOT = Path(__file__).resolve().parent.parent
MODULE = "test_compile.py"
MODELS = ("movie", "seq2seq")
BACKENDS = ("aot_eager", "inductor")
EXTRAS = ("--bucketed", "--export")  # the drop-in loop over bucketed batches, and torch.export
ARGS = ["--models", *MODELS, "--backends", *BACKENDS, *EXTRAS]


class Harness:
    """The harness begun: its process starts at construction; `result()` waits for it, `cancel()`
    stops it. Either removes its folder (its caches and output)."""

    def __init__(self, nice=0):
        self._folder = tempfile.TemporaryDirectory(prefix="compile-harness-")
        folder = Path(self._folder.name)
        # the kernels must be imported without TRITON_INTERPRET, which the test process has set; and
        # Inductor's and Triton's caches of its own: CI's two lanes run it at once, on two torch versions
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env.update(TORCHINDUCTOR_CACHE_DIR=str(folder / "inductor"), TRITON_CACHE_DIR=str(folder / "triton"))
        self._out, self._err = open(folder / "stdout", "w+"), open(folder / "stderr", "w+")  # noqa: SIM115
        self.nice = nice
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.compile_harness", *ARGS],
            cwd=ROOT,
            env=env,
            stdout=self._out,
            stderr=self._err,
            preexec_fn=(lambda: os.nice(nice)) if nice else None,
        )

    def result(self, timeout=1800):
        """(returncode, stdout, stderr) once the harness has exited (killed at `timeout` seconds)."""
        with contextlib.suppress(PermissionError, ProcessLookupError):
            os.setpriority(os.PRIO_PROCESS, self.process.pid, os.getpriority(os.PRIO_PROCESS, 0))
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        try:
            self._out.seek(0)
            self._err.seek(0)
            return self.process.returncode, self._out.read(), self._err.read()
        finally:
            self.cancel()

    def cancel(self):
        """Stop the harness if it still runs and remove its folder; safe to call again."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self._out.close()
        self._err.close()
        self._folder.cleanup()


def _wanted(item):
    return item.path.name == MODULE and "results" in getattr(item, "fixturenames", ())


def last(items):
    """The selected items with the harness's module moved to the end, the rest in their order."""
    items[:] = [item for item in items if item.path.name != MODULE] + [i for i in items if i.path.name == MODULE]


def start(session):
    if session.config.option.collectonly or not any(_wanted(item) for item in session.items):
        return
    session.config.stash[HARNESS] = Harness(nice=NICE)


def result(config):
    """The harness's (returncode, stdout, stderr): of the one begun at collection, else of one begun now."""
    return (config.stash.get(HARNESS, None) or Harness()).result()


def cancel(config):
    """Stop a harness the run ended before taking (-x, Ctrl-C)."""
    harness = config.stash.get(HARNESS, None)
    if harness is not None:
        harness.cancel()
