"""layer_norm(residual + dropout(x)) in one pass, in Triton, and its PyTorch reference.

The forward reads x and residual once, applies dropout (Philox, in the kernel), adds, normalizes
with fp32 statistics and writes y, keeping only each row's mean and 1/std. The backward regenerates
the dropout mask from its seed instead of storing it, and reduces dW/db through per-program partial
sums added in a fixed order (no atomics), so gradients are bitwise reproducible.
"""
import math
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from kernels._common import (
    FLOAT_DTYPES,
    INTERPRET,
    REFERENCE_DTYPES,
    check_dropout_p,
    check_dropout_rows,
    check_same_device,
    check_tensor,
    draw_seed,
    dropout_keep,
    dropout_mask,
    require_launchable,
    rows_view,
    tl,
    triton,
    vector_stride,
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
    X, R, W, B, Y, MEAN, RSTD, SEED,
    stride_x, stride_r, stride_w, stride_b, stride_y,
    n_cols, eps, dropout_p,
    HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_DROPOUT: tl.constexpr, BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    ok = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_DROPOUT:
        keep = _row_keep(tl.load(SEED), row, dropout_p, BLOCK_N)
        x = tl.where(keep, x / (1.0 - dropout_p), 0.0)
    h = tl.load(R + row * stride_r + cols, mask=ok, other=0.0).to(tl.float32) + x
    mean = tl.sum(h, 0) / n_cols
    centered = tl.where(ok, h - mean, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(centered * centered, 0) / n_cols + eps)
    y = centered * rstd
    if HAS_WEIGHT:
        y = y * tl.load(W + cols * stride_w, mask=ok, other=0.0).to(tl.float32)
    if HAS_BIAS:
        y = y + tl.load(B + cols * stride_b, mask=ok, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=ok)
    tl.store(MEAN + row, mean)
    tl.store(RSTD + row, rstd)


@triton.jit
def _add_ln_bwd_kernel(
    X, R, W, DY, DX, DR, DW_PARTIAL, DB_PARTIAL, MEAN, RSTD, SEED,
    stride_x, stride_r, stride_w, stride_dy, stride_dx, stride_dr,
    n_rows, n_cols, rows_per_program, dropout_p,
    HAS_WEIGHT: tl.constexpr, HAS_DROPOUT: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """dx, dresidual for a run of rows, and this program's partial sums of dW and db."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    ok = cols < n_cols
    w = tl.full([BLOCK_N], 1.0, tl.float32)
    if HAS_WEIGHT:
        w = tl.load(W + cols * stride_w, mask=ok, other=0.0).to(tl.float32)
    seed = 0
    if HAS_DROPOUT:
        seed = tl.load(SEED)
    dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    db = tl.zeros([BLOCK_N], dtype=tl.float32)
    first = pid.to(tl.int64) * rows_per_program
    for i in range(0, tl.minimum(rows_per_program, n_rows - first)):
        row = first + i
        x = tl.load(X + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
        if HAS_DROPOUT:
            keep = _row_keep(seed, row, dropout_p, BLOCK_N)
            x = tl.where(keep, x / (1.0 - dropout_p), 0.0)
        h = tl.load(R + row * stride_r + cols, mask=ok, other=0.0).to(tl.float32) + x
        xhat = tl.where(ok, (h - tl.load(MEAN + row)) * tl.load(RSTD + row), 0.0)
        dy = tl.load(DY + row * stride_dy + cols, mask=ok, other=0.0).to(tl.float32)
        wdy = w * dy
        c1 = tl.sum(xhat * wdy, 0) / n_cols
        c2 = tl.sum(wdy, 0) / n_cols
        dh = tl.where(ok, (wdy - (xhat * c1 + c2)) * tl.load(RSTD + row), 0.0)
        tl.store(DR + row * stride_dr + cols, dh.to(DR.dtype.element_ty), mask=ok)
        if HAS_DROPOUT:
            dh = tl.where(keep, dh / (1.0 - dropout_p), 0.0)
        tl.store(DX + row * stride_dx + cols, dh.to(DX.dtype.element_ty), mask=ok)
        dw += dy * xhat
        db += dy
    tl.store(DW_PARTIAL + pid * n_cols + cols, dw, mask=ok)
    tl.store(DB_PARTIAL + pid * n_cols + cols, db, mask=ok)


def _add_ln_forward(x, residual, weight, bias, eps, dropout_p, out_dtype):
    n_cols = x.shape[-1]
    x2, r2 = rows_view(x), rows_view(residual)
    n_rows = x2.shape[0]
    y = torch.empty(n_rows, n_cols, dtype=out_dtype, device=x.device)
    mean = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    rstd = torch.empty_like(mean)
    seed = draw_seed(x.device) if dropout_p > 0.0 else torch.empty(0, dtype=torch.int64, device=x.device)
    torch.library.wrap_triton(_add_ln_fwd_kernel)[(n_rows,)](
        x2, r2, x2 if weight is None else weight, x2 if bias is None else bias, y, mean, rstd, seed,
        x2.stride(0), r2.stride(0), vector_stride(weight), vector_stride(bias), y.stride(0),
        n_cols, eps, dropout_p,
        HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None, HAS_DROPOUT=dropout_p > 0.0,
        BLOCK_N=_row_block(n_cols), num_warps=_warps(n_cols),
    )
    return y.view(x.shape), mean, rstd, seed


def _row_block(n_cols):
    """One row per program, padded to a power of two of at least 4 (dropout decides 4 columns at once)."""
    return max(4, triton.next_power_of_2(n_cols))


def _warps(n_cols):
    return min(16, max(1, triton.next_power_of_2(n_cols) // 256))


def _programs(n_rows, device):
    """How many programs share the backward's rows: enough to fill the GPU, few partial sums."""
    if INTERPRET or device.type != "cuda":
        return min(n_rows, 4)
    return min(n_rows, 4 * torch.cuda.get_device_properties(device).multi_processor_count)


@torch.library.triton_op("fastformer::add_layer_norm_forward", mutates_args=())
def _add_layer_norm_forward_op(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    eps: float,
    dropout_p: float,
    out_dtype: torch.dtype,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _add_ln_forward(x, residual, weight, bias, eps, dropout_p, out_dtype)


@torch.library.triton_op("fastformer::add_layer_norm_backward", mutates_args=())
def _add_layer_norm_backward_op(
    dy: torch.Tensor,
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: Optional[torch.Tensor],
    mean: torch.Tensor,
    rstd: torch.Tensor,
    seed: torch.Tensor,
    dropout_p: float,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    n_cols = x.shape[-1]
    x2, r2, dy2 = rows_view(x), rows_view(residual), rows_view(dy)
    n_rows = x2.shape[0]
    dx = torch.empty(n_rows, n_cols, dtype=x.dtype, device=x.device)
    dr = torch.empty(n_rows, n_cols, dtype=residual.dtype, device=x.device)
    programs = _programs(n_rows, x.device)
    dw_partial = torch.empty(programs, n_cols, dtype=torch.float32, device=x.device)
    db_partial = torch.empty_like(dw_partial)
    torch.library.wrap_triton(_add_ln_bwd_kernel)[(programs,)](
        x2, r2, x2 if weight is None else weight, dy2, dx, dr, dw_partial, db_partial, mean, rstd, seed,
        x2.stride(0), r2.stride(0), vector_stride(weight), dy2.stride(0), dx.stride(0), dr.stride(0),
        n_rows, n_cols, triton.cdiv(n_rows, programs), dropout_p,
        HAS_WEIGHT=weight is not None, HAS_DROPOUT=dropout_p > 0.0,
        BLOCK_N=_row_block(n_cols), num_warps=_warps(n_cols),
    )
    # partial sums added in a fixed order: deterministic
    return dx.view(x.shape), dr.view(residual.shape), dw_partial.sum(0), db_partial.sum(0)


def _setup_context(ctx, inputs, output):
    x, residual, weight, bias, eps, dropout_p, out_dtype = inputs
    _, mean, rstd, seed = output
    ctx.save_for_backward(x, residual, weight, mean, rstd, seed)
    ctx.dropout_p = dropout_p
    ctx.has_bias = bias is not None
    ctx.param_dtypes = (None if weight is None else weight.dtype, None if bias is None else bias.dtype)


def _backward(ctx, dy, _dmean, _drstd, _dseed):
    x, residual, weight, mean, rstd, seed = ctx.saved_tensors
    dx, dr, dw, db = _add_layer_norm_backward_op(dy, x, residual, weight, mean, rstd, seed, ctx.dropout_p)
    w_dtype, b_dtype = ctx.param_dtypes
    dw = None if weight is None else dw.to(w_dtype)
    db = db.to(b_dtype) if ctx.has_bias else None
    return dx, dr, dw, db, None, None, None


torch.library.register_autograd(_add_layer_norm_forward_op, _backward, setup_context=_setup_context)


def add_layer_norm_dropout_mask(shape, dropout_p, device):
    """Testing hook: the bool keep-mask (of x's shape) that `add_layer_norm` applies to x when
    called right after the same torch.manual_seed."""
    n_cols = shape[-1]
    n_rows = 1
    for size in shape[:-1]:
        n_rows *= size
    return dropout_mask(n_rows, n_cols, dropout_p, device).view(shape)


def _output_dtype(x, residual):
    """What the reference returns: fp32 under autocast (layer_norm autocasts), else the promoted dtype."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.float32
    return torch.promote_types(x.dtype, residual.dtype)


def check_add_layer_norm_args(x, residual, weight, bias, eps, dropout_p, dtypes=FLOAT_DTYPES):
    check_tensor("x", x, dtypes=dtypes)
    check_tensor("residual", residual, dtypes=dtypes)
    if x.shape != residual.shape:
        raise ValueError(f"x and residual must have one shape, got x {tuple(x.shape)}, residual {tuple(residual.shape)}")
    d = x.shape[-1]
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None:
            check_tensor(name, t, ndim=1, dtypes=dtypes)
            if t.shape[0] != d:
                raise ValueError(f"{name} must have shape ({d},) to match x {tuple(x.shape)}, got {tuple(t.shape)}")
    check_same_device(x=x, residual=residual, weight=weight, bias=bias)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < math.inf:
        raise ValueError(f"eps must be a positive finite number, got {eps!r}")
    check_dropout_p(dropout_p)


def add_layer_norm(x, residual, weight, bias, eps, dropout_p=0.0):
    """Post-LayerNorm residual block in one Triton pass: layer_norm(residual + dropout(x)).

    Args:
        x: (..., d) the sublayer output; residual: same shape (its dtype may differ, as under
            autocast); weight, bias: (d,) or None. Any leading shape; unit last stride preferred.
        eps: LayerNorm epsilon; dropout_p: dropout on x, drawn in the kernel and regenerated in the
            backward (pass 0.0 in eval).

    Returns:
        (..., d) with fp32 statistics; in fp32 under autocast (as F.layer_norm), else in the
        promoted dtype of x and residual. Widths above MAX_FEATURES run the reference with a
        one-time warning.
    """
    check_add_layer_norm_args(x, residual, weight, bias, eps, dropout_p)
    if x.shape[-1] == 0:  # nothing to normalize: the reference's empty result, no kernel to launch
        return add_layer_norm_reference(x, residual, weight, bias, eps, dropout_p)
    if x.shape[-1] > MAX_FEATURES:
        warn_once(
            ("add_layer_norm", "width"),
            f"kernels.add_layer_norm: width {x.shape[-1]} > {MAX_FEATURES} is not supported by the Triton kernel; "
            "running the PyTorch reference instead",
        )
        return add_layer_norm_reference(x, residual, weight, bias, eps, dropout_p)
    require_launchable("add_layer_norm", x, residual, weight, bias)
    if dropout_p > 0.0:
        check_dropout_rows("add_layer_norm", x.numel() // x.shape[-1])
    y, _, _, _ = _add_layer_norm_forward_op(
        x, residual, weight, bias, float(eps), float(dropout_p), _output_dtype(x, residual)
    )
    return y


def add_layer_norm_reference(x, residual, weight, bias, eps, dropout_p=0.0):
    """layer_norm(residual + dropout(x)) over the last dimension, in PyTorch (fp64 too, for tests)."""
    check_add_layer_norm_args(x, residual, weight, bias, eps, dropout_p, dtypes=REFERENCE_DTYPES)
    if dropout_p > 0.0:
        x = F.dropout(x, p=dropout_p, training=True)
    return F.layer_norm(residual + x, (x.shape[-1],), weight, bias, eps)
