"""The Triton linear + activation kernel (`linear_gelu`, GELU or ReLU) and the FFN built
on it, against fp64 references."""

import contextlib
import functools
import importlib
import itertools

import pytest
import torch

from fastformer import kernels
from fastformer.kernels._runtime import INTERPRET
from tests.helpers import assert_within_torch_error
from tests.test_add_layer_norm import kernels_of

FP32 = pytest.param(torch.float32, 1e-5, id="fp32")
FP16 = pytest.param(torch.float16, 1e-3, id="fp16")
BF16 = pytest.param(torch.bfloat16, 1e-2, id="bf16", marks=pytest.mark.bf16)


def make_inputs(x_shape, widths, device, seed=0):
    """x and one (weight, bias) pair per consecutive pair of widths, scaled like nn.Linear."""
    g = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(*x_shape, generator=g, dtype=torch.float64)]
    for fan_in, fan_out in itertools.pairwise(widths):
        tensors.append(torch.randn(fan_out, fan_in, generator=g, dtype=torch.float64) / fan_in**0.5)
        tensors.append(torch.randn(fan_out, generator=g, dtype=torch.float64))
    return [t.to(device) for t in tensors]


def run(op, inputs, dtype, upstream_seed=1):
    leaves = [t.detach().to(dtype).clone().requires_grad_() for t in inputs]
    y = op(*leaves)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(upstream_seed), dtype=torch.float64)
    y.backward(dy.to(y.device, y.dtype))
    return [y] + [t.grad for t in leaves]


def check_parity(op, reference_op, inputs, dtype, atol, names):
    reference = run(reference_op, inputs, torch.float64)
    torch_same = run(reference_op, inputs, dtype)
    ours = run(op, inputs, dtype)
    for name, a, r, t in zip(names, ours, reference, torch_same):
        assert a.dtype == dtype, name
        assert_within_torch_error(name, a, r, t, atol)


SHAPES = [
    ((1, 32), 48),  # M = 1
    ((7, 40), 24),  # K, N not multiples of the block
    ((33, 64), 128),
    ((1000, 16), 32),  # M = 1000
    ((3, 11, 32), 64),  # 3-D input
]


@pytest.mark.parametrize("dtype, atol", [FP32, FP16, BF16])
@pytest.mark.parametrize("x_shape, n", SHAPES)
def test_linear_gelu_parity(x_shape, n, dtype, atol, device):
    inputs = make_inputs(x_shape, [x_shape[-1], n], device)
    check_parity(kernels.linear_gelu, kernels.linear_gelu_reference, inputs, dtype, atol, ("y", "dx", "dw", "db"))


@pytest.mark.parametrize("dtype, atol", [FP32, FP16, BF16])
@pytest.mark.parametrize("x_shape, n", [((1, 32), 48), ((7, 40), 24), ((3, 11, 32), 64)])
def test_linear_relu_parity(x_shape, n, dtype, atol, device):
    inputs = make_inputs(x_shape, [x_shape[-1], n], device)
    relu = functools.partial(kernels.linear_gelu, activation="relu")
    relu_reference = functools.partial(kernels.linear_gelu_reference, activation="relu")
    check_parity(relu, relu_reference, inputs, dtype, atol, ("y", "dx", "dw", "db"))


@pytest.mark.parametrize("activation", ["gelu", "relu"])
@pytest.mark.parametrize("dtype, atol", [FP32, FP16, BF16])
@pytest.mark.parametrize("x_shape", [(1, 32), (7, 32), (2, 33, 32)])
def test_feed_forward_parity(x_shape, dtype, atol, activation, device):
    inputs = make_inputs(x_shape, [32, 96, 32], device)
    names = ("y", "dx", "dw1", "db1", "dw2", "db2")
    op = functools.partial(kernels.feed_forward, activation=activation)
    reference_op = functools.partial(kernels.feed_forward_reference, activation=activation)
    check_parity(op, reference_op, inputs, dtype, atol, names)


def test_feed_forward_parity_fp32_in_tf32(tf32, device):
    """The FFN in fp32 where PyTorch's fp32 matmuls take TF32 (as test_attention's TF32 case): its
    error against fp64 within twice the reference's under the same setting."""
    assert kernels._runtime.dot_precision(torch.float32) == "tf32"
    inputs = make_inputs((3, 37, 64), [64, 256, 64], device)
    names = ("y", "dx", "dw1", "db1", "dw2", "db2")
    check_parity(kernels.feed_forward, kernels.feed_forward_reference, inputs, torch.float32, 1e-5, names)


def run_no_grad(op, inputs, dtype):
    with torch.no_grad():
        return op(*(t.to(dtype) for t in inputs))


@pytest.mark.parametrize("activation", ["gelu", "relu"])
@pytest.mark.parametrize("dtype, atol", [FP32, FP16, BF16])
@pytest.mark.parametrize(
    "x_shape, widths",
    [
        ((1, 32), [32, 96, 32]),  # M = 1
        ((7, 40), [40, 24, 40]),  # d, d_ff not multiples of the block; d_ff < d
        ((33, 48), [48, 80, 48]),  # d spans several output tiles: the chunk is recomputed per tile
        ((1000, 16), [16, 64, 16]),  # M = 1000
        ((3, 11, 32), [32, 64, 32]),  # 3-D input
    ],
)
def test_feed_forward_fused_parity(x_shape, widths, dtype, atol, activation, device):
    """The fully fused no-grad FFN against fp64, within twice PyTorch's own error in the same dtype."""
    inputs = make_inputs(x_shape, widths, device)
    fused = functools.partial(kernels.feed_forward_fused, activation=activation)
    reference_op = functools.partial(kernels.feed_forward_reference, activation=activation)
    y = run_no_grad(fused, inputs, dtype)
    assert y.dtype == dtype and y.shape == x_shape
    assert_within_torch_error(
        "y", y, run_no_grad(reference_op, inputs, torch.float64), run_no_grad(reference_op, inputs, dtype), atol
    )


def test_feed_forward_fused_without_biases_non_contiguous_and_refusing_grad(device):
    x, w1, _, w2, _ = (t.float() for t in make_inputs((5, 24), [24, 40, 24], device))
    x = x.t().contiguous().t()  # (5, 24) with strides (1, 5): last dimension not contiguous
    with torch.no_grad():
        y = kernels.feed_forward_fused(x, w1, None, w2, None)
    expected = kernels.feed_forward_reference(x.double(), w1.double(), None, w2.double(), None)
    torch.testing.assert_close(y.double(), expected, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="feed_forward_fused has no backward"):
        kernels.feed_forward_fused(x, w1.requires_grad_(), None, w2, None)
    with pytest.raises(ValueError, match="w2 must have shape"):
        kernels.feed_forward_fused(x, w1, None, w2[:, :-1], None)


# fp16, d = 32: x's rows in one block and the loop over d_ff alone; d = 48: past that bound under
# the interpreter, and fp32 at any d: the two loops
@pytest.mark.parametrize("d", [32, 48])
@pytest.mark.parametrize("dtype, atol", [FP32, FP16])
def test_feed_forward_fused_without_biases(d, dtype, atol, device):
    x, w1, _, w2, _ = make_inputs((7, d), [d, 64, d], device)

    def run(op, dtype):
        with torch.no_grad():
            return op(x.to(dtype), w1.to(dtype), None, w2.to(dtype), None, activation="relu")

    reference = kernels.feed_forward_reference
    assert_within_torch_error(
        "y", run(kernels.feed_forward_fused, dtype), run(reference, torch.float64), run(reference, dtype), atol
    )


@pytest.mark.parametrize("d", [32, 48])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("layout", ["strided", "padded_rows", "expanded"])
def test_feed_forward_fused_reads_every_argument_as_laid_out(d, dtype, layout, device):
    """Each argument as a view gives the result of its contiguous copy, bit for bit, in both kernels."""
    from tests.test_layouts_and_edges import LAYOUTS

    args = [t.to(dtype) for t in make_inputs((7, d), [d, 64, d], device)]
    with torch.no_grad():
        for i, arg in enumerate(args):
            if arg.dim() == 1 and layout == "padded_rows":
                continue
            view = LAYOUTS[layout](arg)
            got = kernels.feed_forward_fused(*args[:i], view, *args[i + 1 :])
            expected = kernels.feed_forward_fused(*args[:i], view.contiguous(), *args[i + 1 :])
            torch.testing.assert_close(
                got, expected, rtol=0, atol=0, msg=lambda m, i=i, layout=layout: f"argument {i} {layout}: {m}"
            )


def test_relu_really_is_relu(device):
    """The relu path is not the gelu path: negative pre-activations give exactly 0."""
    x, w, b = (t.float() for t in make_inputs((9, 32), [32, 16], device))
    y = kernels.linear_gelu(x, w, b, activation="relu")
    pre = x @ w.T + b
    assert (y[pre < -1e-3] == 0).all() and (y[pre > 1e-3] > 0).all()
    with pytest.raises(ValueError, match="activation must be one of"):
        kernels.linear_gelu(x, w, b, activation="tanh")
    with pytest.raises(ValueError, match="activation must be one of"):
        kernels.feed_forward_reference(x, w, b, w.T.contiguous(), None, activation="swish")


def test_conv1d_weight_views_and_non_contiguous_input(device):
    conv = torch.nn.Conv1d(24, 40, kernel_size=1).to(device)
    weight = conv.weight.squeeze(-1)  # (40, 24) view of (40, 24, 1): no copy
    assert weight.data_ptr() == conv.weight.data_ptr()
    x = torch.randn(24, 5, 3, device=device).permute(2, 1, 0)  # (3, 5, 24), non-contiguous
    assert not x.is_contiguous()
    y = kernels.linear_gelu(x, weight, conv.bias)
    expected = kernels.linear_gelu_reference(x.double(), weight.double(), conv.bias.double())
    torch.testing.assert_close(y.double(), expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("dtype, atol", [FP32, FP16, BF16])
def test_without_bias(dtype, atol, device):
    """No bias: the forward reads none and, with gradients, the backward sums none (no partial
    sums); under no_grad no pre-activation is written either."""
    x, w, _ = make_inputs((9, 32), [32, 48], device)
    check_parity(
        lambda x, w: kernels.linear_gelu(x, w, None),
        lambda x, w: kernels.linear_gelu_reference(x, w, None),
        [x, w],
        dtype,
        atol,
        ("y", "dx", "dw"),
    )
    with torch.no_grad():
        y = kernels.linear_gelu(x.to(dtype), w.to(dtype), None)
    torch_same = kernels.linear_gelu_reference(x.to(dtype), w.to(dtype), None)
    assert_within_torch_error("y (no_grad)", y, kernels.linear_gelu_reference(x, w, None), torch_same, atol)


def test_no_grad_skips_the_saved_pre_activation_and_matches(device):
    x, w, b = (t.float() for t in make_inputs((9, 32), [32, 16], device))
    with torch.no_grad():
        y = kernels.linear_gelu(x, w, b)
    torch.testing.assert_close(
        y.double(), kernels.linear_gelu_reference(x.double(), w.double(), b.double()), rtol=0, atol=1e-5
    )


def test_autocast_runs_in_half_precision(device):
    x, w, b = (t.float() for t in make_inputs((5, 32), [32, 16], device))
    half = torch.float16 if device.type == "cpu" else torch.bfloat16
    with torch.autocast(device.type, dtype=half):
        y = kernels.linear_gelu(x, w, b)
    assert y.dtype == half


def test_deterministic(device):
    inputs = make_inputs((50, 32), [32, 48], device)
    first, second = run(kernels.linear_gelu, inputs, torch.float32), run(kernels.linear_gelu, inputs, torch.float32)
    for name, a, b in zip(("y", "dx", "dw", "db"), first, second):
        assert torch.equal(a, b), name


def test_registered_op_schema_and_autograd(device):
    x, w, b = (t.float().requires_grad_() for t in make_inputs((6, 32), [32, 16], device))
    torch.library.opcheck(
        torch.ops.fastformer.linear_gelu_forward.default,
        (x, w, b, "gelu", True),
        test_utils=("test_schema", "test_autograd_registration"),
    )


def test_fused_op_schema(device):
    x, w1, b1, w2, b2 = (t.float() for t in make_inputs((6, 32), [32, 16, 32], device))
    torch.library.opcheck(
        torch.ops.fastformer.feed_forward_fused.default, (x, w1, b1, w2, b2, "gelu"), test_utils=("test_schema",)
    )


@pytest.mark.cuda
def test_registered_op_fake_tensors_and_aot_dispatch():
    x, w, b = (t.float().requires_grad_() for t in make_inputs((6, 32), [32, 16], torch.device("cuda")))
    torch.library.opcheck(torch.ops.fastformer.linear_gelu_forward.default, (x, w, b, "gelu", True))
    torch.library.opcheck(torch.ops.fastformer.linear_gelu_forward.default, (x, w, b, "relu", True))
    x, w1, b1, w2, b2 = (t.float() for t in make_inputs((6, 32), [32, 16, 32], torch.device("cuda")))
    torch.library.opcheck(torch.ops.fastformer.feed_forward_fused.default, (x, w1, b1, w2, b2, "gelu"))


def test_launch_errors_name_the_op(device, uncorrected_interpreter):
    """linear_gelu's launch errors name it: bf16 under the uncorrected interpreter, CPU tensors on
    a GPU machine."""
    x, w, b = (t.float() for t in make_inputs((7, 32), [32, 24], device))
    x, w, b = (t.cpu().to(torch.bfloat16) if INTERPRET else t.cpu() for t in (x, w, b))
    with pytest.raises((TypeError, RuntimeError), match=r"^linear_gelu: "):
        kernels.linear_gelu(x, w, b)


@pytest.mark.parametrize("trained", ["all", "no bias", "x only"])
def test_backward_launches_the_activation_gradient_its_bias_sum_and_the_gemms(trained, device):
    """dPre and db's partial column sums come from one kernel and db from their reduction, in the
    inputs' dtype: no zeros for the pre-activation's gradient, no aten sum or cast. A frozen bias
    gets no reduction, frozen weights no GEMM."""
    x, w, b = (t.half() for t in make_inputs((37, 32), [32, 48], device))
    x.requires_grad_()
    w.requires_grad_(trained != "x only")
    b.requires_grad_(trained == "all")
    y = kernels.linear_gelu(x, w, b)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(y)
    expected = {"triton._activation_grad_kernel": 1, "aten.mm": 1 if trained == "x only" else 2}
    if trained == "all":
        expected["triton._sum_partials_kernel"] = 1
    assert kernels_of(lambda: y.backward(dy)) == expected
    assert (b.grad is None) == (trained != "all") and (w.grad is None) == (trained == "x only")
    if trained == "all":
        assert b.grad.dtype == torch.float16


@pytest.mark.parametrize("layout", ["padded_rows", "expanded"])
def test_activation_gradient_reads_dy_rows_as_they_are_laid_out(layout, device):
    """dY with rows further apart than their length, or one row repeated by a stride-0 view, gives
    the result of its contiguous copy."""
    g = torch.Generator().manual_seed(2)
    pre = torch.randn(70, 24, generator=g).to(device)
    if layout == "padded_rows":
        dy = torch.randn(70, 27, generator=g).to(device)[:, :24]
    else:
        dy = torch.randn(1, 24, generator=g).to(device).expand(70, 24)
    got = torch.ops.fastformer.activation_backward(dy, pre, "gelu", True)
    expected = torch.ops.fastformer.activation_backward(dy.contiguous(), pre, "gelu", True)
    for name, a, e in zip(("dpre", "db"), got, expected):
        assert torch.equal(a, e), name


def test_feed_forward_checks_its_arguments_once(monkeypatch, device):
    """feed_forward validates its arguments, then runs linear_gelu without validating them again."""
    feed_forward_module, linear_module = (
        importlib.import_module(f"fastformer.kernels.{m}") for m in ("feed_forward", "linear_gelu")
    )
    check, calls = linear_module.check_linear_args, []

    def counted(*args, **kwargs):
        calls.append(kwargs.get("weight_name", "weight"))
        return check(*args, **kwargs)

    monkeypatch.setattr(feed_forward_module, "check_linear_args", counted)
    monkeypatch.setattr(linear_module, "check_linear_args", counted)
    x, w1, b1, w2, b2 = (t.float() for t in make_inputs((5, 32), [32, 48, 32], device))
    kernels.feed_forward(x, w1, b1, w2, b2)
    assert calls == ["w1"]
    for op in (kernels.feed_forward, kernels.feed_forward_fused):
        with pytest.raises(ValueError, match="activation must be one of"):
            op(x, w1, b1, w2, b2, activation="tanh")


# ----------------------------------------------------------------------------------------------
# The FFN's backward through its activation: the dH GEMM with dPre in its epilogue
# ----------------------------------------------------------------------------------------------
def ffn_backward_inputs(M, d, d_ff, device, seed=3):
    """dout (M, d), w2 (d, d_ff) and pre (M, d_ff) in fp64, scaled as the FFN's backward sees them."""
    g = torch.Generator().manual_seed(seed)
    dout = torch.randn(M, d, generator=g, dtype=torch.float64)
    w2 = torch.randn(d, d_ff, generator=g, dtype=torch.float64) / d_ff**0.5
    pre = torch.randn(M, d_ff, generator=g, dtype=torch.float64) * 2
    return [t.to(device) for t in (dout, w2, pre)]


def ffn_backward_reference(dout, w2, pre, activation):
    """dPre, db1 and h by PyTorch: dH = dout @ w2 in the inputs' dtype, then the activation's backward."""
    pre = pre.detach().requires_grad_()
    h = TORCH_ACTIVATIONS[activation](pre)
    (dpre,) = torch.autograd.grad(h, pre, dout @ w2)
    return dpre, dpre.sum(0), h.detach()


TORCH_ACTIVATIONS = {"gelu": torch.nn.functional.gelu, "relu": torch.nn.functional.relu}


def ffn_activation_backward(*args):
    return torch.ops.fastformer.ffn_activation_backward(*args)


@pytest.mark.parametrize("activation", ["gelu", "relu"])
@pytest.mark.parametrize("dtype, atol", [FP32, FP16, BF16])
@pytest.mark.parametrize("M, d, d_ff", [(1, 32, 48), (37, 24, 40), (64, 16, 96)])
def test_ffn_activation_backward_parity(M, d, d_ff, dtype, atol, activation, device):
    """dPre, db1 and h again of the fused kernel by the parity rule, for one row, rows and widths
    that are not block multiples, and whole blocks."""
    inputs = ffn_backward_inputs(M, d, d_ff, device)
    reference = ffn_backward_reference(*inputs, activation)
    low = [t.to(dtype) for t in inputs]
    torch_same = ffn_backward_reference(*low, activation)
    ours = ffn_activation_backward(*low, activation, True, True)
    for name, a, r, t in zip(("dpre", "db1", "h"), ours, reference, torch_same):
        assert a.dtype == dtype, name
        assert_within_torch_error(name, a, r, t, atol)


@pytest.mark.parametrize("layout", ["padded_rows", "expanded", "conv1d_weight", "transposed_weight", "padded_pre"])
def test_ffn_activation_backward_reads_every_argument_as_laid_out(layout, device):
    """dOut with rows further apart than their length or one row repeated (stride 0), w2 as a Conv1d
    weight's view or a transposed copy, pre with padded rows: the result of contiguous copies."""
    dout, w2, pre = (t.half() for t in ffn_backward_inputs(40, 32, 48, device))
    if layout == "padded_rows":
        dout = torch.cat([dout, torch.ones_like(dout[:, :5])], 1)[:, :32]
    elif layout == "expanded":
        dout = dout[:1].expand(40, 32)
    elif layout == "conv1d_weight":
        w2 = w2.unsqueeze(-1).contiguous().squeeze(-1)
    elif layout == "transposed_weight":
        w2 = w2.t().contiguous().t()
    else:
        pre = torch.cat([pre, torch.zeros_like(pre[:, :3])], 1)[:, :48]
    got = ffn_activation_backward(dout, w2, pre, "gelu", True, True)
    expected = ffn_activation_backward(dout.contiguous(), w2.contiguous(), pre.contiguous(), "gelu", True, True)
    for name, a, e in zip(("dpre", "db1", "h"), got, expected):
        assert torch.equal(a, e), name


def test_ffn_activation_backward_sums_db1_in_rows_of_partials_whatever_the_tile(monkeypatch, device):
    """A config whose tiles are taller than a row of partial sums (PARTIAL_ROWS) writes its column
    sums in its first row and zeros in the others it covers, the last tile's past M masked off:
    db1 as the one-row-a-tile config gives it, within rounding, h bit for bit, and dPre within 4 ulps of
    its largest element: its dH = dOut @ W2 is a tl.dot, which the interpreter hands to numpy's BLAS,
    whose sums may differ by tile height (bit for bit in CI until 2026-12-05; 1 ulp apart on an AMD
    EPYC's OpenBLAS, 2026-12-07)."""
    linear_gelu = importlib.import_module("fastformer.kernels.linear_gelu")
    if not INTERPRET:
        pytest.skip("the interpreter's config is patched; a GPU runs its configs' own tiles")
    dout, w2, pre = (t.float() for t in ffn_backward_inputs(37, 32, 48, device))
    one_row = ffn_activation_backward(dout, w2, pre, "gelu", True, True)
    tall = dict(linear_gelu._ffn_act_grad.interpreter_meta, BLOCK_M=4 * linear_gelu.PARTIAL_ROWS)
    monkeypatch.setattr(linear_gelu._ffn_act_grad, "interpreter_meta", tall)
    taller = ffn_activation_backward(dout, w2, pre, "gelu", True, True)
    assert torch.equal(taller[2], one_row[2])
    ulps = 4 * torch.finfo(torch.float32).eps * one_row[0].abs().max().item()
    assert (taller[0] - one_row[0]).abs().max().item() <= ulps
    torch.testing.assert_close(taller[1], one_row[1], rtol=1e-6, atol=1e-6)
    reference = ffn_backward_reference(*(t.double() for t in (dout, w2, pre)), "gelu")[1]
    torch.testing.assert_close(taller[1].double(), reference, rtol=0, atol=1e-4)


@pytest.mark.parametrize("M", [0, 1])
def test_ffn_activation_backward_of_no_rows_and_one_row(M, device):
    dout, w2, pre = (t.float() for t in ffn_backward_inputs(M, 16, 32, device))
    dpre, db1, h = ffn_activation_backward(dout, w2, pre, "relu", True, True)
    expected = ffn_backward_reference(dout, w2, pre, "relu")
    for name, a, e in zip(("dpre", "db1", "h"), (dpre, db1, h), expected):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5, msg=name)
    assert db1.shape == (32,) and (M or torch.equal(db1, torch.zeros(32, device=device)))


def test_ffn_activation_backward_deterministic_and_optional_outputs(device):
    dout, w2, pre = (t.half() for t in ffn_backward_inputs(70, 32, 48, device))
    first, second = (ffn_activation_backward(dout, w2, pre, "gelu", True, True) for _ in range(2))
    for name, a, b in zip(("dpre", "db1", "h"), first, second):
        assert torch.equal(a, b), name
    dpre, db1, h = ffn_activation_backward(dout, w2, pre, "gelu", False, False)
    assert torch.equal(dpre, first[0]) and db1.shape == (0,) and h.shape == (0, 48)


def test_ffn_activation_backward_op_schema(device):
    dout, w2, pre = (t.float() for t in ffn_backward_inputs(6, 16, 32, device))
    torch.library.opcheck(
        torch.ops.fastformer.ffn_activation_backward.default, (dout, w2, pre, "gelu", True, True),
        test_utils=("test_schema",),
    )  # fmt: skip


@pytest.mark.parametrize("trained", ["all", "frozen b1", "frozen w2", "x only", "w2 only"])
def test_ffn_backward_takes_dpre_from_the_dh_gemm_epilogue(trained, device):
    """The FFN's backward makes dPre (and h again for dW2, and db1's partials) in the dH GEMM's
    epilogue: no activation-gradient pass, no product for dH; a frozen b1 gets no reduction, a
    frozen weight no product, and an FFN whose first product needs no gradient keeps h."""
    x, w1, b1, w2, b2 = (t.half() for t in make_inputs((37, 32), [32, 48, 32], device))
    x.requires_grad_(trained != "w2 only")
    w1.requires_grad_(trained in ("all", "frozen b1", "frozen w2"))
    b1.requires_grad_(trained in ("all", "frozen w2"))
    w2.requires_grad_(trained not in ("frozen w2", "x only"))
    y = kernels.feed_forward(x, w1, b1, w2, b2)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(y)
    counts = kernels_of(lambda: y.backward(dy))
    first = trained != "w2 only"
    products = {"all": 3, "frozen b1": 3, "frozen w2": 2, "x only": 1, "w2 only": 1}[trained]
    expected = {"aten.mm": products}
    if first:
        expected["triton._ffn_act_grad_kernel"] = 1
    if b1.requires_grad:
        expected["triton._sum_partials_kernel"] = 1
    assert counts == expected
    for t in (x, w1, b1, w2):
        assert (t.grad is None) == (not t.requires_grad)


def test_feed_forward_op_schema_and_autograd(device):
    x, w1, b1, w2, b2 = (t.float().requires_grad_() for t in make_inputs((6, 32), [32, 16, 32], device))
    for store_pre, keep_h in ((True, False), (False, True)):
        torch.library.opcheck(
            torch.ops.fastformer.feed_forward_forward.default, (x, w1, b1, w2, b2, "gelu", store_pre, keep_h),
            test_utils=("test_schema", "test_autograd_registration"),
        )  # fmt: skip


@pytest.mark.parametrize("trained", ["all", "w2 only"])
def test_feed_forward_registered_op_gives_the_plans_bits(trained, device):
    """Under a dispatch mode (as tools.launches counts, and as fake tensors and torch.compile see
    it) feed_forward runs its registered op, whose backward is the plan's: the same kernels and
    configs, so the same output and gradients bit for bit, h kept or written again."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class PassThrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    inputs = make_inputs((2, 19, 32), [32, 48, 32], device)

    def run_ffn(mode):
        leaves = [t.detach().half().clone() for t in inputs]
        for i, t in enumerate(leaves):
            t.requires_grad_(trained == "all" or i == 3)
        with mode:
            y = kernels.feed_forward(*leaves)
            y.backward(torch.ones_like(y))
        return [y.detach()] + [t.grad for t in leaves if t.requires_grad]

    planned, registered = run_ffn(contextlib.nullcontext()), run_ffn(PassThrough())
    assert len(planned) == len(registered)
    for i, (a, b) in enumerate(zip(planned, registered)):
        assert torch.equal(a, b), i


@pytest.mark.parametrize("gemm", ["auto", "cublas"])
def test_planned_feed_forward_backward_prepares_the_dh_gemm_not_the_activation_pass(gemm, monkeypatch, device):
    """In eager mode the plan's backward prepares the dH GEMM's launches, never the activation
    gradient pass's (the tests make a plan's launches again on every call: FASTFORMER_CHECK_PLANS);
    where cuBLAS is chosen (kernels.ffn_gemm), cuBLAS's dH and the pass."""
    linear_gelu = importlib.import_module("fastformer.kernels.linear_gelu")
    prepared = []
    for name in ("_ffn_act_grad_launches", "_activation_launches"):
        original = getattr(linear_gelu.LinearGeluPlan, name)

        def recorded(self, *args, _name=name, _original=original):
            prepared.append(_name)
            return _original(self, *args)

        monkeypatch.setattr(linear_gelu.LinearGeluPlan, name, recorded)
    inputs = [t.half().requires_grad_() for t in make_inputs((23, 32), [32, 80, 32], device, seed=11)]
    with kernels.ffn_gemm(gemm):
        for _ in range(2):
            kernels.feed_forward(*inputs).sum().backward()
    expected = "_activation_launches" if gemm == "cublas" else "_ffn_act_grad_launches"
    assert prepared and set(prepared) == {expected}
