"""Two-pass reductions: a kernel writes partial sums per program, `sum_partials` adds them."""

from ._runtime import INTERPRET, cdiv, launch, tl, triton


@triton.jit(do_not_specialize=["n_partials"])  # changes with the batch; bounds the loop and its mask only
def _sum_partials_kernel(PARTIAL, OUT, n_partials, n_cols, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    """OUT[c] = sum over p of PARTIAL[p, c], in fp32 and in a fixed order. Narrow column blocks give
    many programs; each loads its column block's partials two steps ahead. Grid: cdiv(n_cols, BLOCK_N).

    Args:
        PARTIAL: (n_partials, n_cols), contiguous, fp32 as every caller makes it: one row of partial
            sums per program of the first pass.
        OUT: (n_cols,), contiguous: the sums, written in OUT's dtype.
        n_partials: PARTIAL's rows, may be 0 (OUT is then zeros); not specialized: it changes with the batch.
        n_cols: PARTIAL's columns and OUT's length.
        BLOCK_P: partial rows added per loop step.
        BLOCK_N: columns per program.
    """
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n_cols
    acc = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
    for p0 in tl.range(0, n_partials, BLOCK_P, num_stages=3):
        parts = p0 + tl.arange(0, BLOCK_P)
        acc += tl.load(
            PARTIAL + parts[:, None].to(tl.int64) * n_cols + cols[None, :],
            mask=(parts[:, None] < n_partials) & col_ok[None, :],
            other=0.0,
        )
    tl.store(OUT + cols, tl.sum(acc, 0).to(OUT.dtype.element_ty), mask=col_ok)


def sum_partials_launch(partial, out):
    """(grid, args, kwargs) of sum_partials' launch."""
    n_partials, n_cols = partial.shape
    block_n = 16
    args = (partial, out, n_partials, n_cols)
    return (cdiv(n_cols, block_n),), args, {"BLOCK_P": 16 if INTERPRET else 64, "BLOCK_N": block_n}


def sum_partials(partial, out):
    """The second pass of a two-pass reduction: out (n,) = the sum over p of partial (P, n), both
    contiguous, added in fp32 in a fixed order (no atomics, so bitwise reproducible) and written in
    out's dtype. One launch; P may be 0 (out is then zeros). Returns out."""
    grid, args, kwargs = sum_partials_launch(partial, out)
    launch(_sum_partials_kernel)[grid](*args, **kwargs)
    return out
