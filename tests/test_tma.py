"""Tile loads through tensor descriptors (kernels/_tma.py): the attention passes with TMA=True
against the fp64 reference by the parity rule and against their own pointer loads, where TMA can
and cannot serve, and the switch.

On a CPU the descriptors run through Triton's interpreter (as its loads read them: zeros past the
rows and columns), so these check the kernels' offsets, blocks and shapes; the sm_90a compile check
(tools.sm90_cases) checks that the same code compiles to TMA copies in pipelined loops, and the
`cuda` tests here that it runs on a GPU.
"""

import importlib
import threading

import pytest
import torch

from fastformer import kernels
from fastformer.kernels import _runtime, _tma
from tests.test_attention import BF16, FP16, FP32, check_parity, make_inputs, padding

attention = importlib.import_module("fastformer.kernels.attention")  # the module: kernels.attention is the op


@pytest.fixture
def tma_used(monkeypatch):
    """The TMA flag of every attention launch the test makes, in order: a forward's, then a
    backward's dQ pass and dK/dV pass (each its own, as a tuned table may choose them apart)."""
    flags = []

    def recording(rule, *tensors):
        flags.append(_tma.use_tma(rule, *tensors))
        return flags[-1]

    monkeypatch.setattr(attention, "use_tma", recording)
    return flags


def _same_bits(a, b, name):
    assert a.dtype == b.dtype and a.shape == b.shape, name
    assert torch.equal(a, b), (
        f"{name}: TMA loads differ from pointer loads by {(a.double() - b.double()).abs().max().item():.3e}"
    )


@pytest.mark.parametrize("dtype, atol", [FP32, FP16, BF16])
@pytest.mark.parametrize(
    "B, H, Lq, Lk, D, where, causal",
    [
        (1, 1, 1, 1, 16, None, False),  # length 1: every load past the end but one row
        (2, 3, 17, 40, 32, "end", False),  # Lq != Lk, neither a multiple of the block
        (3, 2, 37, 37, 24, "all", True),  # head dim padded to 32 inside the kernel; a batch all padding
        (2, 2, 21, 21, 72, "middle", True),  # rows 144 B apart; head block 128, read as zeros past 72
    ],
)
def test_parity_through_descriptors(B, H, Lq, Lk, D, where, causal, dtype, atol, device, tma_used):
    q, k, v, do = make_inputs(B, H, Lq, Lk, D, device, seed=5)
    pad = None if where is None else padding(B, Lk, where, device)
    with kernels.tma_loads(True):
        check_parity(q, k, v, do, dtype, atol, key_padding_mask=pad, causal=causal)
    assert tma_used and all(tma_used), tma_used  # the forward and the backward took descriptors


@pytest.mark.parametrize("dropout_p", [0.0, 0.2])
def test_descriptor_loads_are_the_pointer_loads_bit_for_bit(dropout_p, device, tma_used):
    """The same tiles reach the same dots: outputs and gradients are bitwise equal either way,
    with key padding, a causal mask and dropout (a seed shared by both runs). In fp16: in fp32 the
    backward's pointer loads read a tile used both ways a second time, transposed
    (attention._read_columns), where a descriptor's tile is transposed in registers, so the same
    values reach a dot in another layout, and the interpreter's matmul sums them in another order
    (1e-6 apart); test_parity_through_descriptors holds fp32 to the parity rule."""
    q, k, v, do = make_inputs(2, 2, 45, 45, 32, device, seed=6)
    pad = padding(2, 45, "end", device)
    seed = torch.tensor([1234], dtype=torch.int64, device=device)
    results = []
    for on in (False, True):
        leaves = [t.detach().half().requires_grad_() for t in (q, k, v)]
        with kernels.tma_loads(on):
            out = kernels.attention(*leaves, key_padding_mask=pad, causal=True, dropout_p=dropout_p, seed=seed)
            out.backward(do.half())
        results.append([out.detach()] + [t.grad for t in leaves])
    assert tma_used == [False] * 3 + [True] * 3  # pointer loads, then descriptors: forward, dQ, dK/dV
    for name, a, b in zip(("out", "dq", "dk", "dv"), *results):
        _same_bits(a, b, name)


def _attend(q, k, v, do):
    """The output and gradients of q, k, v (leaves of the given views) under attention."""
    out = kernels.attention(q, k, v, causal=True)
    out.backward(do)
    return [out.detach(), q.grad, k.grad, v.grad]


def test_a_view_whose_rows_are_not_16_byte_multiples_takes_pointer_loads(device, tma_used):
    """TMA needs every stride but the last a multiple of 16 bytes: heads of 16 fp16 values in rows
    of 2 x 16 + 4 values (72 bytes) are read through pointers, with the same results."""
    B, H, L, D = 2, 2, 19, 16
    rows = torch.randn(3, B, L, H * D + 4, dtype=torch.float16, device=device)
    do = torch.randn(B, H, L, D, dtype=torch.float16, device=device)
    results = []
    for on in (False, True):
        q, k, v = (r[..., : H * D].unflatten(-1, (H, D)).transpose(1, 2).detach().requires_grad_() for r in rows)
        assert q.stride(2) * 2 == 72
        with kernels.tma_loads(on):
            results.append(_attend(q, k, v, do))
    assert tma_used == [False] * 6  # neither the forward nor the backward's passes, either time
    for name, a, b in zip(("out", "dq", "dk", "dv"), *results):
        _same_bits(a, b, name)


def test_a_launch_whose_base_is_not_16_byte_aligned_loads_through_pointers(device):
    """A descriptor's base must be 16-byte aligned: an ordinary launch (kernels._configs.Configs)
    with TMA=True whose Q starts one element into its storage runs with TMA=False."""
    q = torch.randn(2 * 2 * 16 * 32 + 1, device=device)[1:].view(2, 2, 16, 32)
    k = v = torch.randn(2, 2, 16, 32, device=device)
    assert q.data_ptr() % 16 and _tma.tma_can_serve(q, k, v)  # the strides allow it; the address does not
    masking = attention._masking(q, None, None, False, 0.0, 32**-0.5)
    o, lse = attention._forward_outputs(q)
    with kernels.tma_loads(True):
        _, args, kwargs = attention._forward_launch(q, k, v, o, lse, None, masking)
        assert kwargs["TMA"] is True
        assert attention._attn_fwd._tma_checked(args, kwargs)["TMA"] is False
        _, args, kwargs = attention._forward_launch(k, k, v, o, lse, None, masking)
        assert attention._attn_fwd._tma_checked(args, kwargs)["TMA"] is True


def test_a_plan_made_with_descriptors_switches_to_pointers_for_an_unaligned_call(device, monkeypatch):
    """A plan (kernels._runtime.PreparedLaunch) keeps the TMA flag its first call was made with; a
    later call of the same signature whose tensor starts off a 16-byte boundary launches with
    TMA=False, and its result is right."""
    flags = []
    real = _runtime.PreparedLaunch.__call__

    def spying(self, *pointers):
        flags.append((self.tma, any(p is not None and p.data_ptr() & 15 for p in pointers)))
        return real(self, *pointers)

    monkeypatch.setattr(_runtime.PreparedLaunch, "__call__", spying)
    launched = []
    real_launch = _runtime.launch

    def launch_spy(kernel):
        run = real_launch(kernel)

        class Spy:
            def __getitem__(self, grid):
                def go(*args, **kwargs):
                    at = kernel.arg_names.index("TMA")  # positional in a prepared launch
                    launched.append(kwargs["TMA"] if "TMA" in kwargs else args[at])
                    return run[grid](*args, **kwargs)

                return go

        return Spy()

    monkeypatch.setattr(_runtime, "launch", launch_spy)
    B, H, L, D = 2, 2, 16, 32
    aligned = torch.randn(B, H, L, D, device=device)
    storage = torch.randn(B * H * L * D + 1, device=device)
    unaligned = storage[1:].view(B, H, L, D).copy_(aligned)
    with torch.no_grad(), kernels.tma_loads(True):
        first = kernels.attention(aligned, aligned, aligned)
        flags.clear()
        launched.clear()
        second = kernels.attention(unaligned, aligned, aligned)
    assert flags and flags[0][0] and flags[0][1], flags  # a plan with descriptors, and a base off the boundary
    assert launched == [False], launched  # the launch went through pointers
    torch.testing.assert_close(second, first, rtol=0, atol=0)


def test_under_a_trace_the_kernels_take_pointer_loads(device):
    """torch.compile and dispatch modes get the pointer loads (kernels/_tma.py)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passing(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    q = torch.randn(1, 1, 16, 16, device=device)
    with kernels.tma_loads(True):
        assert _tma.use_tma(False, q)
        with Passing():
            assert not _tma.use_tma(False, q)


def test_the_choice_and_the_rule(monkeypatch):
    q = torch.randn(1, 1, 16, 16)
    monkeypatch.delenv(_tma.ENV_VAR, raising=False)
    assert kernels.tma_choice() is None
    assert _tma.use_tma(True, q) and not _tma.use_tma(False, q)  # no choice: the rule's
    monkeypatch.setenv(_tma.ENV_VAR, "0")
    assert kernels.tma_choice() is False and not _tma.use_tma(True, q)
    monkeypatch.setenv(_tma.ENV_VAR, "1")
    assert kernels.tma_choice() is True and _tma.use_tma(False, q)
    with kernels.tma_loads(False):  # set_tma's choice over the environment's
        assert not _tma.use_tma(True, q)
    assert kernels.tma_choice() is True
    monkeypatch.setenv(_tma.ENV_VAR, "yes")
    with pytest.raises(ValueError, match="FASTFORMER_TMA must be 1"):
        kernels.tma_choice()
    with pytest.raises(TypeError, match="set_tma takes True, False or None"):
        kernels.set_tma("on")


@pytest.mark.parametrize("prefers", [False, True])
def test_with_no_choice_made_the_attention_rule_decides(prefers, device, tma_used, monkeypatch):
    """attention.PREFERS_TMA (pointer loads until a GPU has timed both: python -m tools.sweep)."""
    monkeypatch.delenv(_tma.ENV_VAR, raising=False)
    monkeypatch.setattr(attention, "PREFERS_TMA", prefers)
    q, k, v, _ = make_inputs(1, 1, 16, 16, 16, device)
    _runtime.forget_launches()  # the rule is a constant: plans made under the other value do not know it changed
    try:
        kernels.attention(q.float(), k.float(), v.float())
    finally:
        _runtime.forget_launches()
    assert tma_used == [prefers]


def test_each_thread_gets_the_scratch_allocator_once_and_a_users_is_kept(monkeypatch):
    """Triton keeps its allocator per thread context; a launch with descriptors sets fastformer's
    where none is set (the backward runs in autograd's own thread), and leaves a user's alone."""
    import triton
    from triton.runtime import _allocation

    monkeypatch.setattr(_runtime, "INTERPRET", False)  # the interpreter needs no allocator
    seen = {}

    def in_thread(name, user=None):
        if user is not None:
            triton.set_allocator(user)
        _runtime.ensure_allocator()
        seen[name] = _allocation._allocator.get()

    def user_allocator(size, alignment, stream):
        return None

    for name, user in (("fresh", None), ("user's", user_allocator)):
        thread = threading.Thread(target=in_thread, args=(name, user))
        thread.start()
        thread.join()
    assert seen == {"fresh": _runtime._scratch, "user's": user_allocator}


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("B, H, L, D, causal", [(4, 16, 4096, 64, True), (128, 4, 192, 64, False)])
def test_on_a_gpu_descriptors_give_the_pointer_loads_results(B, H, L, D, causal, dtype):
    """On an sm_90 GPU: the benchmark's causal shape and the model's call (key padding, dropout),
    forward and backward, through descriptors and through pointers, within the parity rule of
    each other's fp32 reference, and replayed from a CUDA graph (the scratch buffer taken from
    the graph's pool)."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA needs an sm_90 or newer GPU")
    q, k, v, do = make_inputs(B, H, L, L, D, "cuda", seed=7)
    pad = None if causal else padding(B, L, "end", "cuda")
    dropout_p = 0.0 if causal else 0.1
    seed = torch.tensor([99], dtype=torch.int64, device="cuda")
    results = {}
    for on in (False, True):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        with kernels.tma_loads(on):
            out = kernels.attention(*leaves, key_padding_mask=pad, causal=causal, dropout_p=dropout_p, seed=seed)
            out.backward(do.to(dtype))
        results[on] = [out.detach().float()] + [t.grad.float() for t in leaves]
    for name, a, b in zip(("out", "dq", "dk", "dv"), results[False], results[True]):
        scale = a.abs().max().item() + 1e-6
        assert (a - b).abs().max().item() <= 2e-2 * scale, name
    with kernels.tma_loads(True):
        static = [t.detach().to(dtype) for t in (q, k, v)]
        kernels.attention(*static, key_padding_mask=pad, causal=causal)  # compiles outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            replayed = kernels.attention(*static, key_padding_mask=pad, causal=causal)
        graph.replay()
        torch.cuda.synchronize()
        eager = kernels.attention(*static, key_padding_mask=pad, causal=causal)
    torch.testing.assert_close(replayed, eager, rtol=0, atol=0)


@pytest.fixture
def gemm_tma_used(monkeypatch):
    """The TMA flag of every linear_gelu GEMM launch the test makes, in order."""
    linear_gelu = importlib.import_module("fastformer.kernels.linear_gelu")
    flags = []

    def recording(rule, *tensors):
        flags.append(_tma.use_tma(rule, *tensors))
        return flags[-1]

    monkeypatch.setattr(linear_gelu, "use_tma", recording)
    return flags


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.bf16)])
@pytest.mark.parametrize("M, K, N", [(1, 16, 16), (37, 48, 80), (70, 256, 24)])  # one row; none a block multiple
def test_the_gemm_through_descriptors_is_the_gemm_through_pointers(M, K, N, dtype, device, gemm_tma_used):
    """linear_gelu's GEMM (the FFN's first product) loads X and W tiles through descriptors: the
    same bits out and the same gradients, the weight a Conv1d weight's (N, K, 1) view as the
    model passes it."""
    g = torch.Generator().manual_seed(8)
    x = torch.randn(M, K, generator=g).to(device, dtype)
    w = torch.randn(N, K, 1, generator=g).to(device, dtype)[..., 0]
    b = torch.randn(N, generator=g).to(device, dtype)
    dy = torch.randn(M, N, generator=g).to(device, dtype)
    results = []
    for on in (False, True):
        leaves = [t.detach().requires_grad_() for t in (x, w, b)]
        with kernels.tma_loads(on):
            y = kernels.linear_gelu(*leaves)
            y.backward(dy)
        results.append([y.detach()] + [t.grad for t in leaves])
    assert gemm_tma_used == [False, True]
    for name, a, c in zip(("y", "dx", "dw", "db"), *results):
        _same_bits(a, c, name)


def test_a_transposed_weight_takes_pointer_loads(device, gemm_tma_used):
    """A weight whose rows are not its unit-stride dimension (a (K, N) tensor's transpose) cannot
    be a descriptor's rows: the GEMM reads it through pointers, and right."""
    g = torch.Generator().manual_seed(9)
    x = torch.randn(20, 32, generator=g).to(device)
    w = torch.randn(32, 48, generator=g).to(device).t()  # (48, 32), strides (1, 48)
    with torch.no_grad(), kernels.tma_loads(True):
        y = kernels.linear_gelu(x, w, None)
    assert gemm_tma_used == [False]
    torch.testing.assert_close(y, kernels.linear_gelu_reference(x, w, None), rtol=1e-5, atol=1e-5)
