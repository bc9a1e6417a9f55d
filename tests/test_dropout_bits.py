"""The kernels' dropout bits are the documented function of the seed, four decisions per Philox call.

add + LayerNorm: element (row, col) is kept when word col % 4 of Philox4x32 with PHILOX_ROUNDS (7)
rounds on the counter (col // 4, row, 0, 0), keyed by the seed's low and high 32 bits, is
>= fp32(p) * 2**32. Attention: probability (bh, m, n) takes word 2 * (m // 8 % 2) + n // 8 % 2 of
the call on (pair(n), pair(m), bh, 0), pair(i) = i // 16 * 8 + i % 8: a call decides the square
{m, m + 8} x {n, n + 8}. A NumPy Philox here checks the kernels bit for bit, so a wrong interleave
or a shifted counter fails; being the same function, it also gives the statistics of a million
decisions at NumPy's speed.
"""

import numpy as np
import pytest
import torch

from fastformer.kernels import _dropout
from fastformer.kernels._runtime import launch, tl, triton

MASK32 = np.uint64(0xFFFFFFFF)


def _umulhi(a, b):
    return ((a * b) >> np.uint64(32)) & MASK32


ROUNDS = _dropout.PHILOX_ROUNDS.value


def philox4x32(seed, c0, c1, c2, c3, rounds=ROUNDS):
    """Philox4x32 as Triton computes it, in uint64 arrays holding 32-bit values."""
    k0, k1 = np.uint64(seed & 0xFFFFFFFF), np.uint64((seed >> 32) & 0xFFFFFFFF)
    round_a, round_b = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
    key_a, key_b = np.uint64(0x9E3779B9), np.uint64(0xBB67AE85)
    for _ in range(rounds):
        c0, c1, c2, c3 = (
            _umulhi(round_b, c2) ^ c1 ^ k0,
            (round_b * c2) & MASK32,
            _umulhi(round_a, c0) ^ c3 ^ k1,
            (round_a * c0) & MASK32,
        )
        k0, k1 = (k0 + key_a) & MASK32, (k1 + key_b) & MASK32
    return c0, c1, c2, c3


def expected_keep(seed, n_rows, n_cols, p):
    rows, cols = np.meshgrid(np.arange(n_rows, dtype=np.uint64), np.arange(n_cols, dtype=np.uint64), indexing="ij")
    zero = np.zeros_like(rows)
    words = philox4x32(seed, cols // np.uint64(4), rows, zero, zero)
    picked = np.choose((cols % np.uint64(4)).astype(np.int64), words)  # column 4g + i takes word i
    threshold = np.uint64(int(np.float32(p) * np.float32(2**32)))
    return torch.from_numpy(picked >= threshold)


def _pair(i):
    return i // np.uint64(16) * np.uint64(8) + i % np.uint64(8)


def expected_attention_keep(seed, n_bh, Lq, Lk, p):
    """(n_bh, Lq, Lk): attention's keep decisions (the module docstring)."""
    bh, m, n = np.meshgrid(*(np.arange(k, dtype=np.uint64) for k in (n_bh, Lq, Lk)), indexing="ij")
    words = philox4x32(seed, _pair(n), _pair(m), bh, np.zeros_like(bh))
    eight, two = np.uint64(8), np.uint64(2)
    word = (np.uint64(2) * (m // eight % two) + n // eight % two).astype(np.int64)
    threshold = np.uint64(int(np.float32(p) * np.float32(2**32)))
    return torch.from_numpy(np.choose(word, words) >= threshold)


def _seed_after(manual_seed, device):
    torch.manual_seed(manual_seed)
    return int(_dropout.draw_seed(device).item())


@triton.jit
def _philox_words_kernel(COUNTERS, WORDS, SEED, N: tl.constexpr, WIDE: tl.constexpr):
    """The four words of Philox on N counters (4, N) int64 holding 32-bit values, by the widening
    kernels._dropout.philox or by tl.philox: WORDS (4, N) int64."""
    offs = tl.arange(0, N)
    c0, c1, c2, c3 = (tl.load(COUNTERS + i * N + offs).to(tl.uint32) for i in range(4))
    seed = tl.load(SEED)
    if WIDE:
        r0, r1, r2, r3 = _dropout.philox(seed, c0, c1, c2, c3)
    else:
        r0, r1, r2, r3 = tl.philox(seed, c0, c1, c2, c3, n_rounds=_dropout.PHILOX_ROUNDS)
    for i, r in ((0, r0), (1, r1), (2, r2), (3, r3)):
        tl.store(WORDS + i * N + offs, r.to(tl.int64))


@pytest.mark.parametrize("wide", [True, False], ids=["widening", "tl.philox"])
def test_both_philox_forms_are_the_documented_function(device, wide):
    """attention_keep computes its words by one form or the other, depending on the tile: both are
    Philox4x32-7 bit for bit, on counters that fill all 32 bits."""
    g = torch.Generator().manual_seed(3)
    counters = torch.randint(0, 2**32, (4, 64), generator=g, dtype=torch.int64)
    seed = 0x1234_5678_9ABC_DEF0
    words = torch.empty_like(counters, device=device)
    launch(_philox_words_kernel)[(1,)](counters.to(device), words, torch.tensor([seed], device=device), N=64, WIDE=wide)
    expected = philox4x32(seed, *(c.numpy().astype(np.uint64) for c in counters))
    assert np.array_equal(words.cpu().numpy().astype(np.uint64), np.stack(expected))


@pytest.mark.parametrize("n_rows, n_cols", [(3, 4), (17, 70), (64, 130)])  # 70, 130: not block multiples
def test_kernel_bits_are_the_documented_philox_words(device, n_rows, n_cols):
    p = 0.3
    seed = _seed_after(11, device)
    torch.manual_seed(11)
    keep = _dropout.dropout_mask(n_rows, n_cols, p, device).cpu()
    assert torch.equal(keep, expected_keep(seed, n_rows, n_cols, p))


@pytest.mark.parametrize("n_bh, Lq, Lk", [(1, 1, 1), (3, 40, 24), (2, 17, 70)])  # not block multiples
def test_attention_bits_are_the_documented_philox_words(device, n_bh, Lq, Lk):
    p = 0.3
    seed = _seed_after(5, device)
    torch.manual_seed(5)
    keep = _dropout.attention_mask(n_bh, Lq, Lk, p, device).cpu()
    assert torch.equal(keep, expected_attention_keep(seed, n_bh, Lq, Lk, p))


def test_each_of_the_four_words_keeps_at_the_rate(device):
    p = 0.25
    torch.manual_seed(0)
    keep = _dropout.dropout_mask(256, 256, p, device).float().cpu()
    for word in range(4):
        column_kept = keep[:, word::4]
        sigma = (p * (1 - p) / column_kept.numel()) ** 0.5
        assert abs(column_kept.mean().item() - (1 - p)) <= 4 * sigma, f"word {word}"
    # neighbours share a Philox call but not a word: they agree as independent draws would
    agree = (keep[:, 0::4] == keep[:, 1::4]).float().mean().item()
    expected = p * p + (1 - p) * (1 - p)
    sigma = (expected * (1 - expected) / keep[:, 0::4].numel()) ** 0.5
    assert abs(agree - expected) <= 4 * sigma


def _within(observed, rate, count, what):
    sigma = (rate * (1 - rate) / count) ** 0.5
    assert abs(observed - rate) <= 5 * sigma, f"{what}: {observed:.5f} vs {rate:.5f} (sigma {sigma:.1e})"


def _check_independent(keep, pairs, calls, p):
    """The keep rate, each kind of neighbour kept together at the rate of independent draws, and at
    p = 0.5 the 16 patterns of a call's four decisions (`calls`: (n_calls, 4)) equally often
    (chi-square, 15 degrees of freedom, below its 1-in-10,000 tail)."""
    q = 1 - p
    _within(keep.mean(), q, keep.size, "keep rate")
    for what, (a, b) in pairs.items():
        _within((a & b).mean(), q * q, a.size, what)
    if p == 0.5:
        patterns = (calls * np.array([1, 2, 4, 8])).sum(-1)
        counts = np.bincount(patterns, minlength=16)
        expected = patterns.size / 16
        chi2 = ((counts - expected) ** 2 / expected).sum()
        assert chi2 < 44.3, f"chi-square {chi2:.1f} over the 16 patterns of a call: {counts}"


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_neighbouring_decisions_are_independent(p):
    """Over 1024 x 1024 decisions of add + LayerNorm's function (checked bit for bit above), each
    within 5 sigma of what independent draws give: the keep rate, and for each kind of neighbour
    (the next word of the same Philox call, the first word of the next call, the next row) the rate
    at which both are kept; the patterns of a call's four decisions."""
    n = 1024
    keep = expected_keep(0x5EED_1234_ABCD, n, n, p).numpy()
    pairs = {
        "next word, same call": (keep[:, 0::4], keep[:, 1::4]),
        "last word, next call": (keep[:, 3:-1:4], keep[:, 4::4]),
        "next row": (keep[:-1], keep[1:]),
    }
    _check_independent(keep, pairs, keep.reshape(-1, 4), p)


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_neighbouring_attention_decisions_are_independent(p):
    """The same over attention's function, 4 x 512 x 512 decisions: the words of a call (the next
    key, query and both, 8 apart), the next key and the next query (another call), the next head."""
    keep = expected_attention_keep(0x5EED_1234_ABCD, 4, 512, 512, p).numpy()
    # (bh, m // 16, m // 8 % 2, m % 8, n // 16, n // 8 % 2, n % 8): a call's words differ in axes 2 and 5
    squares = keep.reshape(4, 32, 2, 8, 32, 2, 8)
    pairs = {
        "key + 8, same call": (squares[:, :, :, :, :, 0], squares[:, :, :, :, :, 1]),
        "query + 8, same call": (squares[:, :, 0], squares[:, :, 1]),
        "both + 8, same call": (squares[:, :, 0, :, :, 0], squares[:, :, 1, :, :, 1]),
        "next key, next call": (keep[:, :, :-1], keep[:, :, 1:]),
        "next query, next call": (keep[:, :-1], keep[:, 1:]),
        "next head": (keep[:-1], keep[1:]),
    }
    calls = squares.transpose(0, 1, 3, 4, 6, 2, 5).reshape(-1, 4)
    _check_independent(keep, pairs, calls, p)


def test_rows_beyond_a_32_bit_counter_are_refused():
    with pytest.raises(ValueError, match="2\\*\\*32 rows"):
        _dropout.check_dropout_rows("attention", 2**32)
    _dropout.check_dropout_rows("attention", 2**32 - 1)
