"""tools.work, the count of the work a step gives a GPU: its arithmetic by hand (matrix products,
attention's pairs under padding and a causal mask, multi_tensor_apply's launches, the roofline and
the bound, an epoch's weighting), and one real count of a small config under the dry-run driver,
whose kernels are those tools.launches counts through the interpreter."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tools import work
from tools.work import Kernel

ROOT = Path(__file__).resolve().parent.parent


def test_matmul_flops_from_the_tensors():
    a, b = torch.empty(8, 16), torch.empty(16, 4)
    assert work.matmul_flops("mm", [a, b], []) == 2 * 8 * 16 * 4
    assert work.matmul_flops("addmm", [torch.empty(4), a, b], []) == 2 * 8 * 16 * 4
    assert work.matmul_flops("bmm", [torch.empty(3, 8, 16), torch.empty(3, 16, 4)], []) == 2 * 3 * 8 * 16 * 4
    conv = work.matmul_flops("convolution", [torch.empty(2, 16, 10), torch.empty(32, 16, 1)], [torch.empty(2, 32, 10)])
    assert conv == 2 * (2 * 32 * 10) * 16
    assert work.matmul_flops("add", [a, a], [a]) == 0


def test_attention_counts_the_key_blocks_a_row_reads():
    B, H, L, D = 2, 3, 100, 16
    q = k = torch.empty(B, H, L, D)
    pad = torch.arange(L)[None, :] >= torch.tensor([[10], [70]])  # 10 and 70 real keys
    named = {"Q": q, "K": k, "PAD": pad}
    flags = {"HAS_PAD": True, "IS_CAUSAL": False, "BLOCK_N": 64}
    # the blocks up to each row's last real key: 64 keys and 100 (128 capped at the length)
    assert work.attention_flops("_attn_fwd_kernel", named, flags) == 2 * D * H * L * (64 + 100) * 2
    assert work.attention_flops("_attn_bwd_kernel", named, {**flags, "DQ_PASS": True}) == 2 * D * H * L * 164 * 3
    assert work.attention_flops("_attn_bwd_kernel", named, {**flags, "DQ_PASS": False}) == 2 * D * H * L * 164 * 4
    assert work.attention_flops("_attn_bwd_one_pass_kernel", named, flags) == 2 * D * H * L * 164 * 5  # one pass
    assert work.attention_flops("_attn_bwd_delta_kernel", {"O": q}, {}) == 0
    causal = {"HAS_PAD": False, "IS_CAUSAL": True}
    assert work.attention_flops("_attn_fwd_kernel", named, causal) == 2 * D * H * B * (L * (L + 1) // 2) * 2
    one = {"Q": torch.empty(B, H, 1, D), "K": k, "PAD": None}  # a one-token decoder's cross-attention
    assert work.attention_flops("_attn_fwd_kernel", one, {}) == 2 * D * H * B * L * 2


@pytest.mark.parametrize(
    "sizes, depth, launches",
    [
        ([10] * 5, 1, 1),
        ([10] * 110, 1, 1),  # 110 tensors: one launch's worth at depth 1
        ([10] * 111, 1, 2),
        ([10] * 37, 4, 2),  # 36 tensors a launch at depth 4 (AdamW's)
        ([65536 * 320], 1, 1),  # 320 chunks fill one launch
        ([65536 * 321], 1, 2),  # one more goes on in the next
        ([65536 * 200, 65536 * 200], 1, 2),  # the second tensor is cut by a full launch
        ([0, 10], 1, 1),  # an empty tensor is skipped
    ],
)
def test_foreach_launches_follow_multi_tensor_apply(sizes, depth, launches):
    lists = [[torch.empty(n) for n in sizes]] * depth
    assert work.foreach_launches(lists) == launches


def test_the_bound_is_the_roofline_or_the_floor_whichever_is_longer():
    peaks = {"flops": {"bf16": 1e12, "fp32": 1e11}, "bytes": 1e9}
    gemm = Kernel("forward", "x", "aten.mm", 1, 4e6, "bf16", 1e3)  # 4 us of products, 1 us of bytes
    assert gemm.roofline_us(peaks) == pytest.approx(4.0) and gemm.bound_us(peaks, floor=3.0) == pytest.approx(4.0)
    small = Kernel("forward", "x", "aten.add", 2, 0.0, "fp32", 2e3)  # two launches of 1 us: each the floor
    assert small.roofline_us(peaks) == pytest.approx(1.0) and small.bound_us(peaks, floor=3.0) == pytest.approx(6.0)
    fp32 = Kernel("forward", "x", "aten.mm", 1, 4e6, "fp32", 0.0)  # fp32 products at their own peak
    assert fp32.roofline_us(peaks) == pytest.approx(40.0)
    assert [k.kind() for k in (gemm, small)] == ["GEMM (cuBLAS)", "small ops"]
    assert Kernel("optimizer", "optimizer", "aten.mm", 1, 0, "fp32", 0).kind() == "optimizer"


def test_an_epoch_is_its_batches_weighted_and_the_optimizer_once():
    long = [Kernel("forward", "attention", "triton._attn_fwd_kernel", 1, 3e9, "bf16", 1e6)]
    short = [Kernel("forward", "attention", "triton._attn_fwd_kernel", 1, 1e9, "bf16", 1e6)]
    step = [Kernel("optimizer", "optimizer", "aten._fused_adamw_", 2, 0.0, "fp32", 4e6)]
    summary = work.summarize([(3, long), (1, short)], step, real_flops=2e9)
    assert summary["kernels"] == 3 and summary["flops"] == pytest.approx(2.5e9)
    assert summary["flops_over_real"] == pytest.approx(1.25) and summary["bytes"] == pytest.approx(5e6)
    assert set(summary["by_kind"]) == {"attention", "optimizer"} and summary["by_phase"]["optimizer"]["kernels"] == 2
    # at the H200's peaks the optimizer's two launches are each at the 3 us floor, the long batch's
    # attention just over it (3 GFLOP at 989 TFLOP/s), the short one's under
    assert [k["kernel"] for k in summary["largest"]] == ["aten._fused_adamw_", "triton._attn_fwd_kernel"]
    attention = 0.75 * 3e9 / work.PEAKS["flops"]["bf16"] * 1e6 + 0.25 * work.LAUNCH_FLOOR_US
    expected = (2 * work.LAUNCH_FLOOR_US + attention) / 1e3
    assert summary["bound_ms"] == pytest.approx(expected, abs=1e-6)  # ms to 6 places


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """One `python -m tools.work --quick` on the bench batch, fastformer only (about a minute of one
    core, the kernels compiled for sm_90a)."""
    out = tmp_path_factory.mktemp("work") / "work.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    command = [sys.executable, "-m", "tools.work", "--quick", "--workloads", "bench", "--providers", "fastformer"]
    command += ["--out", str(out)]
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


def test_a_quick_count_sees_the_kernels_tools_launches_counts(quick):
    """The dry run's kernels per phase are those the interpreter's count (tools.launches) sees for
    the same config, as the counts depend on neither batch nor length; the optimizer aside, which
    tools.work counts per CUDA launch."""
    import fastformer
    from tools import launches

    report, stdout = quick
    ours = report["workloads"]["bench"]["providers"]["fastformer"]
    counter = launches.count_step("fastformer", "train", fastformer.Config.tutorial(**work.QUICK_CONFIG))
    for phase in ("forward", "loss", "backward"):
        expected = sum(n for (p, _, _), n in counter.kernels.items() if p == phase)
        assert ours["train_eager"]["by_phase"][phase]["kernels"] == expected, phase
    step = ours["train_eager"]
    assert step["kernels"] == sum(k["kernels"] for k in step["by_kind"].values())
    assert step["bound_ms"] >= step["roofline_ms"] > 0 and step["under_floor"] <= step["kernels"]
    assert step["flops_over_real"] >= 1.0  # a padded batch executes more than its real tokens need
    # the replayed step's AdamW is the eager step's fused one made capturable: the same launches, few
    replayed = ours["train_replayed"]["by_phase"]["optimizer"]
    assert replayed["kernels"] == step["by_phase"]["optimizer"]["kernels"] < 20, replayed
    assert "| fastformer | train, replayed |" in stdout


def test_the_ffn_op_makes_dpre_in_the_dh_gemm_and_moves_no_dh(quick):
    """The FFN op alone: its backward is the dH GEMM with the activation gradient in its epilogue
    (no activation-gradient pass, no product for dH: three products, for dX, dW1 and dW2), whose
    first-touch bytes are dOut, W2, pre, dPre, h and db1's partials, and no dH."""
    report, stdout = quick
    op = report["ops"]["feed_forward"]
    M, d, d_ff = op["M"], op["d"], op["d_ff"]
    kernels = {(k["kernel"], k["phase"]): k for k in op["largest"]}
    assert ("triton._activation_grad_kernel", "backward") not in kernels
    assert kernels["aten.mm", "backward"]["kernels"] == 3
    fused = kernels["triton._ffn_act_grad_kernel", "backward"]
    partial_rows = -(-M // 64) * d_ff * 4  # fp32, a row per 64 rows (linear_gelu.PARTIAL_ROWS on sm_90a)
    assert fused["kernels"] == 1 and fused["bytes"] == 2 * (M * d + d * d_ff + 3 * M * d_ff) + partial_rows
    assert fused["flops"] == 2 * M * d * d_ff
    assert "### feed_forward, forward + backward, alone" in stdout
