"""tools.sass: its reading of SASS on a made-up listing (loops, the hot one, the counts and ratios),
and a run on one of the model's kernels in a process without TRITON_INTERPRET, which must find the
GEMM's main loop with its HGMMA instructions. It checks the instrument, not the kernels' figures."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tools import sass

ROOT = Path(__file__).resolve().parent.parent

# A kernel with an outer loop (.L_x_0) holding an inner one (.L_x_1) with two wgmmas and two exp2,
# a predicated forward branch outside the loops, and the branch to itself that ends every kernel.
LISTING = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/               @P0 BRA `(.L_x_2) ;
.L_x_0:
        /*0020*/                   IADD3 R2, R2, 0x1, RZ ;
.L_x_1:
        /*0030*/                   WARPGROUP.ARRIVE ;
        /*0040*/                   HGMMA.64x64x16.F32 R24, gdesc[UR20], R24 ;
        /*0050*/                   HGMMA.64x64x16.F32 R24, gdesc[UR20], R24, gsb0 ;
        /*0060*/                   MUFU.EX2 R3, R4 ;
        /*0070*/                   MUFU.EX2 R5, R6 ;
        /*0080*/                   MUFU.RCP R7, R8 ;
        /*0090*/                   FFMA R9, R9, R10, R11 ;
        /*00a0*/              @!P1 BRA `(.L_x_1) ;
        /*00b0*/                   ISETP.GE.AND P2, PT, R2, 0x8, PT ;
        /*00c0*/              @!P2 BRA `(.L_x_0) ;
.L_x_2:
        /*00d0*/                   EXIT ;
.L_x_3:
        /*00e0*/                   BRA `(.L_x_3);
"""


def test_the_listing_is_read_into_instructions_labels_and_loops():
    instructions, labels = sass.read_sass(LISTING)
    assert len(instructions) == 15
    assert labels == {".L_x_0": 2, ".L_x_1": 3, ".L_x_2": 13, ".L_x_3": 14}
    assert instructions[1].predicated and instructions[1].opcode == "BRA"
    loops = sass.find_loops(instructions, labels)
    assert [(loop.first, loop.last) for loop in loops] == [(3, 10), (2, 12)]  # not the branch to itself
    (hot,) = sass.hot_loops(instructions, loops)
    assert (hot.first, hot.last) == (3, 10)


def test_a_loop_is_measured_per_warp_and_iteration():
    instructions, labels = sass.read_sass(LISTING)
    (hot,) = sass.hot_loops(instructions, sass.find_loops(instructions, labels))
    row = sass.measure_loop(instructions, hot)
    flops = 2 * (2 * 64 * 64 * 16)
    assert row["instructions"] == 8 and row["hgmma"] == 2 and row["groups"] == 1
    assert row["mufu"] == 3 and row["ex2"] == 2 and row["mma_flops"] == flops and row["straight"]
    assert row["per_kflop"] == pytest.approx(8 / (flops / 4) * 1000)
    assert row["ex2_per_kflop"] == pytest.approx(2 / (flops / 4) * 1000)
    # MMA 64 clocks, issue 8 * 4 / 4 = 8, MUFU 3 * 4 * 32 / 16 = 24: the tensor cores bound it
    assert row["tc_bound"] == 1.0 and row["clocks"] == 64
    # with pre-Hopper MMAs, which it does not count, the loop is MUFU's: 24 clocks
    instructions, labels = sass.read_sass(LISTING.replace("HGMMA.64x64x16.F32", "HMMA.16816.F32"))
    (hot,) = sass.hot_loops(instructions, sass.find_loops(instructions, labels))
    assert sass.measure_loop(instructions, hot)["clocks"] == 24


def test_attention_loops_are_costed_per_score_and_a_call_adds_its_three_passes():
    # a warp group's iteration covers BLOCK_M x BLOCK_N x 4 / num_warps scores
    assert sass._scores_per_group("_attn_fwd_kernel", "BLOCK_D=64 BLOCK_M=128 BLOCK_N=64 w8 s3") == 4096
    assert sass._scores_per_group("_attn_bwd_kernel(DQ_PASS=False)", "BLOCK_D=64 BLOCK_M=32 BLOCK_N=128 w4 s2") == 4096
    assert sass._scores_per_group("_linear_gelu_fwd_kernel", "BLOCK_K=64 BLOCK_M=128 BLOCK_N=128 w8 s3") is None

    def row(shape, kernel, loop=0, per_kscore=100.0):
        return {"shape": shape, "kernel": kernel, "loop": loop, "main": loop == 0, "clocks_per_kscore": per_kscore}

    passes = ["_attn_fwd_kernel", "_attn_bwd_kernel(DQ_PASS=True)", "_attn_bwd_kernel(DQ_PASS=False)"]
    rows = [row("call", kernel, per_kscore=k) for kernel, k in zip(passes, (150.0, 140.0, 180.0))]
    rows += [row("call", passes[0], loop=1, per_kscore=999.0)]  # an edge loop: not the call's
    rows += [row("call", "_attn_draw_kernel", loop=None, per_kscore=None)]  # no loop to read
    rows += [row("forward only", passes[0])]
    rows += [row("gemm", "_linear_gelu_fwd_kernel")]
    found = sass.calls(rows)
    assert list(found) == ["call"]
    assert found["call"] == {
        "forward": 150.0,
        "dq": 140.0,
        "dkdv": 180.0,
        "total": 470.0,
        "left_out": ["_attn_draw_kernel"],
    }
    table = sass.table({"triton": "3.9.0", "date": "today", "rows": [], "calls": found})
    assert "| call | 150 | 140 | 180 | 470 | _attn_draw_kernel |" in table


def test_a_loop_without_mma_has_no_ratios_and_a_kernel_without_mma_has_its_innermost_loops():
    listing = LISTING.replace("HGMMA.64x64x16.F32", "HMMA.16816.F32")
    instructions, labels = sass.read_sass(listing)
    (hot,) = sass.hot_loops(instructions, sass.find_loops(instructions, labels))
    row = sass.measure_loop(instructions, hot)
    assert (hot.first, hot.last) == (3, 10) and row["mma_flops"] == 0 and row["per_kflop"] is None


@pytest.mark.versions
def test_a_run_finds_the_ffn_gemm_main_loop(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(ROOT), TRITON_DEFAULT_FP_FUSION="1")
    out = tmp_path / "sass.json"
    command = [sys.executable, "-m", "tools.sass", "--shapes", "ffn/model", "--json", str(out)]
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["schema"] == "fastformer.sass/1" and report["target"] == "sm_90a"
    gemm = [r for r in report["rows"] if r["kernel"] == "_linear_gelu_fwd_kernel" and r["main"]]
    assert len(gemm) == 1, report["rows"]
    (row,) = gemm
    assert row["hgmma"] > 0 and row["mma_flops"] > 0 and row["straight"]
    assert 0 < row["per_kflop"] < 10 and 0 < row["tc_bound"] <= 1 and row["registers"] > 0
    assert "| ffn/model | _linear_gelu_fwd_kernel |" in proc.stdout


def test_unknown_shapes_and_the_interpreter_are_refused():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run(
        [sys.executable, "-m", "tools.sass", "--shapes", "nope"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 2 and "unknown shapes ['nope']" in proc.stderr
    env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run([sys.executable, "-m", "tools.sass"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == 2 and "unset TRITON_INTERPRET" in proc.stderr
