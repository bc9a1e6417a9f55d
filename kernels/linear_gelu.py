"""Linear layer with its activation fused into the GEMM, the exact (erf) GELU or ReLU, in Triton, and
its PyTorch reference: `linear_gelu` (GELU by default; `activation="relu"` for the models that use ReLU).

The forward is a GEMM whose epilogue adds the bias and applies the activation to the accumulator
rounded to the output's dtype (as eager PyTorch's linear then gelu does), so the pre-activation
never makes a round trip through memory before it. (cuBLASLt,
Apex and TransformerEngine epilogues offer only the tanh GELU, which is not the tutorial's.) For
training it also writes the pre-activation; linear_gelu's backward turns dY into dPre = dY * act'(pre)
in one fused elementwise kernel, which also sums dPre's columns over its slab of rows for db (a
second small kernel adds the slabs in a fixed order); then dX and dW come from tensor-core GEMMs.
The FFN's backward (kernels/feed_forward.py) makes dPre where dY is made: `_ffn_act_grad_kernel`
is the GEMM dH = dOut @ W2 with dPre = dH * act'(pre), db's column partials and act(pre) again
(the same bits as the forward's, so that the FFN keeps one (M, d_ff) tensor for its backward where
it kept two) in its epilogue, so dH never goes to memory.
ReLU serves the models that use it (Aladdin Persson's seq2seq Transformer, the TensorFlow/Keras
tutorial's) through the same kernels.

The forward has a second way, chosen per call (kernels/_gemm_choice.py; the default is the rule,
PREFERS_CUBLAS below): the product and its bias by cuBLAS (torch.addmm, its bias added in
cuBLASLt's epilogue), stored as the pre-activation, then `_activation_fwd_kernel` reads it back and
writes act(pre), the same bits as the GEMM's epilogue writes from the same pre-activation. The
backward is the same either way. docs/kernels.md weighs the two ways' memory traffic.

The file, kernel and launcher keep the first name (`_linear_gelu_fwd_kernel`, `_linear_gelu_forward`:
tools/sm90_cases.py, tests/test_sm90_compile.py and the committed sm_90a table name them), as does
the registered op `fastformer::linear_gelu_forward`.
"""

import math

import torch
import torch.nn.functional as F

from ._checks import FLOAT_DTYPES, REFERENCE_DTYPES, argument_check, check_same_device, check_same_dtype, check_tensor
from ._configs import Configs, fp32_launch, gemm_tile_warps, switches
from ._gemm_choice import use_cublas
from ._layout import last_dim_contiguous, rows_view, vector_stride
from ._reduce import _sum_partials_kernel, sum_partials_launch
from ._runtime import (
    INTERPRET,
    Plan,
    Plans,
    PreparedLaunch,
    autocast_inputs,
    autocast_state,
    autograd_apply,
    call_op,
    cdiv,
    compiling_only,
    defer_ops,
    dot_precision,
    eager,
    eager_twin,
    kept,
    launch,
    needs_grad,
    next_power_of_2,
    plain_backward,
    planning,
    require_launchable,
    signature,
    tl,
    triton,
)
from ._tma import use_tma

# tl.constexpr: jit code may read module globals only when they are constexprs (see kernels/_runtime.py)
SQRT1_2 = tl.constexpr(0.7071067811865476)  # 1 / sqrt(2)
INV_SQRT_2PI = tl.constexpr(0.3989422804014327)  # 1 / sqrt(2 * pi)
TORCH_ACTIVATIONS = {"gelu": F.gelu, "relu": F.relu}  # the references' activations, by name
ACTIVATIONS = tuple(TORCH_ACTIVATIONS)
# rows per program of the activation-gradient kernel (a multiple of its BLOCK_M): a constant, so
# db's summation order does not depend on the GPU
GRAD_ROWS_PER_PROGRAM = 64 if INTERPRET else 256


def _gemm_candidates():
    """The GEMM's configs, the rule's preference first: larger output tiles, then deeper K blocks,
    then fewer stages. 128 x 256 tiles spill with the GELU epilogue on sm_90a."""
    tiles = [(128, 128), (64, 256), (128, 64), (64, 128), (64, 64)]
    blocks_k = [(64, 3), (32, 3), (32, 4)]  # (BLOCK_K, num_stages): 64-deep K blocks fit 3 stages
    return [
        (
            {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8},
            gemm_tile_warps({"BLOCK_M": bm, "BLOCK_N": bn}),
            s,
        )
        for bm, bn in tiles
        for bk, s in blocks_k
    ]


def _gemm_fits(meta, num_warps, num_stages, launch):
    """No block wider than the GEMM needs: BLOCK_N within N and BLOCK_K within K, each rounded up to
    a power of two (the smallest candidate always fits). The rows M do not count: they change with
    every batch, and a config chosen by them would compile anew."""
    return meta["BLOCK_N"] <= max(64, next_power_of_2(launch["N"])) and meta["BLOCK_K"] <= max(
        32, next_power_of_2(launch["K"])
    )


def _linear_gelu_fits(meta, num_warps, num_stages, launch):
    """_gemm_fits, and in fp32 (TF32 products: python -m tools.sm90_report --tf32) not 64 x 256 with
    64-deep K blocks (its 3 stages overflow shared memory), nor 128 x 128 where the pre-activation
    is stored (ptxas serializes its wgmma: C7515)."""
    if fp32_launch(launch, "X"):
        tile = (meta["BLOCK_M"], meta["BLOCK_N"])
        if (tile == (64, 256) and meta["BLOCK_K"] == 64) or (tile == (128, 128) and launch["STORE_PRE"]):
            return False
    return _gemm_fits(meta, num_warps, num_stages, launch)


def _act_grad_fits(meta, num_warps, num_stages, launch):
    """_gemm_fits, and in fp32 (TF32 products: python -m tools.sm90_report --tf32) the 64 x 64 tile
    only: with the fp32 pre-activation its epilogue reads, every larger tile spills 60 to 88 B."""
    if fp32_launch(launch, "DOUT") and (meta["BLOCK_M"], meta["BLOCK_N"]) != (64, 64):
        return False
    return _gemm_fits(meta, num_warps, num_stages, launch)


@triton.jit
def apply_activation(a, ACTIVATION: tl.constexpr):
    """act(a) for ACTIVATION "gelu" (exact erf) or "relu"; shared with the fused FFN."""
    if ACTIVATION == "relu":
        return tl.maximum(a, 0.0)
    return 0.5 * a * (1.0 + tl.erf(a * SQRT1_2))


@triton.jit
def activation_derivative(a, ACTIVATION: tl.constexpr):
    """act'(a) in fp32 for ACTIVATION "gelu" (exact erf): Phi(a) + a * phi(a), or "relu": [a > 0]."""
    if ACTIVATION == "relu":
        return tl.where(a > 0.0, 1.0, 0.0)
    return 0.5 * (1.0 + tl.erf(a * SQRT1_2)) + a * INV_SQRT_2PI * tl.exp(-0.5 * a * a)


@triton.jit
def grouped_tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """The (row block, column block) of this program of a GEMM's one-axis grid, in grouped order:
    GROUP_M row blocks take each column block in turn while its tile of the right operand is in L2
    (Triton's matmul tutorial, 03). Shared by the forward GEMM and the backward's dH GEMM."""
    pid = tl.program_id(0)
    n_m_blocks = tl.cdiv(M, BLOCK_M)
    n_n_blocks = tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * n_n_blocks
    first_m = (pid // in_group) * GROUP_M
    group_size = tl.minimum(n_m_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % group_size
    pid_n = (pid % in_group) // group_size
    return pid_m, pid_n


# The rows M bound masks only (the offsets of a row take their alignment from the strides), and
# M_BUCKET only keys the configs: specialized, a batch whose rows are not a multiple of 16 compiles anew.
@triton.jit(do_not_specialize=["M", "M_BUCKET"])
def _linear_gelu_fwd_kernel(
    X, W, B, Y, PRE,
    stride_xm, stride_wn, stride_wk, stride_b, stride_ym, stride_pm,
    M, N, K,
    M_BUCKET,  # config key only
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, STORE_PRE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, TMA: tl.constexpr,
):
    """One (BLOCK_M, BLOCK_N) tile of Y = act(X @ W.T + B), the bias added to the fp32 accumulator and
    the activation applied to it rounded to Y's dtype, and (STORE_PRE) of that pre-activation.
    Grid: cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N) programs on one axis, in grouped order. Launched by
    _linear_gelu_forward.

    Args:
        X: (M, K) input rows (rows_view of x), fp16, bf16 or fp32, unit column stride.
        W: (N, K) weight in X's dtype, nn.Linear layout, any strides (a Conv1d weight's view).
        B: (N,) bias in X's dtype, any stride; None when HAS_BIAS is off.
        Y: (M, N) output in X's dtype, contiguous.
        PRE: (M, N) output in X's dtype, contiguous: X @ W.T + B, saved for the backward; None when
            STORE_PRE is off.
        stride_xm: X's row stride in elements.
        stride_wn, stride_wk: W's strides in elements (row n, column k).
        stride_b: B's stride in elements; 0 when absent.
        stride_ym: Y's row stride in elements.
        stride_pm: PRE's row stride in elements; 0 when absent.
        M: rows; bounds the masks only, not specialized (it changes with every batch).
        N, K: output and input features.
        M_BUCKET: next_power_of_2(M): a key of the config choice only, unused by the code, not specialized.
        HAS_BIAS: B is read and added.
        ACTIVATION: "gelu" (exact erf) or "relu" (apply_activation).
        STORE_PRE: PRE is written (a forward that the backward will need).
        DOT_PRECISION: tl.dot's input_precision, "ieee" or "tf32" (dot_precision; it matters for fp32 only).
        BLOCK_M, BLOCK_N: the output tile.
        BLOCK_K: the step of the loop over K.
        GROUP_M: row blocks that take each column block of W in turn, while it is in L2.
        TMA: X and W tiles load through tensor descriptors made per program (kernels/_tma.py: unit
            column strides, 16-byte aligned bases and row strides), else through pointers.
    """
    pid_m, pid_n = grouped_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)

    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if TMA:  # tiles past M, N or K read as zeros, as the masked loads below
        x_desc = tl.make_tensor_descriptor(X, shape=[M, K], strides=[stride_xm, 1], block_shape=[BLOCK_M, BLOCK_K])
        w_desc = tl.make_tensor_descriptor(W, shape=[N, K], strides=[stride_wn, 1], block_shape=[BLOCK_N, BLOCK_K])
    for k in range(0, K, BLOCK_K):
        # (BLOCK_M, BLOCK_K) of x and (BLOCK_K, BLOCK_N) of w^T
        if TMA:
            a = x_desc.load([pid_m * BLOCK_M, k])
            b = tl.trans(w_desc.load([pid_n * BLOCK_N, k]))
        else:
            ks = k + offs_k
            a = tl.load(X + offs_m[:, None] * stride_xm + ks[None, :], mask=(offs_m[:, None] < M) & (ks[None, :] < K),
                        other=0.0)
            b = tl.load(
                W + offs_n[None, :] * stride_wn + ks[:, None] * stride_wk,
                mask=(offs_n[None, :] < N) & (ks[:, None] < K),
                other=0.0,
            )
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION, out_dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(B + offs_n * stride_b, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    out_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    # the pre-activation as stored (rounded to the output's dtype), to which the activation applies,
    # as eager PyTorch's linear then gelu computes it: a backward recomputes y from PRE bit for bit
    pre = acc.to(Y.dtype.element_ty)
    if STORE_PRE:
        tl.store(PRE + offs_m[:, None] * stride_pm + offs_n[None, :], pre, mask=out_mask)
    y = apply_activation(pre.to(tl.float32), ACTIVATION)
    tl.store(Y + offs_m[:, None] * stride_ym + offs_n[None, :], y.to(Y.dtype.element_ty), mask=out_mask)


@triton.jit(do_not_specialize=["M"])  # M bounds the masks only
def _activation_fwd_kernel(
    PRE, H,
    stride_pre, stride_h,
    M, N,
    ACTIVATION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One (BLOCK_M, BLOCK_N) tile of H = act(PRE): the forward's activation where cuBLAS computed
    the product (kernels/_gemm_choice.py), applied in fp32 to the pre-activation as stored and
    rounded to H's dtype, as _linear_gelu_fwd_kernel's epilogue applies it (the same bits from the
    same PRE). H may be PRE itself: each element is read, then written, by the program that owns it.
    Grid: (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N)). Launched by _cublas_forward and LinearGeluPlan.

    Args:
        PRE: (M, N) the pre-activation x @ W.T + b, fp16, bf16 or fp32, unit column stride.
        H: (M, N) output in PRE's dtype, unit column stride; PRE itself when the pre-activation is
            not kept.
        stride_pre, stride_h: the row strides in elements of PRE and H.
        M: rows; bounds the masks only, not specialized (it changes with every batch).
        N: columns.
        ACTIVATION: "gelu" (exact erf) or "relu" (apply_activation).
        BLOCK_M, BLOCK_N: the tile.
    """
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    a = tl.load(PRE + rows[:, None] * stride_pre + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    h = apply_activation(a, ACTIVATION).to(H.dtype.element_ty)
    tl.store(H + rows[:, None] * stride_h + cols[None, :], h, mask=mask)


@triton.jit(do_not_specialize=["M"])  # M bounds the slabs' masks only
def _activation_grad_kernel(
    DY, PRE, DPRE, DB_PARTIAL, H,
    stride_dy, stride_pre, stride_dpre, stride_h,
    M, N, rows_per_program,
    ACTIVATION: tl.constexpr, BIAS_GRAD: tl.constexpr, WRITE_H: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """dPre = dY * act'(pre) in fp32 over a slab of rows_per_program rows and BLOCK_N columns,
    (BIAS_GRAD) the slab's column sums of dPre as stored: DB_PARTIAL[pid_m], and (WRITE_H) the
    activation act(pre) again, which the forward wrote from the same PRE, so the same bits: a
    backward that needs it (the FFN's second product's weight gradient) reads PRE where the forward
    would have saved both. The slab's rows are loaded two steps ahead (a loop without a dot is
    pipelined only when asked). The derivative: activation_derivative.
    Grid: (cdiv(M, rows_per_program), cdiv(N, BLOCK_N)). Launched by _activation_backward.

    Args:
        DY: (M, N) the gradient of Y, fp16, bf16 or fp32, unit column stride.
        PRE: (M, N) the forward's pre-activation, unit column stride.
        DPRE: (M, N) output in PRE's dtype: dY * act'(pre).
        DB_PARTIAL: (cdiv(M, rows_per_program), N) fp32, contiguous, output: row pid_m holds the column
            sums of this program's slab of DPRE; None when BIAS_GRAD is off.
        H: (M, N) output in PRE's dtype: act(pre); None when WRITE_H is off.
        stride_dy, stride_pre, stride_dpre, stride_h: the row strides in elements of DY, PRE, DPRE and H.
        M: rows; bounds the slabs' masks only, not specialized.
        N: columns.
        rows_per_program: rows of a slab, GRAD_ROWS_PER_PROGRAM, a multiple of BLOCK_M (fixed, so that db's
            summation order does not depend on the GPU).
        ACTIVATION: "gelu" (exact erf) or "relu": which derivative.
        BIAS_GRAD: DB_PARTIAL is written (the bias needs a gradient).
        WRITE_H: H is written.
        BLOCK_M: rows per step of the loop over the slab.
        BLOCK_N: columns per program.
    """
    pid_m = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    first = pid_m.to(tl.int64) * rows_per_program
    n_mine = tl.minimum(rows_per_program, M - first)
    db = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for i in tl.range(0, n_mine, BLOCK_M, num_stages=3):
        rows = first + i + tl.arange(0, BLOCK_M)
        ok = (i + tl.arange(0, BLOCK_M) < n_mine)[:, None] & col_ok[None, :]
        dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        a = tl.load(PRE + rows[:, None] * stride_pre + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        dpre = (dy * activation_derivative(a, ACTIVATION)).to(DPRE.dtype.element_ty)
        tl.store(DPRE + rows[:, None] * stride_dpre + cols[None, :], dpre, mask=ok)
        if WRITE_H:
            h = apply_activation(a, ACTIVATION).to(H.dtype.element_ty)
            tl.store(H + rows[:, None] * stride_h + cols[None, :], h, mask=ok)
        if BIAS_GRAD:
            db += dpre.to(tl.float32)  # masked elements are 0
    if BIAS_GRAD:
        tl.store(DB_PARTIAL + pid_m * N + cols, tl.sum(db, 0), mask=col_ok)


# The rows M bound masks only, and M_BUCKET only keys the configs (as the forward GEMM's).
@triton.jit(do_not_specialize=["M", "M_BUCKET"])
def _ffn_act_grad_kernel(
    DOUT, W2, PRE, DPRE, DB_PARTIAL, H,
    stride_dm, stride_wk, stride_wn, stride_pm, stride_dpm, stride_hm,
    M, N, K,
    M_BUCKET,  # config key only
    ACTIVATION: tl.constexpr, BIAS_GRAD: tl.constexpr, WRITE_H: tl.constexpr, DOT_PRECISION: tl.constexpr,
    PARTIAL_ROWS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, TMA: tl.constexpr,
):
    """The FFN's activation gradient in the epilogue of the GEMM that makes it: one (BLOCK_M, BLOCK_N)
    tile of dPre = (dOut @ W2) * act'(pre), where the product dH = dOut @ W2 is rounded to dPre's
    dtype first (as torch.mm's result would be before the activation's backward reads it), so dH
    never goes to memory; (WRITE_H) act(pre) again, the forward's bits, for W2's gradient; and
    (BIAS_GRAD) the tile's column sums of dPre as stored, for db1. Grid: cdiv(M, BLOCK_M) *
    cdiv(N, BLOCK_N) programs on one axis, in grouped order. Launched by _ffn_activation_backward
    and LinearGeluPlan.ffn_activation_grad.

    Args:
        DOUT: (M, K) the gradient of the FFN's output, fp16, bf16 or fp32, unit column stride.
        W2: (K, N) the second product's weight in DOUT's dtype, nn.Linear layout (d, d_ff), any
            strides (a Conv1d weight's view).
        PRE: (M, N) the forward's pre-activation, unit column stride.
        DPRE: (M, N) output in PRE's dtype, unit column stride.
        DB_PARTIAL: (cdiv(M, PARTIAL_ROWS), N) fp32, contiguous, output: a program's column sums in
            row pid_m * (BLOCK_M // PARTIAL_ROWS), zeros in the rows after it that its tile covers
            (so that the sum over the rows, in their order, is db1 whatever BLOCK_M the config
            has); None when BIAS_GRAD is off.
        H: (M, N) output in PRE's dtype, unit column stride: act(pre); None when WRITE_H is off.
        stride_dm: DOUT's row stride in elements.
        stride_wk, stride_wn: W2's strides in elements (row k of d, column n of d_ff).
        stride_pm, stride_dpm, stride_hm: the row strides in elements of PRE, DPRE and H (0 when absent).
        M: rows; bounds the masks only, not specialized (it changes with every batch).
        N, K: d_ff and d.
        M_BUCKET: next_power_of_2(M): a key of the config choice only, unused by the code, not specialized.
        ACTIVATION: "gelu" (exact erf) or "relu": which derivative (activation_derivative).
        BIAS_GRAD: DB_PARTIAL is written (b1 needs a gradient).
        WRITE_H: H is written.
        DOT_PRECISION: tl.dot's input_precision, "ieee" or "tf32" (dot_precision; it matters for fp32 only).
        PARTIAL_ROWS: rows of DOUT per row of DB_PARTIAL: the smallest BLOCK_M of the configs, which
            divides every BLOCK_M.
        BLOCK_M, BLOCK_N: the output tile.
        BLOCK_K: the step of the loop over K.
        GROUP_M: row blocks that take each column block of W2 in turn, while it is in L2.
        TMA: DOUT and W2 tiles load through tensor descriptors made per program (kernels/_tma.py:
            unit column strides, 16-byte aligned bases and row strides), else through pointers.
    """
    pid_m, pid_n = grouped_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)

    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if TMA:  # tiles past M, N or K read as zeros, as the masked loads below
        d_desc = tl.make_tensor_descriptor(DOUT, shape=[M, K], strides=[stride_dm, 1], block_shape=[BLOCK_M, BLOCK_K])
        w_desc = tl.make_tensor_descriptor(W2, shape=[K, N], strides=[stride_wk, 1], block_shape=[BLOCK_K, BLOCK_N])
    for k in range(0, K, BLOCK_K):
        # (BLOCK_M, BLOCK_K) of dOut and (BLOCK_K, BLOCK_N) of W2
        if TMA:
            a = d_desc.load([pid_m * BLOCK_M, k])
            b = w_desc.load([k, pid_n * BLOCK_N])
        else:
            ks = k + offs_k
            a = tl.load(DOUT + offs_m[:, None] * stride_dm + ks[None, :],
                        mask=(offs_m[:, None] < M) & (ks[None, :] < K), other=0.0)
            b = tl.load(
                W2 + ks[:, None] * stride_wk + offs_n[None, :] * stride_wn,
                mask=(ks[:, None] < K) & (offs_n[None, :] < N),
                other=0.0,
            )
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION, out_dtype=tl.float32)
    out_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    dh = acc.to(DPRE.dtype.element_ty).to(tl.float32)  # rows and columns past the ends are 0
    a = tl.load(PRE + offs_m[:, None] * stride_pm + offs_n[None, :], mask=out_mask, other=0.0).to(tl.float32)
    dpre = (dh * activation_derivative(a, ACTIVATION)).to(DPRE.dtype.element_ty)
    tl.store(DPRE + offs_m[:, None] * stride_dpm + offs_n[None, :], dpre, mask=out_mask)
    if WRITE_H:
        h = apply_activation(a, ACTIVATION).to(H.dtype.element_ty)
        tl.store(H + offs_m[:, None] * stride_hm + offs_n[None, :], h, mask=out_mask)
    if BIAS_GRAD:
        col_ok = offs_n < N
        first = pid_m * (BLOCK_M // PARTIAL_ROWS)
        tl.store(DB_PARTIAL + first * N + offs_n, tl.sum(dpre.to(tl.float32), 0), mask=col_ok)
        for j in tl.static_range(1, BLOCK_M // PARTIAL_ROWS):
            row = (first + j).to(tl.int64)
            tl.store(DB_PARTIAL + row * N + offs_n, tl.zeros([BLOCK_N], dtype=tl.float32),
                     mask=col_ok & (row * PARTIAL_ROWS + tl.zeros([BLOCK_N], dtype=tl.int64) < M))


_linear_gelu_fwd = Configs(
    _linear_gelu_fwd_kernel, "linear_gelu", _gemm_candidates(),
    ["M_BUCKET", "N", "K", "ACTIVATION", "STORE_PRE", "DOT_PRECISION", "TMA"],
    _linear_gelu_fits, interpreter_meta={"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 2},
    tma_bases=("X", "W"),
)
# Whether the GEMM loads its X and W tiles through tensor descriptors where TMA can serve
# (kernels/_tma.py; set_tma or FASTFORMER_TMA choose otherwise): not until a GPU has timed both
# (python -m tools.sweep), so pointer loads, the kernel the benchmarks have measured.
PREFERS_TMA = False
# The activation kernel of the cuBLAS way: one config, a memory-bound pass of 4,096 elements a
# program (32 a thread) with 16-byte loads and stores of fp16 and bf16 rows.
_activation_fwd = Configs(
    _activation_fwd_kernel, "linear_gelu activation", [({"BLOCK_M": 32, "BLOCK_N": 128}, 4, 1)], ["N", "ACTIVATION"],
    interpreter_meta={"BLOCK_M": 16, "BLOCK_N": 16},
)
# Whether the forward's product runs by cuBLAS, then the activation kernel, in place of the Triton
# GEMM and its fused epilogue (kernels/_gemm_choice.py; set_ffn_gemm or FASTFORMER_FFN_GEMM choose
# otherwise): not until a GPU has timed both (python -m tools.sweep), so the Triton GEMM, which
# moves M * N elements less with the pre-activation kept and 2 * M * N without (docs/kernels.md).
PREFERS_CUBLAS = False
# The FFN's dH GEMM with the activation gradient in its epilogue: the forward GEMM's configs and rule
# (its N is d_ff, its K is d), narrowed for fp32 by its own (_act_grad_fits). Its db1 partial sums
# go one row per PARTIAL_ROWS rows, the smallest BLOCK_M of the configs, so that the partials' buffer
# is sized before a config is picked (or while the autotuner picks one per call).
_ffn_act_grad = Configs(
    _ffn_act_grad_kernel, "ffn activation gradient", _gemm_candidates(),
    ["M_BUCKET", "N", "K", "ACTIVATION", "BIAS_GRAD", "WRITE_H", "DOT_PRECISION", "TMA"],
    _act_grad_fits, interpreter_meta={"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 2},
    tma_bases=("DOUT", "W2"),
)
PARTIAL_ROWS = 16 if INTERPRET else min(meta["BLOCK_M"] for meta, _, _ in _ffn_act_grad.candidates)


def _forward_outputs(x2, N, store_pre):
    """Empty y (M, N) and pre (M, N), or (0, N) when it is not stored, in x2's dtype."""
    M = x2.shape[0]
    y = torch.empty(M, N, dtype=x2.dtype, device=x2.device)
    return y, torch.empty(M if store_pre else 0, N, dtype=x2.dtype, device=x2.device)


def _forward_launch(x2, weight, bias, y, pre, activation, store_pre):
    """(grid, args, kwargs) of the GEMM's launch: y = act(x2 @ weight.T + bias), and pre = the
    pre-activation when store_pre (else pre is not written, and passed as None)."""
    M, K = x2.shape
    N = weight.shape[0]
    args = (
        x2, weight, bias, y, pre if store_pre else None,
        x2.stride(0), weight.stride(0), weight.stride(1), vector_stride(bias),
        y.stride(0), pre.stride(0) if store_pre else 0,
        M, N, K, next_power_of_2(M),
    )
    kwargs = {
        "HAS_BIAS": bias is not None, "ACTIVATION": activation, "STORE_PRE": store_pre,
        "DOT_PRECISION": dot_precision(x2.dtype),
    }
    kwargs["TMA"] = use_tma(_linear_gelu_fwd.prefers_tma(args, kwargs, PREFERS_TMA), x2, weight)
    return lambda meta: (cdiv(M, meta["BLOCK_M"]) * cdiv(N, meta["BLOCK_N"]),), args, kwargs


def _prefers_cublas(x2, weight, activation, store_pre):
    """Whether the forward's product would run by cuBLAS: as the tuned table's entry for the
    GEMM's launch says (kernels/_tuned.py), else as PREFERS_CUBLAS. kernels._gemm_choice.use_cublas
    then applies the choice made and says whether cuBLAS can serve."""
    M, K = x2.shape
    N = weight.shape[0]
    key = {
        "M_BUCKET": next_power_of_2(M), "N": N, "K": K, "ACTIVATION": activation, "STORE_PRE": store_pre,
        "DOT_PRECISION": dot_precision(x2.dtype),
    }
    entry = _linear_gelu_fwd.tuned((x2,), key)
    return PREFERS_CUBLAS if entry is None else entry.variant == "cublas"


def _activation_forward_launch(pre, h, activation):
    """(grid, args, kwargs) of the activation kernel's launch: h = act(pre) for (M, N) pre and h
    with unit last strides (h may be pre)."""
    M, N = pre.shape
    args = (pre, h, pre.stride(0), h.stride(0), M, N)
    return lambda meta: (cdiv(M, meta["BLOCK_M"]), cdiv(N, meta["BLOCK_N"])), args, {"ACTIVATION": activation}


def _cublas_product(x2, weight, bias, out):
    """out = x2 @ weight.T + bias by cuBLAS: addmm, whose bias vector cuBLASLt adds in its epilogue.
    The out= forms are not autocast's: the product stays in the inputs' dtype under autocast, as
    the Triton GEMM's does."""
    if bias is None:
        torch.mm(x2, weight.t(), out=out)
    else:
        torch.addmm(bias, x2, weight.t(), out=out)


def _cublas_forward(x2, weight, bias, activation, store_pre):
    """y and pre as _linear_gelu_forward returns them, the product by cuBLAS into pre, then y =
    act(pre) by the activation kernel; without store_pre the product goes to y and the activation
    is written over it."""
    y, pre = _forward_outputs(x2, weight.shape[0], store_pre)
    product = pre if store_pre else y
    if not compiling_only():  # a warm-up compiles kernels: cuBLAS has none to compile
        _cublas_product(x2, weight, bias, product)
    grid, args, kwargs = _activation_forward_launch(product, y, activation)
    _activation_fwd[grid](*args, **kwargs)
    return y, pre


def _linear_gelu_forward(
    x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str, store_pre: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    if use_cublas(_prefers_cublas(x2, weight, activation, store_pre)):  # a trace takes the Triton GEMM
        return _cublas_forward(x2, weight, bias, activation, store_pre)
    y, pre = _forward_outputs(x2, weight.shape[0], store_pre)
    grid, args, kwargs = _forward_launch(x2, weight, bias, y, pre, activation, store_pre)
    _linear_gelu_fwd[grid](*args, **kwargs)
    return y, pre


def _activation_outputs(pre, bias_grad, write_h, rows_per_partial=GRAD_ROWS_PER_PROGRAM):
    """Empty dpre (pre's shape and dtype), the fp32 partial sums of its columns, a row per
    rows_per_partial rows (None without bias_grad), db ((N,), or (0,) without bias_grad) and h
    (pre's shape, or (0, N) without write_h)."""
    M, N = pre.shape
    dpre = torch.empty_like(pre)
    partial = None
    if bias_grad:
        partial = torch.empty(cdiv(M, rows_per_partial), N, dtype=torch.float32, device=pre.device)
    db = torch.empty(N if bias_grad else 0, dtype=pre.dtype, device=pre.device)
    return dpre, partial, db, torch.empty(M if write_h else 0, N, dtype=pre.dtype, device=pre.device)


def _activation_launches(dy, pre, dpre, partial, db, h, activation, bias_grad, write_h):
    """[(kernel, grid, args, kwargs)] of the activation gradient's launches: the slabs (which write h
    with write_h), then (with bias_grad) the sum of their partials into db. dy has a unit last stride."""
    M, N = pre.shape
    # 128 columns of 16-bit rows; 64 of fp32, whose three steps of two tiles in flight spill at 128
    # on Triton 3.9 (8 B: python -m tools.sm90_report --tf32)
    block_n = 16 if INTERPRET else 64 if pre.dtype == torch.float32 else 128
    slabs = (
        _activation_grad_kernel,
        (cdiv(M, GRAD_ROWS_PER_PROGRAM), cdiv(N, block_n)),
        (
            dy, pre, dpre, partial, h if write_h else None,
            dy.stride(0), pre.stride(0), dpre.stride(0), h.stride(0) if write_h else 0,
            M, N, GRAD_ROWS_PER_PROGRAM,
        ),
        {"ACTIVATION": activation, "BIAS_GRAD": bias_grad, "WRITE_H": write_h, "BLOCK_M": 16, "BLOCK_N": block_n},
    )  # fmt: skip
    return [slabs, (_sum_partials_kernel, *sum_partials_launch(partial, db))] if bias_grad else [slabs]


def _activation_backward(
    dy: torch.Tensor, pre: torch.Tensor, activation: str, bias_grad: bool = True, write_h: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dPre = dY * act'(pre) for (M, N) dy and pre, (bias_grad) db = dPre summed over rows, in pre's
    dtype (else an empty (0,) tensor), and (write_h) act(pre), the forward's output again (else an
    empty (0, N) tensor): two launches, the slabs and the sum of their partials."""
    dy = last_dim_contiguous(dy)
    dpre, partial, db, h = _activation_outputs(pre, bias_grad, write_h)
    launches = _activation_launches(dy, pre, dpre, partial, db, h, activation, bias_grad, write_h)
    for kernel, grid, args, kwargs in launches:
        launch(kernel)[grid](*args, **kwargs)
    return dpre, db, h


def _ffn_act_grad_launches(dout, w2, pre, dpre, partial, db, h, activation, bias_grad, write_h):
    """[(kernel, grid, args, kwargs)] of the FFN's activation gradient by the dH GEMM: the GEMM with
    its epilogue (which writes h with write_h), then (with bias_grad) the sum of its partials into
    db. dout has a unit last stride."""
    M, N = pre.shape
    K = dout.shape[1]
    args = (
        dout, w2, pre, dpre, partial, h if write_h else None,
        dout.stride(0), w2.stride(0), w2.stride(1), pre.stride(0), dpre.stride(0), h.stride(0) if write_h else 0,
        M, N, K, next_power_of_2(M),
    )  # fmt: skip
    kwargs = {
        "ACTIVATION": activation, "BIAS_GRAD": bias_grad, "WRITE_H": write_h,
        "DOT_PRECISION": dot_precision(dout.dtype), "PARTIAL_ROWS": PARTIAL_ROWS,
    }  # fmt: skip
    # a dOut whose rows are one row repeated (stride 0) reads through pointers: a descriptor's strides are not 0
    rule = _ffn_act_grad.prefers_tma(args, kwargs, PREFERS_TMA)
    kwargs["TMA"] = dout.stride(0) != 0 and use_tma(rule, dout, w2)
    grid = lambda meta: (cdiv(M, meta["BLOCK_M"]) * cdiv(N, meta["BLOCK_N"]),)  # noqa: E731
    gemm = (_ffn_act_grad, grid, args, kwargs)
    return [gemm, (_sum_partials_kernel, *sum_partials_launch(partial, db))] if bias_grad else [gemm]


def _prefers_cublas_backward(dout, pre, activation, bias_grad, write_h):
    """Whether the FFN's dH product would run by cuBLAS, then the activation-gradient pass, in place
    of the dH GEMM with its epilogue: as the tuned table's entry for the dH GEMM's launch says
    (kernels/_tuned.py; a GPU's sweep times both ways, tools.sweep's "dH" pass), else as
    PREFERS_CUBLAS, the forward's rule. kernels._gemm_choice.use_cublas then applies the choice
    made and says whether cuBLAS can serve."""
    M, N = pre.shape
    key = {
        "M_BUCKET": next_power_of_2(M), "N": N, "K": dout.shape[1], "ACTIVATION": activation,
        "BIAS_GRAD": bias_grad, "WRITE_H": write_h, "DOT_PRECISION": dot_precision(dout.dtype),
    }  # fmt: skip
    entry = _ffn_act_grad.tuned((dout,), key)
    return PREFERS_CUBLAS if entry is None else entry.variant == "cublas"


def _ffn_backward_uses_cublas(dout, pre, activation, bias_grad, write_h):
    """Whether this FFN backward takes cuBLAS's dH and the activation pass (the choice made, or the
    rule's and the table's, where cuBLAS can serve)."""
    return use_cublas(_prefers_cublas_backward(dout, pre, activation, bias_grad, write_h))


def _ffn_activation_backward(
    dout: torch.Tensor, w2: torch.Tensor, pre: torch.Tensor, activation: str, bias_grad: bool, write_h: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The FFN's backward through its activation: dPre = (dout @ w2) * act'(pre) for (M, d) dout,
    (d, d_ff) w2 and (M, d_ff) pre, (bias_grad) db1 = dPre summed over rows, in pre's dtype (else an
    empty (0,) tensor), and (write_h) act(pre), the forward's activation again (else an empty
    (0, d_ff) tensor): the dH GEMM with its epilogue, and the sum of its partials."""
    dout = last_dim_contiguous(dout)
    dpre, partial, db, h = _activation_outputs(pre, bias_grad, write_h, PARTIAL_ROWS)
    for kernel, grid, args, kwargs in _ffn_act_grad_launches(
        dout, w2, pre, dpre, partial, db, h, activation, bias_grad, write_h
    ):
        (kernel if isinstance(kernel, Configs) else launch(kernel))[grid](*args, **kwargs)
    return dpre, db, h


# the torch.library ops, bound by defer_ops below
_linear_gelu_forward_op = _activation_backward_op = _ffn_activation_backward_op = None


def _setup_context(ctx, inputs, output):
    x2, weight, _bias, activation, _ = inputs
    _, pre = output
    ctx.save_for_backward(x2, weight, pre)
    # pre is saved for the backward, never differentiated: no zeros filled in for its gradient
    ctx.mark_non_differentiable(pre)
    ctx.set_materialize_grads(False)
    ctx.activation = activation


def _backward(ctx, dy, _dpre):
    if dy is None:  # y took no part in what is differentiated
        return None, None, None, None, None
    x2, weight, pre = ctx.saved_tensors
    if pre.numel() == 0 and x2.numel() != 0:
        raise RuntimeError("linear_gelu: backward through a forward run without gradients (no pre-activation saved)")
    needs_dx, needs_dw, needs_db = ctx.needs_input_grad[:3]
    dpre, db, _ = call_op(_activation_backward_op, _activation_backward, dy, pre, ctx.activation, needs_db)
    dx = dpre @ weight if needs_dx else None
    dw = dpre.t() @ x2 if needs_dw else None
    return dx, dw, db if needs_db else None, None, None


defer_ops(
    globals(),
    {
        "_linear_gelu_forward_op": ("linear_gelu_forward", _linear_gelu_forward),
        "_activation_backward_op": ("activation_backward", _activation_backward),
        "_ffn_activation_backward_op": ("ffn_activation_backward", _ffn_activation_backward),
    },
    autograd=(_backward, _setup_context),
)
_linear_gelu_forward_eager = eager_twin(_linear_gelu_forward, _setup_context, _backward)


# ----------------------------------------------------------------------------------------------
# Eager calls by plan (kernels._runtime, Plans), for linear_gelu and feed_forward.
# ----------------------------------------------------------------------------------------------
class LinearGeluPlan(Plan):
    """An eager act(x @ weight.T + bias) call's signature made ready: its checks passed (by the
    public op that made it), the forward's launch prepared (the GEMM's, or where cuBLAS computes
    the product, the activation kernel's: `cublas`), and the activation gradient's launches
    prepared per signature of the gradient on the first backward that meets it."""

    def __init__(self, x, weight, bias, activation, store_pre):
        N = weight.shape[0]
        self.rows = (math.prod(x.shape[:-1]), x.shape[-1])
        self.out_shape = (*x.shape[:-1], N)
        self.activation, self.store_pre = activation, store_pre
        x2 = x.view(self.rows)
        self.cublas = use_cublas(_prefers_cublas(x2, weight, activation, store_pre))
        y, pre = _forward_outputs(x2, N, store_pre)
        if self.cublas:
            self.forward = _activation_fwd.prepare(*_activation_forward_launch(pre if store_pre else y, y, activation))
        else:
            self.forward = _linear_gelu_fwd.prepare(*_forward_launch(x2, weight, bias, y, pre, activation, store_pre))
        self.backwards = {}

    def _made(self):
        return self.rows, self.out_shape, self.activation, self.store_pre, self.cublas, self.forward

    def __repr__(self):
        how = "cuBLAS + activation" if self.cublas else "GEMM"
        return f"LinearGeluPlan(rows={self.rows}, {self.activation}, store_pre={self.store_pre}, {how}, {self.forward})"

    def __call__(self, x, weight, bias):
        """The op's result: (..., N)."""
        return _planned_linear_gelu(x, weight, bias, self) if self.store_pre else self.run(x, weight, bias)[0]

    def run(self, x, weight, bias):
        """y (..., N) and pre (M, N) of the forward, or y and None when pre is not stored. The kernel
        reads x and writes y as the rows of the prepared launch: x is a view of them, and y is laid
        out as _forward_outputs lays it (no view of either is made)."""
        y = torch.empty(*self.out_shape, dtype=x.dtype, device=x.device)
        pre = None
        if self.store_pre:
            pre = torch.empty(self.rows[0], self.out_shape[-1], dtype=x.dtype, device=x.device)
        if self.cublas:
            # the product into pre, or without it into y's rows, where the activation then goes
            product = pre if pre is not None else y if y.dim() == 2 else y.view(self.rows[0], -1)
            _cublas_product(x if x.dim() == 2 else x.view(self.rows), weight, bias, product)
            self.forward(product, y)
        else:
            self.forward(x, weight, bias, y, pre)
        return y, pre

    def activation_grad(self, dy, pre, bias_grad, write_h=False):
        """dpre, db and (write_h) h = act(pre) of a planned backward: by prepared launches
        (activation_backward), or when a dispatch mode or transform is over the backward, through
        the registered op, which it sees."""
        if planning():
            return self.activation_backward(dy, pre, bias_grad, write_h)
        return _activation_backward_op(dy, pre, self.activation, bias_grad, write_h)

    def activation_backward(self, dy, pre, bias_grad, write_h=False):
        """dpre, db and h, as _activation_backward, by prepared launches."""
        dy = last_dim_contiguous(dy)
        dpre, partial, db, h = _activation_outputs(pre, bias_grad, write_h)
        key = (dy.stride(), dy.dtype, bias_grad, write_h)
        launches = kept(
            self.backwards, key, self._activation_launches, dy, pre, dpre, partial, db, h, bias_grad, write_h
        )
        launches[0](dy, pre, dpre, partial, h if write_h else None)
        if bias_grad:
            launches[1](partial, db)
        return dpre, db, h

    def _activation_launches(self, dy, pre, dpre, partial, db, h, bias_grad, write_h):
        launches = _activation_launches(dy, pre, dpre, partial, db, h, self.activation, bias_grad, write_h)
        return [PreparedLaunch(*launch) for launch in launches]

    def ffn_activation_grad(self, dout, w2, pre, bias_grad, write_h):
        """dpre, db and (write_h) h of the FFN's backward through this plan's activation, given the
        gradient of the FFN's output and its second weight: where cuBLAS serves dH
        (_ffn_backward_uses_cublas), dH by cuBLAS and then activation_grad; else by the dH GEMM
        with the activation gradient in its epilogue (_ffn_act_grad_kernel), by prepared launches,
        or when a dispatch mode or transform is over the backward, through the registered op,
        which it sees."""
        key = ("ffn by cuBLAS", dout.dtype, bias_grad, write_h)
        if kept(self.backwards, key, _ffn_backward_uses_cublas, dout, pre, self.activation, bias_grad, write_h):
            return self.activation_grad(torch.mm(dout, w2), pre, bias_grad, write_h)
        if not planning():
            return _ffn_activation_backward_op(dout, w2, pre, self.activation, bias_grad, write_h)
        dout = last_dim_contiguous(dout)
        dpre, partial, db, h = _activation_outputs(pre, bias_grad, write_h, PARTIAL_ROWS)
        key = ("ffn", dout.stride(), w2.stride(), dout.dtype, bias_grad, write_h)
        launches = kept(
            self.backwards, key, self._ffn_act_grad_launches, dout, w2, pre, dpre, partial, db, h, bias_grad, write_h
        )
        launches[0](dout, w2, pre, dpre, partial, h if write_h else None)
        if bias_grad:
            launches[1](partial, db)
        return dpre, db, h

    def _ffn_act_grad_launches(self, dout, w2, pre, dpre, partial, db, h, bias_grad, write_h):
        (gemm, *grid_args), *rest = _ffn_act_grad_launches(
            dout, w2, pre, dpre, partial, db, h, self.activation, bias_grad, write_h
        )
        return [gemm.prepare(*grid_args)] + [PreparedLaunch(*launch) for launch in rest]


class _PlannedLinearGelu(torch.autograd.Function):
    """act(x @ weight.T + bias) by its LinearGeluPlan, which stores the pre-activation for the backward."""

    @staticmethod
    def forward(ctx, x, weight, bias, plan):
        y, pre = plan.run(x, weight, bias)
        ctx.save_for_backward(x, weight, pre)
        ctx.plan = plan
        ctx.set_materialize_grads(False)
        return y

    @staticmethod
    @plain_backward
    def backward(ctx, dy):
        if dy is None:
            return None, None, None, None
        x, weight, pre = ctx.saved_tensors
        plan = ctx.plan
        # the model hands over rows (M, K): then x, dy and dx need no view, which costs more than
        # the product's call on the host (x.shape alone builds a torch.Size)
        rows = x.dim() == 2
        if not rows:
            dy = dy.reshape(pre.shape)
        needs_dx, needs_dw, needs_db = ctx.needs_input_grad[:3]
        dpre, db, _ = plan.activation_grad(dy, pre, needs_db)
        dx = dw = None
        if needs_dx:
            dx = torch.mm(dpre, weight) if rows else torch.mm(dpre, weight).view(x.shape)
        if needs_dw:
            dw = torch.mm(dpre.t(), x if rows else x.view(plan.rows))
        return dx, dw, db if needs_db else None, None


_planned_linear_gelu = autograd_apply(_PlannedLinearGelu)


def make_linear_gelu_plan(x, weight, bias, activation, store_pre, op):
    """The LinearGeluPlan of a call whose arguments `op` has checked, or None for one that takes
    the ordinary path each time: an input autocast casts, or an x its rows cannot view."""
    if autocast_state(x) is not None and any(t is not None and t.dtype == torch.float32 for t in (x, weight, bias)):
        return None
    if x.stride(-1) != 1:
        return None
    try:
        x.view(math.prod(x.shape[:-1]), x.shape[-1])
    except RuntimeError:  # rows_view copies it
        return None
    require_launchable(op, x, weight, bias)
    return LinearGeluPlan(x, weight, bias, activation, store_pre)


def _make_plan(x, weight, bias, activation, store_pre):
    check_linear_args(x, weight, bias)
    check_activation(activation)
    return make_linear_gelu_plan(x, weight, bias, activation, store_pre, "linear_gelu")


_plans = Plans("linear_gelu")


@argument_check
def check_linear_args(x, weight, bias, x_name="x", weight_name="weight", bias_name="bias", dtypes=FLOAT_DTYPES):
    """Validate an nn.Linear-layout product x @ weight.T + bias; returns (K, N)."""
    check_tensor(x_name, x, dtypes=dtypes)
    check_tensor(weight_name, weight, ndim=2, dtypes=dtypes)
    if x.dim() < 1:
        raise ValueError(f"{x_name} must have at least one dimension, got shape {tuple(x.shape)}")
    N, K = weight.shape
    if x.shape[-1] != K:
        raise ValueError(
            f"{x_name}'s last dimension must equal {weight_name}.shape[1]: got {x_name} {tuple(x.shape)}, "
            f"{weight_name} {tuple(weight.shape)}"
        )
    tensors = {x_name: x, weight_name: weight}
    if bias is not None:
        check_tensor(bias_name, bias, ndim=1, dtypes=dtypes)
        if bias.shape[0] != N:
            raise ValueError(
                f"{bias_name} must have shape ({N},) to match {weight_name} {tuple(weight.shape)}, "
                f"got {tuple(bias.shape)}"
            )
        tensors[bias_name] = bias
    check_same_dtype(**tensors)
    check_same_device(**tensors)
    return K, N


def check_activation(activation):
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {', '.join(map(repr, ACTIVATIONS))}, got {activation!r}")


def run_linear_gelu(x, weight, bias, activation, op):
    """`linear_gelu` on arguments its caller has checked (check_linear_args, check_activation): the
    autocast casts, the launch check (its errors name `op`) and the launch."""
    x, weight, bias = autocast_inputs(x, weight, bias)
    require_launchable(op, x, weight, bias)
    store_pre = needs_grad(x, weight, bias)
    forward = _linear_gelu_forward_eager if eager() else _linear_gelu_forward_op
    y, _ = forward(rows_view(x), weight, bias, activation, store_pre)
    return y.view(*x.shape[:-1], weight.shape[0])


def linear_gelu(x, weight, bias, *, activation="gelu"):
    """act(x @ weight.T + bias), the exact (erf) GELU or ReLU, with the bias and activation fused into the GEMM.

    Args:
        x: (..., K); weight: (N, K) (nn.Linear layout; any strides, so Conv1d weight views work);
            bias: (N,) or None. One dtype (fp16, bf16, fp32), one device. Under torch.autocast,
            fp32 inputs are cast to the autocast dtype, as F.linear would.
        activation: "gelu" (exact erf, the tutorial's) or "relu" (Aladdin Persson's seq2seq
            Transformer's and the Keras tutorial's).

    Returns:
        (..., N) in the inputs' dtype. fp32 uses IEEE dots unless TF32 is allowed for matmuls.
    """
    if planning() and isinstance(x, torch.Tensor):
        args = x, weight, bias, activation, needs_grad(x, weight, bias)
        plan = kept(_plans, (signature(*args), switches(x)), _make_plan, *args)
        if plan is not None:
            return plan(x, weight, bias)
    check_linear_args(x, weight, bias)
    check_activation(activation)
    return run_linear_gelu(x, weight, bias, activation, "linear_gelu")


def linear_gelu_reference(x, weight, bias, *, activation="gelu"):
    """act(x @ weight.T + bias) with the exact erf GELU or relu, in PyTorch (fp64 too, for tests)."""
    check_linear_args(x, weight, bias, dtypes=REFERENCE_DTYPES)
    check_activation(activation)
    return TORCH_ACTIVATIONS[activation](F.linear(x, weight, bias))

