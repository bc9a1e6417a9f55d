"""tests/tf32_emulation.py, TF32 on a CPU: rounding to TF32 as a GPU rounds, and inside the `tf32`
fixture both a Triton dot in TF32 and torch's CPU matmuls multiply the rounded operands, so the TF32
parity tests (test_attention, test_linear_gelu) compare TF32 with TF32, not fp32 with fp32."""

import numpy as np
import pytest
import torch

from fastformer.kernels._runtime import INTERPRET, tl, triton
from tests import tf32_emulation

pytestmark = pytest.mark.skipif(
    not INTERPRET, reason="about Triton's interpreter (TRITON_INTERPRET=1), which a GPU run does not use"
)

ULP = 2.0**-10  # TF32's spacing at 1.0: 10 mantissa bits


@triton.jit
def _dot(A, B, C, N: tl.constexpr, PRECISION: tl.constexpr):
    """C (N, N) = A @ B, all fp32 and row-major, in tl.dot's input precision PRECISION."""
    i = tl.arange(0, N)
    a = tl.load(A + i[:, None] * N + i[None, :])
    b = tl.load(B + i[:, None] * N + i[None, :])
    tl.store(C + i[:, None] * N + i[None, :], tl.dot(a, b, input_precision=PRECISION, out_dtype=tl.float32))


def test_rounds_to_nearest_ties_to_even_and_keeps_inf_and_nan():
    ties, above_a_tie = [1 + ULP / 2, 1 + 3 * ULP / 2, -(1 + 3 * ULP / 2)], 1 + ULP / 2 + 2.0**-20
    x = torch.tensor([*ties, above_a_tie, 2.0**-126, float("inf"), float("nan")])
    y = tf32_emulation.to_tf32(x)
    expected = [1.0, 1 + 2 * ULP, -(1 + 2 * ULP), 1 + ULP, 2.0**-126, float("inf")]
    assert y[:6].tolist() == expected and y[6].isnan()
    x64 = x.double()
    assert tf32_emulation.to_tf32(x64) is x64  # only fp32 is rounded


def test_inside_the_fixture_triton_and_torch_multiply_tf32_operands(tf32):
    torch.manual_seed(0)
    a, b = torch.randn(16, 16), torch.randn(16, 16)
    exact = tf32_emulation.to_tf32(a).double() @ tf32_emulation.to_tf32(b).double()
    ieee = a.double() @ b.double()
    torch_tf32, triton_tf32, triton_ieee = torch.mm(a, b), torch.empty(16, 16), torch.empty(16, 16)
    _dot[(1,)](a, b, triton_tf32, 16, "tf32")
    _dot[(1,)](a, b, triton_ieee, 16, "ieee")
    for tf32_product in (torch_tf32, triton_tf32, torch.addmm(torch.zeros(16), a, b)):
        assert (tf32_product.double() - exact).abs().max() < 1e-5  # fp32 accumulation of the rounded operands
        assert (tf32_product.double() - ieee).abs().max() > 1e-3  # TF32's error, not fp32's
    assert (triton_ieee.double() - ieee).abs().max() < 1e-5  # an IEEE dot is left alone


def test_outside_the_fixture_products_are_ieee():
    a = torch.full((16, 16), 1 + ULP / 4)
    c = torch.empty(16, 16)
    _dot[(1,)](a, a, c, 16, "tf32")
    assert np.allclose(c.numpy(), 16 * (1 + ULP / 4) ** 2, rtol=1e-7)
    assert torch.allclose(torch.mm(a, a), c, rtol=1e-7)
