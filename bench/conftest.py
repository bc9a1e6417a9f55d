"""pytest-benchmark suites: `pytest bench --benchmark-only` on a CUDA machine.

Every case comes from bench/cases.py (the same cases `python -m bench.report` runs). Without a
GPU everything skips with the reason and pytest exits 0; `python -m bench.report --smoke` is the
CPU check of the same code.
"""
import pytest
import torch

from bench.common import Skip, peak_memory_mb, synchronize

HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda") if HAS_CUDA else torch.device("cpu")
NO_GPU = "the benchmarks need a CUDA GPU and this machine has none (CPU check: python -m bench.report --smoke)"


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    for item in items:
        item.add_marker(pytest.mark.skip(reason=NO_GPU))


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
