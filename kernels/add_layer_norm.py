"""layer_norm(residual + dropout(x)): the public op and its PyTorch reference."""
import torch.nn.functional as F

from kernels._common import FLOAT_DTYPES, REFERENCE_DTYPES, check_dropout_p, check_same_device, check_tensor


def check_add_layer_norm_args(x, residual, weight, bias, eps, dropout_p, dtypes=FLOAT_DTYPES):
    check_tensor("x", x, dtypes=dtypes)
    check_tensor("residual", residual, dtypes=dtypes)
    if x.shape != residual.shape:
        raise ValueError(f"x and residual must have one shape, got x {tuple(x.shape)}, residual {tuple(residual.shape)}")
    d = x.shape[-1]
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None:
            check_tensor(name, t, ndim=1, dtypes=dtypes)
            if t.shape[0] != d:
                raise ValueError(f"{name} must have shape ({d},) to match x {tuple(x.shape)}, got {tuple(t.shape)}")
    check_same_device(x=x, residual=residual, weight=weight, bias=bias)
    if not isinstance(eps, (int, float)) or eps < 0:
        raise ValueError(f"eps must be a non-negative number, got {eps!r}")
    check_dropout_p(dropout_p)


def add_layer_norm_reference(x, residual, weight, bias, eps, dropout_p=0.0):
    """layer_norm(residual + dropout(x)) over the last dimension, in PyTorch (fp64 too, for tests)."""
    check_add_layer_norm_args(x, residual, weight, bias, eps, dropout_p, dtypes=REFERENCE_DTYPES)
    if dropout_p > 0.0:
        x = F.dropout(x, p=dropout_p, training=True)
    return F.layer_norm(residual + x, (x.shape[-1],), weight, bias, eps)


def add_layer_norm(x, residual, weight, bias, eps, dropout_p=0.0):
    """Post-LayerNorm residual block: layer_norm(residual + dropout(x)).

    Args:
        x: (..., d) the sublayer output; residual: same shape; weight, bias: (d,) or None.
        eps: LayerNorm epsilon; dropout_p: dropout on x (pass 0.0 in eval).

    Returns:
        (..., d). Statistics are computed in fp32.
    """
    return add_layer_norm_reference(x, residual, weight, bias, eps, dropout_p)
