"""layer_norm(residual + dropout(x + x_bias)) in one pass, in Triton, and its PyTorch reference.

The forward reads x and residual once, adds the optional x_bias (the bias of the linear layer that
made x, in fp32), applies dropout (Philox, in the kernel, from a seed the caller may pass), adds,
normalizes with fp32 statistics and writes y, and optionally y cast to fp16/bf16 (`lowp_dtype`:
under autocast y is the fp32 residual stream and the cast is what the next matrix product reads),
keeping each row's mean and 1/std and, when a gradient will be taken, the fp32 sum it normalized,
h = residual + dropout(x + x_bias). The backward reads h from that one tensor instead of recomputing
it: autograd then keeps neither x nor the residual (under autocast x in bf16 and the residual stream
in fp32, 6 bytes an element where h is 4), which nothing else needs after the forward, and h is the
same bits the forward normalized. The backward adds the gradients of y and of its cast itself,
regenerates the dropout mask from its seed instead of storing it (dx is dh through the mask), and
reduces dW, db and d(x_bias) through per-program partial sums that a second small kernel
(`sum_partials`) adds in a fixed order (no atomics), so gradients are bitwise reproducible. The
backward takes BLOCK_M rows at a time, so a narrow row (the tutorial's d = 256) still gives each
program several warps and several rows' loads in flight.
"""
import math

import torch
import torch.nn.functional as F

from ._checks import FLOAT_DTYPES, REFERENCE_DTYPES, argument_check, check_same_device, check_tensor
from ._configs import switches
from ._dropout import (
    check_dropout_p,
    check_dropout_rows,
    check_seed,
    draw_seed,
    dropout_keep,
    dropout_mask,
    load_seed,
    planned_seed,
)
from ._layout import rows_view, vector_stride
from ._reduce import _sum_partials_kernel, sum_partials_launch
from ._runtime import (
    INTERPRET,
    Plan,
    Plans,
    PreparedLaunch,
    autograd_apply,
    call_op,
    cdiv,
    defer_ops,
    eager,
    eager_twin,
    kept,
    launch,
    needs_grad,
    next_power_of_2,
    plain_backward,
    planning,
    require_interpreter_bf16,
    require_launchable,
    signature,
    tl,
    triton,
    warn_once,
)

# One row per program up to this width; wider rows go to the reference (one-time warning).
MAX_FEATURES = 16384


@triton.jit
def _row_keep(seed, row, dropout_p, BLOCK_N: tl.constexpr):
    """The (BLOCK_N,) dropout keep-mask of one row."""
    return tl.reshape(dropout_keep(seed, row + tl.zeros([1], dtype=tl.int64), 0, dropout_p, BLOCK_N), (BLOCK_N,))


@triton.jit
def _add_ln_fwd_kernel(
    X, R, W, B, XB, Y, Y_LOW, S, MEAN, RSTD, SEED,
    stride_x, stride_r, stride_w, stride_b, stride_xb, stride_y, stride_y_low, stride_s,
    n_cols, eps, dropout_p,
    HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_X_BIAS: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    WRITE_LOW: tl.constexpr, WRITE_SUM: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One row: y = layer_norm(residual + dropout(x + x_bias)), (WRITE_LOW) y cast once more, from
    y's own dtype, to Y_LOW's, and (WRITE_SUM) the fp32 sum it normalizes, for the backward. Grid:
    (n_rows,), one row per program. Launched by _add_ln_forward.

    Args:
        X: (n_rows, n_cols) the sublayer output's rows (rows_view of x), fp16, bf16 or fp32, unit column stride.
        R: (n_rows, n_cols) the residual's rows, unit column stride; its dtype may differ from X's.
        W: (n_cols,) LayerNorm weight, any stride; None when HAS_WEIGHT is off.
        B: (n_cols,) LayerNorm bias, any stride; None when HAS_BIAS is off.
        XB: (n_cols,) x_bias, the bias of the layer that made x, any stride and dtype; None when
            HAS_X_BIAS is off.
        Y: (n_rows, n_cols) output, contiguous, in the op's output dtype (fp32 under autocast).
        Y_LOW: (n_rows, n_cols) output in fp16 or bf16, contiguous: y cast; None when WRITE_LOW is off.
        S: (n_rows, n_cols) fp32 output, contiguous: h = residual + dropout(x + x_bias), what the
            backward reads; None when WRITE_SUM is off.
        MEAN, RSTD: (n_rows,) fp32 outputs: each row's mean and 1/std, for the backward.
        SEED: (1,) int64 dropout seed; None when HAS_DROPOUT is off.
        stride_x, stride_r: the row strides in elements of X and R.
        stride_w, stride_b, stride_xb: the strides in elements of W, B and XB; 0 for an absent one.
        stride_y: Y's row stride in elements.
        stride_y_low: Y_LOW's row stride in elements; 0 when absent.
        stride_s: S's row stride in elements; 0 when absent.
        n_cols: the row's width d.
        eps: LayerNorm epsilon.
        dropout_p: the dropout probability, in [0, 1); read only under HAS_DROPOUT.
        HAS_WEIGHT, HAS_BIAS: W, B are read (else weight 1, bias 0).
        HAS_X_BIAS: XB is read and added to x in fp32 before dropout.
        HAS_DROPOUT: SEED and dropout_p are read: x + x_bias dropped with Philox (dropout_keep).
        WRITE_LOW: Y_LOW is written.
        WRITE_SUM: S is written.
        BLOCK_N: the whole row, n_cols padded to a power of two of at least 4 (_row_block).
    """
    # torch.compile's Inductor passes a Python float as fp64, a launch as fp32: one type for both
    eps, dropout_p = tl.cast(eps, tl.float32), tl.cast(dropout_p, tl.float32)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    ok = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_X_BIAS:
        x = x + tl.load(XB + cols * stride_xb, mask=ok, other=0.0).to(tl.float32)
    if HAS_DROPOUT:
        keep = _row_keep(tl.load(SEED), row, dropout_p, BLOCK_N)
        x = tl.where(keep, x / (1.0 - dropout_p), 0.0)
    h = tl.load(R + row * stride_r + cols, mask=ok, other=0.0).to(tl.float32) + x
    if WRITE_SUM:
        tl.store(S + row * stride_s + cols, h, mask=ok)
    mean = tl.sum(h, 0) / n_cols
    centered = tl.where(ok, h - mean, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(centered * centered, 0) / n_cols + eps)
    y = centered * rstd
    if HAS_WEIGHT:
        y = y * tl.load(W + cols * stride_w, mask=ok, other=0.0).to(tl.float32)
    if HAS_BIAS:
        y = y + tl.load(B + cols * stride_b, mask=ok, other=0.0).to(tl.float32)
    y = y.to(Y.dtype.element_ty)
    tl.store(Y + row * stride_y + cols, y, mask=ok)
    if WRITE_LOW:
        tl.store(Y_LOW + row * stride_y_low + cols, y.to(Y_LOW.dtype.element_ty), mask=ok)
    tl.store(MEAN + row, mean)
    tl.store(RSTD + row, rstd)


@triton.jit(do_not_specialize=["n_rows", "rows_per_program"])  # they change with the batch and bound masks only
def _add_ln_bwd_kernel(
    S, W, DY, DY_LOW, DX, DR, PARTIAL, MEAN, RSTD, SEED,
    stride_s, stride_w, stride_dy, stride_dy_low, stride_dx, stride_dr, stride_partial,
    n_rows, n_cols, rows_per_program, dropout_p,
    HAS_WEIGHT: tl.constexpr, HAS_DY_LOW: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    PARAM_GRADS: tl.constexpr, X_BIAS_GRAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    """dx, dresidual for a run of rows, BLOCK_M rows at a time, from the forward's sum h, dy and
    dy_low (HAS_DY_LOW: the gradient of y's cast, added in fp32), and this program's partial sums,
    one row of PARTIAL: (PARAM_GRADS) the sum of dy * xhat (dW) and of dy (db), then (X_BIAS_GRAD)
    the sum of the gradient of x + x_bias, in the row's last n_cols columns.
    NUM_STAGES > 1 has Triton load h, dy (and dy_low) NUM_STAGES - 1 steps ahead (async copies into
    shared memory on sm_80+): a loop without a dot is pipelined only when asked.
    Grid: (cdiv(n_rows, rows_per_program),) (_bwd_grid). Launched by _add_layer_norm_backward.

    Args:
        S: (n_rows, n_cols) fp32, unit column stride: the forward's h = residual + dropout(x + x_bias) (WRITE_SUM).
        W: (n_cols,) LayerNorm weight, any stride; None when HAS_WEIGHT is off.
        DY: (n_rows, n_cols) the gradient of y, unit column stride.
        DY_LOW: (n_rows, n_cols) the gradient of y's low-precision cast, unit column stride; None
            when HAS_DY_LOW is off.
        DX: (n_rows, n_cols) output in x's dtype, contiguous: the gradient of x.
        DR: (n_rows, n_cols) output in the residual's dtype, contiguous: the gradient of the residual.
        PARTIAL: (programs, k * n_cols) fp32, contiguous, output: row pid holds this program's sums,
            k blocks of n_cols: dW then db (PARAM_GRADS), then d(x_bias) (X_BIAS_GRAD); None when k = 0.
        MEAN, RSTD: (n_rows,) fp32: the forward's row means and 1/std.
        SEED: (1,) int64, the forward's dropout seed; None when HAS_DROPOUT is off.
        stride_s: S's row stride in elements.
        stride_w: W's stride in elements; 0 when absent.
        stride_dy: DY's row stride in elements.
        stride_dy_low: DY_LOW's row stride in elements; 0 when absent.
        stride_dx, stride_dr: the row strides in elements of DX and DR.
        stride_partial: PARTIAL's row stride, k * n_cols: d(x_bias) goes to its last n_cols columns; 0 when absent.
        n_rows: rows; bounds the masks only, not specialized.
        n_cols: the row's width d.
        rows_per_program: the rows of a program, a multiple of BLOCK_M (_bwd_grid); not specialized.
        dropout_p: the forward's dropout probability; read only under HAS_DROPOUT.
        HAS_WEIGHT: W is read (else weight 1).
        HAS_DY_LOW: DY_LOW is read and added to DY in fp32.
        HAS_DROPOUT: SEED and dropout_p are read: the forward's mask is regenerated (dropout_keep) for dx.
        PARAM_GRADS: the dW and db sums are written to PARTIAL.
        X_BIAS_GRAD: the d(x_bias) sums, of dx (the gradient of x + x_bias), are written to PARTIAL.
        BLOCK_M: rows per step of the loop.
        BLOCK_N: the whole row, n_cols padded to a power of two of at least 4 (_row_block).
        NUM_STAGES: the loop's pipeline depth (1: not pipelined; _bwd_tile).
    """
    # torch.compile's Inductor passes a Python float as fp64, a launch as fp32: one type for both
    dropout_p = tl.cast(dropout_p, tl.float32)
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < n_cols
    w = tl.full([BLOCK_N], 1.0, tl.float32)
    if HAS_WEIGHT:
        w = tl.load(W + cols * stride_w, mask=col_ok, other=0.0).to(tl.float32)
    seed = load_seed(SEED, HAS_DROPOUT)
    dw = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    db = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    dxb = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    first = pid.to(tl.int64) * rows_per_program
    n_mine = tl.minimum(rows_per_program, n_rows - first)
    for i in tl.range(0, n_mine, BLOCK_M, num_stages=NUM_STAGES):
        rows = first + i + tl.arange(0, BLOCK_M)
        row_ok = i + tl.arange(0, BLOCK_M) < n_mine
        ok = row_ok[:, None] & col_ok[None, :]
        h = tl.load(S + rows[:, None] * stride_s + cols[None, :], mask=ok, other=0.0)
        dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        if HAS_DY_LOW:
            dy = dy + tl.load(DY_LOW + rows[:, None] * stride_dy_low + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        mean = tl.load(MEAN + rows, mask=row_ok, other=0.0)
        rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)
        xhat = tl.where(ok, (h - mean[:, None]) * rstd[:, None], 0.0)
        wdy = w[None, :] * dy
        c1 = tl.sum(xhat * wdy, 1) / n_cols
        c2 = tl.sum(wdy, 1) / n_cols
        dh = tl.where(ok, (wdy - (xhat * c1[:, None] + c2[:, None])) * rstd[:, None], 0.0)
        tl.store(DR + rows[:, None] * stride_dr + cols[None, :], dh.to(DR.dtype.element_ty), mask=ok)
        if HAS_DROPOUT:
            keep = dropout_keep(seed, rows, 0, dropout_p, BLOCK_N)
            dh = tl.where(keep, dh / (1.0 - dropout_p), 0.0)
        tl.store(DX + rows[:, None] * stride_dx + cols[None, :], dh.to(DX.dtype.element_ty), mask=ok)
        if PARAM_GRADS:
            dw += dy * xhat
            db += dy
        if X_BIAS_GRAD:
            dxb += dh
    if PARAM_GRADS:
        tl.store(PARTIAL + pid * stride_partial + cols, tl.sum(dw, 0), mask=col_ok)
        tl.store(PARTIAL + pid * stride_partial + n_cols + cols, tl.sum(db, 0), mask=col_ok)
    if X_BIAS_GRAD:
        tl.store(PARTIAL + pid * stride_partial + (stride_partial - n_cols) + cols, tl.sum(dxb, 0), mask=col_ok)


def _forward_outputs(x, out_dtype, lowp_dtype, save_sum):
    """Empty y (x's shape, out_dtype), y_low (x's shape in lowp_dtype; None when that is None),
    each row's mean and 1/std (fp32) and the sum s (rows, d) in fp32 (None without save_sum),
    contiguous."""
    n_rows = math.prod(x.shape[:-1])  # as rows_view's shape has it (a product, not a quotient, of symbolic sizes)
    y = torch.empty(*x.shape, dtype=out_dtype, device=x.device)  # sizes as ints: a microsecond less than a Size
    y_low = None if lowp_dtype is None else torch.empty(*x.shape, dtype=lowp_dtype, device=x.device)
    mean = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    s = torch.empty(n_rows, x.shape[-1], dtype=torch.float32, device=x.device) if save_sum else None
    return y, y_low, mean, torch.empty_like(mean), s


def _forward_launch(x2, r2, weight, bias, x_bias, y, y_low, s, mean, rstd, seed, eps, dropout_p):
    """(grid, args, kwargs) of the forward's launch on rows x2 and r2 (n_rows, n_cols) with a unit
    last stride, into _forward_outputs' (s None: the sum is not written)."""
    n_rows, n_cols = x2.shape
    args = (
        x2, r2, weight, bias, x_bias, y, y_low, s, mean, rstd, seed,
        x2.stride(0), r2.stride(0), vector_stride(weight), vector_stride(bias), vector_stride(x_bias), n_cols,
        0 if y_low is None else n_cols, 0 if s is None else n_cols, n_cols, eps, dropout_p,
    )
    kwargs = {
        "HAS_WEIGHT": weight is not None, "HAS_BIAS": bias is not None, "HAS_X_BIAS": x_bias is not None,
        "HAS_DROPOUT": dropout_p > 0.0, "WRITE_LOW": y_low is not None, "WRITE_SUM": s is not None,
        "BLOCK_N": _row_block(n_cols), "num_warps": _warps(n_cols),
    }
    return (n_rows,), args, kwargs


def _add_ln_forward(x, residual, weight, bias, x_bias, seed, eps, dropout_p, out_dtype, lowp_dtype, save_sum):
    """(y, y_low, mean, rstd, s): y_low is empty when lowp_dtype is None, s (the fp32 sum the
    backward reads) empty (0, d) without save_sum. One launch."""
    y, y_low, mean, rstd, s = _forward_outputs(x, out_dtype, lowp_dtype, save_sum)
    grid, args, kwargs = _forward_launch(
        rows_view(x), rows_view(residual), weight, bias, x_bias, y, y_low, s, mean, rstd, seed, eps, dropout_p
    )
    launch(_add_ln_fwd_kernel)[grid](*args, **kwargs)
    if y_low is None:
        y_low = torch.empty(0, dtype=out_dtype, device=x.device)
    if s is None:
        s = torch.empty(0, x.shape[-1], dtype=torch.float32, device=x.device)
    return y, y_low, mean, rstd, s


def _row_block(n_cols):
    """A whole row, padded to a power of two of at least 4 (dropout decides 4 columns at once)."""
    return max(4, next_power_of_2(n_cols))


def _warps(n_cols):
    return min(16, max(1, next_power_of_2(n_cols) // 256))


def _bwd_tile(n_cols):
    """(BLOCK_M, num_warps, NUM_STAGES) of the backward. BLOCK_M rows (at most 16) make a tile of
    1024 elements, 8 to a thread over 4 warps (d = 256: 4 rows a step), loaded two steps ahead (h
    and dy: 16 KiB of shared memory in fp32; 24 KiB under autocast, with y_low's gradient). Rows
    wider than 1024 go one at a time, 8 to 32 elements to a thread, unpipelined (pipelined, d = 2048
    spills on sm_90a in fp32 with dropout)."""
    block_n = _row_block(n_cols)
    block_m = max(1, min(16, 1024 // block_n))
    return block_m, min(16, max(4, block_n // 256)), 3 if block_n <= 1024 else 1


def _bwd_grid(n_rows, block_m, device):
    """(programs, rows per program, a multiple of BLOCK_M) of the backward: enough programs to fill
    the GPU, few partial sums."""
    if INTERPRET or device.type != "cuda":
        target = 4
    else:
        target = 4 * torch.cuda.get_device_properties(device).multi_processor_count
    rows_per_program = block_m * max(1, cdiv(n_rows, target * block_m))
    return cdiv(n_rows, rows_per_program), rows_per_program


def _add_layer_norm_forward(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    x_bias: torch.Tensor | None,
    seed: torch.Tensor | None,
    eps: float,
    dropout_p: float,
    out_dtype: torch.dtype,
    lowp_dtype: torch.dtype | None,
    save_sum: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """y, y_low (empty when lowp_dtype is None), each row's mean and 1/std, and (save_sum) the fp32
    sum the backward reads, else an empty (0, d) tensor: ask for it when a gradient will be taken
    (`add_layer_norm` passes needs_grad). The seed is an input (an op may not return one of its
    inputs): `add_layer_norm` draws one when dropout needs it."""
    if dropout_p > 0.0 and seed is None:
        raise ValueError("add_layer_norm_forward: dropout_p > 0 needs a seed tensor")
    return _add_ln_forward(x, residual, weight, bias, x_bias, seed, eps, dropout_p, out_dtype, lowp_dtype, save_sum)


def _add_layer_norm_backward(
    dy: torch.Tensor,
    dy_low: torch.Tensor | None,
    s: torch.Tensor,
    weight: torch.Tensor | None,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    seed: torch.Tensor | None,
    dropout_p: float,
    param_grads: bool,
    x_bias_grad: bool,
    sums_dtype: torch.dtype,
    x_dtype: torch.dtype,
    residual_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dx (dy's shape in x_dtype), dresidual (in residual_dtype), and the column sums as one (k, d)
    tensor in sums_dtype: dweight and dbias when param_grads, then dx_bias when x_bias_grad (k = 0
    when neither), from s, the forward's fp32 sum (rows, d). The gradient of y is dy + dy_low
    (dy_low: of y's cast, or None). Two launches, the rows and the reduction of their partial sums
    (one, the rows, when k = 0)."""
    dy_low = None if dy_low is None else rows_view(dy_low)
    programs = _bwd_programs(*s.shape, s.device)
    dx, dr, partial, sums = _backward_outputs(
        dy.shape, x_dtype, residual_dtype, s.device, programs, param_grads, x_bias_grad, sums_dtype
    )
    launches = _backward_launches(
        s, weight, rows_view(dy), dy_low, dx, dr, partial, sums, mean, rstd, seed, dropout_p, param_grads, x_bias_grad
    )
    for kernel, grid, args, kwargs in launches:
        launch(kernel)[grid](*args, **kwargs)
    return dx, dr, sums


def _bwd_programs(n_rows, n_cols, device):
    """The backward's number of programs for n_rows rows of n_cols (_bwd_grid)."""
    return _bwd_grid(n_rows, _bwd_tile(n_cols)[0], device)[0]


def _backward_outputs(shape, x_dtype, residual_dtype, device, programs, param_grads, x_bias_grad, sums_dtype):
    """Empty dx (x's shape and dtype), dresidual (x's shape, residual's dtype), the fp32 partial sums
    of `programs` (_bwd_programs; None when no sum is asked for) and the sums (k, d) in sums_dtype
    (_add_layer_norm_backward), contiguous."""
    n_cols = shape[-1]
    dx = torch.empty(*shape, dtype=x_dtype, device=device)
    dr = torch.empty(*shape, dtype=residual_dtype, device=device)
    n_sums = 2 * param_grads + x_bias_grad
    partial = None
    if n_sums:
        partial = torch.empty(programs, n_sums * n_cols, dtype=torch.float32, device=device)
    return dx, dr, partial, torch.empty(n_sums, n_cols, dtype=sums_dtype, device=device)


def _backward_launches(
    s, weight, dy2, dy_low2, dx, dr, partial, sums, mean, rstd, seed, dropout_p, param_grads, x_bias_grad
):
    """[(kernel, grid, args, kwargs)] of the backward's launches on the forward's sum s and the
    gradients' rows (unit last stride) into _backward_outputs': the rows, then (when a sum is asked
    for) the sum of their partials."""
    n_rows, n_cols = s.shape
    block_m, num_warps, num_stages = _bwd_tile(n_cols)
    programs, rows_per_program = _bwd_grid(n_rows, block_m, s.device)
    rows = (
        _add_ln_bwd_kernel,
        (programs,),
        (
            s, weight, dy2, dy_low2, dx, dr, partial, mean, rstd, seed,
            s.stride(0), vector_stride(weight),
            dy2.stride(0), 0 if dy_low2 is None else dy_low2.stride(0), n_cols, n_cols,
            0 if partial is None else partial.stride(0),
            n_rows, n_cols, rows_per_program, dropout_p,
        ),
        {
            "HAS_WEIGHT": weight is not None, "HAS_DY_LOW": dy_low2 is not None,
            "HAS_DROPOUT": dropout_p > 0.0, "PARAM_GRADS": param_grads, "X_BIAS_GRAD": x_bias_grad,
            "BLOCK_M": block_m, "BLOCK_N": _row_block(n_cols), "NUM_STAGES": num_stages, "num_warps": num_warps,
        },
    )
    if partial is None:
        return [rows]
    return [rows, (_sum_partials_kernel, *sum_partials_launch(partial, sums.view(-1)))]


_add_layer_norm_forward_op = _add_layer_norm_backward_op = None  # the torch.library ops, bound by defer_ops below


def _setup_context(ctx, inputs, output):
    x, residual, weight, bias, x_bias, seed, _eps, dropout_p, _out_dtype, lowp_dtype, _save_sum = inputs
    _, y_low, mean, rstd, s = output
    # the sum stands for x, residual and x_bias: the backward needs only their dtypes and shape
    ctx.save_for_backward(s, weight, mean, rstd, seed)
    # the statistics, the sum (and y_low when none is asked for) take no gradient: autograd neither
    # tracks them nor fills zeros for them
    ctx.mark_non_differentiable(mean, rstd, s, *([y_low] if lowp_dtype is None else []))
    ctx.set_materialize_grads(False)
    ctx.dropout_p = dropout_p
    ctx.x_shape, ctx.x_dtype, ctx.residual_dtype = x.shape, x.dtype, residual.dtype
    ctx.sum_dtypes = tuple(None if t is None else t.dtype for t in (weight, bias, x_bias))


def _backward(ctx, dy, dy_low, _dmean, _drstd, _ds):
    no_grads = (None,) * 11
    if dy is None and dy_low is None:  # neither y nor y_low took part in what is differentiated
        return no_grads
    if dy is None:  # y_low alone did: its gradient is all of y's
        dy, dy_low = dy_low, None
    s, weight, mean, rstd, seed = ctx.saved_tensors
    if s.numel() == 0 and math.prod(ctx.x_shape) != 0:
        raise RuntimeError("add_layer_norm: backward through a forward run without gradients (no sum saved)")
    needs_dw, needs_db, needs_dxb = ctx.needs_input_grad[2:5]
    param_grads = needs_dw or needs_db
    # the sums come out in the dtype of the parameters they are for when those share one (no casts)
    sums_dtype = _sums_dtype(ctx.sum_dtypes, (needs_dw, needs_db, needs_dxb))
    dx, dr, sums = call_op(
        _add_layer_norm_backward_op, _add_layer_norm_backward,
        dy, dy_low, s, weight, mean, rstd, seed, ctx.dropout_p, param_grads, needs_dxb, sums_dtype,
        ctx.x_dtype, ctx.residual_dtype,
    )
    w_dtype, b_dtype, xb_dtype = ctx.sum_dtypes
    dw = sums[0].to(w_dtype) if needs_dw else None
    db = sums[1].to(b_dtype) if needs_db else None
    dxb = sums[-1].to(xb_dtype) if needs_dxb else None
    return dx, dr, dw, db, dxb, None, None, None, None, None, None


defer_ops(
    globals(),
    {
        "_add_layer_norm_forward_op": ("add_layer_norm_forward", _add_layer_norm_forward),
        "_add_layer_norm_backward_op": ("add_layer_norm_backward", _add_layer_norm_backward),
    },
    autograd=(_backward, _setup_context),
)
_add_layer_norm_forward_eager = eager_twin(_add_layer_norm_forward, _setup_context, _backward)


# ----------------------------------------------------------------------------------------------
# Eager calls by plan (kernels._runtime, Plans).
# ----------------------------------------------------------------------------------------------
class _Plan(Plan):
    """An eager `add_layer_norm` call's signature made ready: its checks passed, the forward's
    launch prepared with and without the sum the backward reads, and the backward's launches
    prepared per signature of the gradients (and of which inputs need one) on the first backward
    that meets it."""

    def __init__(self, x, residual, weight, bias, x_bias, seed, eps, dropout_p, out_dtype, lowp_dtype):
        self.shape, self.rows = tuple(x.shape), (math.prod(x.shape[:-1]), x.shape[-1])
        self.eps, self.dropout_p, self.out_dtype, self.lowp_dtype = eps, dropout_p, out_dtype, lowp_dtype
        self.x_dtype, self.residual_dtype = x.dtype, residual.dtype  # dx's and dresidual's
        self.draws_seed = dropout_p > 0.0 and seed is None
        if self.draws_seed:  # a stand-in for the seed each call draws (no number drawn here)
            seed = torch.empty(1, dtype=torch.int64, device=x.device)
        elif dropout_p == 0.0:
            seed = None
        y, y_low, mean, rstd, s = _forward_outputs(x, out_dtype, lowp_dtype, True)
        x2, r2 = x.view(self.rows), residual.view(self.rows)
        # forwards[save_sum]: without the sum (nothing to differentiate), and with it
        self.forwards = tuple(
            PreparedLaunch(
                _add_ln_fwd_kernel,
                *_forward_launch(x2, r2, weight, bias, x_bias, y, y_low, sum_, mean, rstd, seed, eps, dropout_p),
            )
            for sum_ in (None, s)
        )
        # the dtypes the parameter gradients come out in (_backward), the backward's programs
        self.sum_dtypes = tuple(None if t is None else t.dtype for t in (weight, bias, x_bias))
        self.programs = _bwd_programs(*self.rows, x.device)
        self.backwards = {}
        self._grads = {}  # grads(needs), by needs

    def _made(self):
        return (
            self.rows, self.eps, self.dropout_p, self.out_dtype, self.lowp_dtype, self.x_dtype, self.residual_dtype,
            self.draws_seed, self.sum_dtypes, self.programs, *self.forwards,
        )

    def __repr__(self):
        return (
            f"add_layer_norm._Plan(rows={self.rows}, p={self.dropout_p}, lowp={self.lowp_dtype}, "
            f"{self.forwards[True]})"
        )

    def _backward_launches(self, s, weight, dy2, dy_low2, dx, dr, partial, sums, mean, rstd, seed, param_grads,
                           x_bias_grad):
        dy2, dy_low2 = dy2.view(self.rows), None if dy_low2 is None else dy_low2.view(self.rows)
        launches = _backward_launches(
            s, weight, dy2, dy_low2, dx, dr, partial, sums, mean, rstd, seed, self.dropout_p, param_grads, x_bias_grad
        )
        return [PreparedLaunch(*launch) for launch in launches]

    def run(self, x, residual, weight, bias, x_bias, seed, save_sum):
        """y, y_low, mean, rstd and (save_sum) s, the sum the backward reads, else None, of the
        forward, allocated as _forward_outputs lays them out."""
        device = x.device
        y = torch.empty(*self.shape, dtype=self.out_dtype, device=device)
        y_low = None if self.lowp_dtype is None else torch.empty(*self.shape, dtype=self.lowp_dtype, device=device)
        mean = torch.empty(self.rows[0], dtype=torch.float32, device=device)
        rstd = torch.empty_like(mean)
        s = torch.empty(*self.rows, dtype=torch.float32, device=device) if save_sum else None
        # x and residual go as they are: the launch was prepared on their rows, views of them
        self.forwards[save_sum](x, residual, weight, bias, x_bias, y, y_low, s, mean, rstd, seed)
        return y, y_low, mean, rstd, s

    def grads(self, needs):
        """What the backward computes when (weight, bias, x_bias) each need a gradient or not:
        whether the kernel sums the parameters' columns (param_grads) and x_bias's (x_bias_grad),
        the sums' dtype, and per gradient the row of the sums it is (or None) and the dtype it
        comes out in (None: the sums' own, no cast)."""
        found = self._grads.get(needs)
        if found is None:
            param_grads, x_bias_grad = needs[0] or needs[1], needs[2]
            sums_dtype = _sums_dtype(self.sum_dtypes, needs)
            rows = (0, 1, 2 * param_grads)  # dw and db first, when summed; dxb last
            picks = tuple(
                (row, None if dtype == sums_dtype else dtype) if needed else None
                for row, dtype, needed in zip(rows, self.sum_dtypes, needs)
            )
            found = self._grads[needs] = (param_grads, x_bias_grad, sums_dtype, picks)
        return found

    def backward(self, dy, dy_low, s, weight, mean, rstd, seed, needs):
        """dx, dresidual, dweight, dbias and dx_bias (None where `needs` says none), as
        _add_layer_norm_backward and _backward compute them from the forward's sum s, by prepared
        launches."""
        param_grads, x_bias_grad, sums_dtype, picks = self.grads(needs)
        # the gradients' rows (a contiguous gradient goes as it is: the launches are prepared on its rows)
        dy2 = dy if dy.is_contiguous() else rows_view(dy)
        dy_low2 = dy_low if dy_low is None or dy_low.is_contiguous() else rows_view(dy_low)
        key = (dy2.stride(), dy2.dtype, None if dy_low2 is None else (dy_low2.stride(), dy_low2.dtype), needs)
        dx, dr, partial, sums = _backward_outputs(
            self.shape, self.x_dtype, self.residual_dtype, s.device, self.programs, param_grads, x_bias_grad,
            sums_dtype,
        )
        tensors = s, weight, dy2, dy_low2, dx, dr, partial, sums, mean, rstd, seed
        launches = kept(self.backwards, key, self._backward_launches, *tensors, param_grads, x_bias_grad)
        launches[0](s, weight, dy2, dy_low2, dx, dr, partial, mean, rstd, seed)
        if partial is not None:
            launches[1](partial, sums)
        return dx, dr, *[_pick(sums, pick) for pick in picks]


def _pick(sums, pick):
    """A parameter's gradient out of the backward's sums: pick (row, dtype to cast to or None), or None."""
    if pick is None:
        return None
    row, dtype = pick
    return sums[row] if dtype is None else sums[row].to(dtype)


def _sums_dtype(sum_dtypes, needs):
    """The dtype the column sums come out in: the one of the parameters they are for when those
    share one (no casts), else fp32. `needs`: whether (weight, bias, x_bias) each need a gradient."""
    wanted = {dtype for dtype, needed in zip(sum_dtypes, needs) if needed}
    return wanted.pop() if len(wanted) == 1 else torch.float32


class _PlannedAddLayerNorm(torch.autograd.Function):
    """`add_layer_norm` by its _Plan: y, and y_low too when the plan writes it."""

    @staticmethod
    def forward(ctx, x, residual, weight, bias, x_bias, seed, plan):
        y, y_low, mean, rstd, s = plan.run(x, residual, weight, bias, x_bias, seed, True)
        ctx.save_for_backward(s, weight, mean, rstd, seed)  # the sum, not x, residual and x_bias
        ctx.plan = plan
        ctx.set_materialize_grads(False)
        return y if plan.lowp_dtype is None else (y, y_low)

    @staticmethod
    @plain_backward
    def backward(ctx, dy, dy_low=None):
        if dy is None and dy_low is None:  # neither y nor y_low took part in what is differentiated
            return (None,) * 7
        if dy is None:  # y_low alone did: its gradient is all of y's
            dy, dy_low = dy_low, None
        plan = ctx.plan
        args = (dy, dy_low, *ctx.saved_tensors)
        needs = ctx.needs_input_grad[2:5]
        if planning():
            return *plan.backward(*args, needs), None, None
        # a dispatch mode or transform over the backward sees the registered op
        param_grads, x_bias_grad, sums_dtype, picks = plan.grads(needs)
        dx, dr, sums = _add_layer_norm_backward_op(
            *args, plan.dropout_p, param_grads, x_bias_grad, sums_dtype, plan.x_dtype, plan.residual_dtype
        )
        return dx, dr, *[_pick(sums, pick) for pick in picks], None, None


_planned_add_layer_norm = autograd_apply(_PlannedAddLayerNorm)


def _make_plan(x, residual, weight, bias, eps, dropout_p, x_bias, seed, lowp_dtype):
    """The _Plan of a call, or None for one that takes the ordinary path each time: a width the
    kernel does not take, or inputs whose rows are not views with a unit last stride."""
    check_add_layer_norm_args(x, residual, weight, bias, eps, dropout_p, x_bias, seed, lowp_dtype)
    if not 0 < x.shape[-1] <= MAX_FEATURES or x.stride(-1) != 1 or residual.stride(-1) != 1:
        return None
    rows = (math.prod(x.shape[:-1]), x.shape[-1])
    try:
        x.view(rows), residual.view(rows)
    except RuntimeError:  # rows_view copies them
        return None
    require_launchable("add_layer_norm", x, residual, weight, bias, x_bias)
    if lowp_dtype == torch.bfloat16:
        require_interpreter_bf16("add_layer_norm", "lowp_dtype=torch.bfloat16")
    if dropout_p > 0.0:
        check_dropout_rows("add_layer_norm", rows[0])
    out_dtype = _output_dtype(x, residual, x_bias)
    return _Plan(x, residual, weight, bias, x_bias, seed, float(eps), float(dropout_p), out_dtype, lowp_dtype)


_plans = Plans("add_layer_norm")


def add_layer_norm_dropout_mask(shape, dropout_p, device):
    """Testing hook: the bool keep-mask (of x's shape) that `add_layer_norm` applies to x when
    called right after the same torch.manual_seed with no `seed` (for a given seed, the mask is
    `_dropout._dropout_mask` of that seed)."""
    n_cols = shape[-1]
    n_rows = 1
    for size in shape[:-1]:
        n_rows *= size
    return dropout_mask(n_rows, n_cols, dropout_p, device).view(shape)


def _output_dtype(x, residual, x_bias):
    """What the reference returns: fp32 under autocast (layer_norm autocasts), else the promoted
    dtype of x, x_bias and residual."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.float32
    dtype = x.dtype if x_bias is None else torch.promote_types(x.dtype, x_bias.dtype)
    return torch.promote_types(dtype, residual.dtype)


LOWP_DTYPES = (torch.float16, torch.bfloat16)


@argument_check
def check_add_layer_norm_args(
    x, residual, weight, bias, eps, dropout_p, x_bias=None, seed=None, lowp_dtype=None, dtypes=FLOAT_DTYPES
):
    check_tensor("x", x, dtypes=dtypes)
    check_tensor("residual", residual, dtypes=dtypes)
    if x.shape != residual.shape:
        raise ValueError(
            f"x and residual must have one shape, got x {tuple(x.shape)}, residual {tuple(residual.shape)}"
        )
    d = x.shape[-1]
    for name, t in (("weight", weight), ("bias", bias), ("x_bias", x_bias)):
        if t is not None:
            check_tensor(name, t, ndim=1, dtypes=dtypes)
            if t.shape[0] != d:
                raise ValueError(f"{name} must have shape ({d},) to match x {tuple(x.shape)}, got {tuple(t.shape)}")
    check_same_device(x=x, residual=residual, weight=weight, bias=bias, x_bias=x_bias)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < math.inf:
        raise ValueError(f"eps must be a positive finite number, got {eps!r}")
    check_dropout_p(dropout_p)
    check_seed(seed, x.device)
    if lowp_dtype is not None and lowp_dtype not in LOWP_DTYPES:
        raise TypeError(f"lowp_dtype must be None, torch.float16 or torch.bfloat16, got {lowp_dtype!r}")


def add_layer_norm(x, residual, weight, bias, eps, dropout_p=0.0, *, x_bias=None, seed=None, lowp_dtype=None):
    """Post-LayerNorm residual block in one Triton pass: layer_norm(residual + dropout(x + x_bias)).

    Args:
        x: (..., d) the sublayer output; residual: same shape (its dtype may differ, as under
            autocast); weight, bias: (d,) or None. Any leading shape; unit last stride preferred.
        eps: LayerNorm epsilon; dropout_p: dropout on x + x_bias, drawn in the kernel and
            regenerated in the backward (pass 0.0 in eval).
        x_bias: (d,) or None, the bias of the linear layer that made x, added to x in fp32 before
            dropout (its dtype may differ from x's: under autocast, the fp32 parameter). Its
            gradient, the column sum of the gradient reaching x + x_bias, comes out of the
            backward's reduction with dW and db, in x_bias's dtype.
        seed: None (one is drawn from torch's generator when dropout_p > 0) or a one-element int64
            tensor on x's device, such as `_dropout.draw_seeds(n, device)[i:i + 1]`: the dropout mask
            is `_dropout._dropout_mask` of that seed, and no random number is drawn.
        lowp_dtype: None, torch.float16 or torch.bfloat16: also return y cast to it (y_low), written
            by the same kernel. Under autocast, y (fp32) is the residual stream and y_low what the
            next matrix product reads; the backward adds the two gradients in fp32 itself.

    Returns:
        y (..., d) with fp32 statistics; in fp32 under autocast (as F.layer_norm), else in the
        promoted dtype of x, x_bias and residual. With lowp_dtype, the pair (y, y_low), y_low equal
        to y.to(lowp_dtype). Widths above MAX_FEATURES run the reference (which ignores `seed`)
        with a one-time warning.
    """
    if planning() and isinstance(x, torch.Tensor):
        args = x, residual, weight, bias, eps, dropout_p, x_bias, seed, lowp_dtype
        plan = kept(_plans, (signature(*args), switches(x)), _make_plan, *args)
        if plan is not None:
            seed = planned_seed(plan, seed, x.device)
            if needs_grad(x, residual, weight, bias, x_bias):
                return _planned_add_layer_norm(x, residual, weight, bias, x_bias, seed, plan)
            y, y_low, _, _, _ = plan.run(x, residual, weight, bias, x_bias, seed, False)  # nothing to differentiate
            return y if lowp_dtype is None else (y, y_low)
    check_add_layer_norm_args(x, residual, weight, bias, eps, dropout_p, x_bias, seed, lowp_dtype)
    kwargs = dict(x_bias=x_bias, seed=seed, lowp_dtype=lowp_dtype)
    if x.shape[-1] == 0:  # nothing to normalize: the reference's empty result, no kernel to launch
        return add_layer_norm_reference(x, residual, weight, bias, eps, dropout_p, **kwargs)
    if x.shape[-1] > MAX_FEATURES:
        warn_once(
            ("add_layer_norm", "width"),
            f"kernels.add_layer_norm: width {x.shape[-1]} > {MAX_FEATURES} is not supported by the Triton kernel; "
            "running the PyTorch reference instead",
        )
        return add_layer_norm_reference(x, residual, weight, bias, eps, dropout_p, **kwargs)
    require_launchable("add_layer_norm", x, residual, weight, bias, x_bias)
    if lowp_dtype == torch.bfloat16:
        require_interpreter_bf16("add_layer_norm", "lowp_dtype=torch.bfloat16")
    if dropout_p > 0.0:
        check_dropout_rows("add_layer_norm", x.numel() // x.shape[-1])
        seed = draw_seed(x.device) if seed is None else seed
    else:
        seed = None
    out_dtype = _output_dtype(x, residual, x_bias)
    forward = _add_layer_norm_forward_eager if eager() else _add_layer_norm_forward_op
    save_sum = needs_grad(x, residual, weight, bias, x_bias)  # the backward's input, when there will be one
    y, y_low, _, _, _ = forward(
        x, residual, weight, bias, x_bias, seed, float(eps), float(dropout_p), out_dtype, lowp_dtype, save_sum
    )
    return y if lowp_dtype is None else (y, y_low)


def add_layer_norm_reference(x, residual, weight, bias, eps, dropout_p=0.0, *, x_bias=None, seed=None, lowp_dtype=None):
    """layer_norm(residual + dropout(x + x_bias)) over the last dimension, in PyTorch (fp64 too, for
    tests), and with lowp_dtype the pair (y, y.to(lowp_dtype)). `seed` is checked but not used:
    dropout here is F.dropout's, drawn from torch's generator, not the kernel's Philox mask."""
    check_add_layer_norm_args(
        x, residual, weight, bias, eps, dropout_p, x_bias, seed, lowp_dtype, dtypes=REFERENCE_DTYPES
    )
    if x_bias is not None:
        x = x + x_bias
    if dropout_p > 0.0:
        x = F.dropout(x, p=dropout_p, training=True)
    # the weight's shape where there is one: a constant when traced (torch.jit.trace, the legacy
    # ONNX exporter, whose LayerNormalization takes no shape computed from x)
    normalized_shape = weight.shape if weight is not None else (x.shape[-1],)
    y = F.layer_norm(residual + x, normalized_shape, weight, bias, eps)
    return y if lowp_dtype is None else (y, y.to(lowp_dtype))
