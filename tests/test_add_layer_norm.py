"""The Triton add + LayerNorm kernel against the fp64 reference: outputs, every gradient, dropout."""

import importlib
import warnings

import pytest
import torch

from fastformer import kernels
from fastformer.kernels._reduce import sum_partials
from tests.helpers import assert_within_torch_error
from tools import launches

add_layer_norm_module = importlib.import_module("fastformer.kernels.add_layer_norm")  # the package exports the function

FP32 = pytest.param(torch.float32, 1e-5, id="fp32")
FP16 = pytest.param(torch.float16, 1e-3, id="fp16")
BF16 = pytest.param(torch.bfloat16, 1e-2, id="bf16", marks=pytest.mark.bf16)
NAMES = ("y", "dx", "dresidual", "dweight", "dbias")


def make_inputs(shape, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x, residual, dy = (torch.randn(*shape, generator=g, dtype=torch.float64).to(device) for _ in range(3))
    weight = (1 + 0.5 * torch.randn(shape[-1], generator=g, dtype=torch.float64)).to(device)
    bias = torch.randn(shape[-1], generator=g, dtype=torch.float64).to(device)
    return x, residual, weight, bias, dy


def run(op, x, residual, weight, bias, dy, dtype, eps=1e-5, **kwargs):
    leaves = [t.detach().to(dtype).clone().requires_grad_() for t in (x, residual, weight, bias)]
    y = op(*leaves, eps, **kwargs)
    y.backward(dy.to(y.dtype))
    return [y] + [t.grad for t in leaves]


def check_parity(inputs, dtype, atol, **kwargs):
    reference = run(kernels.add_layer_norm_reference, *inputs, torch.float64, **kwargs)
    torch_same = run(kernels.add_layer_norm_reference, *inputs, dtype, **kwargs)
    ours = run(kernels.add_layer_norm, *inputs, dtype, **kwargs)
    for name, a, r, t in zip(NAMES, ours, reference, torch_same):
        assert a.dtype == t.dtype, name
        assert_within_torch_error(name, a, r, t, atol)


@pytest.mark.parametrize("dtype, atol", [FP32, FP16, BF16])
@pytest.mark.parametrize(
    "shape",
    [
        (1, 16),  # one row
        (7, 48),  # width not a power of two
        (33, 256),  # the tutorial's d_hidn
        # many rows per backward program: under the interpreter 4 programs of 64 rows, 4 steps of 16
        # each, the last program 58 rows (a partial step); the forward takes a program per row
        (250, 32),
        (3, 5, 40),  # 3-D input
        (5, 2500),  # wider than 2048: the backward takes one row at a time
    ],
)
def test_parity(shape, dtype, atol, device):
    check_parity(make_inputs(shape, device), dtype, atol)


def test_parity_with_the_eps_of_the_tutorial(device):
    check_parity(make_inputs((9, 64), device, seed=1), torch.float32, 1e-5, eps=1e-12)


def test_non_contiguous_input(device):
    x, residual, weight, bias, dy = make_inputs((6, 4, 32), device)
    x = x.transpose(0, 1)  # (4, 6, 32) view with strides
    residual, dy = residual.transpose(0, 1), dy.transpose(0, 1)
    assert not x.is_contiguous()
    check_parity((x, residual, weight, bias, dy), torch.float32, 1e-5)


def test_mixed_dtypes_under_autocast_give_fp32_like_layer_norm(device):
    x, residual, weight, bias, _ = make_inputs((5, 32), device)
    half = torch.float16 if device.type == "cpu" else torch.bfloat16
    with torch.autocast(device.type, dtype=half):
        y = kernels.add_layer_norm(x.to(half), residual.float(), weight.float(), bias.float(), 1e-5)
        expected = kernels.add_layer_norm_reference(x.to(half), residual.float(), weight.float(), bias.float(), 1e-5)
    assert y.dtype == expected.dtype == torch.float32
    torch.testing.assert_close(y, expected, rtol=0, atol=1e-5)


def test_deterministic(device):
    # 100 rows: several backward programs (4 under the interpreter: 32, 32, 32 and 4 rows) of several
    # steps, each a partial sum, with dropout; the forward takes a program per row
    inputs = make_inputs((100, 64), device, seed=2)
    torch.manual_seed(0)
    first = run(kernels.add_layer_norm, *inputs, torch.float32, dropout_p=0.2)
    torch.manual_seed(0)
    second = run(kernels.add_layer_norm, *inputs, torch.float32, dropout_p=0.2)
    for name, a, b in zip(NAMES, first, second):
        assert torch.equal(a, b), name


class TestDropout:
    p = 0.25

    def test_keep_rate_within_three_sigma(self, device):
        keep = kernels.add_layer_norm_dropout_mask((64, 256), self.p, device)
        sigma = (self.p * (1 - self.p) / keep.numel()) ** 0.5
        assert abs(keep.float().mean().item() - (1 - self.p)) <= 3 * sigma

    def test_matches_the_reference_with_the_kernels_mask(self, device):
        inputs = make_inputs((2, 9, 48), device, seed=3)
        torch.manual_seed(11)
        ours = run(kernels.add_layer_norm, *inputs, torch.float32, dropout_p=self.p)
        torch.manual_seed(11)
        keep = kernels.add_layer_norm_dropout_mask((2, 9, 48), self.p, device)

        def with_mask(x, residual, weight, bias, eps):
            return kernels.add_layer_norm_reference(x * keep / (1 - self.p), residual, weight, bias, eps)

        reference = run(with_mask, *inputs, torch.float64)
        torch_same = run(with_mask, *inputs, torch.float32)
        for name, a, r, t in zip(NAMES, ours, reference, torch_same):
            assert_within_torch_error(name, a, r, t, 1e-5)

    def test_same_seed_same_result(self, device):
        x, residual, weight, bias, _ = (t.float() for t in make_inputs((4, 32), device))
        torch.manual_seed(5)
        a = kernels.add_layer_norm(x, residual, weight, bias, 1e-5, dropout_p=self.p)
        torch.manual_seed(5)
        b = kernels.add_layer_norm(x, residual, weight, bias, 1e-5, dropout_p=self.p)
        c = kernels.add_layer_norm(x, residual, weight, bias, 1e-5, dropout_p=self.p)
        assert torch.equal(a, b) and not torch.equal(a, c)


def test_without_weight_and_bias(device):
    x, residual, _, _, _ = (t.float() for t in make_inputs((5, 24), device))
    y = kernels.add_layer_norm(x, residual, None, None, 1e-5)
    torch.testing.assert_close(y, torch.nn.functional.layer_norm(x + residual, (24,), eps=1e-5), rtol=0, atol=1e-5)


@pytest.mark.parametrize("dtype, atol", [FP32, FP16, BF16])
def test_without_weight_and_bias_forward_and_backward(dtype, atol, device):
    """Every optional tensor of both kernels absent (weight, bias, x_bias, seed, the half-precision
    copy and its gradient, the partial sums): y, dx and dresidual as the reference's, with the
    rows' kernel alone in the backward (nothing to reduce)."""
    x, residual, _, _, dy = make_inputs((7, 48), device, seed=2)

    def without(op, dtype):
        leaves = [t.detach().to(dtype).clone().requires_grad_() for t in (x, residual)]
        y = op(*leaves, None, None, 1e-5)
        dy_cast = dy.to(y.dtype)
        launched = kernels_of(lambda: y.backward(dy_cast))
        return [y] + [t.grad for t in leaves], launched

    reference, _ = without(kernels.add_layer_norm_reference, torch.float64)
    torch_same, _ = without(kernels.add_layer_norm_reference, dtype)
    ours, launched = without(kernels.add_layer_norm, dtype)
    assert launched == {"triton._add_ln_bwd_kernel": 1}
    for name, a, r, t in zip(NAMES, ours, reference, torch_same):
        assert a.dtype == dtype, name
        assert_within_torch_error(name, a, r, t, atol)


def test_too_wide_rows_fall_back_with_one_warning(device):
    x = torch.randn(2, kernels.add_layer_norm.__globals__["MAX_FEATURES"] + 1, device=device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y = kernels.add_layer_norm(x, x, None, None, 1e-5)
        kernels.add_layer_norm(x, x, None, None, 1e-5)
    assert len([w for w in caught if "not supported by the Triton kernel" in str(w.message)]) <= 1
    torch.testing.assert_close(y, kernels.add_layer_norm_reference(x, x, None, None, 1e-5))


def test_registered_op_schema_and_autograd(device):
    x, residual, weight, bias, _ = (t.float().requires_grad_() for t in make_inputs((5, 32), device))
    torch.library.opcheck(
        torch.ops.fastformer.add_layer_norm_forward.default,
        (x, residual, weight, bias, None, None, 1e-5, 0.0, torch.float32, None, True),
        test_utils=("test_schema", "test_autograd_registration"),
    )


@pytest.mark.cuda
def test_registered_op_fake_tensors_and_aot_dispatch():
    x, residual, weight, bias, _ = (t.float().requires_grad_() for t in make_inputs((5, 32), torch.device("cuda")))
    torch.library.opcheck(
        torch.ops.fastformer.add_layer_norm_forward.default,
        (x, residual, weight, bias, None, None, 1e-5, 0.0, torch.float32, None, True),
    )


@pytest.mark.parametrize("forward", ["registered op", "eager twin"])
def test_a_backward_through_a_forward_run_without_gradients_raises(forward, device):
    """A forward run without save_sum (`add_layer_norm` asks for the sum only when a gradient will be
    taken) keeps nothing for the backward to read: called directly on inputs that require grad, its
    backward raises instead of reading an empty tensor."""
    x, residual, weight, bias, _ = (t.float().requires_grad_() for t in make_inputs((5, 32), device))
    if forward == "registered op":
        op = torch.ops.fastformer.add_layer_norm_forward
    else:
        op = add_layer_norm_module._add_layer_norm_forward_eager
    y, _, _, _, s = op(x, residual, weight, bias, None, None, 1e-5, 0.0, torch.float32, None, False)
    assert s.shape == (0, 32)
    with pytest.raises(RuntimeError, match="backward through a forward run without gradients"):
        y.sum().backward()


def kernels_of(fn):
    """{op: count} of the kernels `fn` launches (tools.launches' counter): Triton launches and aten ops."""
    with launches.counting("cpu") as counter:
        fn()
    counts = {}
    for (_, _, op), n in counter.kernels.items():
        counts[op] = counts.get(op, 0) + n
    return counts


def test_backward_is_two_kernels_with_no_zero_filled_gradients(device):
    """The backward launches the rows' kernel and the reduction of their dW/db partial sums, and
    nothing else: no zeros for the statistics' and y_low's gradients, no aten sums or casts."""
    x, residual, weight, bias, dy = (t.float() for t in make_inputs((9, 64), device))
    x, weight, bias = (t.requires_grad_() for t in (x, weight, bias))
    y = kernels.add_layer_norm(x, residual, weight, bias, 1e-5, dropout_p=0.1)
    assert kernels_of(lambda: y.backward(dy)) == {"triton._add_ln_bwd_kernel": 1, "triton._sum_partials_kernel": 1}
    seed = torch.zeros(1, dtype=torch.int64, device=device)
    _, y_low, mean, rstd, s = torch.ops.fastformer.add_layer_norm_forward(
        x, residual, weight, bias, None, seed, 1e-5, 0.1, torch.float32, None, True
    )
    assert not (mean.requires_grad or rstd.requires_grad or y_low.requires_grad or s.requires_grad)


@pytest.mark.parametrize("trained", ["none", "weight", "bias"])
def test_frozen_parameters_get_no_gradient_and_no_reduction(trained, device):
    """Parameters that take no gradient get none, and with neither the reduction is not launched;
    the gradients that are taken match those with every parameter trained."""
    inputs = [t.float() for t in make_inputs((13, 48), device, seed=4)]
    full = run(kernels.add_layer_norm, *inputs, torch.float32)
    x, residual, weight, bias = (
        t.clone().requires_grad_(name in ("x", trained))
        for name, t in zip(("x", "residual", "weight", "bias"), inputs[:4])
    )
    y = kernels.add_layer_norm(x, residual, weight, bias, 1e-5)
    counts = kernels_of(lambda: y.backward(inputs[4]))
    assert counts.get("triton._sum_partials_kernel", 0) == (trained != "none")
    assert (
        residual.grad is None
        and (weight.grad is None) == (trained != "weight")
        and (bias.grad is None) == (trained != "bias")
    )
    for name, got, expected in zip(NAMES[1:], (x.grad, None, weight.grad, bias.grad), full[1:]):
        if got is not None:
            assert torch.equal(got, expected), name


def test_no_rows(device):
    x, residual, weight, bias = (
        torch.randn(*shape, device=device, requires_grad=True) for shape in ((0, 16), (0, 16), (16,), (16,))
    )
    kernels.add_layer_norm(x, residual, weight, bias, 1e-5).sum().backward()
    assert x.grad.shape == (0, 16) and torch.equal(weight.grad, torch.zeros(16, device=device))
    assert torch.equal(bias.grad, torch.zeros(16, device=device))


@pytest.mark.parametrize("n_partials, n_cols", [(37, 70), (1, 3), (0, 5)])  # not multiples of the blocks; none
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_sum_partials(n_partials, n_cols, dtype, device):
    """The column sums of fp32 partials within fp32 accumulation's error bound (plus the final
    rounding to dtype), and the same bits twice."""
    partial = torch.randn(n_partials, n_cols, generator=torch.Generator().manual_seed(0)).to(device)
    out = sum_partials(partial, torch.empty(n_cols, dtype=dtype, device=device))
    expected = partial.double().sum(0)
    bound = n_partials * 2.0**-24 * partial.double().abs().sum(0)
    if dtype == torch.float16:
        bound += 2.0**-11 * expected.abs()
    assert out.dtype == dtype
    err = (out.double() - expected).abs()
    assert (err <= bound).all(), (
        f"sum_partials: error {err.max().item():.3e} over the bound at column {err.sub(bound).argmax().item()}"
    )
    assert torch.equal(out, sum_partials(partial, torch.empty(n_cols, dtype=dtype, device=device)))
