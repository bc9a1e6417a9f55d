"""add_layer_norm's keyword arguments that cut launches (docs/launches.md): x_bias, added in the forward
and reduced with dW and db in the backward; a seed passed in; y's fp16/bf16 copy written by the
same kernel, whose gradient the backward adds itself. Parity with the fp64 reference, bit-exact
casts and gradients, launch counts, what autograd keeps for the backward, argument checks."""

import contextlib

import pytest
import torch

import fastformer
from fastformer import kernels
from fastformer.kernels import _dropout
from tests.helpers import assert_within_torch_error
from tests.test_add_layer_norm import kernels_of
from tests.test_dropout_bits import expected_keep
from tests.test_eager_launch import Seen
from tools import launches

LEAVES = ("x", "residual", "weight", "bias", "x_bias")
NAMES = ("y", "dx", "dresidual", "dweight", "dbias", "dx_bias")
FP64 = dict.fromkeys(LEAVES, torch.float64)
HALF = torch.float16
BF16 = torch.bfloat16  # a GPU run's autocast dtype; on a CPU through the corrected interpreter
# (dtype of each leaf, autocast dtype, atol)
DTYPES = {
    "fp32": (dict.fromkeys(LEAVES, torch.float32), None, 1e-5),
    "fp16": (dict.fromkeys(LEAVES, HALF), None, 1e-3),
    # the model under autocast: x from a half matmul, the residual stream and the parameters in fp32
    "autocast": ({**dict.fromkeys(LEAVES, torch.float32), "x": HALF}, HALF, 1e-3),
    # x_bias in another dtype than the weight: the sums come out in fp32 and x_bias's is cast
    "mixed": ({**dict.fromkeys(LEAVES, torch.float32), "x": HALF, "x_bias": HALF}, None, 1e-3),
    "autocast-bf16": ({**dict.fromkeys(LEAVES, torch.float32), "x": BF16}, BF16, 1e-2),
}


def cases(*names):
    """The case names for parametrize, the bf16 ones marked `bf16`."""
    return [pytest.param(name, marks=pytest.mark.bf16) if "bf16" in name else name for name in names]


def make_inputs(shape, device, seed=0, x_shape=None, residual_shape=None):
    """fp64 leaves (x and residual of their own shapes, for views) and the gradient of y."""
    g = torch.Generator().manual_seed(seed)
    d = shape[-1]
    inputs = {
        "x": torch.randn(*(x_shape or shape), generator=g, dtype=torch.float64),
        "residual": torch.randn(*(residual_shape or shape), generator=g, dtype=torch.float64),
        "weight": 1 + 0.5 * torch.randn(d, generator=g, dtype=torch.float64),
        "bias": torch.randn(d, generator=g, dtype=torch.float64),
        "x_bias": torch.randn(d, generator=g, dtype=torch.float64),
        "dy": torch.randn(*shape, generator=g, dtype=torch.float64),
    }
    return {name: t.to(device) for name, t in inputs.items()}


def run(op, inputs, dtypes, autocast=None, views=None, eps=1e-5, **kwargs):
    """y and the gradients of the leaves (None for a leaf given as None) after y.backward(dy).
    `views` maps a leaf's name to the view of it the op is called with."""
    leaves = {
        name: None if inputs[name] is None else inputs[name].detach().to(dtypes[name]).clone().requires_grad_()
        for name in LEAVES
    }
    args = {name: (views or {}).get(name, lambda t: t)(t) if t is not None else None for name, t in leaves.items()}
    device_type = inputs["x"].device.type
    with torch.autocast(device_type, dtype=autocast or HALF, enabled=autocast is not None):
        y = op(args["x"], args["residual"], args["weight"], args["bias"], eps, x_bias=args["x_bias"], **kwargs)
    y.backward(inputs["dy"].to(y.dtype))
    return [y] + [None if t is None else t.grad for t in leaves.values()]


def check_parity(inputs, case, op=kernels.add_layer_norm, reference=kernels.add_layer_norm_reference, **kwargs):
    dtypes, autocast, atol = DTYPES[case]
    oracle = run(reference, inputs, FP64, **kwargs)
    torch_same = run(reference, inputs, dtypes, autocast, **kwargs)
    ours = run(op, inputs, dtypes, autocast, **kwargs)
    for name, a, r, t in zip(NAMES, ours, oracle, torch_same):
        if r is None:
            assert a is None and t is None, name
            continue
        assert a.dtype == t.dtype, f"{name}: {a.dtype} != torch's {t.dtype}"
        assert_within_torch_error(name, a, r, t, atol)


def without(inputs, *names):
    return {**inputs, **dict.fromkeys(names)}


# ----------------------------------------------------------------------------------------------
# x_bias
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", cases(*DTYPES))
@pytest.mark.parametrize(
    "shape",
    [
        (7, 33),  # odd width; fewer rows than the backward's BLOCK_M (16 at d = 33)
        (33, 256),  # the tutorial's d_hidn; 33 rows: 3 programs of 3 steps of BLOCK_M = 4, the last one short
        (3, 5, 40),  # 3-D, 15 rows
    ],
)
def test_parity_with_x_bias(shape, case, device):
    check_parity(make_inputs(shape, device), case)


@pytest.mark.parametrize("case", ["fp32", "autocast"])
@pytest.mark.parametrize("absent", [("weight",), ("bias",), ("weight", "bias")])
def test_parity_with_x_bias_without_weight_or_bias(absent, case, device):
    check_parity(without(make_inputs((9, 33), device, seed=1), *absent), case)


@pytest.mark.parametrize("case", cases("fp32", "autocast", "autocast-bf16"))
def test_parity_with_x_bias_and_dropout_with_the_seeds_mask(case, device):
    """Dropout falls on x + x_bias with the keep-mask of the given seed (`_dropout._dropout_mask`),
    in the forward and in every gradient, d(x_bias) included."""
    p, shape = 0.3, (2, 9, 48)
    seed = torch.tensor([0x0123456789ABCDEF], dtype=torch.int64, device=device)
    keep = _dropout._dropout_mask(torch.empty(18, 48, dtype=torch.uint8, device=device), seed, p).bool().view(shape)

    def with_mask(x, residual, weight, bias, eps, x_bias):
        return kernels.add_layer_norm_reference((x + x_bias) * keep / (1 - p), residual, weight, bias, eps)

    def ours(x, residual, weight, bias, eps, x_bias):
        return kernels.add_layer_norm(x, residual, weight, bias, eps, p, x_bias=x_bias, seed=seed)

    check_parity(make_inputs(shape, device, seed=2), case, op=ours, reference=with_mask)


VIEWS = {
    # the kernels read these views as they are: x a slice of wider rows (row stride 38), the
    # residual one row expanded over every row (row stride 0)
    "strided x, expanded residual": (
        dict(x_shape=(3, 7, 38), residual_shape=(1, 1, 33)),
        {"x": lambda t: t[..., :33], "residual": lambda t: t.expand(3, 7, 33)},
    ),
    "expanded x, strided residual": (
        dict(x_shape=(1, 1, 33), residual_shape=(3, 7, 40)),
        {"x": lambda t: t.expand(3, 7, 33), "residual": lambda t: t[..., 7:]},
    ),
    # views whose rows do not merge into one stride, which the launchers copy
    "transposed x, half-expanded residual": (
        dict(x_shape=(7, 3, 33), residual_shape=(1, 7, 33)),
        {"x": lambda t: t.transpose(0, 1), "residual": lambda t: t.expand(3, 7, 33)},
    ),
}


@pytest.mark.parametrize("case", ["fp32", "autocast"])
@pytest.mark.parametrize("layout", list(VIEWS))
def test_parity_with_x_bias_on_views(layout, case, device):
    shapes, views = VIEWS[layout]
    inputs = make_inputs((3, 7, 33), device, seed=3, **shapes)
    args = {name: views.get(name, lambda t: t)(inputs[name]) for name in ("x", "residual")}
    assert not args["x"].is_contiguous() and not args["residual"].is_contiguous()
    check_parity(inputs, case, views=views)


def test_x_bias_alone_needs_the_reduction_and_gets_the_same_bits(device):
    """With the weight and bias frozen, d(x_bias) still goes through the partial sums and their one
    reduction, bit for bit as with every parameter trained; with nothing to reduce, the rows' kernel
    alone runs."""
    inputs = make_inputs((13, 48), device, seed=4)
    dtypes = dict.fromkeys(LEAVES, torch.float32)
    full = run(kernels.add_layer_norm, inputs, dtypes)
    x, residual, weight, bias, x_bias, dy = (inputs[name].float() for name in (*LEAVES, "dy"))
    x, x_bias = x.requires_grad_(), x_bias.requires_grad_()
    y = kernels.add_layer_norm(x, residual, weight, bias, 1e-5, x_bias=x_bias)
    assert kernels_of(lambda: y.backward(dy)) == {"triton._add_ln_bwd_kernel": 1, "triton._sum_partials_kernel": 1}
    assert torch.equal(x_bias.grad, full[5]) and torch.equal(x.grad, full[1])

    x = x.detach().requires_grad_()
    y = kernels.add_layer_norm(x, residual, weight, bias, 1e-5, x_bias=x_bias.detach())
    assert kernels_of(lambda: y.backward(dy)) == {"triton._add_ln_bwd_kernel": 1}
    assert torch.equal(x.grad, full[1])


def test_half_parameters_get_their_sums_in_half_without_casts(device):
    """When the parameters whose sums are taken share a dtype, the reduction writes that dtype."""
    inputs = make_inputs((9, 32), device)
    leaves = [inputs[name].half().requires_grad_() for name in LEAVES]
    y = kernels.add_layer_norm(*leaves[:4], 1e-5, x_bias=leaves[4])
    dy = inputs["dy"].half()
    assert kernels_of(lambda: y.backward(dy)) == {"triton._add_ln_bwd_kernel": 1, "triton._sum_partials_kernel": 1}
    assert all(t.grad.dtype == torch.float16 for t in leaves)


# ----------------------------------------------------------------------------------------------
# seed
# ----------------------------------------------------------------------------------------------
def float_inputs(shape, device, seed=0):
    inputs = make_inputs(shape, device, seed)
    return [inputs[name].float() for name in ("x", "residual", "weight", "bias", "x_bias")]


def test_a_given_seed_decides_the_mask_and_draws_nothing(device):
    """The mask is the documented Philox function of the seed's value (tests/test_dropout_bits.py),
    the same seed gives the same bits, another seed others, and torch's generator is left alone."""
    p = 0.25
    x, residual, weight, bias, x_bias = float_inputs((17, 70), device)
    seeds = torch.tensor([7, 0x5EED5EED5EED], dtype=torch.int64, device=device)
    x.requires_grad_()

    torch.manual_seed(0)
    y = kernels.add_layer_norm(x, residual, weight, bias, 1e-5, p, x_bias=x_bias, seed=seeds[1:2])
    after = torch.rand(4)
    torch.manual_seed(0)
    assert torch.equal(after, torch.rand(4)), "the op drew from torch's generator"
    (dx,) = torch.autograd.grad(y, x, torch.randn_like(y))
    assert torch.equal((dx != 0).cpu(), expected_keep(0x5EED5EED5EED, 17, 70, p))  # dropped elements get no gradient

    again = kernels.add_layer_norm(x, residual, weight, bias, 1e-5, p, x_bias=x_bias, seed=seeds[1:2].clone())
    other = kernels.add_layer_norm(x, residual, weight, bias, 1e-5, p, x_bias=x_bias, seed=seeds[0:1])
    assert torch.equal(y, again) and not torch.equal(y, other)


def test_a_seed_without_dropout_is_checked_and_unused(device):
    x, residual, weight, bias, x_bias = float_inputs((5, 32), device)
    seed = _dropout.draw_seeds(2, device)[1:]
    y = kernels.add_layer_norm(x, residual, weight, bias, 1e-5, x_bias=x_bias, seed=seed)
    assert torch.equal(y, kernels.add_layer_norm(x, residual, weight, bias, 1e-5, x_bias=x_bias))


@pytest.mark.parametrize("op", [kernels.add_layer_norm, kernels.add_layer_norm_reference])
@pytest.mark.parametrize(
    "seed, error",
    [
        (lambda d: torch.zeros(1, dtype=torch.int32, device=d), ValueError),  # wrong dtype
        (lambda d: torch.zeros(2, dtype=torch.int64, device=d), ValueError),  # two seeds
        (lambda d: torch.zeros(1, device=d), ValueError),  # float
        (lambda d: 5, TypeError),  # not a tensor
        (lambda d: torch.zeros(1, dtype=torch.int64, device="meta"), ValueError),  # another device
    ],
    ids=["int32", "numel-2", "float", "int", "meta"],
)
def test_bad_seeds_are_refused(op, seed, error, device):
    x, residual, weight, bias, x_bias = float_inputs((3, 16), device)
    with pytest.raises(error, match=r"^seed must"):
        op(x, residual, weight, bias, 1e-5, 0.1, x_bias=x_bias, seed=seed(device))


# ----------------------------------------------------------------------------------------------
# lowp_dtype
# ----------------------------------------------------------------------------------------------
# (dtype of x, of the residual and the parameters, autocast, lowp_dtype)
LOWP_CASES = {
    "fp32": (torch.float32, torch.float32, None, HALF),
    "autocast": (HALF, torch.float32, HALF, HALF),
    "fp16": (HALF, HALF, None, HALF),
    "autocast-bf16": (BF16, torch.float32, BF16, BF16),
}


def lowp_leaves(case, device, shape=(2, 11, 33)):
    x_dtype, dtype, _, _ = LOWP_CASES[case]
    x, residual, weight, bias, x_bias = float_inputs(shape, device, seed=5)
    return [x.to(x_dtype).requires_grad_()] + [t.to(dtype).requires_grad_() for t in (residual, weight, bias, x_bias)]


def fused(case, leaves, seed, lowp_dtype=None):
    x, residual, weight, bias, x_bias = leaves
    autocast = LOWP_CASES[case][2]
    with torch.autocast(x.device.type, dtype=autocast or HALF, enabled=autocast is not None):
        return kernels.add_layer_norm(
            x, residual, weight, bias, 1e-5, 0.1, x_bias=x_bias, seed=seed, lowp_dtype=lowp_dtype
        )


@pytest.mark.parametrize("case", cases(*LOWP_CASES))
def test_y_low_is_y_cast_bit_for_bit(case, device):
    leaves = lowp_leaves(case, device)
    seed = _dropout.draw_seed(device)
    lowp = LOWP_CASES[case][3]
    y, y_low = fused(case, leaves, seed, lowp)
    assert y_low.dtype == lowp and y_low.shape == y.shape
    assert torch.equal(y_low, y.to(lowp))
    assert torch.equal(y, fused(case, leaves, seed))  # y is what it is without y_low
    assert y_low.data_ptr() != y.data_ptr()


@pytest.mark.parametrize(
    "case, used",
    [
        pytest.param(case, used, marks=pytest.mark.bf16 if "bf16" in case else ())
        for case in LOWP_CASES
        for used in ("both", "y", "y_low")
        # an fp16 y's two gradients are added in fp32, where autograd adds them in fp16
        if (case, used) != ("fp16", "both")
    ],
)
def test_gradients_through_y_and_y_low_are_autograds_bit_for_bit(case, used, device):
    """The backward adds the gradients of an fp32 y and of y_low in fp32, as autograd adds those of
    y and of y.to(lowp); every gradient equals that of the op without lowp_dtype followed by the
    cast, also when only one of the two outputs is used."""
    leaves = lowp_leaves(case, device)
    seed = _dropout.draw_seed(device)
    g = torch.Generator().manual_seed(6)
    a, b = (torch.randn(2, 11, 33, generator=g).to(device) for _ in range(2))

    def loss(y, y_low):
        terms = {"y": (y.float() * a).sum(), "y_low": (y_low.float() * b).sum()}
        return sum(terms.values()) if used == "both" else terms[used]

    lowp = LOWP_CASES[case][3]
    y, y_low = fused(case, leaves, seed, lowp)
    grads = torch.autograd.grad(loss(y, y_low), leaves)
    y = fused(case, leaves, seed)
    expected = torch.autograd.grad(loss(y, y.to(lowp)), leaves)
    for name, got, want in zip(LEAVES, grads, expected):
        assert got.dtype == want.dtype and torch.equal(got, want), name


class _Stop(torch.autograd.Function):
    """The identity, passing no gradient back."""

    @staticmethod
    def forward(ctx, t):
        return t.clone()

    @staticmethod
    def backward(ctx, grad):
        return None


def test_no_gradient_from_either_output_gives_none_and_launches_nothing(device):
    leaves = lowp_leaves("autocast", device)
    y, y_low = fused("autocast", leaves, _dropout.draw_seed(device), HALF)
    loss = _Stop.apply(y).sum() + _Stop.apply(y_low).float().sum() + leaves[1].sum()
    grads = []
    counts = kernels_of(lambda: grads.extend(torch.autograd.grad(loss, leaves, allow_unused=True)))
    assert not any(op.startswith("triton.") for op in counts)
    assert [g is None for g in grads] == [True, False, True, True, True]


def test_reference_returns_y_and_its_cast(device):
    x, residual, weight, bias, x_bias = float_inputs((4, 24), device)
    y, y_low = kernels.add_layer_norm_reference(
        x, residual, weight, bias, 1e-5, x_bias=x_bias, lowp_dtype=torch.bfloat16
    )
    assert torch.equal(y, kernels.add_layer_norm_reference(x, residual, weight, bias, 1e-5, x_bias=x_bias))
    assert y_low.dtype == torch.bfloat16 and torch.equal(y_low, y.to(torch.bfloat16))


# ----------------------------------------------------------------------------------------------
# launches, the backend, the registered op
# ----------------------------------------------------------------------------------------------
def test_the_models_call_is_one_kernel_forward_and_two_backward(device):
    """Under fp16 autocast with x_bias, a given seed, dropout and y's fp16 copy: the forward is one
    launch (no seed drawn, no cast of y), and the backward of both outputs with respect to every
    input is the rows' kernel and one reduction (no sum for x_bias, no cast or add of y_low's
    gradient, no zero gradients)."""
    leaves = lowp_leaves("autocast", device)
    seed = _dropout.draw_seeds(3, device)[1:2]
    dy, dy_low = torch.randn(2, 11, 33, device=device), torch.randn(2, 11, 33, device=device).half()
    with launches.counting("cpu") as counter:
        y, y_low = fused("autocast", leaves, seed, HALF)
        counter.phase = "backward"
        grads = torch.autograd.grad((y, y_low), leaves, (dy, dy_low))
    assert counter.ops("forward") == {"triton._add_ln_fwd_kernel": 1}
    assert counter.ops("backward") == {"triton._add_ln_bwd_kernel": 1, "triton._sum_partials_kernel": 1}
    assert [g.dtype for g in grads] == [HALF] + [torch.float32] * 4


@pytest.mark.parametrize("name", ["triton", "reference"])
def test_the_backend_passes_the_new_arguments_through(name, device):
    x, residual, weight, bias, x_bias = float_inputs((6, 40), device)
    seed = _dropout.draw_seed(device)
    op = kernels.add_layer_norm if name == "triton" else kernels.add_layer_norm_reference
    args = (x, residual, weight, bias, 1e-5, 0.0)
    with fastformer.use_backend(name):
        y, y_low = fastformer.backend.add_layer_norm(*args, x_bias=x_bias, seed=seed, lowp_dtype=HALF)
    expected, expected_low = op(*args, x_bias=x_bias, seed=seed, lowp_dtype=HALF)
    assert torch.equal(y, expected) and torch.equal(y_low, expected_low)
    assert not torch.equal(y, op(*args))  # x_bias reached the op


def _opcheck_args(device):
    x, residual, weight, bias, x_bias = (t.requires_grad_() for t in float_inputs((5, 32), device))
    seed = _dropout.draw_seed(device)
    return (x.half(), residual, weight, bias, x_bias, seed, 1e-5, 0.1, torch.float32, HALF, True)


def test_registered_op_schema_and_autograd_with_the_new_inputs(device):
    """The seed is an input the op does not return (torch.library's schema check)."""
    torch.library.opcheck(
        torch.ops.fastformer.add_layer_norm_forward.default,
        _opcheck_args(device),
        test_utils=("test_schema", "test_autograd_registration"),
    )


@pytest.mark.cuda
def test_registered_op_fake_tensors_and_aot_dispatch_with_the_new_inputs():
    torch.library.opcheck(torch.ops.fastformer.add_layer_norm_forward.default, _opcheck_args(torch.device("cuda")))


# ----------------------------------------------------------------------------------------------
# what autograd keeps
# ----------------------------------------------------------------------------------------------
# (dtype of x, of the residual and the parameters, autocast and lowp_dtype)
SAVED_CASES = {
    "fp32": (torch.float32, torch.float32, None),
    # the model under bf16 autocast: x a bf16 product's output, the residual stream in fp32
    "autocast-bf16": (BF16, torch.float32, BF16),
}


@pytest.mark.parametrize("path", ["planned", "eager twin", "registered op"])
@pytest.mark.parametrize("case", cases(*SAVED_CASES))
def test_autograd_keeps_the_fp32_sum_not_x_or_the_residual(case, path, device):
    """With a gradient to take, the op keeps one (rows, d) fp32 tensor for its backward, the sum
    it normalized, and the rows' statistics, the seed and the weight: no storage of x or of the
    residual. So on each path: its plan, its eager twin (x's rows not a view: no plan) and its
    registered op (under a dispatch mode, as torch.compile's tracing sees it)."""
    x_dtype, dtype, autocast = SAVED_CASES[case]
    shape, rows = (2, 7, 33), 14
    x, residual, weight, bias, x_bias = float_inputs(shape, device, seed=7)
    x = x.to(x_dtype)
    if path == "eager twin":
        x = x.transpose(0, 1).contiguous().transpose(0, 1)
    leaves = [x.requires_grad_()] + [t.to(dtype).requires_grad_() for t in (residual, weight, bias, x_bias)]
    x, residual, weight, bias, x_bias = leaves
    seed = _dropout.draw_seed(device)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    mode = Seen() if path == "registered op" else contextlib.nullcontext()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), mode:
        with torch.autocast(device.type, dtype=autocast or HALF, enabled=autocast is not None):
            out = kernels.add_layer_norm(
                x, residual, weight, bias, 1e-5, 0.1, x_bias=x_bias, seed=seed, lowp_dtype=autocast
            )
        y = out if autocast is None else out[0]
        grads = torch.autograd.grad(y.sum(), leaves)
    node = type(y.grad_fn).__name__
    if path == "planned":
        assert node == "_PlannedAddLayerNormBackward", node
    elif path == "eager twin":
        assert node.endswith("_eagerBackward"), node
    else:
        assert "fastformer.add_layer_norm_forward.default" in mode.ops, node
    storage = {t.untyped_storage().data_ptr() for t in saved}
    assert x.untyped_storage().data_ptr() not in storage and residual.untyped_storage().data_ptr() not in storage
    kept = sorted((tuple(t.shape), t.dtype) for t in saved)
    expected = [((1,), torch.int64), ((rows,), torch.float32), ((rows,), torch.float32)]
    expected += [((rows, 33), torch.float32), ((33,), dtype)]  # the sum; the weight, a leaf
    assert kept == sorted(expected), kept
    assert [g.dtype for g in grads] == [x_dtype] + [dtype] * 4


# ----------------------------------------------------------------------------------------------
# bad arguments
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("op", [kernels.add_layer_norm, kernels.add_layer_norm_reference])
@pytest.mark.parametrize(
    "x_bias, error, match",
    [
        (lambda d: torch.zeros(17, device=d), ValueError, r"x_bias must have shape \(16,\)"),
        (lambda d: torch.zeros(1, 16, device=d), ValueError, "x_bias must have 1 dimensions"),
        (lambda d: torch.zeros(16, dtype=torch.int64, device=d), TypeError, "x_bias must be one of"),
        (lambda d: torch.zeros(16, device="meta"), ValueError, "x_bias on meta"),
    ],
    ids=["shape", "ndim", "dtype", "device"],
)
def test_bad_x_bias_is_refused(op, x_bias, error, match, device):
    x, residual, weight, bias, _ = float_inputs((3, 16), device)
    with pytest.raises(error, match=match):
        op(x, residual, weight, bias, 1e-5, x_bias=x_bias(device))


def test_fp64_x_bias_is_refused_by_the_kernel_only(device):
    x, residual, weight, bias, x_bias = float_inputs((3, 16), device)
    with pytest.raises(TypeError, match="x_bias must be one of"):
        kernels.add_layer_norm(x, residual, weight, bias, 1e-5, x_bias=x_bias.double())
    kernels.add_layer_norm_reference(*(t.double() for t in (x, residual, weight, bias)), 1e-5, x_bias=x_bias.double())


@pytest.mark.parametrize("op", [kernels.add_layer_norm, kernels.add_layer_norm_reference])
@pytest.mark.parametrize("lowp_dtype", [torch.float32, torch.int8, "float16"])
def test_bad_lowp_dtype_is_refused(op, lowp_dtype, device):
    x, residual, weight, bias, _ = float_inputs((3, 16), device)
    with pytest.raises(TypeError, match=r"lowp_dtype must be None, torch\.float16 or torch\.bfloat16"):
        op(x, residual, weight, bias, 1e-5, lowp_dtype=lowp_dtype)


@pytest.mark.bf16
@pytest.mark.skipif(
    not kernels.INTERPRET,
    reason="about Triton's interpreter (TRITON_INTERPRET=1), which refuses bf16 and a GPU run does not use",
)
def test_bf16_lowp_dtype_is_refused_under_the_interpreter(device, uncorrected_interpreter):
    """fp32 inputs, only y_low in bf16: refused as well."""
    x, residual, weight, bias, _ = float_inputs((3, 16), device)
    with pytest.raises(TypeError, match=r"lowp_dtype=torch\.bfloat16 is not supported under Triton's interpreter"):
        kernels.add_layer_norm(x, residual, weight, bias, 1e-5, lowp_dtype=torch.bfloat16)


@pytest.mark.parametrize(
    "x_bias_view",
    [
        lambda d: torch.randn(2 * d).requires_grad_(),  # every other element: stride 2
        lambda d: torch.randn(1).requires_grad_(),  # one value expanded over the row: stride 0
    ],
    ids=["strided", "expanded"],
)
def test_x_bias_as_a_strided_or_expanded_view(x_bias_view, device):
    """The kernels read x_bias with its own stride: a strided and an expanded view give the
    reference's output and gradients (reaching the base tensor through the view)."""
    torch.manual_seed(5)
    d = 33
    base = x_bias_view(d).to(device).detach().requires_grad_()
    as_view = (lambda t: t[::2]) if base.numel() == 2 * d else (lambda t: t.expand(d))
    assert as_view(base).stride(0) != 1
    x, residual, dy = (torch.randn(5, d, device=device) for _ in range(3))
    weight, bias = torch.randn(d, device=device), torch.randn(d, device=device)
    results = []
    for op in (kernels.add_layer_norm, kernels.add_layer_norm_reference):
        base.grad = None
        x_ = x.clone().requires_grad_()
        y = op(x_, residual, weight, bias, 1e-5, x_bias=as_view(base))
        y.backward(dy)
        results.append((y, x_.grad, base.grad))
    for got, expected in zip(*results):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
