"""The one-pass attention backward (dQ summed by atomics inside the dK/dV pass: 5 products a tile)
against the fp64 reference and against the two passes, and when it runs (kernels/_backward_choice.py).

On a CPU the interpreter runs the programs one after another, so the atomics' sums come out in one
order; only a GPU shows them racing. What the CPU can show: the parity rule, dK and dV bit for bit
the two passes' (the same code computes them), dQ within fp32 rounding of theirs (summed in
another order), and which way each switch and rule picks.
"""

import importlib
import itertools
import re
from pathlib import Path

import pytest
import torch

from fastformer import kernels
from fastformer.kernels import _configs
from tests import test_attention
from tests.helpers import assert_max_diff, assert_within_torch_error
from tests.test_attention import BF16, FP16, FP32, check_parity, make_inputs, padding, run
from tools.sm90_cases import HEAD_DIMS, MASKS


@pytest.fixture
def one_pass():
    with kernels.attention_backward("one-pass"):
        yield


def both_ways(q, k, v, do, dtype, seed=11, **kwargs):
    """[out, dq, dk, dv] of kernels.attention in two passes and in one, on the same dropout seed."""
    results = []
    for way in ("two-pass", "one-pass"):
        torch.manual_seed(seed)
        with kernels.attention_backward(way):
            results.append(run(kernels.attention, q, k, v, do, dtype, **kwargs))
    return results


def assert_one_pass_matches_two(two, one, tol=2e-6):
    """The output bit for bit (the same forward); dK and dV bit for bit under the interpreter, where
    both ways take one tile and the same code computes them (on a GPU each way's rule picks its
    own tile, so the sums' order differs: within fp32 rounding); dQ within fp32 rounding of the
    sums' other order."""
    assert two[0] is None or torch.equal(two[0], one[0]), "out"
    for name, a, b in zip(("dq", "dk", "dv"), two[1:], one[1:]):
        if name != "dq" and not a.is_cuda:
            assert torch.equal(a, b), name
        else:
            assert_max_diff(name, b, a, tol * max(a.abs().max().item(), 1.0))


def backward_kernels(op, *args, **kwargs):
    """{kernel name: launches} of the backward of op(*args, **kwargs).sum(), by tools.launches' counter."""
    from tools import launches

    out = op(*args, **kwargs)
    with launches.counting("cpu") as counter:
        counter.phase = "backward"
        out.sum().backward()
    ops = counter.ops("backward")
    return {name.removeprefix("triton."): n for name, n in ops.items() if name.startswith("triton.")}


ONE_PASS = {"_attn_bwd_delta_kernel": 1, "_attn_bwd_one_pass_kernel": 1, "_attn_bwd_dq_convert_kernel": 1}
TWO_PASSES = {"_attn_bwd_kernel": 2}
attention_module = importlib.import_module("fastformer.kernels.attention")  # kernels.attention is the op


SHAPES = [
    (1, 1, 1, 1, 16),  # length 1
    (2, 3, 17, 100, 64),  # Lq != Lk (cross-attention), not block multiples
    (2, 2, 100, 17, 32),
    (2, 3, 21, 21, 72),  # rows aligned by the ROW_ALIGN hint, head dim padded in the kernel
    (1, 2, 33, 40, 128),
]


@pytest.mark.parametrize("dtype, atol", [FP16, BF16])
@pytest.mark.parametrize("B, H, Lq, Lk, D", SHAPES)
def test_parity_shapes(B, H, Lq, Lk, D, dtype, atol, device, one_pass):
    q, k, v, do = make_inputs(B, H, Lq, Lk, D, device)
    check_parity(q, k, v, do, dtype, atol)


@pytest.mark.parametrize("B, H, Lq, Lk, D", [shape for shape in SHAPES if shape[-1] <= 32] + [(2, 3, 17, 100, 32)])
def test_parity_shapes_fp32(B, H, Lq, Lk, D, device, one_pass):
    """fp32 takes the one pass at head dims up to 32 (above, the two passes: _one_pass)."""
    q, k, v, do = make_inputs(B, H, Lq, Lk, D, device)
    check_parity(q, k, v, do, torch.float32, 1e-5)


@pytest.mark.parametrize("dtype, atol", [FP32, BF16])
@pytest.mark.parametrize("where", ["end", "middle", "all"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_parity_key_padding(where, causal, dtype, atol, device, one_pass):
    q, k, v, do = make_inputs(3, 2, 37, 37, 32, device, seed=1)
    check_parity(q, k, v, do, dtype, atol, key_padding_mask=padding(3, 37, where, device), causal=causal)


@pytest.mark.parametrize("per_head", [False, True], ids=["(B,Lq,Lk)", "(B,H,Lq,Lk)"])
def test_parity_dense_mask(per_head, device, one_pass):
    q, k, v, do = make_inputs(2, 2, 30, 41, 16, device, seed=2)
    shape = (2, 2, 30, 41) if per_head else (2, 30, 41)
    mask = torch.rand(shape, generator=torch.Generator().manual_seed(3)) < 0.3
    mask[0, ..., 5, :] = True  # a row whose keys are all masked
    pad = padding(2, 41, "end", device)
    check_parity(q, k, v, do, torch.float32, 1e-5, attn_mask=mask.to(device), key_padding_mask=pad)


@pytest.mark.parametrize("dtype, atol", [FP32, BF16])
def test_parity_with_dropout(dtype, atol, device, one_pass):
    """Dropout regenerated in the pass from the forward's seed: test_attention's check against the
    reference given the kernels' mask, with a batch all padding (rows whose keys are all masked
    reach dV only)."""
    test_attention.TestDropout().check_against_the_reference(dtype, atol, device)  # not collected here


@pytest.mark.parametrize(
    "kwargs",
    [
        {"causal": True},
        {"key_padding_mask": "middle", "causal": True, "dropout_p": 0.2},
        {"key_padding_mask": "all", "dropout_p": 0.1},
    ],
    ids=["causal", "padding+causal+dropout", "all-padding+dropout"],
)
def test_the_one_pass_matches_the_two(kwargs, device):
    kwargs = dict(kwargs)
    if "key_padding_mask" in kwargs:
        kwargs["key_padding_mask"] = padding(2, 45, kwargs["key_padding_mask"], device)
    q, k, v, do = make_inputs(2, 3, 40, 45, 32, device, seed=4)
    assert_one_pass_matches_two(*both_ways(q, k, v, do, torch.float32, **kwargs))


def test_every_tensor_as_a_strided_and_an_expanded_view(device, one_pass):
    """q as a slice of a wider tensor, k and v expanded over the heads (stride 0), dO transposed."""
    B, H, L, D = 2, 3, 24, 16
    g = torch.Generator().manual_seed(8)
    wide = torch.randn(B, H, L, 2 * D, generator=g).to(device)
    q = wide[..., :D]
    k = torch.randn(B, 1, L, D, generator=g).to(device).expand(B, H, L, D)
    v = torch.randn(B, 1, L, D, generator=g).to(device).expand(B, H, L, D)
    do = torch.randn(B, L, H, D, generator=g).to(device).transpose(1, 2)
    ours = run(kernels.attention, q, k, v, do, torch.float32, causal=True)
    reference = run(kernels.attention_reference, q, k, v, do, torch.float64, causal=True)
    torch_same = run(kernels.attention_reference, q, k, v, do, torch.float32, causal=True)
    for name, a, r, t in zip(("out", "dq", "dk", "dv"), ours, reference, torch_same):
        assert_within_torch_error(name, a, r, t, 1e-5)


def test_self_attention_in_one_pass(device):
    """self_attention's backward writes qkv's gradient in one pass too: its columns as
    assert_one_pass_matches_two holds attention's."""
    B, L, H, D = 2, 33, 2, 16
    qkv = torch.randn(B, L, 3 * H * D, generator=torch.Generator().manual_seed(9)).to(device)
    dcontext = torch.randn(B, L, H * D, generator=torch.Generator().manual_seed(10)).to(device)
    pad = padding(B, L, "end", device)
    grads = []
    for way in ("two-pass", "one-pass"):
        x = qkv.clone().requires_grad_()
        with kernels.attention_backward(way):
            kernels.self_attention(x, H, key_padding_mask=pad, causal=True).backward(dcontext)
        grads.append(x.grad)
    two, one = (g.split(H * D, dim=-1) for g in grads)
    assert_one_pass_matches_two([None, *two], [None, *one])
    with kernels.attention_backward("one-pass"):  # its launches, counted on the CPU
        assert backward_kernels(kernels.self_attention, qkv.cpu().requires_grad_(), H) == ONE_PASS


def test_the_unplanned_call_takes_the_same_way(device, one_pass):
    """A call no plan runs (probabilities asked for) launches the one pass as a planned call does:
    the same kernels, the same bits."""
    q, k, v, do = make_inputs(2, 2, 20, 26, 16, device, seed=12)
    pad = padding(2, 26, "end", device)
    planned = run(kernels.attention, q, k, v, do, torch.float32, key_padding_mask=pad)

    def with_probs(q, k, v, **kwargs):
        return kernels.attention(q, k, v, return_probs=True, **kwargs)[0]

    unplanned = run(with_probs, q, k, v, do, torch.float32, key_padding_mask=pad)
    for name, a, b in zip(("out", "dq", "dk", "dv"), planned, unplanned):
        assert torch.equal(a, b), name


def test_the_launches_of_each_way_and_determinism():
    """One pass: delta and zeroed sums, dK/dV/dQ, dQ from the sums (3 launches); two: the dQ and
    dK/dV passes. Under torch.use_deterministic_algorithms(True) the two passes, whatever the
    choice, and the planned call's gradients are theirs bit for bit."""
    q, k, v = (t.float().requires_grad_() for t in make_inputs(2, 2, 30, 30, 16, "cpu", seed=13)[:3])
    with kernels.attention_backward("one-pass"):
        assert backward_kernels(kernels.attention, q, k, v, causal=True) == ONE_PASS
    with kernels.attention_backward("two-pass"):
        assert backward_kernels(kernels.attention, q, k, v, causal=True) == TWO_PASSES
        two = torch.autograd.grad(kernels.attention(q, k, v, causal=True).sum(), (q, k, v))
    torch.use_deterministic_algorithms(True)
    try:
        with kernels.attention_backward("one-pass"):
            assert backward_kernels(kernels.attention, q, k, v, causal=True) == TWO_PASSES
            planned = torch.autograd.grad(kernels.attention(q, k, v, causal=True).sum(), (q, k, v))
    finally:
        torch.use_deterministic_algorithms(False)
    for name, a, b in zip(("dq", "dk", "dv"), two, planned):
        assert torch.equal(a, b), name


def test_the_rule_and_the_choices(monkeypatch):
    """auto: one pass from ONE_PASS_FROM queries and keys at head dims up to 64, two below (the
    model's lengths) and above; the choice overrules the rule; determinism and fp32 above head
    dim 32 overrule both, and a traced call keeps the two passes."""
    edge = attention_module.ONE_PASS_FROM

    def one_pass(Lq, Lk, D=64, dtype=torch.bfloat16):
        return attention_module._one_pass(Lq, Lk, D, dtype)

    assert kernels.attention_backward_choice() == "auto"
    assert one_pass(edge, edge) and one_pass(4096, 4096) and one_pass(4096, 4096, 16)
    assert not one_pass(edge - 1, 4096) and not one_pass(4096, edge - 1) and not one_pass(256, 256)
    assert not one_pass(4096, 4096, 72) and not one_pass(4096, 4096, 128)
    with kernels.attention_backward("one-pass"):
        assert one_pass(64, 64) and one_pass(1, 1) and one_pass(64, 64, 128) and one_pass(64, 64, 32, torch.float32)
        assert not one_pass(4096, 4096, 64, torch.float32)  # fp32 above head dim 32: no clean config
        assert attention_module._on_real_tensors(torch.ones(1))
        with torch._subclasses.fake_tensor.FakeTensorMode() as fake:
            assert not attention_module._on_real_tensors(fake.from_tensor(torch.ones(1)))
        torch.use_deterministic_algorithms(True)
        try:
            assert not one_pass(4096, 4096)
        finally:
            torch.use_deterministic_algorithms(False)
    with kernels.attention_backward("two-pass"):
        assert not one_pass(4096, 4096)
    monkeypatch.setenv("FASTFORMER_ATTENTION_BACKWARD", "one-pass")
    assert one_pass(64, 64)
    with kernels.attention_backward("auto"):  # a choice made in Python stands for the variable
        assert not one_pass(64, 64)


def test_bad_choices_are_refused_naming_them(monkeypatch):
    with pytest.raises(ValueError, match="set_attention_backward's way must be"):
        kernels.set_attention_backward("fast")
    monkeypatch.setenv("FASTFORMER_ATTENTION_BACKWARD", "1")
    with pytest.raises(ValueError, match="FASTFORMER_ATTENTION_BACKWARD must be two-pass"):
        _configs.check_environment()


def test_five_products_a_tile_where_the_two_passes_take_seven():
    """tools.work's count of the backward's FLOPs (2 D per pair and product, from each launch's
    arguments): the two passes 3 + 4 products a tile, the one pass 5, and its delta and dQ
    launches none: 5 / 7 of the tensor-core work, for one launch more."""
    from tools import launches, work

    B, H, L, D = 1, 2, 48, 16
    q, k, v = (t.float().requires_grad_() for t in make_inputs(B, H, L, L, D, "cpu", seed=14)[:3])
    flops = {}
    for way in ("two-pass", "one-pass"):
        out = kernels.attention(q, k, v)
        counter = work._work_counter("cpu")
        with kernels.attention_backward(way), launches.counting("cpu", counter):
            counter.phase = "backward"
            out.sum().backward()
        records = [r for r in counter.records if r.name.startswith("triton._attn")]
        flops[way] = (sum(r.flops for r in records), len(records))
    pair_product = 2 * D * H * B * L * L
    assert flops == {"two-pass": (7 * pair_product, 2), "one-pass": (5 * pair_product, 3)}


RESULTS = Path(__file__).resolve().parent.parent / "tools" / "results"
ONE_PASS_TABLES = {"3.9": RESULTS / "sm90-one-pass.md", "3.6": RESULTS / "sm90-one-pass-triton36.md"}
# a 32-row tile's verdict: dS K off wgmma, and in places ptxas's note that it serializes the others
NOT_WGMMA = re.compile(r"^(\d+) of (\d+) dots are not wgmma \(mma\.sync or FMA\)(; ptxas: \(C7515\) .*)?$")


def one_pass_kept(D, mask, dropout, tma, L=256):
    """[(meta, num_warps, num_stages)] the one pass's rule keeps for an fp16 launch."""
    pad, causal, dense = MASKS[mask]
    flags = {
        "HEAD_DIM": D, "BLOCK_D": attention_module._head_block(D), "LQ_BUCKET": L, "LK_BUCKET": L,
        "HAS_PAD": pad, "IS_CAUSAL": causal, "HAS_MASK": dense, "HAS_DROPOUT": dropout, "TMA": tma,
    }  # fmt: skip
    return [c for c in attention_module._attn_bwd_one_pass.candidates if attention_module._one_pass_fits(*c, flags)]


def test_the_rule_keeps_64_query_rows_wherever_one_fits_and_a_config_everywhere():
    """wgmma takes 64 rows at least, so the fifth product (dS K, the tile's query rows) is on the
    tensor cores' fast path only with 64-row tiles: kept wherever dK/dV's rule keeps one, the
    32-row ones only where it keeps none; every launch keeps a config."""
    for D, mask, dropout, tma, L in itertools.product(HEAD_DIMS, MASKS, (False, True), (False, True), (16, 64, 4096)):
        kept = one_pass_kept(D, mask, dropout, tma, L)
        assert kept, (D, mask, dropout, tma, L)
        rows = {meta["BLOCK_M"] for meta, _, _ in kept}
        assert len(rows) == 1, (D, mask, dropout, tma, L, kept)
    assert {m["BLOCK_M"] for m, _, _ in one_pass_kept(64, "pad", True, False)} == {64}  # the model's flags
    assert {m["BLOCK_M"] for m, _, _ in one_pass_kept(64, "causal", False, True, 4096)} == {64}  # the targets'
    assert {m["BLOCK_M"] for m, _, _ in one_pass_kept(128, "pad", False, False)} == {32}


def verdicts(path):
    """{(kernel, config, case): verdict} of a committed compile table."""
    rows = {}
    for line in path.read_text().splitlines():
        if line.startswith("| _"):
            kernel, config, case, *_, verdict = (cell.strip() for cell in line.strip("|").split("|"))
            rows[(kernel, config, case)] = verdict
    return rows


@pytest.mark.parametrize("version", sorted(ONE_PASS_TABLES))
def test_the_rule_keeps_only_what_its_table_shows_clean(version):
    """Every config the one pass's rule keeps for an fp16 launch at 256 tokens (every head dim, mask
    and dropout through pointers, the tutorial's head dim through descriptors) compiled in the
    committed table of that Triton version (python -m tools.sm90_report --one-pass) without a spill
    or a shared-memory overflow, its loops pipelined; a 64-row tile on wgmma throughout, a 32-row
    one with only its fifth product off it. The delta and dQ launches compiled clean everywhere."""
    table = verdicts(ONE_PASS_TABLES[version])
    checked = 0
    for D, mask, dropout, tma in itertools.product(HEAD_DIMS, MASKS, (False, True), (False, True)):
        if tma and D != 64:
            continue
        block_d = attention_module._head_block(D)
        case = f"attention/fp16/d{D}/{mask}{'+dropout' if dropout else ''}/self/L256{'/tma' if tma else ''}/one-pass"
        for meta, w, s in one_pass_kept(D, mask, dropout, tma):
            config = f"BLOCK_D={block_d} BLOCK_M={meta['BLOCK_M']} BLOCK_N={meta['BLOCK_N']} w{w} s{s}"
            verdict = table.get(("_attn_bwd_one_pass_kernel", config + (" tma" if tma else ""), case))
            assert verdict is not None, f"Triton {version}: {config} in {case} is not in the table"
            if meta["BLOCK_M"] == 64:
                assert verdict == "ok", f"Triton {version}, {case}: {config}: {verdict}"
            elif mask == "dense" and dropout and block_d == 128:  # no clean config, as dK/dV's (_one_pass_fits)
                assert verdict.startswith("register spills"), verdict
            else:
                # the only problem: one dot of each copy of the loop's step (5 dots) off wgmma, dS K's
                found = NOT_WGMMA.match(verdict)
                assert found and int(found[1]) == int(found[2]) // 5, f"Triton {version}, {case}: {config}: {verdict}"
            checked += 1
    small = {k: v for k, v in table.items() if k[0] in ("_attn_bwd_delta_kernel", "_attn_bwd_dq_convert_kernel")}
    assert len(small) >= 140 and set(small.values()) == {"ok"}, {k: v for k, v in small.items() if v != "ok"}
    assert checked >= 190, checked  # 199 on 2026-12-04
