"""What outside test suites break kernels with: argument layouts, empty inner dimensions, bad
scalars and bf16 under the interpreter.

Layouts: every tensor argument of every op, passed as a strided view and as an expanded (stride-0)
view, must give what its `.contiguous()` copy gives, outputs and gradients alike. A kernel that
assumes a layout it was not given reads the wrong elements (or past the tensor's end).
"""

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fastformer import kernels
from fastformer.kernels._runtime import INTERPRET


def strided(t):
    """The values of t in storage twice as wide in every dimension: every stride doubled."""
    base = torch.zeros(*(2 * s for s in t.shape), dtype=t.dtype, device=t.device)
    view = base[tuple(slice(None, None, 2) for _ in t.shape)]
    view.copy_(t)
    return view


def padded_rows(t):
    """The values of t with unit last stride but rows further apart than their length."""
    base = torch.zeros(*t.shape[:-1], t.shape[-1] + 3, dtype=t.dtype, device=t.device)
    view = base[..., : t.shape[-1]]
    view.copy_(t)
    return view


def expanded(t):
    """t's first slice along dim 0, repeated by a stride-0 view to t's shape."""
    return t[:1].expand(t.shape)


LAYOUTS = {"strided": strided, "padded_rows": padded_rows, "expanded": expanded}


def _attention(q, k, v, key_padding_mask, attn_mask):
    return kernels.attention(q, k, v, key_padding_mask=key_padding_mask, attn_mask=attn_mask, causal=True)


def _self_attention(qkv, key_padding_mask):
    return kernels.self_attention(qkv, 3, key_padding_mask=key_padding_mask, causal=True)


def _feed_forward_fused(x, w1, b1, w2, b2):
    with torch.no_grad():
        return kernels.feed_forward_fused(x, w1, b1, w2, b2)


def _inputs(op, device):
    """(function, [(argument name, tensor)]) with small odd sizes."""
    g = torch.Generator().manual_seed(0)
    r = lambda *shape: torch.randn(*shape, generator=g).to(device)  # noqa: E731
    if op == "attention":
        pad = torch.zeros(2, 11, dtype=torch.bool)
        pad[1, 7:] = True  # pads at the end of one sequence
        pad, dense = pad.to(device), (torch.rand(2, 9, 11, generator=g) < 0.2).to(device)
        return _attention, [
            ("q", r(2, 3, 9, 16)),
            ("k", r(2, 3, 11, 16)),
            ("v", r(2, 3, 11, 16)),
            ("key_padding_mask", pad),
            ("attn_mask", dense),
        ]
    if op == "self_attention":
        pad = torch.zeros(2, 9, dtype=torch.bool)
        pad[0, 6:] = True
        return _self_attention, [("qkv", r(2, 9, 3 * 3 * 16)), ("key_padding_mask", pad.to(device))]
    if op == "linear_gelu":
        return kernels.linear_gelu, [("x", r(3, 5, 24)), ("weight", r(20, 24)), ("bias", r(20))]
    if op == "feed_forward":
        return kernels.feed_forward, [
            ("x", r(3, 5, 24)),
            ("w1", r(40, 24)),
            ("b1", r(40)),
            ("w2", r(24, 40)),
            ("b2", r(24)),
        ]
    if op == "feed_forward_fused":
        return _feed_forward_fused, [
            ("x", r(3, 5, 24)),
            ("w1", r(40, 24)),
            ("b1", r(40)),
            ("w2", r(24, 40)),
            ("b2", r(24)),
        ]
    assert op == "add_layer_norm"
    return lambda x, residual, weight, bias: kernels.add_layer_norm(x, residual, weight, bias, 1e-5), [
        ("x", r(3, 5, 24)),
        ("residual", r(3, 5, 24)),
        ("weight", r(24)),
        ("bias", r(24)),
    ]


def _run(fn, args):
    """The output and the gradient of every floating argument (None where there is no backward)."""
    leaves = [a.detach().requires_grad_() if a.is_floating_point() else a for a in args]
    out = fn(*leaves)
    if not out.requires_grad:
        return out, []
    out.backward(torch.linspace(-1, 1, out.numel(), device=out.device).view(out.shape))
    return out, [a.grad for a in leaves if a.is_floating_point()]


OPS = ("attention", "self_attention", "linear_gelu", "feed_forward", "feed_forward_fused", "add_layer_norm")
CASES = [
    (op, index, layout)
    for op in OPS
    for index, (_, arg) in enumerate(_inputs(op, "cpu")[1])
    for layout in LAYOUTS
    if arg.dim() >= 2 or layout != "padded_rows"  # a vector has no rows to pad
]


@pytest.mark.parametrize("op, index, layout", CASES, ids=[f"{op}-{i}-{layout}" for op, i, layout in CASES])
def test_every_argument_as_a_view_gives_the_result_of_its_contiguous_copy(op, index, layout, device):
    fn, named = _inputs(op, device)
    name, arg = named[index]
    view = LAYOUTS[layout](arg)
    args = [t for _, t in named]
    expected = _run(fn, [*args[:index], view.contiguous(), *args[index + 1 :]])
    got = _run(fn, [*args[:index], view, *args[index + 1 :]])
    torch.testing.assert_close(got[0], expected[0], rtol=0, atol=0, msg=lambda m: f"{op} output, {name} {layout}: {m}")
    for g, e in zip(got[1], expected[1]):
        torch.testing.assert_close(g, e, rtol=0, atol=0, msg=lambda m: f"{op} gradient, {name} {layout}: {m}")


class _PassThrough(TorchDispatchMode):
    """A dispatch mode that runs every op as it is: under it an op takes its registered torch.library
    op (kernels._runtime.eager is False), as under torch.compile or make_fx, not its eager plan."""

    def __init__(self):
        super().__init__()
        self.ops = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(str(func))
        return func(*args, **(kwargs or {}))


SELF_CASES = [(op, index, layout) for op, index, layout in CASES if op == "self_attention"]


@pytest.mark.parametrize("op, index, layout", SELF_CASES, ids=[f"{i}-{layout}" for _, i, layout in SELF_CASES])
def test_self_attentions_registered_ops_take_every_argument_as_a_view(op, index, layout):
    """fastformer::self_attention_forward / _backward (a dispatch mode's path): each argument as a
    view gives what its contiguous copy gives, output and qkv's gradient, bit for bit."""
    fn, named = _inputs(op, "cpu")
    name, arg = named[index]
    view = LAYOUTS[layout](arg)
    args = [t for _, t in named]
    with _PassThrough() as mode:
        expected = _run(fn, [*args[:index], view.contiguous(), *args[index + 1 :]])
        got = _run(fn, [*args[:index], view, *args[index + 1 :]])
    assert {"fastformer.self_attention_forward.default", "fastformer.self_attention_backward.default"} <= mode.ops
    torch.testing.assert_close(got[0], expected[0], rtol=0, atol=0, msg=lambda m: f"output, {name} {layout}: {m}")
    for g, e in zip(got[1], expected[1]):
        torch.testing.assert_close(g, e, rtol=0, atol=0, msg=lambda m: f"gradient, {name} {layout}: {m}")


# ----------------------------------------------------------------------------------------------
# Empty inner dimensions: the Triton path and the reference agree
# ----------------------------------------------------------------------------------------------
def test_linear_gelu_with_no_inner_dimension_is_the_activation_of_the_bias(device):
    x, weight, bias = torch.randn(3, 0, device=device), torch.randn(4, 0, device=device), torch.randn(4, device=device)
    got, expected = _run(kernels.linear_gelu, [x, weight, bias]), _run(kernels.linear_gelu_reference, [x, weight, bias])
    torch.testing.assert_close(got[0], expected[0])
    torch.testing.assert_close(got[0], torch.nn.functional.gelu(bias).expand(3, 4))
    for g, e in zip(got[1], expected[1]):
        torch.testing.assert_close(g, e)


def test_feed_forward_with_no_model_dimension_matches_the_reference(device):
    args = [torch.randn(*shape, device=device) for shape in ((3, 0), (4, 0), (4,), (0, 4), (0,))]
    got, expected = _run(kernels.feed_forward, args), _run(kernels.feed_forward_reference, args)
    assert got[0].shape == expected[0].shape == (3, 0)
    for g, e in zip(got[1], expected[1]):
        torch.testing.assert_close(g, e)


def test_add_layer_norm_with_no_features_matches_the_reference(device):
    args = [torch.randn(*shape, device=device) for shape in ((3, 0), (3, 0), (0,), (0,))]
    got = _run(lambda *a: kernels.add_layer_norm(*a, 1e-5), args)
    expected = _run(lambda *a: kernels.add_layer_norm_reference(*a, 1e-5), args)
    assert got[0].shape == expected[0].shape == (3, 0)
    for g, e in zip(got[1], expected[1]):
        assert g.shape == e.shape


# ----------------------------------------------------------------------------------------------
# Scalars that cannot be right: both paths refuse them, naming the argument
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("eps", [0.0, -1e-5, math.nan, math.inf, True, "1e-5"])
@pytest.mark.parametrize("op", [kernels.add_layer_norm, kernels.add_layer_norm_reference])
def test_eps_must_be_positive_and_finite(op, eps):
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match=r"eps must be a positive finite number, got"):
        op(x, x, None, None, eps)


@pytest.mark.parametrize("scale", [0.0, -0.5, math.nan, math.inf, -math.inf, True])
@pytest.mark.parametrize("op", [kernels.attention, kernels.attention_reference])
def test_softmax_scale_must_be_positive_and_finite(op, scale):
    q = torch.randn(1, 1, 4, 16)
    with pytest.raises(ValueError, match=r"softmax_scale must be a positive finite number or None, got"):
        op(q, q, q, softmax_scale=scale)


# ----------------------------------------------------------------------------------------------
# bf16 under an interpreter that computes it wrongly (Triton's as it ships; the tests correct it,
# tests/interpreter_bf16.py): a clear error, never the wrong bf16 products
# ----------------------------------------------------------------------------------------------
BF16_CALLS = {
    "attention": lambda t: kernels.attention(t(1, 1, 4, 16), t(1, 1, 4, 16), t(1, 1, 4, 16)),
    "linear_gelu": lambda t: kernels.linear_gelu(t(3, 16), t(8, 16), t(8)),
    "feed_forward": lambda t: kernels.feed_forward(t(3, 16), t(8, 16), t(8), t(16, 8), t(16)),
    "feed_forward_fused": lambda t: kernels.feed_forward_fused(t(3, 16), t(8, 16), t(8), t(16, 8), t(16)),
    "add_layer_norm": lambda t: kernels.add_layer_norm(t(3, 16), t(3, 16), t(16), t(16), 1e-5),
}


@pytest.mark.bf16
@pytest.mark.skipif(
    not INTERPRET, reason="about Triton's interpreter (TRITON_INTERPRET=1), which a GPU run does not use"
)
@pytest.mark.parametrize("op", BF16_CALLS)
def test_bf16_under_the_interpreter_is_refused(op, uncorrected_interpreter):
    with pytest.raises(TypeError, match=rf"^{op}: bfloat16 is not supported under Triton's interpreter"):
        BF16_CALLS[op](lambda *shape: torch.randn(*shape, dtype=torch.bfloat16))


@pytest.mark.bf16
@pytest.mark.skipif(
    not INTERPRET, reason="about Triton's interpreter (TRITON_INTERPRET=1), which a GPU run does not use"
)
def test_bf16_autocast_under_the_interpreter_is_refused_too(uncorrected_interpreter):
    x, w, b = torch.randn(3, 16), torch.randn(8, 16), torch.randn(8)
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(TypeError, match="bfloat16 is not supported"):
        kernels.linear_gelu(x, w, b)


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_layer_called_alone_takes_strided_and_expanded_inputs(layout, backend, request):
    """EncoderLayer and DecoderLayer called alone (each makes its own ForwardPlan, whose hidden
    states are rows) on a strided or expanded view: the outputs and input gradients of its
    contiguous copy, bit for bit. On one CPU thread: with two, the CPU's BLAS may split a product
    of padded rows across its threads otherwise than the same product of contiguous rows (seen on
    an AMD EPYC: 2e-7 apart in a third of the outputs, on the unchanged tree), which says nothing
    of the layers' handling of layouts."""
    import fastformer
    from fastformer.model import DecoderLayer, EncoderLayer
    from tests.helpers import small_config

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    request.addfinalizer(lambda: torch.set_num_threads(threads))
    torch.manual_seed(0)
    config = small_config(dropout=0.0)
    enc, dec = EncoderLayer(config), DecoderLayer(config)
    x, y = torch.randn(2, 5, config.d_hidn), torch.randn(2, 3, config.d_hidn)
    enc_mask = torch.zeros(2, 5, 5, dtype=torch.bool)
    self_mask, cross_mask = (
        torch.ones(3, 3, dtype=torch.bool).triu(1).expand(2, 3, 3),
        torch.zeros(2, 3, 5, dtype=torch.bool),
    )

    def run(x, y):
        leaves = [t.detach().requires_grad_() for t in (x, y)]
        with fastformer.use_backend(backend):
            enc_out = enc(leaves[0], enc_mask)[0]
            dec_out = dec(leaves[1], enc_out, self_mask, cross_mask)[0]
        dec_out.backward(torch.linspace(-1, 1, dec_out.numel()).view(dec_out.shape))
        return dec_out, *[t.grad for t in leaves]

    view = LAYOUTS[layout]
    for got, expected in zip(run(view(x), view(y)), run(view(x).contiguous(), view(y).contiguous())):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
