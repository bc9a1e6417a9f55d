"""The attention configs as a GPU launch sees them: what the rules keep per launch.

The rules themselves (which configs compile for sm_90a without spills) are held to the compiler by
tests/test_sm90_compile.py; here: every launch keeps a config, short sequences compile fewer, and
the pruner reads the length buckets that the launchers pass positionally.
"""

import importlib
import itertools

import pytest
import triton

from fastformer.kernels import _configs

attention_module = importlib.import_module(
    "fastformer.kernels.attention"
)  # the module; `kernels.attention` is the function

KERNELS = {
    "forward": (attention_module._FWD_TILES, attention_module._fwd_fits),
    "dK/dV": (attention_module._DKDV_TILES, attention_module._dkdv_fits),
    "dQ": (attention_module._DQ_TILES, attention_module._dq_fits),
}
BUCKETS = [1, 16, 32, 64, 128, 256, 4096]


def kept(tiles, fits, launch):
    return [
        (bm, bn, w, s)
        for (bm, bn, w), s in itertools.product(tiles, attention_module._STAGES)
        if fits({"BLOCK_M": bm, "BLOCK_N": bn}, w, s, launch)
    ]


def launch(block_d, dropout, lq, lk, mask=False, pad=False, causal=False):
    return {
        "BLOCK_D": block_d,
        "HAS_DROPOUT": dropout,
        "HAS_MASK": mask,
        "HAS_PAD": pad,
        "IS_CAUSAL": causal,
        "LQ_BUCKET": lq,
        "LK_BUCKET": lk,
    }


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_every_launch_keeps_a_config_no_longer_than_the_sequence_needs(kernel):
    tiles, fits = KERNELS[kernel]
    min_m, min_n = min(t[0] for t in tiles), min(t[1] for t in tiles)
    booleans = [(False, True)] * 4  # dropout, dense mask, key padding, causal
    flags = itertools.product((16, 32, 64, 128), *booleans, BUCKETS, BUCKETS)
    for block_d, dropout, mask, pad, causal, lq, lk in flags:
        configs = kept(tiles, fits, launch(block_d, dropout, lq, lk, mask, pad, causal))
        assert configs, (
            f"{kernel}: nothing kept for D={block_d} dropout={dropout} mask={mask} pad={pad} causal={causal} "
            f"Lq={lq} Lk={lk}"
        )
        too_long = [c for c in configs if c[0] > max(min_m, lq) or c[1] > max(min_n, lk)]
        assert not too_long, f"{kernel}: tiles longer than Lq={lq}, Lk={lk}: {too_long}"


def first_use_compiles(block_d, dropout, length):
    return sum(len(kept(tiles, fits, launch(block_d, dropout, length, length))) for tiles, fits in KERNELS.values())


def test_short_sequences_compile_fewer_variants_on_first_use():
    # the tutorial's reviews (<= 64 pieces) against its 256-piece maximum, at head dim 64
    for dropout in (False, True):
        short, long = first_use_compiles(64, dropout, 64), first_use_compiles(64, dropout, 256)
        assert short < long, (dropout, short, long)
    assert first_use_compiles(64, False, 64) <= 12


def test_the_pruner_reads_positional_length_buckets():
    prune = _configs._pruner("attention forward", attention_module._fwd_fits)
    configs = [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=2)
        for bm, bn, w in attention_module._FWD_TILES
    ]
    named_args = {"LQ_BUCKET": 64, "LK_BUCKET": 32}  # the autotuner's positional arguments
    kept_configs = prune(
        configs, named_args, BLOCK_D=64, HAS_DROPOUT=False, HAS_PAD=True, IS_CAUSAL=False, HAS_MASK=False
    )
    assert [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]) for c in kept_configs] == [(64, 32)]
