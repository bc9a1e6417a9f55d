"""The project's tools, and the benchmarks' library (tools.benchmarks: the cases, their timing and
the report, which bench/'s pytest suites and `python -m bench.report` run too):

    python -m tools.gpu_check      everything a GPU can tell in one command: tests, compile, determinism,
                                   benchmarks, the model's throughput and convergence (docs/benchmarks.md)
    python -m tools.sweep          on a GPU, each variant x config of the kernels that have a choice, timed
                                   (docs/kernels.md)
    python -m tools.sm90_report    the sm_90a compile check's table: every kernel and config compiled
                                   for Hopper on a CPU (tools/sm90.py's dry-run driver; docs/sm90.md)
    python -m tools.launches       kernels launched per train step and per inference (docs/launches.md)
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
