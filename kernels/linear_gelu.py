"""Linear layer with the exact (erf) GELU: the public op and its PyTorch reference."""
import torch.nn.functional as F

from kernels._common import FLOAT_DTYPES, REFERENCE_DTYPES, check_same_device, check_same_dtype, check_tensor


def check_linear_args(x, weight, bias, x_name="x", weight_name="weight", bias_name="bias", dtypes=FLOAT_DTYPES):
    """Validate an nn.Linear-layout product x @ weight.T + bias; returns (K, N)."""
    check_tensor(x_name, x, dtypes=dtypes)
    check_tensor(weight_name, weight, ndim=2, dtypes=dtypes)
    if x.dim() < 1:
        raise ValueError(f"{x_name} must have at least one dimension, got shape {tuple(x.shape)}")
    N, K = weight.shape
    if x.shape[-1] != K:
        raise ValueError(
            f"{x_name}'s last dimension must equal {weight_name}.shape[1]: got {x_name} {tuple(x.shape)}, "
            f"{weight_name} {tuple(weight.shape)}"
        )
    tensors = {x_name: x, weight_name: weight}
    if bias is not None:
        check_tensor(bias_name, bias, ndim=1, dtypes=dtypes)
        if bias.shape[0] != N:
            raise ValueError(
                f"{bias_name} must have shape ({N},) to match {weight_name} {tuple(weight.shape)}, "
                f"got {tuple(bias.shape)}"
            )
        tensors[bias_name] = bias
    check_same_dtype(**tensors)
    check_same_device(**tensors)
    return K, N


def linear_gelu_reference(x, weight, bias):
    """gelu(x @ weight.T + bias) with the exact erf GELU, in PyTorch (fp64 too, for tests)."""
    check_linear_args(x, weight, bias, dtypes=REFERENCE_DTYPES)
    return F.gelu(F.linear(x, weight, bias))


def linear_gelu(x, weight, bias):
    """Exact (erf) GELU of x @ weight.T + bias.

    Args:
        x: (..., K); weight: (N, K) (nn.Linear layout); bias: (N,) or None. One dtype, one device.

    Returns:
        (..., N) in x's dtype.
    """
    return linear_gelu_reference(x, weight, bias)
