"""CI's sm_90a compile matrix begun as the test run begins (tests/conftest.py's hooks), for
tests/test_sm90_compile.py's `records`: its two worker processes compile for about 12 minutes of
two cores (CI, 2026-12-03), and begun when collection ends they compile beside the tests that
run before the check, which on CI's two-core machine run in one process and leave a core idle
(in CI's rehearsal of 2026-12-03, 94 core-minutes over 54 minutes of two cores); the fixture
then waits for what is left. Begun only where a selected test takes the records, and not by
--collect-only."""

import pytest

COMPILATION = pytest.StashKey()


def start(session):
    if session.config.option.collectonly:
        return
    if any(item.path.name == "test_sm90_compile.py" and "records" in item.fixturenames for item in session.items):
        from tools import sm90

        session.config.stash[COMPILATION] = sm90.Compilation("tools.sm90_cases:ci_cases", jobs=2)


def records(config):
    """The matrix's Records: of the compilation begun at collection, else of one begun now."""
    from tools import sm90

    compilation = config.stash.get(COMPILATION, None) or sm90.Compilation("tools.sm90_cases:ci_cases", jobs=2)
    return compilation.records()


def cancel(config):
    """Stop the workers of a run that ended before the check took them (-x, Ctrl-C)."""
    compilation = config.stash.get(COMPILATION, None)
    if compilation is not None:
        compilation.cancel()
