"""Masked scaled-dot-product attention: the public op and its PyTorch reference.

Mask conventions (the tutorial's): boolean masks, True = masked. A query row whose keys are all
masked gets the tutorial's value, the mean of V over all Lk keys (its -1e9 fill makes the softmax
uniform), never NaN.
"""
import torch
import torch.nn.functional as F

from kernels._common import (
    check_dropout_p,
    check_same_device,
    check_same_dtype,
    check_tensor,
)

# The tutorial fills masked scores with -1e9; kept so fully masked rows average V uniformly.
MASKED_SCORE = -1e9


def check_attention_args(q, k, v, key_padding_mask, attn_mask, dropout_p, softmax_scale):
    """Validate the arguments of `attention`; returns (B, H, Lq, Lk, D)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t, ndim=4)
    check_same_dtype(q=q, k=k, v=v)
    B, H, Lq, D = q.shape
    if k.shape[:2] != (B, H) or v.shape[:2] != (B, H):
        raise ValueError(
            f"q, k and v must share batch and heads (B, H): got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if k.shape[3] != D or v.shape[3] != D:
        raise ValueError(
            f"q, k and v must share the head dim D: got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    Lk = k.shape[2]
    if v.shape[2] != Lk:
        raise ValueError(f"k and v must have the same length: got k {tuple(k.shape)}, v {tuple(v.shape)}")
    if key_padding_mask is not None:
        check_tensor("key_padding_mask", key_padding_mask, ndim=2, dtypes=(torch.bool,))
        if tuple(key_padding_mask.shape) != (B, Lk):
            raise ValueError(
                f"key_padding_mask must have shape (B, Lk) = {(B, Lk)}, got {tuple(key_padding_mask.shape)}"
            )
    if attn_mask is not None:
        check_tensor("attn_mask", attn_mask, dtypes=(torch.bool,))
        shape = tuple(attn_mask.shape)
        if shape not in ((B, Lq, Lk), (B, H, Lq, Lk), (B, 1, Lq, Lk)):
            raise ValueError(
                f"attn_mask must have shape (B, Lq, Lk) = {(B, Lq, Lk)} or (B, H, Lq, Lk) = {(B, H, Lq, Lk)}, "
                f"got {shape}"
            )
    check_same_device(q=q, k=k, v=v, key_padding_mask=key_padding_mask, attn_mask=attn_mask)
    check_dropout_p(dropout_p)
    if softmax_scale is not None and not (isinstance(softmax_scale, (int, float)) and softmax_scale > 0):
        raise ValueError(f"softmax_scale must be a positive number or None, got {softmax_scale!r}")
    return B, H, Lq, Lk, D


def dense_mask(Lq, Lk, device, key_padding_mask=None, causal=False, attn_mask=None):
    """All masks OR-ed into one boolean tensor that broadcasts to (B, H, Lq, Lk), or None."""
    mask = None
    if key_padding_mask is not None:
        mask = key_padding_mask[:, None, None, :]  # (B, 1, 1, Lk)
    if causal:
        # (1, 1, Lq, Lk): key j > query i
        future = torch.ones(Lq, Lk, dtype=torch.bool, device=device).triu(diagonal=1)[None, None]
        mask = future if mask is None else mask | future
    if attn_mask is not None:
        full = attn_mask if attn_mask.dim() == 4 else attn_mask[:, None]
        mask = full if mask is None else mask | full
    return mask


def attention_reference(
    q,
    k,
    v,
    *,
    key_padding_mask=None,
    causal=False,
    attn_mask=None,
    dropout_p=0.0,
    softmax_scale=None,
    return_probs=False,
):
    """The tutorial's attention in plain PyTorch: the oracle for the Triton kernel.

    Same signature and semantics as `attention`. Scores are masked with -1e9 and the softmax runs in
    fp32 (the -1e9 fill would overflow fp16); the probabilities are cast back to v's dtype for the
    product with V, as a kernel does.
    """
    B, H, Lq, Lk, D = check_attention_args(q, k, v, key_padding_mask, attn_mask, dropout_p, softmax_scale)
    scale = D**-0.5 if softmax_scale is None else softmax_scale
    # (B, H, Lq, Lk)
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    mask = dense_mask(Lq, Lk, q.device, key_padding_mask, causal, attn_mask)
    if mask is not None:
        scores = scores.masked_fill(mask, MASKED_SCORE)
    probs = torch.softmax(scores, dim=-1)
    if dropout_p > 0.0:
        probs = F.dropout(probs, p=dropout_p, training=True)
    probs = probs.to(v.dtype)
    # (B, H, Lq, D)
    out = torch.matmul(probs, v)
    return (out, probs) if return_probs else out


def attention(
    q,
    k,
    v,
    *,
    key_padding_mask=None,
    causal=False,
    attn_mask=None,
    dropout_p=0.0,
    softmax_scale=None,
    return_probs=False,
):
    """Masked scaled-dot-product attention, softmax(q k^T * scale + mask) v.

    Args:
        q: (B, H, Lq, D); k, v: (B, H, Lk, D). fp16, bf16 or fp32, one dtype, any strides.
        key_padding_mask: (B, Lk) bool, True = padding key, masked for every query.
        causal: mask key j > query i (top-left aligned, as the tutorial's decoder mask).
        attn_mask: (B, Lq, Lk) or (B, H, Lq, Lk) bool, True = masked. All masks combine by OR.
        dropout_p: dropout on the probabilities (pass 0.0 in eval).
        softmax_scale: defaults to D ** -0.5.
        return_probs: also return the probabilities that multiplied V (after dropout), (B, H, Lq, Lk).

    Returns:
        (B, H, Lq, D) in q's dtype, or (out, probs) when return_probs. A row whose keys are all
        masked is the mean of v over all Lk keys (the tutorial's -1e9 fill), never NaN.
    """
    return attention_reference(
        q,
        k,
        v,
        key_padding_mask=key_padding_mask,
        causal=causal,
        attn_mask=attn_mask,
        dropout_p=dropout_p,
        softmax_scale=softmax_scale,
        return_probs=return_probs,
    )
