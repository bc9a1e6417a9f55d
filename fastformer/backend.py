"""One switch for where the math runs: the Triton kernels or the PyTorch reference.

    fastformer.set_backend("reference")        # everywhere, from now on
    with fastformer.use_backend("triton"): ...  # inside a block, in this thread
    FASTFORMER_BACKEND=reference python ...     # from the environment

A block's choice holds in the thread that entered it, as torch.no_grad's and torch.autocast's do:
two threads in blocks of their own each run on theirs. set_backend's holds in every thread that is
in no block.

"auto" (the default) runs the Triton kernels on CUDA tensors and the reference elsewhere, with one
exception: attention and the feed-forward in fp32 run their kernels only where PyTorch's own fp32
matmuls would take TF32 (torch.set_float32_matmul_precision("high") or "medium", or
torch.backends.cuda.matmul.allow_tf32 = True), by the same contract: TF32 products, fp32
accumulation and softmax. At PyTorch's default precision, "highest", they run the reference
(cuBLAS in IEEE fp32), with a one-time warning: an IEEE-fp32 `tl.dot` compiles to CUDA-core FMA
loops, no match for cuBLAS. Under torch.autocast in bf16/fp16, as `fastformer train` runs, the
kernels run whatever the fp32 precision. The add + LayerNorm kernel has no matrix product and
takes fp32 as it is.
"triton" always runs the kernels: on a CPU that needs TRITON_INTERPRET=1 set before `fastformer.kernels` is
imported (Triton's interpreter; this is how the tests check the kernels without a GPU).
Under either, a model in a dtype the kernels do not take (float64: they take fp16, bf16 and fp32) runs
the reference, with a one-time warning naming the dtype, as attention does for a head dim over 128.
Modules reach attention, the FFN and add + LayerNorm only through the functions below; a planned
Encoder or Decoder forward (fastformer.plan) through `ops`, which picks the same functions once for
all its layers.
"""

import sys
import threading
from collections.abc import Callable
from contextlib import contextmanager
from typing import NamedTuple

import torch

from fastformer import kernels
from fastformer.environment import BACKEND_ENV, BACKENDS
from fastformer.kernels._runtime import EnvSetting, allow_tf32, warn_once

ENV_VAR = BACKEND_ENV
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # what the Triton kernels take

_backend = None  # set_backend's choice, for every thread; None: read ENV_VAR, default "auto"
_block = threading.local()  # `name`: the innermost use_backend block's choice in this thread, if any


def _validate(name, what):
    if name not in BACKENDS:
        raise ValueError(f"{what} must be one of {', '.join(map(repr, BACKENDS))}, got {name!r}")
    return name


# read on every op call: parsed once per value the variable takes
_env_backend = EnvSetting(ENV_VAR, lambda value: _validate("auto" if value is None else value, f"${ENV_VAR}"))


def get_backend():
    """The backend in force: this thread's use_backend block's choice, else set_backend's, else
    $FASTFORMER_BACKEND, else "auto"."""
    name = getattr(_block, "name", None)
    if name is not None:
        return name
    return _env_backend() if _backend is None else _backend


def set_backend(name):
    """Choose "auto", "triton" or "reference" for every later call."""
    global _backend
    _backend = _validate(name, "backend")


@contextmanager
def use_backend(name):
    """Run a block on one backend in this thread, then restore the thread's previous choice."""
    previous = getattr(_block, "name", None)
    _block.name = _validate(name, "backend")
    try:
        yield
    finally:
        _block.name = previous


def uses_triton(tensor, matmul=True):
    """Whether an op on `tensor` runs the Triton kernels under the current backend; `matmul` says
    the op is built on matrix products (attention, the feed-forward), which "auto" keeps off fp32.
    Under torch.jit.trace (the kernels' ops do not trace), under torch.onnx.export (ONNX has no
    function for them) and under a torch.func transform (vmap, grad, jacrev...: they have no
    batching rules) the reference runs, with a one-time warning where
    the kernels would have run; where the reference runs anyway, nothing is said. So does a
    floating dtype the kernels do not take (float64), with a one-time warning naming it."""
    if not _kernels_take(tensor, matmul):
        return False
    if torch.jit.is_tracing():  # the trace would hold the kernels' launches, fixed to the example's shapes
        warn_once(
            ("backend", "jit.trace"),
            "fastformer: under torch.jit.trace the model runs the PyTorch reference, which the trace records: "
            "the Triton kernels' ops do not trace (torch.compile and torch.export take them)",
        )
        return False
    if _onnx_exporting():  # ONNX has no function for the kernels' ops; the reference's are standard
        warn_once(
            ("backend", "onnx"),
            "fastformer: under torch.onnx.export the model exports the PyTorch reference: ONNX has no function for "
            "the Triton kernels' ops",
        )
        return False
    if not torch.compiler.is_compiling() and torch._C._functorch.peek_interpreter_stack() is not None:
        warn_once(
            ("backend", "functorch"),
            "fastformer: under a torch.func transform (vmap, grad, ...) the model runs the PyTorch reference: "
            "the Triton kernels' ops have no batching rules",
        )
        return False
    return True


def _onnx_exporting():
    """Whether torch.onnx.export (either exporter) is running: never before torch.onnx is imported."""
    onnx = sys.modules.get("torch.onnx")
    return onnx is not None and onnx.is_in_onnx_export()


def _kernels_take(tensor, matmul):
    """uses_triton outside torch.jit.trace and torch.func transforms."""
    backend = get_backend()
    if backend == "reference" or (backend == "auto" and not (kernels.HAS_TRITON and tensor.is_cuda)):
        return False
    if tensor.is_floating_point() and tensor.dtype not in KERNEL_DTYPES:
        if not torch.compiler.is_compiling():  # a warning would break the graph
            dtype = str(tensor.dtype).replace("torch.", "")
            warn_once(
                ("backend", "dtype", tensor.dtype),
                f"fastformer: the Triton kernels take fp16, bf16 and fp32; this model is {dtype}, so it runs the "
                "PyTorch reference: use model.float() for the kernels, or fastformer.set_backend('reference')",
            )
        return False
    return backend == "triton" or not matmul or in_half_precision(tensor) or in_tf32(tensor)


def in_tf32(tensor):
    """Whether matrix products on fp32 `tensor` may take TF32, as PyTorch's fp32 CUDA matmuls would
    (kernels._runtime.allow_tf32): the kernels' fp32 products are then TF32 too (dot_precision)."""
    return tensor.dtype == torch.float32 and allow_tf32()


def in_half_precision(tensor):
    """Whether matrix products on `tensor` run in fp16/bf16: its own dtype, or autocast's for fp32
    (and for token ids, which the model embeds in fp32)."""
    if tensor.dtype in (torch.float16, torch.bfloat16):
        return True
    device_type = tensor.device.type
    return (
        (tensor.dtype == torch.float32 or not tensor.is_floating_point())
        and torch.is_autocast_enabled(device_type)
        and torch.get_autocast_dtype(device_type) in (torch.float16, torch.bfloat16)
    )


def _matmul_uses_triton(tensor):
    """uses_triton for attention and the feed-forward, warning once when "auto" keeps fp32 on CUDA
    off the kernels (at the "highest" fp32 precision: see the module docstring); not while compiling,
    where a warning breaks the graph."""
    if uses_triton(tensor):
        return True
    fp32 = tensor.dtype == torch.float32  # other dtypes: uses_triton has said why
    if fp32 and get_backend() == "auto" and kernels.HAS_TRITON and tensor.is_cuda and not torch.compiler.is_compiling():
        warn_once(
            ("backend", "fp32"),
            "fastformer: float32 attention and feed-forward run the PyTorch reference on CUDA at PyTorch's default "
            'fp32 precision ("highest"); for the Triton kernels, run under torch.autocast("cuda", '
            "dtype=torch.bfloat16), or allow TF32 as for PyTorch's own matmuls: "
            'torch.set_float32_matmul_precision("high")',
        )
    return False


def attention(q, k, v, **kwargs):
    op = kernels.attention if _matmul_uses_triton(q) else kernels.attention_reference
    return op(q, k, v, **kwargs)


def self_attention(qkv, n_head, **kwargs):
    op = kernels.self_attention if _matmul_uses_triton(qkv) else kernels.self_attention_reference
    return op(qkv, n_head, **kwargs)


def feed_forward(x, w1, b1, w2, b2, activation="gelu"):
    op = kernels.feed_forward if _matmul_uses_triton(x) else kernels.feed_forward_reference
    return op(x, w1, b1, w2, b2, activation=activation)


def add_layer_norm(x, residual, weight, bias, eps, dropout_p=0.0, *, x_bias=None, seed=None, lowp_dtype=None):
    op = kernels.add_layer_norm if uses_triton(x, matmul=False) else kernels.add_layer_norm_reference
    return op(x, residual, weight, bias, eps, dropout_p, x_bias=x_bias, seed=seed, lowp_dtype=lowp_dtype)


class Ops(NamedTuple):
    """The ops of one planned Encoder or Decoder forward, picked once for all its layers (`ops`):
    each is the function the backend function of its name would call."""

    kernels: bool  # attention and the feed-forward run the Triton kernels
    attention: Callable
    self_attention: Callable
    feed_forward: Callable
    add_layer_norm: Callable


def ops(tensor):
    """The Ops of a forward whose products run in `tensor`'s precision (its dtype, or autocast's):
    what attention, self_attention, feed_forward and add_layer_norm would each pick for the
    tensors such a forward hands them, picked with one look at the backend (fastformer.plan)."""
    matmul, norm = _matmul_uses_triton(tensor), uses_triton(tensor, matmul=False)
    return Ops(
        matmul,
        kernels.attention if matmul else kernels.attention_reference,
        kernels.self_attention if matmul else kernels.self_attention_reference,
        kernels.feed_forward if matmul else kernels.feed_forward_reference,
        kernels.add_layer_norm if norm else kernels.add_layer_norm_reference,
    )
