"""Masked scaled-dot-product attention in Triton (FlashAttention-2), and its PyTorch reference.

Mask conventions (the tutorial's): boolean masks, True = masked. A masked key gets no weight; a
query row whose keys are all masked gets the tutorial's value, the mean of V over all Lk keys (its
-1e9 fill makes the softmax uniform), never NaN. The reference keeps the same rule (mask_scores):
the tutorial's fill would give the masked keys the weight of a row whose unmasked scores all lie
below -1e9 (docs/backends.md).

The kernels stream K/V blocks past a tile of queries with an online softmax in fp32 and never
write an (Lq, Lk) matrix. The forward saves the per-row log-sum-exp (base 2; +inf marks a row whose
keys are all masked); the backward recomputes the probabilities from it, in one kernel launched
in two passes (dQ per query block, then dK/dV per key block; the constexpr DQ_PASS picks the
pass's code, so each compiles to its own), so no atomics and bitwise-reproducible gradients; or,
where kernels/_backward_choice.py says (long sequences, or chosen), in one pass: the dK/dV pass
also adds each tile's part of dQ to fp32 sums by atomics (_attn_bwd_one_pass_kernel, between a
delta launch and a convert launch), 5 matrix products a tile where the two passes take 7.

A call is its kernels and nothing else on the device (the train step is launch-bound, see docs/launches.md):
the dQ pass computes delta = rowsum(dO * O) for its rows and hands it to dK/dV; each program
finds where its batch's padding starts by scanning the key-padding flags itself, and dK/dV finds
whether a (batch, head) has fully masked rows by scanning its lse, so no per-call bookkeeping runs
as separate ops; the lse is marked non-differentiable, so autograd makes no zero gradient for it.
The outputs o, dq, dk and dv are laid out as (B, L, H, D).

The same kernels take packed sequences, (total, H, D) rows without padding (constexpr VARLEN,
kernels/attention_varlen.py): each program reads its sequence's first row and lengths from the
offsets (_sequence) and works on them as on a padded batch's (batch, head).

Dropout is Philox keyed by a seed, a one-element int64 tensor on the device, which the backward
and the probabilities regenerate the mask from. It is an input of the op: the model draws the
seeds of a whole forward in one launch (`_dropout.draw_seeds`) and hands each call a view
`seeds[i:i + 1]`; without one, `attention` draws its own (`draw_seed`, one launch) before the op.

File order: kernels and their jit helpers, each kernel's candidate configs and rule, the launches
with their configs (`_attn_fwd`, the backward kernel's two, `_attn_bwd_dq` and `_attn_bwd_dkdv`,
and the one pass's `_attn_bwd_one_pass`), launchers (with `_Masking`, how a call masks, drops out and scales, built once
per op call), the torch.library ops, eager calls by plan (`_Plan`, `_PlannedAttention`: what a
signature of the arguments fixes, made once; kernels._runtime, Plans), the public `attention`,
and the PyTorch reference.

Why the kernels are shaped so for sm_90a (what the sm_90a compile check, python -m tools.sm90_report,
shows for each choice, per Triton version, is in docs/kernels.md):
- Dropout draws four keep decisions per Philox call (one per call costs so many registers that
  the forward's tiles spill), for a 2 x 2 square of scores, queries {m, m + 8} x keys {n, n + 8}
  (kernels._dropout.attention_keep): Hopper's MMA accumulator holds such a square in one thread,
  with queries or with keys as its rows, so each pass places the words by register moves. Four
  consecutive keys, as add + LayerNorm draws them, span two threads and went through shared memory.
- The softmax scale is folded into the exponent (`exp2(qk * qk_scale - m)`, one FFMA per score),
  and dropout's 1 / (1 - p) is applied once (to the forward's output rows, to dV after its loop)
  or as a product, never as a division per element: python -m tools.sass reads what each costs.
- Each loop runs its interior blocks with no mask (every key in bounds, before the batch's first
  padding key, at or below the tile's first query when causal: _query_key_range), a copy of its
  body with MASKED off (_fwd_step, _dq_step, _dkdv_step), and masks per element only the blocks at
  the edge: a bounds tail, the causal diagonal, a padding edge, and everything after a padding key
  that is not a suffix.
- The key-padding flags of the masked blocks are loaded one key block ahead in the forward and dQ loops
  (_next_key_block), and once per program in dK/dV (its key block is fixed), so no loop waits on them.
- A launch runs the first of its kernel's candidates that compiles without spills or shared-memory
  overflow for its flags and whose tiles are no longer than the sequence (the rules _fwd_fits,
  _dq_fits, _dkdv_fits, with _fits_lengths); autotuning, on request, times every candidate they keep.
- The head dim is a constexpr (HEAD_DIM), so the column mask of a head dim below its power-of-two
  block is known when compiling; and where every row stride is a multiple of 16 bytes but not of
  16 elements (head dim 72: rows 144 B apart), the launcher says so (ROW_ALIGN) and the kernels
  hint it (tl.multiple_of): without the hint Triton cannot prove the rows 16-byte aligned and
  compiles scalar loads, with which the tiles spill and the dot loops do not pipeline.
- Not done: D = 72, 80 or 96 run a 128-wide head block (tl.arange needs a power of two), so their
  dots pay for 128 columns.
"""
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ._backward_choice import attention_backward_choice
from ._checks import (
    FLOAT_DTYPES,
    REFERENCE_DTYPES,
    argument_check,
    check_same_device,
    check_same_dtype,
    check_softmax_scale,
    check_tensor,
)
from ._configs import Configs, fp32_launch, switches
from ._dropout import (
    attention_keep,
    attention_mask,
    check_dropout_p,
    check_dropout_rows,
    check_seed,
    draw_seed,
    load_seed,
    planned_seed,
)
from ._layout import last_dim_contiguous
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
    warn_once,
)
from ._tma import use_tma

# ----------------------------------------------------------------------------------------------
# Triton kernels. Scores live in base 2: s = q k^T * scale * log2(e), p = exp2(s - lse).
#
# Every kernel first offsets its pointers to its (batch, head) once: `q_bh`, `k_bh`, ... (_head_slice),
# `pad_b` (the batch's key-padding flags) and `mask_bh` (its dense mask), None when absent, so the
# helpers below take row offsets only. A jit helper cannot return None (kernels/_runtime.py, `launch`),
# so `pad_b` and `mask_bh` are offset in the kernels' bodies, under HAS_PAD and HAS_MASK.
# The forward and dQ loops step over key blocks with _next_key_block.
# ----------------------------------------------------------------------------------------------
LOG2E = 1.4426950408889634


@triton.jit
def _program_block(L, H, BLOCK: tl.constexpr, LAST_FIRST: tl.constexpr):
    """The (batch, head) of this program and the first row of its block of L rows (queries in the
    forward and dQ grids, keys in the dK/dV grid): (bh, b, h, start). Grids are cdiv(L, BLOCK) * B * H
    programs on one axis. LAST_FIRST: each (batch, head) takes its blocks last to first, so under a
    causal mask the longest query rows start first."""
    n_blocks = tl.cdiv(L, BLOCK)
    pid = tl.program_id(0)
    bh = pid // n_blocks
    block = pid % n_blocks
    if LAST_FIRST:
        block = n_blocks - 1 - block
    return bh, (bh // H).to(tl.int64), (bh % H).to(tl.int64), block * BLOCK


@triton.jit
def _sequence(CU, b, L, VARLEN: tl.constexpr):
    """Where batch b's rows lie, as (index, first, length). Padded (B, H, L, D) inputs: index b (the
    inputs' slices are index * their batch stride), first b * L (the first row of the outputs'
    (B * L, ...) rows, _interleaved), length L. VARLEN: sequence b of inputs packed as (total, H, D)
    rows (attention_varlen), rows CU[b] to CU[b + 1] (CU: the int32 offsets, cu_seqlens), the
    launcher passing the row stride as the batch stride: index and first CU[b], length
    CU[b + 1] - CU[b]."""
    if VARLEN:
        start = tl.load(CU + b)
        index = start.to(tl.int64)
        first = index
        length = tl.load(CU + b + 1) - start
    else:
        index = b
        first = b * L
        length = L
    return index, first, length


@triton.jit
def _head_slice(T, b, h, stride_b, stride_h, ROW_ALIGN: tl.constexpr):
    """The base pointer of T's (batch, head) slice. ROW_ALIGN: every stride of the tensors the
    kernel reads row by row is a multiple of it (_row_align), which Triton cannot see when one is
    not a multiple of 16 (head dim 72): with the hint its loads stay 16-byte vectors."""
    return T + tl.multiple_of(b * stride_b + h * stride_h, ROW_ALIGN)


@triton.jit
def _load_rows(base, offs, stride, n, offs_d, D, ROW_ALIGN: tl.constexpr = 1):
    """(len(offs), BLOCK_D) rows `offs` of an (n, D) matrix with row stride `stride` (a multiple of
    ROW_ALIGN) and unit column stride; zeros past n rows or D columns."""
    rows = tl.multiple_of(offs * stride, ROW_ALIGN)
    return tl.load(base + rows[:, None] + offs_d[None, :], mask=(offs[:, None] < n) & (offs_d[None, :] < D), other=0.0)


@triton.jit
def _load_block(base, offs, stride, offs_d, HEAD_DIM: tl.constexpr, ROW_ALIGN: tl.constexpr, BLOCK_D: tl.constexpr):
    """(len(offs), BLOCK_D) rows `offs` of a matrix, all known to be in bounds (an interior key
    block): masked past HEAD_DIM columns only, and not at all when HEAD_DIM is a power of two."""
    rows = tl.multiple_of(offs * stride, ROW_ALIGN)
    pointers = base + rows[:, None] + offs_d[None, :]
    if HEAD_DIM == BLOCK_D:
        return tl.load(pointers)
    return tl.load(pointers, mask=offs_d[None, :] < HEAD_DIM, other=0.0)


@triton.jit
def _rows_source(base, n, stride, HEAD_DIM: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
                 TMA: tl.constexpr):
    """What a kernel reads the (n, HEAD_DIM) rows at `base` (row stride `stride`, unit column
    stride) from: `base` itself, or (TMA) a tensor descriptor of them whose loads of BLOCK_ROWS rows
    read zeros past n rows and HEAD_DIM columns, as the masked pointer loads do (kernels/_tma.py)."""
    if TMA:  # (one return: Triton types every return of a function, whichever constexpr branch it is in)
        source = tl.make_tensor_descriptor(
            base, shape=[n, HEAD_DIM], strides=[stride, 1], block_shape=[BLOCK_ROWS, BLOCK_D]
        )
    else:
        source = base
    return source


@triton.jit
def _read_rows(
    source, start, stride, n, offs_d,
    MASKED: tl.constexpr, HEAD_DIM: tl.constexpr, ROW_ALIGN: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_ROWS: tl.constexpr, TMA: tl.constexpr,
):
    """(BLOCK_ROWS, BLOCK_D) rows start.. of a _rows_source, zeros past n rows and HEAD_DIM columns:
    one descriptor load (TMA), else pointer loads, which mask columns only where MASKED is off (an
    interior block, every row known to be in bounds: _load_block)."""
    if TMA:
        rows = source.load([start, 0])
    elif MASKED:
        rows = _load_rows(source, start + tl.arange(0, BLOCK_ROWS), stride, n, offs_d, HEAD_DIM, ROW_ALIGN)
    else:
        rows = _load_block(source, start + tl.arange(0, BLOCK_ROWS), stride, offs_d, HEAD_DIM, ROW_ALIGN, BLOCK_D)
    return rows


@triton.jit
def _read_columns(
    source, rows, start, stride, n, offs_d,
    MASKED: tl.constexpr, HEAD_DIM: tl.constexpr, ROW_ALIGN: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_ROWS: tl.constexpr, TMA: tl.constexpr,
):
    """The (BLOCK_D, BLOCK_ROWS) transpose of `rows`, the tile _read_rows read from `source`, for a
    second product that takes the tile the other way round (`x @ rows^T` beside `y @ rows`).

    For fp32 tiles (TF32 products) it is read from memory a second time, already transposed: wgmma
    takes 32-bit operands from shared memory only K-major, so one tile feeding two products in
    opposite orders cannot sit in shared memory in a single layout, and Triton then runs both
    products of the loop unpipelined (tools/results/sm90-compile-tf32.md, 2026-12-03). The second
    read comes from L2 and gives each product its own pipelined tile. 16-bit tiles, and TMA's
    descriptor loads, take tl.trans of the tile they have."""
    if TMA or rows.dtype != tl.float32:
        columns = tl.trans(rows)
    else:
        offs = start + tl.arange(0, BLOCK_ROWS)
        pointers = source + tl.multiple_of(offs * stride, ROW_ALIGN)[None, :] + offs_d[:, None]
        if MASKED:
            columns = tl.load(pointers, mask=(offs[None, :] < n) & (offs_d[:, None] < HEAD_DIM), other=0.0)
        elif HEAD_DIM == BLOCK_D:
            columns = tl.load(pointers)
        else:
            columns = tl.load(pointers, mask=offs_d[:, None] < HEAD_DIM, other=0.0)
    return columns


@triton.jit
def _store_rows(base, offs, stride, n, offs_d, D, value):
    mask = (offs[:, None] < n) & (offs_d[None, :] < D)
    tl.store(base + offs[:, None] * stride + offs_d[None, :], value.to(base.dtype.element_ty), mask=mask)


@triton.jit
def _interleaved(T, first, h, D, row):
    """The (batch, head) slice of a (B, H, L, D) tensor laid out as (B, L, row) rows with the heads
    side by side, each D wide (row = H * D: (B, L, H, D) contiguous, the layout of o, dq, dk and dv
    that _interleaved_empty makes; 3 * H * D: dq, dk and dv as views of one fused QKV projection's
    gradient), or of packed (total, H, D) rows: its base pointer. `first`: the slice's first row
    (_sequence: b * L, or a packed sequence's first row). Its rows are `row` apart."""
    return T + first * row + h * D


@triton.jit
def _key_padding(pad_b, stride_pn, offs_n, Lk, HAS_PAD: tl.constexpr):
    """The key-padding flags of one key block, read from the bool mask as it is (True = padding;
    keys past Lk count as padding), all False when the call has no padding mask."""
    flags = tl.zeros(offs_n.shape, dtype=tl.int1)
    if HAS_PAD:
        flags = tl.load(pad_b + offs_n * stride_pn, mask=offs_n < Lk, other=True)
    return flags


@triton.jit
def _next_key_block(pad_b, stride_pn, start_n, pad_next, Lk, HAS_PAD: tl.constexpr, BLOCK_N: tl.constexpr):
    """One step of a loop over key blocks: the offsets of block start_n.., its padding flags (loaded
    the step before, so this small load is not waited on) and the next block's flags."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    return offs_n, pad_next, _key_padding(pad_b, stride_pn, offs_n + BLOCK_N, Lk, HAS_PAD)


@triton.jit
def _has_masked_row(lse_bh, Lq, SCAN: tl.constexpr = 512):
    """Whether any query row of this (batch, head) has all its keys masked (lse = +inf)."""
    found = tl.zeros([SCAN], dtype=tl.int32)
    for start in range(0, Lq, SCAN):
        offs = start + tl.arange(0, SCAN)
        lse = tl.load(lse_bh + offs, mask=offs < Lq, other=0.0)
        found = tl.maximum(found, (lse == float("inf")).to(tl.int32))
    return tl.max(found, 0) > 0


@triton.jit
def _tile_valid(
    offs_m, offs_n, pad, Lq, Lk, mask_bh, stride_mm, stride_mn,
    HAS_PAD: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, KEYS_FIRST: tl.constexpr = False,
):
    """(BLOCK_M, BLOCK_N) True where query offs_m may attend to key offs_n; (BLOCK_N, BLOCK_M),
    the transpose, when KEYS_FIRST. `pad` is the key block's padding flags (_key_padding)."""
    if KEYS_FIRST:
        queries = offs_m[None, :]
        keys = offs_n[:, None]
        pad_keys = pad[:, None]
    else:
        queries = offs_m[:, None]
        keys = offs_n[None, :]
        pad_keys = pad[None, :]
    in_bounds = (queries < Lq) & (keys < Lk)
    valid = in_bounds
    if HAS_PAD:
        valid = valid & (pad_keys == 0)
    if IS_CAUSAL:
        valid = valid & (keys <= queries)
    if HAS_MASK:
        dense = tl.load(mask_bh + queries * stride_mm + keys * stride_mn, mask=in_bounds, other=True)
        valid = valid & (dense == 0)
    return valid


@triton.jit
def _scores(
    q, k, offs_m, offs_n, pad, Lq, Lk, mask_bh, stride_mm, stride_mn, qk_scale,
    HAS_PAD: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """The (BLOCK_M, BLOCK_N) scores q k^T * qk_scale (base 2) of a query and a key block, and
    where they are valid."""
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION, out_dtype=tl.float32) * qk_scale
    valid = _tile_valid(offs_m, offs_n, pad, Lq, Lk, mask_bh, stride_mm, stride_mn, HAS_PAD, IS_CAUSAL, HAS_MASK)
    return s, valid


@triton.jit
def _padding_bounds(pad_b, stride_pn, Lk, SCAN: tl.constexpr = 512):
    """(first, end) of the batch's key padding: its first padding key (Lk when none) and one past
    its last key that is not padding (0 when all are). One scan of Lk / SCAN loads per program."""
    first = tl.zeros([SCAN], dtype=tl.int32) + Lk
    last = tl.zeros([SCAN], dtype=tl.int32)
    for start in range(0, Lk, SCAN):
        offs = start + tl.arange(0, SCAN)
        flags = tl.load(pad_b + offs * stride_pn, mask=offs < Lk, other=True)
        first = tl.minimum(first, tl.where(flags != 0, offs, Lk))
        last = tl.maximum(last, tl.where(flags == 0, offs + 1, 0))
    return tl.min(first, 0), tl.max(last, 0)


@triton.jit
def _query_key_range(
    pad_b, stride_pn, Lk, start_m,
    HAS_PAD: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """The key blocks the query block start_m.. loops over, as (clean_end, end_n): keys from end_n
    on are never loaded (trailing padding, keys above the diagonal), and the whole key blocks before
    clean_end need no mask at all (every key in bounds, before the batch's first padding key, at or
    below the block's first query under a causal mask). The blocks from clean_end to end_n are
    masked per element: a bounds tail, the causal diagonal, a padding edge.

    No interior run (clean_end 0) with a dense mask, which may mask any score, nor at head dims
    above 64 with dropout or key padding, where a second copy of the loop body spills registers on
    Triton 3.9 (python -m tools.sm90_report); the dK/dV pass follows the same condition."""
    end_n = Lk
    clean = Lk
    if HAS_PAD:
        clean, end_n = _padding_bounds(pad_b, stride_pn, Lk)
    if IS_CAUSAL:
        end_n = tl.minimum(end_n, start_m + BLOCK_M)
        clean = tl.minimum(clean, start_m + 1)
    if HAS_MASK or (BLOCK_D > 64 and (HAS_DROPOUT or HAS_PAD)):  # no interior run
        clean = 0
    return (clean // BLOCK_N) * BLOCK_N, end_n


@triton.jit
def _masked_rows_value(
    v_bh, stride_vn, start_m, offs_d, seed, bh, Lq, Lk, D, dropout_p,
    HAS_DROPOUT: tl.constexpr, DOT_PRECISION: tl.constexpr, ROW_ALIGN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """The tutorial's output for a row whose keys are all masked: uniform 1/Lk over every key
    (after dropout, as the tutorial applies it), times V. The rare, slower path."""
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for start_n in range(0, Lk, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        p = tl.where(offs_n[None, :] < Lk, 1.0 / Lk, 0.0) + tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        if HAS_DROPOUT:
            keep = attention_keep(seed, bh, start_m, start_n, dropout_p, BLOCK_M, BLOCK_N, False)
            p = tl.where(keep, p / (1.0 - dropout_p), 0.0)
        v = _load_rows(v_bh, offs_n, stride_vn, Lk, offs_d, D, ROW_ALIGN)
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION, out_dtype=tl.float32)
    return acc


@triton.jit
def _fwd_step(
    acc, l_i, m_i, start_n, pad,
    q, k_src, v_src, stride_kn, stride_vn, start_m, offs_d, Lq, Lk, mask_bh, stride_mm, stride_mn,
    seed, bh, qk_scale, dropout_p,
    MASKED: tl.constexpr, HAS_PAD: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, DOT_PRECISION: tl.constexpr, HEAD_DIM: tl.constexpr, ROW_ALIGN: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TMA: tl.constexpr,
):
    """The forward's online softmax over the key block start_n..: returns acc, l_i and m_i updated.
    MASKED: the block may hold masked scores (`pad`: its padding flags); otherwise it is an interior
    block (_query_key_range), whose keys are all in bounds and visible to every query of the tile:
    no flags, no bounds and no selects. k_src and v_src are _rows_source's."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    k = _read_rows(k_src, start_n, stride_kn, Lk, offs_d, MASKED, HEAD_DIM, ROW_ALIGN, BLOCK_D, BLOCK_N, TMA)
    # (BLOCK_M, BLOCK_N) unscaled scores: the scale is folded into the exponent below
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION, out_dtype=tl.float32)
    if MASKED:
        offs_m = start_m + tl.arange(0, BLOCK_M)
        valid = _tile_valid(offs_m, offs_n, pad, Lq, Lk, mask_bh, stride_mm, stride_mn, HAS_PAD, IS_CAUSAL, HAS_MASK)
        qk = tl.where(valid, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)  # qk_scale > 0: the max of the scaled scores
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no valid key yet
    else:
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        m_safe = m_new  # every score is valid, so finite
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(qk * qk_scale - m_safe[:, None])  # one FFMA per score
    l_i = l_i * alpha + tl.sum(p, 1)
    if HAS_DROPOUT:  # the kept probabilities; 1 / (1 - p) scales the output once, after the loop
        p = tl.where(attention_keep(seed, bh, start_m, start_n, dropout_p, BLOCK_M, BLOCK_N, False), p, 0.0)
    v = _read_rows(v_src, start_n, stride_vn, Lk, offs_d, MASKED, HEAD_DIM, ROW_ALIGN, BLOCK_D, BLOCK_N, TMA)
    # rescale first, then let the dot accumulate in place (wgmma keeps acc in registers)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION, out_dtype=tl.float32)
    return acc, l_i, m_new


@triton.jit
def _dq_step(
    dq, start_n, pad,
    q, do, lse, delta, k_src, v_src, stride_kn, stride_vn, start_m, offs_d, Lq, Lk,
    mask_bh, stride_mm, stride_mn, seed, bh, qk_scale, dropout_p,
    MASKED: tl.constexpr, HAS_PAD: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, DOT_PRECISION: tl.constexpr, HEAD_DIM: tl.constexpr, ROW_ALIGN: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TMA: tl.constexpr,
):
    """The dQ pass over the key block start_n..: returns dq with the block's part added. MASKED as
    in _fwd_step. With dropout, delta is the rows' delta times 1 - p, and dq comes out 1 - p times
    the gradient: dS = P (keep dP / (1 - p) - delta) = P (keep dP - (1 - p) delta) / (1 - p), so
    the pass scales dq once, after its loop, not dP per element."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    if HAS_DROPOUT:  # drawn first: fewer registers live across the dots (python -m tools.sm90_report)
        keep = attention_keep(seed, bh, start_m, start_n, dropout_p, BLOCK_M, BLOCK_N, False)
    k = _read_rows(k_src, start_n, stride_kn, Lk, offs_d, MASKED, HEAD_DIM, ROW_ALIGN, BLOCK_D, BLOCK_N, TMA)
    v = _read_rows(v_src, start_n, stride_vn, Lk, offs_d, MASKED, HEAD_DIM, ROW_ALIGN, BLOCK_D, BLOCK_N, TMA)
    kt = _read_columns(k_src, k, start_n, stride_kn, Lk, offs_d, MASKED, HEAD_DIM, ROW_ALIGN, BLOCK_D, BLOCK_N, TMA)
    qk = tl.dot(q, kt, input_precision=DOT_PRECISION, out_dtype=tl.float32)
    p = tl.exp2(qk * qk_scale - lse[:, None])  # the scale in one FFMA per score
    if MASKED:
        offs_m = start_m + tl.arange(0, BLOCK_M)
        valid = _tile_valid(offs_m, offs_n, pad, Lq, Lk, mask_bh, stride_mm, stride_mn, HAS_PAD, IS_CAUSAL, HAS_MASK)
        p = tl.where(valid, p, 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION, out_dtype=tl.float32)
    if HAS_DROPOUT:
        dp = tl.where(keep, dp, 0.0)
    ds = p * (dp - delta[:, None])
    return tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION, out_dtype=tl.float32)


@triton.jit
def _dkdv_step(
    dk, dv, m, k, v, offs_n, pad, q_src, do_src, stride_qm, stride_dom, offs_d, lse_bh, delta_bh, dq_bh,
    Lq, Lk, mask_bh, stride_mm, stride_mn, seed, bh, start_n, qk_scale, dropout_p,
    MASKED: tl.constexpr, HAS_PAD: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, DOT_PRECISION: tl.constexpr, HEAD_DIM: tl.constexpr, ROW_ALIGN: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TMA: tl.constexpr,
    ACCUMULATE_DQ: tl.constexpr,
):
    """The dK/dV pass over the query block m..: returns dk and dv with the block's part added.
    MASKED: the tile may hold masked scores (`pad`: the key block's padding flags); otherwise every
    query of the block is in bounds and sees every key of the key block. lse_bh and delta_bh: the
    (batch, head)'s rows of LSE and DELTA. With dropout, dk and dv
    come out 1 - p times their gradients (as dq in _dq_step): scaled once, after the loop.
    ACCUMULATE_DQ (the one-pass backward): the tile's part of dQ, dS K, a fifth product, is added
    to the block's rows of the fp32 sums at dq_bh ((Lq, HEAD_DIM) contiguous), 1 - p times it
    with dropout as dk; otherwise dq_bh is None."""
    offs_m = m + tl.arange(0, BLOCK_M)
    if HAS_DROPOUT:
        keep = attention_keep(seed, bh, m, start_n, dropout_p, BLOCK_M, BLOCK_N, True)  # (BLOCK_N, BLOCK_M)
    q = _read_rows(q_src, m, stride_qm, Lq, offs_d, MASKED, HEAD_DIM, ROW_ALIGN, BLOCK_D, BLOCK_M, TMA)
    do = _read_rows(do_src, m, stride_dom, Lq, offs_d, MASKED, HEAD_DIM, ROW_ALIGN, BLOCK_D, BLOCK_M, TMA)
    if MASKED:
        lse = tl.load(lse_bh + offs_m, mask=offs_m < Lq, other=float("inf"))
        delta = tl.load(delta_bh + offs_m, mask=offs_m < Lq, other=0.0)
    else:
        lse = tl.load(lse_bh + offs_m)
        delta = tl.load(delta_bh + offs_m)
    # (BLOCK_N, BLOCK_M)
    qt = _read_columns(q_src, q, m, stride_qm, Lq, offs_d, MASKED, HEAD_DIM, ROW_ALIGN, BLOCK_D, BLOCK_M, TMA)
    st = tl.dot(k, qt, input_precision=DOT_PRECISION, out_dtype=tl.float32)
    pt = tl.exp2(st * qk_scale - lse[None, :])  # the scale in one FFMA per score
    if MASKED:
        valid = _tile_valid(
            offs_m, offs_n, pad, Lq, Lk, mask_bh, stride_mm, stride_mn, HAS_PAD, IS_CAUSAL, HAS_MASK, KEYS_FIRST=True
        )
        pt = tl.where(valid, pt, 0.0)
    do_t = _read_columns(do_src, do, m, stride_dom, Lq, offs_d, MASKED, HEAD_DIM, ROW_ALIGN, BLOCK_D, BLOCK_M, TMA)
    dpt = tl.dot(v, do_t, input_precision=DOT_PRECISION, out_dtype=tl.float32)
    if HAS_DROPOUT:  # dS^T = P^T (keep dP^T - (1 - p) delta): the kept P^T times dP^T, one select
        pt_kept = tl.where(keep, pt, 0.0)
        dst = pt_kept * dpt - pt * (delta * (1.0 - dropout_p))[None, :]
    else:
        pt_kept = pt
        dst = pt * (dpt - delta[None, :])
    dv = tl.dot(pt_kept.to(do.dtype), do, dv, input_precision=DOT_PRECISION, out_dtype=tl.float32)
    dk = tl.dot(dst.to(q.dtype), q, dk, input_precision=DOT_PRECISION, out_dtype=tl.float32)
    if ACCUMULATE_DQ:  # (BLOCK_M, BLOCK_D): relaxed atomics, the sums' order left to the hardware
        dq = tl.dot(tl.trans(dst.to(k.dtype)), k, input_precision=DOT_PRECISION, out_dtype=tl.float32)
        pointers = dq_bh + offs_m[:, None] * HEAD_DIM + offs_d[None, :]
        if MASKED:
            tl.atomic_add(pointers, dq, mask=(offs_m[:, None] < Lq) & (offs_d[None, :] < HEAD_DIM), sem="relaxed")
        elif HEAD_DIM == BLOCK_D:
            tl.atomic_add(pointers, dq, sem="relaxed")
        else:
            tl.atomic_add(pointers, dq, mask=offs_d[None, :] < HEAD_DIM, sem="relaxed")
    return dk, dv


# Each kernel's tiles, in the order its rule prefers them (the first that fits the launch runs;
# autotuning tries all that fit), each in _STAGES, in that order.
# (BLOCK_M, BLOCK_N, num_warps): 4 warps (one warp group) per 64 query rows; last, for autotuning
# and the sweep to time (the rule's picks come first), 128 rows in one warp group, two CTAs an SM
# where each has half an SM's registers (_one_warp_group_fits)
_FWD_TILES = [(128, 128, 8), (128, 64, 8), (64, 64, 4), (128, 32, 8), (64, 32, 4), (128, 64, 4), (128, 32, 4)]
# (BLOCK_M, BLOCK_N, num_warps): the tiles are keys x queries, so wgmma's 64-row minimum falls on
# BLOCK_N; 8 warps hold the two (BLOCK_N, BLOCK_D) fp32 accumulators without spilling (4 warps mostly
# spill). 64 x 128 first: a step's fixed costs spread over twice the MMA work of 32 x 128 (0.64 /kF
# against 0.85 unmasked at D64, python -m tools.sass), where it fits (_dkdv_fits: no padding, dropout
# or dense mask). 64 x 64 in one warp group where it fits (with dropout, as the model trains at its
# lengths): at L64 it costs the model's call 167 SM clocks per 1,000 scores, where 8 warps cost 344.
# Last, for autotuning and the sweep: 32 x 64 in one warp group (_one_warp_group_fits).
_DKDV_TILES = [(64, 128, 8), (32, 128, 8), (64, 64, 4), (64, 64, 8), (32, 64, 8), (32, 64, 4)]
# (BLOCK_M, BLOCK_N, num_warps): query rows are wgmma's rows, so BLOCK_M >= 64
_DQ_TILES = [(128, 64, 8), (64, 64, 4), (64, 32, 4), (64, 128, 8)]
_STAGES = (3, 2)


def _candidates(tiles):
    return [({"BLOCK_M": bm, "BLOCK_N": bn}, w, s) for bm, bn, w in tiles for s in _STAGES]


def _fits_lengths(meta, launch, tiles):
    """A tile longer than the sequence (rounded up to a power of two) computes only padding: such
    configs are neither picked nor tried when autotuning. The kernel's smallest tile always fits."""
    min_m = min(bm for bm, _, _ in tiles)
    min_n = min(bn for _, bn, _ in tiles)
    return meta["BLOCK_M"] <= max(min_m, launch["LQ_BUCKET"]) and meta["BLOCK_N"] <= max(min_n, launch["LK_BUCKET"])


def _one_warp_group_fits(meta, num_stages, launch):
    """Where the candidates in one warp group compile clean for sm_90a on Triton 3.9 and 3.6, with
    every mask, with and without dropout, through pointers and descriptors, in 2 and 3 stages
    (python -m tools.sm90_report --candidates; tools/results/sm90-candidates*.md): the forward's
    128 x 32 and dK/dV's 32 x 64 at head dims up to 64, the forward's 128 x 64 up to 32 without
    dropout. At 128 they spill (Triton 3.9: the forward's 128 x 32 32 to 1,196 B of stores a
    thread, dK/dV's 4 to 16 B with padding or a dense mask), 128 x 64 at 64 too (12 to 400 B) and
    with dropout at 32 (12 to 64 B); the forward's 128 x 32 in 3 stages with a dense mask and
    dropout at 64 spills 4 B on Triton 3.6. Not fp32: TF32 products in one warp group are untried."""
    if fp32_launch(launch, "Q") or launch["BLOCK_D"] > 64:
        return False
    if (meta["BLOCK_M"], meta["BLOCK_N"]) == (128, 64):
        return launch["BLOCK_D"] <= 32 and not launch["HAS_DROPOUT"]
    if (meta["BLOCK_M"], meta["BLOCK_N"]) == (128, 32) and launch["BLOCK_D"] == 64 and num_stages == 3:
        return not (launch["HAS_MASK"] and launch["HAS_DROPOUT"])
    return True


def _fwd_fits(meta, num_warps, num_stages, launch):
    """What compiles for sm_90a without spills on Triton 3.9 and 3.6 (python -m tools.sm90_report;
    the figures are in docs/kernels.md). Dropout draws four keep decisions per Philox call
    (kernels._dropout.attention_keep) and still costs registers: with it, key blocks of at most 64.
    The 128 x 128 tile at head dim 64 is at the register limit: with two kinds of mask it spills
    (padding and causal, on 3.6), so it takes one kind of mask at most. At head dim 128 (72 to 128)
    the 128 x 128 tile spills and overflows shared memory, 64 x 64 spills (in 3 stages; with
    dropout; in the full matrix, in 2 stages at head dims 72 and 80 with Lq != Lk), and 128 x 64
    with dropout spills in 2 stages.

    fp32 (TF32 products: python -m tools.sm90_report --tf32, tools/results/sm90-compile-tf32*.md)
    takes 2 stages only (in 3, 128 x 64 overflows shared memory at head dim 128 and spills at 64,
    64 x 64 and 64 x 32 spill); at head dims above 32 not 128 x 128 (it spills at 64 with key
    padding); at 64 with dropout not 64 x 64 (24 B on Triton 3.9); at 128 (72 to 128) 128 x 32,
    and 64 x 32 without dropout or for queries that fit in 64 rows (on Triton 3.9, 128 x 64 spills
    80 B, and 64 x 32 with dropout 28 B: kept where 128 rows would compute padding only)."""
    if not _fits_lengths(meta, launch, _FWD_TILES):
        return False
    if meta["BLOCK_M"] == 128 and num_warps == 4:  # the sweep's candidates
        return _one_warp_group_fits(meta, num_stages, launch)
    tile, dropout = (meta["BLOCK_M"], meta["BLOCK_N"]), launch["HAS_DROPOUT"]
    if fp32_launch(launch, "Q"):
        block_d = launch["BLOCK_D"]
        if num_stages != 2 or (block_d > 32 and tile == (128, 128)) or (block_d == 64 and dropout and tile == (64, 64)):
            return False
        if block_d == 128 and tile != (128, 32):
            return tile == (64, 32) and (not dropout or launch["LQ_BUCKET"] <= 64)
    if dropout and meta["BLOCK_N"] > 64:
        return False
    masks = launch["HAS_PAD"] + launch["IS_CAUSAL"] + launch["HAS_MASK"]
    if tile == (128, 128) and launch["BLOCK_D"] == 64 and masks > 1:
        return False
    if launch["BLOCK_D"] == 128:
        if tile == (128, 128):
            return False
        if tile == (64, 64):
            return False
        if tile == (128, 64) and dropout:
            return num_stages == 3
    return True


_KEY = [
    "HEAD_DIM", "ROW_ALIGN", "BLOCK_D", "LQ_BUCKET", "LK_BUCKET",
    "IS_CAUSAL", "HAS_PAD", "HAS_MASK", "HAS_DROPOUT", "DOT_PRECISION", "TMA",
]
# Whether the passes load their Q, K, V and dO tiles through tensor descriptors where TMA can
# serve (kernels/_tma.py; set_tma or FASTFORMER_TMA choose otherwise): not until a GPU has timed
# both (python -m tools.sweep), so pointer loads, the kernels the benchmarks have measured.
PREFERS_TMA = False
# The buckets only key the configs: specialized, a bucket below 16 (and one of 1) would compile
# anew. The lengths stay specialized: knowing that Lq or Lk is a multiple of 16 keeps the masks
# of 16 rows or keys one predicate, which the kernels' tightest tiles need to fit their registers.
_UNSPECIALIZED = ["LQ_BUCKET", "LK_BUCKET"]


@triton.jit(do_not_specialize=_UNSPECIALIZED)
def _attn_fwd_kernel(
    Q, K, V, O, LSE, SEED,
    PAD, stride_pb, stride_pn, MASK, stride_mb, stride_mh, stride_mm, stride_mn,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    H, Lq, Lk, qk_scale, dropout_p,
    LQ_BUCKET, LK_BUCKET,  # config keys only
    CU_Q, CU_K,
    HAS_PAD: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    DOT_PRECISION: tl.constexpr, HEAD_DIM: tl.constexpr, ROW_ALIGN: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TMA: tl.constexpr,
    VARLEN: tl.constexpr,
):
    """The forward of one query block of one (batch, head): O = softmax(masked Q K^T * scale) V with
    an online softmax in fp32, over the key blocks the block can see, and each row's log-sum-exp.
    Grid: cdiv(Lq, BLOCK_M) * B * H programs on one axis (_program_block). Launched by _attn_forward.

    Args:
        Q: (B, H, Lq, D) queries, fp16, bf16 or fp32; any strides with a unit last one.
        K, V: (B, H, Lk, D) keys and values in Q's dtype; any strides with a unit last one.
        O: (B, H, Lq, D) output in Q's dtype, laid out as (B, Lq, H, D) contiguous (_interleaved).
        LSE: (B, H, Lq) fp32, contiguous, output: each row's log-sum-exp in base 2, +inf for a row
            whose keys are all masked.
        SEED: (1,) int64 dropout seed; None when HAS_DROPOUT is off.
        PAD: (B, Lk) bool key-padding mask, True = padding; None when HAS_PAD is off.
        stride_pb, stride_pn: PAD's strides in elements (batch, key); 0 when absent.
        MASK: (B, H or 1, Lq, Lk) bool dense mask, True = masked (a (B, Lq, Lk) mask viewed with a head
            dim); None when HAS_MASK is off.
        stride_mb, stride_mh, stride_mm, stride_mn: MASK's strides in elements (batch, head, query, key);
            stride_mh is 0 for a mask shared by the heads, all are 0 when absent.
        stride_qb, stride_qh, stride_qm: Q's strides in elements (batch, head, row).
        stride_kb, stride_kh, stride_kn: K's strides in elements (batch, head, row).
        stride_vb, stride_vh, stride_vn: V's strides in elements (batch, head, row).
        H: heads (the grid flattens batch and head into one axis).
        Lq, Lk: query and key lengths.
        qk_scale: softmax_scale * log2(e): the scores are computed in base 2.
        dropout_p: the dropout probability, in [0, 1); read only under HAS_DROPOUT.
        LQ_BUCKET, LK_BUCKET: next_power_of_2 of Lq and of Lk: keys of the config choice only, unused
            by the code and not specialized.
        CU_Q, CU_K: with VARLEN, (B + 1,) int32 offsets of the packed sequences' query and key rows
            (cu_seqlens); None otherwise.
        HAS_PAD: PAD is read: keys flagged True are masked, and key blocks past the batch's last real key skipped.
        IS_CAUSAL: key j > query i is masked (top-left aligned), and key blocks above the diagonal skipped.
        HAS_MASK: MASK is read: the general, slower path.
        HAS_DROPOUT: SEED and dropout_p are read: probabilities dropped with Philox (attention_keep).
        DOT_PRECISION: tl.dot's input_precision, "ieee" or "tf32" (dot_precision; it matters for fp32 only).
        HEAD_DIM: D, a constexpr so that the mask of the columns past D is known when compiling.
        ROW_ALIGN: every (batch, head, row) stride of Q, K and V is a multiple of it (_row_align: the
            elements in 16 bytes, else 1), hinted with tl.multiple_of.
        BLOCK_D: the head block, D padded to a power of two of at least 16 (_head_block).
        BLOCK_M: query rows per program.
        BLOCK_N: keys per step of the loop over key blocks.
        TMA: Q, K and V tiles load through tensor descriptors made per program (kernels/_tma.py:
            16-byte aligned bases and row strides), else through pointers.
        VARLEN: Q, K, V and O are packed sequences, (total, H, D) rows (attention_varlen): sequence
            b's rows are CU_Q[b].. and CU_K[b].. (_sequence), the batch strides are the row strides,
            Lq and Lk are the longest lengths (LSE is (B, H, Lq) all the same); no PAD nor MASK. A
            query with no keys gets zeros (and lse +inf).
    """
    # torch.compile's Inductor passes a Python float as fp64, a launch as fp32: one type for both
    qk_scale, dropout_p = tl.cast(qk_scale, tl.float32), tl.cast(dropout_p, tl.float32)
    bh, b, h, start_m = _program_block(Lq, H, BLOCK_M, LAST_FIRST=True)
    lse_bh = LSE + bh * Lq
    bq, first_q, Lq = _sequence(CU_Q, b, Lq, VARLEN)  # from here on, this sequence's lengths
    bk, _first_k, Lk = _sequence(CU_K, b, Lk, VARLEN)
    q_bh = _head_slice(Q, bq, h, stride_qb, stride_qh, ROW_ALIGN)
    k_bh = _head_slice(K, bk, h, stride_kb, stride_kh, ROW_ALIGN)
    v_bh = _head_slice(V, bk, h, stride_vb, stride_vh, ROW_ALIGN)
    pad_b = PAD + b * stride_pb if HAS_PAD else PAD  # None when absent
    mask_bh = MASK + b * stride_mb + h * stride_mh if HAS_MASK else MASK
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    k_src = _rows_source(k_bh, Lk, stride_kn, HEAD_DIM, BLOCK_N, BLOCK_D, TMA)
    v_src = _rows_source(v_bh, Lk, stride_vn, HEAD_DIM, BLOCK_N, BLOCK_D, TMA)
    # (BLOCK_M, BLOCK_D)
    q_src = _rows_source(q_bh, Lq, stride_qm, HEAD_DIM, BLOCK_M, BLOCK_D, TMA)
    q = _read_rows(q_src, start_m, stride_qm, Lq, offs_d, True, HEAD_DIM, ROW_ALIGN, BLOCK_D, BLOCK_M, TMA)
    seed = load_seed(SEED, HAS_DROPOUT)
    clean_end, end_n = _query_key_range(
        pad_b, stride_pn, Lk, start_m, HAS_PAD, IS_CAUSAL, HAS_MASK, HAS_DROPOUT, BLOCK_D, BLOCK_M, BLOCK_N
    )
    if VARLEN:  # a block past its sequence's queries: no keys
        end_n = tl.where(start_m < Lq, end_n, 0)
        clean_end = tl.minimum(clean_end, end_n)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # the interior: key blocks that no mask touches
    for start_n in range(0, clean_end, BLOCK_N):
        acc, l_i, m_i = _fwd_step(
            acc, l_i, m_i, start_n, 0,
            q, k_src, v_src, stride_kn, stride_vn, start_m, offs_d, Lq, Lk, mask_bh, stride_mm, stride_mn,
            seed, bh, qk_scale, dropout_p,
            False, HAS_PAD, IS_CAUSAL, HAS_MASK, HAS_DROPOUT, DOT_PRECISION, HEAD_DIM, ROW_ALIGN,
            BLOCK_D, BLOCK_M, BLOCK_N, TMA,
        )
    # the edge: masked per element (a loop counted from 0: Triton 3.9 pipelines no loop that starts
    # at a value a reduction gave, here the padding scan's)
    pad_next = _key_padding(pad_b, stride_pn, clean_end + tl.arange(0, BLOCK_N), Lk, HAS_PAD)
    for i in range(0, tl.cdiv(end_n - clean_end, BLOCK_N)):
        start_n = clean_end + i * BLOCK_N
        _, pad, pad_next = _next_key_block(pad_b, stride_pn, start_n, pad_next, Lk, HAS_PAD, BLOCK_N)
        acc, l_i, m_i = _fwd_step(
            acc, l_i, m_i, start_n, pad,
            q, k_src, v_src, stride_kn, stride_vn, start_m, offs_d, Lq, Lk, mask_bh, stride_mm, stride_mn,
            seed, bh, qk_scale, dropout_p,
            True, HAS_PAD, IS_CAUSAL, HAS_MASK, HAS_DROPOUT, DOT_PRECISION, HEAD_DIM, ROW_ALIGN,
            BLOCK_D, BLOCK_M, BLOCK_N, TMA,
        )

    masked_row = l_i == 0.0
    l_safe = tl.where(masked_row, 1.0, l_i)
    # the softmax's 1 / l, and the dropout's 1 / (1 - p) with it: one scale per row
    row_scale = l_safe * (1.0 - dropout_p) if HAS_DROPOUT else l_safe
    out = acc / row_scale[:, None]
    lse = tl.where(masked_row, float("inf"), m_i + tl.log2(l_safe))
    if HAS_PAD or HAS_MASK:
        if tl.max((masked_row & (offs_m < Lq)).to(tl.int32), 0) > 0:
            uniform = _masked_rows_value(
                v_bh, stride_vn, start_m, offs_d, seed, bh, Lq, Lk, HEAD_DIM, dropout_p,
                HAS_DROPOUT, DOT_PRECISION, ROW_ALIGN, BLOCK_M, BLOCK_N, BLOCK_D,
            )
            out = tl.where(masked_row[:, None], uniform, out)
    _store_rows(_interleaved(O, first_q, h, HEAD_DIM, H * HEAD_DIM), offs_m, H * HEAD_DIM, Lq, offs_d, HEAD_DIM, out)
    tl.store(lse_bh + offs_m, lse, mask=offs_m < Lq)


def _dkdv_fits(meta, num_warps, num_stages, launch):
    """What compiles for sm_90a without spills (python -m tools.sm90_report; the figures are in
    docs/kernels.md). 64 x 128 at head dims up to 64 without padding, dropout or a dense mask only.
    At head dim 128, 64 x 64 spills (with padding and a causal mask: the kernel
    scans the padding itself), so only 32 query rows a block.

    With dropout at head dim 128 (72 to 128), 32 x 64 in 2 stages: in 3 it spills 4 bytes with key
    padding on Triton 3.9 (since dV takes the dropout's 1 / (1 - p) once, after its loop). The one
    known exception, from the full matrix (tools.sm90_cases.full_cases): with a dense mask and
    dropout there, even 32 x 64 in 2 stages spills on Triton 3.9, and the list has no smaller tile;
    it is kept, spilling least. The model never passes a dense mask.

    64 x 64 in 4 warps holds 238 to 255 registers at D64: in 2 stages with dropout and neither a
    causal nor a dense mask it compiles clean on both versions; in 3 stages, or with key padding but
    no dropout, it spills (24 to 56 B on Triton 3.9), and through tensor descriptors (TMA) too
    (16 B on Triton 3.9, the model's call).

    fp32 (TF32 products: python -m tools.sm90_report --tf32, tools/results/sm90-compile-tf32*.md):
    not 64 x 64 in 4 warps (it spills with dropout); at head dims from 32, 32 query rows a block (64
    x 64 spills 28 to 200 B, 32 B at head dim 32 on Triton 3.9; 64 x 128 168 B); from 64, 2 stages
    (32 x 64 spills 16 B in 3 with dropout on 3.9); at 128 (72 to 128) 32 x 64 (32 x 128 spills,
    and in 3 stages overflows shared memory). That last tile compiles clean on Triton 3.6, the GPU
    machines', and is the one fp32 launch with no clean config on 3.9: it spills 80 to 332 B there,
    and every other tile overflows shared memory; it is kept, as the only one that compiles."""
    if not _fits_lengths(meta, launch, _DKDV_TILES):
        return False
    if (meta["BLOCK_M"], meta["BLOCK_N"], num_warps) == (32, 64, 4):  # the sweep's candidate
        return _one_warp_group_fits(meta, num_stages, launch)
    if fp32_launch(launch, "Q"):
        block_d = launch["BLOCK_D"]
        if (meta["BLOCK_M"], meta["BLOCK_N"], num_warps) == (64, 64, 4):
            return False
        if (block_d >= 32 and meta["BLOCK_M"] != 32) or (block_d >= 64 and num_stages != 2):
            return False
        if block_d == 128 and meta["BLOCK_N"] != 64:
            return False
    tile = (meta["BLOCK_M"], meta["BLOCK_N"])
    if tile == (64, 64) and num_warps == 4:  # at the register limit: where it compiles clean
        dropout_only = launch["HAS_DROPOUT"] and not (launch["IS_CAUSAL"] or launch["HAS_MASK"])
        return dropout_only and launch["BLOCK_D"] <= 64 and num_stages == 2 and not launch.get("TMA")
    if tile == (64, 128):  # with key padding it spills (12 to 36 B at D64), with dropout more
        return launch["BLOCK_D"] <= 64 and not (launch["HAS_PAD"] or launch["HAS_DROPOUT"] or launch["HAS_MASK"])
    if tile == (64, 64) and launch["HAS_DROPOUT"] and launch["IS_CAUSAL"]:
        return False  # spills 20 to 28 B with key padding on Triton 3.9
    if launch["BLOCK_D"] == 128:
        if launch["HAS_DROPOUT"]:
            return tile == (32, 64) and num_stages == 2
        return tile in ((32, 64), (32, 128))
    # a dense mask with dropout: 64 x 64 spills
    return not (launch["HAS_MASK"] and launch["HAS_DROPOUT"] and tile == (64, 64))


def _dq_fits(meta, num_warps, num_stages, launch):
    """What compiles for sm_90a without spills on Triton 3.9 and 3.6 (python -m tools.sm90_report;
    the figures are in docs/kernels.md). With dropout, key blocks of at most 64: the 64 x 128 tile
    spills on Triton 3.6 at head dims 16 to 64 and is at the register limit on 3.9. At head dim 128
    (72 to 128): the 64 x 128 tile in 3 stages overflows shared memory with a dense mask (on 3.6)
    and with padding spills in 2 stages, so it runs in 2 stages without padding only, and through
    tensor descriptors (TMA) not with a dense mask either (12 B of spills on Triton 3.9); with dropout
    the 128 x 64 tile is at the register limit (with padding alone it spills on Triton 3.6), so
    64-row tiles only, and with a causal or dense mask 64 x 64 spills too, so 64 x 32 it is.

    fp32 (TF32 products: python -m tools.sm90_report --tf32, tools/results/sm90-compile-tf32*.md):
    2 stages (128 x 64 spills in 3 with dropout); 64 x 128 at head dims up to 32 only (at 64 it
    spills 240 B and more); at 64 not 64 x 64 (28 B with both masks on Triton 3.9); at 128 (72 to
    128) 64 x 32 only (the larger tiles overflow shared memory)."""
    if not _fits_lengths(meta, launch, _DQ_TILES):
        return False
    if fp32_launch(launch, "Q"):
        tile, block_d = (meta["BLOCK_M"], meta["BLOCK_N"]), launch["BLOCK_D"]
        if num_stages != 2 or (block_d > 32 and meta["BLOCK_N"] == 128):
            return False
        if (block_d == 64 and tile == (64, 64)) or (block_d == 128 and tile != (64, 32)):
            return False
    dropout = launch["HAS_DROPOUT"]
    if dropout and meta["BLOCK_N"] > 64:
        return False
    if dropout and launch["BLOCK_D"] <= 64 and (meta["BLOCK_M"], meta["BLOCK_N"]) == (64, 64):
        return num_stages == 2  # in 3 it spills 48 B with key padding on Triton 3.9
    if launch["BLOCK_D"] == 128:
        if meta["BLOCK_N"] == 128:
            return num_stages == 2 and not launch["HAS_PAD"] and not (launch.get("TMA") and launch["HAS_MASK"])
        if dropout and (launch["IS_CAUSAL"] or launch["HAS_MASK"]):
            return (meta["BLOCK_M"], meta["BLOCK_N"]) == (64, 32)
        if dropout:
            return meta["BLOCK_M"] == 64
    return True


def _one_pass_fits(meta, num_warps, num_stages, launch):
    """The one-pass backward's dK/dV/dQ: dK/dV's tiles (_dkdv_fits) where the fifth product, dS K
    added to dQ's sums, also fits (python -m tools.sm90_report --one-pass; tools/results/
    sm90-one-pass*.md). That product's rows are the tile's queries, and wgmma takes 64 rows at
    least: on a 32-row tile it runs on mma.sync. So the 64-row tiles where one fits, and the 32-row
    ones only where none does (a causal or dense mask with dropout, head dims above 64: the way
    rule, _one_pass, keeps those launches in two passes unless one pass is chosen). With dropout
    at head dim 64 the 64 x 64 tile is at the register limit: only 8 warps in 3 stages through
    pointers compiles clean on both versions (4 warps spill 36 B with key padding on Triton 3.9,
    12 B without on 3.6; 8 warps in 2 stages 4 B on 3.6, through descriptors 8 to 32 B on 3.9). At
    head dim 128 (72 to 128) 32 x 128 spills (4 to 24 B on Triton 3.6), so 32 x 64; with a dense
    mask and dropout that spills too (16 to 52 B), as dK/dV's does, and is kept, spilling least.
    fp32 runs the two passes at head dims above 32 (_one_pass: 32 x 64 spills 84 B at 64 and
    overflows shared memory at 128)."""
    if not _dkdv_fits(meta, num_warps, num_stages, launch):
        return False
    if meta["BLOCK_M"] == 64:
        return _one_pass_64_rows_fit(meta, num_warps, num_stages, launch)
    if launch["BLOCK_D"] == 128 and meta["BLOCK_N"] != 64:
        return False
    return not any(
        m["BLOCK_M"] == 64 and _dkdv_fits(m, w, s, launch) and _one_pass_64_rows_fit(m, w, s, launch)
        for m, w, s in _candidates(_DKDV_TILES)
    )


def _one_pass_64_rows_fit(meta, num_warps, num_stages, launch):
    """_one_pass_fits for a 64-row tile that dK/dV's rule keeps."""
    if launch["HAS_DROPOUT"] and launch["BLOCK_D"] == 64 and meta["BLOCK_N"] == 64:
        return num_warps == 8 and num_stages == 3 and not launch.get("TMA")
    return True


# The rule for the attention backward's way where neither determinism nor a choice decides
# (kernels/_backward_choice.py): one pass (5 products a tile, 3 launches) where both the queries
# and the keys number at least ONE_PASS_FROM and the head dim is at most 64, two passes (7, 2
# launches) otherwise. At the model's lengths (64 to 256) a launch's floor outweighs the two
# products a tile saved; at the targets' L4096 they are 2 / 7 of the backward's tensor work.
# Above head dim 64 the one pass's tiles have 32 query rows, on which its fifth product cannot
# take wgmma (_one_pass_fits). Until a GPU has timed both ways (python -m tools.sweep), this is a
# count of work, not a measurement.
ONE_PASS_FROM = 1024


def _one_pass(Lq, Lk, D, dtype):
    """Whether the backward of an eager call with Lq queries, Lk keys, head dim D and inputs of
    `dtype` runs in one pass (kernels/_backward_choice.py); _on_real_tensors says whether an op's
    call is one. fp32 (TF32 products) takes it at head dims up to 32 only: above, its one config
    spills or overflows shared memory (_one_pass_fits)."""
    if torch.are_deterministic_algorithms_enabled() or (dtype == torch.float32 and D > 32):
        return False
    way = attention_backward_choice()
    if way == "auto":
        return min(Lq, Lk) >= ONE_PASS_FROM and D <= 64
    return way == "one-pass"


def _on_real_tensors(q):
    """Whether the op's call runs on real tensors: no torch.compile trace and no fake, functional or
    make_fx proxy tensors. A traced graph keeps the two passes (kernels/_backward_choice.py); a
    dispatch mode that runs the op as it is (tools.launches' counter) sees the way an eager call takes."""
    from torch._subclasses.fake_tensor import is_fake
    from torch._subclasses.functional_tensor import FunctionalTensor
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    if torch.compiler.is_compiling() or get_proxy_mode() is not None:
        return False
    return not (is_fake(q) or isinstance(q, FunctionalTensor))


@triton.jit
def _dkdv_program(
    lse_bh, delta_bh, dq_bh, DK, DV, seed, bh, first_k, h, start_n, q_bh, k_bh, v_bh, do_bh, pad_b, mask_bh,
    stride_pn, stride_mm, stride_mn, stride_qm, stride_kn, stride_vn, stride_dom, stride_gm,
    Lq, Lk, qk_scale, sm_scale, dropout_p, offs_d,
    HAS_PAD: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    DOT_PRECISION: tl.constexpr, HEAD_DIM: tl.constexpr, ROW_ALIGN: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TMA: tl.constexpr,
    ACCUMULATE_DQ: tl.constexpr, VARLEN: tl.constexpr,
):
    """One program of the dK/dV pass (its key block start_n.. of (batch, head) bh; the _bh pointers
    offset to it as _attn_bwd_kernel makes them, lse_bh and delta_bh to its rows of LSE and DELTA;
    first_k: its keys' first row of DK and DV, _sequence's): dK and dV written, and with
    ACCUMULATE_DQ (the one-pass backward, _attn_bwd_one_pass_kernel) dQ's parts added to the fp32
    sums at dq_bh, its (Lq rows, HEAD_DIM) (_dkdv_step); dq_bh is None otherwise. Lq and Lk: this
    (batch, head)'s lengths. VARLEN: a key block past a packed sequence's end computes nothing."""
    # dK and dV of one key block, looping over the query blocks that can see it. Reads the delta
    # the dQ pass (or, one-pass, _attn_bwd_delta_kernel) wrote.
    offs_n = start_n + tl.arange(0, BLOCK_N)
    # (BLOCK_N, BLOCK_D)
    k_src = _rows_source(k_bh, Lk, stride_kn, HEAD_DIM, BLOCK_N, BLOCK_D, TMA)
    v_src = _rows_source(v_bh, Lk, stride_vn, HEAD_DIM, BLOCK_N, BLOCK_D, TMA)
    k = _read_rows(k_src, start_n, stride_kn, Lk, offs_d, True, HEAD_DIM, ROW_ALIGN, BLOCK_D, BLOCK_N, TMA)
    v = _read_rows(v_src, start_n, stride_vn, Lk, offs_d, True, HEAD_DIM, ROW_ALIGN, BLOCK_D, BLOCK_N, TMA)
    q_src = _rows_source(q_bh, Lq, stride_qm, HEAD_DIM, BLOCK_M, BLOCK_D, TMA)
    do_src = _rows_source(do_bh, Lq, stride_dom, HEAD_DIM, BLOCK_M, BLOCK_D, TMA)

    start_m = 0
    if IS_CAUSAL:
        start_m = (start_n // BLOCK_M) * BLOCK_M  # queries above the diagonal never see this block
    end_m = Lq
    if HAS_PAD:
        first_pad, keys_end = _padding_bounds(pad_b, stride_pn, Lk)
        end_m = tl.where(start_n < keys_end, Lq, start_m)  # a block of trailing padding: skip
    if VARLEN:
        end_m = tl.where(start_n < Lk, end_m, start_m)  # past its sequence's keys: skip
    pad = _key_padding(pad_b, stride_pn, offs_n, Lk, HAS_PAD)  # this program's keys: once

    # Every tile is computed transposed, keys first: S^T = K Q^T (BLOCK_N, BLOCK_M), so each dot's
    # rows are this program's keys, P^T and dS^T feed dV and dK from registers without a transpose,
    # and the row vectors (lse, delta) broadcast along columns.
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)  # of the kept probabilities: 1 / (1 - p) after the loop
    # The query blocks loop in three runs, masked, clean, masked (one masked run where the
    # forward has no interior run, _query_key_range). The clean run is every whole query block
    # (in bounds) that sees every key of this block, when those are all in bounds and before the
    # batch's first padding key: under a causal mask, from the first query block at or past the
    # block's last key. The clean and the tail runs start where a reduction puts them: counted
    # from 0 (see the forward).
    clean_start = end_m
    clean_stop = end_m
    if not (HAS_MASK or (BLOCK_D > 64 and (HAS_DROPOUT or HAS_PAD))):
        clean_keys = start_n + BLOCK_N <= Lk
        if HAS_PAD:
            clean_keys = clean_keys & (start_n + BLOCK_N <= first_pad)
        first_clean = start_m
        if IS_CAUSAL:
            first_clean = tl.cdiv(start_n + BLOCK_N - 1, BLOCK_M) * BLOCK_M
        whole_end = (Lq // BLOCK_M) * BLOCK_M
        first_clean = tl.maximum(tl.minimum(first_clean, whole_end), start_m)
        clean_start = tl.where(clean_keys, first_clean, end_m)
        clean_stop = tl.where(clean_keys, tl.maximum(whole_end, first_clean), end_m)
    for m in range(start_m, clean_start, BLOCK_M):
        dk, dv = _dkdv_step(
            dk, dv, m, k, v, offs_n, pad, q_src, do_src, stride_qm, stride_dom, offs_d, lse_bh, delta_bh, dq_bh,
            Lq, Lk, mask_bh, stride_mm, stride_mn, seed, bh, start_n, qk_scale, dropout_p,
            True, HAS_PAD, IS_CAUSAL, HAS_MASK, HAS_DROPOUT, DOT_PRECISION, HEAD_DIM, ROW_ALIGN,
            BLOCK_D, BLOCK_M, BLOCK_N, TMA, ACCUMULATE_DQ,
        )
    if not (HAS_MASK or (BLOCK_D > 64 and (HAS_DROPOUT or HAS_PAD))):
        for i in range(0, tl.cdiv(clean_stop - clean_start, BLOCK_M)):
            m = clean_start + i * BLOCK_M
            dk, dv = _dkdv_step(
                dk, dv, m, k, v, offs_n, pad, q_src, do_src, stride_qm, stride_dom, offs_d, lse_bh, delta_bh, dq_bh,
                Lq, Lk, mask_bh, stride_mm, stride_mn, seed, bh, start_n, qk_scale, dropout_p,
                False, HAS_PAD, IS_CAUSAL, HAS_MASK, HAS_DROPOUT, DOT_PRECISION, HEAD_DIM, ROW_ALIGN,
                BLOCK_D, BLOCK_M, BLOCK_N, TMA, ACCUMULATE_DQ,
            )
        for i in range(0, tl.cdiv(end_m - clean_stop, BLOCK_M)):
            m = clean_stop + i * BLOCK_M
            dk, dv = _dkdv_step(
                dk, dv, m, k, v, offs_n, pad, q_src, do_src, stride_qm, stride_dom, offs_d, lse_bh, delta_bh, dq_bh,
                Lq, Lk, mask_bh, stride_mm, stride_mn, seed, bh, start_n, qk_scale, dropout_p,
                True, HAS_PAD, IS_CAUSAL, HAS_MASK, HAS_DROPOUT, DOT_PRECISION, HEAD_DIM, ROW_ALIGN,
                BLOCK_D, BLOCK_M, BLOCK_N, TMA, ACCUMULATE_DQ,
            )

    if HAS_PAD or HAS_MASK:
        # Rows whose keys are all masked spread 1/Lk over every key (the tutorial's -1e9 fill):
        # they reach dV only, and only in the (B, H) slices that have such rows.
        if _has_masked_row(lse_bh, Lq):
            for m in range(0, Lq, BLOCK_M):
                offs_m = m + tl.arange(0, BLOCK_M)
                lse = tl.load(lse_bh + offs_m, mask=offs_m < Lq, other=0.0)
                row = (lse == float("inf")) & (offs_m < Lq)
                # (BLOCK_N, BLOCK_M)
                pt = tl.where(row[None, :] & (offs_n[:, None] < Lk), 1.0 / Lk, 0.0)
                if HAS_DROPOUT:  # scaled with the rest of dV, below
                    keep = attention_keep(seed, bh, m, start_n, dropout_p, BLOCK_M, BLOCK_N, True)
                    pt = tl.where(keep, pt, 0.0)
                do = _load_rows(do_bh, offs_m, stride_dom, Lq, offs_d, HEAD_DIM, ROW_ALIGN)
                dv = tl.dot(pt.to(do.dtype), do, dv, input_precision=DOT_PRECISION, out_dtype=tl.float32)

    dk_bh = _interleaved(DK, first_k, h, HEAD_DIM, stride_gm)
    dk_scale = sm_scale
    if HAS_DROPOUT:  # dropout's 1 / (1 - p), once (_dkdv_step)
        dk_scale = sm_scale / (1.0 - dropout_p)
        dv = dv * (1.0 / (1.0 - dropout_p))
    _store_rows(dk_bh, offs_n, stride_gm, Lk, offs_d, HEAD_DIM, dk * dk_scale)
    _store_rows(_interleaved(DV, first_k, h, HEAD_DIM, stride_gm), offs_n, stride_gm, Lk, offs_d, HEAD_DIM, dv)


@triton.jit(do_not_specialize=_UNSPECIALIZED)
def _attn_bwd_kernel(
    Q, K, V, O, DO, LSE, DELTA, DQ, DK, DV, SEED,
    PAD, stride_pb, stride_pn, MASK, stride_mb, stride_mh, stride_mm, stride_mn,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_dom, stride_gm,
    H, Lq, Lk, qk_scale, sm_scale, dropout_p,
    LQ_BUCKET, LK_BUCKET,  # config keys only
    CU_Q, CU_K,
    DQ_PASS: tl.constexpr,
    HAS_PAD: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    DOT_PRECISION: tl.constexpr, HEAD_DIM: tl.constexpr, ROW_ALIGN: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TMA: tl.constexpr,
    VARLEN: tl.constexpr,
):
    """The backward, one kernel in two launches (_attn_bwd_dq, then _attn_bwd_dkdv). DQ_PASS is a
    constexpr: each pass compiles to its own branch alone, and the pointers only the other pass
    uses (DK and DV in the dQ pass, O and DQ in dK/dV) are None.
    Grid: cdiv(Lq, BLOCK_M) * B * H programs in the dQ pass (one per query block), cdiv(Lk, BLOCK_N)
    * B * H in the dK/dV pass (one per key block), on one axis. Launched by _attn_backward.

    Args:
        Q: (B, H, Lq, D) the forward's queries, fp16, bf16 or fp32; any strides with a unit last one.
        K, V: (B, H, Lk, D) the forward's keys and values in Q's dtype; any strides with a unit last one.
        O: (B, H, Lq, D) the forward's output, laid out as (B, Lq, H, D) contiguous (_interleaved);
            read by the dQ pass, None in the dK/dV pass.
        DO: (B, H, Lq, D) the gradient of O in Q's dtype; any strides with a unit last one.
        LSE: (B, H, Lq) fp32, contiguous: the forward's log-sum-exp (base 2, +inf: all keys masked).
        DELTA: (B, H, Lq) fp32, contiguous: rowsum(dO * O), written by the dQ pass, read by dK/dV.
        DQ: (B, H, Lq, D) output in Q's dtype, laid out as (B, Lq, stride_gm) rows, the heads side by
            side (_interleaved); written by the dQ pass, None in the dK/dV pass.
        DK, DV: (B, H, Lk, D) outputs in Q's dtype, laid out as DQ; written by the dK/dV pass, None in
            the dQ pass.
        SEED: the forward's dropout seed, so the backward drops what the forward dropped; None
            when HAS_DROPOUT is off.
        stride_dob, stride_doh, stride_dom: DO's strides in elements (batch, head, row).
        stride_gm: the row stride of DQ, DK and DV in elements: H * D (each its own tensor), or 3 * H *
            D (views of one fused QKV projection's gradient, self_attention).
        sm_scale: softmax_scale, which dQ and dK are multiplied by.
        DQ_PASS: True: the dQ pass (and DELTA); False: the dK/dV pass.
        PAD, MASK, their strides, the strides of Q, K and V, H, Lq, Lk, qk_scale, dropout_p,
            LQ_BUCKET, LK_BUCKET, CU_Q, CU_K, HAS_PAD, IS_CAUSAL, HAS_MASK, HAS_DROPOUT, DOT_PRECISION,
            HEAD_DIM, BLOCK_D, VARLEN: as in _attn_fwd_kernel (with VARLEN, DO, DQ, DK and DV are
            packed rows too, and DELTA is (B, H, Lq) as LSE).
        ROW_ALIGN: every (batch, head, row) stride of Q, K, V and DO is a multiple of it (_row_align: the
            elements in 16 bytes, else 1), hinted with tl.multiple_of.
        BLOCK_M: query rows per program (dQ) or per step of the loop over query blocks (dK/dV).
        BLOCK_N: keys per step of the loop over key blocks (dQ) or per program (dK/dV).
        TMA: Q, K, V and DO tiles load through tensor descriptors made per program (kernels/_tma.py:
            16-byte aligned bases and row strides), else through pointers.
    """
    # torch.compile's Inductor passes a Python float as fp64, a launch as fp32: one type for both
    qk_scale, sm_scale = tl.cast(qk_scale, tl.float32), tl.cast(sm_scale, tl.float32)
    dropout_p = tl.cast(dropout_p, tl.float32)
    # A program of the dQ pass owns a block of queries, one of the dK/dV pass a block of keys; both
    # read the four inputs of their (batch, head).
    if DQ_PASS:
        bh, b, h, start_m = _program_block(Lq, H, BLOCK_M, LAST_FIRST=True)
    else:
        bh, b, h, start_n = _program_block(Lk, H, BLOCK_N, LAST_FIRST=False)
    lse_bh = LSE + bh * Lq
    delta_bh = DELTA + bh * Lq
    bq, first_q, Lq = _sequence(CU_Q, b, Lq, VARLEN)  # from here on, this sequence's lengths
    bk, first_k, Lk = _sequence(CU_K, b, Lk, VARLEN)
    q_bh = _head_slice(Q, bq, h, stride_qb, stride_qh, ROW_ALIGN)
    k_bh = _head_slice(K, bk, h, stride_kb, stride_kh, ROW_ALIGN)
    v_bh = _head_slice(V, bk, h, stride_vb, stride_vh, ROW_ALIGN)
    do_bh = _head_slice(DO, bq, h, stride_dob, stride_doh, ROW_ALIGN)
    pad_b = PAD + b * stride_pb if HAS_PAD else PAD  # None when absent
    mask_bh = MASK + b * stride_mb + h * stride_mh if HAS_MASK else MASK
    offs_d = tl.arange(0, BLOCK_D)
    seed = load_seed(SEED, HAS_DROPOUT)

    if DQ_PASS:
        # dQ of one query block, looping over the key blocks it can see. It also writes its rows'
        # delta = rowsum(dO * O) (which holds under dropout too) for the dK/dV pass, launched next.
        offs_m = start_m + tl.arange(0, BLOCK_M)
        # Each pass makes the sources of its own block's rows first and the streamed ones after its
        # loads: made once above both passes, the TMA variant's loops came out longer on sm_90a
        # (tools.sass, 2026-11-29: the model's dQ 141 -> 151 clocks per 1,000 scores).
        q_src = _rows_source(q_bh, Lq, stride_qm, HEAD_DIM, BLOCK_M, BLOCK_D, TMA)
        do_src = _rows_source(do_bh, Lq, stride_dom, HEAD_DIM, BLOCK_M, BLOCK_D, TMA)
        q = _read_rows(q_src, start_m, stride_qm, Lq, offs_d, True, HEAD_DIM, ROW_ALIGN, BLOCK_D, BLOCK_M, TMA)
        do = _read_rows(do_src, start_m, stride_dom, Lq, offs_d, True, HEAD_DIM, ROW_ALIGN, BLOCK_D, BLOCK_M, TMA)
        k_src = _rows_source(k_bh, Lk, stride_kn, HEAD_DIM, BLOCK_N, BLOCK_D, TMA)
        v_src = _rows_source(v_bh, Lk, stride_vn, HEAD_DIM, BLOCK_N, BLOCK_D, TMA)
        o = _load_rows(_interleaved(O, first_q, h, HEAD_DIM, H * HEAD_DIM), offs_m, H * HEAD_DIM, Lq, offs_d, HEAD_DIM)
        delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)
        tl.store(delta_bh + offs_m, delta, mask=offs_m < Lq)
        lse = tl.load(lse_bh + offs_m, mask=offs_m < Lq, other=float("inf"))
        clean_end, end_n = _query_key_range(
            pad_b, stride_pn, Lk, start_m, HAS_PAD, IS_CAUSAL, HAS_MASK, HAS_DROPOUT, BLOCK_D, BLOCK_M, BLOCK_N
        )
        if VARLEN:  # a block past its sequence's queries: no keys
            end_n = tl.where(start_m < Lq, end_n, 0)
            clean_end = tl.minimum(clean_end, end_n)

        dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        dq_scale = sm_scale
        if HAS_DROPOUT:  # dropout's 1 / (1 - p) once, after the loop (_dq_step)
            delta = delta * (1.0 - dropout_p)
            dq_scale = sm_scale / (1.0 - dropout_p)
        # the interior: key blocks that no mask touches
        for start_n in range(0, clean_end, BLOCK_N):
            dq = _dq_step(
                dq, start_n, 0,
                q, do, lse, delta, k_src, v_src, stride_kn, stride_vn, start_m, offs_d, Lq, Lk,
                mask_bh, stride_mm, stride_mn, seed, bh, qk_scale, dropout_p,
                False, HAS_PAD, IS_CAUSAL, HAS_MASK, HAS_DROPOUT, DOT_PRECISION, HEAD_DIM, ROW_ALIGN,
                BLOCK_D, BLOCK_M, BLOCK_N, TMA,
            )
        # the edge: masked per element (counted from 0, as the forward's)
        pad_next = _key_padding(pad_b, stride_pn, clean_end + tl.arange(0, BLOCK_N), Lk, HAS_PAD)
        for i in range(0, tl.cdiv(end_n - clean_end, BLOCK_N)):
            start_n = clean_end + i * BLOCK_N
            _, pad, pad_next = _next_key_block(pad_b, stride_pn, start_n, pad_next, Lk, HAS_PAD, BLOCK_N)
            dq = _dq_step(
                dq, start_n, pad,
                q, do, lse, delta, k_src, v_src, stride_kn, stride_vn, start_m, offs_d, Lq, Lk,
                mask_bh, stride_mm, stride_mn, seed, bh, qk_scale, dropout_p,
                True, HAS_PAD, IS_CAUSAL, HAS_MASK, HAS_DROPOUT, DOT_PRECISION, HEAD_DIM, ROW_ALIGN,
                BLOCK_D, BLOCK_M, BLOCK_N, TMA,
            )
        dq_bh = _interleaved(DQ, first_q, h, HEAD_DIM, stride_gm)
        _store_rows(dq_bh, offs_m, stride_gm, Lq, offs_d, HEAD_DIM, dq * dq_scale)
    else:
        _dkdv_program(
            lse_bh, delta_bh, None, DK, DV, seed, bh, first_k, h, start_n, q_bh, k_bh, v_bh, do_bh, pad_b, mask_bh,
            stride_pn, stride_mm, stride_mn, stride_qm, stride_kn, stride_vn, stride_dom, stride_gm,
            Lq, Lk, qk_scale, sm_scale, dropout_p, offs_d,
            HAS_PAD, IS_CAUSAL, HAS_MASK, HAS_DROPOUT, DOT_PRECISION, HEAD_DIM, ROW_ALIGN, BLOCK_D, BLOCK_M, BLOCK_N,
            TMA, False, VARLEN,
        )


@triton.jit(do_not_specialize=_UNSPECIALIZED)
def _attn_bwd_one_pass_kernel(
    Q, K, V, O, DO, LSE, DELTA, DQ, DK, DV, SEED,
    PAD, stride_pb, stride_pn, MASK, stride_mb, stride_mh, stride_mm, stride_mn,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_dom, stride_gm,
    H, Lq, Lk, qk_scale, sm_scale, dropout_p,
    LQ_BUCKET, LK_BUCKET,  # config keys only
    CU_Q, CU_K,
    HAS_PAD: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    DOT_PRECISION: tl.constexpr, HEAD_DIM: tl.constexpr, ROW_ALIGN: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TMA: tl.constexpr,
    VARLEN: tl.constexpr,
):
    """The one-pass backward's main launch (_attn_bwd_one_pass, between _attn_bwd_delta_kernel and
    _attn_bwd_dq_convert_kernel): the dK/dV pass of _attn_bwd_kernel, one program per key block,
    which also adds each tile's part of dQ to fp32 sums by atomics: 5 products a tile where the two
    passes take 7 (the dQ pass computes Q K^T and dO V^T again), in an order the hardware picks, so
    not bitwise repeatable (_one_pass says when it runs).

    Args: as _attn_bwd_kernel's in its dK/dV pass, but for
        O: None (delta comes from _attn_bwd_delta_kernel).
        DELTA: (B, H, Lq) fp32, rowsum(dO * O), written by _attn_bwd_delta_kernel.
        DQ: (B, H, Lq, HEAD_DIM) fp32, contiguous: dQ's sums, zeroed by _attn_bwd_delta_kernel and
            turned into the gradient by _attn_bwd_dq_convert_kernel (1 - p times dS K with dropout,
            as _dkdv_step adds them; unscaled).
    """
    qk_scale, sm_scale = tl.cast(qk_scale, tl.float32), tl.cast(sm_scale, tl.float32)
    dropout_p = tl.cast(dropout_p, tl.float32)
    bh, b, h, start_n = _program_block(Lk, H, BLOCK_N, LAST_FIRST=False)
    pad_b = PAD + b * stride_pb if HAS_PAD else PAD  # None when absent
    mask_bh = MASK + b * stride_mb + h * stride_mh if HAS_MASK else MASK
    lse_bh, delta_bh, dq_bh = LSE + bh * Lq, DELTA + bh * Lq, DQ + bh.to(tl.int64) * Lq * HEAD_DIM
    bq, _first_q, Lq = _sequence(CU_Q, b, Lq, VARLEN)  # from here on, this sequence's lengths
    bk, first_k, Lk = _sequence(CU_K, b, Lk, VARLEN)
    q_bh = _head_slice(Q, bq, h, stride_qb, stride_qh, ROW_ALIGN)
    do_bh = _head_slice(DO, bq, h, stride_dob, stride_doh, ROW_ALIGN)
    k_bh = _head_slice(K, bk, h, stride_kb, stride_kh, ROW_ALIGN)
    v_bh = _head_slice(V, bk, h, stride_vb, stride_vh, ROW_ALIGN)
    _dkdv_program(
        lse_bh, delta_bh, dq_bh, DK, DV, load_seed(SEED, HAS_DROPOUT), bh, first_k, h, start_n,
        q_bh, k_bh, v_bh, do_bh, pad_b, mask_bh,
        stride_pn, stride_mm, stride_mn, stride_qm, stride_kn, stride_vn, stride_dom, stride_gm,
        Lq, Lk, qk_scale, sm_scale, dropout_p, tl.arange(0, BLOCK_D),
        HAS_PAD, IS_CAUSAL, HAS_MASK, HAS_DROPOUT, DOT_PRECISION, HEAD_DIM, ROW_ALIGN, BLOCK_D, BLOCK_M, BLOCK_N,
        TMA, True, VARLEN,
    )


@triton.jit
def _attn_bwd_delta_kernel(
    O, DO, DELTA, DQ, stride_dob, stride_doh, stride_dom, H, Lq, CU_Q,
    HEAD_DIM: tl.constexpr, ROW_ALIGN: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    VARLEN: tl.constexpr,
):
    """The one-pass backward's first launch: delta = rowsum(dO * O) into DELTA (B, H, Lq) fp32, and
    zeros into the block's rows of dQ's fp32 sums DQ (B, H, Lq, HEAD_DIM) contiguous. O as
    _attn_bwd_kernel reads it ((B, Lq, H, D) rows), DO with its strides. Grid: cdiv(Lq, BLOCK_M) *
    B * H programs, one per block of query rows. CU_Q, VARLEN: as _attn_bwd_kernel's (DELTA and DQ
    (B, H, Lq, ...) with Lq the longest length)."""
    bh, b, h, start_m = _program_block(Lq, H, BLOCK_M, LAST_FIRST=False)
    delta_bh, dq_bh = DELTA + bh * Lq, DQ + bh.to(tl.int64) * Lq * HEAD_DIM
    bq, first_q, Lq = _sequence(CU_Q, b, Lq, VARLEN)  # from here on, this sequence's length
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    o = _load_rows(_interleaved(O, first_q, h, HEAD_DIM, H * HEAD_DIM), offs_m, H * HEAD_DIM, Lq, offs_d, HEAD_DIM)
    do_bh = _head_slice(DO, bq, h, stride_dob, stride_doh, ROW_ALIGN)
    do = _load_rows(do_bh, offs_m, stride_dom, Lq, offs_d, HEAD_DIM, ROW_ALIGN)
    tl.store(delta_bh + offs_m, tl.sum(do.to(tl.float32) * o.to(tl.float32), 1), mask=offs_m < Lq)
    zeros = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    _store_rows(dq_bh, offs_m, HEAD_DIM, Lq, offs_d, HEAD_DIM, zeros)


@triton.jit
def _attn_bwd_dq_convert_kernel(
    DQ_SUMS, DQ, stride_gm, H, Lq, scale, CU_Q,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, VARLEN: tl.constexpr,
):
    """The one-pass backward's last launch: dQ = scale * its fp32 sums (DQ_SUMS, (B, H, Lq, HEAD_DIM)
    contiguous; scale: softmax_scale, over 1 - p with dropout) in DQ's dtype, laid out as
    _attn_bwd_kernel writes DQ ((B, Lq, stride_gm) rows, heads side by side). Grid as
    _attn_bwd_delta_kernel's, and CU_Q and VARLEN."""
    bh, b, h, start_m = _program_block(Lq, H, BLOCK_M, LAST_FIRST=False)
    sums_bh = DQ_SUMS + bh.to(tl.int64) * Lq * HEAD_DIM
    _bq, first_q, Lq = _sequence(CU_Q, b, Lq, VARLEN)  # from here on, this sequence's length
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    sums = _load_rows(sums_bh, offs_m, HEAD_DIM, Lq, offs_d, HEAD_DIM)
    dq = sums * tl.cast(scale, tl.float32)
    _store_rows(_interleaved(DQ, first_q, h, HEAD_DIM, stride_gm), offs_m, stride_gm, Lq, offs_d, HEAD_DIM, dq)


# The kernels' launches with their configs; the backward kernel's two passes each have their own.
_INTERPRETER_TILE = {"BLOCK_M": 16, "BLOCK_N": 16}
_attn_fwd = Configs(
    _attn_fwd_kernel, "attention forward", _candidates(_FWD_TILES), _KEY, _fwd_fits,
    interpreter_meta=_INTERPRETER_TILE, tma_bases=("Q", "K", "V"),
)
_attn_bwd_dq = Configs(
    _attn_bwd_kernel, "attention dQ", _candidates(_DQ_TILES), _KEY, _dq_fits,
    interpreter_meta=_INTERPRETER_TILE, tma_bases=("Q", "K", "V", "DO"),
)
_attn_bwd_dkdv = Configs(
    _attn_bwd_kernel, "attention dK/dV", _candidates(_DKDV_TILES), _KEY, _dkdv_fits,
    interpreter_meta=_INTERPRETER_TILE, tma_bases=("Q", "K", "V", "DO"),
)
# the one-pass backward's dK/dV/dQ: dQ's sums zeroed before each config an autotuner times
_attn_bwd_one_pass = Configs(
    _attn_bwd_one_pass_kernel, "attention dK/dV/dQ", _candidates(_DKDV_TILES), _KEY, _one_pass_fits,
    interpreter_meta=_INTERPRETER_TILE, tma_bases=("Q", "K", "V", "DO"), reset_to_zero=("DQ",),
)
# rows per program of the one-pass backward's delta and dQ launches (32 at head dims above 64)
_ROWS = 32 if INTERPRET else 64


@triton.jit
def _attn_probs_kernel(
    Q, K, LSE, P, SEED,
    PAD, stride_pb, stride_pn, MASK, stride_mb, stride_mh, stride_mm, stride_mn,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    H, Lq, Lk, qk_scale, dropout_p,
    HAS_PAD: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    DOT_PRECISION: tl.constexpr, HEAD_DIM: tl.constexpr, ROW_ALIGN: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One (BLOCK_M, BLOCK_N) tile of the probabilities, exactly exp2(s - lse), into (B, H, Lq, Lk),
    after dropout as they multiplied V (1/Lk for a row whose keys are all masked). Grid: cdiv(Lq,
    BLOCK_M) * cdiv(Lk, BLOCK_N) * B * H programs on one axis. Launched by _attn_probs.

    Args (those it shares with _attn_fwd_kernel mean what they mean there: Q, K, SEED, PAD, MASK,
    their strides, H, Lq, Lk, qk_scale, dropout_p and the constexprs):
        LSE: (B, H, Lq) fp32, contiguous: the forward's log-sum-exp (base 2, +inf: all keys masked).
        P: (B, H, Lq, Lk) output in Q's dtype, contiguous: the probabilities.
        SEED: the forward's dropout seed, so the dropped probabilities are the ones that multiplied V.
        BLOCK_M, BLOCK_N: the tile's query rows and keys.
    """
    n_m_blocks = tl.cdiv(Lq, BLOCK_M)
    n_n_blocks = tl.cdiv(Lk, BLOCK_N)
    pid = tl.program_id(0)
    bh = pid // (n_m_blocks * n_n_blocks)
    tile = pid % (n_m_blocks * n_n_blocks)
    start_n = (tile % n_n_blocks) * BLOCK_N
    start_m = (tile // n_n_blocks) * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    q_bh = _head_slice(Q, b, h, stride_qb, stride_qh, ROW_ALIGN)
    k_bh = _head_slice(K, b, h, stride_kb, stride_kh, ROW_ALIGN)
    pad_b = PAD + b * stride_pb if HAS_PAD else PAD  # None when absent
    mask_bh = MASK + b * stride_mb + h * stride_mh if HAS_MASK else MASK
    offs_d = tl.arange(0, BLOCK_D)
    q = _load_rows(q_bh, offs_m, stride_qm, Lq, offs_d, HEAD_DIM, ROW_ALIGN)
    k = _load_rows(k_bh, offs_n, stride_kn, Lk, offs_d, HEAD_DIM, ROW_ALIGN)
    lse = tl.load(LSE + bh * Lq + offs_m, mask=offs_m < Lq, other=float("inf"))
    pad = _key_padding(pad_b, stride_pn, offs_n, Lk, HAS_PAD)
    s, valid = _scores(
        q, k, offs_m, offs_n, pad, Lq, Lk, mask_bh, stride_mm, stride_mn, qk_scale,
        HAS_PAD, IS_CAUSAL, HAS_MASK, DOT_PRECISION,
    )
    p = tl.where(valid, tl.exp2(s - lse[:, None]), 0.0)
    p = tl.where((lse == float("inf"))[:, None], 1.0 / Lk, p)  # all keys masked: uniform
    if HAS_DROPOUT:
        keep = attention_keep(load_seed(SEED, HAS_DROPOUT), bh, start_m, start_n, dropout_p, BLOCK_M, BLOCK_N, False)
        p = tl.where(keep, p / (1.0 - dropout_p), 0.0)
    tl.store(
        P + bh.to(tl.int64) * Lq * Lk + offs_m[:, None] * Lk + offs_n[None, :],
        p.to(P.dtype.element_ty),
        mask=(offs_m[:, None] < Lq) & (offs_n[None, :] < Lk),
    )


# ----------------------------------------------------------------------------------------------
# Launchers: arguments checked by `attention`, block sizes from the kernels' Configs, grids flattened to one
# axis so B * H may exceed 65535. Strides reach the kernels as scalars, (batch, head, row) per
# tensor: torch.compile rejects tuple arguments on direct launches.
# ----------------------------------------------------------------------------------------------
def _head_block(D):
    """Head dims are padded (masked) up to a power of two of at least 16, tl.dot's minimum: D = 80
    or 96 computes as D = 128 (see the module docstring)."""
    return max(16, next_power_of_2(D))


def _row_strides(*tensors):
    """The (batch, head, row) strides of (B, H, L, D) tensors, in order, as the kernels take them;
    of packed (total, H, D) rows (_Packed), the row stride as the batch's (_sequence)."""
    packed = lambda t: (t.stride(0), t.stride(1), t.stride(0))  # noqa: E731
    return tuple(s for t in tensors for s in (t.stride()[:3] if t.dim() == 4 else packed(t)))


class _Packed(NamedTuple):
    """Packed sequences as the kernels take them (attention_varlen, VARLEN): q, k and v are
    (total, H, D) rows, sequence b's queries rows cu_q[b] to cu_q[b + 1] and its keys cu_k's."""

    cu_q: torch.Tensor  # (B + 1,) int32 offsets of the query rows
    cu_k: torch.Tensor  # (B + 1,) int32 offsets of the key rows
    max_q: int  # the longest sequence's queries
    max_k: int  # and keys


def _shape(q, k, packed):
    """(B, H, Lq, Lk, CU_Q, CU_K, VARLEN) of a launch: padded (B, H, L, D) inputs or, with `packed`,
    (total, H, D) rows, Lq and Lk the longest lengths."""
    if packed is None:
        B, H, Lq, _ = q.shape
        return B, H, Lq, k.shape[2], None, None, False
    return packed.cu_q.shape[0] - 1, q.shape[1], packed.max_q, packed.max_k, packed.cu_q, packed.cu_k, True


class _Masking(NamedTuple):
    """How one attention call masks, drops out and scales, in the form every launcher passes on.
    Built once per op call by `_masking`, in Python only: no device work."""

    tensors: tuple  # (key padding mask (B, Lk), dense mask (B, H or 1, Lq, Lk)), each None when absent
    pad_strides: tuple  # the key padding mask's (stride_pb, stride_pn), zeros when absent
    mask_strides: tuple  # the dense mask's (stride_mb, stride_mh, stride_mm, stride_mn), zeros when absent
    flags: dict  # the kernels' constexprs: HAS_PAD, IS_CAUSAL, HAS_MASK, HAS_DROPOUT, DOT_PRECISION, BLOCK_D
    dropout_p: float
    scale: float  # softmax_scale; the kernels take it times log2(e) as qk_scale


def _dense_mask_view(attn_mask):
    """attn_mask as the kernels read it, (B, H or 1, Lq, Lk): a (B, Lq, Lk) mask gains a head axis."""
    return attn_mask.unsqueeze(1) if attn_mask is not None and attn_mask.dim() == 3 else attn_mask


def _masking(q, key_padding_mask, attn_mask, causal, dropout_p, softmax_scale):
    """The _Masking of a call. An absent mask is None with zero strides (never read: its flag is
    off); a (B, 1, Lq, Lk) or (B, Lq, Lk) mask is read with a zero head stride."""
    pad_strides = (0, 0) if key_padding_mask is None else key_padding_mask.stride()
    dense = _dense_mask_view(attn_mask)
    if dense is None:
        mask_strides = (0, 0, 0, 0)
    else:
        sb, sh, sm, sn = dense.stride()
        mask_strides = (sb, 0 if dense.shape[1] == 1 else sh, sm, sn)
    flags = {
        "HAS_PAD": key_padding_mask is not None,
        "IS_CAUSAL": bool(causal),
        "HAS_MASK": attn_mask is not None,
        "HAS_DROPOUT": dropout_p > 0.0,
        "DOT_PRECISION": dot_precision(q.dtype),
        "HEAD_DIM": q.shape[-1],
        "BLOCK_D": _head_block(q.shape[-1]),
    }
    return _Masking((key_padding_mask, dense), tuple(pad_strides), mask_strides, flags, dropout_p, softmax_scale)


def _row_align(*tensors):
    """ROW_ALIGN for kernels reading `tensors` row by row: the elements in 16 bytes when every
    (batch, head, row) stride is a multiple of them, else 1 (a symbolic stride gives no hint).

    The hint is about offsets only: `tl.multiple_of(b * stride_b + h * stride_h, ROW_ALIGN)`.
    Whether a base pointer is 16-byte aligned is Triton's own specialization of the launch (and
    Inductor's, for a compiled graph), so no data pointer is read here: a fake or functional tensor
    has none, and the hint holds for every tensor torch.compile traces."""
    elements = 16 // tensors[0].element_size()
    if not all(isinstance(n, int) and n % elements == 0 for n in _row_strides(*tensors)):
        return 1
    return elements


def _buckets(Lq, Lk):
    """The config keys of the sequence lengths: new lengths in one power of two reuse the pick and the tuning."""
    return next_power_of_2(Lq), next_power_of_2(Lk)


def _interleaved_empty(B, H, L, D, like):
    """An empty (B, H, L, D) tensor laid out as (B, L, H, D): the layout of the kernels' outputs,
    o, dq, dk and dv, whose strides the kernels compute (_interleaved). A (B, L, H * D) reshape of
    the output is free, and a gradient reaching a fused QKV projection is read row by row."""
    # (a plan allocates the same layout with torch.empty_strided, a microsecond less; under
    # torch.compile on torch 2.11 that form, with symbolic strides, breaks Inductor's functionalized
    # launch of the dK/dV pass at a second sequence length: tests/test_compile.py)
    return torch.empty(B, L, H, D, dtype=like.dtype, device=like.device).transpose(1, 2)


def _forward_outputs(q, packed=None):
    """Empty o (_interleaved_empty; packed: (total, H, D) rows) and lse (B, H, Lq) fp32, for
    _forward_launch to fill."""
    B, H, Lq, _, _, _, _ = _shape(q, q, packed)
    if packed is None:
        o = _interleaved_empty(B, H, Lq, q.shape[-1], q)
    else:
        o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    return o, torch.empty(B, H, Lq, dtype=torch.float32, device=q.device)


def _forward_launch(q, k, v, o, lse, seed, masking, packed=None):
    """(grid, args, kwargs) of the forward kernel's launch: o (B, H, Lq, D) as _forward_outputs lays
    it out and lse (B, H, Lq) in base 2 (+inf for rows whose keys are all masked). `seed`: the
    one-element int64 dropout seed, None without dropout. `packed`: q, k, v and o are packed
    sequences (_Packed), through pointer loads."""
    if masking.dropout_p > 0.0 and seed is None:
        raise ValueError("attention: dropout needs a seed (`attention` draws one when none is given)")
    B, H, Lq, Lk, cu_q, cu_k, varlen = _shape(q, k, packed)
    pad, mask = masking.tensors
    args = (
        q, k, v, o, lse, seed, pad, *masking.pad_strides, mask, *masking.mask_strides, *_row_strides(q, k, v),
        H, Lq, Lk, masking.scale * LOG2E, masking.dropout_p, *_buckets(Lq, Lk), cu_q, cu_k,
    )
    kwargs = {**masking.flags, "ROW_ALIGN": _row_align(q, k, v), "VARLEN": varlen}
    kwargs["TMA"] = not varlen and use_tma(_attn_fwd.prefers_tma(args, kwargs, PREFERS_TMA), q, k, v)
    return lambda meta: (cdiv(Lq, meta["BLOCK_M"]) * B * H,), args, kwargs


def _attn_forward(q, k, v, masking, seed, packed=None):
    """o and lse (_forward_launch)."""
    o, lse = _forward_outputs(q, packed)
    grid, args, kwargs = _forward_launch(q, k, v, o, lse, seed, masking, packed)
    _attn_fwd[grid](*args, **kwargs)
    return o, lse


def _backward_outputs(q, k, v, lse):
    """Empty dq, dk, dv (_interleaved_empty) and delta (B, H, Lq) fp32, for _backward_launches to fill."""
    B, H, _, D = q.shape
    return (*(_interleaved_empty(B, H, t.shape[2], D, t) for t in (q, k, v)), torch.empty_like(lse))


def _gradient_rows(dq, dk, dv):
    """The row stride of dq, dk and dv (B, H, L, D), which the kernel writes laid out as (B, L, row)
    rows with the heads side by side (_interleaved): each its own (_interleaved_empty, row H * D)
    or views of one fused projection's gradient (self_attention, row 3 * H * D)."""
    row = dq.stride(2)
    for t in (dq, dk, dv):
        _, _, L, D = t.shape
        if t.stride() != (L * row, D, row, 1):
            raise ValueError(f"attention's gradients must be rows {row} apart, heads side by side; got {t.stride()}")
    return row


def _backward_launches(do, q, k, v, o, lse, seed, dq, dk, dv, delta, masking, dq_sums=None, packed=None):
    """[(kernel, grid, args, kwargs)] of the backward's launches, `kernel` a Configs or a jit kernel
    (_launch_of, _prepared_of). Without `dq_sums`, the two passes: dQ, which also writes delta
    (B, H, Lq) = rowsum(dO * O), then dK/dV. With it (the one-pass backward, _one_pass: an empty
    (B, H, Lq, D) fp32 tensor, _dq_sums), three: delta and zeroed sums, dK/dV adding dQ's parts to
    the sums, and dQ from them. `do` has a unit last stride; `o` is the forward's output in its
    layout; dq, dk and dv as _gradient_rows takes them. `packed` (_Packed): every tensor is packed
    sequences' (total, H, D) rows, the gradients contiguous, through pointer loads; dq_sums and
    delta are (B, H, Lq, ...) for the longest length Lq."""
    B, H, Lq, Lk, cu_q, cu_k, varlen = _shape(q, k, packed)
    D = q.shape[-1]
    pad, mask = masking.tensors
    masks = (pad, *masking.pad_strides, mask, *masking.mask_strides)
    rows = _gradient_rows(dq, dk, dv) if packed is None else dq.stride(0)
    strides = (*_row_strides(q, k, v, do), rows)
    scalars = (H, Lq, Lk, masking.scale * LOG2E, masking.scale, masking.dropout_p, *_buckets(Lq, Lk), cu_q, cu_k)
    flags = {**masking.flags, "ROW_ALIGN": _row_align(q, k, v, do), "VARLEN": varlen}
    dkdv_args = (q, k, v, None, do, lse, delta, dq_sums, dk, dv, seed, *masks, *strides, *scalars)
    keys = lambda meta: (cdiv(Lk, meta["BLOCK_N"]) * B * H,)  # noqa: E731 (one program per key block)
    if dq_sums is None:
        # the pointers only the other pass uses are None: DK and DV in the dQ pass, O and DQ in dK/dV
        passes = [
            (
                _attn_bwd_dq,
                lambda meta: (cdiv(Lq, meta["BLOCK_M"]) * B * H,),
                (q, k, v, o, do, lse, delta, dq, None, None, seed, *masks, *strides, *scalars),
                {"DQ_PASS": True, **flags},
            ),
            (_attn_bwd_dkdv, keys, dkdv_args, {"DQ_PASS": False, **flags}),
        ]
    else:
        passes = [(_attn_bwd_one_pass, keys, dkdv_args, dict(flags))]
    for configs, _, args, kwargs in passes:  # each pass its own variant: a tuned table may pick them apart
        kwargs["TMA"] = not varlen and use_tma(configs.prefers_tma(args, kwargs, PREFERS_TMA), q, k, v, do)
    if dq_sums is None:
        return passes
    block_d = _head_block(D)
    block_m = _ROWS if block_d <= 64 else _ROWS // 2  # 64 rows of 128 columns spill at head dims 72 and 80
    grid = (cdiv(Lq, block_m) * B * H,)
    sizes = {"HEAD_DIM": D, "BLOCK_D": block_d, "BLOCK_M": block_m, "num_warps": 4, "VARLEN": varlen}
    dq_scale = masking.scale / (1.0 - masking.dropout_p)  # dropout's 1 / (1 - p) (_dkdv_step)
    delta_args = (o, do, delta, dq_sums, *_row_strides(do), H, Lq, cu_q)
    return [
        (_attn_bwd_delta_kernel, grid, delta_args, {**sizes, "ROW_ALIGN": _row_align(do)}),
        *passes,
        (_attn_bwd_dq_convert_kernel, grid, (dq_sums, dq, rows, H, Lq, dq_scale, cu_q), sizes),
    ]


def _launch_of(kernel, grid, args, kwargs):
    """Launch one of _backward_launches' items."""
    (kernel if isinstance(kernel, Configs) else launch(kernel))[grid](*args, **kwargs)


def _prepared_of(kernel, grid, args, kwargs):
    """The PreparedLaunch of one of _backward_launches' items."""
    if isinstance(kernel, Configs):
        return kernel.prepare(grid, args, kwargs)
    return PreparedLaunch(kernel, grid, args, kwargs)


def _dq_sums(q):
    """dQ's fp32 sums for the one-pass backward, (B, H, Lq, D) contiguous, uninitialized (its first
    launch zeroes them)."""
    return torch.empty(q.shape, dtype=torch.float32, device=q.device)


def _attn_backward(do, q, k, v, o, lse, seed, masking, grads=None):
    """dq, dk, dv, laid out as (B, L, H, D) (_interleaved_empty), or written into `grads`, three
    views of one fused projection's gradient (_self_attention_backward); _backward_launches, in
    one pass or two as _one_pass says."""
    B, H, Lq, D = q.shape
    do = last_dim_contiguous(do)
    if o.stride() != (Lq * H * D, D, H * D, 1):  # the forward wrote it so; torch.compile may not keep it
        o = _interleaved_empty(B, H, Lq, D, o).copy_(o)
    if grads is None:
        dq, dk, dv, delta = _backward_outputs(q, k, v, lse)
    else:
        (dq, dk, dv), delta = grads, torch.empty_like(lse)
    dq_sums = _dq_sums(q) if _one_pass(q.shape[2], k.shape[2], q.shape[3], q.dtype) and _on_real_tensors(q) else None
    for item in _backward_launches(do, q, k, v, o, lse, seed, dq, dk, dv, delta, masking, dq_sums):
        _launch_of(*item)
    return dq, dk, dv


_TILE = 16 if INTERPRET else 64  # probabilities tiles (an inspection path, not tuned)


def _attn_probs(q, k, lse, seed, masking):
    """(B, H, Lq, Lk) probabilities that multiplied V, from the forward's log-sum-exp."""
    B, H, Lq, _ = q.shape
    Lk = k.shape[2]
    probs = torch.empty(B, H, Lq, Lk, dtype=q.dtype, device=q.device)
    grid = (cdiv(Lq, _TILE) * cdiv(Lk, _TILE) * B * H,)
    pad, mask = masking.tensors
    launch(_attn_probs_kernel)[grid](
        q, k, lse, probs, seed, pad, *masking.pad_strides, mask, *masking.mask_strides, *_row_strides(q, k),
        H, Lq, Lk, masking.scale * LOG2E, masking.dropout_p, **masking.flags, ROW_ALIGN=_row_align(q, k),
        BLOCK_M=_TILE, BLOCK_N=_TILE,
    )
    return probs


# ----------------------------------------------------------------------------------------------
# The op, registered with torch.library so torch.compile(fullgraph=True) traces it without breaks.
# ----------------------------------------------------------------------------------------------
def _attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    attn_mask: torch.Tensor | None,
    causal: bool,
    dropout_p: float,
    softmax_scale: float,
    seed: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """o and lse. `seed` is an input, never an output (an op may not return one of its inputs):
    the caller draws it, and it is None without dropout."""
    masking = _masking(q, key_padding_mask, attn_mask, causal, dropout_p, softmax_scale)
    return _attn_forward(q, k, v, masking, seed)


def _attention_backward(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    seed: torch.Tensor | None,
    key_padding_mask: torch.Tensor | None,
    attn_mask: torch.Tensor | None,
    causal: bool,
    dropout_p: float,
    softmax_scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    masking = _masking(q, key_padding_mask, attn_mask, causal, dropout_p, softmax_scale)
    return _attn_backward(do, q, k, v, o, lse, seed, masking)


_attention_forward_op = _attention_backward_op = None  # the torch.library ops, bound by defer_ops below


def _setup_context(ctx, inputs, output):
    q, k, v, key_padding_mask, attn_mask, causal, dropout_p, softmax_scale, seed = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, seed, key_padding_mask, attn_mask)
    ctx.causal, ctx.dropout_p, ctx.softmax_scale = causal, dropout_p, softmax_scale
    # lse carries no gradient: none is made for it (autograd would fill zeros)
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)


def _backward(ctx, do, _dlse):
    q, k, v, o, lse, seed, key_padding_mask, attn_mask = ctx.saved_tensors
    dq, dk, dv = call_op(
        _attention_backward_op, _attention_backward,
        do, q, k, v, o, lse, seed, key_padding_mask, attn_mask, ctx.causal, ctx.dropout_p, ctx.softmax_scale,
    )
    return dq, dk, dv, None, None, None, None, None, None


defer_ops(
    globals(),
    {
        "_attention_forward_op": ("attention_forward", _attention_forward),
        "_attention_backward_op": ("attention_backward", _attention_backward),
    },
    autograd=(_backward, _setup_context),
)
_attention_forward_eager = eager_twin(_attention_forward, _setup_context, _backward)


# ----------------------------------------------------------------------------------------------
# Eager calls by plan (kernels._runtime, Plans): what a signature of `attention`'s arguments fixes,
# made on its first eager call, and the autograd.Function that runs it.
# ----------------------------------------------------------------------------------------------
class _Plan(Plan):
    """An eager `attention` call's signature made ready: its checks passed, the forward's launch
    prepared, and the backward's two launches prepared per signature of the gradient (its strides
    and dtype) on the first backward that meets it."""

    def __init__(self, q, k, v, key_padding_mask, attn_mask, causal, dropout_p, scale, seed):
        self.causal, self.dropout_p, self.scale = causal, dropout_p, scale
        self.draws_seed = dropout_p > 0.0 and seed is None
        masking = _masking(q, key_padding_mask, attn_mask, causal, dropout_p, scale)
        if self.draws_seed:  # a stand-in for the seed each call draws (no number drawn here)
            seed = torch.empty(1, dtype=torch.int64, device=q.device)
        elif dropout_p == 0.0:
            seed = None
        o, lse = _forward_outputs(q)
        self.forward = _attn_fwd.prepare(*_forward_launch(q, k, v, o, lse, seed, masking))
        # the outputs' layouts as _forward_outputs and _backward_outputs make them, for `run` and the
        # backward to allocate without working them out
        self.o_layout, self.lse_size = (tuple(o.shape), o.stride()), tuple(lse.shape)
        dk = _backward_outputs(q, k, v, lse)[1]
        self.dkv_layout = (tuple(dk.shape), dk.stride())
        self.backwards = {}

    def _made(self):
        return self.causal, self.dropout_p, self.scale, self.draws_seed, self.forward

    def __repr__(self):
        return f"attention._Plan(causal={self.causal}, dropout_p={self.dropout_p}, scale={self.scale}, {self.forward})"

    def run(self, q, k, v, key_padding_mask, attn_mask, seed):
        """o and lse of the forward."""
        o = torch.empty_strided(*self.o_layout, dtype=q.dtype, device=q.device)
        lse = torch.empty(*self.lse_size, dtype=torch.float32, device=q.device)
        mask = None if attn_mask is None else _dense_mask_view(attn_mask)
        self.forward(q, k, v, o, lse, seed, key_padding_mask, mask)
        return o, lse

    def backward_launches(self, do, q, k, v, o, lse, seed, key_padding_mask, attn_mask):
        """The backward's PreparedLaunches (two passes, or the one pass's three: _one_pass) for a
        gradient `do` (unit last stride) of this signature."""
        args = do, q, k, v, o, lse, seed, key_padding_mask, attn_mask
        key = do.stride(), do.dtype, _one_pass(q.shape[2], k.shape[2], q.shape[3], q.dtype)
        return kept(self.backwards, key, self._backward_launches, *args)

    def _backward_launches(self, do, q, k, v, o, lse, seed, key_padding_mask, attn_mask):
        masking = _masking(q, key_padding_mask, attn_mask, self.causal, self.dropout_p, self.scale)
        dq, dk, dv, delta = _backward_outputs(q, k, v, lse)
        dq_sums = _dq_sums(q) if _one_pass(q.shape[2], k.shape[2], q.shape[3], q.dtype) else None
        launches = _backward_launches(do, q, k, v, o, lse, seed, dq, dk, dv, delta, masking, dq_sums)
        return [_prepared_of(*item) for item in launches]

    def run_backward(self, launches, q, k, v, o, do, lse, seed, key_padding_mask, attn_mask, dq, dk, dv):
        """Run backward_launches' launches on a call's tensors, writing dq, dk and dv."""
        delta = torch.empty(*self.lse_size, dtype=torch.float32, device=q.device)
        mask = None if attn_mask is None else _dense_mask_view(attn_mask)
        if len(launches) == 2:
            dq_pass, dkdv_pass = launches
            dq_pass(q, k, v, o, do, lse, delta, dq, None, None, seed, key_padding_mask, mask)
            dkdv_pass(q, k, v, None, do, lse, delta, None, dk, dv, seed, key_padding_mask, mask)
        else:
            sums, one_pass, convert = launches
            dq_sums = _dq_sums(q)
            sums(o, do, delta, dq_sums)
            one_pass(q, k, v, None, do, lse, delta, dq_sums, dk, dv, seed, key_padding_mask, mask)
            convert(dq_sums, dq)


def _plannable(q, k, v, key_padding_mask, attn_mask, causal, dropout_p, softmax_scale, seed, return_probs):
    """Check a call's arguments (raising as `attention`'s checks do); whether a plan can run it:
    not for probabilities asked for, a head dim the kernel does not take, or an input autocast
    casts or the launch copies."""
    check_attention_args(q, k, v, key_padding_mask, attn_mask, dropout_p, softmax_scale, seed, causal=causal)
    casts = autocast_state(q) is not None and q.dtype == torch.float32
    if return_probs or q.shape[-1] > MAX_HEAD_DIM or casts or any(t.stride(-1) != 1 for t in (q, k, v)):
        return False
    require_launchable("attention", q, k, v)
    if dropout_p > 0.0:
        check_dropout_rows("attention", q.shape[0] * q.shape[1] * q.shape[2])
    return True


def _make_plan(q, k, v, key_padding_mask, attn_mask, causal, dropout_p, softmax_scale, seed, return_probs):
    """The _Plan of a call, or None for one that takes the ordinary path each time (_plannable)."""
    if not _plannable(q, k, v, key_padding_mask, attn_mask, causal, dropout_p, softmax_scale, seed, return_probs):
        return None
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    return _Plan(q, k, v, key_padding_mask, attn_mask, bool(causal), float(dropout_p), scale, seed)


class _PlannedAttention(torch.autograd.Function):
    """`attention` by its _Plan: the op's forward and backward, launched by the plan's prepared launches."""

    @staticmethod
    def forward(ctx, q, k, v, key_padding_mask, attn_mask, seed, plan):
        o, lse = plan.run(q, k, v, key_padding_mask, attn_mask, seed)
        ctx.save_for_backward(q, k, v, o, lse, seed, key_padding_mask, attn_mask)
        ctx.plan = plan
        ctx.set_materialize_grads(False)
        return o

    @staticmethod
    @plain_backward
    def backward(ctx, do):
        if do is None:
            return (None,) * 7
        plan = ctx.plan
        q, k, v, o, lse, seed, key_padding_mask, attn_mask = ctx.saved_tensors
        if not planning():  # a dispatch mode or transform over the backward sees the registered op
            dq, dk, dv = _attention_backward_op(
                do, q, k, v, o, lse, seed, key_padding_mask, attn_mask, plan.causal, plan.dropout_p, plan.scale
            )
            return dq, dk, dv, None, None, None, None
        do = last_dim_contiguous(do)
        launches = plan.backward_launches(do, q, k, v, o, lse, seed, key_padding_mask, attn_mask)
        dq = torch.empty_strided(*plan.o_layout, dtype=q.dtype, device=q.device)
        dk = torch.empty_strided(*plan.dkv_layout, dtype=k.dtype, device=q.device)
        dv = torch.empty_strided(*plan.dkv_layout, dtype=v.dtype, device=q.device)
        plan.run_backward(launches, q, k, v, o, do, lse, seed, key_padding_mask, attn_mask, dq, dk, dv)
        return dq, dk, dv, None, None, None, None


_planned_attention = autograd_apply(_PlannedAttention)


_plans = Plans("attention")


# ----------------------------------------------------------------------------------------------
# Self-attention on a fused QKV projection: q, k and v come in as one tensor and their gradients go
# out as one, the context as the output projection reads it.
# ----------------------------------------------------------------------------------------------
def _packed_heads(qkv, n_head, seq_len):
    """q, k and v, each (B, H, L, D), of a fused projection's output qkv (B, L, 3 * H * D), or of its
    rows (B * L, 3 * H * D) with seq_len L: views."""
    return [t.transpose(1, 2) for t in qkv.view(-1, seq_len, 3, n_head, qkv.shape[-1] // (3 * n_head)).unbind(2)]


def _one_key(qkv):
    """self_attention's context over one key, without dropout (the decoder's one [BOS] token:
    MovieClassification, and a cached decoding step's first): that key's probability is 1, masked
    or not (a row whose keys are all masked is the mean of V over its one key), so the context is
    V: qkv's last third of columns, a view of it, where the kernel's output is the same bits (p = 1,
    and 1 * v exactly). Its gradient (autograd's, of the view) is dO in V's columns and zeros in Q's
    and K's, the exact one, where the kernels' rounds dS = dP - delta to within an ulp of 0."""
    width = qkv.shape[-1] // 3
    return qkv.narrow(-1, 2 * width, width)


def _context(o, rows):
    """The (B, L, H * D) view of an output o (B, H, L, D) laid out as (B, L, H, D), or with `rows`
    its (B * L, H * D) view."""
    B, H, L, D = o.shape
    return o.transpose(1, 2).view(B * L, H * D) if rows else o.transpose(1, 2).view(B, L, H * D)


def _self_attention_forward(
    qkv: torch.Tensor,
    n_head: int,
    seq_len: int,
    key_padding_mask: torch.Tensor | None,
    attn_mask: torch.Tensor | None,
    causal: bool,
    dropout_p: float,
    softmax_scale: float,
    seed: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """o and lse of attention on qkv's heads (_packed_heads), as _attention_forward's."""
    q, k, v = _packed_heads(qkv, n_head, seq_len)
    return _attn_forward(q, k, v, _masking(q, key_padding_mask, attn_mask, causal, dropout_p, softmax_scale), seed)


def _self_attention_backward(
    do: torch.Tensor,
    qkv: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    seed: torch.Tensor | None,
    key_padding_mask: torch.Tensor | None,
    attn_mask: torch.Tensor | None,
    n_head: int,
    seq_len: int,
    causal: bool,
    dropout_p: float,
    softmax_scale: float,
) -> torch.Tensor:
    """qkv's gradient, one tensor of its shape whose three column slices the backward's kernels
    write: no stack of dq, dk and dv (the copy autograd's unbind backward makes of three)."""
    q, k, v = _packed_heads(qkv, n_head, seq_len)
    masking = _masking(q, key_padding_mask, attn_mask, causal, dropout_p, softmax_scale)
    dqkv = torch.empty(qkv.shape, dtype=qkv.dtype, device=qkv.device)
    _attn_backward(do, q, k, v, o, lse, seed, masking, grads=_packed_heads(dqkv, n_head, seq_len))
    return dqkv


_self_attention_forward_op = _self_attention_backward_op = None  # the torch.library ops, bound by defer_ops below


def _self_setup_context(ctx, inputs, output):
    qkv, n_head, seq_len, key_padding_mask, attn_mask, causal, dropout_p, softmax_scale, seed = inputs
    o, lse = output
    ctx.save_for_backward(qkv, o, lse, seed, key_padding_mask, attn_mask)
    ctx.args = n_head, seq_len, causal, dropout_p, softmax_scale
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)


def _self_backward(ctx, do, _dlse):
    if do is None:
        return (None,) * 9
    qkv, o, lse, seed, key_padding_mask, attn_mask = ctx.saved_tensors
    dqkv = call_op(
        _self_attention_backward_op, _self_attention_backward,
        do, qkv, o, lse, seed, key_padding_mask, attn_mask, *ctx.args,
    )  # fmt: skip
    return dqkv, None, None, None, None, None, None, None, None


defer_ops(
    globals(),
    {
        "_self_attention_forward_op": ("self_attention_forward", _self_attention_forward),
        "_self_attention_backward_op": ("self_attention_backward", _self_attention_backward),
    },
    autograd=(_self_backward, _self_setup_context),
)
_self_attention_forward_eager = eager_twin(_self_attention_forward, _self_setup_context, _self_backward)


class _SelfPlan(_Plan):
    """An eager `self_attention` call's signature made ready: attention's _Plan on the views of qkv,
    whose backward writes dq, dk and dv into one tensor of qkv's shape, the gradient of qkv (no
    stack of three gradients, no transposes on autograd's side)."""

    def __init__(self, qkv, n_head, seq_len, key_padding_mask, attn_mask, causal, dropout_p, scale, seed):
        self.n_head, self.seq_len, self.qkv_shape = n_head, seq_len, tuple(qkv.shape)
        self.rows = qkv.dim() == 2
        heads = _packed_heads(qkv, n_head, seq_len)
        super().__init__(*heads, key_padding_mask, attn_mask, causal, dropout_p, scale, seed)

    def _made(self):
        return (*super()._made(), self.n_head, self.seq_len, self.qkv_shape)

    def heads(self, qkv):
        """q, k and v of qkv (or of its gradient), as _packed_heads."""
        return _packed_heads(qkv, self.n_head, self.seq_len)

    def pointers(self, qkv):
        """What the prepared launches take for q, k and v of qkv (or of its gradient): its three
        column slices, each the elements of one head view at the same address. A prepared launch
        reads a tensor through the strides bound when the plan was made and takes only its pointer
        and dtype, so these stand for the heads' views: three views where the heads take five
        (view, unbind, three transposes), on every call forward and backward."""
        width = qkv.shape[-1] // 3
        return qkv.narrow(-1, 0, width), qkv.narrow(-1, width, width), qkv.narrow(-1, 2 * width, width)

    def backward_outputs(self, like):
        """dqkv (qkv's shape) in like's dtype, and the pointers (`pointers`) of its dq, dk and dv."""
        dqkv = torch.empty(self.qkv_shape, dtype=like.dtype, device=like.device)
        return dqkv, *self.pointers(dqkv)

    def backward_launches(self, do, qkv, o, lse, seed, key_padding_mask, attn_mask):
        """The backward's PreparedLaunches (_Plan's) for a gradient `do` (unit last stride) of this signature."""
        args = do, qkv, o, lse, seed, key_padding_mask, attn_mask
        key = do.stride(), do.dtype, _one_pass(self.seq_len, self.seq_len, do.shape[3], do.dtype)
        return kept(self.backwards, key, self._backward_launches, *args)

    def _backward_launches(self, do, qkv, o, lse, seed, key_padding_mask, attn_mask):
        q, k, v = self.heads(qkv)
        masking = _masking(q, key_padding_mask, attn_mask, self.causal, self.dropout_p, self.scale)
        dq, dk, dv = self.heads(torch.empty(self.qkv_shape, dtype=q.dtype, device=q.device))
        dq_sums = _dq_sums(q) if _one_pass(self.seq_len, self.seq_len, q.shape[3], q.dtype) else None
        launches = _backward_launches(do, q, k, v, o, lse, seed, dq, dk, dv, torch.empty_like(lse), masking, dq_sums)
        return [_prepared_of(*item) for item in launches]


class _PlannedSelfAttention(torch.autograd.Function):
    """`self_attention` by its _SelfPlan: qkv in, the context out, dqkv back."""

    @staticmethod
    def forward(ctx, qkv, key_padding_mask, attn_mask, seed, plan):
        o, lse = plan.run(*plan.pointers(qkv), key_padding_mask, attn_mask, seed)
        # qkv and o saved (the pointers, or views, are made again), so that autograd checks neither changed
        ctx.save_for_backward(qkv, o, lse, seed, key_padding_mask, attn_mask)
        ctx.plan = plan
        ctx.set_materialize_grads(False)
        return _context(o, plan.rows)

    @staticmethod
    @plain_backward
    def backward(ctx, dcontext):
        if dcontext is None:
            return (None,) * 5
        plan = ctx.plan
        qkv, o, lse, seed, key_padding_mask, attn_mask = ctx.saved_tensors
        B, H, L, D = o.shape
        # (B, H, L, D): the gradient's rows as the kernels read them
        do = last_dim_contiguous(dcontext).reshape(B, L, H, D).transpose(1, 2)
        if not planning():  # a dispatch mode or transform over the backward sees the registered op
            dqkv = _self_attention_backward_op(
                do, qkv, o, lse, seed, key_padding_mask, attn_mask, plan.n_head, plan.seq_len, plan.causal,
                plan.dropout_p, plan.scale,
            )  # fmt: skip
            return dqkv, None, None, None, None
        launches = plan.backward_launches(do, qkv, o, lse, seed, key_padding_mask, attn_mask)
        q, k, v = plan.pointers(qkv)
        dqkv, dq, dk, dv = plan.backward_outputs(qkv)
        plan.run_backward(launches, q, k, v, o, do, lse, seed, key_padding_mask, attn_mask, dq, dk, dv)
        return dqkv, None, None, None, None


_planned_self_attention = autograd_apply(_PlannedSelfAttention)
_self_plans = Plans("self_attention")


def check_self_attention_args(qkv, n_head, seq_len, dtypes=FLOAT_DTYPES):
    """Validate self_attention's qkv, n_head and seq_len; returns L, the sequence length."""
    check_tensor("qkv", qkv, dtypes=dtypes)
    if qkv.dim() not in (2, 3):
        raise ValueError(f"qkv must be (B, L, 3 * H * D) or its rows (B * L, 3 * H * D), got {tuple(qkv.shape)}")
    if isinstance(n_head, bool) or not isinstance(n_head, int) or n_head <= 0:
        raise ValueError(f"n_head must be a positive int, got {n_head!r}")
    width = qkv.shape[-1]
    if width == 0 or width % (3 * n_head):
        raise ValueError(
            f"qkv's last dimension must be 3 * n_head * d_head (q, k and v side by side), got {width} "
            f"with n_head {n_head}"
        )
    if qkv.dim() == 3:
        if seq_len is not None and seq_len != qkv.shape[1]:
            raise ValueError(f"seq_len must be None or qkv's length {qkv.shape[1]}, got {seq_len!r}")
        return qkv.shape[1]
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len <= 0 or qkv.shape[0] % seq_len:
        raise ValueError(
            f"seq_len must be a positive int that divides qkv's {qkv.shape[0]} rows (B * L), got {seq_len!r}"
        )
    return seq_len


def _make_self_plan(qkv, n_head, seq_len, key_padding_mask, attn_mask, causal, dropout_p, softmax_scale, seed):
    """The _SelfPlan of a call, or None for one that takes attention's path each time (as _make_plan)."""
    seq_len = check_self_attention_args(qkv, n_head, seq_len)
    q, k, v = _packed_heads(qkv, n_head, seq_len)
    if not _plannable(q, k, v, key_padding_mask, attn_mask, causal, dropout_p, softmax_scale, seed, False):
        return None
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    return _SelfPlan(qkv, n_head, seq_len, key_padding_mask, attn_mask, bool(causal), float(dropout_p), scale, seed)


def _call_scalars(tensors, rows, head_dim, dropout_p, softmax_scale, seed):
    """What an unplanned call of `attention` or `self_attention` checks and fixes before its op:
    its tensors launchable, the dropout's limit on rows, the softmax scale, and the seed the
    kernels read (None without dropout, the op and its kernels then seeing a call without one;
    drawn where dropout has none). Returns (scale, seed)."""
    require_launchable("attention", *tensors)
    if dropout_p > 0.0:
        check_dropout_rows("attention", rows)
    scale = head_dim**-0.5 if softmax_scale is None else float(softmax_scale)
    if dropout_p == 0.0:
        seed = None
    elif seed is None:
        seed = draw_seed(tensors[0].device)
    return scale, seed


def self_attention(
    qkv, n_head, *, seq_len=None, key_padding_mask=None, causal=False, attn_mask=None, dropout_p=0.0,
    softmax_scale=None, seed=None,
):
    """`attention` of the heads of one fused QKV projection, its result as the output projection
    reads it: the attention sublayer's core with no reshapes around it.

    Args:
        qkv: (B, L, 3 * H * D), the product of the input with W_Q, W_K and W_V stacked (rows [Q; K;
            V], each H heads of D): q, k and v are its views. Or its rows, (B * L, 3 * H * D), as a
            product of a (B * L, d) input gives them, with `seq_len`.
        n_head: H.
        seq_len: L, for qkv given as rows (None, or qkv's length, otherwise).
        The other arguments are attention's, for Lq = Lk = L.

    Returns:
        The context (B, L, H * D), the heads side by side, or its rows (B * L, H * D) for qkv's
        rows, in qkv's dtype. In eager mode its gradient comes back to qkv as one tensor, written
        by the backward's kernels. With one token (L = 1) and no dropout, qkv's V columns
        themselves, a view: no kernel (_one_key).
    """
    if planning() and isinstance(qkv, torch.Tensor):
        args = qkv, n_head, seq_len, key_padding_mask, attn_mask, causal, dropout_p, softmax_scale, seed
        plan = kept(_self_plans, (signature(*args), switches(qkv)), _make_self_plan, *args)
        if plan is not None:
            if plan.seq_len == 1 and plan.dropout_p == 0.0:
                return _one_key(qkv)
            seed = planned_seed(plan, seed, qkv.device)
            if needs_grad(qkv):
                return _planned_self_attention(qkv, key_padding_mask, attn_mask, seed, plan)
            return _context(plan.run(*plan.pointers(qkv), key_padding_mask, attn_mask, seed)[0], plan.rows)
    seq_len = check_self_attention_args(qkv, n_head, seq_len)
    heads = _packed_heads(qkv, n_head, seq_len)
    check_attention_args(*heads, key_padding_mask, attn_mask, dropout_p, softmax_scale, seed, causal=causal)
    if heads[0].shape[-1] > MAX_HEAD_DIM:  # attention's fallback, with its warning
        kwargs = dict(key_padding_mask=key_padding_mask, causal=causal, attn_mask=attn_mask, dropout_p=dropout_p)
        out = attention(*heads, **kwargs, softmax_scale=softmax_scale, seed=seed)
        return out.transpose(1, 2).reshape(*qkv.shape[:-1], -1)
    if seq_len == 1 and dropout_p == 0.0 and not (autocast_state(qkv) is not None and qkv.dtype == torch.float32):
        return _one_key(qkv)
    # attention's steps on one tensor: one op forward, one gradient (of qkv's shape) back
    (qkv,) = autocast_inputs(last_dim_contiguous(qkv))
    rows = qkv.shape[:-1].numel() * n_head
    scale, seed = _call_scalars((qkv,), rows, heads[0].shape[-1], dropout_p, softmax_scale, seed)
    forward = _self_attention_forward_eager if eager() else _self_attention_forward_op
    o, _ = forward(
        qkv, n_head, seq_len, key_padding_mask, attn_mask, bool(causal), float(dropout_p), scale, seed
    )  # fmt: skip
    return o.transpose(1, 2).reshape(*qkv.shape[:-1], -1)


def self_attention_reference(
    qkv, n_head, *, seq_len=None, key_padding_mask=None, causal=False, attn_mask=None, dropout_p=0.0,
    softmax_scale=None, seed=None,
):
    """self_attention in plain PyTorch (attention_reference on qkv's heads): same signature; also
    takes fp64, to serve as the tests' oracle."""
    seq_len = check_self_attention_args(qkv, n_head, seq_len, dtypes=REFERENCE_DTYPES)
    kwargs = dict(key_padding_mask=key_padding_mask, causal=causal, attn_mask=attn_mask, dropout_p=dropout_p)
    out = attention_reference(*_packed_heads(qkv, n_head, seq_len), **kwargs, softmax_scale=softmax_scale, seed=seed)
    return out.transpose(1, 2).reshape(*qkv.shape[:-1], -1)


@argument_check
def check_attention_args(
    q, k, v, key_padding_mask, attn_mask, dropout_p, softmax_scale, seed=None, dtypes=FLOAT_DTYPES, causal=False
):
    """Validate the arguments of `attention`; returns (B, H, Lq, Lk, D)."""
    if not isinstance(causal, bool):  # a string such as "no" would read as True
        raise TypeError(f"causal must be a bool, got {causal!r}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t, ndim=4, dtypes=dtypes)
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
    if Lq == 0 or Lk == 0 or B == 0 or H == 0:
        raise ValueError(f"attention needs non-empty inputs, got q {tuple(q.shape)}, k {tuple(k.shape)}")
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
    check_softmax_scale(softmax_scale)
    check_seed(seed, q.device)
    return B, H, Lq, Lk, D


def attention_dropout_mask(B, H, Lq, Lk, dropout_p, device):
    """Testing hook: the (B, H, Lq, Lk) bool keep-mask that `attention` uses for dropout on these
    shapes when called right after the same `torch.manual_seed`. For small shapes."""
    return attention_mask(B * H, Lq, Lk, dropout_p, device).view(B, H, Lq, Lk)


MAX_HEAD_DIM = 128


def attention(
    q, k, v, *, key_padding_mask=None, causal=False, attn_mask=None, dropout_p=0.0, softmax_scale=None,
    return_probs=False, seed=None,
):
    """Masked scaled-dot-product attention, softmax(q k^T * scale + mask) v, in Triton.

    Args:
        q: (B, H, Lq, D); k, v: (B, H, Lk, D). fp16, bf16 or fp32, one dtype; any strides with a
            unit last dimension (views of a fused QKV projection need no copy).
        key_padding_mask: (B, Lk) bool, True = padding key, masked for every query. Read as one
            vector per key block; key blocks past a sequence's last valid key are skipped.
        causal: mask key j > query i (top-left aligned, as the tutorial's decoder mask); key blocks
            above the diagonal are skipped.
        attn_mask: (B, Lq, Lk) or (B, H, Lq, Lk) bool, True = masked: the general, slower path.
            All masks combine by OR.
        dropout_p: dropout on the probabilities, drawn in the kernel (Philox) from `seed` (pass
            0.0 in eval).
        softmax_scale: defaults to D ** -0.5.
        return_probs: also return the (B, H, Lq, Lk) probabilities that multiplied V (after
            dropout, from the same seed), computed exactly from the saved log-sum-exp; they carry
            no gradient.
        seed: the dropout seed, a one-element int64 tensor on q's device, such as a view
            `draw_seeds(n, device)[i:i + 1]` of the seeds a model draws once per forward; the
            mask is a function of it alone (same seed, same mask). None: with dropout, one is
            drawn from torch's generator (one more launch), so torch.manual_seed reproduces it.
            Without dropout it is checked and not read.

    Returns:
        (B, H, Lq, D) in q's dtype, laid out as (B, Lq, H, D) in memory, or (out, probs). A row
        whose keys are all masked is the mean of v over all Lk keys (the tutorial's -1e9 fill),
        never NaN. Head dims up to 128 run in the kernel (padded to a power of two inside);
        larger ones run the reference with a one-time warning. Under torch.autocast, fp32 inputs
        are cast to the autocast dtype.
    """
    if planning() and isinstance(q, torch.Tensor):
        args = q, k, v, key_padding_mask, attn_mask, causal, dropout_p, softmax_scale, seed, return_probs
        plan = kept(_plans, (signature(*args), switches(q)), _make_plan, *args)
        if plan is not None:
            seed = planned_seed(plan, seed, q.device)
            if needs_grad(q, k, v):
                return _planned_attention(q, k, v, key_padding_mask, attn_mask, seed, plan)
            return plan.run(q, k, v, key_padding_mask, attn_mask, seed)[0]  # nothing to differentiate: no autograd node
    check_attention_args(q, k, v, key_padding_mask, attn_mask, dropout_p, softmax_scale, seed, causal=causal)
    q, k, v = autocast_inputs(q, k, v)
    kwargs = dict(key_padding_mask=key_padding_mask, causal=causal, attn_mask=attn_mask, dropout_p=dropout_p, seed=seed)
    if q.shape[-1] > MAX_HEAD_DIM:
        warn_once(
            ("attention", "head_dim"),
            f"kernels.attention: head dim {q.shape[-1]} > {MAX_HEAD_DIM} is not supported by the Triton kernel; "
            "running the PyTorch reference instead",
        )
        return attention_reference(q, k, v, **kwargs, softmax_scale=softmax_scale, return_probs=return_probs)
    q, k, v = (last_dim_contiguous(t) for t in (q, k, v))
    rows = q.shape[0] * q.shape[1] * q.shape[2]
    scale, seed = _call_scalars((q, k, v), rows, q.shape[-1], dropout_p, softmax_scale, seed)
    forward = _attention_forward_eager if eager() else _attention_forward_op
    out, lse = forward(q, k, v, key_padding_mask, attn_mask, bool(causal), float(dropout_p), scale, seed)
    if not return_probs:
        return out
    probs = _attn_probs(q, k, lse, seed, _masking(q, key_padding_mask, attn_mask, causal, dropout_p, scale))
    return out, probs


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
    q, k, v, *, key_padding_mask=None, causal=False, attn_mask=None, dropout_p=0.0, softmax_scale=None,
    return_probs=False, seed=None,
):
    """The tutorial's attention in plain PyTorch: the oracle for the Triton kernel.

    Same signature and semantics as `attention`; also takes fp64, to serve as the tests' oracle.
    Scores are masked as the kernels mask them (mask_scores) and the softmax runs in at least fp32;
    the probabilities are cast back to v's dtype for the product with V, as a kernel does.
    Dropout is torch's (F.dropout, torch's generator): `seed` is checked as `attention` checks it,
    then ignored, so the reference's mask is not the kernel's for the same seed (tests build the
    kernel's mask with `attention_dropout_mask`).
    """
    _, _, Lq, Lk, D = check_attention_args(
        q, k, v, key_padding_mask, attn_mask, dropout_p, softmax_scale, seed, dtypes=REFERENCE_DTYPES, causal=causal
    )
    scale = D**-0.5 if softmax_scale is None else softmax_scale
    # (B, H, Lq, Lk)
    scores = torch.matmul(q, k.transpose(-1, -2))
    scores = scores.to(torch.promote_types(scores.dtype, torch.float32)) * scale
    mask = dense_mask(Lq, Lk, q.device, key_padding_mask, causal, attn_mask)
    if mask is not None:
        scores = mask_scores(scores, mask)
    probs = torch.softmax(scores, dim=-1)
    if dropout_p > 0.0:
        probs = F.dropout(probs, p=dropout_p, training=True)
    probs = probs.to(v.dtype)
    # (B, H, Lq, D)
    out = torch.matmul(probs, v)
    return (out, probs) if return_probs else out


def mask_scores(scores, mask):
    """The scores a softmax over the last dim turns into the kernels' weights: masked keys at the
    lowest value of the scores' dtype, one masked_fill as the tutorial's. A row whose keys are all
    masked is then uniform (1/Lk each, the tutorial's value for it), and a masked key gets no weight
    wherever an unmasked score of its row lies above that lowest value by more than the exponent's
    range (in fp32 anything above -3.4e38; -1e9 in the tutorial's fill). There the softmax is bit
    for bit that of the tutorial's `masked_fill(mask, -1e9)`, which below -1e9 would hand the
    masked keys the whole weight. `mask` broadcasts to scores."""
    return scores.masked_fill(mask, torch.finfo(scores.dtype).min)
