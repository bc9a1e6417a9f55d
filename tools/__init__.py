"""The project's instruments (the benchmarks' library, which the GPU check runs too, is bench/):

    python -m tools.gpu_check      everything a GPU can tell in one command of a lease (tools/gpu_run.sh):
                                   the sweep, benchmarks beside the peers, the model's throughput and
                                   convergence, tests, compile, determinism (docs/benchmarks.md)
    python -m tools.sweep          on a GPU, each variant x config of the kernels that have a choice, timed;
                                   --adopt: the tuned table the kernels read (docs/kernels.md)
    python -m tools.sm90_report    the sm_90a compile check's table: every kernel and config compiled
                                   for Hopper on a CPU (tools/sm90.py's dry-run driver; docs/sm90.md)
    python -m tools.launches       kernels launched per train step and per inference (docs/launches.md)
    python -m tools.work           each kernel's FLOPs and bytes per step, and the step's lower bound on a
                                   GPU (docs/launches.md)
    python -m tools.cold_start     what a first and a second GPU run compile and time (docs/cold-start.md)
    python -m tools.host_overhead  the host time of an op call and of a train step (docs/host-path.md)
    python -m tools.sass           the kernels' hot loops read from their sm_90a SASS (docs/kernels.md)
    python -m tools.memory         where a train step's memory goes, fastformer's against the reference (docs/memory.md)
    python -m tools.corpus_memory  the memory reading and encoding a large review file takes (docs/training.md)
    python -m tools.train_stops    the calls a reader follows from `fastformer train` to its first step (docs/layout.md)

Their outputs that are committed live in tools/results/. The tests use tools.sm90 and
tools.launches; nothing in fastformer or kernels imports this package, and nothing here imports
bench.
"""

import json
import signal
import sys


def refuses_interpreter(tool, why):
    """For a tool that compiles kernels for a GPU: True, having said so on stderr, when
    TRITON_INTERPRET is set (the interpreter replaces triton.jit when the kernels are imported)."""
    from fastformer.environment import interpreter_requested

    if not interpreter_requested():
        return False
    print(f"tools.{tool}: unset TRITON_INTERPRET: {why}", file=sys.stderr)
    return True


def write_report(path, report, table):
    """Write a tool's report as JSON to `path` (its folder made), print its table and where it went."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n")
    print(table)
    print(f"\nwrote {path}")


def interrupt_once():
    """SIGINT raises KeyboardInterrupt the first time and is ignored after it, in this process: a
    run stopped at its limit (tools/gpu_run.sh's `timeout` signals the command and then its whole
    process group, so a process can get it twice, and a parent passes it on to its subprocess) winds
    down and writes its files without a second interrupt cutting that short."""

    def interrupted(signum, frame):
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, interrupted)
