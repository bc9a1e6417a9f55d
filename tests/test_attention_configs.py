"""The attention configs as a GPU launch sees them: what the rules keep per launch.

The rules themselves (which configs compile for sm_90a without spills) are held to the compiler by
tests/test_sm90_compile.py; here: every launch keeps a config, short sequences compile fewer, and
the pruner reads the length buckets that the launchers pass positionally.
"""

import importlib
import itertools
from pathlib import Path

import pytest
import triton

from fastformer.kernels import _configs
from tools.sm90_cases import HEAD_DIMS, MASKS

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
    # 12 until dK/dV's 32 x 64 in one warp group joined the list for autotuning and the sweep (2 more)
    assert first_use_compiles(64, False, 64) <= 14


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


CANDIDATE_TILES = {
    "forward": {(128, 64, 4), (128, 32, 4)},
    "dK/dV": {(32, 64, 4)},
}
RESULTS = Path(__file__).resolve().parent.parent / "tools" / "results"
CANDIDATE_TABLES = {"3.9": RESULTS / "sm90-candidates.md", "3.6": RESULTS / "sm90-candidates-triton36.md"}
KERNEL_NAMES = {"forward": "_attn_fwd_kernel", "dK/dV": "_attn_bwd_kernel(DQ_PASS=False)"}
CASE_LABELS = {"forward": "forward", "dK/dV": "dKdV"}


def test_the_rules_never_pick_a_candidate_of_the_sweep():
    """The tiles in one warp group are in the lists for autotuning and the sweep to time, last: for
    every launch (head dims, masks, dropout, lengths; fp16/bf16 and fp32) the rule's pick is what it
    was before they came, one of the other tiles."""
    for kernel, tiles in CANDIDATE_TILES.items():
        listed, fits = KERNELS[kernel]
        assert tiles <= set(listed) and not tiles & set(listed[: len(listed) - len(tiles)])
        flags = itertools.product((16, 32, 64, 128), *[(False, True)] * 4, BUCKETS, BUCKETS)
        for block_d, dropout, mask, pad, causal, lq, lk in flags:
            configs = kept(listed, fits, launch(block_d, dropout, lq, lk, mask, pad, causal))
            assert configs[0][:3] not in tiles, (kernel, block_d, dropout, mask, pad, causal, lq, lk)


def candidate_table(path):
    """{(kernel, case): [verdicts]} of a committed candidates table (tools.sm90_report --candidates)."""
    rows = {}
    for line in path.read_text().splitlines():
        if line.startswith("| _"):
            kernel, config, case, *_, verdict = (cell.strip() for cell in line.strip("|").split("|"))
            rows.setdefault((kernel, config, case), []).append(verdict)
    return rows


@pytest.mark.parametrize("version", sorted(CANDIDATE_TABLES))
def test_the_rules_keep_a_candidate_only_where_its_table_shows_it_clean(version):
    """Every launch of fp16 attention at 256 tokens (every head dim, mask and dropout, through
    pointers and descriptors) that the rule lets run a candidate in one warp group has the
    candidate's compile in the committed table of that Triton version (tools.sm90_cases.
    candidates_cases), with no spill, shared memory within the limit and its loops pipelined."""
    table = candidate_table(CANDIDATE_TABLES[version])
    checked = 0
    for kernel, tiles in CANDIDATE_TILES.items():
        fits = KERNELS[kernel][1]
        for (bm, bn, w), stages, D, mask, dropout, tma in itertools.product(
            sorted(tiles), attention_module._STAGES, HEAD_DIMS, MASKS, (False, True), (False, True)
        ):
            pad, causal, dense = MASKS[mask]
            block_d = attention_module._head_block(D)
            flags = launch(block_d, dropout, 256, 256, dense, pad, causal)
            if not fits({"BLOCK_M": bm, "BLOCK_N": bn}, w, stages, {**flags, "HEAD_DIM": D, "TMA": tma}):
                continue
            config = f"BLOCK_D={block_d} BLOCK_M={bm} BLOCK_N={bn} w{w} s{stages}" + (" tma" if tma else "")
            case = f"{CASE_LABELS[kernel]}-{bm}x{bn}w{w}s{stages}/attention/fp16/d{D}/{mask}"
            case += ("+dropout" if dropout else "") + "/self/L256" + ("/tma" if tma else "")
            verdicts = table.get((KERNEL_NAMES[kernel], config, case))
            assert verdicts, f"Triton {version}: {kernel} {config} in {case} is not in the table"
            assert set(verdicts) == {"ok"}, f"Triton {version}, {case}: {kernel} {config}: {verdicts}"
            checked += 1
    assert checked >= 200, checked
