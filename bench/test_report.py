"""The benchmark suite's own tests, on a CPU: the report in smoke mode (tiny shapes), its schema,
tables, plots and targets, a wrong kernel failing its benchmark, the model cases the GPU check
times beside fastformer's eager step, and `pytest bench --benchmark-only` skipping cleanly.

They run with the test suite (`pytest` collects tests/ and bench/); the benchmarks themselves run
only under `--benchmark-only` (bench/conftest.py)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fastformer
from bench import cases, reporting, targets
from bench.common import RECORD_KEYS, Skip, attention_flops, ffn_flops
from fastformer.data.reviews import bucket_length

ROOT = Path(__file__).resolve().parent.parent
SCHEMA_KEYS = set(RECORD_KEYS)
BENCHES = {
    "attention_fwd",
    "attention_fwd_bwd",
    "attention_model_call",
    "attention_varlen",
    "ffn_fwd",
    "ffn_fwd_bwd",
    "add_layer_norm",
    "model_train",
    "model_infer",
}
PROVIDERS = {
    *cases.ATTENTION_PROVIDERS,
    *cases.VARLEN_PROVIDERS,
    *cases.FFN_PROVIDERS,
    *cases.ADD_LAYER_NORM_PROVIDERS,
    *cases.MODEL_PROVIDERS,
    "fastformer_fused",
}


def test_flop_formulas():
    assert attention_flops(2, 3, 5, 7, 64, causal=False, mode="fwd") == 4 * 2 * 3 * 5 * 7 * 64
    assert attention_flops(2, 3, 5, 7, 64, causal=True, mode="fwd") == 2 * 2 * 3 * 5 * 7 * 64
    assert attention_flops(1, 1, 4, 4, 8, causal=False, mode="fwd_bwd") == 3.5 * 4 * 4 * 4 * 8
    assert ffn_flops(10, 4, 16, "fwd") == 2 * 2 * 10 * 4 * 16
    assert ffn_flops(10, 4, 16, "fwd_bwd") == 3 * ffn_flops(10, 4, 16, "fwd")


def smoke_subset():
    """One case of each kind from the smoke suite (the whole suite takes ~20 s here)."""
    wanted = [
        "attention_fwd-fastformer-shape=tiny-dtype=fp32-D=16-mask=padding_causal-B=2-H=2-L=13",
        "attention_fwd-sdpa-shape=tiny-dtype=fp32-D=16-mask=padding_causal-B=2-H=2-L=13",
        "attention_fwd_bwd-fastformer-shape=tiny-dtype=fp32-D=16-mask=causal-B=2-H=2-L=8",
        "attention_fwd_bwd-reference-shape=tiny-dtype=fp32-D=16-mask=causal-B=2-H=2-L=8",
        "attention_fwd-flex-shape=tiny-dtype=fp32-D=16-mask=causal-B=2-H=2-L=16",
        "ffn_fwd_bwd-fastformer-op=feed_forward-dtype=fp32-M=24-d=16-d_ff=32",
        "ffn_fwd_bwd-eager-op=feed_forward-dtype=fp32-M=24-d=16-d_ff=32",
        "ffn_fwd-fastformer_fused-op=feed_forward-dtype=fp32-M=24-d=16-d_ff=32",
        "add_layer_norm-fastformer-mode=fwd_bwd-dtype=fp32-M=24-d=16",
        "model_train-reference_fp32-scenario=classify-B=2-n_layer=1-d_hidn=32-amp=False",
        "model_infer-fastformer-scenario=classify-B=2-n_layer=1-d_hidn=32-amp=False",
    ]
    by_id = {c.id: c for c in cases.smoke_suite("cpu")}
    return [by_id[i] for i in wanted]


@pytest.fixture(scope="module")
def smoke_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("results")
    result = reporting.run(smoke_subset(), "cpu", warmup=0, rep=1, log=lambda *_: None)
    return result, reporting.write(result, str(out)), out


def test_smoke_report_schema(smoke_report):
    result, _, out = smoke_report
    assert not result["failed"], result["failed"]
    saved = json.loads((out / "cpu.json").read_text())
    assert set(saved["env"]) >= {"gpu", "torch", "triton", "cuda", "date"}
    assert saved["env"]["gpu"] == "cpu" and saved["env"]["torch"] == torch.__version__
    assert len(saved["results"]) == 10 and len(saved["skipped"]) == 1
    assert "flex is benchmarked on CUDA only" in saved["skipped"][0]["reason"]
    for record in saved["results"]:
        assert set(record) >= SCHEMA_KEYS
        assert record["bench"] in BENCHES and record["provider"] in PROVIDERS
        assert record["ms"] > 0
    attention = [r for r in saved["results"] if r["bench"].startswith("attention")]
    assert all(r["tflops"] > 0 for r in attention)
    model = [r for r in saved["results"] if r["bench"].startswith("model")]
    assert all(r["tokens_per_s"] > 0 for r in model)


def test_smoke_report_tables_and_plots(smoke_report):
    _, paths, out = smoke_report
    names = {Path(p).name for p in paths}
    assert {
        "cpu.json",
        "cpu.md",
        "cpu-attention_fwd_d16.png",
        "cpu-attention_fwd_bwd_d16.png",
        "cpu-model.png",
    } <= names
    for p in paths:
        if p.endswith(".png"):
            assert Path(p).read_bytes()[:4] == b"\x89PNG"
    table = (out / "cpu.md").read_text()
    assert table.startswith("Measured on cpu, torch")
    assert "| attention_fwd | B=2, D=16, H=2, L=13, dtype=fp32, mask=padding_causal, shape=tiny | sdpa | " in table
    target = (
        "| model_train, tutorial: replayed step vs reference_fp32 eager | >= 6.00x | - | - | - | 0 | not measured |"
    )
    assert target in table


def test_a_wrong_kernel_fails_its_benchmark(monkeypatch):
    """A fastformer kernel that is off by 1e-2 fails its check and is reported, not timed."""
    from fastformer import kernels

    def slightly_wrong(q, k, v, **kwargs):
        return kernels.attention_reference(q, k, v, **kwargs) + 1e-2

    monkeypatch.setattr(kernels, "attention", slightly_wrong)
    case = cases.attention_case("fwd", "fp32", 16, "causal", 2, 2, 8, "fastformer", "cpu", "tiny")
    result = reporting.run([case], "cpu", warmup=0, rep=1, log=lambda *_: None)
    assert not result["results"] and len(result["failed"]) == 1
    assert "out: max error 0.01" in result["failed"][0]["error"]


def _step(provider, ms, mem, spread=0.05):
    """A model_train record as bench.common.measure writes it (wall time, no replay)."""
    params = {"scenario": "classify", "B": 128, "n_layer": 6, "d_hidn": 256, "amp": provider != "reference_fp32"}
    figures = {"ms": ms, "p20_ms": ms * (1 - spread), "p80_ms": ms * (1 + spread), "reps": 10}
    replay = {"graph_ms": None, "graph_p20_ms": None, "graph_p80_ms": None, "graph_reps": None}
    return {"bench": "model_train", "provider": provider, "params": params, "timing": "wall", **figures, **replay,
            "flops": None, "tflops": None, "tokens_per_s": None, "peak_mem_mb": mem}  # fmt: skip


def test_every_target_is_judged_from_one_runs_records():
    results = [_step("fastformer", 40.0, 300), _step("reference_fp32", 50.0, 1000), _step("fastformer_graphs", 5.0, 0)]
    rows = {r["target"]: r for r in reporting.evaluate_targets(results)}
    assert len(rows) == len(targets.TARGETS)
    replayed = rows["model_train, tutorial: replayed step vs reference_fp32 eager"]
    assert replayed["worst"] == 10.0 and replayed["verdict"] == "met" and replayed["basis"] == "wall"
    assert rows["model_train, tutorial: eager peak memory vs reference_fp32"]["worst"] == 0.3
    assert rows["model_train, tutorial: replayed step vs the reference at its best"]["verdict"] == "not measured"
    for row in rows.values():
        assert set(row) == {"target", "kind", "required", "cases", "worst", "low", "high", "basis", "peer", "verdict",
                            "met"}  # fmt: skip


def test_the_readme_summary_is_a_line_a_case_with_every_peer_and_variant():
    env = {"gpu": "H100", "torch": "2.11", "triton": "3.6", "date": "2026-11-26"}
    results = [
        _step("fastformer", 10, 600, 0.0),
        _step("reference_fp32", 50, 1000, 0.0),
        _step("fastformer_graphs", 2, 0),
    ]
    summary = reporting.readme_summary({"env": env, "results": results}, "bench/results/gpu/h100")
    row = (
        "| model_train | B=128, d_hidn=256, n_layer=6 | 10.000 (10.000-10.000) | "
        "reference_fp32 5.00x [5.00-5.00] wall | graphs 2.00 ms |"
    )
    assert row in summary, summary
    assert summary.rstrip().endswith(
        f"Targets: 1 met, 1 not met, 0 within noise, {len(targets.TARGETS) - 2} not measured "
        f"({len(targets.TARGETS)} in all). Every row, target and plot: bench/results/gpu/h100."
    )


def test_readme_table_is_spliced_between_markers(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{reporting.README_START}\nold\n{reporting.README_END}\nafter\n")
    reporting.splice_readme("| new |\n", str(readme))
    assert readme.read_text() == f"intro\n{reporting.README_START}\n| new |\n{reporting.README_END}\nafter\n"
    assert reporting.README_START in (ROOT / "README.md").read_text()


def test_report_without_a_gpu_says_so(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert reporting.main(["--out", "/nonexistent"]) == 2
    assert "no CUDA GPU here" in capsys.readouterr().err


def test_pytest_bench_skips_cleanly_without_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the suite would run for real")
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "bench", "--benchmark-only", "-q", "-p", "no:cacheprovider"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "skipped" in result.stdout and "passed" not in result.stdout


def test_every_model_provider_is_a_case_of_the_same_bench_and_params():
    """Each way of running the step (MODEL_WAYS) shares the eager fastformer case's bench and params
    but for autocast and TF32 (so the report groups them); on a CPU, the ways that need CUDA skip saying why;
    the fused optimizer is a way of stepping, with no inference case."""
    config = fastformer.Config.tutorial(
        n_layer=1, d_hidn=32, n_head=2, d_head=16, d_ff=64, n_enc_vocab=50, n_dec_vocab=50, n_enc_seq=12, n_dec_seq=12
    )
    cpu_only = {"fastformer", "reference_fp32", "reference", "reference_sdpa"}
    for kind in ("train", "infer"):
        eager = cases.model_case(kind, "fastformer", "cpu", B=2, config=config, amp=False)
        for provider in cases.MODEL_PROVIDERS:
            if kind == "infer" and provider in cases.TRAIN_ONLY:
                with pytest.raises(ValueError, match=f"^{provider} is a way of stepping the optimizer"):
                    cases.model_case(kind, provider, "cpu", B=2, config=config, amp=False)
                continue
            case = cases.model_case(kind, provider, "cpu", B=2, config=config, amp=False)
            assert (case.bench, case.timing) == (eager.bench, "wall")
            assert {**case.params, "tf32": False} == {**eager.params, "tf32": False}  # how it ran: TF32 or not
            if provider not in cpu_only:
                with pytest.raises(Skip, match=f"^{provider} is benchmarked on CUDA only "):
                    case.setup()
    with pytest.raises(ValueError, match="provider must be one of fastformer, fastformer_autotune"):
        cases.model_case("train", "graphs", "cpu", B=2, config=config)


def test_the_reference_written_with_sdpa_is_timed_and_checked_like_the_others():
    config = fastformer.Config.tutorial(
        n_layer=1, d_hidn=32, n_head=2, d_head=16, d_ff=64, n_enc_vocab=50, n_dec_vocab=50, n_enc_seq=12, n_dec_seq=12
    )
    case = cases.model_case("train", "reference_sdpa", "cpu", B=2, config=config, amp=False)
    result = reporting.run([case], "cpu", warmup=0, rep=2, log=lambda *_: None)
    assert not result["failed"] and len(result["results"]) == 1, result


def test_the_model_batch_of_128_reviews_is_a_bucket_length_already():
    """The model cases' batch of 128 reviews is padded to its longest, 128 tokens: the shape
    `fastformer train --cuda-graphs` pads it to, so the graphed variant times the step it runs."""
    tutorial = fastformer.Config.tutorial()
    width = cases.review_batch(tutorial, 128, False, "cpu")[0].size(1)
    assert bucket_length(width, tutorial.n_enc_seq) == width == 128


@pytest.mark.parametrize("run", sorted(p.name for p in (ROOT / "bench" / "results" / "gpu").iterdir()))
def test_the_committed_gpu_runs_still_render_and_are_judged_on_wall_time(run):
    """Runs from before device time kept a median alone, of wall-clock calls: they render, and
    their comparisons say "wall" with a spread of zero, never "events" or "graph"."""
    saved = reporting.load(ROOT / "bench" / "results" / "gpu" / run / "results.json")
    table = reporting.markdown(saved)
    assert table.startswith(f"Measured on {saved['env']['gpu']}")
    judged = [t for t in reporting.evaluate_targets(saved["results"]) if t["cases"]]
    assert bool(judged) == bool(saved["results"])  # one run measured nothing (its stages: env, tests, compile)
    assert {t["basis"] for t in judged} <= {"wall", "peak memory"}
    assert all(t["low"] == t["worst"] == t["high"] for t in judged)
