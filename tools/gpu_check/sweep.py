"""The sweep stage: tools.sweep in a subprocess (the kernels' variants and configs, a family at a
time, each family's files written into DIR as it ends), then its winners put in force for the
rest of the run: the tuned table tools.sweep.adopt makes of the report (kernels/_tuned.py), through
FASTFORMER_TUNED, which this process's launches and the tests stage's pytest read alike.

A subprocess, so that on a CPU the sweep compiles for sm_90a under the dry-run driver (which needs
the kernels imported without TRITON_INTERPRET) while this process runs them through the
interpreter; on a GPU it times them. Interrupted (the run's limit), the sweep writes what it timed
and this stage keeps that in its details before the run stops."""

import json
import os
import sys
import tempfile

from tools import sweep as sweep_tool
from tools.gpu_check.run import Failed, tuned_in_force
from tools.gpu_check.run import stream as run_stream

SLACK_SECONDS = 5  # the sweep's budget is the stage's time left less this: its last family and its files


def command(run, budget):
    """The tools.sweep command line of the plan's Sweep, its budget `budget` seconds."""
    spec = run.plan.sweep
    line = [
        sys.executable,
        "-m",
        "tools.sweep",
        "--out",
        run.out,
        "--budget",
        f"{budget:.0f}",
        "--reps",
        str(spec.reps),
    ]
    if spec.quick:
        line.append("--quick")
    if spec.dry_run:
        line.append("--dry-run")
    for family in spec.families or ():
        line += ["--family", family]
    return line


def stage(run, stream=run_stream):
    spec = run.plan.sweep
    if spec.dry_run and run.cuda:
        raise Failed("the plan's sweep is a dry run, which compiles for a GPU that is not there: a CPU's")
    budget = max(1.0, run.seconds_left("sweep") - SLACK_SECONDS)
    environment = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # it compiles, or times
    environment["PYTHONUNBUFFERED"] = "1"
    line = command(run, budget)
    details = run.stages["sweep"]["details"] = {"command": " ".join(["python", *line[1:]]), "returncode": None}
    try:
        returncode, timed_out = stream(line, budget + SLACK_SECONDS + 10, env=environment)
    except KeyboardInterrupt:
        details.update(read(run, interrupted=True))
        raise
    details.update(returncode=returncode, timed_out=timed_out, **read(run))
    if "report" not in details:
        raise Failed(f"tools.sweep exited {returncode} without writing sweep.json (see log.txt)", details)
    del details["report"]
    if details["errors"]:
        raise Failed(f"{details['errors']} launches failed: {details['summary']}", details)
    if returncode != 0:
        raise Failed(f"tools.sweep exited {returncode}: {details['summary']}", details)
    return details


def read(run, interrupted=False):
    """The details of the sweep's report in DIR (none yet: {}), and its winners put in force."""
    path = os.path.join(run.out, "sweep.json")
    try:
        with open(path, encoding="utf-8") as f:
            report = json.load(f)
    except (OSError, ValueError):
        return {}
    statuses = [r["status"] for r in report["records"]]
    counts = {status: statuses.count(status) for status in ("timed", "compiled", "not timed", "error")}
    details = {
        "report": True,
        "families": report["families"],
        "interrupted": report["interrupted"] or interrupted,
        "seconds": report["seconds"],
        "launches": len(statuses),
        **{status.replace(" ", "_"): n for status, n in counts.items()},
        "errors": counts["error"],
        "best": [
            f"{family}: {sweep_tool.family_line(report, family)}"
            for family in dict.fromkeys(row["family"] for row in report["best"])
        ],
    }
    done = ", ".join(f"{n} {status}" for status, n in counts.items() if n)
    if report["dry_run"]:
        details["adopted"] = ["a dry run: nothing timed, the written rules stay in force"]
    else:
        table = sweep_tool.adopt(report, source="this run's sweep.json")
        put_in_force(run, table)
        details["adopted"] = sweep_tool.adopted_lines(table)
    families = len(report["families"])
    details["summary"] = (
        f"{len(statuses)} launches in {families} famil{'y' if families == 1 else 'ies'}: {done}"
        + (" (interrupted)" if details["interrupted"] else "")
        + f"; {details['adopted'][0]}"
    )
    return details


def put_in_force(run, table):
    """The tuned table of this run's sweep in force for the rest of the run: written to a file of
    its own outside DIR (DIR keeps its few files) and named by FASTFORMER_TUNED, read live by this
    process's launches and inherited by the tests stage's pytest; results.json's env.tuned says so."""
    from fastformer.kernels import _tuned

    handle, path = tempfile.mkstemp(prefix="fastformer-tuned-", suffix=".json")
    with os.fdopen(handle, "w", encoding="utf-8") as f:
        json.dump(table, f, indent=1)
    os.environ[_tuned.ENV_VAR] = path
    run.env["tuned"] = dict(tuned_in_force(run.env["gpu"]), source="this run's sweep (tools.sweep.adopt)")
