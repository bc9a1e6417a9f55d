"""What every op file shares: Triton's availability, input checks and one-time warnings.

Rules for jit code in `kernels/` (the sm_90a compile check, tests/test_sm90_compile.py, enforces
what a compiler can see):
- No plain globals inside jit code: use tl.constexpr. A module constant read by a kernel must be
  `NAME = tl.constexpr(value)`; the interpreter accepts a plain float, the compiler rejects it.
- `tl.dot(a, b, acc, input_precision=..., out_dtype=tl.float32)`: accumulate in place (wgmma keeps
  the accumulator in registers) and say the fp32 result (tl.dot's default differs between the
  supported Triton versions: 3.8 changed it).
- Triton 3.6 to 3.9: no block pointers (`tl.make_block_ptr` raises in 3.9), no API added after 3.6.
"""
import contextlib
import contextvars
import math
import os
import warnings

import torch
from torch.utils._python_dispatch import _disable_current_modes


def _identity_decorator(*args, **kwargs):
    """`@x` and `@x(...)` both leave the function as it is."""
    if len(args) == 1 and callable(args[0]) and not kwargs:
        return args[0]
    return lambda fn: fn


class _TritonMissing:
    """Stands in for `triton` and `tl` where Triton is not installed (it ships for Linux only), so
    the op files still import and the reference path works; launching a kernel is refused first."""

    def __getattr__(self, name):
        return _identity_decorator


try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:
    triton = tl = _TritonMissing()
    HAS_TRITON = False

# Triton reads TRITON_INTERPRET when a kernel is decorated, so this is fixed at import time.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# The references also take fp64, so tests can use them as oracles.
REFERENCE_DTYPES = (*FLOAT_DTYPES, torch.float64)

_warned = set()


def warn_once(key, message):
    """Warn about `key` once per process (fallbacks must be loud but not spam every layer)."""
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, stacklevel=3)


def launch(kernel):
    """How every op file launches a kernel: `launch(kernel)[grid](...)`, through
    torch.library.wrap_triton, so that torch.compile traces the launch in place of a graph break
    (a kernel with several configs launches through its kernels._configs.Configs, which calls this).
    An absent tensor argument, input or output (a seed without dropout, a missing weight, a
    half-precision copy not asked for, the outputs of the other pass of a kernel launched in
    passes), is None, and its strides 0: Triton compiles None as a constexpr, and every use of
    the pointer, its offsetting included, sits under the constexpr flag that says it is present
    (HAS_DROPOUT, HAS_WEIGHT, WRITE_LOW, DQ_PASS...). A jit helper may take such a None, but not
    return one (Triton 3.6 rejects it, and 3.9 inside a tuple), so an absent pointer is offset in
    the kernel's own body. wrap_triton (torch 2.11 and 2.13) and Inductor pass None on as a
    constexpr too, so a compiled graph launches the same specializations.
    Inside `compile_only()` a launch compiles its kernel and runs nothing. Under the interpreter
    the kernel is launched as it is, as torch 2.13's wrap_triton does (2.11's refuses it)."""
    if _compile_only.get():
        return _CompileOnly(kernel)
    if INTERPRET:
        return kernel
    return torch.library.wrap_triton(kernel)


_compile_only = contextvars.ContextVar("fastformer_compile_only", default=False)


@contextlib.contextmanager
def compile_only():
    """Inside the block, every kernel launch compiles what it would run and runs nothing: the
    kernels' outputs are left as allocated (torch.empty), so what the ops return is garbage of the
    right shapes, dtypes and strides. A launch on a key the autotuner has not tuned compiles every
    config it would time, and times none. Under a triton.AsyncCompileMode the compiles are
    submitted to its executor and the launches do not wait for them (fastformer.warmup)."""
    token = _compile_only.set(True)
    try:
        yield
    finally:
        _compile_only.reset(token)


class _CompileOnly:
    """launch(kernel) inside compile_only(): `[grid](...)` is Triton's warm-up call, which specializes
    and compiles the kernel for these arguments (asynchronously under AsyncCompileMode) and launches
    nothing; an autotuner's warm-up does so for each config its pruning keeps."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.kernel.warmup(*args, grid=grid, **kwargs)


def can_launch(*tensors):
    """Whether Triton can run on these tensors: CUDA tensors, or any tensors under the interpreter."""
    if not HAS_TRITON:
        return False
    return INTERPRET or all(t.is_cuda for t in tensors)


def require_launchable(op, *tensors):
    """Raise a clear error when the Triton path is forced on tensors it cannot run on (call it with
    the tensors as the kernel will see them, after autocast)."""
    if not HAS_TRITON:
        raise RuntimeError(f"{op}: the Triton path needs the `triton` package, which is not installed")
    tensors = [t for t in tensors if t is not None]
    if not can_launch(*tensors):
        raise RuntimeError(
            f"{op}: the Triton path got tensors on {tensors[0].device}; Triton compiles for CUDA only. "
            "Use the reference backend, or set TRITON_INTERPRET=1 before importing `kernels` "
            "to run the kernels through Triton's (slow) interpreter."
        )
    if any(t.dtype == torch.bfloat16 for t in tensors):
        require_interpreter_bf16(op)


def require_interpreter_bf16(op, what="bfloat16"):
    """Under the interpreter, a TypeError naming `what` unless the interpreter computes bf16 as a
    GPU does (see interpreter_computes_bf16); nothing on a GPU."""
    if INTERPRET and not interpreter_computes_bf16():
        raise TypeError(
            f"{op}: {what} is not supported under Triton's interpreter (TRITON_INTERPRET=1) as installed, "
            "which computes bf16 wrongly (its bf16 tl.dot or its fp32 -> bf16 rounding differs from a GPU's); "
            "use fp16 or fp32 there (no bf16 autocast), the reference backend, or a GPU"
        )


_interpreter_bf16_ok = None  # the probe's answer, once asked


def interpreter_computes_bf16():
    """Whether Triton's interpreter multiplies bf16 in a tl.dot and rounds fp32 to bf16 as a GPU
    does. Triton 3.6 to 3.9 as shipped do neither (numpy has no bf16: the interpreter multiplies
    the 16-bit patterns as integers and truncates the casts); fastformer's tests correct both.
    Asked once per process, at the first bf16 launch, by running _bf16_probe."""
    global _interpreter_bf16_ok
    if _interpreter_bf16_ok is None:
        _interpreter_bf16_ok = _probe_interpreter_bf16()
    return _interpreter_bf16_ok


@triton.jit
def _bf16_probe(A, B, C, X, Y, N: tl.constexpr):
    """interpreter_computes_bf16's test, run under the interpreter only (not named *_kernel: the
    sm_90a compile check takes those for kernels a launcher launches on a GPU).

    Args:
        A, B: (N, N) bf16, row-major, the dot's operands.
        C: (N, N) fp32, row-major: A @ B accumulated in fp32.
        X: (N,) fp32 values to round.
        Y: (N,) bf16: X rounded to nearest even.
        N: the side of the matrices and the length of X and Y, a power of two of at least 16 (tl.dot's minimum).
    """
    offs = tl.arange(0, N)
    tile = offs[:, None] * N + offs[None, :]
    acc = tl.zeros([N, N], dtype=tl.float32)
    acc = tl.dot(tl.load(A + tile), tl.load(B + tile), acc, out_dtype=tl.float32)
    tl.store(C + tile, acc)
    tl.store(Y + offs, tl.load(X + offs).to(tl.bfloat16))


@torch.compiler.disable  # Dynamo runs it as it is, on real tensors
def _probe_interpreter_bf16():
    """A 16 x 16 x 16 bf16 dot of small integers (every partial sum exact, so any order gives the
    exact product) and fp32 -> bf16 casts of a tie that rounds down to even, ties that round up to
    even and a subnormal, each compared with torch bit for bit. A question about the process, not
    part of the caller's work: it runs on the CPU outside autocast and outside any dispatch mode
    the caller is in (fake tensors while tracing, launch counters)."""
    n = 16
    with _disable_current_modes(), torch.autocast("cpu", enabled=False):
        a = (torch.arange(n * n, dtype=torch.float32).reshape(n, n) % 7 - 3).to(torch.bfloat16)
        b = (torch.arange(n * n, dtype=torch.float32).reshape(n, n) % 5 - 2).to(torch.bfloat16)
        x = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -1 - 3 * 2**-8, 1e-40], dtype=torch.float32).repeat(n // 4)
        c = torch.empty(n, n, dtype=torch.float32)
        y = torch.empty(n, dtype=torch.bfloat16)
        _bf16_probe[(1,)](a, b, c, x, y, N=n)
        rounded = x.to(torch.bfloat16)
        return torch.equal(c, a.float() @ b.float()) and torch.equal(y.view(torch.int16), rounded.view(torch.int16))


def check_tensor(name, t, *, ndim=None, dtypes=FLOAT_DTYPES):
    """TypeError/ValueError naming `name` unless `t` is a tensor of the given rank and dtype."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must be one of ({allowed}), got {t.dtype}")


def check_same_dtype(**tensors):
    dtypes = {name: t.dtype for name, t in tensors.items()}
    if len(set(dtypes.values())) > 1:
        seen = ", ".join(f"{name}={str(d).replace('torch.', '')}" for name, d in dtypes.items())
        raise TypeError(f"inputs must share one dtype, got {seen}")


def check_same_device(**tensors):
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    if len(set(devices.values())) > 1:
        seen = ", ".join(f"{name} on {d}" for name, d in devices.items())
        raise ValueError(f"inputs must be on one device, got {seen}")


def check_dropout_p(dropout_p):
    if not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be a float in [0, 1), got {dropout_p!r}")


def autocast_inputs(*tensors):
    """Under torch.autocast, fp32 inputs cast to the autocast dtype, as matmul would see them."""
    device_type = tensors[0].device.type
    if not torch.is_autocast_enabled(device_type):
        return tensors
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(t.to(dtype) if t is not None and t.dtype == torch.float32 else t for t in tensors)


def dot_precision(dtype):
    """tl.dot's input precision: IEEE for fp32 unless the user allowed TF32 for matmuls."""
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"


def rows_view(t):
    """t (..., n) as (rows, n) with unit last stride, the layout the kernels read: a view where the
    leading dims merge and the last is contiguous, else a copy. Unlike reshape(-1, n), this also
    works for n = 0 (an empty inner dimension)."""
    return last_dim_contiguous(t.reshape(math.prod(t.shape[:-1]), t.shape[-1]))


def vector_stride(vector):
    """The element stride of an optional (n,) bias or weight (0 for None): kernels read strided and
    expanded vectors as they are."""
    return 0 if vector is None else vector.stride(0)


def last_dim_contiguous(t):
    """t itself when its last dimension has unit stride (kernels take the other strides as they are)."""
    return t if t is None or t.stride(-1) == 1 else t.contiguous()


# ----------------------------------------------------------------------------------------------
# Dropout inside kernels: Philox keyed by one seed per call. Element (row, col) of a (rows, cols)
# view is decided by output col % 4 of Philox on the counter (col // 4, row, 0, 0): one call, four
# keep decisions, 32-bit counters and no per-element multiply. A backward regenerates the
# forward's mask from the seed alone, and a test can ask for it.
# ----------------------------------------------------------------------------------------------
MAX_DROPOUT_ROWS = 2**32  # rows are a 32-bit Philox counter word


def draw_seed(device):
    """A dropout seed drawn on the device from torch's generator: no host sync, and reproducible
    under torch.manual_seed."""
    return torch.randint(0, 2**62, (1,), device=device, dtype=torch.int64)


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
def dropout_keep(seed, rows, col_start, dropout_p, BLOCK_N: tl.constexpr):
    """(len(rows), BLOCK_N) keep-mask of the columns col_start + arange(BLOCK_N) (col_start and
    BLOCK_N multiples of 4) in the given rows, each kept with probability 1 - dropout_p.

    Why 4 at a time: a Philox call is ten rounds of 32-bit multiplies and yields 128 bits; using
    one 32-bit word of each call, as tl.rand does, costs the attention kernels far more registers
    (the figures are in docs/kernels.md). The words are compared as integers with dropout_p * 2**32."""
    tl.static_assert(BLOCK_N % 4 == 0, "dropout_keep decides columns in groups of 4")
    groups = col_start // 4 + tl.arange(0, BLOCK_N // 4)
    c0 = (groups[None, :] + 0 * rows[:, None]).to(tl.uint32)
    c1 = (rows[:, None] + 0 * groups[None, :]).to(tl.uint32)
    zero = c0 * 0
    r0, r1, r2, r3 = tl.philox(seed, c0, c1, zero, zero)
    threshold = (tl.cast(dropout_p, tl.float32) * 4294967296.0).to(tl.uint32)  # exact: a power-of-two scale
    # column 4g + i takes word i: interleave(interleave(w0, w2), interleave(w1, w3)) is w0 w1 w2 w3
    even = tl.interleave(r0 >= threshold, r2 >= threshold)
    odd = tl.interleave(r1 >= threshold, r3 >= threshold)
    return tl.interleave(even, odd)


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
    grid = (triton.cdiv(n_rows, block) * triton.cdiv(n_cols, block),)
    launch(_dropout_mask_kernel)[grid](keep, seed, n_rows, n_cols, dropout_p, BLOCK_M=block, BLOCK_N=block)
    return keep


# ----------------------------------------------------------------------------------------------
# Two-pass reductions: a kernel writes partial sums per program, sum_partials adds them.
# ----------------------------------------------------------------------------------------------
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


def sum_partials(partial, out):
    """The second pass of a two-pass reduction: out (n,) = the sum over p of partial (P, n), both
    contiguous, added in fp32 in a fixed order (no atomics, so bitwise reproducible) and written in
    out's dtype. One launch; P may be 0 (out is then zeros). Returns out."""
    n_partials, n_cols = partial.shape
    block_n = 16
    launch(_sum_partials_kernel)[(triton.cdiv(n_cols, block_n),)](
        partial, out, n_partials, n_cols, BLOCK_P=16 if INTERPRET else 64, BLOCK_N=block_n
    )
    return out
