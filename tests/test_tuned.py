"""The kernels follow a GPU sweep's table (kernels/_tuned.py), not a hand edit: a committed table is
exactly what `python -m tools.sweep --adopt` makes of the committed sweep report beside it; a launch
the table has an entry for runs the entry's variant and config, where the kernel's rule lets it;
any other launch, and every launch where no table is in force, runs as the written rule says. On
made-up tables and sweep records: which way is fastest on a GPU is the sweep's to say. Pure Python,
no compile: the rules' configs are held to the compiler by tests/test_sm90_compile.py."""

import importlib
import json
from pathlib import Path

import pytest
import torch

from bench.timing import Ratio, Timing
from fastformer import kernels
from fastformer.kernels import _configs, _tuned
from tools import sweep as sweep_tool

attention = importlib.import_module("fastformer.kernels.attention")
linear_gelu = importlib.import_module("fastformer.kernels.linear_gelu")
ROOT = Path(__file__).resolve().parent.parent
GPU = "NVIDIA H200"


@pytest.fixture
def compiled(monkeypatch):
    """The configs' rule as on a GPU (no interpreter's one config), with no table chosen but the test's."""
    monkeypatch.setattr(_configs, "INTERPRET", False)
    monkeypatch.delenv(_tuned.ENV_VAR, raising=False)
    kernels.set_tuned(None)
    yield
    kernels.set_tuned(None)


def _model_call(B=4, H=2, L=64, D=64, dropout=0.1):
    """The forward launch of the model's attention call (fused QKV views, key padding, dropout)."""
    q, k, v = (t.transpose(1, 2) for t in torch.randn(B, L, 3, H, D, dtype=torch.bfloat16).unbind(2))
    pad = torch.arange(L)[None, :] >= torch.tensor([L, L // 2, 3, 1])[:B, None]
    masking = attention._masking(q, pad, None, False, dropout, D**-0.5)
    o, lse = attention._forward_outputs(q)
    seed = torch.tensor([3], dtype=torch.int64)
    return q, k, v, o, lse, seed, masking


def _entry(configs, args, kwargs, variant, config, family="f"):
    kernel, key, dtype = sweep_tool.launch_match(configs, args, kwargs)
    meta, warps, stages = config if config else (None, None, None)
    fields = dict(kernel=kernel, family=family, key=key, dtype=dtype, variant=variant, meta=meta)
    return dict(fields, num_warps=warps, num_stages=stages, speedup=1.3, low=1.2, high=1.4)


def _table(*entries, gpu=GPU):
    return {"schema": _tuned.SCHEMA, "gpu": gpu, "source": {}, "launches": list(entries)}


def test_with_no_table_a_launch_runs_the_written_rule(compiled):
    kernels.set_tuned(False)  # as on a GPU with no table installed for it
    _, args, kwargs = attention._forward_launch(*_model_call())
    assert _tuned.in_force() is None
    assert not kwargs["TMA"]  # PREFERS_TMA is False
    assert attention._attn_fwd.pick(args, kwargs) == attention._attn_fwd._first_fit(
        {**dict(zip(attention._attn_fwd_kernel.arg_names, args)), **kwargs}
    )
    assert attention.PREFERS_TMA is False and linear_gelu.PREFERS_TMA is False and linear_gelu.PREFERS_CUBLAS is False


def test_a_launch_the_table_names_runs_its_variant_and_config(compiled):
    call = _model_call()
    _, args, kwargs = attention._forward_launch(*call)
    rule = attention._attn_fwd.pick(args, kwargs)
    named = {**dict(zip(attention._attn_fwd_kernel.arg_names, args)), **kwargs, "TMA": True}
    other = next(c for c in attention._attn_fwd.candidates if c != rule and attention._fwd_fits(*c, named))
    with kernels.tuned(_table(_entry(attention._attn_fwd, args, kwargs, "tma", other))):
        _, args, kwargs = attention._forward_launch(*call)
        assert kwargs["TMA"]  # the entry's variant, where TMA can serve (here: the interpreter's)
        assert attention._attn_fwd.pick(args, kwargs) == other
        with kernels.tma_loads(False):  # a choice made overrules the table's variant: then the rule's config
            _, args, kwargs = attention._forward_launch(*call)
            assert not kwargs["TMA"] and attention._attn_fwd.pick(args, kwargs) == rule
    _, args, kwargs = attention._forward_launch(*call)
    assert not kwargs["TMA"] and attention._attn_fwd.pick(args, kwargs) == rule  # the table gone, the rule


def test_an_entry_is_taken_at_the_nearest_lengths_within_a_factor_of_4_and_its_flags_exactly(compiled):
    _, args, kwargs = attention._forward_launch(*_model_call(L=64))
    pick = next(c for c in attention._attn_fwd.candidates if c[0] == {"BLOCK_M": 64, "BLOCK_N": 32} and c[2] == 3)
    table = _tuned.Table(_table(_entry(attention._attn_fwd, args, kwargs, "pointer", pick)))
    for L, taken in ((64, True), (128, True), (256, True), (512, False), (32, True), (16, True), (8, False)):
        _, args, kwargs = attention._forward_launch(*_model_call(L=L))
        assert (attention._attn_fwd.tuned(args, kwargs, table) is not None) == taken, L
    _, args, kwargs = attention._forward_launch(*_model_call(dropout=0.0))  # another flag: not its entry
    assert attention._attn_fwd.tuned(args, kwargs, table) is None
    q, k, v, o, lse, seed, masking = _model_call()
    half = [t.half() for t in (q, k, v)]  # another dtype
    _, args, kwargs = attention._forward_launch(
        *half, o.half(), lse, seed, attention._masking(half[0], *masking_args(masking))
    )
    assert attention._attn_fwd.tuned(args, kwargs, table) is None


def masking_args(masking):
    pad, _ = masking.tensors
    return pad, None, masking.flags["IS_CAUSAL"], masking.dropout_p, masking.scale


def test_an_entry_whose_config_the_rule_refuses_for_the_launch_is_not_taken(compiled):
    """The table cannot make a launch run what its rule keeps out (a tile that spills with dropout)."""
    _, args, kwargs = attention._forward_launch(*_model_call())
    wide = next(c for c in attention._attn_fwd.candidates if c[0]["BLOCK_N"] == 128)  # dropout: at most 64 keys
    table = _tuned.Table(_table(_entry(attention._attn_fwd, args, kwargs, "pointer", wide)))
    assert attention._attn_fwd.tuned(args, kwargs, table) is None
    with kernels.tuned(table):
        assert attention._attn_fwd.pick(args, kwargs) != wide


def test_the_backward_passes_take_their_variants_apart(compiled):
    q, k, v, o, lse, seed, masking = _model_call()
    do = torch.randn_like(o)
    outputs = attention._backward_outputs(q, k, v, lse)
    launches = attention._backward_launches(do, q, k, v, o, lse, seed, *outputs, masking)
    (_, _, dq_args, dq_kwargs), _ = launches
    dq_pick = attention._attn_bwd_dq.pick(dq_args, dq_kwargs)
    table = _table(_entry(attention._attn_bwd_dq, dq_args, dq_kwargs, "tma", dq_pick))
    with kernels.tuned(table):
        (*_, dq_kwargs), (*_, dkdv_kwargs) = attention._backward_launches(do, q, k, v, o, lse, seed, *outputs, masking)
    assert dq_kwargs["TMA"] and not dkdv_kwargs["TMA"]


def test_the_ffn_gemm_takes_cublas_where_the_table_says(compiled, monkeypatch):
    x = torch.randn(512, 256, dtype=torch.bfloat16)
    w = torch.randn(1024, 256, dtype=torch.bfloat16)
    b = torch.randn(1024, dtype=torch.bfloat16)
    y, pre = linear_gelu._forward_outputs(x, 1024, True)
    _, args, kwargs = linear_gelu._forward_launch(x, w, b, y, pre, "gelu", True)
    assert not linear_gelu._prefers_cublas(x, w, "gelu", True)
    with kernels.tuned(_table(_entry(linear_gelu._linear_gelu_fwd, args, kwargs, "cublas", None))):
        assert linear_gelu._prefers_cublas(x, w, "gelu", True)
        assert not linear_gelu._prefers_cublas(x, w, "relu", True)  # another activation: the rule
        assert linear_gelu._prefers_cublas(torch.randn(2048, 256, dtype=torch.bfloat16), w, "gelu", True)  # 4x M
        assert not linear_gelu._prefers_cublas(torch.randn(4096, 256, dtype=torch.bfloat16), w, "gelu", True)  # 8x
    config = next(c for c in linear_gelu._linear_gelu_fwd.candidates if c[0]["BLOCK_N"] == 64)
    with kernels.tuned(_table(_entry(linear_gelu._linear_gelu_fwd, args, kwargs, "pointer", config))):
        assert not linear_gelu._prefers_cublas(x, w, "gelu", True)
        assert linear_gelu._linear_gelu_fwd.pick(args, kwargs) == config


def test_the_ffn_backward_takes_cublas_dh_where_the_table_says(compiled):
    """The dH GEMM's entry decides the FFN backward's way apart from the forward's: cuBLAS's dH and
    the activation pass (variant "cublas"), or the GEMM in the entry's config; no entry, the rule."""
    dout = torch.randn(512, 256, dtype=torch.bfloat16)
    w2 = torch.randn(256, 1024, dtype=torch.bfloat16)
    pre = torch.randn(512, 1024, dtype=torch.bfloat16)
    outputs = linear_gelu._activation_outputs(pre, True, True, linear_gelu.PARTIAL_ROWS)
    (configs, _, args, kwargs), _ = linear_gelu._ffn_act_grad_launches(dout, w2, pre, *outputs, "gelu", True, True)
    assert configs is linear_gelu._ffn_act_grad
    assert not linear_gelu._prefers_cublas_backward(dout, pre, "gelu", True, True)
    with kernels.tuned(_table(_entry(configs, args, kwargs, "cublas", None))):
        assert linear_gelu._prefers_cublas_backward(dout, pre, "gelu", True, True)
        assert not linear_gelu._prefers_cublas_backward(dout, pre, "gelu", True, False)  # another flag: the rule
        assert not linear_gelu._prefers_cublas(dout, torch.randn(1024, 256, dtype=torch.bfloat16), "gelu", True)
    config = next(c for c in configs.candidates if c[0]["BLOCK_N"] == 64)
    with kernels.tuned(_table(_entry(configs, args, kwargs, "pointer", config))):
        assert not linear_gelu._prefers_cublas_backward(dout, pre, "gelu", True, True)
        assert configs.pick(args, kwargs) == config


def test_what_the_sweep_records_is_what_the_kernels_look_up(compiled):
    """A sweep's report adopted into a table, then read by the kernels: the sweep's record of a
    launch (tools.sweep.launch_match) names the entry a launch like it finds."""
    family = sweep_tool.FAMILIES[2]  # the model's call at L64
    launches = sweep_tool.attention_launches(family, family.quick, "pointer", torch.device("cpu"))
    forward = launches[0]
    rule = forward.configs.pick(forward.args, forward.kwargs)
    faster = next(c for c in forward.kept() if c != rule)
    records = [
        _timed(forward, rule, True, 1.0),
        _timed(forward, faster, False, 0.7),  # 1.43x [1.30, 1.57]: outside the noise
    ]
    table = sweep_tool.adopt(_report(records))
    assert [e["variant"] for e in table["launches"]] == ["pointer"]
    with kernels.tuned(table):
        assert forward.configs.pick(forward.args, forward.kwargs) == faster


def _timed(launch, config, pick, median):
    record = sweep_tool.record_of(launch, config, pick)
    record.status, record.reps = "timed", 20
    record.median_ms, record.p20_ms, record.p80_ms = median, median * 0.95, median * 1.05
    return record


def _report(records, gpu=GPU, interrupted=False):
    return {
        "schema": sweep_tool.SCHEMA,
        "env": {"gpu": gpu, "date": "2026-12-02 00:00 UTC", "commit": "c", "torch": "2.11", "triton": "3.6"},
        "dry_run": False,
        "interrupted": interrupted,
        "records": [vars(r) for r in records],
        "best": sweep_tool.best_per_pass(records),
    }


def test_adopt_keeps_the_rule_within_noise_and_where_the_pick_wins():
    def record(pass_name, variant, config, pick, median, spread):
        return sweep_tool.Record(
            "f", pass_name, variant, config, pick, "timed", median, median - spread, median + spread, 20, 1.0,
            kernel=pass_name, key={"HEAD_DIM": 64}, dtype="torch.bfloat16", meta={"BLOCK_M": 64}, num_warps=4,
            num_stages=2,
        )  # fmt: skip

    records = [
        record("a", "pointer", "x", True, 1.0, 0.01),
        record("a", "tma", "y", False, 0.9, 0.01),  # 1.11x [1.09, 1.13]: adopted
        record("b", "pointer", "x", True, 1.0, 0.05),
        record("b", "tma", "y", False, 0.96, 0.05),  # 1.04x [0.94, 1.15]: within noise
        record("c", "pointer", "x", True, 1.0, 0.01),
        record("c", "tma", "y", False, 1.2, 0.01),  # the pick wins
        record("d", "pointer", "x", True, 1.0, 0.01),
        record("d", "cublas", "z", False, 0.5, 0.01),  # cuBLAS: no config of the GEMM's
    ]
    table = sweep_tool.adopt(_report(records))
    assert [(e["pass"], e["variant"]) for e in table["launches"]] == [("a", "tma"), ("d", "cublas")]
    expected = Ratio.of(Timing(1.0, 0.99, 1.01, 20), Timing(0.9, 0.89, 0.91, 20))
    assert table["launches"][0]["low"] == round(expected.low, 4) and table["launches"][1]["meta"] is None
    assert _tuned.Table(table).gpu == GPU and len(_tuned.Table(table)) == 2  # a table the kernels read
    with pytest.raises(ValueError, match="a dry run timed nothing"):
        sweep_tool.adopt({**_report(records), "dry_run": True})


def test_adopt_command_writes_the_table_and_the_report_beside_the_committed_ones(tmp_path, capsys):
    report = _report([])
    (tmp_path / "sweep.json").write_text(json.dumps(report))
    args = ["--adopt", str(tmp_path / "sweep.json"), "--tables", str(tmp_path / "t"), "--results", str(tmp_path / "r")]
    assert sweep_tool.main(args) == 0
    table = json.loads((tmp_path / "t" / "h200.json").read_text())
    assert table == sweep_tool.adopt(report, "tools/results/sweep-h200.json") or table["launches"] == []
    assert json.loads((tmp_path / "r" / "sweep-h200.json").read_text()) == report
    assert "no winner outside the noise; the written rules stand" in capsys.readouterr().out
    (tmp_path / "bad.json").write_text("{}")
    assert sweep_tool.main(["--adopt", str(tmp_path / "bad.json"), "--tables", str(tmp_path / "t2")]) == 2
    assert not (tmp_path / "t2").exists()


def test_each_committed_table_is_what_its_committed_sweep_decides():
    """kernels/tuned/<gpu>.json is tools.sweep.adopt of tools/results/sweep-<gpu>.json, and each has
    the other: the table decides, not a hand edit."""
    tables = {p.stem: p for p in (ROOT / "kernels" / "tuned").glob("*.json")}
    sweeps = {p.stem.removeprefix("sweep-"): p for p in (ROOT / "tools" / "results").glob("sweep-*.json")}
    assert set(tables) == set(sweeps), (sorted(tables), sorted(sweeps))
    for slug, path in sweeps.items():
        report = json.loads(path.read_text())
        assert _tuned.gpu_slug(report["env"]["gpu"]) == slug
        expected = sweep_tool.adopt(report, str(path.relative_to(ROOT)))
        assert json.loads(tables[slug].read_text()) == expected, (
            f"python -m tools.sweep --adopt {path.relative_to(ROOT)}"
        )
    assert set(_tuned.installed()) == {json.loads(p.read_text())["gpu"] for p in tables.values()}


def test_the_table_in_force_and_its_checks(compiled, monkeypatch, tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps(_table()))
    monkeypatch.setenv(_tuned.ENV_VAR, str(path))
    assert isinstance(_tuned.in_force(), _tuned.Table) and _tuned.in_force().where == str(path)
    switches = _configs.switches(torch.zeros(1))
    monkeypatch.setenv(_tuned.ENV_VAR, "0")
    assert _tuned.in_force() is None and _configs.switches(torch.zeros(1)) != switches  # plans are kept per table
    monkeypatch.setenv(_tuned.ENV_VAR, str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="FASTFORMER_TUNED must be the path of a tuned table or 0"):
        _tuned.in_force()
    (tmp_path / "bad.json").write_text(json.dumps({"schema": _tuned.SCHEMA, "gpu": GPU, "launches": [{"kernel": "k"}]}))
    with pytest.raises(ValueError, match=r"bad.json: launches\[0\]: missing dtype, family"):
        kernels.set_tuned(tmp_path / "bad.json")
    with pytest.raises(TypeError, match="set_tuned takes a tuned table, its path, False or None"):
        kernels.set_tuned(3)
    assert _tuned.gpu_slug("NVIDIA H100 80GB HBM3") == "h100-80gb-hbm3" and _tuned.gpu_slug("NVIDIA H200") == "h200"
