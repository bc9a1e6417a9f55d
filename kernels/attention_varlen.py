"""Attention over packed sequences (FlashAttention-2's variable-length API), and its PyTorch reference.

Sequences of mixed lengths sit back to back as rows, q (total_q, H, D), k and v (total_k, H, D),
with no padding: sequence b's queries are the rows cu_seqlens_q[b] to cu_seqlens_q[b + 1], its keys
cu_seqlens_k's (int32 offsets, B + 1 of them, from 0 to the total). Each sequence attends to its own
keys only, causal within it where asked (top-left aligned, as `attention`: query i sees keys 0..i).
It runs the attention kernels of kernels/attention.py, their VARLEN path: a program finds its
sequence's rows and lengths from the offsets (attention._sequence), so blocks past a sequence's end
compute nothing, and no key is padding. The grid is sized by the longest lengths (max_seqlen_q,
max_seqlen_k), as FlashAttention-2's. Dropout is drawn as `attention` draws it for sequence b at
batch index b: the same seed drops the same probabilities as `attention` over the padded batch.

File order: the torch.library ops and their autograd, the checks, the public `attention_varlen`,
the reference.
"""

import itertools
import weakref

import torch

from ._checks import (
    FLOAT_DTYPES,
    REFERENCE_DTYPES,
    argument_check,
    check_same_device,
    check_same_dtype,
    check_softmax_scale,
    check_tensor,
)
from ._dropout import check_dropout_p, check_seed
from ._layout import last_dim_contiguous
from ._runtime import autocast_inputs, call_op, defer_ops, eager, eager_twin, warn_once
from .attention import (
    MAX_HEAD_DIM,
    _attn_forward,
    _backward_launches,
    _call_scalars,
    _launch_of,
    _masking,
    _on_real_tensors,
    _one_pass,
    _Packed,
    attention_reference,
)


# ----------------------------------------------------------------------------------------------
# The op, registered with torch.library so torch.compile(fullgraph=True) traces it without breaks.
# ----------------------------------------------------------------------------------------------
def _varlen_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool,
    dropout_p: float,
    softmax_scale: float,
    seed: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """o (total_q, H, D) and lse (B, H, max_seqlen_q), base 2, +inf for a query with no keys."""
    packed = _Packed(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    return _attn_forward(q, k, v, _masking(q, None, None, causal, dropout_p, softmax_scale), seed, packed)


def _varlen_backward(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    seed: torch.Tensor | None,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool,
    dropout_p: float,
    softmax_scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv, each (total, H, D) contiguous: the backward's launches (attention._backward_launches),
    in one pass or two as attention's rule says for the longest lengths."""
    masking = _masking(q, None, None, causal, dropout_p, softmax_scale)
    do = last_dim_contiguous(do)
    o = o.contiguous()  # the forward wrote it so; torch.compile may not keep it
    dq, dk, dv = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
    delta = torch.empty_like(lse)
    B, H, D = lse.shape[0], q.shape[1], q.shape[2]
    dq_sums = None
    if _one_pass(max_seqlen_q, max_seqlen_k, D, q.dtype) and _on_real_tensors(q):
        dq_sums = torch.empty(B, H, max_seqlen_q, D, dtype=torch.float32, device=q.device)
    packed = _Packed(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    for item in _backward_launches(do, q, k, v, o, lse, seed, dq, dk, dv, delta, masking, dq_sums, packed):
        _launch_of(*item)
    return dq, dk, dv


_varlen_forward_op = _varlen_backward_op = None  # the torch.library ops, bound by defer_ops below


def _setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, dropout_p, softmax_scale, seed = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, seed, cu_seqlens_q, cu_seqlens_k)
    ctx.lengths = max_seqlen_q, max_seqlen_k
    ctx.causal, ctx.dropout_p, ctx.softmax_scale = causal, dropout_p, softmax_scale
    ctx.mark_non_differentiable(lse)  # no zero gradient is made for it
    ctx.set_materialize_grads(False)


def _backward(ctx, do, _dlse):
    q, k, v, o, lse, seed, cu_seqlens_q, cu_seqlens_k = ctx.saved_tensors
    dq, dk, dv = call_op(
        _varlen_backward_op, _varlen_backward,
        do, q, k, v, o, lse, seed, cu_seqlens_q, cu_seqlens_k, *ctx.lengths, ctx.causal, ctx.dropout_p,
        ctx.softmax_scale,
    )  # fmt: skip
    return dq, dk, dv, *(None,) * 8


defer_ops(
    globals(),
    {
        "_varlen_forward_op": ("attention_varlen_forward", _varlen_forward),
        "_varlen_backward_op": ("attention_varlen_backward", _varlen_backward),
    },
    autograd=(_backward, _setup_context),
)
_varlen_forward_eager = eager_twin(_varlen_forward, _setup_context, _backward)


# ----------------------------------------------------------------------------------------------
# Checks
# ----------------------------------------------------------------------------------------------
def _is_int(n):
    return isinstance(n, int) and not isinstance(n, bool)


def _reads_values(t):
    """Whether the offsets' values may be read on the host: not while a CUDA graph is captured nor
    under torch.compile or a fake tensor, where the kernels' own bounds are all there is."""
    from torch._subclasses.fake_tensor import is_fake

    if torch.compiler.is_compiling() or is_fake(t):
        return False
    return not (t.is_cuda and torch.cuda.is_current_stream_capturing())


# the offsets tensors whose values passed _check_offsets: id -> (weak reference, version, rows, limit)
_checked = {}


def _check_offsets(name, cu, rows, longest, limit):
    """The offsets' values, read on the host (one copy): from 0 to `rows`, never falling, no
    sequence longer than `limit`. Once per tensor and contents: a tensor that passed for these rows
    and limit, unchanged since (its version counter), is not read again, so a loop over the same
    offsets pays the copy once."""
    seen = _checked.get(id(cu))
    if seen is not None and seen[0]() is cu and seen[1:] == (cu._version, rows, limit):
        return
    offsets = cu.tolist()
    lengths = [b - a for a, b in itertools.pairwise(offsets)]
    if offsets[0] != 0 or offsets[-1] != rows or min(lengths, default=0) < 0:
        raise ValueError(
            f"{name} must rise from 0 to its tensor's {rows} rows, never falling, got {offsets[:8]}"
            + (" ..." if len(offsets) > 8 else "")
        )
    if max(lengths, default=0) > limit:
        raise ValueError(f"{longest} is {limit}, but {name} holds a sequence of {max(lengths)}")
    if len(_checked) > 64:  # tensors long gone
        _checked.clear()
    _checked[id(cu)] = (weakref.ref(cu), cu._version, rows, limit)


@argument_check
def check_varlen_args(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, seed, causal,
    dtypes=FLOAT_DTYPES,
):  # fmt: skip
    """Validate the arguments of `attention_varlen`; returns (B, H, D). The offsets' values are read
    where _reads_values allows (_check_offsets, once per tensor and contents): each must start at
    0, never decrease, end at its tensor's rows, and no sequence may be longer than its max_seqlen,
    which the kernels' grid trusts (a longer one would lose rows, silently)."""
    if not isinstance(causal, bool):  # a string such as "no" would read as True
        raise TypeError(f"causal must be a bool, got {causal!r}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t, ndim=3, dtypes=dtypes)
    check_same_dtype(q=q, k=k, v=v)
    if k.shape != v.shape:
        raise ValueError(f"k and v must have one shape (total_k, H, D): got k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.shape[1:] != k.shape[1:]:
        raise ValueError(
            f"q, k and v must share heads and head dim (H, D): got q {tuple(q.shape)}, k {tuple(k.shape)}"
        )
    H, D = q.shape[1:]
    if H == 0 or D == 0:
        raise ValueError(f"attention_varlen needs heads and a head dim, got q {tuple(q.shape)}")
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        check_tensor(name, cu, ndim=1, dtypes=(torch.int32,))
        if cu.shape[0] < 1:
            raise ValueError(f"{name} must hold B + 1 offsets, at least the 0, got shape {tuple(cu.shape)}")
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must count the same sequences: got {cu_seqlens_q.shape[0]} "
            f"and {cu_seqlens_k.shape[0]} offsets"
        )
    for name, n in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if not _is_int(n) or n < 0:
            raise ValueError(f"{name} must be an int >= 0, got {n!r}")
    check_same_device(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    check_dropout_p(dropout_p)
    check_softmax_scale(softmax_scale)
    check_seed(seed, q.device)
    for name, cu, rows, longest, limit in (
        ("cu_seqlens_q", cu_seqlens_q, q.shape[0], "max_seqlen_q", max_seqlen_q),
        ("cu_seqlens_k", cu_seqlens_k, k.shape[0], "max_seqlen_k", max_seqlen_k),
    ):
        if _reads_values(cu):
            _check_offsets(name, cu, rows, longest, limit)
    return cu_seqlens_q.shape[0] - 1, H, D


# ----------------------------------------------------------------------------------------------
# The public op and its reference
# ----------------------------------------------------------------------------------------------
def attention_varlen(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=None,
    causal=False, *, seed=None,
):  # fmt: skip
    """Attention of packed sequences, each over its own keys: FlashAttention-2's
    `flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
    dropout_p, softmax_scale, causal)`, on fastformer's attention kernels.

    Args:
        q: (total_q, H, D); k, v: (total_k, H, D), the rows of every sequence back to back. fp16,
            bf16 or fp32, one dtype; any strides with a unit last dimension (views of a fused QKV
            projection's rows need no copy).
        cu_seqlens_q, cu_seqlens_k: (B + 1,) int32 on q's device, the offsets of each sequence's
            query and key rows: sequence b is rows cu[b] to cu[b + 1]. A sequence may have no
            queries or no keys (a query with no keys gets zeros).
        max_seqlen_q, max_seqlen_k: ints, at least the longest sequence's query and key counts
            (the grid is sized by them; checked against the offsets where they can be read).
        dropout_p: dropout on the probabilities, drawn in the kernel (Philox) from `seed`.
        softmax_scale: defaults to D ** -0.5.
        causal: query i of a sequence sees its keys 0 to i (top-left aligned, as `attention`).
        seed: the dropout seed, a one-element int64 tensor on q's device; None: drawn from torch's
            generator (one more launch). Sequence b gets the mask `attention` draws at batch index b
            from the same seed.

    Returns:
        (total_q, H, D) in q's dtype, contiguous. Head dims above 128 run the reference with a
        one-time warning. Under torch.autocast, fp32 inputs are cast to the autocast dtype.

    The offsets' values are checked on the host (one copy, once per offsets tensor while it is
    unchanged) except while a CUDA graph is captured and under torch.compile. The probabilities
    are not returned (the padded `attention` returns them).
    """
    check_varlen_args(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, seed, causal
    )
    return attention_packed(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, seed
    )


def attention_packed(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, seed
):  # fmt: skip
    """attention_varlen without its checks, for offsets its caller made and trusts: the model's
    packing (fastformer.packing), whose offsets come from the padding flags, so no copy of them is
    read back to check them (on CUDA, a host sync per offsets tensor)."""
    B, H, D = cu_seqlens_q.shape[0] - 1, q.shape[1], q.shape[2]
    q, k, v = autocast_inputs(q, k, v)
    # the kernels read the offsets as a unit-stride vector (CU + b): a strided view is copied
    lengths = cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous(), max_seqlen_q, max_seqlen_k
    if D > MAX_HEAD_DIM:
        warn_once(
            ("attention_varlen", "head_dim"),
            f"kernels.attention_varlen: head dim {D} > {MAX_HEAD_DIM} is not supported by the Triton "
            "kernel; running the PyTorch reference instead",
        )
        return attention_varlen_reference(q, k, v, *lengths, dropout_p, softmax_scale, causal, seed=seed)
    if q.shape[0] == 0 or max_seqlen_q == 0:  # no query rows: nothing to launch (zero gradients)
        return q * 0 + 0 * (k.sum() + v.sum())
    q, k, v = (last_dim_contiguous(t) for t in (q, k, v))
    rows = B * H * max_seqlen_q
    scale, seed = _call_scalars((q, k, v), rows, D, dropout_p, softmax_scale, seed)
    forward = _varlen_forward_eager if eager() else _varlen_forward_op
    out, _ = forward(q, k, v, *lengths, causal, float(dropout_p), scale, seed)
    return out


def attention_varlen_reference(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=None,
    causal=False, *, seed=None,
):  # fmt: skip
    """attention_varlen in plain PyTorch, sequence by sequence through attention_reference: same
    signature; also takes fp64, to serve as the tests' oracle. A query with no keys gets zeros.
    Dropout is torch's (attention_reference), so its mask is not the kernels' for the same seed."""
    check_varlen_args(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, seed, causal,
        dtypes=REFERENCE_DTYPES,
    )  # fmt: skip
    starts_q, starts_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    pieces = []
    for (q0, q1), (k0, k1) in zip(itertools.pairwise(starts_q), itertools.pairwise(starts_k)):
        if q1 == q0:
            continue
        if k1 == k0:  # no keys: zeros
            pieces.append(0 * q[q0:q1])
            continue
        heads = (t[a:b].transpose(0, 1)[None] for t, a, b in ((q, q0, q1), (k, k0, k1), (v, k0, k1)))
        out = attention_reference(
            *heads, causal=causal, dropout_p=dropout_p, softmax_scale=softmax_scale, seed=seed
        )
        pieces.append(out[0].transpose(0, 1))
    return torch.cat(pieces) if pieces else 0 * q
