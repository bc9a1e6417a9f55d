"""The FFN's first product by cuBLAS and the activation kernel (kernels/_gemm_choice.py), beside the
Triton GEMM with its fused epilogue: the parity rule against fp64 for outputs and every gradient,
the shapes and layouts that break kernels, feed_forward end to end, the switch, the plans keyed on
it, and the default, which stays the Triton GEMM until a GPU sweep says otherwise.

On a CPU the product is torch.addmm on CPU tensors and the activation kernel runs through Triton's
interpreter; the `cuda` tests run both ways on a GPU, under a CUDA graph and under torch.compile
(which takes the Triton GEMM).
"""

import functools
import importlib

import pytest
import torch
import torch.nn.functional as F

from fastformer import kernels
from fastformer.kernels import _gemm_choice, _runtime
from tests.helpers import assert_within_torch_error
from tests.test_layouts_and_edges import LAYOUTS
from tests.test_linear_gelu import BF16, FP16, FP32, SHAPES, check_parity, make_inputs

linear_gelu_module = importlib.import_module("fastformer.kernels.linear_gelu")


@pytest.fixture
def cublas_used(monkeypatch):
    """use_cublas's answer for every linear_gelu forward the test makes, in order (a plan is made
    again on every call: tests/conftest.py sets FASTFORMER_CHECK_PLANS), the count of the
    products cuBLAS ran (`cublas_used.products`), and apart, the answers for the FFN backward's
    dH product (`cublas_used.backward`)."""

    class Flags(list):
        products = 0

    flags = Flags()
    flags.backward = []

    def recording(rule):
        flags.append(_gemm_choice.use_cublas(rule))
        return flags[-1]

    def recording_backward(*args):
        flags.backward.append(_gemm_choice.use_cublas(linear_gelu_module._prefers_cublas_backward(*args)))
        return flags.backward[-1]

    real_product = linear_gelu_module._cublas_product

    def counted(*args):
        flags.products += 1
        return real_product(*args)

    monkeypatch.setattr(linear_gelu_module, "use_cublas", recording)
    for module in (linear_gelu_module, importlib.import_module("fastformer.kernels.feed_forward")):
        monkeypatch.setattr(module, "_ffn_backward_uses_cublas", recording_backward)
    monkeypatch.setattr(linear_gelu_module, "_cublas_product", counted)
    monkeypatch.delenv(_gemm_choice.ENV_VAR, raising=False)
    return flags


@pytest.mark.parametrize("activation", ["gelu", "relu"])
@pytest.mark.parametrize("dtype, atol", [FP32, FP16, BF16])
@pytest.mark.parametrize("x_shape, n", SHAPES)  # M = 1, K and N not block multiples, M = 1000, 3-D x
def test_parity_by_cublas(x_shape, n, dtype, atol, activation, device, cublas_used):
    inputs = make_inputs(x_shape, [x_shape[-1], n], device)
    op = functools.partial(kernels.linear_gelu, activation=activation)
    reference = functools.partial(kernels.linear_gelu_reference, activation=activation)
    with kernels.ffn_gemm("cublas"):
        check_parity(op, reference, inputs, dtype, atol, ("y", "dx", "dw", "db"))
    assert cublas_used == [True] and cublas_used.products == 1


@pytest.mark.parametrize("dtype, atol", [FP32, FP16, BF16])
def test_without_bias_by_cublas(dtype, atol, device, cublas_used):
    """No bias: torch.mm, not addmm; with gradients and under no_grad (the activation written over
    the product in place)."""
    x, w, _ = make_inputs((9, 33), [33, 47], device)  # neither a multiple of the activation kernel's block
    with kernels.ffn_gemm("cublas"):
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
    assert cublas_used == [True, True] and cublas_used.products == 2


@pytest.mark.parametrize("layout", ["strided", "padded_rows", "expanded"])
@pytest.mark.parametrize("dtype, atol", [FP32, FP16])
def test_x_as_a_view_by_cublas(layout, dtype, atol, device, cublas_used):
    """x as a strided view (rows_view copies it), with rows further apart than their length (cuBLAS
    reads them in place), and expanded from one row (stride 0): outputs and gradients by the
    parity rule, the gradient reaching x through the view."""
    inputs = make_inputs((2, 13, 40), [40, 24], device)
    view = LAYOUTS[layout]

    def op(x, w, b):
        return kernels.linear_gelu(view(x), w, b)

    def reference(x, w, b):
        return kernels.linear_gelu_reference(view(x), w, b)

    with kernels.ffn_gemm("cublas"):
        check_parity(op, reference, inputs, dtype, atol, ("y", "dx", "dw", "db"))
    assert cublas_used == [True]


@pytest.mark.parametrize("layout", ["strided", "padded_rows", "expanded"])
@pytest.mark.parametrize("argument", ["weight", "bias"])
@pytest.mark.parametrize("dtype, atol", [FP16])
def test_weight_and_bias_as_views_by_cublas(argument, layout, dtype, atol, device, cublas_used):
    """The weight or the bias as a strided, padded or expanded (stride 0) view, which addmm reads
    as it is: outputs and gradients by the parity rule, in fp16."""
    inputs = make_inputs((2, 13, 40), [40, 24], device)
    view = LAYOUTS[layout]
    which = {"weight": 1, "bias": 2}[argument]

    def viewed(fn):
        return lambda *args: fn(*(view(a) if i == which else a for i, a in enumerate(args)))

    with kernels.ffn_gemm("cublas"):
        names = ("y", "dx", "dw", "db")
        check_parity(viewed(kernels.linear_gelu), viewed(kernels.linear_gelu_reference), inputs, dtype, atol, names)
    assert cublas_used == [True]


@pytest.mark.parametrize("activation", ["gelu", "relu"])
@pytest.mark.parametrize("dtype, atol", [FP32, FP16, BF16])
@pytest.mark.parametrize("x_shape", [(1, 32), (7, 32), (2, 33, 32)])
def test_feed_forward_parity_by_cublas(x_shape, dtype, atol, activation, device, cublas_used):
    """The FFN with its first product by cuBLAS: its one autograd node (the activation recomputed
    from the pre-activation for w2's gradient) and every gradient, then the no-grad call."""
    inputs = make_inputs(x_shape, [32, 96, 32], device)
    names = ("y", "dx", "dw1", "db1", "dw2", "db2")
    op = functools.partial(kernels.feed_forward, activation=activation)
    reference = functools.partial(kernels.feed_forward_reference, activation=activation)
    with kernels.ffn_gemm("cublas"):
        check_parity(op, reference, inputs, dtype, atol, names)
        with torch.no_grad():
            y = op(*(t.to(dtype) for t in inputs))
    with torch.no_grad():
        expected, torch_same = reference(*inputs), reference(*(t.to(dtype) for t in inputs))
    assert_within_torch_error("y (no_grad)", y, expected, torch_same, atol)
    assert cublas_used == [True, True] and cublas_used.products == 2
    assert cublas_used.backward == [True]  # the backward's dH by cuBLAS too, then the activation pass


def test_the_activation_kernel_writes_the_epilogues_bits(device):
    """act(pre) from the activation kernel is the Triton GEMM epilogue's from the same pre, bit for
    bit, and the one the backward writes again for the FFN (WRITE_H): the three agree."""
    x, w, b = (t.half() for t in make_inputs((37, 48), [48, 80], device))
    for activation in ("gelu", "relu"):
        y_gemm, pre = linear_gelu_module._linear_gelu_forward(x, w, b, activation, True)
        h = torch.empty_like(pre)
        grid, args, kwargs = linear_gelu_module._activation_forward_launch(pre, h, activation)
        linear_gelu_module._activation_fwd[grid](*args, **kwargs)
        _, _, h_again = linear_gelu_module._activation_backward(torch.zeros_like(pre), pre, activation, False, True)
        assert torch.equal(h, y_gemm) and torch.equal(h, h_again), activation


def test_grad_and_no_grad_forwards_agree_bit_for_bit(device, cublas_used):
    """With a gradient the product goes to the saved pre-activation and the activation to y; without,
    the activation is written over the product: the same y either way."""
    x, w, b = (t.float() for t in make_inputs((3, 11, 32), [32, 40], device))
    with kernels.ffn_gemm("cublas"):
        y = kernels.linear_gelu(x, w.requires_grad_(), b)
        with torch.no_grad():
            y_no_grad = kernels.linear_gelu(x, w, b)
    assert torch.equal(y.detach(), y_no_grad)
    assert cublas_used == [True, True]


def test_autocast_keeps_the_inputs_dtype_or_casts_fp32(device, cublas_used):
    """fp32 inputs under autocast are cast first, as F.linear's would be; inputs already in half
    precision keep their dtype (the product's out= form is not autocast's), as the Triton GEMM's do."""
    x, w, b = (t.float() for t in make_inputs((5, 32), [32, 16], device))
    half = torch.float16 if device.type == "cpu" else torch.bfloat16
    x16, w16, b16 = (t.half() for t in (x, w, b))
    with kernels.ffn_gemm("cublas"):
        with torch.autocast(device.type, dtype=half):
            assert kernels.linear_gelu(x, w, b).dtype == half
        plain = kernels.linear_gelu(x16, w16, b16)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            under = kernels.linear_gelu(x16, w16, b16)
    assert under.dtype == torch.float16 and torch.equal(under, plain)
    assert cublas_used.products == 3


def test_deterministic_by_cublas(device):
    inputs = make_inputs((50, 32), [32, 48], device)
    results = []
    with kernels.ffn_gemm("cublas"):
        for _ in range(2):
            leaves = [t.float().requires_grad_() for t in inputs]
            y = kernels.linear_gelu(*leaves)
            y.backward(torch.ones_like(y))
            results.append([y.detach()] + [t.grad for t in leaves])
    for name, a, b in zip(("y", "dx", "dw", "db"), *results):
        assert torch.equal(a, b), name


def test_the_choice_and_the_rule(monkeypatch):
    """FASTFORMER_FFN_GEMM, set_ffn_gemm over it, ffn_gemm for a block, and bad values of each."""
    monkeypatch.delenv(_gemm_choice.ENV_VAR, raising=False)
    assert kernels.ffn_gemm_choice() == "auto"
    assert _gemm_choice.use_cublas(True) and not _gemm_choice.use_cublas(False)  # no choice: the rule's
    for value, choice in (("cublas", True), ("triton", False)):
        monkeypatch.setenv(_gemm_choice.ENV_VAR, value)
        assert kernels.ffn_gemm_choice() == value
        assert _gemm_choice.use_cublas(not choice) is choice
    for value in ("auto", ""):
        monkeypatch.setenv(_gemm_choice.ENV_VAR, value)
        assert kernels.ffn_gemm_choice() == "auto" and not _gemm_choice.use_cublas(False)
    monkeypatch.setenv(_gemm_choice.ENV_VAR, "cublas")
    with kernels.ffn_gemm("triton"):  # set_ffn_gemm's choice over the environment's
        assert kernels.ffn_gemm_choice() == "triton" and not _gemm_choice.use_cublas(True)
        with kernels.ffn_gemm("auto"):  # the rule, whatever the environment says
            assert not _gemm_choice.use_cublas(False) and _gemm_choice.use_cublas(True)
        assert kernels.ffn_gemm_choice() == "triton"
    assert kernels.ffn_gemm_choice() == "cublas"
    kernels.set_ffn_gemm("triton")
    try:
        assert kernels.ffn_gemm_choice() == "triton"
    finally:
        kernels.set_ffn_gemm(None)
    assert kernels.ffn_gemm_choice() == "cublas"
    monkeypatch.setenv(_gemm_choice.ENV_VAR, "cuBLAS")
    with pytest.raises(ValueError, match="FASTFORMER_FFN_GEMM must be triton"):
        kernels.ffn_gemm_choice()
    for bad in ("torch", True, 1):
        with pytest.raises(ValueError, match="set_ffn_gemm's gemm must be"):
            kernels.set_ffn_gemm(bad)
        with pytest.raises(ValueError, match="set_ffn_gemm's gemm must be"), kernels.ffn_gemm(bad):
            pass
    assert _gemm_choice.ffn_gemm_choice.made is None  # a refused value leaves the choice as it was


def test_by_default_the_triton_gemm_runs(device, cublas_used):
    """With no choice made, linear_gelu's rule: the Triton GEMM until a GPU sweep has timed both."""
    assert linear_gelu_module.PREFERS_CUBLAS is False
    assert kernels.ffn_gemm_choice() == "auto"
    x, w, b = (t.float() for t in make_inputs((7, 32), [32, 24], device))
    kernels.linear_gelu(x, w, b)
    kernels.feed_forward(x.requires_grad_(), w, b, w.t().contiguous(), None)
    assert cublas_used == [False, False] and cublas_used.products == 0


@pytest.mark.parametrize("prefers", [False, True])
def test_with_no_choice_made_the_rule_decides(prefers, device, cublas_used, monkeypatch):
    monkeypatch.setattr(linear_gelu_module, "PREFERS_CUBLAS", prefers)
    x, w, b = (t.float() for t in make_inputs((7, 32), [32, 24], device))
    _runtime.forget_launches()  # the rule is a constant: plans made under the other value do not know it changed
    try:
        kernels.linear_gelu(x, w, b)
    finally:
        _runtime.forget_launches()
    assert cublas_used == [prefers]


def test_flipping_the_choice_between_calls_runs_each_way(device, cublas_used, monkeypatch):
    """One signature called under each choice in turn, by the setter and by the environment: each
    call runs its own way (the plans are keyed on the choice) and gives that way's result, the one
    a first call of it gives."""
    x, w, b = (t.float() for t in make_inputs((3, 11, 40), [40, 56], device))
    with torch.no_grad():
        first = {}
        for way in ("triton", "cublas"):
            _runtime.forget_launches()
            with kernels.ffn_gemm(way):
                first[way] = kernels.linear_gelu(x, w, b)
        del cublas_used[:]
        seen = []
        for way in ("cublas", "triton", "cublas", "auto", "triton"):
            with kernels.ffn_gemm(way):
                seen.append(kernels.linear_gelu(x, w, b))
        for way in ("cublas", "triton"):
            monkeypatch.setenv(_gemm_choice.ENV_VAR, way)
            seen.append(kernels.linear_gelu(x, w, b))
    assert cublas_used == [True, False, True, False, False, True, False]
    for way, y in zip(("cublas", "triton", "cublas", "triton", "triton", "cublas", "triton"), seen):
        assert torch.equal(y, first[way]), way


def test_under_a_trace_the_triton_gemm_runs(device, monkeypatch):
    """torch.compile, fake tensors and dispatch modes take the Triton GEMM, whatever the choice
    (kernels/_gemm_choice.py: a compiled graph would keep its trace's choice)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passing(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    monkeypatch.delenv(_gemm_choice.ENV_VAR, raising=False)
    with kernels.ffn_gemm("cublas"):
        assert _gemm_choice.use_cublas(False)
        with Passing():
            assert not _gemm_choice.use_cublas(False)
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
        assert not _gemm_choice.use_cublas(False)


def test_a_warm_up_compiles_the_activation_kernel_and_runs_no_product(device, monkeypatch):
    """Inside kernels.compile_only() (a warm-up) the cuBLAS way launches nothing: cuBLAS has no
    kernel to compile, and the activation kernel is compiled, not run."""
    x, w, b = (t.float() for t in make_inputs((7, 32), [32, 24], device))
    products = []
    monkeypatch.setattr(linear_gelu_module, "_cublas_product", lambda *args: products.append(args))
    compiled = []
    real_launch = _runtime.launch

    def spying(kernel):
        compiled.append(kernel)
        return real_launch(kernel)

    monkeypatch.setattr(_runtime, "launch", spying)
    monkeypatch.setattr(importlib.import_module("fastformer.kernels._configs"), "launch", spying)
    with kernels.ffn_gemm("cublas"), kernels.compile_only():
        linear_gelu_module._linear_gelu_forward(x, w, b, "gelu", True)
    assert not products and compiled == [linear_gelu_module._activation_fwd_kernel], compiled


def test_the_sweep_and_the_benchmarks_know_the_variant():
    """tools.sweep times the cuBLAS way as a third variant of the GEMM family; the benchmarks have a
    provider for it."""
    from bench import cases
    from tools import sweep

    assert sweep.VARIANTS["gemm"] == ("pointer", "tma", "cublas") and "cublas" not in sweep.VARIANTS["attention"]
    assert "fastformer_cublas" in cases.FFN_PROVIDERS


# ----------------------------------------------------------------------------------------------
# on a GPU
# ----------------------------------------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.parametrize("dtype, atol", [FP16, BF16])
@pytest.mark.parametrize("M, d, d_ff", [(2048, 256, 1024), (1000, 1024, 4096)])
def test_on_a_gpu_both_ways_meet_the_parity_rule(M, d, d_ff, dtype, atol):
    """The tutorial's FFN rows and a wide layer, odd rows: each way's output and gradients against
    fp64, within twice PyTorch's same-dtype error."""
    inputs = make_inputs((M, d), [d, d_ff], torch.device("cuda"))
    names = ("y", "dx", "dw", "db")
    for way in ("triton", "cublas"):
        with kernels.ffn_gemm(way):
            check_parity(kernels.linear_gelu, kernels.linear_gelu_reference, inputs, dtype, atol, names)


@pytest.mark.cuda
def test_on_a_gpu_a_cuda_graph_replays_the_cublas_way():
    """addmm and the activation kernel captured in a CUDA graph: the replay gives the eager call's
    bits, for linear_gelu and for the FFN's forward."""
    x, w1, b1, w2, b2 = (t.half() for t in make_inputs((512, 256), [256, 1024, 256], torch.device("cuda")))
    with kernels.ffn_gemm("cublas"), torch.no_grad():
        for op, args in ((kernels.linear_gelu, (x, w1, b1)), (kernels.feed_forward, (x, w1, b1, w2, b2))):
            eager = op(*args)  # compiles outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                replayed = op(*args)
            graph.replay()
            torch.cuda.synchronize()
            torch.testing.assert_close(replayed, eager, rtol=0, atol=0)


@pytest.mark.cuda
def test_on_a_gpu_torch_compile_runs_the_triton_gemm():
    """Under torch.compile the choice does not apply (the Triton GEMM runs); the result is right."""
    x, w, b = (t.half() for t in make_inputs((256, 128), [128, 512], torch.device("cuda")))
    with kernels.ffn_gemm("cublas"):
        compiled = torch.compile(lambda x, w, b: kernels.linear_gelu(x, w, b), fullgraph=True)
        y = compiled(x, w, b)
    expected = F.gelu(F.linear(x.float(), w.float(), b.float()))
    torch.testing.assert_close(y.float(), expected, rtol=2e-2, atol=2e-2)
