"""The tests stage: pytest on the GPU in a subprocess, stopped at the stage's budget, its JUnit
report read back into counts, failures and skip reasons.

A GPU runs the `cuda` tests and the `parity` ones (every test that takes the `device` fixture,
marked by tests/conftest.py), selected by mode (SELECTIONS): full runs them all; quick (a lease's
first call) a few parametrizations of each parity test (--parity-subset quick), the kernels'
parity on the device; rest (its second call) everything quick left out, the cuda tests included,
so that the two calls run each test once. On a CPU the parity tests would run through Triton's
interpreter, far too slowly for the smoke run: there the mode's selection is only collected and
counted, and the cuda tests run (and skip) as the stage's result."""

import os
import re
import shlex
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from importlib.util import find_spec

from tools.gpu_check.run import ROOT, Failed, Skipped, stream

# The -k keyword tests/conftest.py gives the parity tests --parity-subset quick keeps (its PARITY_QUICK_KEYWORD).
PARITY_QUICK_KEYWORD = "parity_subset_quick"
QUICK = ["-m", "parity", "--parity-subset", "quick"]
# mode: (pytest's selection arguments, what they select)
SELECTIONS = {
    "full": (["-m", "cuda or parity"], "every cuda and parity test"),
    "quick": (QUICK, "a few parametrizations of each parity test (--parity-subset quick)"),
    "smoke": (QUICK, "as quick: a few parametrizations of each parity test"),
    "rest": (
        ["-m", "cuda or parity", "-k", f"not {PARITY_QUICK_KEYWORD}"],
        "what quick leaves out: every cuda test and the other parametrizations of the parity tests",
    ),
}
XDIST_WORKERS = 4  # kernel compiles in parallel on a GPU machine's cores; the GPU itself has room for four


def junit_counts(path):
    """Counts, failing tests (with their first message line) and skip reasons of a pytest JUnit XML."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    counts = {key: sum(int(s.get(key, 0)) for s in suites) for key in ("tests", "failures", "errors", "skipped")}
    failures, skip_reasons = [], Counter()
    for case in root.iter("testcase"):
        for tag in ("failure", "error"):
            element = case.find(tag)
            if element is not None:
                message = (element.get("message") or element.text or "").strip().splitlines()
                failures.append(
                    f"{case.get('classname')}::{case.get('name')} ({tag}): {message[0][:300] if message else ''}"
                )
        skipped = case.find("skipped")
        if skipped is not None:
            skip_reasons[skipped.get("message") or ""] += 1
    return {
        "tests": counts["tests"],
        "passed": max(0, counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]),
        "failed": counts["failures"],
        "errors": counts["errors"],
        "skipped": counts["skipped"],
        "seconds": sum(float(s.get("time", 0)) for s in suites),
        "failures": failures,
        "skip_reasons": dict(skip_reasons),
    }


def selection(mode):
    """pytest's arguments for a mode's selection (SELECTIONS)."""
    if mode not in SELECTIONS:
        raise ValueError(f"mode must be one of {sorted(SELECTIONS)}, got {mode!r}")
    return list(SELECTIONS[mode][0])


def workers(cuda):
    """pytest-xdist's workers where it is installed and the tests run on a GPU: each compiles its
    kernels on its own cores. None on a CPU, where the smoke run only collects the parity tests."""
    return ["-n", str(XDIST_WORKERS)] if cuda and find_spec("xdist") is not None else []


def pytest_args(run):
    """What the stage runs: on a GPU the mode's selection, in xdist's workers where it can; on a
    CPU the cuda tests (they skip there, each saying why)."""
    if run.cuda:
        return selection(run.plan.tests) + workers(run.cuda)
    return ["-m", "cuda"]


def only_parity(args):
    """A selection's arguments narrowed to its parity tests: its -m expression and `parity`."""
    marker = args.index("-m") + 1
    return [*args[:marker], f"({args[marker]}) and parity", *args[marker + 1 :]]


def collected(args, timeout):
    """How many tests `pytest tests ARGS` selects: a --collect-only run."""
    command = [sys.executable, "-m", "pytest", "tests", *args, "--collect-only", "-q", "-p", "no:cacheprovider"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    last = result.stdout.strip().splitlines()[-1:] or [""]
    found = re.match(r"(\d+)(?:/\d+)? tests? collected", last[0])
    if result.returncode == 5 and "no tests collected" in last[0]:
        return 0
    if result.returncode != 0 or not found:
        raise Failed(
            f"pytest --collect-only exited {result.returncode}: {(result.stdout + result.stderr)[-500:]}",
            {"command": shlex.join(["python", *command[1:]])},
        )
    return int(found.group(1))


def stage(run):
    junit = os.path.join(run.out, "junit.xml")
    budget = run.seconds_left("tests")
    tests = run.plan.tests
    chosen = selection(tests)
    gpu = {"selection": tests, "gpu_command": shlex.join(["python", "-m", "pytest", "tests", *chosen])}
    if run.cuda:
        gpu.update(selected_on_gpu=None, parity_on_gpu=None)  # the run's own counts say
    else:  # the GPU's selection counted, and the parity tests among it
        gpu["selected_on_gpu"] = collected(chosen, budget)
        gpu["parity_on_gpu"] = collected(only_parity(chosen), budget)
    command = [
        sys.executable,
        "-m",
        "pytest",
        "tests",
        *pytest_args(run),
        "-v",
        "--tb=short",
        "-p",
        "no:cacheprovider",
        f"--junitxml={junit}",
    ]
    returncode, timed_out = stream(command, run.seconds_left("tests"))
    details = {"command": shlex.join(["python", *command[1:]]), "returncode": returncode, "timed_out": timed_out}
    details.update(gpu)
    if not os.path.exists(junit):
        raise Failed(f"pytest exited {returncode} without writing junit.xml (see log.txt)", details)
    details.update(junit_counts(junit))
    counts = ", ".join(f"{details[key]} {key}" for key in ("passed", "failed", "errors", "skipped"))
    if run.cuda:
        details["summary"] = f"the {tests} selection ({SELECTIONS[tests][1]}): {counts}"
    else:
        details["summary"] = (
            f"the cuda tests of the {tests} selection, on a CPU: {counts}; a GPU would run "
            f"{gpu['selected_on_gpu']} tests, {gpu['parity_on_gpu']} of them parity ({SELECTIONS[tests][1]})"
        )
    if timed_out:
        raise Failed(f"stopped at the stage's budget ({budget:.0f} s left at its start): {counts} by then", details)
    if details["failed"] or details["errors"] or returncode not in (0, 5):
        raise Failed(f"pytest exited {returncode}: {counts}", details)
    if details["passed"] == 0:
        if not run.cuda:
            raise Skipped(
                f"needs CUDA: the {details['skipped']} cuda tests selected all skip on this machine "
                "(pytest ran them, junit.xml has each reason); the parity tests are only counted here",
                details,
            )
        raise Failed(f"no cuda or parity test passed: {counts}", details)
    return details
