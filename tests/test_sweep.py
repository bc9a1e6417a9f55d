"""tools.sweep, the GPU sweep of the kernels' variants and configs, rehearsed on a CPU: a dry run
compiles what the GPU run would time (every variant, every config each rule keeps) and says which
is each rule's pick; the table's arithmetic on records made up here; an interrupted sweep still
reports. What the sweep finds needs a GPU (tools/gpu_run.sh --sweep)."""

import collections
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.timing import Ratio, Timing
from tools import sweep

ROOT = Path(__file__).resolve().parent.parent
# one family of each kind of launch: the causal forward's long shape, the model's call (padding,
# dropout, fused QKV views), the FFN's GEMM
DRY_RUN_FAMILIES = ("attention causal L4096", "attention model call L64", "gemm ffn M8192")


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("sweep")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_DEFAULT_FP_FUSION="1", TRITON_CACHE_DIR=str(out / "triton"))
    families = [arg for name in DRY_RUN_FAMILIES for arg in ("--family", name)]
    proc = subprocess.run(
        [sys.executable, "-m", "tools.sweep", "--dry-run", "--quick", "--out", str(out), *families],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "sweep.json").read_text()), (out / "sweep.md").read_text()


def test_a_dry_run_compiles_every_variant_and_config_each_rule_keeps(dry_run):
    report, _ = dry_run
    assert report["schema"] == sweep.SCHEMA and report["dry_run"] and report["families"] == list(DRY_RUN_FAMILIES)
    records = report["records"]
    broken = [
        f"{r['family']} {r['pass_name']} {r['variant']} {r['config']}: {r['error']}" for r in records if r["error"]
    ]
    assert not broken, "\n".join(broken)
    assert {r["status"] for r in records} == {"compiled"}
    passes = collections.defaultdict(set)
    for r in records:
        passes[(r["family"], r["pass_name"])].add(r["variant"])
    expected = {(f, p) for f in DRY_RUN_FAMILIES[:2] for p in ("forward", "dQ", "dK/dV", "dK/dV/dQ")} | {
        (DRY_RUN_FAMILIES[2], p) for p in ("forward", "dH")
    }
    assert set(passes) == expected
    # the GEMM's third variant: cuBLAS's product (not run in a dry run), then the activation kernel
    # (the forward) or the activation-gradient pass (dH), each named by the Triton GEMM's choice
    variants = {key: set(sweep.VARIANTS["gemm" if key[0].startswith("gemm") else "attention"]) for key in passes}
    assert passes == variants and sweep.VARIANTS["gemm"] == ("pointer", "tma", "cublas"), passes
    cublas = [r for r in records if r["variant"] == "cublas"]
    assert [r["pass_name"] for r in cublas] == ["forward", "dH"], cublas  # one config each
    assert not any(r["rule_pick"] for r in cublas)  # PREFERS_CUBLAS is False
    assert [r["kernel"] for r in cublas] == ["linear_gelu", "ffn activation gradient"]


def test_each_pass_has_one_rule_pick_in_the_variant_its_kernel_prefers(dry_run):
    report, _ = dry_run
    picks = collections.Counter((r["family"], r["pass_name"]) for r in report["records"] if r["rule_pick"])
    assert set(picks.values()) == {1} and len(picks) == 10
    assert {r["variant"] for r in report["records"] if r["rule_pick"]} == {"pointer"}  # PREFERS_TMA is False


def test_the_model_calls_dkdv_through_descriptors_leaves_out_the_tile_that_spills(dry_run):
    """attention._dkdv_fits: the 64 x 64 tile in 4 warps compiles clean through pointers (2 stages,
    dropout, no causal mask) and spills through descriptors, so the TMA variant does not try it."""
    report, _ = dry_run
    tile = "BLOCK_M=64 BLOCK_N=64 w4 s2"
    configs = {
        r["variant"]: {
            r2["config"]
            for r2 in report["records"]
            if r2["variant"] == r["variant"]
            and (r2["family"], r2["pass_name"]) == ("attention model call L64", "dK/dV")
        }
        for r in report["records"]
    }
    assert tile in configs["pointer"] and tile not in configs["tma"]


def test_the_table_of_a_dry_run_says_it_timed_nothing(dry_run):
    report, markdown = dry_run
    assert "A dry run: compiled for sm_90a on a CPU, nothing timed." in markdown
    assert all(row["speedup"] is None and row["fastest"] is None for row in report["best"])


KERNELS = {
    "forward": "attention forward",
    "dQ": "attention dQ",
    "dK/dV": "attention dK/dV",
    "dK/dV/dQ": "attention dK/dV/dQ",
}
KEY = {"HEAD_DIM": 64, "BLOCK_D": 64, "LQ_BUCKET": 4096, "LK_BUCKET": 4096, "IS_CAUSAL": True}


def _record(pass_name, variant, config, pick, median, p20, p80, family="f"):
    """A made-up timed record; `config` a letter (BLOCK_M 128 for "a", 64 for any other)."""
    meta = {"BLOCK_M": 128 if config == "a" else 64, "BLOCK_N": 64}
    return sweep.Record(
        family, pass_name, variant, config, pick, "timed", median, p20, p80, 20, 1.0,
        kernel=KERNELS[pass_name], key=KEY, dtype="torch.bfloat16", meta=meta, num_warps=8, num_stages=3,
    )  # fmt: skip


def test_the_fastest_is_set_beside_the_rule_pick_with_the_interval_of_their_spreads():
    records = [
        _record("forward", "pointer", "a", True, 1.0, 0.9, 1.1),
        _record("forward", "tma", "a", False, 0.5, 0.45, 0.55),
        _record("forward", "tma", "b", False, 0.8, 0.7, 0.9),
        sweep.Record("f", "dQ", "pointer", "a", True, "not timed"),
        _record("dQ", "tma", "a", False, 2.0, 1.9, 2.1),
    ]
    rows = {row["pass"]: row for row in sweep.best_per_pass(records)}
    forward = rows["forward"]
    assert forward["pick"]["config"] == "a" and forward["pick"]["variant"] == "pointer"
    assert forward["fastest"]["variant"] == "tma" and forward["fastest"]["median_ms"] == 0.5
    expected = Ratio.of(Timing(1.0, 0.9, 1.1, 20), Timing(0.5, 0.45, 0.55, 20))
    assert (forward["speedup"], forward["low"], forward["high"]) == (expected.median, expected.low, expected.high)
    assert forward["speedup"] == 2.0 and forward["low"] == pytest.approx(0.9 / 0.55)
    assert rows["dQ"]["speedup"] is None and rows["dQ"]["fastest"]["median_ms"] == 2.0  # no timed pick: no ratio
    report = {
        "schema": sweep.SCHEMA,
        "env": {"gpu": "G", "date": "D", "torch": "t", "triton": "3", "commit": "c"},
        "dry_run": False,
        "interrupted": False,
        "quick": False,
        "seconds": 1.0,
        "budget_seconds": 480.0,
        "reps": 20,
        "records": [vars(r) for r in records],
        "best": list(rows.values()),
    }
    markdown = sweep.table(report)
    assert "| f | forward | pointer a: 1.0000 ms [0.9000, 1.1000], 1.0 TFLOP/s | tma a: 0.5000 ms" in markdown
    assert "2.000x [1.636, 2.444]" in markdown
    assert "both ways" not in markdown  # no dK/dV or dK/dV/dQ timed: no line for the backward's ways


def test_the_backward_both_ways_sums_the_two_passes_fastest_against_the_one_pass():
    records = [
        _record("dQ", "pointer", "a", True, 1.0, 0.9, 1.1),
        _record("dQ", "tma", "b", False, 0.8, 0.7, 0.9),
        _record("dK/dV", "pointer", "a", True, 1.2, 1.1, 1.3),
        _record("dK/dV/dQ", "pointer", "a", True, 1.6, 1.5, 1.7),
        _record("dK/dV/dQ", "tma", "a", False, 1.5, 1.4, 1.6),
    ]
    report = {"best": sweep.best_per_pass(records)}
    assert sweep.backward_ways(report) == ["f: two passes 2.0000 ms, one pass 1.5000 ms (1.33x)"]
    report["best"] = [row for row in report["best"] if row["pass"] != "dK/dV/dQ"]  # not reached
    assert sweep.backward_ways(report) == []


def test_an_interrupted_sweep_reports_what_it_has(monkeypatch):
    """tools/gpu_run.sh stops the sweep with SIGINT at its limit: the report still comes back,
    marked interrupted, the launches it did not reach "not timed"."""

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(sweep, "compile_all", interrupted)
    report = sweep.sweep(quick=True, dry_run=True, families=["gemm ffn M8192"], progress=lambda message: None)
    assert report["interrupted"] and report["records"]
    assert {r["status"] for r in report["records"]} == {"not timed"}


def test_the_command_refuses_the_interpreter_and_a_machine_without_cuda(tmp_path):
    interpreted = subprocess.run(
        [sys.executable, "-m", "tools.sweep", "--dry-run", "--out", str(tmp_path)],
        cwd=ROOT,
        env=dict(os.environ, TRITON_INTERPRET="1"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert interpreted.returncode == 2 and "tools.sweep: unset TRITON_INTERPRET" in interpreted.stderr
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    no_gpu = subprocess.run(
        [sys.executable, "-m", "tools.sweep", "--out", str(tmp_path)],
        cwd=ROOT,
        env=dict(env, CUDA_VISIBLE_DEVICES=""),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert no_gpu.returncode == 2 and "no CUDA device" in no_gpu.stderr
    assert not list(tmp_path.iterdir())  # nothing written
