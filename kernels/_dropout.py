"""Dropout inside kernels: Philox keyed by one seed per call, four keep decisions per call,
32-bit counters and no per-element multiply. In a (rows, cols) view (add + LayerNorm), element
(row, col) is decided by output col % 4 of Philox4x32 with PHILOX_ROUNDS rounds on the counter
(col // 4, row, 0, 0) (dropout_keep); attention's probabilities are decided in 2 x 2 squares that
suit its tiles (attention_keep). A backward regenerates the forward's mask from the seed alone, and
a test can ask for either (`dropout_mask`, `attention_mask`).

Seven rounds, not the ten of Philox's default: the rounds are most of what dropout costs the
attention kernels' hot loops (about 49 instructions a round per warp and key block of the
forward, python -m tools.sass), and Philox4x32-7 already passes TestU01's BigCrush (Salmon et al.,
"Parallel random numbers: as easy as 1, 2, 3", SC 2011, Table 2; ten is their margin above
it). tests/test_dropout_bits.py checks the keep rate of each word and the independence of
neighbouring decisions, across a call's words, across calls and across rows.
"""

import torch

from ._runtime import INTERPRET, cdiv, launch, require_launchable, tl, triton

MAX_DROPOUT_ROWS = 2**32  # rows are a 32-bit Philox counter word
PHILOX_ROUNDS = tl.constexpr(7)  # see the module docstring


def check_dropout_p(dropout_p):
    if not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be a float in [0, 1), got {dropout_p!r}")


def draw_seed(device):
    """A dropout seed drawn on the device from torch's generator: no host sync, and reproducible
    under torch.manual_seed."""
    return torch.randint(0, 2**62, (1,), device=device, dtype=torch.int64)


def planned_seed(plan, seed, device):
    """The seed a planned call (an op's Plan with `draws_seed` and `dropout_p`) launches with: one
    drawn now when the call gave none and drops out, None without dropout (not read), else `seed`."""
    if plan.draws_seed:
        return draw_seed(device)
    return None if plan.dropout_p == 0.0 else seed


def draw_seeds(n, device):
    """n dropout seeds in one launch, for a model forward to hand one to each dropout site (an op's
    `seed` argument takes a one-element view, `seeds[i:i + 1]`, which costs no kernel). The seeds
    lie 16 bytes apart (stride 2), so every view is 16-byte aligned like a seed of its own: Triton
    specializes a pointer argument on that alignment and would otherwise compile each kernel twice."""
    return torch.randint(0, 2**62, (n, 2), device=device, dtype=torch.int64)[:, 0]


def check_seed(seed, device):
    """Validate an op's `seed` argument: None (the op draws its own) or a one-element int64 tensor
    on the op's device, as `draw_seed` and `draw_seeds` make."""
    if seed is None:
        return
    if not isinstance(seed, torch.Tensor):
        raise TypeError(f"seed must be a torch.Tensor or None, got {type(seed).__name__}")
    if seed.dtype != torch.int64 or seed.numel() != 1:
        raise ValueError(
            f"seed must be a one-element int64 tensor (such as draw_seeds(n, device)[i:i + 1]), "
            f"got {seed.dtype} of shape {tuple(seed.shape)}"
        )
    if seed.device != device:
        raise ValueError(f"seed must be on the op's device {device}, got {seed.device}")


def check_dropout_rows(op, n_rows):
    if n_rows >= MAX_DROPOUT_ROWS:
        raise ValueError(f"{op}: dropout draws over at most 2**32 rows (a 32-bit Philox counter), got {n_rows}")


@triton.jit
def load_seed(SEED, HAS_DROPOUT: tl.constexpr):
    """A kernel's dropout seed, or 0 when it drops nothing (SEED is then None, never read)."""
    seed = 0
    if HAS_DROPOUT:
        seed = tl.load(SEED)
    return seed


@triton.jit
def philox(seed, c0, c1, c2, c3):
    """tl.philox(seed, c0, c1, c2, c3, n_rounds=PHILOX_ROUNDS) on uint32 counters, bit for bit.
    Each round's two products are widening 32 x 32 -> 64-bit multiplies, one IMAD.WIDE.U32 each
    on sm_90a; tl.philox's separate high and low halves (umulhi, mul) took ptxas 1.7 instructions
    a product in the attention kernels' loops (python -m tools.sass, docs/kernels.md). Not in
    add + LayerNorm's backward, whose loop it made longer (461 -> 496 instructions)."""
    seed = seed.to(tl.uint64)
    k0 = (seed & 0xFFFFFFFF).to(tl.uint32)
    k1 = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    for _ in tl.static_range(PHILOX_ROUNDS):
        a = c0.to(tl.uint64) * 0xD2511F53
        b = c2.to(tl.uint64) * 0xCD9E8D57
        c0 = (b >> 32).to(tl.uint32) ^ c1 ^ k0
        c2 = (a >> 32).to(tl.uint32) ^ c3 ^ k1
        c1 = b.to(tl.uint32)
        c3 = a.to(tl.uint32)
        k0 = k0 + 0x9E3779B9
        k1 = k1 + 0xBB67AE85
    return c0, c1, c2, c3


@triton.jit
def dropout_keep(seed, rows, col_start, dropout_p, BLOCK_N: tl.constexpr):
    """(len(rows), BLOCK_N) keep-mask of the columns col_start + arange(BLOCK_N) (col_start and
    BLOCK_N multiples of 4) in the given rows, each kept with probability 1 - dropout_p.

    Why 4 at a time: a Philox call is PHILOX_ROUNDS rounds of 32-bit multiplies and yields 128 bits; using
    one 32-bit word of each call, as tl.rand does, costs the attention kernels far more registers
    (the figures are in docs/kernels.md). The words are compared as integers with dropout_p * 2**32."""
    tl.static_assert(BLOCK_N % 4 == 0, "dropout_keep decides columns in groups of 4")
    groups = col_start // 4 + tl.arange(0, BLOCK_N // 4)
    c0 = (groups[None, :] + 0 * rows[:, None]).to(tl.uint32)
    c1 = (rows[:, None] + 0 * groups[None, :]).to(tl.uint32)
    zero = c0 * 0
    r0, r1, r2, r3 = tl.philox(seed, c0, c1, zero, zero, n_rounds=PHILOX_ROUNDS)
    threshold = (tl.cast(dropout_p, tl.float32) * 4294967296.0).to(tl.uint32)  # exact: a power-of-two scale
    # column 4g + i takes word i: interleave(interleave(w0, w2), interleave(w1, w3)) is w0 w1 w2 w3
    even = tl.interleave(r0 >= threshold, r2 >= threshold)
    odd = tl.interleave(r1 >= threshold, r3 >= threshold)
    return tl.interleave(even, odd)


@triton.jit
def attention_keep(
    seed, bh, start_m, start_n, dropout_p, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, KEYS_FIRST: tl.constexpr
):
    """The attention kernels' keep-mask of queries start_m + arange(BLOCK_M) and keys start_n +
    arange(BLOCK_N) of the (batch, head) bh: (BLOCK_M, BLOCK_N), or (BLOCK_N, BLOCK_M) with
    KEYS_FIRST (the dK/dV pass's tiles). Starts and blocks are multiples of 16.

    One Philox call decides the square {m, m + 8} x {n, n + 8} for m % 16 < 8 and n % 16 < 8: word
    2 * (m // 8 % 2) + (n // 8 % 2) of the call on the counter (pair(n), pair(m), bh, 0), where
    pair(i) = i // 16 * 8 + i % 8. Why that square: Hopper's MMA accumulator gives each thread rows
    i and i + 8 of a 16-row slab and columns 8 apart, whichever of queries and keys are its rows, so
    the four words of a call land in the thread that drew them in the forward, the dQ pass and the
    transposed dK/dV pass alike, and the mask is placed by register moves, where four consecutive
    columns (dropout_keep) spread over two threads and went through shared memory.

    The words are the same either way; how they are computed is not. philox's widening products
    hold register pairs: in the 128-query forward and dQ tiles and the 32-query dK/dV tiles they
    save instructions (the model's call: forward 2.79 -> 2.44 /kF, dQ 1.77 -> 1.54, dK/dV 1.69 ->
    1.59), in the 64 x 64 tiles they add some (forward 736 -> 752 instructions at L64) or spill
    (dQ and dK/dV with key padding on Triton 3.9), so those take tl.philox (python -m tools.sass)."""
    tl.static_assert(BLOCK_M % 16 == 0 and BLOCK_N % 16 == 0, "attention_keep decides 16 x 16 squares")
    pm = start_m // 2 + tl.arange(0, BLOCK_M // 2)
    pn = start_n // 2 + tl.arange(0, BLOCK_N // 2)
    c0 = (pn[None, :] + 0 * pm[:, None]).to(tl.uint32)
    c1 = (pm[:, None] + 0 * pn[None, :]).to(tl.uint32)
    zero = c0 * 0
    if (BLOCK_M >= 128) if not KEYS_FIRST else (BLOCK_M <= 32):  # see the docstring's last paragraph
        r0, r1, r2, r3 = philox(seed, c0, c1, zero + bh.to(tl.uint32), zero)
    else:
        r0, r1, r2, r3 = tl.philox(seed, c0, c1, zero + bh.to(tl.uint32), zero, n_rounds=PHILOX_ROUNDS)
    threshold = (tl.cast(dropout_p, tl.float32) * 4294967296.0).to(tl.uint32)  # exact: a power-of-two scale
    # (pair(m), pair(n), n // 8 % 2, m // 8 % 2), then split into (m // 16, m % 8, n // 16, n % 8, ...)
    keep = tl.join(tl.join(r0 >= threshold, r1 >= threshold), tl.join(r2 >= threshold, r3 >= threshold))
    keep = tl.reshape(keep, (BLOCK_M // 16, 8, BLOCK_N // 16, 8, 2, 2))
    if KEYS_FIRST:  # (n // 16, n // 8 % 2, n % 8, m // 16, m // 8 % 2, m % 8)
        return tl.reshape(tl.permute(keep, (2, 4, 3, 0, 5, 1)), (BLOCK_N, BLOCK_M))
    else:
        return tl.reshape(tl.permute(keep, (0, 5, 1, 2, 4, 3)), (BLOCK_M, BLOCK_N))


@triton.jit
def _dropout_mask_kernel(KEEP, SEED, n_rows, n_cols, dropout_p, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The keep-mask of one (BLOCK_M, BLOCK_N) tile of a (n_rows, n_cols) view, as the kernels draw it
    (dropout_keep). Grid: cdiv(n_rows, BLOCK_M) * cdiv(n_cols, BLOCK_N) programs on one axis.

    Args:
        KEEP: (n_rows, n_cols) uint8, contiguous: the output, 1 = kept, 0 = dropped.
        SEED: (1,) int64, the dropout seed (always present: this kernel draws nothing else).
        n_rows, n_cols: the view's rows (Philox's row counter, < 2**32) and columns.
        dropout_p: probability of dropping an element, in [0, 1).
        BLOCK_M: rows per program.
        BLOCK_N: columns per program, a multiple of 4 (dropout_keep decides 4 columns per Philox call).
    """
    # torch.compile's Inductor passes a Python float as fp64, a launch as fp32: one type for both
    dropout_p = tl.cast(dropout_p, tl.float32)
    n_col_blocks = tl.cdiv(n_cols, BLOCK_N)
    pid = tl.program_id(0)
    rows = (pid // n_col_blocks) * BLOCK_M + tl.arange(0, BLOCK_M)
    col_start = (pid % n_col_blocks) * BLOCK_N
    cols = col_start + tl.arange(0, BLOCK_N)
    keep = dropout_keep(tl.load(SEED), rows, col_start, dropout_p, BLOCK_N)
    tl.store(
        KEEP + rows[:, None].to(tl.int64) * n_cols + cols[None, :],
        keep.to(tl.uint8),
        mask=(rows[:, None] < n_rows) & (cols[None, :] < n_cols),
    )


@triton.jit
def _attention_mask_kernel(KEEP, SEED, Lq, Lk, dropout_p, BLOCK: tl.constexpr):
    """The keep-mask of one (BLOCK, BLOCK) tile of one (batch, head), as the attention kernels draw
    it (attention_keep). Grid: (batch * heads, cdiv(Lq, BLOCK), cdiv(Lk, BLOCK)).

    Args:
        KEEP: (batch * heads, Lq, Lk) uint8, contiguous: the output, 1 = kept, 0 = dropped.
        SEED: (1,) int64, the dropout seed.
        Lq, Lk: queries and keys.
        dropout_p: probability of dropping an element, in [0, 1).
        BLOCK: queries and keys per program, a multiple of 16.
    """
    dropout_p = tl.cast(dropout_p, tl.float32)  # Inductor passes a Python float as fp64
    bh = tl.program_id(0)
    start_m, start_n = tl.program_id(1) * BLOCK, tl.program_id(2) * BLOCK
    keep = attention_keep(tl.load(SEED), bh, start_m, start_n, dropout_p, BLOCK, BLOCK, False)
    rows = start_m + tl.arange(0, BLOCK)
    cols = start_n + tl.arange(0, BLOCK)
    tl.store(
        KEEP + bh.to(tl.int64) * Lq * Lk + rows[:, None] * Lk + cols[None, :],
        keep.to(tl.uint8),
        mask=(rows[:, None] < Lq) & (cols[None, :] < Lk),
    )


def attention_mask(n_bh, Lq, Lk, dropout_p, device):
    """The (n_bh, Lq, Lk) bool keep-mask the attention kernels draw over n_bh (batch, head) slices
    when called right after the same torch.manual_seed. For tests; materializes the whole mask."""
    check_dropout_p(dropout_p)
    check_dropout_rows("attention", n_bh * Lq)
    seed = draw_seed(device)
    keep = torch.empty(n_bh, Lq, Lk, dtype=torch.uint8, device=device)
    require_launchable("attention_dropout_mask", keep)
    return _attention_mask(keep, seed, dropout_p).bool()


def _attention_mask(keep, seed, dropout_p):
    """Launcher: fills the (n_bh, Lq, Lk) uint8 `keep` with attention's keep-mask of `seed`."""
    n_bh, Lq, Lk = keep.shape
    block = 16 if INTERPRET else 64
    grid = (n_bh, cdiv(Lq, block), cdiv(Lk, block))
    launch(_attention_mask_kernel)[grid](keep, seed, Lq, Lk, dropout_p, BLOCK=block)
    return keep


def dropout_mask(n_rows, n_cols, dropout_p, device):
    """The (n_rows, n_cols) bool keep-mask a kernel draws when called right after the same
    torch.manual_seed (the seed is drawn the same way). For tests; materializes the whole mask."""
    check_dropout_p(dropout_p)
    check_dropout_rows("dropout_mask", n_rows)
    seed = draw_seed(device)
    keep = torch.empty(n_rows, n_cols, dtype=torch.uint8, device=device)
    require_launchable("dropout_mask", keep)
    return _dropout_mask(keep, seed, dropout_p).bool()


def _dropout_mask(keep, seed, dropout_p):
    """Launcher: fills the (n_rows, n_cols) uint8 `keep` with the keep-mask of `seed`."""
    n_rows, n_cols = keep.shape
    block = 16 if INTERPRET else 64
    grid = (cdiv(n_rows, block) * cdiv(n_cols, block),)
    launch(_dropout_mask_kernel)[grid](keep, seed, n_rows, n_cols, dropout_p, BLOCK_M=block, BLOCK_N=block)
    return keep
