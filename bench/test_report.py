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
from fastformer.data.reviews import bucket_length
from tools.benchmarks import cases, report
from tools.benchmarks.common import Skip, attention_flops, ffn_flops

ROOT = Path(__file__).resolve().parent.parent
SCHEMA_KEYS = {"bench", "provider", "params", "ms", "tflops", "tokens_per_s", "peak_mem_mb"}
BENCHES = {
    "attention_fwd",
    "attention_fwd_bwd",
    "ffn_fwd",
    "ffn_fwd_bwd",
    "add_layer_norm",
    "model_train",
    "model_infer",
}
PROVIDERS = {
    "fastformer",
    "fastformer_autotune",
    "fastformer_fused",
    "reference",
    "reference_fp32",
    "sdpa",
    "flex",
    "compile",
    "eager",
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
    result = report.run(smoke_subset(), "cpu", warmup=0, rep=1, log=lambda *_: None)
    return result, report.write(result, str(out)), out


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
    assert "| attention_fwd | B=2, D=16, H=2, L=13, dtype=fp32, mask=padding_causal, shape=tiny | sdpa |" in table
    assert "| model_train, tutorial config: tokens/s vs reference_fp32 | 4.0x | - | 0 | not measured |" in table


def test_a_wrong_kernel_fails_its_benchmark(monkeypatch):
    """A fastformer kernel that is off by 1e-2 fails its check and is reported, not timed."""
    from fastformer import kernels

    def slightly_wrong(q, k, v, **kwargs):
        return kernels.attention_reference(q, k, v, **kwargs) + 1e-2

    monkeypatch.setattr(kernels, "attention", slightly_wrong)
    case = cases.attention_case("fwd", "fp32", 16, "causal", 2, 2, 8, "fastformer", "cpu", "tiny")
    result = report.run([case], "cpu", warmup=0, rep=1, log=lambda *_: None)
    assert not result["results"] and len(result["failed"]) == 1
    assert "out: max error 0.01" in result["failed"][0]["error"]


def test_targets_are_judged_from_ratios_in_one_run():
    def record(provider, ms, mem):
        # as tools.benchmarks.cases records them: reference_fp32 is the one provider without autocast
        amp = provider != "reference_fp32"
        return {
            "bench": "model_train",
            "provider": provider,
            "params": {"scenario": "classify", "B": 128, "n_layer": 6, "d_hidn": 256, "amp": amp},
            "ms": ms,
            "tflops": None,
            "tokens_per_s": None,
            "peak_mem_mb": mem,
        }

    results = [record("fastformer", 10.0, 300), record("reference_fp32", 50.0, 1000), record("reference", 15.0, 600)]
    rows = {r["target"]: r for r in report.evaluate_targets(results)}
    assert rows["model_train, tutorial config: tokens/s vs reference_fp32"]["worst"] == 5.0
    assert rows["model_train, tutorial config: tokens/s vs reference_fp32"]["met"] is True
    assert rows["model_train, tutorial config: tokens/s vs reference (bf16)"]["met"] is False  # 1.5x < 2x
    assert rows["model_train, tutorial config: tokens/s vs compile"]["met"] is None  # not measured
    assert rows["model_train, tutorial config: peak memory vs reference_fp32"]["worst"] == 0.3


def test_the_readme_summary_is_a_line_a_case_with_every_peer_and_variant():
    def record(provider, ms, mem):
        params = {"scenario": "classify", "B": 128, "n_layer": 6, "d_hidn": 256, "amp": provider != "reference_fp32"}
        return {"bench": "model_train", "provider": provider, "params": params, "ms": ms, "peak_mem_mb": mem}

    env = {"gpu": "H100", "torch": "2.11", "triton": "3.6", "date": "2026-11-26"}
    # tokens/s 5x the fp32 reference's (target 4x: met), peak memory 0.6x its (target 0.4x: not met)
    results = [record("fastformer", 10, 600), record("reference_fp32", 50, 1000), record("fastformer_graphs", 2, 0)]
    summary = report.readme_summary({"env": env, "results": results}, "bench/results/gpu/h100")
    row = "| model_train | B=128, d_hidn=256, n_layer=6 | 10.00 ms | reference_fp32 5.00x | graphs 2.00 ms |"
    assert row in summary, summary
    assert summary.rstrip().endswith(
        "Targets met: 1 of the 2 measured (11 in all). Every row, target and plot: bench/results/gpu/h100."
    )


def test_readme_table_is_spliced_between_markers(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{report.README_START}\nold\n{report.README_END}\nafter\n")
    report.splice_readme("| new |\n", str(readme))
    assert readme.read_text() == f"intro\n{report.README_START}\n| new |\n{report.README_END}\nafter\n"
    assert report.README_START in (ROOT / "README.md").read_text()


def test_report_without_a_gpu_says_so(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert report.main(["--out", "/nonexistent"]) == 2
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


def test_model_variants_are_cases_beside_fastformer_and_skip_without_cuda():
    """fastformer's step replayed from CUDA graphs, run through torch.compile and stepped by the
    fused AdamW (train only): the eager fastformer case's bench and params (so the report groups
    them with it), and on a CPU a skip that says why."""
    config = fastformer.Config.tutorial(
        n_layer=1, d_hidn=32, n_head=2, d_head=16, d_ff=64, n_enc_vocab=50, n_dec_vocab=50, n_enc_seq=12, n_dec_seq=12
    )
    for kind in ("train", "infer"):
        eager = cases.model_case(kind, "classify", "fastformer", "cpu", B=2, config=config, amp=False)
        for variant in cases.MODEL_VARIANTS:
            if kind == "infer" and variant in cases.TRAIN_VARIANTS:
                with pytest.raises(ValueError, match=f"^{variant} is a variant of the train step"):
                    cases.model_variant_case(kind, variant, "cpu", 2, config, amp=False)
                continue
            case = cases.model_variant_case(kind, variant, "cpu", 2, config, amp=False)
            assert (case.bench, case.params) == (eager.bench, eager.params)
            with pytest.raises(Skip, match=f"^{variant} is benchmarked on CUDA only "):
                case.setup()
    with pytest.raises(
        ValueError, match="variant must be one of fastformer_graphs, fastformer_compile, fastformer_fus"
    ):
        cases.model_variant_case("train", "graphs", "cpu", 2, config, amp=False)


def test_the_model_batch_of_128_reviews_is_a_bucket_length_already():
    """The model cases' batch of 128 reviews is padded to its longest, 128 tokens: the shape
    `fastformer train --cuda-graphs` pads it to, so the graphed variant times the step it runs."""
    tutorial = fastformer.Config.tutorial()
    width = cases.review_batch(tutorial, 128, False, "cpu")[0].size(1)
    assert bucket_length(width, tutorial.n_enc_seq) == width == 128
