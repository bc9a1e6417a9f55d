"""What every op file shares: Triton's availability, input checks and one-time warnings."""
import os
import warnings

import torch

try:
    import triton  # noqa: F401
    import triton.language as tl  # noqa: F401

    HAS_TRITON = True
except ImportError:  # Triton ships for Linux only
    HAS_TRITON = False

# Triton reads TRITON_INTERPRET when a kernel is decorated, so this is fixed at import time.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

_warned = set()


def warn_once(key, message):
    """Warn about `key` once per process (fallbacks must be loud but not spam every layer)."""
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, stacklevel=3)


def can_launch(*tensors):
    """Whether Triton can run on these tensors: CUDA tensors, or any tensors under the interpreter."""
    if not HAS_TRITON:
        return False
    return INTERPRET or all(t.is_cuda for t in tensors)


def require_launchable(op, *tensors):
    """Raise a clear error when the Triton path is forced on tensors it cannot run on."""
    if not HAS_TRITON:
        raise RuntimeError(f"{op}: the Triton path needs the `triton` package, which is not installed")
    if not can_launch(*tensors):
        raise RuntimeError(
            f"{op}: the Triton path got tensors on {tensors[0].device}; Triton compiles for CUDA only. "
            "Use the reference backend, or set TRITON_INTERPRET=1 before importing `kernels` "
            "to run the kernels through Triton's (slow) interpreter."
        )


def check_tensor(name, t, *, ndim=None, dtypes=FLOAT_DTYPES):
    """TypeError/ValueError naming `name` unless `t` is a tensor of the given rank and dtype."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must be one of ({allowed}), got {t.dtype}")


def check_same_dtype(**tensors):
    dtypes = {name: t.dtype for name, t in tensors.items()}
    if len(set(dtypes.values())) > 1:
        seen = ", ".join(f"{name}={str(d).replace('torch.', '')}" for name, d in dtypes.items())
        raise TypeError(f"inputs must share one dtype, got {seen}")


def check_same_device(**tensors):
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    if len(set(devices.values())) > 1:
        seen = ", ".join(f"{name} on {d}" for name, d in devices.items())
        raise ValueError(f"inputs must be on one device, got {seen}")


def check_dropout_p(dropout_p):
    if not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be a float in [0, 1), got {dropout_p!r}")
