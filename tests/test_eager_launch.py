"""The eager host path (kernels._runtime): a launch that skips Triton's binder after the first call
of a signature, and ops that skip the torch.library dispatcher in eager mode (eager_twin).

- Under the dry-run sm_90a driver (tests/eager_launch_check.py, in a process without
  TRITON_INTERPRET), launches after a cached one, with an unaligned view, an odd length, a length
  of 1, other strides, another dtype, a None argument and a 64-bit integer, each run the compiled
  kernel Triton's own binder picks for those arguments.
- Under the interpreter, each op's eager twin gives bitwise the outputs and gradients of its
  registered torch.library op.
"""

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fastformer import kernels
from fastformer.kernels._dropout import draw_seeds

pytest.importorskip("triton")

# the op modules (the package exports functions of the same names)
attention_module = importlib.import_module("fastformer.kernels.attention")
linear_gelu_module = importlib.import_module("fastformer.kernels.linear_gelu")
add_layer_norm_module = importlib.import_module("fastformer.kernels.add_layer_norm")

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.versions
def test_a_cached_launch_runs_the_kernel_triton_would_pick():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run(
        [sys.executable, "-m", "tests.eager_launch_check"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    cases = report["cases"]
    wrong = [name for name, case in cases.items() if not case["same"]]
    assert not wrong, f"launched another compiled kernel than Triton picks for: {wrong}"
    assert cases["first call"]["new_entry"] and not cases["the same signature"]["new_entry"]
    assert not cases["a Parameter"]["new_entry"]  # a plain tensor to Triton: the model's weights take the cache
    for name in ("an unaligned view", "a length of 1", "another dtype", "a None argument", "a large integer"):
        assert cases[name]["new_entry"], f"{name}: a specialization of its own, so an entry of its own"
    # one compile per specialization Triton makes: the first call's, the unaligned view's, the
    # length of 1's, the dtype's, the None's, the 64-bit integer's (an odd length and another stride
    # are specialized by neither Triton nor the cache key beyond divisibility by 16)
    assert report["compiles"] <= len(cases), report
    assert report["forgotten"], "tools.sm90's reset between cases keeps the eager launches' kernels"


def _inputs(requires_grad=True):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 7, 16, generator=g).requires_grad_(requires_grad) for _ in range(3))
    pad = torch.zeros(2, 7, dtype=torch.bool)
    pad[1, 4:] = True
    return q, k, v, pad


def _grads(out, *leaves):
    torch.manual_seed(1)
    weights = torch.randn_like(out)
    return [g.clone() for g in torch.autograd.grad((out * weights).sum(), leaves)]


def test_the_eager_attention_is_the_registered_op_bitwise():
    q, k, v, pad = _inputs()
    seed = draw_seeds(2, "cpu")[1:2]
    args = (q, k, v, pad, None, True, 0.25, 16**-0.5, seed)
    out_eager, _ = attention_module._attention_forward_eager(*args)
    out_op, _ = attention_module._attention_forward_op(*args)
    assert torch.equal(out_eager, out_op)
    for a, b in zip(_grads(out_eager, q, k, v), _grads(out_op, q, k, v)):
        assert torch.equal(a, b)


def test_the_eager_linear_gelu_and_add_layer_norm_are_their_registered_ops_bitwise():
    g = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(*s, generator=g).requires_grad_() for s in ((5, 8), (12, 8), (12,)))
    y_eager, _ = linear_gelu_module._linear_gelu_forward_eager(x, w, b, "gelu", True)
    y_op, _ = linear_gelu_module._linear_gelu_forward_op(x, w, b, "gelu", True)
    assert torch.equal(y_eager, y_op)
    for a, c in zip(_grads(y_eager, x, w, b), _grads(y_op, x, w, b)):
        assert torch.equal(a, c)

    h, r, lw, lb = (torch.randn(*s, generator=g).requires_grad_() for s in ((5, 12), (5, 12), (12,), (12,)))
    seed = draw_seeds(2, "cpu")[1:2]
    args = (h, r, lw, lb, None, seed, 1e-6, 0.2, torch.float32, None)
    y_eager = add_layer_norm_module._add_layer_norm_forward_eager(*args)[0]
    y_op = add_layer_norm_module._add_layer_norm_forward_op(*args)[0]
    assert torch.equal(y_eager, y_op)
    for a, c in zip(_grads(y_eager, h, r, lw, lb), _grads(y_op, h, r, lw, lb)):
        assert torch.equal(a, c)


def test_the_public_ops_take_the_eager_twin_and_the_registered_op_under_a_dispatch_mode(monkeypatch):
    """Eager calls skip the dispatcher; under a dispatch mode (fake tensors, make_fx, torch.compile's
    tracing) the registered op runs, which those tools see."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    calls = []
    eager = attention_module._attention_forward_eager

    def spy(*args):
        calls.append("eager")
        return eager(*args)

    monkeypatch.setattr(attention_module, "_attention_forward_eager", spy)
    q, k, v, pad = _inputs(requires_grad=False)
    expected = kernels.attention(q, k, v, key_padding_mask=pad)
    assert calls == ["eager"]
    with Seen() as mode:
        out = kernels.attention(q, k, v, key_padding_mask=pad)
    assert calls == ["eager"], "the eager twin ran under a dispatch mode"
    assert mode.ops and torch.equal(out, expected)
