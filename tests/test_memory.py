"""tools.memory, where a train step's memory goes: the instrument's quick run (a subprocess: the
kernels are imported there without TRITON_INTERPRET), and what it finds of the feed-forward: one
(M, d_ff) tensor kept for its backward, the pre-activation, where it kept the activation too."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fastformer
from bench.cases import review_batch
from tools.memory import QUICK, SavedTensors

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("memory") / "memory.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_DEFAULT_FP_FUSION="1", TRITON_CACHE_DIR=str(out.parent / "triton"))
    proc = subprocess.run(
        [sys.executable, "-m", "tools.memory", "--quick", "--json", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "at backward, fastformer over the reference: " in proc.stdout
    return json.loads(out.read_text())


def _real_tokens(report):
    """The real tokens of the quick run's batch: the rows the fastformer path's encoder computes."""
    config = fastformer.Config.tutorial(**QUICK["config"])
    enc = review_batch(config, report["batch"], False, "cpu")[0]
    return int((enc != config.i_pad).sum())


def _rounding(rows):
    """The bytes the report's rounding may move a sum of rows by: each row's MB is rounded to 0.001
    (half of it, 524 bytes, is 0.15% of the quick run's 0.33 MB of add + LayerNorm)."""
    return len(rows) * 0.0005 * 2**20


def test_a_quick_run_counts_each_part_of_both_paths(report):
    paths = report["paths"]
    assert set(paths) == {"fastformer", "reference_fp32"} and report["batch"] == 8
    for path in paths.values():
        assert path["weights_mb"] > 0 and path["optimizer_mb"] >= 2 * path["gradients_mb"] > 0  # exp_avg, exp_avg_sq
        assert path["saved_mb"] == pytest.approx(sum(row["mb"] for row in path["saved"]), abs=0.01)
        parts = path["weights_mb"] + path["optimizer_mb"] + path["saved_mb"]
        assert path["at_backward_mb"] == pytest.approx(parts, abs=0.01)  # each rounded to 0.001
    assert paths["fastformer"]["weights_mb"] == paths["reference_fp32"]["weights_mb"]  # one model
    assert report["at_backward_ratio"] == pytest.approx(
        paths["fastformer"]["at_backward_mb"] / paths["reference_fp32"]["at_backward_mb"], abs=1e-3
    )


def test_the_feed_forward_keeps_its_input_and_pre_activation_only(report):
    """The planned feed-forward (the path a GPU runs: no dispatch mode over the step) saves x and
    the pre-activation; the activation, as many bytes again as the pre-activation, is rewritten
    by the backward's activation-gradient kernel (kernels/feed_forward.py)."""
    rows = [r for r in report["paths"]["fastformer"]["saved"] if r["site"] == "kernels/feed_forward.py:feed_forward"]
    assert rows and {r["dtype"] for r in rows} == {"bfloat16"}
    batch, real = report["batch"], _real_tokens(report)
    config = fastformer.Config.tutorial(**QUICK["config"])
    assert sum(r["tensors"] for r in rows) == 4  # x and pre, of the encoder's one layer and the decoder's
    # bf16: the encoder's rows of real tokens (fastformer.packing), the decoder's [BOS] rows
    kept = (real + batch) * (config.d_hidn + config.d_ff) * 2
    assert sum(r["mb"] for r in rows) * 2**20 == pytest.approx(kept, abs=_rounding(rows))  # not the activation too


def test_saved_tensors_are_counted_once_per_storage_and_the_weights_not_at_all():
    linear = torch.nn.Linear(4, 3)
    saved = SavedTensors(linear)
    x = torch.randn(5, 4, requires_grad=True)
    with saved.counting():
        y = linear(x)
        (y * y).sum().backward()
    nbytes = {(site.split(":")[-1], dtype): n for (site, dtype, _), n in saved.rows.items()}
    # linear saves x (its weight is a parameter: not counted); y * y saves y, twice, counted once
    assert sum(nbytes.values()) == x.untyped_storage().nbytes() + y.untyped_storage().nbytes()
    assert sum(saved.tensors.values()) == 2


def test_add_layer_norm_keeps_its_fp32_sum_and_row_statistics_only(report):
    """Each add + LayerNorm saves the fp32 sum it normalizes, and each row's mean and 1/std, for
    its backward (kernels/add_layer_norm.py): not its input and residual, two (rows, d) tensors in
    the model's dtype, nor a copy of either."""
    site = "kernels/add_layer_norm.py:add_layer_norm"
    rows = [r for r in report["paths"]["fastformer"]["saved"] if r["site"] == site]
    assert rows and {r["dtype"] for r in rows} == {"float32"}
    config = fastformer.Config.tutorial(**QUICK["config"])
    batch, real = report["batch"], _real_tokens(report)
    # rows: the encoder layer's two on its real tokens (fastformer.packing), the decoder layer's three ([BOS])
    calls = {real: 2, batch: 3}
    assert sum(r["tensors"] for r in rows) == 3 * sum(calls.values())  # the sum, the mean, the 1/std
    kept = sum(n * rows_ * (config.d_hidn + 2) * 4 for rows_, n in calls.items())
    assert sum(r["mb"] for r in rows) * 2**20 == pytest.approx(kept, abs=_rounding(rows))
