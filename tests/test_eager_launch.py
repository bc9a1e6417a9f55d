"""The eager host path (kernels._runtime): a launch that skips Triton's binder after the first call
of a signature, ops that skip the torch.library dispatcher in eager mode (eager_twin), and the ops'
plans (a signature's checks, configs and launch arguments made once: Plans, PreparedLaunch).

- Under the dry-run sm_90a driver (tests/eager_launch_check.py, in a process without
  TRITON_INTERPRET), launches after a cached one, with an unaligned view, an odd length, a length
  of 1, other strides, another dtype, a None argument and a 64-bit integer, each run the compiled
  kernel Triton's own binder picks for those arguments; so do a PreparedLaunch's on pointers
  unaligned, of another dtype, a Parameter or a None, and attention's plan on unaligned views. A
  kept kernel's launcher gets each pointer as its address (an int) and a None as None.
- Under the interpreter, each op's eager twin and its plan give bitwise the outputs and gradients
  of its registered torch.library op; a plan is made once per signature, and a kept plan that
  differs from the one a call makes fails (the tests run with FASTFORMER_CHECK_PLANS=1).
"""

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fastformer import kernels
from fastformer.kernels import _runtime as runtime
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
    assert report["forgotten"], "tools.sm90's reset between cases keeps the eager launches' kernels or the plans"
    wrong = [name for name, same in report["prepared"].items() if not same]
    assert not wrong, f"a PreparedLaunch ran another compiled kernel than Triton picks for: {wrong}"
    wrong = [name for name, took in report["addresses"].items() if not took]
    assert not wrong, f"a kept kernel's launcher did not get the pointers as their addresses (ints): {wrong}"
    wrong = [name for name, same in report["planned"].items() if not same]
    assert not wrong, f"attention's plan ran another compiled kernel than Triton picks for (or made two plans): {wrong}"


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


def _same_but_dh(a, c):
    """Gradients that flow through dH = dOut @ W2 in fp32: the plan computes dH in its Triton GEMM
    (a tl.dot, which the interpreter hands to numpy's BLAS) and the ordinary path by torch.mm
    (PyTorch's BLAS), so on a CPU two libraries sum the same products, and their orders (FMA or
    not, blocking) are theirs: bit for bit where both sum alike (CI until 2026-12-05), 1 ulp of
    the largest element apart on an AMD EPYC's OpenBLAS and MKL (2026-12-07). Within 4 ulps of
    the largest here; bf16 rounds the difference away and stays bit for bit."""
    tol = 4 * torch.finfo(torch.float32).eps * c.abs().max().item()
    assert (a - c).abs().max().item() <= tol, ((a - c).abs().max().item(), tol)


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
    args = (h, r, lw, lb, None, seed, 1e-6, 0.2, torch.float32, None, True)
    y_eager = add_layer_norm_module._add_layer_norm_forward_eager(*args)[0]
    y_op = add_layer_norm_module._add_layer_norm_forward_op(*args)[0]
    assert torch.equal(y_eager, y_op)
    for a, c in zip(_grads(y_eager, h, r, lw, lb), _grads(y_op, h, r, lw, lb)):
        assert torch.equal(a, c)


class Seen(TorchDispatchMode):
    """A dispatch mode that records the ops it sees (fake tensors, make_fx and torch.compile's
    tracing are such modes)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_the_public_ops_take_their_plan_and_the_registered_op_under_a_dispatch_mode(monkeypatch):
    """Eager calls run the op's plan (no dispatcher); under a dispatch mode (fake tensors, make_fx,
    torch.compile's tracing) the registered op runs, which those tools see."""
    calls = []
    run = attention_module._Plan.run

    def spy(plan, *args):
        calls.append("plan")
        return run(plan, *args)

    monkeypatch.setattr(attention_module._Plan, "run", spy)
    q, k, v, pad = _inputs(requires_grad=False)
    expected = kernels.attention(q, k, v, key_padding_mask=pad)
    assert calls == ["plan"]
    with Seen() as mode:
        out = kernels.attention(q, k, v, key_padding_mask=pad)
    assert calls == ["plan"], "the plan ran under a dispatch mode"
    assert "fastformer.attention_forward.default" in mode.ops and torch.equal(out, expected)


def test_a_planned_backward_under_a_dispatch_mode_runs_the_registered_backward():
    q, k, v, pad = _inputs()
    out = kernels.attention(q, k, v, key_padding_mask=pad)  # planned: no mode
    expected = _grads(out, q, k, v)
    out = kernels.attention(q, k, v, key_padding_mask=pad)
    with Seen() as mode:
        grads = _grads(out, q, k, v)
    assert "fastformer.attention_backward.default" in mode.ops
    for a, b in zip(grads, expected):
        assert torch.equal(a, b)


def test_a_plan_is_made_once_per_signature(monkeypatch):
    """Without FASTFORMER_CHECK_PLANS, a signature's later calls skip the checks (its plan holds
    them); a new shape, dtype or flag makes a plan of its own."""
    monkeypatch.setattr(runtime, "CHECK_PLANS", False)
    checks = []
    check = attention_module.check_attention_args

    def counted(*args, **kwargs):
        checks.append(1)
        return check(*args, **kwargs)

    monkeypatch.setattr(attention_module, "check_attention_args", counted)
    monkeypatch.setattr(attention_module, "_plans", runtime.Plans("attention, in a test"))
    q, k, v, pad = _inputs(requires_grad=False)
    kernels.attention(q, k, v, key_padding_mask=pad)
    kernels.attention(q.clone(), k.clone(), v.clone(), key_padding_mask=pad.clone())
    assert len(checks) == 1 and len(attention_module._plans) == 1
    kernels.attention(q, k, v, key_padding_mask=pad, causal=True)
    kernels.attention(q.half(), k.half(), v.half(), key_padding_mask=pad)
    kernels.attention(q[:, :, :5], k, v, key_padding_mask=pad)
    assert len(checks) == 4 and len(attention_module._plans) == 4
    with pytest.raises(ValueError, match="key_padding_mask must have shape"):  # a new signature is checked
        kernels.attention(q, k, v, key_padding_mask=pad[:, :3])
    with pytest.raises(ValueError, match="softmax_scale"):  # unhashable: the ordinary path's checks
        kernels.attention(q, k, v, softmax_scale=[0.5])


def test_a_kept_plan_that_differs_from_the_one_made_fails_under_the_check(monkeypatch):
    monkeypatch.setattr(runtime, "CHECK_PLANS", True)
    cache = {}
    made = iter([1, 1, 2])
    assert runtime.kept(cache, "key", lambda: next(made)) == 1
    assert runtime.kept(cache, "key", lambda: next(made)) == 1
    with pytest.raises(AssertionError, match="differs from what its use makes"):
        runtime.kept(cache, "key", lambda: next(made))


def _dead_wrapper(t):
    """t's values in a tensor torch.func.grad wrapped and left wrapped when it finished (a dead
    wrapper: no storage of its own), as a closure that keeps a transform's intermediate hands it on."""
    leaked = []

    def f(x):
        leaked.append(x * 1)
        return x.sum()

    torch.func.grad(f)(t.detach())
    assert torch._C._functorch.is_functorch_wrapped_tensor(leaked[0])
    return leaked[0]


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_a_dead_functorch_wrapper_takes_the_ops_ordinary_path(grad):
    """A tensor left wrapped by a finished torch.func transform has no storage for a kernel: a
    planned call (its signature already kept, from a plain tensor's call) must not launch on it,
    with or without an autograd node to record; the ordinary path unwraps it and gives what the
    plain tensor gives."""
    g = torch.Generator().manual_seed(0)
    h, r, w, b = (torch.randn(*shape, generator=g) for shape in ((2, 5, 16), (2, 5, 16), (16,), (16,)))
    qkv = torch.randn(2, 5, 3 * 2 * 16, generator=g)
    calls = {
        "add_layer_norm": lambda x: kernels.add_layer_norm(x, r, w, b, 1e-6),
        "self_attention": lambda x: kernels.self_attention(x, 2),
    }
    for name, x in (("add_layer_norm", h), ("self_attention", qkv)):
        dead = _dead_wrapper(x)  # requires grad, as the transform's tensors did
        with torch.set_grad_enabled(grad):
            expected = calls[name](x.requires_grad_(grad))  # keeps the plan of the signature
            assert torch.equal(calls[name](dead), expected), name


def _leaves(g, *shapes, dtype=torch.float32):
    return [torch.randn(*shape, generator=g, dtype=dtype).requires_grad_() for shape in shapes]


def test_each_planned_op_is_its_registered_op_bitwise():
    """The planned path (the public op in eager mode) against the registered op on the same
    arguments: outputs and gradients equal bit for bit, for the model's calls (views of a fused
    projection, key padding and dropout; add + LayerNorm with x_bias, dropout and a low-precision
    copy; the FFN's product)."""
    g = torch.Generator().manual_seed(0)
    seeds = draw_seeds(4, "cpu")
    (qkv,) = _leaves(g, (2, 7, 3 * 3 * 16))
    q, k, v = (t.view(2, 7, 3, 16).transpose(1, 2) for t in qkv.split(48, dim=-1))
    pad = torch.zeros(2, 7, dtype=torch.bool)
    pad[0, 5:] = True
    for _ in range(2):  # the plan's first call and a later one
        planned = kernels.attention(q, k, v, key_padding_mask=pad, dropout_p=0.2, seed=seeds[0:1])
        op, _ = attention_module._attention_forward_op(q, k, v, pad, None, False, 0.2, 16**-0.5, seeds[0:1])
        assert torch.equal(planned, op)
        for a, b in zip(_grads(planned, qkv), _grads(op, qkv)):
            assert torch.equal(a, b)

    x, w, b = _leaves(g, (2, 7, 8), (12, 8), (12,))
    for _ in range(2):
        planned = kernels.linear_gelu(x, w, b)
        op, _ = linear_gelu_module._linear_gelu_forward_op(x.view(14, 8), w, b, "gelu", True)
        assert torch.equal(planned, op.view(2, 7, 12))
        for a, c in zip(_grads(planned, x, w, b), _grads(op, x, w, b)):
            assert torch.equal(a, c)

    h, r, lw, lb, xb = _leaves(g, (2, 7, 12), (2, 7, 12), (12,), (12,), (12,))
    for _ in range(2):
        y, y_low = kernels.add_layer_norm(h, r, lw, lb, 1e-6, 0.2, x_bias=xb, seed=seeds[1:2], lowp_dtype=torch.float16)
        args = (h, r, lw, lb, xb, seeds[1:2], 1e-6, 0.2, torch.float32, torch.float16, True)
        y_op, y_low_op, _, _, _ = add_layer_norm_module._add_layer_norm_forward_op(*args)
        assert torch.equal(y, y_op) and torch.equal(y_low, y_low_op)
        for a, c in zip(_grads(y + y_low.float(), h, r, lw, lb, xb), _grads(y_op + y_low_op.float(), h, r, lw, lb, xb)):
            assert torch.equal(a, c)


@pytest.mark.parametrize("x_shape", [(14, 8), (2, 7, 8)], ids=["rows", "3-D"])
@pytest.mark.parametrize("biases", [True, False], ids=["biases", "no_biases"])
@pytest.mark.parametrize("wanted", ["all", "x", "w2", "w1"])
@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.bf16)])
def test_the_planned_feed_forward_is_its_ordinary_path_bitwise(x_shape, biases, wanted, dtype):
    """feed_forward's plan runs the FFN as one autograd node (its backward computes the second
    product's gradients itself, from the activation its activation-gradient kernel writes again out
    of the stored pre-activation, where the ordinary path keeps the forward's): its output and
    every gradient asked for equal bit for bit what the registered linear_gelu op followed by
    F.linear give, for the model's rows and a 3-D x, with and without biases, when only some inputs
    need a gradient (only those are computed), in fp32 and in bf16 (where the forward's activation
    rounds its input to bf16 first, so that the recomputed one has the same bits)."""
    g = torch.Generator().manual_seed(0)
    x, w1, b1, w2, b2 = _leaves(g, x_shape, (12, 8), (12,), (8, 12), (8,), dtype=dtype)
    if not biases:
        b1 = b2 = None
    tensors = {"x": x, "w1": w1, "b1": b1, "w2": w2, "b2": b2}
    for name, t in tensors.items():
        if t is not None and wanted != "all" and name != wanted:
            t.requires_grad_(False)
    leaves = [t for t in tensors.values() if t is not None and t.requires_grad]
    for _ in range(2):  # the plan's first call and a later one
        planned = kernels.feed_forward(x, w1, b1, w2, b2)
        assert type(planned.grad_fn).__name__ == "_PlannedFeedForwardBackward"
        h, _ = linear_gelu_module._linear_gelu_forward_op(x.reshape(14, 8), w1, b1, "gelu", True)
        ordinary = torch.nn.functional.linear(h, w2, b2).view(planned.shape)
        assert torch.equal(planned, ordinary)
        for t, a, c in zip(leaves, _grads(planned, *leaves), _grads(ordinary, *leaves)):
            if dtype == torch.float32 and t is not w2 and t is not b2:  # through dH: see _same_but_dh
                _same_but_dh(a, c)
            else:
                assert torch.equal(a, c)
    # a sum's gradient comes in expanded (stride 0), as a loss's first backward hands it over
    h, _ = linear_gelu_module._linear_gelu_forward_op(x.reshape(14, 8), w1, b1, "gelu", True)
    planned, ordinary = kernels.feed_forward(x, w1, b1, w2, b2), torch.nn.functional.linear(h, w2, b2)
    grads = zip(leaves, torch.autograd.grad(planned.sum(), leaves), torch.autograd.grad(ordinary.sum(), leaves))
    for t, a, c in grads:
        if dtype == torch.float32 and t is not w2 and t is not b2:
            _same_but_dh(a, c)
        else:
            assert torch.equal(a, c)


def test_self_attention_is_the_registered_attention_on_its_heads_bitwise():
    """self_attention's plan (qkv in, the context out, dqkv written by the kernels: one autograd
    node) against the registered attention op on qkv's views: the context and qkv's gradient equal
    bit for bit, with key padding and dropout, causal or not, on the plan's first call and a later
    one; its backward under a dispatch mode runs the registered self-attention backward op, which
    writes qkv's gradient as one tensor, with the same result."""
    g = torch.Generator().manual_seed(0)
    seeds = draw_seeds(2, "cpu")
    (qkv,) = _leaves(g, (2, 7, 3 * 3 * 16))
    pad = torch.zeros(2, 7, dtype=torch.bool)
    pad[0, 5:] = True

    def planned(causal):
        return kernels.self_attention(qkv, 3, key_padding_mask=pad, causal=causal, dropout_p=0.2, seed=seeds[1:2])

    for causal in (False, True):
        q, k, v = (t.view(2, 7, 3, 16).transpose(1, 2) for t in qkv.split(48, dim=-1))
        op, _ = attention_module._attention_forward_op(q, k, v, pad, None, causal, 0.2, 16**-0.5, seeds[1:2])
        expected = op.transpose(1, 2).reshape(2, 7, 48)
        (expected_grad,) = _grads(expected, qkv)
        for _ in range(2):  # the plan's first call and a later one
            context = planned(causal)
            assert type(context.grad_fn).__name__ == "_PlannedSelfAttentionBackward"
            assert torch.equal(context, expected)
            (grad,) = _grads(context, qkv)
            assert torch.equal(grad, expected_grad)
    context = planned(True)
    with Seen() as mode:
        (grad,) = _grads(context, qkv)
    assert "fastformer.self_attention_backward.default" in mode.ops  # qkv's gradient in one op: no stack
    assert "aten.stack.default" not in mode.ops
    assert torch.equal(grad, expected_grad)


def _fused_calls(g):
    """name -> (fn(), leaves): a call of each fused op on its planned path and on its eager twin
    (the ordinary path in eager mode), the tensors it is differentiated against."""
    x, w1, b1, w2, b2 = _leaves(g, (6, 8), (12, 8), (12,), (8, 12), (8,))
    h, r, lw, lb = _leaves(g, (6, 8), (6, 8), (8,), (8,))
    (qkv,) = _leaves(g, (2, 3, 3 * 2 * 8))
    q, k, v = _inputs()[:3]
    return {
        "attention": (lambda: kernels.attention(q, k, v, causal=True), [q, k, v]),
        "self_attention": (lambda: kernels.self_attention(qkv, 2), [qkv]),
        "linear_gelu": (lambda: kernels.linear_gelu(x, w1, b1), [x, w1, b1]),
        "feed_forward": (lambda: kernels.feed_forward(x, w1, b1, w2, b2), [x, w1, b1, w2, b2]),
        "add_layer_norm": (lambda: kernels.add_layer_norm(h, r, lw, lb, 1e-6), [h, r, lw, lb]),
        # the registered op's body as an autograd.Function: what an op runs in eager mode without a plan
        "linear_gelu, eager twin": (
            lambda: linear_gelu_module._linear_gelu_forward_eager(x, w1, b1, "gelu", True)[0],
            [x, w1, b1],
        ),
    }


@pytest.mark.parametrize(
    "name",
    ["attention", "self_attention", "linear_gelu", "feed_forward", "add_layer_norm", "linear_gelu, eager twin"],
)
def test_a_fused_ops_backward_refuses_a_graph_of_its_gradients_and_batched_gradients(name):
    """A fused op's backward launches kernels that autograd cannot differentiate, so a gradient
    taken through it with create_graph=True would miss the op's part of any second derivative,
    silently (torch's own path gives it; this op gave None before). The backward refuses, naming
    the reference backend, for a loss's first backward too (whose incoming gradient does not
    require grad). Batched gradients (is_grads_batched: a vmap over the backward) would hand the
    kernels tensors with no storage, which failed with torch's "Cannot access storage of
    BatchedTensorImpl": the backward refuses them too. An ordinary backward gives the gradients
    as before."""
    fn, leaves = _fused_calls(torch.Generator().manual_seed(0))[name]
    expected = _grads(fn(), *leaves)
    for incoming in ("weighted", "ones"):
        out = fn()
        loss = (out * torch.randn_like(out)).sum() if incoming == "weighted" else out.sum()
        with pytest.raises(RuntimeError, match=r"no second derivative.*fastformer.use_backend\('reference'\)"):
            torch.autograd.grad(loss, leaves, create_graph=True)
    out = fn()
    batch = torch.randn(3, *out.shape)
    with pytest.raises(RuntimeError, match=r"cannot run batched.*fastformer.use_backend\('reference'\)"):
        torch.autograd.grad(out, leaves, batch, is_grads_batched=True)
    for a, b in zip(_grads(fn(), *leaves), expected):
        assert torch.equal(a, b)
