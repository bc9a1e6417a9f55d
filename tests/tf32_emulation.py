"""TF32 on a CPU, for the tests: matrix products whose fp32 operands are rounded to TF32 first.

On a GPU, where fp32 matmuls may take TF32 (torch.set_float32_matmul_precision("high")), cuBLAS
and the kernels' `tl.dot(..., input_precision="tf32")` multiply fp32 operands rounded to TF32 (10
mantissa bits, fp32's exponent) and accumulate in fp32. A CPU has no TF32: torch's CPU matmuls and
Triton's interpreter compute IEEE fp32 whatever the precision, so a TF32 parity test on a CPU would
compare fp32 with fp32 and say nothing of what TF32 costs. `emulated()` makes both sides round:
- Triton's interpreter: `InterpreterBuilder.create_dot` rounds fp32 operands of a dot whose input
  precision is TF32 (as installed at the time: tests/interpreter_bf16.py's correction stays under it);
- torch: a TorchDispatchMode rounds the fp32 operands of the CPU matrix products (mm, bmm, addmm,
  baddbmm: what matmul and linear and their backwards run), as cuBLAS does, the bias left exact.
Rounding is to nearest, ties to even, Inf and NaN kept (what a TF32 tensor map and Triton's
conversions do; Hopper's tensor cores read only the kept bits either way).
"""

import contextlib

import numpy as np
import torch
import triton.language as tl
from torch.utils._python_dispatch import TorchDispatchMode
from triton.runtime import interpreter

Builder = interpreter.InterpreterBuilder


def round_bits_to_tf32(bits):
    """uint32 fp32 patterns rounded to TF32's 10 mantissa bits: nearest, ties to even; Inf and NaN kept."""
    special = (bits & np.uint32(0x7F800000)) == np.uint32(0x7F800000)
    rounded = (bits + np.uint32(0x0FFF) + ((bits >> np.uint32(13)) & np.uint32(1))) & np.uint32(0xFFFFE000)
    return np.where(special, bits, rounded)


def to_tf32(t):
    """An fp32 CPU tensor's values rounded to TF32 (still fp32); other tensors as they are."""
    if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.device.type != "cpu":
        return t
    bits = t.detach().contiguous().numpy().view(np.uint32)
    return torch.from_numpy(round_bits_to_tf32(bits).view(np.float32)).reshape(t.shape)


def _tf32_handle(handle, input_precision):
    if handle.dtype != tl.float32 or not str(input_precision).endswith(".TF32"):
        return handle
    data = np.ascontiguousarray(handle.data, dtype=np.float32)
    return interpreter.TensorHandle(round_bits_to_tf32(data.view(np.uint32)).view(np.float32), tl.float32)


# (op, which positional arguments are the product's operands)
_PRODUCTS = {
    torch.ops.aten.mm.default: (0, 1),
    torch.ops.aten.bmm.default: (0, 1),
    torch.ops.aten.addmm.default: (1, 2),
    torch.ops.aten.baddbmm.default: (1, 2),
}


class _RoundProducts(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        operands = _PRODUCTS.get(func)
        if operands is not None:
            args = tuple(to_tf32(a) if i in operands else a for i, a in enumerate(args))
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def emulated():
    """TF32 products in the interpreter's dots and torch's CPU matmuls inside the block."""
    inner = Builder.create_dot

    def create_dot(self, a, b, d, input_precision, *args):
        a, b = _tf32_handle(a, input_precision), _tf32_handle(b, input_precision)
        return inner(self, a, b, d, input_precision, *args)

    Builder.create_dot = create_dot
    try:
        with _RoundProducts():
            yield
    finally:
        Builder.create_dot = inner
