"""CI's sm_90a compile matrix begun as the test run begins (tests/conftest.py's hooks), for
tests/test_sm90_compile.py's `records`: its two worker processes compile for about 12 minutes of
two cores on the oldest lane (CI, 2026-12-03), every config; about 5 on the newest, the rules'
picks (tools.sm90_cases.ci_cases_here). Begun when collection ends, at nice 19, they compile on a core the
tests leave idle: CI's newest lane runs its tests in one process, and once its oldest lane ends
(1,620 s into CI's run of 2026-12-03, of 3,176) a core is idle until the check; the fixture then
sets them back to the default niceness and waits for what is left: the rehearsal of 2026-12-04
took 35 minutes, 54 before (begun early at the default niceness they took the critical path's
core, and the rehearsal of 2026-12-03 took 56; docs/testing.md). Begun only where a selected test
takes the records, and not by --collect-only."""

import pytest

COMPILATION = pytest.StashKey()
NICE = 19  # the lowest priority: a core no test wants


def start(session):
    if session.config.option.collectonly:
        return
    if any(item.path.name == "test_sm90_compile.py" and "records" in item.fixturenames for item in session.items):
        from tools import sm90

        session.config.stash[COMPILATION] = sm90.Compilation("tools.sm90_cases:ci_cases_here", jobs=2, nice=NICE)


def records(config):
    """The matrix's Records: of the compilation begun at collection, else of one begun now."""
    from tools import sm90

    compilation = config.stash.get(COMPILATION, None) or sm90.Compilation("tools.sm90_cases:ci_cases_here", jobs=2)
    return compilation.records()


def cancel(config):
    """Stop the workers of a run that ended before the check took them (-x, Ctrl-C)."""
    compilation = config.stash.get(COMPILATION, None)
    if compilation is not None:
        compilation.cancel()
