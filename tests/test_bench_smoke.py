"""The benchmark command a user without a GPU is pointed to (`pytest bench --benchmark-only` skips
every benchmark there and names it): `python -m bench.report --smoke`, run as written from the
checkout's root, with nothing set in the environment. It passes, runs the kernels through Triton's
interpreter and says so, and writes into a new temporary directory, never into bench/results/."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's smoke run; a GPU runs the benchmarks")


def bench_report(*args, env=None):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | (env or {})
    return subprocess.run(
        [sys.executable, "-m", "bench.report", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900
    )


def results_listing():
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "bench" / "results").rglob("*"))


@CPU_ONLY
def test_the_smoke_command_passes_on_a_cpu_and_writes_only_to_a_temporary_directory():
    before = results_listing()
    done = bench_report("--smoke")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "through Triton's interpreter" in done.stdout
    counts = re.search(r"(\d+) measured, (\d+) skipped, (\d+) failed", done.stdout)
    assert counts and int(counts[1]) > 0 and counts[3] == "0", done.stdout[-2000:]
    written = [Path(line.removeprefix("wrote ")) for line in done.stdout.splitlines() if line.startswith("wrote ")]
    folders = {path.parent for path in written}
    try:
        assert len(folders) == 1 and all(path.is_file() for path in written)
        (folder,) = folders
        assert folder.name.startswith("fastformer-smoke-") and ROOT not in folder.parents
        assert {path.name for path in written} >= {"cpu.json", "cpu.md"}
    finally:
        for folder in folders:
            if folder.name.startswith("fastformer-smoke-"):
                shutil.rmtree(folder, ignore_errors=True)
    assert results_listing() == before
    assert "USDT" not in done.stdout + done.stderr and "profiler_start" not in done.stderr  # Kineto's lines held back


def test_the_report_is_named_as_it_is_run_and_kinetos_lines_are_held_back():
    """`--help` names `python -m bench.report`; a profile holds back the lines Kineto writes to
    stderr (`USDT: ... profiler_start`), passing on anything else written meanwhile (issue 69, 5)."""
    assert bench_report("--help").stdout.startswith("usage: python -m bench.report ")
    code = (
        "import sys, torch\n"
        "from torch.profiler import ProfilerActivity\n"
        "from bench.common import profiling\n"
        "with profiling([ProfilerActivity.CPU]) as profiler:\n"
        "    torch.ones(3) + 1\n"
        "    print('kept', file=sys.stderr)\n"
        "print(any(e.name == 'aten::add' for e in profiler.events()))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "True", done.stderr[-3000:]
    assert done.stderr.strip() == "kept", done.stderr


@CPU_ONLY
def test_benchmarks_all_skipped_list_no_durations():
    """`pytest bench --benchmark-only` on a CPU skips every case: no slowest-durations list of skips."""
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "bench/test_ffn.py", "--benchmark-only", "-p", "no:cacheprovider"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0 and " skipped" in done.stdout, done.stdout[-2000:]
    assert "slowest" not in done.stdout, done.stdout[-2000:]


@CPU_ONLY
def test_the_smoke_run_writes_where_asked(tmp_path):
    done = bench_report("--smoke", "--filter", "add_layer_norm-eager", "--out", str(tmp_path / "r"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "r" / "cpu.json").is_file()


@CPU_ONLY
def test_a_cpu_smoke_run_with_the_interpreter_turned_off_is_refused_in_one_line(tmp_path):
    done = bench_report("--smoke", "--out", str(tmp_path / "r"), env={"TRITON_INTERPRET": "0"})
    assert done.returncode == 2 and not (tmp_path / "r" / "cpu.json").exists()
    (line,) = done.stderr.strip().splitlines()
    assert "TRITON_INTERPRET" in line and "interpreter" in line
