"""Each kernel's rule against its autotune list (kernels._configs.Configs): the rule picks, for every
launch of the sm_90a check's matrix, the first candidate that autotuning would try, so the check,
which compiles everything autotuning can try, covers every pick; and the switch between the rule
and autotuning. Pure Python, no compile: the picks are held to the compiler by
tests/test_sm90_compile.py and tools/cold_start.py.
"""

import importlib
import itertools
from pathlib import Path

import pytest
import torch
import triton

from fastformer import kernels
from fastformer.kernels import _configs
from tools.sm90_cases import HEAD_DIMS, LARGE, MASKS, TUTORIAL

attention = importlib.import_module("fastformer.kernels.attention")
linear_gelu = importlib.import_module("fastformer.kernels.linear_gelu")
feed_forward = importlib.import_module("fastformer.kernels.feed_forward")

FP32 = torch.empty(0, dtype=torch.float32)  # what a rule reads of an fp32 launch's tensors: the dtype
ATTENTION = {
    "forward": attention._attn_fwd, "dQ": attention._attn_bwd_dq, "dK/dV": attention._attn_bwd_dkdv,
    "dK/dV/dQ": attention._attn_bwd_one_pass,  # the one-pass backward's
}  # fmt: skip
# the CI matrix's lengths (256, 97 x 61, 4096, the model case's 64) and those of the model's decoder (1)
LENGTHS = [(256, 256), (97, 61), (4096, 4096), (64, 64), (1, 1), (1, 64), (1, 256), (13, 20)]


def tried(tuned, launch):
    """What autotuning tries for the launch: the autotune list on a GPU, as its pruning keeps it."""
    configs = [triton.Config(meta, num_warps=w, num_stages=s) for meta, w, s in tuned.candidates]
    kept = _configs._pruner(tuned.name, tuned.fits)(configs, {}, **launch)
    return [(c.kwargs, c.num_warps, c.num_stages) for c in kept]


def attention_launches():
    for D, mask, dropout, (lq, lk) in itertools.product(HEAD_DIMS, MASKS, (False, True), LENGTHS):
        pad, causal, dense = MASKS[mask]
        yield {
            "HEAD_DIM": D,
            "BLOCK_D": attention._head_block(D),
            "HAS_PAD": pad,
            "IS_CAUSAL": causal,
            "HAS_MASK": dense,
            "HAS_DROPOUT": dropout,
            "LQ_BUCKET": triton.next_power_of_2(lq),
            "LK_BUCKET": triton.next_power_of_2(lk),
        }


@pytest.mark.parametrize("fp32", [False, True], ids=["fp16/bf16", "fp32"])
@pytest.mark.parametrize("kernel", sorted(ATTENTION))
def test_the_attention_rule_picks_the_first_config_autotuning_tries(kernel, fp32):
    tuned = ATTENTION[kernel]
    for launch in attention_launches():
        launch = {**launch, "Q": FP32} if fp32 else launch
        kept = tried(tuned, launch)
        assert kept, f"attention {kernel}: no config for {launch}"
        assert tuned._first_fit(launch) == kept[0], f"attention {kernel}: {launch}"


GEMM_SHAPES = [  # (N, K) of the matrix products: the CI matrix's FFNs both ways, and small ones
    (TUTORIAL["d_ff"], TUTORIAL["d_hidn"]),
    (LARGE["d_ff"], LARGE["d_hidn"]),
    (64, 32),
    (48, 20),
    (1, 1),
    (300, 7),
]


def test_the_gemm_rule_picks_the_first_config_autotuning_tries():
    for tuned, (N, K), store_pre, fp32 in itertools.product(
        (linear_gelu._linear_gelu_fwd, linear_gelu._ffn_act_grad), GEMM_SHAPES, (False, True), (False, True)
    ):
        launch = {
            "N": N,
            "K": K,
            "M_BUCKET": 256,
            "STORE_PRE": store_pre,
            "ACTIVATION": "gelu",
            "DOT_PRECISION": "tf32",
            **({"X": FP32, "DOUT": FP32} if fp32 else {}),
        }
        kept = tried(tuned, launch)
        assert kept and tuned._first_fit(launch) == kept[0], (tuned.name, launch)
        meta = kept[0][0]
        assert meta["BLOCK_N"] <= max(64, triton.next_power_of_2(N)) and meta["BLOCK_K"] <= max(
            32, triton.next_power_of_2(K)
        )


def test_the_fused_ffn_rule_picks_the_first_config_autotuning_tries():
    tuned = feed_forward._ffn_fused_fwd
    for D, F in [(TUTORIAL["d_hidn"], TUTORIAL["d_ff"]), (LARGE["d_hidn"], LARGE["d_ff"]), (32, 64), (20, 40)]:
        launch = {"D": D, "F": F, "M_BUCKET": 256, "ACTIVATION": "gelu", "DOT_PRECISION": "tf32"}
        kept = tried(tuned, launch)
        assert kept and tuned._first_fit(launch) == kept[0], launch


def test_the_tutorial_encoders_forward_tiles_grow_with_the_reviews():
    """The tutorial's shapes pick what docs/cold-start.md says they do (what tools.cold_start compiles)."""
    train = {"HEAD_DIM": 64, "BLOCK_D": 64, "HAS_PAD": True, "IS_CAUSAL": False, "HAS_MASK": False, "HAS_DROPOUT": True}
    picks = {
        bucket: (
            attention._attn_fwd._first_fit({**train, "LQ_BUCKET": bucket, "LK_BUCKET": bucket})[0]["BLOCK_M"],
            attention._attn_fwd._first_fit({**train, "LQ_BUCKET": bucket, "LK_BUCKET": bucket})[0]["BLOCK_N"],
        )
        for bucket in (16, 32, 64, 128, 256)
    }
    assert picks == {16: (64, 32), 32: (64, 32), 64: (64, 64), 128: (128, 64), 256: (128, 64)}


def test_the_dkdv_pass_at_the_tutorials_lengths_runs_one_warp_group_where_it_fits():
    """Keys up to 64 with dropout and neither a causal nor a dense mask (the model's training call):
    64 x 64 in 4 warps and 2 stages; with a causal mask, or without dropout, in 8 warps; at head dim
    128, 32 queries (its rule); at 256 keys, 32 x 128 as before."""

    def pick(lk=64, D=64, dropout=True, causal=False, mask=False):
        launch = {"HEAD_DIM": D, "BLOCK_D": D, "HAS_PAD": True, "IS_CAUSAL": causal, "HAS_MASK": mask}
        launch.update(HAS_DROPOUT=dropout, LQ_BUCKET=lk, LK_BUCKET=lk)
        meta, num_warps, num_stages = attention._attn_bwd_dkdv._first_fit(launch)
        return meta["BLOCK_M"], meta["BLOCK_N"], num_warps, num_stages

    assert pick() == (64, 64, 4, 2)
    assert pick(D=32) == (64, 64, 4, 2)
    assert pick(causal=True) == (32, 64, 8, 3)
    assert pick(dropout=False) == (64, 64, 8, 3)
    assert pick(mask=True) == (32, 64, 8, 3)  # 64 x 64 spills with a dense mask and dropout
    assert pick(D=128)[:2] == (32, 64)
    assert pick(lk=256) == (32, 128, 8, 3)


def test_a_pick_is_kept_per_key_and_dtypes(monkeypatch):
    monkeypatch.setattr(_configs, "INTERPRET", False)
    tuned = _configs.Configs(
        attention._attn_fwd_kernel,
        "test",
        attention._candidates(attention._FWD_TILES),
        attention._KEY,
        attention._fwd_fits,
        interpreter_meta={"BLOCK_M": 16, "BLOCK_N": 16},
    )
    calls = []

    def counting_fits(*args):
        calls.append(args)
        return attention._fwd_fits(*args)

    tuned.fits = counting_fits
    launch = {
        **dict.fromkeys(attention._KEY, 0),
        "HEAD_DIM": 64,
        "BLOCK_D": 64,
        "LQ_BUCKET": 64,
        "LK_BUCKET": 64,
        "HAS_PAD": True,
        "IS_CAUSAL": False,
        "HAS_MASK": False,
        "HAS_DROPOUT": False,
        "Q": torch.zeros(1, dtype=torch.float16),
    }
    first = tuned.pick((), launch)
    asked = len(calls)
    assert tuned.pick((), launch) == first and len(calls) == asked  # the second launch looks it up
    tuned.pick((), {**launch, "Q": torch.zeros(1, dtype=torch.bfloat16)})  # another dtype: the rule again
    assert len(calls) > asked


def test_the_switch_between_the_rule_and_autotuning(monkeypatch):
    monkeypatch.delenv(_configs.ENV_VAR, raising=False)
    assert not kernels.autotune_enabled()
    monkeypatch.setenv(_configs.ENV_VAR, "1")
    assert kernels.autotune_enabled()
    kernels.set_autotune(False)
    try:
        assert not kernels.autotune_enabled()  # the Python switch wins over the environment
    finally:
        kernels.set_autotune(None)
    assert kernels.autotune_enabled()
    monkeypatch.setenv(_configs.ENV_VAR, "yes")
    with pytest.raises(ValueError, match="FASTFORMER_AUTOTUNE must be 1"):
        kernels.autotune_enabled()
    with pytest.raises(TypeError, match="True, False or None"):
        kernels.set_autotune("1")


def test_autotuning_holds_inside_its_block_only(monkeypatch):
    monkeypatch.setenv(_configs.ENV_VAR, "0")
    with kernels.autotuning():
        assert kernels.autotune_enabled()
        with kernels.autotuning(False):
            assert not kernels.autotune_enabled()
        assert kernels.autotune_enabled()
    assert not kernels.autotune_enabled()
    with pytest.raises(KeyError), kernels.autotuning():
        raise KeyError("inside")
    assert _configs.autotune_enabled.made is None  # back to following the environment


def test_a_launch_runs_the_rules_config_or_the_autotuner(monkeypatch):
    launched = []

    class Recorded:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launched.append((self.kernel, kwargs))

    monkeypatch.setattr(_configs, "launch", Recorded)
    monkeypatch.setattr(_configs, "INTERPRET", False)  # the GPU's rule
    tuned = linear_gelu._linear_gelu_fwd
    launch = {
        "N": 1024,
        "K": 256,
        "M_BUCKET": 4096,
        "STORE_PRE": True,
        "ACTIVATION": "gelu",
        "DOT_PRECISION": "tf32",
        "TMA": False,
    }
    tuned[(1,)](**launch)
    meta, num_warps, num_stages = tuned._first_fit(launch)
    assert launched.pop() == (
        linear_gelu._linear_gelu_fwd_kernel,
        {**launch, **meta, "num_warps": num_warps, "num_stages": num_stages},
    )
    kernels.set_autotune(True)
    try:
        tuned[(1,)](**launch)
    finally:
        kernels.set_autotune(None)
    assert launched.pop() == (tuned.autotuner, launch)


RESULTS = Path(__file__).resolve().parent.parent / "tools" / "results"
TF32_TABLES = {"3.9": RESULTS / "sm90-compile-tf32.md", "3.6": RESULTS / "sm90-compile-tf32-triton36.md"}


def tf32_table(path):
    """{(kernel, case): {config: verdicts}} of a committed TF32 compile table (tools.sm90_report --tf32)."""
    rows = {}
    for line in path.read_text().splitlines():
        if line.startswith("| _"):
            kernel, config, case, *_, verdict = (cell.strip() for cell in line.strip("|").split("|"))
            rows.setdefault((kernel, case), {}).setdefault(config, []).append(verdict)
    return rows


def config_name(meta, num_warps, num_stages, **constexprs):
    """A config as the compile table writes it: the block sizes by name, then warps and stages."""
    blocks = " ".join(f"{k}={v}" for k, v in sorted({**meta, **constexprs}.items()))
    return f"{blocks} w{num_warps} s{num_stages}"


def fp32_launches(case):
    """(kernel, its Configs, the launch, the constexprs the table names beside the config) for each
    launch of a TF32 table's case, its tensors fp32."""
    parts = case.split("/")
    if parts[0] == "attention":
        D, mask, L = int(parts[2][1:]), parts[3], parts[5][1:]
        lq, lk = (int(n) for n in (L.split("x") if "x" in L else (L, L)))
        pad, causal, dense = MASKS[mask.removesuffix("+dropout")]
        launch = {
            "Q": FP32,
            "HEAD_DIM": D,
            "BLOCK_D": attention._head_block(D),
            "HAS_PAD": pad,
            "IS_CAUSAL": causal,
            "HAS_MASK": dense,
            "HAS_DROPOUT": mask.endswith("+dropout"),
            "LQ_BUCKET": triton.next_power_of_2(lq),
            "LK_BUCKET": triton.next_power_of_2(lk),
        }
        names = {
            "forward": "_attn_fwd_kernel",
            "dQ": "_attn_bwd_kernel(DQ_PASS=True)",
            "dK/dV": "_attn_bwd_kernel(DQ_PASS=False)",
        }
        for kernel, name in names.items():  # not the one pass: fp32 takes it at head dims up to 32 only
            yield name, ATTENTION[kernel], launch, {"BLOCK_D": launch["BLOCK_D"]}
    elif parts[0] == "ffn":
        train = parts[3] == "train"
        d, d_ff = (int(n) for n in parts[4][1:].split("x"))
        gemm = {"X": FP32, "DOUT": FP32, "N": d_ff, "K": d, "STORE_PRE": train}
        yield "_linear_gelu_fwd_kernel", linear_gelu._linear_gelu_fwd, gemm, {}
        if train:
            yield "_ffn_act_grad_kernel", linear_gelu._ffn_act_grad, gemm, {}
        else:  # BLOCK_D 0: fp32 takes the fused FFN's two loops (feed_forward._one_block_d)
            yield "_ffn_fused_fwd_kernel", feed_forward._ffn_fused_fwd, {"X": FP32, "D": d, "F": d_ff}, {"BLOCK_D": 0}


# The one fp32 launch with no config that compiles clean on Triton 3.9 (kernels/attention.py,
# _dkdv_fits): dK/dV at head dims 72 to 128 (BLOCK_D 128), whose one config that compiles spills
# there (clean on 3.6). Listed so that a new failure, or this one's end, fails the test.
KNOWN_TF32_SPILLS = {("3.9", "_attn_bwd_kernel(DQ_PASS=False)", "BLOCK_D=128 BLOCK_M=32 BLOCK_N=64 w8 s2")}


@pytest.mark.parametrize("version", sorted(TF32_TABLES))
def test_the_fp32_rules_take_only_what_the_tf32_tables_show_clean(version):
    """Every config an fp32 launch can run (the rule's pick, or any that autotuning tries) for the
    cases of the TF32 compile matrix (tools.sm90_cases.tf32_cases: every config the fp16/bf16 rules
    allow, compiled for sm_90a with TF32 products before the fp32 rules narrowed them, committed per
    Triton version) compiled clean there: no spills, shared memory within the limit, its dot loops
    pipelined, no ptxas note; KNOWN_TF32_SPILLS aside. This holds the fp32 rules to the compiler,
    Triton 3.6 (the GPU machines') and 3.9 alike."""
    table = tf32_table(TF32_TABLES[version])
    cases = {case for _, case in table if case.startswith(("attention/", "ffn/"))}
    assert len(cases) >= 20, sorted(cases)
    known = set()
    for case in sorted(cases):
        for kernel, tuned, launch, constexprs in fp32_launches(case):
            fitting = [c for c in tuned.candidates if tuned.fits(*c, launch)]
            assert fitting and tuned._first_fit(launch) == fitting[0], (case, kernel)
            for meta, num_warps, num_stages in fitting:
                config = config_name(meta, num_warps, num_stages, **constexprs)
                verdicts = table.get((kernel, case), {}).get(config)
                assert verdicts, f"Triton {version}, {case}: {kernel} {config} is not in the table"
                if (version, kernel, config) in KNOWN_TF32_SPILLS:
                    known.add((version, kernel, config))
                    assert all(v.startswith("register spills") for v in verdicts), (case, verdicts)
                    continue
                assert set(verdicts) == {"ok"}, f"Triton {version}, {case}: {kernel} {config}: {verdicts}"
    assert known == {k for k in KNOWN_TF32_SPILLS if k[0] == version}
