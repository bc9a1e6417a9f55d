"""tools.host_overhead: a short run in a process without TRITON_INTERPRET writes a report with every
row, each a positive time, and prints its table. It checks the instrument, not the figures."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parent.parent


def test_a_quick_run_writes_every_row(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(ROOT), TRITON_CACHE_DIR=str(tmp_path / "cache"))
    out = tmp_path / "host.json"
    command = [sys.executable, "-m", "tools.host_overhead", "--quick", "--json", str(out)]
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["schema"] == "fastformer.host_overhead/1"
    assert set(report["floors"]) == {"kernel[grid]", "launch(kernel)[grid]", "PreparedLaunch", "triton_op"}
    ops = report["ops"]
    for op in ("attention, key padding", "attention, causal", "attention, key padding + dropout", "linear_gelu"):
        assert {f"{op}: forward", f"{op}: forward + backward"} <= set(ops)
    assert all(row["us"] > 0 and row["x_triton_op"] > 0 for row in ops.values())
    step = report["train_step"]
    assert step["triton_us"] > 0 and step["reference_us"] > 0
    assert step["fused_adamw"]["triton_us"] > 0 and step["fused_adamw"]["reference_us"] > 0
    assert step["triton_over_reference_paired"] > 0 and step["fused_adamw"]["triton_over_reference_paired"] > 0
    assert "the same with the fused AdamW `fastformer train` steps" in proc.stdout
    ffn = report["ffn_forward_backward"]
    assert ffn["feed_forward_us"] > 0 and ffn["eager_us"] > 0 and ffn["feed_forward_over_eager_paired"] > 0
    assert "FFN forward + backward, fp32: feed_forward" in proc.stdout
    optimizer = report["optimizer_step"]
    assert optimizer["foreach"] > 0 and optimizer["fused"] > 0 and "AdamW step alone: foreach" in proc.stdout
    assert "| attention, key padding: forward |" in proc.stdout and "x the reference's host time" in proc.stdout


def test_it_refuses_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    command = [sys.executable, "-m", "tools.host_overhead", "--quick"]
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "unset TRITON_INTERPRET" in proc.stderr


def test_the_paired_ratio_is_the_median_of_each_rounds_ratio():
    """A round where the machine was slow for both rows leaves the paired ratio as it is; the ratio
    of best times takes each row's best from rounds of different speeds."""
    from tools.host_overhead import _paired

    rounds = {"triton": [8.0, 16.0, 8.8], "reference": [10.0, 20.0, 11.0]}  # round 2: all twice as slow
    assert _paired(rounds, "triton", "reference") == 0.8
    rounds = {"triton": [8.0, 6.0, 8.0], "reference": [10.0, 10.0, 10.0]}  # a fast moment of one row alone
    assert _paired(rounds, "triton", "reference") == 0.8 and min(rounds["triton"]) / min(rounds["reference"]) == 0.6
