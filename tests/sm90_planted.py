"""Kernels that each break one rule of the sm_90a compile check, to prove the check sees it.

`tests/test_sm90_compile.py` compiles `cases()` through tools.sm90 and expects each case to fail
exactly its rule, and the control case to pass every rule. Not product code: nothing imports this
module but that test (through tools.sm90's worker, without TRITON_INTERPRET).
"""

import torch
import triton
import triton.language as tl

from tools.sm90 import Case

_PLAIN_GLOBAL = 0.5  # read inside jit code below: the compiler must reject it


@triton.jit
def _plain_global_kernel(X, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(X + offs, mask=offs < n)
    tl.store(X + offs, x * _PLAIN_GLOBAL, mask=offs < n)


@triton.jit
def _gemm_kernel(
    A,
    B,
    C,
    M,
    N,
    K,
    stride_am,
    stride_ak,
    stride_bk,
    stride_bn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """C = A @ B for one (BLOCK_M, BLOCK_N) tile; the planted cases vary its tiles and strides."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        ks = k + offs_k
        a = tl.load(
            A + offs_m[:, None] * stride_am + ks[None, :] * stride_ak,
            mask=(offs_m[:, None] < M) & (ks[None, :] < K),
            other=0.0,
        )
        b = tl.load(
            B + ks[:, None] * stride_bk + offs_n[None, :] * stride_bn,
            mask=(ks[:, None] < K) & (offs_n[None, :] < N),
            other=0.0,
        )
        acc = tl.dot(a, b, acc, out_dtype=tl.float32)
    tl.store(
        C + offs_m[:, None] * N + offs_n[None, :],
        acc.to(C.dtype.element_ty),
        mask=(offs_m[:, None] < M) & (offs_n[None, :] < N),
    )


@triton.jit
def _tma_gemm_kernel(
    A,
    B,
    C,
    M,
    N,
    K,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    LOOP_STAGES: tl.constexpr,
):
    """C = A @ B^T for one (BLOCK_M, BLOCK_N) tile, A (M, K) and B (N, K) row-major, their tiles
    loaded through tensor descriptors made in the kernel (as kernels/_tma.py's kernels make theirs);
    LOOP_STAGES: the loop's own pipeline depth (tl.range), 1 to keep it from being pipelined."""
    off_m = tl.program_id(0) * BLOCK_M
    off_n = tl.program_id(1) * BLOCK_N
    a_desc = tl.make_tensor_descriptor(A, shape=[M, K], strides=[K, 1], block_shape=[BLOCK_M, BLOCK_K])
    b_desc = tl.make_tensor_descriptor(B, shape=[N, K], strides=[K, 1], block_shape=[BLOCK_N, BLOCK_K])
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in tl.range(0, K, BLOCK_K, num_stages=LOOP_STAGES):
        acc = tl.dot(a_desc.load([off_m, k]), tl.trans(b_desc.load([off_n, k])), acc, out_dtype=tl.float32)
    offs_m = off_m + tl.arange(0, BLOCK_M)
    offs_n = off_n + tl.arange(0, BLOCK_N)
    tl.store(
        C + offs_m[:, None] * N + offs_n[None, :],
        acc.to(C.dtype.element_ty),
        mask=(offs_m[:, None] < M) & (offs_n[None, :] < N),
    )


def _tma_gemm(loop_stages):
    """Launch _tma_gemm_kernel on fp16 (1024 x 1024) operands, 128 x 128 x 64 tiles in 3 stages."""

    def run():
        M = N = K = 1024
        a, b = torch.zeros(M, K, dtype=torch.float16), torch.zeros(N, K, dtype=torch.float16)
        c = torch.empty(M, N, dtype=torch.float16)
        grid = (triton.cdiv(M, 128), triton.cdiv(N, 128))
        _tma_gemm_kernel[grid](
            a, b, c, M, N, K, BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, LOOP_STAGES=loop_stages, num_warps=8, num_stages=3
        )

    return run


def _gemm(BLOCK_M, BLOCK_N, BLOCK_K, num_warps=4, num_stages=3, a_misaligned=False):
    """Launch _gemm_kernel on fp16 (1024 x 1024) operands. a_misaligned starts A one element past
    a 16-byte boundary: the JIT then cannot assume aligned rows, loads go element by element (2
    bytes, below the 4 an async copy needs) and the loop is not pipelined."""

    def run():
        M = N = K = 1024
        a = (
            torch.zeros(M * K + 1, dtype=torch.float16)[1:].view(M, K)
            if a_misaligned
            else torch.zeros(M, K, dtype=torch.float16)
        )
        b = torch.zeros(K, N, dtype=torch.float16)
        c = torch.empty(M, N, dtype=torch.float16)
        grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(N, BLOCK_N))
        _gemm_kernel[grid](
            a,
            b,
            c,
            M,
            N,
            K,
            *a.stride(),
            *b.stride(),
            BLOCK_M=BLOCK_M,
            BLOCK_N=BLOCK_N,
            BLOCK_K=BLOCK_K,
            num_warps=num_warps,
            num_stages=num_stages,
        )

    return run


def _plain_global():
    x = torch.zeros(64, dtype=torch.float32)
    _plain_global_kernel[(1,)](x, 64, BLOCK=64)


# case name -> the one problem it must show (a substring of tools.sm90.problems' message)
EXPECTED = {
    "control": None,
    "plain-global": "does not compile",
    "over-shared-memory": "shared memory",
    "spills": "register spills",
    "not-wgmma": "wgmma",
    "not-pipelined": "not pipelined",
    "tma-control": None,
    # an unpipelined descriptor load: a TMA copy and a barrier made and waited on in every iteration
    "tma-not-pipelined": "not pipelined",
}


def cases():
    return [
        Case("control", _gemm(128, 128, 64, num_warps=8), "float16"),
        Case("plain-global", _plain_global, "float32"),
        # 4 stages of (256 x 128) + (128 x 128) fp16 tiles: 384 KiB
        Case("over-shared-memory", _gemm(256, 128, 128, num_warps=8, num_stages=4), "float16"),
        # a 256 x 256 fp32 accumulator over 128 threads: 512 registers a thread
        Case("spills", _gemm(256, 256, 32, num_warps=4, num_stages=2), "float16"),
        # 16 rows: below the 64 a warp group's wgmma needs, so mma.sync
        Case("not-wgmma", _gemm(16, 64, 64), "float16"),
        Case("not-pipelined", _gemm(64, 64, 64, a_misaligned=True), "float16"),
        Case("tma-control", _tma_gemm(3), "float16"),
        Case("tma-not-pipelined", _tma_gemm(1), "float16"),
    ]
