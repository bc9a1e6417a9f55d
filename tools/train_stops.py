"""The stops from `fastformer train` to the first optimizer step: `python -m tools.train_stops`.

    python -m tools.train_stops                           # tools/results/train_stops.json
    python -m tools.train_stops --json /tmp/stops.json    # elsewhere (the CI test)

What a reader follows: `fastformer train` is run in this process on the embedded demo set, one
step on the CPU with the reference backend, under sys.settrace. A stop is a call of a function
defined in fastformer/cli.py or fastformer/train/, from the moment cli._train is entered to the
first call of an optimizer's `step`: the functions a reader steps into to see how the job comes to
train. Comprehensions, generator expressions and lambdas (an option's declared check, say) are
not stops: they are read where they are written, as part of the line that holds them. Nor is what
runs at import (module code and what it calls). The report gives the
stops, the files they are in, the calls per file and per function, and the checks (functions named
check_*) called again with the same arguments, which the train wing's aim says should be none (the
house, second step: at most 30 stops in at most 6 files, each check run once).

It reads structure, not time: the figures are the same on every machine for the same code, but
for the data's sizes (a vocab to train adds its stops).
"""

import argparse
import collections
import os
import platform
import sys
import tempfile
from pathlib import Path

from tools import write_report

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "tools" / "results" / "train_stops.json"
WING = ("fastformer/cli.py", "fastformer/train/")  # where a stop is, relative to the checkout
ARGV = ["train", "--epochs", "1", "--max-steps", "1", "--device", "cpu", "--backend", "reference", "--vocab-size", "60"]


def follow(argv, out):
    """The (file, function) of each stop of `fastformer train argv --out out`, in order."""
    import fastformer
    from fastformer.cli import main

    root = os.path.dirname(os.path.dirname(os.path.abspath(fastformer.__file__))) + os.sep
    stops, state = [], {"started": False, "done": False, "entry": None}

    def tracer(frame, event, arg):
        if event != "call" or state["done"]:
            return None
        code = frame.f_code
        if code.co_name == "step" and os.sep + "optim" + os.sep in code.co_filename:
            state["done"] = True
            sys.settrace(None)
            return None
        where = os.path.relpath(code.co_filename, root) if code.co_filename.startswith(root) else None
        if where is None or not where.startswith(WING):
            return None
        if code.co_name == "_train" and where == "fastformer/cli.py" and not state["started"]:
            state["started"], state["entry"] = True, frame
        if not state["started"] or code.co_name.startswith("<") or _in_import(frame, state["entry"]):
            return None
        name = code.co_qualname if hasattr(code, "co_qualname") else code.co_name
        stops.append((where, name, _arguments(frame) if code.co_name.startswith("check") else None))
        return None

    sys.settrace(tracer)
    try:
        status = main([*argv, "--out", out])
    finally:
        sys.settrace(None)
    if status != 0:
        raise RuntimeError(f"fastformer train {' '.join(argv)} exited {status}")
    if not state["done"]:
        raise RuntimeError("the job ended without an optimizer step")
    return stops


def _arguments(frame):
    """A check's arguments as a key: plain values as they are, other objects by identity."""
    plain = (str, int, float, bool, type(None))
    values = frame.f_locals.items()
    return tuple((name, value if isinstance(value, plain) else id(value)) for name, value in values)


def _in_import(frame, entry):
    """Whether the frame runs under a module's code (an import) that cli._train's frame `entry` led to."""
    while frame is not None and frame is not entry:
        if frame.f_code.co_name == "<module>":
            return True
        frame = frame.f_back
    return False


def report(stops):
    """The figures of `follow`'s stops; a check counts as run again when it is called again with
    the same arguments (check_values of two options is two checks)."""
    functions = collections.Counter(f"{where}:{name}" for where, name, _ in stops)
    files = collections.Counter(where for where, _, _ in stops)
    calls = collections.Counter((f"{where}:{name}", key) for where, name, key in stops if key is not None)
    repeated = collections.Counter(name for (name, _), n in calls.items() for _ in range(n - 1))
    return {
        "stops": len(stops),
        "files": len(files),
        "per_file": dict(files.most_common()),
        "per_function": dict(functions.most_common()),
        "checks_run_again": dict(repeated),
        "argv": ARGV,
        "versions": {"python": platform.python_version()},
    }


def table(result):
    lines = [
        f"{result['stops']} stops in {result['files']} files from cli._train to the first optimizer step",
        "",
        "| file | stops |",
        "| --- | ---: |",
        *(f"| {where} | {n} |" for where, n in result["per_file"].items()),
    ]
    again = ", ".join(f"{name} ({n})" for name, n in result["checks_run_again"].items()) or "none"
    lines += ["", f"checks run again on the same arguments: {again}"]
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, default=RESULTS, help=f"where the report goes (default {RESULTS})")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as scratch:
        stops = follow(ARGV, os.path.join(scratch, "run"))
    result = report(stops)
    write_report(args.json, result, table(result))
    return result


if __name__ == "__main__":
    main()
