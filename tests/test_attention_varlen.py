"""kernels.attention_varlen, attention over packed sequences (issue 67, item 1), against the fp64
reference and against kernels.attention over the same sequences padded.

Sequences of mixed lengths, one of no queries, one of a single token, one of no keys for
cross-attention, lengths that are not block multiples; the parity rule in fp32, fp16 and bf16 at
head dims 16 to 128; the padded op's values bit for bit under the interpreter (the same kernels
and, for sequence b, the dropout mask of batch index b), in one backward pass and in two; every
tensor as a strided and an expanded view; the offsets' checks.
"""

import itertools
import sys

import pytest
import torch

from fastformer import kernels
from tests.helpers import assert_max_diff, assert_within_torch_error
from tests.test_attention import BF16, FP16, FP32

SELF = ([5, 0, 1, 33, 17], None)  # query lengths; keys the same
CROSS = ([5, 2, 1, 33, 17], [7, 0, 3, 20, 40])  # a sequence with no keys


def offsets(lengths, device):
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)


def packed_inputs(lq, lk, H, D, device, seed=0):
    """fp64 q (total_q, H, D), k, v (total_k, H, D), do, and the varlen arguments."""
    lk = lq if lk is None else lk
    g = torch.Generator().manual_seed(seed)
    q, do = (torch.randn(sum(lq), H, D, generator=g, dtype=torch.float64).to(device) for _ in range(2))
    k, v = (torch.randn(sum(lk), H, D, generator=g, dtype=torch.float64).to(device) for _ in range(2))
    lengths = (offsets(lq, device), offsets(lk, device), max(lq), max(lk))
    return q, k, v, do, lengths


def run(op, q, k, v, do, dtype, lengths, **kwargs):
    """[out, dq, dk, dv] of `op` on copies of q, k, v cast to dtype."""
    leaves = [t.detach().to(dtype).clone().requires_grad_() for t in (q, k, v)]
    out = op(*leaves, *lengths, **kwargs)
    out.backward(do.to(dtype))
    return [out] + [t.grad for t in leaves]


@pytest.mark.parametrize("dtype, atol", [FP32, FP16, BF16])
@pytest.mark.parametrize(
    "lengths, causal", [(SELF, False), (SELF, True), (CROSS, False), (CROSS, True)],
    ids=["self", "self-causal", "cross", "cross-causal"],
)  # fmt: skip
def test_parity(lengths, causal, dtype, atol, device):
    q, k, v, do, cu = packed_inputs(*lengths, H=2, D=16, device=device, seed=1)
    reference = run(kernels.attention_varlen_reference, q, k, v, do, torch.float64, cu, causal=causal)
    torch_same = run(kernels.attention_varlen_reference, q, k, v, do, dtype, cu, causal=causal)
    ours = run(kernels.attention_varlen, q, k, v, do, dtype, cu, causal=causal)
    for name, a, r, t in zip(("out", "dq", "dk", "dv"), ours, reference, torch_same):
        assert a.dtype == dtype, name
        assert_within_torch_error(name, a, r, t, atol)


@pytest.mark.parametrize("D", [32, 64, 72, 128])
def test_parity_head_dims(D, device):
    q, k, v, do, cu = packed_inputs([9, 40, 1], [30, 17, 64], H=1, D=D, device=device, seed=2)
    reference = run(kernels.attention_varlen_reference, q, k, v, do, torch.float64, cu, causal=True)
    torch_same = run(kernels.attention_varlen_reference, q, k, v, do, torch.float16, cu, causal=True)
    ours = run(kernels.attention_varlen, q, k, v, do, torch.float16, cu, causal=True)
    for name, a, r, t in zip(("out", "dq", "dk", "dv"), ours, reference, torch_same):
        assert_within_torch_error(name, a, r, t, 1e-3)


def padded(t, lengths):
    """(B, H, max L, D) zero-padded from packed (total, H, D) rows, and the (B, max L) padding."""
    L = max(lengths)
    out = t.new_zeros(len(lengths), L, *t.shape[1:])
    pad = torch.ones(len(lengths), L, dtype=torch.bool, device=t.device)
    for b, (start, n) in enumerate(zip(itertools.accumulate([0, *lengths]), lengths)):
        out[b, :n] = t[start : start + n]
        pad[b, :n] = False
    return out.transpose(1, 2), pad


def unpadded(t, lengths):
    """Packed (total, H, D) rows of a (B, H, L, D) tensor's real rows."""
    return torch.cat([t[b, :, :n].transpose(0, 1) for b, n in enumerate(lengths)])


@pytest.mark.parametrize("way", ["two-pass", "one-pass"])
@pytest.mark.parametrize(
    "lq, lk, causal", [([5, 1, 33, 17], None, True), ([5, 2, 33, 17], [7, 3, 20, 40], False)], ids=["self", "cross"]
)
def test_the_padded_op_over_the_same_sequences(lq, lk, causal, way, device):
    """attention over the sequences padded, with the key padding as its mask and the same seed:
    its values on the real rows, with dropout (sequence b drops what batch index b does). Bit for
    bit under the interpreter; on a GPU the two calls' rules may pick other tiles (the padded call
    has a padding flag), so within fp32 rounding."""
    lk = lq if lk is None else lk
    q, k, v, do, cu = packed_inputs(lq, lk, H=2, D=16, device=device, seed=3)
    seed = torch.tensor([1234], dtype=torch.int64, device=device)
    kwargs = dict(causal=causal, dropout_p=0.3, seed=seed)
    with kernels.attention_backward(way):
        ours = run(kernels.attention_varlen, q, k, v, do, torch.float32, cu, **kwargs)
        (qp, _), (kp, pad), (vp, _), (dop, _) = padded(q, lq), padded(k, lk), padded(v, lk), padded(do, lq)
        theirs = run(kernels.attention, qp, kp, vp, dop, torch.float32, (), key_padding_mask=pad, **kwargs)
    for name, a, b, n in zip(("out", "dq", "dk", "dv"), ours, theirs, (lq, lq, lk, lk)):
        b = unpadded(b, n)
        if device == "cpu" and not (way == "one-pass" and name == "dq"):
            assert torch.equal(a, b), name
        else:  # dQ's sums by atomics in the order their programs ran
            assert_max_diff(name, a, b, 2e-6 * max(b.abs().max().item(), 1.0))


def test_every_tensor_as_a_strided_and_an_expanded_view(device):
    """q and v as column slices of fused projection rows, k one head expanded to all, do
    transposed, cu_seqlens_q a strided view: the values and gradients of contiguous copies, bit
    for bit under the interpreter."""
    lq, H, D = [4, 19, 1], 2, 16
    cu = offsets(lq, device)
    g = torch.Generator().manual_seed(4)
    qkv = torch.randn(sum(lq), 3, H, D, generator=g).to(device).requires_grad_()
    k_one = torch.randn(sum(lq), 1, D, generator=g).to(device).requires_grad_()
    do = torch.randn(H, sum(lq), D, generator=g).to(device).transpose(0, 1)  # (total, H, D), head-major
    q, v, k = qkv[:, 0], qkv[:, 2], k_one.expand(-1, H, -1)
    cu_strided = torch.stack([cu, torch.zeros_like(cu)], 1)[:, 0]  # the offsets every other int32
    out = kernels.attention_varlen(q, k, v, cu_strided, cu, max(lq), max(lq), causal=True)
    out.backward(do)
    leaves = [t.detach().contiguous().requires_grad_() for t in (q, k, v)]
    out_c = kernels.attention_varlen(*leaves, cu, cu, max(lq), max(lq), causal=True)
    out_c.backward(do.contiguous())
    check = torch.equal if device == "cpu" else lambda a, b: torch.allclose(a, b, rtol=1e-5, atol=1e-6)
    assert check(out, out_c)
    assert check(qkv.grad[:, 0], leaves[0].grad) and check(qkv.grad[:, 2], leaves[2].grad)
    assert torch.equal(qkv.grad[:, 1], torch.zeros_like(qkv.grad[:, 1]))
    assert check(k_one.grad, leaves[1].grad.sum(1, keepdim=True))


def test_no_keys_no_queries_and_no_sequences(device):
    """A query with no keys gets zeros and sends no gradient; no query rows, or no sequences at
    all, launch nothing and give empty outputs with zero gradients."""
    q, k, v, do, cu = packed_inputs([3, 4], [0, 5], H=2, D=16, device=device, seed=5)
    out, dq, dk, dv = run(kernels.attention_varlen, q, k, v, do, torch.float32, cu)
    assert torch.equal(out[:3], torch.zeros_like(out[:3])) and torch.equal(dq[:3], torch.zeros_like(dq[:3]))
    for lq, lk in (([0, 0], [2, 3]), ([], [])):
        q, k, v, do, cu = packed_inputs(lq or [0], lk or [0], H=2, D=16, device=device, seed=6)
        if not lq:
            cu = (torch.zeros(1, dtype=torch.int32, device=device),) * 2 + (0, 0)
        out, dq, dk, dv = run(kernels.attention_varlen, q, k, v, do, torch.float32, cu)
        assert out.shape == (0, 2, 16) and dq.shape == (0, 2, 16)
        assert torch.equal(dk, torch.zeros_like(dk)) and torch.equal(dv, torch.zeros_like(dv))


def test_its_launches():
    """One forward launch; the backward two (dQ, then dK/dV) or, in one pass, three."""
    from tests.test_attention_one_pass import ONE_PASS, backward_kernels
    from tools import launches

    q, k, v, _, cu = packed_inputs([5, 9], None, H=2, D=16, device="cpu", seed=7)
    q, k, v = (t.float().requires_grad_() for t in (q, k, v))
    with launches.counting("cpu") as counter:
        kernels.attention_varlen(q, k, v, *cu)
    assert counter.ops("forward") == {"triton._attn_fwd_kernel": 1}
    with kernels.attention_backward("two-pass"):
        assert backward_kernels(kernels.attention_varlen, q, k, v, *cu) == {"_attn_bwd_kernel": 2}
    with kernels.attention_backward("one-pass"):
        assert backward_kernels(kernels.attention_varlen, q, k, v, *cu) == ONE_PASS


def _bad(**changes):
    q, k, v, _, (cu_q, cu_k, max_q, max_k) = packed_inputs([3, 4], [2, 5], H=2, D=16, device="cpu")
    args = dict(q=q.float(), k=k.float(), v=v.float(), cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    args.update(max_seqlen_q=max_q, max_seqlen_k=max_k)
    args.update(changes)
    return args


@pytest.mark.parametrize(
    "changes, error, words",
    [
        (dict(q=torch.zeros(7, 2, 2, 16)), ValueError, "q must have 3 dimensions"),
        (dict(k=torch.zeros(7, 3, 16)), ValueError, "k and v must have one shape"),
        (dict(q=torch.zeros(7, 3, 16)), ValueError, "share heads and head dim"),
        (dict(q=torch.zeros(7, 2, 16, dtype=torch.float16)), TypeError, "share one dtype"),
        (dict(cu_seqlens_q=torch.tensor([0, 3, 7])), TypeError, "cu_seqlens_q must be one of \\(int32\\)"),
        (dict(cu_seqlens_k=torch.tensor([0, 7], dtype=torch.int32)), ValueError, "count the same sequences"),
        (dict(cu_seqlens_q=torch.tensor([1, 3, 7], dtype=torch.int32)), ValueError, "cu_seqlens_q must rise from 0"),
        (dict(cu_seqlens_q=torch.tensor([0, 5, 6], dtype=torch.int32)), ValueError, "to its tensor's 7 rows"),
        (dict(cu_seqlens_k=torch.tensor([0, 8, 7], dtype=torch.int32)), ValueError, "never falling"),
        (dict(max_seqlen_q=3), ValueError, "max_seqlen_q is 3, but cu_seqlens_q holds a sequence of 4"),
        (dict(max_seqlen_k=-1), ValueError, "max_seqlen_k must be an int >= 0"),
        (dict(max_seqlen_k=True), ValueError, "max_seqlen_k must be an int >= 0"),
        (dict(causal="yes"), TypeError, "causal must be a bool"),
        (dict(dropout_p=1.0), ValueError, "dropout_p must be a float in \\[0, 1\\)"),
        (dict(softmax_scale=0.0), ValueError, "softmax_scale must be a positive finite number"),
        (dict(seed=torch.tensor([1, 2])), ValueError, "seed must be a one-element int64 tensor"),
    ],
    ids=lambda x: x if isinstance(x, str) else None,
)
def test_bad_arguments_are_refused_naming_them(changes, error, words):
    for op in (kernels.attention_varlen, kernels.attention_varlen_reference):
        with pytest.raises(error, match=words):
            op(**_bad(**changes))


def test_the_offsets_are_read_once_per_tensor_and_contents(monkeypatch):
    """A loop over the same offsets copies them to the host once; changed in place (a new version),
    or given with a smaller max_seqlen, they are read and refused again."""
    module = sys.modules["fastformer.kernels.attention_varlen"]  # (kernels.attention_varlen is the op)
    reads = []
    module._checked.clear()
    original_tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(t.shape) or original_tolist(t))
    args = _bad()
    for _ in range(3):
        kernels.attention_varlen(**args)
    assert len(reads) == 2  # cu_seqlens_q and cu_seqlens_k, the first call only
    with pytest.raises(ValueError, match="max_seqlen_q is 3"):
        kernels.attention_varlen(**{**args, "max_seqlen_q": 3})
    args["cu_seqlens_k"][1] = 9  # in place: 0, 9, 7
    with pytest.raises(ValueError, match="never falling"):
        kernels.attention_varlen(**args)
