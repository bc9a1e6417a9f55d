"""The Triton linear + activation kernel (`linear_gelu`, GELU or ReLU) and the FFN built
on it, against fp64 references."""

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
