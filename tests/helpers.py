"""Comparison helpers shared by the tests."""
import torch


def worst(actual, expected):
    """Largest absolute difference and where it is, for failure messages."""
    diff = (actual.double() - expected.double()).abs()
    index = tuple(int(i) for i in torch.unravel_index(diff.argmax(), diff.shape)) if diff.numel() else ()
    value = diff.max().item() if diff.numel() else 0.0
    return value, index


def assert_within_torch_error(name, actual, reference, torch_same_dtype, atol):
    """flash-attention's rule: max|actual - ref| <= 2 * max|torch_same_dtype - ref| + atol.

    `reference` is computed in fp32/fp64; `torch_same_dtype` is the PyTorch path in the test's dtype.
    """
    assert actual.shape == reference.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(reference.shape)}"
    assert torch.isfinite(actual).all(), f"{name}: non-finite values"
    err, where = worst(actual, reference)
    torch_err, _ = worst(torch_same_dtype, reference)
    bound = 2 * torch_err + atol
    assert err <= bound, (
        f"{name}: max error {err:.3e} at {where} exceeds 2 x torch's {torch_err:.3e} + atol {atol:.1e} = {bound:.3e} "
        f"(actual {actual[where].item():.6f}, reference {reference[where].item():.6f})"
    )


def assert_max_diff(name, actual, expected, tol):
    err, where = worst(actual, expected)
    assert err <= tol, f"{name}: max abs difference {err:.3e} at {where} exceeds {tol:.1e}"
