"""The PyTorch references of the ops: semantics, dtypes, autocast and argument checks."""

import pytest
import torch
import torch.nn.functional as F

from fastformer import kernels
from tests.helpers import assert_max_diff


def naive_attention(q, k, v, mask, scale):
    """fp64 attention with one dense mask, written out longhand."""
    scores = (q.double() @ k.double().transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores.masked_fill(mask, -1e9)
    return torch.softmax(scores, -1) @ v.double()


def qkv(B=2, H=3, Lq=5, Lk=7, D=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, L, D, generator=g).to(dtype) for L in (Lq, Lk, Lk)]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("with_pad", [False, True])
@pytest.mark.parametrize("with_dense", [False, True])
def test_attention_reference_combines_masks_by_or(causal, with_pad, with_dense):
    q, k, v = qkv()
    B, H, Lq, Lk = 2, 3, 5, 7
    pad = torch.tensor([[False] * 5 + [True] * 2, [True, False, True, False, False, False, True]])
    dense = torch.rand(B, H, Lq, Lk, generator=torch.Generator().manual_seed(1)) < 0.3
    full = torch.zeros(B, H, Lq, Lk, dtype=torch.bool)
    if with_pad:
        full |= pad[:, None, None, :]
    if causal:
        full |= torch.ones(Lq, Lk, dtype=torch.bool).triu(1)
    if with_dense:
        full |= dense
    got = kernels.attention_reference(
        q, k, v, key_padding_mask=pad if with_pad else None, causal=causal, attn_mask=dense if with_dense else None
    )
    assert_max_diff("attention", got, naive_attention(q, k, v, full, 16**-0.5), 1e-5)


def test_fully_masked_rows_average_v():
    q, k, v = qkv()
    pad = torch.ones(2, 7, dtype=torch.bool)
    pad[1, :3] = False  # batch 1 keeps three keys; batch 0 is all padding
    out = kernels.attention_reference(q, k, v, key_padding_mask=pad)
    assert_max_diff("all-padding row", out[0], v[0].mean(dim=1, keepdim=True).expand_as(out[0]), 1e-6)
    # causal + padding: query 0 sees key 0 only, which is padding -> the row is fully masked
    pad = torch.zeros(2, 7, dtype=torch.bool)
    pad[:, 0] = True
    out = kernels.attention_reference(q, k, v, key_padding_mask=pad, causal=True)
    assert_max_diff("causal+pad row", out[:, :, 0], v.mean(dim=2), 1e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_attention_reference_half_precision_is_finite_and_close(dtype):
    q, k, v = qkv(dtype=dtype)
    pad = torch.zeros(2, 7, dtype=torch.bool)
    pad[0] = True
    out, probs = kernels.attention_reference(q, k, v, key_padding_mask=pad, causal=True, return_probs=True)
    assert out.dtype == dtype and probs.dtype == dtype
    assert torch.isfinite(out).all()
    full = pad[:, None, None, :] | torch.ones(5, 7, dtype=torch.bool).triu(1)
    assert_max_diff(f"{dtype} attention", out, naive_attention(q, k, v, full, 0.25), 2e-2)


def test_attention_reference_under_autocast_and_backward():
    q, k, v = (t.requires_grad_() for t in qkv())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = kernels.attention_reference(q, k, v, causal=True)
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def test_attention_return_probs_and_dropout():
    q, k, v = qkv(Lq=64, Lk=64)
    out, probs = kernels.attention_reference(q, k, v, return_probs=True)
    assert probs.shape == (2, 3, 64, 64)
    assert_max_diff("rows sum to one", probs.sum(-1), torch.ones(2, 3, 64), 1e-5)
    torch.manual_seed(0)
    out, probs = kernels.attention_reference(q, k, v, dropout_p=0.5, return_probs=True)
    assert_max_diff("probs @ v", out, probs @ v, 1e-5)
    kept = (probs > 0).float().mean().item()
    assert abs(kept - 0.5) < 0.02, kept
    torch.manual_seed(0)
    again = kernels.attention_reference(q, k, v, dropout_p=0.5)
    assert torch.equal(out, again)


def test_attention_reference_takes_non_contiguous_views():
    B, L, H, D = 2, 6, 3, 16
    fused = torch.randn(B, L, 3, H, D)
    q, k, v = (t.transpose(1, 2) for t in fused.unbind(2))  # views with strides
    assert not q.is_contiguous()
    got = kernels.attention_reference(q, k, v)
    assert_max_diff("views", got, naive_attention(q, k, v, None, D**-0.5), 1e-5)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"q": torch.randn(2, 3, 5)}, ValueError, r"q must have 4 dimensions, got shape \(2, 3, 5\)"),
        ({"k": torch.randn(2, 4, 7, 16)}, ValueError, "share batch and heads"),
        ({"v": torch.randn(2, 3, 7, 8)}, ValueError, "share the head dim"),
        ({"v": torch.randn(2, 3, 6, 16)}, ValueError, "k and v must have the same length"),
        ({"q": torch.ones(2, 3, 5, 16, dtype=torch.int32)}, TypeError, "q must be one of"),
        ({"k": torch.randn(2, 3, 7, 16).half()}, TypeError, "share one dtype"),
        ({"q": [1, 2]}, TypeError, "q must be a torch.Tensor"),
        (
            {"key_padding_mask": torch.zeros(2, 6, dtype=torch.bool)},
            ValueError,
            r"key_padding_mask must have shape \(B, Lk\)",
        ),
        ({"key_padding_mask": torch.zeros(2, 7)}, TypeError, "key_padding_mask must be one of"),
        ({"attn_mask": torch.zeros(2, 5, 6, dtype=torch.bool)}, ValueError, "attn_mask must have shape"),
        ({"attn_mask": torch.zeros(2, 5, 7, dtype=torch.long)}, TypeError, "attn_mask must be one of"),
        ({"dropout_p": 1.0}, ValueError, "dropout_p"),
        ({"softmax_scale": -1.0}, ValueError, "softmax_scale"),
        ({"seed": torch.zeros(1)}, ValueError, r"seed must be a one-element int64 tensor .* got torch.float32"),
        (
            {"seed": torch.zeros(1, dtype=torch.int32)},
            ValueError,
            r"seed must be a one-element int64 tensor .* got torch.int32",
        ),
        (
            {"seed": torch.zeros(2, dtype=torch.int64)},
            ValueError,
            r"seed must be a one-element int64 tensor .* shape \(2,\)",
        ),
        ({"seed": 1234}, TypeError, "seed must be a torch.Tensor or None, got int"),
    ],
)
@pytest.mark.parametrize("op", ["attention", "attention_reference"])
def test_attention_rejects_bad_arguments(op, kwargs, error, message):
    q, k, v = qkv()
    args = {"q": q, "k": k, "v": v, **kwargs}
    with pytest.raises(error, match=message):
        getattr(kernels, op)(args.pop("q"), args.pop("k"), args.pop("v"), **args)


def test_linear_gelu_and_feed_forward_references():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 8, generator=g)
    w1, b1 = torch.randn(16, 8, generator=g), torch.randn(16, generator=g)
    w2, b2 = torch.randn(8, 16, generator=g), torch.randn(8, generator=g)
    hidden = kernels.linear_gelu_reference(x, w1, b1)
    exact = 0.5 * (x @ w1.T + b1) * (1 + torch.erf((x @ w1.T + b1) / 2**0.5))
    assert_max_diff("linear_gelu", hidden, exact, 1e-5)
    assert_max_diff(
        "linear_gelu relu",
        kernels.linear_gelu_reference(x, w1, b1, activation="relu"),
        (x @ w1.T + b1).clamp_min(0),
        1e-5,
    )
    assert_max_diff("feed_forward", kernels.feed_forward_reference(x, w1, b1, w2, b2), exact @ w2.T + b2, 1e-4)
    assert_max_diff("public feed_forward", kernels.feed_forward(x, w1, b1, w2, b2), exact @ w2.T + b2, 1e-4)


@pytest.mark.parametrize("op", ["linear_gelu", "linear_gelu_reference"])
def test_linear_rejects_bad_arguments(op):
    x, w, b = torch.randn(4, 8), torch.randn(16, 8), torch.randn(16)
    linear = getattr(kernels, op)
    with pytest.raises(ValueError, match=r"x's last dimension must equal weight\.shape"):
        linear(torch.randn(4, 7), w, b)
    with pytest.raises(ValueError, match=r"bias must have shape \(16,\)"):
        linear(x, w, torch.randn(8))
    with pytest.raises(TypeError, match="share one dtype"):
        linear(x.half(), w, b)
    with pytest.raises(ValueError, match="activation must be one of"):
        linear(x, w, b, activation="swish")


def test_ffn_rejects_bad_arguments():
    x, w, b = torch.randn(4, 8), torch.randn(16, 8), torch.randn(16)
    with pytest.raises(ValueError, match=r"w2 must have shape \(d, d_ff\)"):
        kernels.feed_forward(x, w, b, torch.randn(8, 15), torch.randn(8))
    with pytest.raises(ValueError, match=r"b2 must have shape \(8,\)"):
        kernels.feed_forward(x, w, b, torch.randn(8, 16), torch.randn(16))


def test_add_layer_norm_reference():
    g = torch.Generator().manual_seed(0)
    x, res = torch.randn(4, 6, 32, generator=g), torch.randn(4, 6, 32, generator=g)
    w, b = torch.randn(32, generator=g), torch.randn(32, generator=g)
    expected = F.layer_norm(res + x, (32,), w, b, 1e-12)
    assert_max_diff("add_layer_norm", kernels.add_layer_norm_reference(x, res, w, b, 1e-12), expected, 1e-5)
    assert_max_diff("public add_layer_norm", kernels.add_layer_norm(x, res, w, b, 1e-12), expected, 1e-5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = kernels.add_layer_norm_reference(x.bfloat16(), res, w, b, 1e-5)
    assert torch.isfinite(out).all()
    with pytest.raises(ValueError, match="x and residual must have one shape"):
        kernels.add_layer_norm(x, res[:, :5], w, b, 1e-5)
    with pytest.raises(ValueError, match=r"weight must have shape \(32,\)"):
        kernels.add_layer_norm(x, res, w[:8], b, 1e-5)
    with pytest.raises(ValueError, match="dropout_p"):
        kernels.add_layer_norm(x, res, w, b, 1e-5, dropout_p=-0.1)
