"""tests/interpreter_bf16.py, the correction of Triton's interpreter for bf16: through it a bf16
tl.dot and the fp32 <-> bf16 casts compute what a GPU computes, without it they do not, and the
kernels take bf16 under the interpreter exactly when it computes bf16 right."""

import numpy as np
import pytest
import torch

from fastformer import kernels
from fastformer.kernels import _runtime
from fastformer.kernels._runtime import INTERPRET, tl, triton
from tests import interpreter_bf16

pytestmark = [
    pytest.mark.bf16,
    pytest.mark.skipif(
        not INTERPRET, reason="about Triton's interpreter (TRITON_INTERPRET=1), which a GPU run does not use"
    ),
]

BF16_MAX = torch.finfo(torch.bfloat16).max


@triton.jit
def _dot(A, B, C, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr):
    """C (M, N) fp32 += A (M, K) @ B (K, N), A and B bf16; all row-major."""
    m, n, k = tl.arange(0, M), tl.arange(0, N), tl.arange(0, K)
    acc = tl.load(C + m[:, None] * N + n[None, :])
    a = tl.load(A + m[:, None] * K + k[None, :])
    b = tl.load(B + k[:, None] * N + n[None, :])
    acc = tl.dot(a, b, acc, out_dtype=tl.float32)
    tl.store(C + m[:, None] * N + n[None, :], acc)


@triton.jit
def _cast(X, Y, n, BLOCK: tl.constexpr):
    """Y (n,) = X (n,) cast to Y's dtype: fp32 -> bf16 or bf16 -> fp32."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(Y + offs, tl.load(X + offs, mask=offs < n).to(Y.dtype.element_ty), mask=offs < n)


@triton.jit
def _move(X, KEEP, Y, E, n, BLOCK: tl.constexpr):
    """What the kernels do with bf16 besides dots and casts. X (n,) bf16, KEEP (n,) bool; past n the
    masked load's `other` is read. Y (BLOCK,) bf16 = X where KEEP else 0; E (BLOCK,) fp32 = exp2 of
    X upcast, -inf past n."""
    offs = tl.arange(0, BLOCK)
    x = tl.load(X + offs, mask=offs < n, other=float("-inf"))
    keep = tl.load(KEEP + offs, mask=offs < n, other=0) != 0
    tl.store(Y + offs, tl.where(keep, x, 0.0))
    tl.store(E + offs, tl.exp2(x.to(tl.float32)))


def interpreted_dot(a, b, acc):
    c = acc.clone()
    _dot[(1,)](a, b, c, *c.shape, a.shape[1])
    return c


def interpreted_cast(x, dtype):
    y = torch.empty(x.shape, dtype=dtype)
    block = 1024
    _cast[(triton.cdiv(x.numel(), block),)](x, y, x.numel(), BLOCK=block)
    return y


def bits(t):
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


def fp32_of_bits(patterns):
    """fp32 values of the given 32-bit patterns (Python ints, 0 to 2**32 - 1)."""
    return torch.from_numpy(np.array(patterns, dtype=np.uint32).view(np.float32))


SHAPES = [(16, 16, 16), (32, 16, 64), (16, 64, 32), (64, 16, 16)]  # (M, N, K)


@pytest.mark.parametrize("M, N, K", SHAPES)
def test_bf16_dot_of_exactly_summable_values_is_the_fp32_dot_bit_for_bit(M, N, K):
    """Multiples of 1/8 below 4 in magnitude: every product and every partial sum is exact in
    fp32, so a right dot equals torch's fp32 product of the same values whatever the order of
    its sums."""
    g = torch.Generator().manual_seed(M + N + K)
    a, b = ((torch.randint(-31, 32, shape, generator=g) / 8).to(torch.bfloat16) for shape in ((M, K), (K, N)))
    acc = torch.randint(-64, 65, (M, N), generator=g).float()
    expected = acc + a.float() @ b.float()
    assert torch.equal(interpreted_dot(a, b, acc), expected)


@pytest.mark.parametrize("M, N, K", SHAPES)
def test_bf16_dot_is_the_fp32_dot_of_the_bf16_values_up_to_the_order_of_its_sums(M, N, K):
    """The product of two bf16 values (8-bit significands) is exact in fp32, so a dot of bf16
    operands accumulated in fp32 differs from the exact sum only by the fp32 rounding of the K + 1
    additions, whose order numpy's matmul and a GPU's MMA choose each their own way: within
    (K + 1) * 2**-24 * sum |terms| of the exact (fp64) result. Not bit for bit with torch's fp32
    matmul for that reason alone."""
    g = torch.Generator().manual_seed(M * N * K)
    a = (torch.randn(M, K, generator=g) * torch.rand(M, 1, generator=g) * 8).to(torch.bfloat16)
    b = torch.randn(K, N, generator=g).to(torch.bfloat16)
    acc = torch.randn(M, N, generator=g)
    c = interpreted_dot(a, b, acc)
    exact = acc.double() + a.double() @ b.double()
    bound = (K + 1) * 2.0**-24 * (acc.double().abs() + a.double().abs() @ b.double().abs())
    err = (c.double() - exact).abs()
    assert (err <= bound).all(), (
        f"max error {err.max().item():.3e}, bound there {bound.flatten()[err.argmax()].item():.3e}"
    )


def cast_cases():
    """fp32 values whose bf16 rounding is easy to get wrong, each labelled."""
    tie = 2.0**-8  # half a bf16 ulp at 1
    cases = {
        "tie to even, down": 1 + tie,  # 1 + half an ulp: 1.0 is even
        "tie to even, up": 1 + 3 * tie,  # 1 + 1.5 ulp: 1 + 2 ulp is even
        "negative tie, down": -(1 + tie),
        "negative tie, up": -(1 + 3 * tie),
        "just above a tie": 1 + tie + 2.0**-23,
        "just below a tie": 1 + 3 * tie - 2.0**-23,
        "tie carrying into the exponent": 2 - tie,  # rounds up to 2.0
        "bf16 max": BF16_MAX,
        "below half an ulp past bf16 max": fp32_of_bits([0x7F7F7FFF]).item(),  # rounds to bf16 max
        "half an ulp past bf16 max": fp32_of_bits([0x7F7F8000]).item(),  # a tie, to even: inf
        "fp32 max": torch.finfo(torch.float32).max,  # inf
        "-fp32 max": -torch.finfo(torch.float32).max,
        "fp32 subnormal": 1e-40,
        "subnormal tie, down": fp32_of_bits([0x00008000]).item(),  # to 0
        "subnormal tie, up": fp32_of_bits([0x00018000]).item(),  # to 2 * 2**-133
        "smallest bf16 subnormal": 2.0**-133,
        "smallest fp32 normal": torch.finfo(torch.float32).tiny,
        "inf": float("inf"),
        "-inf": float("-inf"),
        "0": 0.0,
        "-0": -0.0,
        "nan": float("nan"),
        "-nan": -float("nan"),
        "nan with low payload": fp32_of_bits([0x7F800001]).item(),  # truncated it would be an inf
    }
    return list(cases), torch.tensor(list(cases.values()), dtype=torch.float32)


def test_fp32_to_bf16_rounds_as_torch_does():
    """Bit for bit, NaN aside: a NaN must stay a NaN (torch's CPU writes 0xFFFF, a GPU 0x7FFF)."""
    names, x = cast_cases()
    got, want = interpreted_cast(x, torch.bfloat16), x.to(torch.bfloat16)
    for name, g, w in zip(names, got, want):
        if w.isnan():
            assert g.isnan(), f"{name}: {g.item()} is not a NaN"
        else:
            assert bits(g) == bits(w), f"{name}: {g.item()!r} ({bits(g).item() & 0xFFFF:#06x}) != torch's {w.item()!r}"
    assert bits(got[names.index("-0")]) == bits(torch.tensor(-0.0, dtype=torch.bfloat16))


def test_fp32_to_bf16_rounds_as_torch_does_around_every_bf16_value():
    """Every bf16 value's fp32 neighbourhood: the value itself, one fp32 ulp up, just below, at and
    just above half a bf16 ulp, and the largest fp32 before the next bf16 value."""
    upper = torch.arange(2**16, dtype=torch.int64)[:, None] << 16
    low = torch.tensor([0, 1, 0x3FFF, 0x7FFF, 0x8000, 0x8001, 0xFFFF])
    x = fp32_of_bits((upper + low).flatten().numpy())
    got, want = interpreted_cast(x, torch.bfloat16), x.to(torch.bfloat16)
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    wrong = (bits(got) != bits(want)) & ~nan
    assert not wrong.any(), f"{int(wrong.sum())} wrong, e.g. {x[wrong][:4].tolist()} -> {got[wrong][:4].tolist()}"


def test_bf16_to_fp32_is_exact_for_every_bf16_pattern():
    x = torch.arange(-(2**15), 2**15, dtype=torch.int16).view(torch.bfloat16)  # subnormals, inf, NaNs too
    assert torch.equal(bits(interpreted_cast(x, torch.float32)), bits(x.float()))


def test_loads_stores_where_and_exp2_on_upcast_values_need_no_correction():
    """What the kernels do with bf16 values besides dots and casts: masked loads with an `other`,
    tl.where between a bf16 tensor and a constant, stores, and math on the fp32 upcast."""
    n, block = 13, 16
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(n, generator=g) * 4).to(torch.bfloat16)
    keep = torch.rand(n, generator=g) < 0.5
    y, e = torch.empty(block, dtype=torch.bfloat16), torch.empty(block)
    _move[(1,)](x, keep, y, e, n, BLOCK=block)
    assert torch.equal(bits(y[:n]), bits(torch.where(keep, x, torch.zeros_like(x))))
    assert torch.equal(bits(y[n:]), bits(torch.zeros(block - n, dtype=torch.bfloat16)))  # -inf not kept
    torch.testing.assert_close(e[:n], torch.exp2(x.float()), rtol=2**-22, atol=0)  # numpy's exp2 and torch's
    assert (e[n:] == 0).all()  # exp2(-inf) of the `other`


def test_without_the_correction_the_interpreter_is_wrong():
    """What the correction corrects is wrong in the Triton installed: the tests above could fail."""
    a = torch.full((16, 16), 1.5, dtype=torch.bfloat16)
    x = torch.tensor([1 + 3 * 2.0**-8, 1e-40])  # a tie rounding up, an fp32 subnormal
    with interpreter_bf16.uncorrected():
        c = interpreted_dot(a, a, torch.zeros(16, 16))
        y = interpreted_cast(x, torch.bfloat16)
        up = interpreted_cast(torch.tensor([2.0**-130], dtype=torch.bfloat16), torch.float32)
    assert interpreter_bf16.installed()
    assert (c - 36.0).abs().min() > 1e3  # 16 * 1.5 * 1.5, from the patterns multiplied as integers
    assert not torch.equal(bits(y), bits(x.to(torch.bfloat16)))
    assert y[0].item() == 1 + 2.0**-7  # truncated
    assert up.item() != 2.0**-130  # a bf16 subnormal upcast wrongly


@pytest.mark.parametrize(
    "faults", [("cast_impl", "create_dot"), ("cast_impl",), ("create_dot",)], ids=["both", "cast", "dot"]
)
def test_the_kernels_probe_finds_each_fault(faults, monkeypatch):
    assert _runtime._probe_interpreter_bf16()
    for name in faults:
        monkeypatch.setattr(interpreter_bf16.Builder, name, interpreter_bf16.ORIGINAL[name])
    assert not _runtime._probe_interpreter_bf16()


def test_the_kernels_ask_once_and_take_bf16_when_the_interpreter_computes_it_right(monkeypatch):
    asked = []
    probe = _runtime._probe_interpreter_bf16
    monkeypatch.setattr(_runtime, "_probe_interpreter_bf16", lambda: asked.append(1) or probe())
    monkeypatch.setattr(_runtime, "_interpreter_bf16_ok", None)
    x = torch.randn(3, 16)
    w, b = torch.randn(8, 16), torch.randn(8)
    kernels.linear_gelu(x, w, b)  # fp32: nothing to ask
    assert asked == []
    for _ in range(2):
        y = kernels.linear_gelu(x.bfloat16(), w.bfloat16(), b.bfloat16())
    assert asked == [1] and y.dtype == torch.bfloat16
