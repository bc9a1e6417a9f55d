"""The tests stage: pytest on the GPU in a subprocess, stopped at the stage's budget, its JUnit
report read back into counts, failures and skip reasons."""

import os
import shlex
import sys
import xml.etree.ElementTree as ET
from collections import Counter

from tools.gpu_check.run import Failed, Skipped, stream


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


def stage(run):
    junit = os.path.join(run.out, "junit.xml")
    command = [
        sys.executable,
        "-m",
        "pytest",
        "tests",
        "-m",
        "cuda",
        "-v",
        "--tb=short",
        "-p",
        "no:cacheprovider",
        f"--junitxml={junit}",
    ]
    if run.plan.tests_filter:
        command += ["-k", run.plan.tests_filter]
    budget = run.plan.budget_seconds["tests"]
    returncode, timed_out = stream(command, budget)
    details = {"command": shlex.join(["python", *command[1:]]), "returncode": returncode, "timed_out": timed_out}
    if not os.path.exists(junit):
        raise Failed(f"pytest exited {returncode} without writing junit.xml (see log.txt)", details)
    details.update(junit_counts(junit))
    counts = ", ".join(f"{details[key]} {key}" for key in ("passed", "failed", "errors", "skipped"))
    details["summary"] = counts
    if timed_out:
        raise Failed(f"stopped at the stage's budget of {budget} s: {counts} by then", details)
    if details["failed"] or details["errors"] or returncode not in (0, 5):
        raise Failed(f"pytest exited {returncode}: {counts}", details)
    if details["passed"] == 0:
        if not run.cuda:
            raise Skipped(
                f"needs CUDA: the {details['skipped']} cuda tests selected all skip on this machine "
                "(pytest ran them, junit.xml has each reason)",
                details,
            )
        raise Failed(f"no cuda test passed: {counts}", details)
    return details
