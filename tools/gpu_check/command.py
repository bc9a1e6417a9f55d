"""`python -m tools.gpu_check`: the command line, the log, and the stages run in order."""

import argparse
import os
import shlex
import sys
import time
import traceback

import tools.gpu_check
from tools.gpu_check import bench, determinism, env, job, model, tests
from tools.gpu_check import compile as compile_check
from tools.gpu_check.plan import PLANS, STAGES
from tools.gpu_check.report import note, summary_table
from tools.gpu_check.run import Run, Skipped, clear_outputs, now, release

DESCRIPTION = tools.gpu_check.__doc__.split("\n\n")[0]
STAGE_FUNCTIONS = {
    "env": env.stage,
    "tests": tests.stage,
    "compile": compile_check.stage,
    "determinism": determinism.stage,
    "bench": bench.stage,
    "model": model.stage,
    "job": job.stage,
}


class UsageError(Exception):
    """A bad command line: reported in one line, exit status 2."""


def run_stage(run, name):
    """Run one stage: time it, record its details, or its reason, or its error with the traceback."""
    entry = run.stages[name]
    entry["status"] = "running"
    run.write(plots=False)
    print(f"\n=== {name} ===", flush=True)
    run.stage_started = time.monotonic()
    try:
        if not run.cuda and run.mode != "smoke" and name != "env":
            raise Skipped("needs CUDA: this machine has no CUDA device (--smoke is the CPU check of this command)")
        details = STAGE_FUNCTIONS[name](run)
        entry.update(status="passed", details=details)
    except Skipped as skip:
        entry.update(status="skipped", reason=str(skip), details=skip.details)
    except Exception as error:  # noqa: BLE001 (a failing stage is recorded; the next one runs)
        entry.update(
            status="failed",
            error=f"{type(error).__name__}: {error}",
            traceback=traceback.format_exc(),
            details=getattr(error, "details", {}),
        )
        print(entry["traceback"], end="", flush=True)
    finally:
        entry["seconds"] = time.monotonic() - run.stage_started
        release(run)
    print(f"=== {name}: {entry['status']} in {entry['seconds']:.1f} s: {note(entry)}", flush=True)
    run.write()


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(f"{message} (see --help)")


class _Tee:
    """A text stream that writes to the console and to log.txt, flushing both at every write."""

    def __init__(self, stream, log):
        self._stream, self._log = stream, log

    def write(self, text):
        self._stream.write(text)
        self._stream.flush()
        self._log.write(text)
        self._log.flush()
        return len(text)

    def flush(self):
        self._stream.flush()
        self._log.flush()

    def __getattr__(self, name):
        return getattr(self._stream, name)


def parse_args(argv):
    parser = _Parser(prog="python -m tools.gpu_check", description=DESCRIPTION)
    parser.add_argument("--out", required=True, metavar="DIR", help="the folder the files go to (created if needed)")
    parser.add_argument(
        "--stage",
        help=f"comma-separated stages to run, from: {', '.join(STAGES)} (default: the mode's; full: all)",
    )
    size = parser.add_mutually_exclusive_group()
    size.add_argument(
        "--quick",
        action="store_true",
        help="a 560-s lease's first call: what decides (env, tests, bench, model)",
    )
    size.add_argument(
        "--rest", action="store_true", help="the second call: the rest (env, tests, compile, determinism, job)"
    )
    size.add_argument("--smoke", action="store_true", help="tiny shapes; on a CPU through Triton's interpreter")
    args = parser.parse_args(argv)
    args.mode = "smoke" if args.smoke else "quick" if args.quick else "rest" if args.rest else "full"
    if args.stage is None:
        args.stages = list(PLANS[args.mode].stages)
        return args
    names = [n.strip() for n in args.stage.split(",") if n.strip()]
    unknown = [n for n in names if n not in STAGES]
    if unknown:
        raise UsageError(f"--stage: unknown stage {', '.join(map(repr, unknown))}; the stages are {', '.join(STAGES)}")
    if not names:
        raise UsageError(f"--stage: no stage given; the stages are {', '.join(STAGES)}")
    args.stages = [s for s in STAGES if s in names]
    return args


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = parse_args(argv)
    except UsageError as error:
        print(f"gpu_check: {error}", file=sys.stderr)
        return 2
    try:
        os.makedirs(args.out, exist_ok=True)
        clear_outputs(args.out)
    except OSError as error:
        print(f"gpu_check: --out {args.out}: {error}", file=sys.stderr)
        return 2
    run = Run(args.out, args.stages, args.mode, shlex.join(["python", "-m", "tools.gpu_check", *argv]))
    with open(os.path.join(args.out, "log.txt"), "w", encoding="utf-8", errors="replace") as log:
        stdout, stderr = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = _Tee(stdout, log), _Tee(stderr, log)
        try:
            print(
                f"gpu_check {run.mode} on {run.env['gpu']} ({run.device.type}): stages {', '.join(args.stages)}; "
                f"torch {run.env['torch']}, Triton {run.env['triton']}; writing into {args.out}",
                flush=True,
            )
            for name in args.stages:
                run_stage(run, name)
            run.finished = now()
        finally:
            try:
                for entry in run.stages.values():
                    if entry["status"] == "running":
                        entry["status"] = "interrupted"
                run.write()
                print("\n" + summary_table(run.document()), flush=True)
            finally:
                sys.stdout, sys.stderr = stdout, stderr
    return 1 if any(e["status"] == "failed" for e in run.stages.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
