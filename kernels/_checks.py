"""The checks of the ops' tensor arguments: each raises a TypeError or ValueError naming the argument."""

import functools
import math
import warnings

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# The references also take fp64, so tests can use them as oracles.
REFERENCE_DTYPES = (*FLOAT_DTYPES, torch.float64)


def argument_check(check):
    """Decorates a function that checks an op's arguments: under torch.jit.trace it runs with
    TracerWarnings silenced, as each of its shape comparisons would warn that the trace cannot
    generalize it, and the trace records none of it anyway (the example inputs are still checked)."""

    @functools.wraps(check)
    def checked(*args, **kwargs):
        if not torch.jit.is_tracing():
            return check(*args, **kwargs)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", torch.jit.TracerWarning)
            return check(*args, **kwargs)

    return checked


def check_tensor(name, t, *, ndim=None, dtypes=FLOAT_DTYPES):
    """TypeError/ValueError naming `name` unless `t` is a tensor of the given rank and dtype."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must be one of ({allowed}), got {t.dtype}")


def check_softmax_scale(softmax_scale):
    """ValueError unless softmax_scale is None or a positive finite number (not a bool)."""
    is_number = isinstance(softmax_scale, (int, float)) and not isinstance(softmax_scale, bool)
    if softmax_scale is not None and not (is_number and 0 < softmax_scale < math.inf):
        raise ValueError(f"softmax_scale must be a positive finite number or None, got {softmax_scale!r}")


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
