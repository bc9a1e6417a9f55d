"""`python -m tools.gpu_check`: the command line, the log, and the stages run in order."""

import argparse
import os
import shlex
import sys
import time
import traceback

import torch

import tools.gpu_check
from tools import interrupt_once
from tools.gpu_check import bench, determinism, env, job, model, sweep, tests
from tools.gpu_check import compile as compile_check
from tools.gpu_check.plan import ONE_SECONDS, PLANS, ROOT, STAGES, budget_line, one_run
from tools.gpu_check.report import note, summary_table
from tools.gpu_check.run import Run, Skipped, clear_outputs, now, release

DESCRIPTION = tools.gpu_check.__doc__.split("\n\n")[0]
STAGE_FUNCTIONS = {
    "env": env.stage,
    "sweep": sweep.stage,
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
        if not run.cuda and not run.plan.tiny and name != "env":
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
        "--one",
        action="store_true",
        help="the default: the one run of a GPU lease, planned from what the repository holds (plan.one_run)",
    )
    size.add_argument("--full", action="store_true", help="every stage at full size (about 40 minutes)")
    size.add_argument("--quick", action="store_true", help="the kernel and model stages, then the parity subset")
    size.add_argument(
        "--rest", action="store_true", help="the rest: the other tests, compile, determinism, the default job"
    )
    size.add_argument("--smoke", action="store_true", help="tiny shapes; on a CPU through Triton's interpreter")
    parser.add_argument(
        "--seconds",
        type=float,
        default=ONE_SECONDS,
        help=f"with the one run: the seconds its stages' budgets add up to (default {ONE_SECONDS})",
    )
    parser.add_argument(
        "--repo",
        default=str(ROOT),
        metavar="DIR",
        help="with the one run: the checkout whose committed results decide what it runs (default: this one)",
    )
    args = parser.parse_args(argv)
    modes = ("full", "quick", "rest", "smoke")
    args.mode = next((m for m in modes if getattr(args, m)), "one")
    if args.seconds <= 0:
        raise UsageError("--seconds must be positive")
    if args.mode == "one":
        cuda = torch.cuda.is_available()
        args.plan = one_run(torch.cuda.get_device_name() if cuda else "cpu", cuda, args.repo, args.seconds)
    else:
        args.plan = PLANS[args.mode]
    if args.stage is None:
        args.stages = list(args.plan.stages)
        return args
    names = [n.strip() for n in args.stage.split(",") if n.strip()]
    unknown = [n for n in names if n not in STAGES]
    if unknown:
        raise UsageError(f"--stage: unknown stage {', '.join(map(repr, unknown))}; the stages are {', '.join(STAGES)}")
    if not names:
        raise UsageError(f"--stage: no stage given; the stages are {', '.join(STAGES)}")
    order = list(args.plan.stages) + [s for s in STAGES if s not in args.plan.stages]
    args.stages = [s for s in order if s in names]
    missing = [s for s in args.stages if s not in args.plan.budget_seconds]
    if missing:
        raise UsageError(f"--stage: the {args.mode} mode has no budget for {', '.join(missing)}")
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
    run = Run(args.out, args.stages, args.mode, shlex.join(["python", "-m", "tools.gpu_check", *argv]), args.plan)
    with open(os.path.join(args.out, "log.txt"), "w", encoding="utf-8", errors="replace") as log:
        stdout, stderr = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = _Tee(stdout, log), _Tee(stderr, log)
        try:
            print(
                f"gpu_check {run.mode} on {run.env['gpu']} ({run.device.type}): stages {', '.join(args.stages)}; "
                f"torch {run.env['torch']}, Triton {run.env['triton']}; tuned table: {run.env['tuned']['source']}; "
                f"writing into {args.out}",
                flush=True,
            )
            for line in (*run.plan.why, budget_line(run.plan)) if run.mode == "one" else ():
                print(f"plan: {line}", flush=True)
            run.clock = time.monotonic()
            interrupt_once()
            try:
                for name in args.stages:
                    run_stage(run, name)
                run.finished = now()
            except KeyboardInterrupt:  # tools/gpu_run.sh's limit, or Ctrl-C: what was measured is kept
                interrupted = next((n for n, e in run.stages.items() if e["status"] == "running"), None)
                print(
                    f"\ngpu_check: interrupted in the {interrupted} stage; the files hold what was measured", flush=True
                )
                run.interrupted = True
        finally:
            try:
                for entry in run.stages.values():
                    if entry["status"] == "running":
                        entry["status"] = "interrupted"
                run.write()
                print("\n" + summary_table(run.document()), flush=True)
            finally:
                sys.stdout, sys.stderr = stdout, stderr
    if run.interrupted:
        return 130
    return 1 if any(e["status"] == "failed" for e in run.stages.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
