"""pytest-benchmark suites: `pytest bench --benchmark-only` on a CUDA machine.

Every case comes from bench/cases.py (the same cases `python -m bench.report` runs). A benchmark
runs only under --benchmark-only and on a GPU; elsewhere it skips with the reason, so the plain
`pytest`, which collects bench/ for the suite's own tests (test_report.py), times nothing.
`python -m bench.report --smoke` is the CPU check of the benchmarks' code.
"""

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
# Without a GPU the suite's own tests run the kernels through Triton's interpreter, which Triton
# reads when a kernel is decorated: before bench.cases imports fastformer.kernels.
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from bench.common import Skip, peak_memory_mb, synchronize  # noqa: E402

DEVICE = torch.device("cuda") if HAS_CUDA else torch.device("cpu")
NO_GPU = (
    "the benchmarks need a CUDA GPU and this machine has none (the CPU check of their code, through Triton's "
    "interpreter: python -m bench.report --smoke)"
)
NOT_ASKED = "a benchmark: run the benchmarks with `pytest bench --benchmark-only`"


def pytest_configure(config):
    """`pytest bench --benchmark-only` without a GPU skips every case, so the slowest-durations list
    (pyproject's --durations) would list skips: it is left out there (issue 69, item 5)."""
    if not HAS_CUDA and config.getoption("benchmark_only", False):
        config.option.durations = None


def pytest_collection_modifyitems(config, items):
    """Skip the benchmarks (the tests that take pytest-benchmark's `benchmark` fixture) without a
    GPU, or without --benchmark-only. The hook sees the whole session's items, tests/ too."""
    reason = NO_GPU if not HAS_CUDA else None if config.getoption("benchmark_only") else NOT_ASKED
    if reason is None:
        return
    for item in items:
        if "benchmark" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.skip(reason=reason))


def run_case(benchmark, case, rounds=10, warmup_rounds=3):
    """Check the case's result, then time it (synchronizing inside the timed callable) and record
    TFLOP/s, tokens/s and peak memory in extra_info. Providers of one case share a group, so the
    table compares them side by side."""
    try:
        run, check = case.setup()
    except Skip as reason:
        pytest.skip(str(reason))
    run()
    synchronize(DEVICE)
    check()

    def timed():
        run()
        synchronize(DEVICE)

    benchmark.group = f"{case.bench} " + " ".join(f"{k}={v}" for k, v in case.params.items())
    benchmark.pedantic(timed, rounds=rounds, warmup_rounds=warmup_rounds, iterations=1)
    seconds = benchmark.stats.stats.median
    benchmark.extra_info.update(
        provider=case.provider,
        **case.params,
        **case.extra,
        tflops=case.flops / seconds / 1e12 if case.flops else None,
        tokens_per_s=case.tokens / seconds if case.tokens else None,
        peak_mem_mb=peak_memory_mb(run, DEVICE),
    )
