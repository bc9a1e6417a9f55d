"""layer_norm(residual + dropout(x)) in one pass, in Triton, and its PyTorch reference.

The forward reads x and residual once, applies dropout (Philox, in the kernel), adds, normalizes
with fp32 statistics and writes y, keeping only each row's mean and 1/std. The backward regenerates
the dropout mask from its seed instead of storing it, and reduces dW/db through per-program partial
sums that a second small kernel (`sum_partials`) adds in a fixed order (no atomics), so gradients are
bitwise reproducible. The backward takes BLOCK_M rows at a time, so a narrow row (the tutorial's d = 256)
still gives each program several warps and several rows' loads in flight.
"""
import math
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from ._common import (
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
    launch,
    require_launchable,
    rows_view,
    sum_partials,
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
    X, R, W, DY, DX, DR, PARTIAL, MEAN, RSTD, SEED,
    stride_x, stride_r, stride_w, stride_dy, stride_dx, stride_dr,
    n_rows, n_cols, rows_per_program, dropout_p,
    HAS_WEIGHT: tl.constexpr, HAS_DROPOUT: tl.constexpr, PARAM_GRADS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    """dx, dresidual for a run of rows, BLOCK_M rows at a time, and (PARAM_GRADS) this program's
    partial sums of dW and db: PARTIAL[pid] = (sum of dy * xhat, sum of dy) over its rows.
    NUM_STAGES > 1 has Triton load x, residual and dy NUM_STAGES - 1 steps ahead (async copies into
    shared memory on sm_80+): a loop without a dot is pipelined only when asked."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < n_cols
    w = tl.full([BLOCK_N], 1.0, tl.float32)
    if HAS_WEIGHT:
        w = tl.load(W + cols * stride_w, mask=col_ok, other=0.0).to(tl.float32)
    seed = 0
    if HAS_DROPOUT:
        seed = tl.load(SEED)
    dw = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    db = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    first = pid.to(tl.int64) * rows_per_program
    n_mine = tl.minimum(rows_per_program, n_rows - first)
    for i in tl.range(0, n_mine, BLOCK_M, num_stages=NUM_STAGES):
        rows = first + i + tl.arange(0, BLOCK_M)
        row_ok = i + tl.arange(0, BLOCK_M) < n_mine
        ok = row_ok[:, None] & col_ok[None, :]
        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        if HAS_DROPOUT:
            keep = dropout_keep(seed, rows, 0, dropout_p, BLOCK_N)
            x = tl.where(keep, x / (1.0 - dropout_p), 0.0)
        h = tl.load(R + rows[:, None] * stride_r + cols[None, :], mask=ok, other=0.0).to(tl.float32) + x
        dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        mean = tl.load(MEAN + rows, mask=row_ok, other=0.0)
        rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)
        xhat = tl.where(ok, (h - mean[:, None]) * rstd[:, None], 0.0)
        wdy = w[None, :] * dy
        c1 = tl.sum(xhat * wdy, 1) / n_cols
        c2 = tl.sum(wdy, 1) / n_cols
        dh = tl.where(ok, (wdy - (xhat * c1[:, None] + c2[:, None])) * rstd[:, None], 0.0)
        tl.store(DR + rows[:, None] * stride_dr + cols[None, :], dh.to(DR.dtype.element_ty), mask=ok)
        if HAS_DROPOUT:
            dh = tl.where(keep, dh / (1.0 - dropout_p), 0.0)
        tl.store(DX + rows[:, None] * stride_dx + cols[None, :], dh.to(DX.dtype.element_ty), mask=ok)
        if PARAM_GRADS:
            dw += dy * xhat
            db += dy
    if PARAM_GRADS:
        tl.store(PARTIAL + pid * 2 * n_cols + cols, tl.sum(dw, 0), mask=col_ok)
        tl.store(PARTIAL + pid * 2 * n_cols + n_cols + cols, tl.sum(db, 0), mask=col_ok)


def _add_ln_forward(x, residual, weight, bias, eps, dropout_p, out_dtype):
    n_cols = x.shape[-1]
    x2, r2 = rows_view(x), rows_view(residual)
    n_rows = x2.shape[0]
    y = torch.empty(n_rows, n_cols, dtype=out_dtype, device=x.device)
    mean = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    rstd = torch.empty_like(mean)
    seed = draw_seed(x.device) if dropout_p > 0.0 else torch.empty(0, dtype=torch.int64, device=x.device)
    launch(_add_ln_fwd_kernel)[(n_rows,)](
        x2, r2, x2 if weight is None else weight, x2 if bias is None else bias, y, mean, rstd, seed,
        x2.stride(0), r2.stride(0), vector_stride(weight), vector_stride(bias), y.stride(0),
        n_cols, eps, dropout_p,
        HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None, HAS_DROPOUT=dropout_p > 0.0,
        BLOCK_N=_row_block(n_cols), num_warps=_warps(n_cols),
    )
    return y.view(x.shape), mean, rstd, seed


def _row_block(n_cols):
    """A whole row, padded to a power of two of at least 4 (dropout decides 4 columns at once)."""
    return max(4, triton.next_power_of_2(n_cols))


def _warps(n_cols):
    return min(16, max(1, triton.next_power_of_2(n_cols) // 256))


def _bwd_tile(n_cols):
    """(BLOCK_M, num_warps, NUM_STAGES) of the backward. BLOCK_M rows (at most 16) make a tile of
    1024 elements, 8 to a thread over 4 warps (d = 256: 4 rows a step), loaded two steps ahead
    (24 KiB of shared memory in fp32). Rows wider than 1024 go one at a time, 8 to 32 elements to a
    thread, unpipelined (pipelined, d = 2048 spills on sm_90a in fp32 with dropout)."""
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
    rows_per_program = block_m * max(1, triton.cdiv(n_rows, target * block_m))
    return triton.cdiv(n_rows, rows_per_program), rows_per_program


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
    param_grads: bool = True,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dx, dresidual and, when param_grads, dweight and dbias stacked as one (2, d) fp32 tensor
    (else (0, d)): two launches, the rows and the reduction of their partial sums."""
    n_cols = x.shape[-1]
    x2, r2, dy2 = rows_view(x), rows_view(residual), rows_view(dy)
    n_rows = x2.shape[0]
    dx = torch.empty(n_rows, n_cols, dtype=x.dtype, device=x.device)
    dr = torch.empty(n_rows, n_cols, dtype=residual.dtype, device=x.device)
    block_m, num_warps, num_stages = _bwd_tile(n_cols)
    programs, rows_per_program = _bwd_grid(n_rows, block_m, x.device)
    partial = torch.empty(programs if param_grads else 0, 2 * n_cols, dtype=torch.float32, device=x.device)
    launch(_add_ln_bwd_kernel)[(programs,)](
        x2, r2, x2 if weight is None else weight, dy2, dx, dr, partial, mean, rstd, seed,
        x2.stride(0), r2.stride(0), vector_stride(weight), dy2.stride(0), dx.stride(0), dr.stride(0),
        n_rows, n_cols, rows_per_program, dropout_p,
        HAS_WEIGHT=weight is not None, HAS_DROPOUT=dropout_p > 0.0, PARAM_GRADS=param_grads,
        BLOCK_M=block_m, BLOCK_N=_row_block(n_cols), NUM_STAGES=num_stages, num_warps=num_warps,
    )
    dparams = torch.empty(2 if param_grads else 0, n_cols, dtype=torch.float32, device=x.device)
    if param_grads:
        sum_partials(partial, dparams.view(2 * n_cols))
    return dx.view(x.shape), dr.view(residual.shape), dparams


def _setup_context(ctx, inputs, output):
    x, residual, weight, bias, eps, dropout_p, out_dtype = inputs
    _, mean, rstd, seed = output
    ctx.save_for_backward(x, residual, weight, mean, rstd, seed)
    # the statistics and the seed take no gradient: autograd neither tracks them nor fills zeros for them
    ctx.mark_non_differentiable(mean, rstd, seed)
    ctx.set_materialize_grads(False)
    ctx.dropout_p = dropout_p
    ctx.param_dtypes = (None if weight is None else weight.dtype, None if bias is None else bias.dtype)


def _backward(ctx, dy, _dmean, _drstd, _dseed):
    if dy is None:  # y took no part in what is differentiated
        return None, None, None, None, None, None, None
    x, residual, weight, mean, rstd, seed = ctx.saved_tensors
    needs_dw, needs_db = ctx.needs_input_grad[2:4]
    dx, dr, dparams = _add_layer_norm_backward_op(
        dy, x, residual, weight, mean, rstd, seed, ctx.dropout_p, needs_dw or needs_db
    )
    w_dtype, b_dtype = ctx.param_dtypes
    dw = dparams[0].to(w_dtype) if needs_dw else None
    db = dparams[1].to(b_dtype) if needs_db else None
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
