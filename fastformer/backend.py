"""One switch for where the math runs: the Triton kernels or the PyTorch reference.

    fastformer.set_backend("reference")        # everywhere, from now on
    with fastformer.use_backend("triton"): ...  # inside a block
    FASTFORMER_BACKEND=reference python ...     # from the environment

"auto" (the default) runs the Triton kernels on CUDA tensors and the reference elsewhere.
"triton" always runs the kernels: on a CPU that needs TRITON_INTERPRET=1 set before `kernels` is
imported (Triton's interpreter; this is how the tests check the kernels without a GPU).
Modules reach attention, the FFN and add + LayerNorm only through the functions below.
"""
import os
from contextlib import contextmanager

import kernels

BACKENDS = ("auto", "triton", "reference")
ENV_VAR = "FASTFORMER_BACKEND"

_backend = None  # None: read ENV_VAR, default "auto"


def _validate(name, what):
    if name not in BACKENDS:
        raise ValueError(f"{what} must be one of {', '.join(map(repr, BACKENDS))}, got {name!r}")
    return name


def get_backend():
    """The backend in force: set_backend's or use_backend's choice, else $FASTFORMER_BACKEND, else "auto"."""
    if _backend is not None:
        return _backend
    return _validate(os.environ.get(ENV_VAR, "auto"), f"${ENV_VAR}")


def set_backend(name):
    """Choose "auto", "triton" or "reference" for every later call."""
    global _backend
    _backend = _validate(name, "backend")


@contextmanager
def use_backend(name):
    """Run a block on one backend, then restore the previous choice."""
    global _backend
    previous = _backend
    _backend = _validate(name, "backend")
    try:
        yield
    finally:
        _backend = previous


def uses_triton(tensor):
    """Whether an op on `tensor` runs the Triton kernels under the current backend."""
    backend = get_backend()
    if backend == "auto":
        return kernels.HAS_TRITON and tensor.is_cuda
    return backend == "triton"


def attention(q, k, v, **kwargs):
    op = kernels.attention if uses_triton(q) else kernels.attention_reference
    return op(q, k, v, **kwargs)


def feed_forward(x, w1, b1, w2, b2, activation="gelu"):
    op = kernels.feed_forward if uses_triton(x) else kernels.feed_forward_reference
    return op(x, w1, b1, w2, b2, activation=activation)


def add_layer_norm(x, residual, weight, bias, eps, dropout_p=0.0):
    op = kernels.add_layer_norm if uses_triton(x) else kernels.add_layer_norm_reference
    return op(x, residual, weight, bias, eps, dropout_p)
