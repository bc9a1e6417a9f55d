"""bf16 through Triton's interpreter, corrected for the tests (tests/conftest.py installs it).

The interpreter holds a bf16 tensor as its raw 16-bit patterns in a numpy uint16 array (numpy has
no bf16). Two methods of its InterpreterBuilder then compute bf16 wrongly, alike in Triton 3.6 and
3.9:
- `create_dot` hands the operands to np.matmul as they are, which multiplies the patterns as
  integers;
- `cast_impl` (what create_fp_trunc and create_fp_ext call) converts fp32 <-> bf16 through
  `_convert_float` with no rounding mode: fp32 -> bf16 truncates, and subnormals come out wrong
  both ways.
`install()` wraps the two: bf16 operands of a dot become their exact fp32 values, so the product is
accumulated in fp32 as on a GPU, and fp32 <-> bf16 casts are done on the bit patterns, rounding to
nearest even as torch's `.to(torch.bfloat16)` does. Every other call goes to the original methods.

Arithmetic on bf16 values themselves (bf16 + bf16, a comparison of two bf16) stays wrong, done on
the patterns: the kernels do none, they upcast to fp32 after loading (tests/test_interpreter_bf16.py
checks what they do use: masked loads, tl.where, stores, math on the upcast values).
"""

import contextlib

import numpy as np
import triton.language as tl
from triton.runtime import interpreter

Builder = interpreter.InterpreterBuilder
ORIGINAL = {"cast_impl": Builder.cast_impl, "create_dot": Builder.create_dot}


def bf16_to_fp32(bits):
    """uint16 bf16 patterns -> their fp32 values, exactly: a bf16 is the top half of an fp32."""
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def fp32_to_bf16(x):
    """fp32 -> uint16 bf16 patterns rounded to nearest, ties to even, as torch and a GPU round:
    adding 0x7FFF plus the kept half's lowest bit carries exactly the values above half an ulp, and
    at half an ulp only the odd ones; a carry out of the mantissa steps the exponent, up to inf.
    Every NaN becomes the quiet NaN 0x7FC0 (truncated, one could become an inf)."""
    bits = np.asarray(x, dtype=np.float32).view(np.uint32)
    nan = (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    bits = np.where(nan, np.uint32(0x7FC00000), bits)  # also keeps the sum below from overflowing
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    return rounded.astype(np.uint16)


def _as_fp32(handle):
    if handle.dtype != tl.bfloat16:
        return handle
    return interpreter.TensorHandle(bf16_to_fp32(handle.data), tl.float32)


def cast_impl(self, src, dst_type):
    """InterpreterBuilder.cast_impl with fp32 <-> bf16 done right."""
    src_ty, dst_ty = src.dtype.scalar, dst_type.scalar
    if src_ty == tl.bfloat16 and dst_ty == tl.float32:
        return interpreter.TensorHandle(bf16_to_fp32(src.data), tl.float32)
    if src_ty == tl.float32 and dst_ty == tl.bfloat16:
        return interpreter.TensorHandle(fp32_to_bf16(src.data), tl.bfloat16)
    return ORIGINAL["cast_impl"](self, src, dst_type)


def create_dot(self, a, b, d, *args):
    """InterpreterBuilder.create_dot(a, b, d, input_precision, max_num_imprecise_acc) with bf16
    operands as their fp32 values: exact products, summed in d's fp32."""
    return ORIGINAL["create_dot"](self, _as_fp32(a), _as_fp32(b), d, *args)


def install():
    Builder.cast_impl, Builder.create_dot = cast_impl, create_dot


def uninstall():
    Builder.cast_impl, Builder.create_dot = ORIGINAL["cast_impl"], ORIGINAL["create_dot"]


def installed():
    return Builder.create_dot is create_dot


@contextlib.contextmanager
def uncorrected():
    """The interpreter as Triton ships it, for the block; the correction is back after it if it was
    installed before."""
    was_installed = installed()
    uninstall()
    try:
        yield
    finally:
        if was_installed:
            install()
