"""The position-wise feed-forward block, linear(act(linear(x))), act GELU or ReLU: public ops and PyTorch reference.

Two Triton paths:
- `feed_forward`: `linear_gelu` (GEMM with bias + activation in its epilogue) then a GEMM with
  bias; it has a backward and serves training, in which the GEMM for dH = dOut @ W2 makes dPre =
  dH * act'(pre) in its epilogue (kernels/linear_gelu.py, `_ffn_act_grad_kernel`). In eager mode
  by the first product's plan (`_PlannedFeedForward`), else by the registered op
  `fastformer::feed_forward_forward`, whose backward is the same.
- `feed_forward_fused`: inference only. Each program owns a (BLOCK_M, BLOCK_N) tile of the output
  and streams over d_ff in chunks: it computes act(x @ W1[chunk].T + b1[chunk]) on chip and
  accumulates its product with W2[:, chunk].T, so the (M, d_ff) activation never goes to memory.
  When d > BLOCK_N the chunk's activation is recomputed once per output tile.
  On Hopper (sm_90a compile check): in fp16/bf16 with d <= 256 (a multiple of 16; the tutorial's
  256) x's rows are read once into shared memory and the loop over d_ff chunks is the only loop, so
  Triton pipelines its W1 and W2 loads (async copies, num_stages deep) and b1 is loaded a chunk ahead.
  For wider d the chunk's product with W1 is a loop over d inside the loop over chunks: the inner
  loop is pipelined, the outer one is not (Triton pipelines innermost loops only), so each chunk's
  W2 tile is loaded synchronously after the inner loop.
"""

import torch
import torch.nn.functional as F

from . import linear_gelu as _linear
from ._checks import FLOAT_DTYPES, REFERENCE_DTYPES, argument_check, check_same_device, check_same_dtype, check_tensor
from ._configs import Configs, fp32_launch, gemm_tile_warps, switches
from ._layout import rows_view, vector_stride
from ._runtime import (
    INTERPRET,
    Plans,
    autocast_inputs,
    autocast_state,
    autograd_apply,
    call_op,
    cdiv,
    defer_ops,
    dot_precision,
    eager,
    eager_twin,
    kept,
    needs_grad,
    next_power_of_2,
    plain_backward,
    planning,
    require_launchable,
    signature,
    tl,
    triton,
)
from .linear_gelu import (
    TORCH_ACTIVATIONS,
    _activation_backward,
    _ffn_activation_backward,
    _ffn_backward_uses_cublas,
    _linear_gelu_forward,
    apply_activation,
    check_activation,
    check_linear_args,
    make_linear_gelu_plan,
)


def _fused_candidates():
    """The fused FFN's configs, the rule's preference first: the widest output tile (a hidden chunk
    is recomputed once per output tile across d), then more rows, wider chunks, more stages. A
    128-row tile with 64-wide hidden chunks spills on sm_90a beside a 64 or 256 wide output tile."""
    return [
        (
            {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_F": bf, "BLOCK_K": bf},
            gemm_tile_warps({"BLOCK_M": bm, "BLOCK_N": bn}),
            s,
        )
        for bn in (256, 128, 64)
        for bm in (128, 64)
        for bf in (64, 32)
        for s in (3, 2)
        if not (bm == 128 and bf == 64 and bn != 128)  # spills
    ]


def _fused_fits(meta, num_warps, num_stages, launch):
    """No output tile wider than d needs (rounded up to a power of two; the 64-wide tiles always fit).
    In fp32 (TF32 products: python -m tools.sm90_report --tf32) no 64-row tile with 64-wide hidden
    chunks: beside a 128-wide output tile it spills, beside a 256-wide one in 2 stages on Triton 3.9."""
    if fp32_launch(launch, "X") and (meta["BLOCK_M"], meta["BLOCK_F"]) == (64, 64):
        return False
    return meta["BLOCK_N"] <= max(64, next_power_of_2(launch["D"]))


# d up to which the fused FFN keeps x's rows in one block, in fp16/bf16 for d a multiple of 16: its
# loop over d_ff is then pipelined on sm_90a, and every config fits in shared memory (the figure is
# in docs/kernels.md). Other widths compile unpipelined that way and spill, and fp32's FMA dots spill
# at any width, so those run the two loops. The interpreter's bound is lower so that the tests run both.
MAX_ONE_BLOCK_D = 32 if INTERPRET else 256


def _one_block_d(x2):
    """BLOCK_D of the fused FFN: d padded to a power of two where x's rows fit in one block, else 0."""
    D = x2.shape[1]
    return next_power_of_2(D) if x2.element_size() == 2 and D <= MAX_ONE_BLOCK_D and D % 16 == 0 else 0


@triton.jit
def _load_b1(B1, offs_f, stride_b1, F, HAS_B1: tl.constexpr):
    """b1[offs_f] in fp32 (0 past F, or without b1), loaded into registers ahead of its use."""
    if HAS_B1:
        return tl.load(B1 + offs_f * stride_b1, mask=offs_f < F, other=0.0).to(tl.float32)
    return tl.zeros(offs_f.shape, dtype=tl.float32)


@triton.jit
def _chunk_into_output(
    h, b1, acc, offs_f, offs_n, W2, stride_w2n, stride_w2f, D, F,
    ACTIVATION: tl.constexpr, DOT_PRECISION: tl.constexpr, H_DTYPE: tl.constexpr,
):
    """acc + act(h + b1) @ W2[:, offs_f].T for one chunk of d_ff: h (BLOCK_M, BLOCK_F) fp32, b1 (BLOCK_F,)."""
    # rounded to the input dtype, as the two-GEMM path stores it; columns past F are act(0) = 0
    h = apply_activation(h + b1[None, :], ACTIVATION).to(H_DTYPE)
    w2 = tl.load(
        W2 + offs_n[None, :] * stride_w2n + offs_f[:, None] * stride_w2f,
        mask=(offs_n[None, :] < D) & (offs_f[:, None] < F),
        other=0.0,
    )
    return tl.dot(h, w2, acc, input_precision=DOT_PRECISION, out_dtype=tl.float32)


@triton.jit(do_not_specialize=["M", "M_BUCKET"])  # M bounds masks only; M_BUCKET keys the configs
def _ffn_fused_fwd_kernel(
    X, W1, B1, W2, B2, Y,
    stride_xm, stride_w1f, stride_w1k, stride_b1, stride_w2n, stride_w2f, stride_b2, stride_ym,
    M, D, F,
    M_BUCKET,  # config key only
    HAS_B1: tl.constexpr, HAS_B2: tl.constexpr, ACTIVATION: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_D: tl.constexpr,  # next_power_of_2(D) when x's rows fit in one block (_one_block_d), else 0
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One (BLOCK_M, BLOCK_N) tile of Y = act(X @ W1.T + B1) @ W2.T + B2, streaming over d_ff in chunks
    of BLOCK_F so that the (M, F) activation stays on chip. Grid: (cdiv(M, BLOCK_M), cdiv(D, BLOCK_N)).
    Launched by _ffn_fused_forward.

    Args:
        X: (M, D) input rows (rows_view of x), fp16, bf16 or fp32, unit column stride.
        W1: (F, D) first weight in X's dtype, nn.Linear layout, any strides (a Conv1d weight's view).
        B1: (F,) first bias in X's dtype, any stride; None when HAS_B1 is off.
        W2: (D, F) second weight in X's dtype, nn.Linear layout, any strides.
        B2: (D,) second bias in X's dtype, any stride; None when HAS_B2 is off.
        Y: (M, D) output in X's dtype, contiguous.
        stride_xm: X's row stride in elements.
        stride_w1f, stride_w1k: W1's strides in elements (row f, column k).
        stride_b1: B1's stride in elements; 0 when absent.
        stride_w2n, stride_w2f: W2's strides in elements (row n, column f).
        stride_b2: B2's stride in elements; 0 when absent.
        stride_ym: Y's row stride in elements.
        M: rows; bounds the masks only, not specialized.
        D, F: the model width d and the hidden width d_ff.
        M_BUCKET: next_power_of_2(M): a key of the config choice only, unused by the code, not specialized.
        HAS_B1, HAS_B2: B1, B2 are read and added.
        ACTIVATION: "gelu" (exact erf) or "relu" (apply_activation).
        DOT_PRECISION: tl.dot's input_precision, "ieee" or "tf32" (dot_precision; it matters for fp32 only).
        BLOCK_D: next_power_of_2(D) when x's rows fit in one block (_one_block_d): the loop over d_ff is
            then the only loop; 0: a loop over D in BLOCK_K steps inside each chunk.
        BLOCK_M, BLOCK_N: the output tile.
        BLOCK_F: the width of a d_ff chunk.
        BLOCK_K: the step of the loop over D when BLOCK_D is 0 (every config makes it BLOCK_F).
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if BLOCK_D > 0:
        # x's (BLOCK_M, d) rows stay on chip and the loop over d_ff chunks is the innermost loop:
        # Triton pipelines its W1 and W2 loads; b1 is loaded one chunk ahead
        ks = tl.arange(0, BLOCK_D)
        x_mask = (offs_m[:, None] < M) & (ks[None, :] < D)
        x = tl.load(X + offs_m[:, None] * stride_xm + ks[None, :], mask=x_mask, other=0.0)
        b1_next = _load_b1(B1, tl.arange(0, BLOCK_F), stride_b1, F, HAS_B1)
        for f0 in range(0, F, BLOCK_F):
            offs_f = f0 + tl.arange(0, BLOCK_F)
            b1 = b1_next
            b1_next = _load_b1(B1, offs_f + BLOCK_F, stride_b1, F, HAS_B1)
            w1 = tl.load(
                W1 + offs_f[None, :] * stride_w1f + ks[:, None] * stride_w1k,
                mask=(offs_f[None, :] < F) & (ks[:, None] < D),
                other=0.0,
            )
            h = tl.zeros([BLOCK_M, BLOCK_F], dtype=tl.float32)
            h = tl.dot(x, w1, h, input_precision=DOT_PRECISION, out_dtype=tl.float32)
            acc = _chunk_into_output(
                h, b1, acc, offs_f, offs_n, W2, stride_w2n, stride_w2f, D, F,
                ACTIVATION, DOT_PRECISION, X.dtype.element_ty,
            )
    else:
        offs_k = tl.arange(0, BLOCK_K)
        for f0 in range(0, F, BLOCK_F):
            offs_f = f0 + tl.arange(0, BLOCK_F)
            b1 = _load_b1(B1, offs_f, stride_b1, F, HAS_B1)  # in registers while the loop over d runs
            # (BLOCK_M, BLOCK_F) of the hidden activation, on chip only
            h = tl.zeros([BLOCK_M, BLOCK_F], dtype=tl.float32)
            for k0 in range(0, D, BLOCK_K):
                ks = k0 + offs_k
                x = tl.load(
                    X + offs_m[:, None] * stride_xm + ks[None, :],
                    mask=(offs_m[:, None] < M) & (ks[None, :] < D),
                    other=0.0,
                )
                w1 = tl.load(
                    W1 + offs_f[None, :] * stride_w1f + ks[:, None] * stride_w1k,
                    mask=(offs_f[None, :] < F) & (ks[:, None] < D),
                    other=0.0,
                )
                h = tl.dot(x, w1, h, input_precision=DOT_PRECISION, out_dtype=tl.float32)
            # W2's tile is loaded after the loop: loaded before it, Triton would store it to shared
            # memory (for the dot) right after the load, waiting for it there all the same
            acc = _chunk_into_output(
                h, b1, acc, offs_f, offs_n, W2, stride_w2n, stride_w2f, D, F,
                ACTIVATION, DOT_PRECISION, X.dtype.element_ty,
            )
    if HAS_B2:
        acc += tl.load(B2 + offs_n * stride_b2, mask=offs_n < D, other=0.0).to(tl.float32)[None, :]
    out_mask = (offs_m[:, None] < M) & (offs_n[None, :] < D)
    tl.store(Y + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(Y.dtype.element_ty), mask=out_mask)


_ffn_fused_fwd = Configs(
    _ffn_fused_fwd_kernel, "feed_forward_fused", _fused_candidates(),
    ["M_BUCKET", "D", "F", "ACTIVATION", "DOT_PRECISION"],
    _fused_fits, interpreter_meta={"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_F": 16, "BLOCK_K": 16},
)


def _ffn_fused_forward(x2, w1, b1, w2, b2, activation):
    M, D = x2.shape
    F_ = w1.shape[0]
    y = torch.empty(M, D, dtype=x2.dtype, device=x2.device)
    grid = lambda meta: (cdiv(M, meta["BLOCK_M"]), cdiv(D, meta["BLOCK_N"]))  # noqa: E731
    _ffn_fused_fwd[grid](
        x2, w1, b1, w2, b2, y,
        x2.stride(0), w1.stride(0), w1.stride(1), vector_stride(b1),
        w2.stride(0), w2.stride(1), vector_stride(b2), y.stride(0),
        M, D, F_, next_power_of_2(M),
        HAS_B1=b1 is not None, HAS_B2=b2 is not None, ACTIVATION=activation, DOT_PRECISION=dot_precision(x2.dtype),
        BLOCK_D=_one_block_d(x2),
    )
    return y


def _feed_forward_fused(
    x2: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor | None, w2: torch.Tensor, b2: torch.Tensor | None,
    activation: str,
) -> torch.Tensor:
    return _ffn_fused_forward(x2, w1, b1, w2, b2, activation)


_feed_forward_fused_op = None  # the torch.library op, bound by defer_ops below


defer_ops(globals(), {"_feed_forward_fused_op": ("feed_forward_fused", _feed_forward_fused)})


@argument_check
def check_feed_forward_args(x, w1, b1, w2, b2, activation, dtypes=FLOAT_DTYPES):
    """Validate the FFN's arguments; returns (d, d_ff)."""
    d, d_ff = check_linear_args(x, w1, b1, weight_name="w1", bias_name="b1", dtypes=dtypes)
    check_tensor("w2", w2, ndim=2, dtypes=dtypes)
    if tuple(w2.shape) != (d, d_ff):
        raise ValueError(
            f"w2 must have shape (d, d_ff) = {(d, d_ff)} to match w1 {tuple(w1.shape)}, got {tuple(w2.shape)}"
        )
    if b2 is not None:
        check_tensor("b2", b2, ndim=1, dtypes=dtypes)
        if tuple(b2.shape) != (d,):
            raise ValueError(f"b2 must have shape ({d},), got {tuple(b2.shape)}")
    check_same_dtype(x=x, w2=w2, **({} if b2 is None else {"b2": b2}))
    check_same_device(x=x, w2=w2, b2=b2)
    check_activation(activation)
    return d, d_ff


def feed_forward_reference(x, w1, b1, w2, b2, *, activation="gelu"):
    """linear(gelu(linear(x, w1, b1)), w2, b2) (or relu) in PyTorch (fp64 too, for tests)."""
    check_feed_forward_args(x, w1, b1, w2, b2, activation, dtypes=REFERENCE_DTYPES)
    return F.linear(TORCH_ACTIVATIONS[activation](F.linear(x, w1, b1)), w2, b2)


def feed_forward(x, w1, b1, w2, b2, *, activation="gelu"):
    """The tutorial's FFN: linear(gelu(linear(x, w1, b1)), w2, b2), exact erf GELU.

    The first GEMM runs in Triton with the bias and GELU fused into its epilogue (`linear_gelu`);
    the second is a cuBLAS GEMM with bias. This is also the no-grad path: the fully fused
    `feed_forward_fused` is kept beside it, and becomes the no-grad path only for the shapes where
    the GPU benchmark (bench/, ffn_fwd, provider fastformer_fused) shows it wins (where that stands:
    docs/kernels.md).

    Args:
        x: (..., d); w1: (d_ff, d); b1: (d_ff,); w2: (d, d_ff); b2: (d,). nn.Linear layout.
        activation: "gelu" (exact erf, the tutorial's) or "relu".

    Returns:
        (..., d) in x's dtype.
    """
    if planning() and isinstance(x, torch.Tensor):
        args = x, w1, b1, w2, b2, activation, needs_grad(x, w1, b1)
        plan = kept(_plans, (signature(*args), switches(x)), _make_plan, *args)
        if plan is not None:
            if needs_grad(x, w1, b1, w2, b2):
                return _planned_feed_forward(x, w1, b1, w2, b2, plan)
            return F.linear(plan.run(x, w1, b1)[0], w2, b2)
    check_feed_forward_args(x, w1, b1, w2, b2, activation)
    x, w1, b1, w2, b2 = autocast_inputs(x, w1, b1, w2, b2)
    require_launchable("feed_forward", x, w1, b1, w2, b2)
    store_pre = needs_grad(x, w1, b1)
    keep_h = not store_pre and needs_grad(w2)  # else h is not needed, or its backward writes it again
    forward = _feed_forward_forward_eager if eager() else _feed_forward_forward_op
    out, _, _ = forward(rows_view(x), w1, b1, w2, b2, activation, store_pre, keep_h)
    return out.view(*x.shape[:-1], out.shape[-1])


def _feed_forward_forward(
    x2: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor | None, w2: torch.Tensor, b2: torch.Tensor | None,
    activation: str, store_pre: bool, keep_h: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The FFN's forward on (M, d) rows: out = act(x2 @ w1.T + b1) @ w2.T + b2 (linear_gelu's
    forward, then a cuBLAS product with bias), the pre-activation (M, d_ff) when store_pre (else
    (0, d_ff)) and the activation h when keep_h (else (0, d_ff)): what the backward reads."""
    h, pre = _linear_gelu_forward(x2, w1, b1, activation, store_pre)
    out = torch.mm(h, w2.t()) if b2 is None else torch.addmm(b2, h, w2.t())
    return out, pre, h if keep_h else h.new_empty(0, h.shape[1])


def _setup_context(ctx, inputs, output):
    x2, w1, _b1, w2, _b2, activation, _store_pre, keep_h = inputs
    _, pre, h = output
    ctx.save_for_backward(x2, w1, w2, pre, h)
    ctx.mark_non_differentiable(pre, h)  # saved for the backward, never differentiated
    ctx.set_materialize_grads(False)
    ctx.activation, ctx.keep_h = activation, keep_h


def _backward(ctx, dout, _dpre, _dh):
    """The gradients feed_forward's ordinary path takes: those of _PlannedFeedForward, by the
    registered ops where a dispatch mode, transform or torch.compile is over the backward."""
    if dout is None:
        return (None,) * 8
    x2, w1, w2, pre, h = ctx.saved_tensors
    needs_dx, needs_dw1, needs_db1, needs_dw2, needs_db2 = ctx.needs_input_grad[:5]
    dx = dw1 = db1 = None
    if needs_dx or needs_dw1 or needs_db1:
        if pre.numel() == 0 and x2.numel() != 0:
            raise RuntimeError(
                "feed_forward: backward through a forward run without gradients (no pre-activation saved)"
            )
        write_h = needs_dw2 and not ctx.keep_h
        if _ffn_backward_uses_cublas(dout, pre, ctx.activation, needs_db1, write_h):  # dH by cuBLAS, then the pass
            op, impl, args = _linear._activation_backward_op, _activation_backward, (torch.mm(dout, w2),)
        else:
            op, impl, args = _linear._ffn_activation_backward_op, _ffn_activation_backward, (dout, w2)
        dpre, db1, h_again = call_op(op, impl, *args, pre, ctx.activation, needs_db1, write_h)
        h = h_again if write_h else h
        dx = torch.mm(dpre, w1) if needs_dx else None
        dw1 = torch.mm(dpre.t(), x2) if needs_dw1 else None
    dw2 = torch.mm(dout.t(), h) if needs_dw2 else None
    db2 = dout.sum(0) if needs_db2 else None
    return dx, dw1, db1 if needs_db1 else None, dw2, db2, None, None, None


_feed_forward_forward_op = None  # the torch.library op, bound by defer_ops below
defer_ops(
    globals(), {"_feed_forward_forward_op": ("feed_forward_forward", _feed_forward_forward)},
    autograd=(_backward, _setup_context),
)
_feed_forward_forward_eager = eager_twin(_feed_forward_forward, _setup_context, _backward)


def _make_plan(x, w1, b1, w2, b2, activation, store_pre):
    """The plan of feed_forward's first product (kernels._runtime, Plans), or None: its checks
    passed. None also under autocast unless every tensor has its dtype: the ordinary path's
    F.linear casts the others, and records the casts for the backward."""
    check_feed_forward_args(x, w1, b1, w2, b2, activation)
    dtype = autocast_state(x)
    if dtype is not None and any(t is not None and t.dtype != dtype for t in (x, w1, b1, w2, b2)):
        return None
    return make_linear_gelu_plan(x, w1, b1, activation, store_pre, "feed_forward")


class _PlannedFeedForward(torch.autograd.Function):
    """linear(act(linear(x, w1, b1)), w2, b2) with a gradient, by the first product's plan (the
    pre-activation stored when x, w1 or b1 needs a gradient, and the activation recomputed from it
    for w2's gradient rather than kept) and a cuBLAS product with bias, as one autograd node: its
    backward computes what the second product's AddmmBackward and the first product's node would,
    the same products on the same layouts (so the same bits), where the engine would visit three
    nodes, two of them between Python and C++. The FFN's forward +
    backward cost 1.06x to 1.08x eager PyTorch's host time as two nodes and 0.96x to 0.98x as one
    (tools.host_overhead; docs/host-path.md). Each tensor is saved only where a gradient asked for
    needs it."""

    @staticmethod
    def forward(ctx, x, w1, b1, w2, b2, plan):
        h, pre = plan.run(x, w1, b1)  # h (..., d_ff) laid out as rows; pre (M, d_ff), or None
        rows = x.dim() == 2
        x2, h2 = (x, h) if rows else (x.view(plan.rows), h.view(plan.rows[0], -1))
        out = torch.mm(h2, w2.t()) if b2 is None else torch.addmm(b2, h2, w2.t())
        needs_dx, needs_dw1, needs_db1, needs_dw2 = ctx.needs_input_grad[:4]
        first = needs_dx or needs_dw1 or needs_db1  # a gradient through the first product
        # the activation h for dw2 is recomputed from pre where pre is kept (the activation gradient's
        # kernel writes it again, the same bits): one (M, d_ff) tensor held for the backward, not two
        keep_h = needs_dw2 and pre is None
        ctx.save_for_backward(
            x2 if needs_dw1 else None, w1 if needs_dx else None, w2 if first else None, pre, h2 if keep_h else None
        )
        ctx.plan, ctx.shape = plan, None if rows else x.shape
        ctx.set_materialize_grads(False)
        return out if rows else out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    @plain_backward
    def backward(ctx, dout):
        if dout is None:
            return (None,) * 6
        x2, w1, w2, pre, h2 = ctx.saved_tensors
        needs_dx, needs_dw1, needs_db1, needs_dw2, needs_db2 = ctx.needs_input_grad[:5]
        if ctx.shape is not None:
            dout = dout.reshape(-1, dout.shape[-1])
        dx = dw1 = db1 = None
        if needs_dx or needs_dw1 or needs_db1:
            dpre, db1, h = ctx.plan.ffn_activation_grad(dout, w2, pre, needs_db1, needs_dw2 and h2 is None)
            h2 = h if h2 is None else h2
            if needs_dx:
                dx = torch.mm(dpre, w1) if ctx.shape is None else torch.mm(dpre, w1).view(ctx.shape)
            if needs_dw1:
                dw1 = torch.mm(dpre.t(), x2)
        dw2 = torch.mm(dout.t(), h2) if needs_dw2 else None
        db2 = dout.sum(0) if needs_db2 else None
        return dx, dw1, db1 if needs_db1 else None, dw2, db2, None


_planned_feed_forward = autograd_apply(_PlannedFeedForward)


_plans = Plans("feed_forward")


def feed_forward_fused(x, w1, b1, w2, b2, *, activation="gelu"):
    """linear(act(linear(x, w1, b1)), w2, b2) in one Triton kernel, for inference: the (M, d_ff)
    activation stays on chip (see the module docstring). Same arguments and result as
    `feed_forward`, but no backward: inputs that require grad under grad mode raise ValueError."""
    check_feed_forward_args(x, w1, b1, w2, b2, activation)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, w1, b1, w2, b2)):
        raise ValueError("feed_forward_fused has no backward: call it under torch.no_grad(), or use feed_forward")
    x, w1, b1, w2, b2 = autocast_inputs(x, w1, b1, w2, b2)
    require_launchable("feed_forward_fused", x, w1, b1, w2, b2)
    y = _feed_forward_fused_op(rows_view(x), w1, b1, w2, b2, activation)
    return y.view(x.shape)
