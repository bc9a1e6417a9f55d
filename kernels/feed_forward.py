"""The position-wise feed-forward block, linear(act(linear(x))), act GELU or ReLU: public op and PyTorch reference."""
import torch.nn.functional as F

from kernels._common import (
    FLOAT_DTYPES,
    REFERENCE_DTYPES,
    check_same_device,
    check_same_dtype,
    check_tensor,
)
from kernels.linear_gelu import check_linear_args, linear_gelu, linear_gelu_reference


def check_feed_forward_args(x, w1, b1, w2, b2, dtypes=FLOAT_DTYPES):
    """Validate the FFN's arguments; returns (d, d_ff)."""
    d, d_ff = check_linear_args(x, w1, b1, weight_name="w1", bias_name="b1", dtypes=dtypes)
    check_tensor("w2", w2, ndim=2, dtypes=dtypes)
    if tuple(w2.shape) != (d, d_ff):
        raise ValueError(f"w2 must have shape (d, d_ff) = {(d, d_ff)} to match w1 {tuple(w1.shape)}, got {tuple(w2.shape)}")
    if b2 is not None:
        check_tensor("b2", b2, ndim=1, dtypes=dtypes)
        if tuple(b2.shape) != (d,):
            raise ValueError(f"b2 must have shape ({d},), got {tuple(b2.shape)}")
    check_same_dtype(x=x, w2=w2, **({} if b2 is None else {"b2": b2}))
    check_same_device(x=x, w2=w2, b2=b2)
    return d, d_ff


def feed_forward_reference(x, w1, b1, w2, b2, *, activation="gelu"):
    """linear(gelu(linear(x, w1, b1)), w2, b2) (or relu) in PyTorch (fp64 too, for tests)."""
    check_feed_forward_args(x, w1, b1, w2, b2, dtypes=REFERENCE_DTYPES)
    return F.linear(linear_gelu_reference(x, w1, b1, activation=activation), w2, b2)


def feed_forward(x, w1, b1, w2, b2, *, activation="gelu"):
    """The tutorial's FFN: linear(gelu(linear(x, w1, b1)), w2, b2), exact erf GELU.

    The first GEMM runs in Triton with the bias and GELU fused into its epilogue (`linear_gelu`);
    the second is a cuBLAS GEMM with bias. There is no separate fully fused no-grad FFN yet: one
    is worth keeping only where a GPU benchmark shows it beats this path, which has not been run.

    Args:
        x: (..., d); w1: (d_ff, d); b1: (d_ff,); w2: (d, d_ff); b2: (d,). nn.Linear layout.
        activation: "gelu" (exact erf, the tutorial's) or "relu".

    Returns:
        (..., d) in x's dtype.
    """
    check_feed_forward_args(x, w1, b1, w2, b2)
    return F.linear(linear_gelu(x, w1, b1, activation=activation), w2, b2)
