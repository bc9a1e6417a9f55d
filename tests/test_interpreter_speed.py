"""tests/interpreter_speed.py, which tests/conftest.py installs: the kernels compute bit for bit
what they compute on the interpreter as it ships, and a launch leaves triton.language as the
shipped interpreter leaves it, also when the kernel fails."""

import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from fastformer import kernels  # noqa: E402
from fastformer.kernels._runtime import INTERPRET  # noqa: E402
from tests import interpreter_speed  # noqa: E402

pytestmark = [
    pytest.mark.versions,  # it patches Triton's interpreter: CI runs it on Triton 3.9 and on 3.6
    pytest.mark.skipif(not INTERPRET, reason="the kernels run compiled here, not through the interpreter"),
]


def _ops():
    """Each op's outputs and gradients on small odd shapes: attention with padding, causal and
    dropout (its helpers call triton.language.standard's), add + LayerNorm with dropout, the linear op."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 13, 16, generator=g).requires_grad_() for _ in range(3))
    pad = torch.zeros(2, 13, dtype=torch.bool)
    pad[1, 9:] = True
    o = kernels.attention(q, k, v, key_padding_mask=pad, causal=True, dropout_p=0.25, seed=torch.tensor([3]))
    o.sum().backward()
    x, res = (torch.randn(7, 24, generator=g).requires_grad_() for _ in range(2))
    w, b = torch.ones(24, requires_grad=True), torch.zeros(24, requires_grad=True)
    y = kernels.add_layer_norm(x, res, w, b, 1e-5, 0.25, seed=torch.tensor([5]))
    y.square().sum().backward()
    xl, wl, bl = torch.randn(7, 24, generator=g), torch.randn(20, 24, generator=g), torch.randn(20, generator=g)
    z = kernels.linear_gelu(xl, wl, bl)
    return [o, q.grad, k.grad, v.grad, y, x.grad, res.grad, w.grad, b.grad, z]


def _language_state():
    """Which members of the language modules are the builtins they ship as."""
    return {
        (module.__name__, name): tl.core.is_builtin(getattr(module, name))
        for module in (tl, tl.core, tl.math, tl.tensor)
        for name in dir(module)
    }


def test_the_kernels_compute_what_they_compute_on_the_shipped_interpreter():
    assert interpreter_speed.installed()
    fast = _ops()
    fast_state = _language_state()
    with interpreter_speed.shipped():
        shipped = _ops()
        shipped_state = _language_state()
    for got, expected in zip(fast, shipped):
        assert torch.equal(got, expected)
    assert fast_state == shipped_state


@triton.jit
def _fails_in_a_helper_kernel(X):
    tl.store(X + tl.arange(0, 3), 1.0)  # a range whose length is not a power of 2: an error at run time


def test_a_failing_launch_closes_its_patching():
    x = torch.zeros(4)
    with pytest.raises(Exception, match="power of 2"):
        _fails_in_a_helper_kernel[(1,)](x)
    assert interpreter_speed._launches == []
    assert torch.equal(_ops()[0], _ops()[0])  # and the next launches run as before
