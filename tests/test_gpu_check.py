"""tools.gpu_check on a CPU: the --smoke run's files, schema and summary; every stage reachable by
--stage; a failing stage recorded with its traceback while the run goes on; the exit statuses; and
the helpers whose real work only a GPU run reaches (bitwise comparison, graph breaks, JUnit counts,
the model FLOP count, pytest's time budget)."""

import inspect
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fastformer
from bench import cases, common, targets
from bench.common import KERNEL_ROWS, kernel_rows, model_flops
from bench.targets import TARGETS
from tools.convergence import TINY
from tools.gpu_check import job
from tools.gpu_check.bench import KERNEL_PROFILE, bench_cases
from tools.gpu_check.command import STAGE_FUNCTIONS, main
from tools.gpu_check.compile import graph_breaks
from tools.gpu_check.determinism import first_mismatch
from tools.gpu_check.env import copy_gbps, git_commit, output
from tools.gpu_check.model import PROFILE_ROWS, model_cases
from tools.gpu_check.plan import FULL, MODEL_ORDER, ONE_SECONDS, QUICK, REST, SMOKE, STAGES, SWEEP_FIRST
from tools.gpu_check.run import UNITS, stream
from tools.gpu_check.tests import junit_counts

ROOT = Path(__file__).resolve().parent.parent
TOP_KEYS = {
    "schema",
    "command",
    "mode",
    "plan",
    "device",
    "started",
    "finished",
    "env",
    "units",
    "stages",
    "targets",
    "targets_note",
    "report",
    "plots",
}
STAGE_KEYS = {"status", "seconds", "reason", "error", "traceback", "details"}
RECORD_KEYS = {*common.RECORD_KEYS, "mfu"}  # and "kernels" where the stage profiled the case
# the --smoke run on a GPU would run the cuda tests and compile for real: that is the command's job there
CPU_ONLY = pytest.mark.skipif(
    torch.cuda.is_available(), reason="the CPU behaviour of --smoke; on a GPU run the command"
)


# every stage but the sweep, whose rehearsal (a dry run under the driver tools/sm90.py) is the one
# run's, tests/test_one_run.py
SMOKE_STAGES = [s for s in STAGES if s != "sweep"]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """One real `python -m tools.gpu_check --smoke` (about 130 s of one core, 2026-12-02), into a folder holding
    a stranger's file and an earlier run's plot. A subprocess, as the command is run: inside the
    pytest process the interpreter's allocations page-fault ten times more."""
    out = tmp_path_factory.mktemp("smoke")
    (out / "notes.txt").write_text("not gpu_check's\n")
    (out / "plot-attention_fwd_d64.png").write_bytes(b"an earlier run's plot")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    scratch(out).mkdir()
    env["TMPDIR"] = str(scratch(out))  # where the job stage's jobs make their temporary folders
    result = subprocess.run(
        [sys.executable, "-m", "tools.gpu_check", "--smoke", "--out", str(out), "--stage", ",".join(SMOKE_STAGES)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    return result, out, json.loads((out / "results.json").read_text())


def scratch(out):
    """The smoke run's temporary folder ($TMPDIR), beside its output folder `out`."""
    return out.with_name(out.name + "-tmp")


def _unit_patterns():
    return [p for key in UNITS for p in key.split(", ")]


def _has_unit(key):
    return any(key == p or (p.startswith("*") and key.endswith(p[1:])) for p in _unit_patterns())


def _figures(node, key=None):
    """(key, value) of every non-integer number in a JSON tree: the figures that need a unit."""
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _figures(v, k)
    elif isinstance(node, list):
        for v in node:
            yield from _figures(v, key)
    elif isinstance(node, float):
        yield key, node


@CPU_ONLY
def test_smoke_run_exits_0_and_writes_only_its_files(smoke):
    result, out, _ = smoke
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    names = {p.name for p in out.iterdir()} - {"notes.txt"}
    plots = {n for n in names if n.endswith(".png")}
    assert names - plots == {"summary.md", "results.json", "log.txt", "junit.xml"}
    # at most four: model tokens/s, and attention TFLOP/s per (bench, head dim), D64 (here 16) first
    assert plots == {
        "plot-attention_fwd_d16.png",
        "plot-attention_fwd_bwd_d16.png",
        "plot-attention_fwd_d128.png",
        "plot-model.png",
    }
    assert len(names) <= 8 and len(plots) <= 4
    assert all((out / p).read_bytes()[:4] == b"\x89PNG" for p in plots)
    assert (out / "notes.txt").read_text() == "not gpu_check's\n"  # not ours: left alone


@CPU_ONLY
def test_results_json_schema(smoke):
    _, _, doc = smoke
    assert set(doc) == TOP_KEYS
    assert doc["schema"] == "fastformer.gpu_check/1" and doc["mode"] == "smoke" and doc["device"] == "cpu"
    assert doc["finished"] and doc["started"] <= doc["finished"]
    assert doc["env"]["gpu"] == "cpu" and doc["env"]["torch"] == torch.__version__ and doc["env"]["triton"]
    assert doc["env"]["bf16_gemm_tflops"] is None and doc["env"]["d2d_copy_gbps"] is None  # no CPU "ceiling"
    assert list(doc["stages"]) == SMOKE_STAGES
    for name, entry in doc["stages"].items():
        assert set(entry) == STAGE_KEYS, name
        assert entry["seconds"] >= 0 and entry["error"] is None and entry["traceback"] is None
    statuses = {name: entry["status"] for name, entry in doc["stages"].items()}
    assert statuses == {
        "env": "passed",
        "tests": "skipped",
        "compile": "skipped",
        "determinism": "passed",
        "bench": "passed",
        "model": "passed",
        "job": "passed",
    }
    for name in ("tests", "compile"):
        assert doc["stages"][name]["reason"].startswith("needs CUDA: ")
    assert doc["plots"] == sorted(p.name for p in smoke[1].iterdir() if p.suffix == ".png")
    unitless = sorted({key for key, _ in _figures(doc) if not _has_unit(key)})
    assert not unitless, f"figures without a unit in UNITS: {unitless}"


@CPU_ONLY
def test_smoke_stage_details(smoke):
    _, _, doc = smoke
    stages = {name: entry["details"] for name, entry in doc["stages"].items()}
    assert all(details["summary"] for details in stages.values() if details)
    env = stages["env"]
    assert env["torch"] == torch.__version__ and env["sm_count"] is None
    assert env["ceilings_note"].startswith("needs CUDA")
    tests = stages["tests"]
    assert tests["tests"] > 0 and tests["skipped"] == tests["tests"] and tests["passed"] == 0
    assert tests["command"].startswith("python -m pytest tests -m cuda") and tests["returncode"] == 0
    determinism = stages["determinism"]
    assert [s["repetitions"] for s in determinism["attention"]["settings"]] == [SMOKE.reps.attention] * 2
    assert all(s["mismatch"] is None for s in determinism["attention"]["settings"])
    assert determinism["training"]["steps"] == SMOKE.reps.train_steps
    assert determinism["training"]["mismatch"] is None
    assert stages["bench"]["failed"] == 0 and stages["bench"]["measured"] >= 20
    # the kernels of the pairs KERNEL_PROFILE names, fastformer's beside the peer's; on a CPU, operators
    kernels = stages["bench"]["kernel_profile"]
    assert {tuple(case.split("-")[:2]) for case in kernels} == {
        (bench, provider) for bench, _, providers in KERNEL_PROFILE for provider in providers
    }
    for rows in kernels.values():
        whole, *named = rows
        assert whole["kernel"] == "every kernel of the case" and whole["us_per_run"] > 0
        assert 0 < len(named) <= KERNEL_ROWS
        assert sum(r["us_per_run"] for r in named) <= whole["us_per_run"] * 1.001
        assert [r["us_per_run"] for r in named] == sorted((r["us_per_run"] for r in named), reverse=True)
    model = stages["model"]
    on_a_cpu = ("fastformer", "reference_fp32", "reference", "reference_sdpa")
    assert {(r["bench"], r["provider"]) for r in model["rows"]} == {
        (b, p) for b in ("model_train", "model_infer") for p in on_a_cpu
    }
    assert all(r["p20_ms"] <= r["ms"] <= r["p80_ms"] for r in model["rows"])  # per-step wall time, its spread
    # the train steps' kernels: fastformer's (replayed on a GPU) and the fastest reference's
    fastest = min((r for r in model["rows"] if r["bench"] == "model_train" and r["provider"].startswith("reference")),
                  key=lambda r: r["ms"])  # fmt: skip
    assert set(model["step_kernels"]) == {"fastformer", fastest["provider"]}
    assert model["memory_phases"]["not_run"].startswith("needs CUDA")
    assert all(r["tokens_per_s"] > 0 and r["tflops"] > 0 and r["mfu"] is None for r in model["rows"])
    assert model["mfu_note"].startswith("needs CUDA")
    profile = model["host_profile"]  # where the eager train step's host time goes, per provider
    assert set(profile) == set(SMOKE.host_profile) == {"reference_fp32"}
    rows = profile["reference_fp32"]
    assert rows[0]["function"] == "the whole step (wall)" and rows[0]["cum_ms_per_step"] > 0
    assert len(rows) == 1 + PROFILE_ROWS and all(r["own_ms_per_step"] >= 0 for r in rows[1:])
    assert any(r["function"].startswith("torch/optim/adam.py:") for r in rows)  # a path from site-packages
    calls = {r["call"]: r["us_per_call"] for r in model["host_calls"]}  # what single calls cost this host
    expected = {"torch.empty(1024)", "F.linear with a bias, under bf16 autocast"}
    expected |= {f"one-pointer Triton kernel, {n}" for n in ("kernel[grid]", "launch(kernel)[grid]", "PreparedLaunch")}
    assert expected <= set(calls) and all("error" not in r for r in model["host_calls"])
    assert all(us > 0 for us in calls.values())


@CPU_ONLY
def test_the_job_stage_trains_on_both_backends_and_reads_back_their_figures(smoke):
    """Both `fastformer train` jobs end to end at the smoke size (tools.gpu_check.job), and what
    the stage reads of each: figures, the interpreter's one step, the reference's whole epoch."""
    _, out, doc = smoke
    details = doc["stages"]["job"]["details"]
    assert details["data"] == job.REVIEWS_200 and details["data_command"] is None
    figures_read = ("wall_seconds", "setup_seconds", "first_step_seconds", "train_seconds", "tokens_per_s")
    for name, backend in (("triton", "triton"), ("triton_warm", "triton"), ("reference", "reference")):
        figures = details[name]
        assert "error" not in figures, figures
        assert figures["returncode"] == 0 and not figures["timed_out"]
        assert all(figures[key] > 0 for key in figures_read), figures
        # setup from the process's start, the first step from the job's (its inputs' checks, just after)
        assert max(figures["setup_seconds"], figures["first_step_seconds"]) < figures["wall_seconds"]
        assert figures["eager_because"] == "CUDA graphs need a CUDA device; the device is cpu"
        assert 0 <= figures["accuracy"] <= 1
        assert figures["kernels"] == backend and figures["step_mode"] == "eager" and figures["device"] == "cpu"
    # Triton's interpreter: one step; the reference: the whole epoch of 180 reviews in batches of 4
    assert details["triton"]["max_steps"] == details["triton_warm"]["steps"] == 1
    assert details["reference"]["max_steps"] is None and details["reference"]["steps"] == 45
    assert "\n" not in details["summary"] and details["summary"].startswith("CPU figures")
    assert "triton/reference" in details["summary"] and "smoke" in details["summary"]
    left = [p.name for p in scratch(out).iterdir() if p.name.startswith(("gpu-check-job-", "fastformer-"))]
    assert left == [], left  # the jobs' temporary folders gone (the output folder: the test above)


@CPU_ONLY
def test_smoke_report_and_targets(smoke):
    """Every provider of every kind of case the GPU runs is a row: measured, or skipped with its
    reason; on a CPU, the targets keep their ratios and withhold the verdicts."""
    _, _, doc = smoke
    report = doc["report"]
    assert set(report) == {"env", "results", "skipped", "failed"} and not report["failed"]
    assert all(RECORD_KEYS <= set(r) <= RECORD_KEYS | {"kernels"} for r in report["results"])
    rows = {(r["bench"], r["provider"]) for r in report["results"] + report["skipped"]}
    quick = {(c.bench, c.provider) for c in bench_cases("quick", "cpu")}
    assert quick <= rows  # the smoke cases are the quick list's kinds on tiny shapes
    assert {p for b, p in rows if b == "model_train"} == set(cases.MODEL_PROVIDERS)
    assert {p for b, p in rows if b == "model_infer"} == set(cases.MODEL_PROVIDERS) - set(cases.TRAIN_ONLY)
    assert all(s["reason"] for s in report["skipped"])
    reasons = {s["provider"]: s["reason"] for s in report["skipped"] if s["bench"] == "attention_fwd"}
    assert reasons["sdpa_cudnn"].startswith("sdpa_cudnn: SDPA's CUDNN_ATTENTION does not run this case: ")
    sdpa = [r for r in report["results"] if r["provider"] == "sdpa"]
    assert sdpa and all(r["params"]["sdpa_backend"] for r in sdpa)  # the backend that ran, from the profiler
    kernels = [r for r in report["results"] if r["timing"] == "device"]
    assert kernels and all(r["graph_ms"] is None and r["graph_note"].startswith("needs CUDA") for r in kernels)
    assert all(r["reps"] == SMOKE.reps.kernel and r["p20_ms"] <= r["ms"] <= r["p80_ms"] for r in kernels)
    assert len(doc["targets"]) == len(TARGETS) and all(t["met"] is None for t in doc["targets"])
    assert all(t["verdict"] == "not judged (CPU)" for t in doc["targets"])
    assert doc["targets_note"].startswith("not judged")
    call = next(t for t in doc["targets"] if t["target"].startswith("attention_model_call fwd_bwd"))
    assert call["cases"] == 1 and call["worst"] > 0  # the ratio is kept, only the verdict is withheld


@CPU_ONLY
def test_smoke_summary_and_log(smoke):
    _, out, doc = smoke
    summary = (out / "summary.md").read_text()
    assert summary.startswith("# gpu_check on cpu (smoke)")
    for name, entry in doc["stages"].items():
        assert f"| {name} | {entry['status']} | " in summary
    assert "| attention_model_call fwd_bwd (padding, dropout 0.1): vs the fastest SDPA | >= 1.50x |" in summary
    assert "not judged (CPU)" in summary
    assert "## Benchmarks" in summary and "| model_train | B=2" in summary
    log = (out / "log.txt").read_text()
    assert "=== determinism: passed" in log
    assert "SKIPPED" in log  # the pytest run's own output, streamed
    table = smoke[0].stdout[smoke[0].stdout.index("stage        status") :]  # the table printed at the end
    assert table in log and "not judged (CPU)" in table
    assert all(f"\n{name:<12} {entry['status']:<8} " in "\n" + table for name, entry in doc["stages"].items())


@CPU_ONLY
def test_bench_report_renders_the_results_for_committing(smoke, tmp_path):
    """The GPU check's commit step (docs/benchmarks.md): `python -m bench.report --from results.json`
    writes the report's files from the records measured, with no GPU; a second file's duplicate
    records are dropped."""
    results = str(smoke[1] / "results.json")

    def report(*args):
        return subprocess.run([sys.executable, "-m", "bench.report", *args], cwd=ROOT, capture_output=True, text=True)

    done = report("--from", results, results, "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    saved = json.loads((tmp_path / "cpu.json").read_text())
    assert saved["results"] == smoke[2]["report"]["results"]
    assert {"cpu.md", "cpu-model.png", "cpu-attention_fwd_d16.png"} <= {p.name for p in tmp_path.iterdir()}
    refused = report("--from", str(smoke[1] / "log.txt"), "--out", str(tmp_path))
    assert refused.returncode == 2 and "log.txt is not JSON" in refused.stderr


def _recorders(monkeypatch, calls):
    for name in STAGES:

        def stage(run, name=name):
            calls.append(name)
            return {"summary": f"{name} ran"}

        monkeypatch.setitem(STAGE_FUNCTIONS, name, stage)


def test_every_stage_is_reachable_alone_and_stages_run_in_order(tmp_path, monkeypatch):
    calls = []
    _recorders(monkeypatch, calls)
    for name in STAGES:
        calls.clear()
        assert main(["--smoke", "--out", str(tmp_path / name), "--stage", name]) == 0
        assert calls == [name]
        doc = json.loads((tmp_path / name / "results.json").read_text())
        assert list(doc["stages"]) == [name] and doc["stages"][name]["details"] == {"summary": f"{name} ran"}
    calls.clear()
    assert main(["--smoke", "--out", str(tmp_path / "two"), "--stage", "model, env"]) == 0
    assert calls == ["env", "model"]


def test_a_failing_stage_is_recorded_with_its_traceback_and_the_run_goes_on(tmp_path, monkeypatch):
    seen = {}

    def planted_failure(run):
        raise RuntimeError("planted failure")

    def compile_reads_the_partial_results(run):
        seen.update(json.loads((tmp_path / "results.json").read_text())["stages"])
        return {"summary": "ran after the failure"}

    monkeypatch.setitem(STAGE_FUNCTIONS, "env", planted_failure)
    monkeypatch.setitem(STAGE_FUNCTIONS, "compile", compile_reads_the_partial_results)
    assert main(["--smoke", "--out", str(tmp_path), "--stage", "env,compile"]) == 1
    assert seen["env"]["status"] == "failed" and seen["compile"]["status"] == "running"  # written as it went
    doc = json.loads((tmp_path / "results.json").read_text())
    env = doc["stages"]["env"]
    assert env["status"] == "failed" and env["error"] == "RuntimeError: planted failure"
    assert "in planted_failure" in env["traceback"] and env["traceback"].rstrip().endswith(
        "RuntimeError: planted failure"
    )
    assert doc["stages"]["compile"]["status"] == "passed"
    assert "in planted_failure" in (tmp_path / "summary.md").read_text()
    assert "in planted_failure" in (tmp_path / "log.txt").read_text()


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--stage", "env,nope"], ["'nope'", *STAGES]),
        (["--stage", " , "], ["no stage given", *STAGES]),
        (["--quick", "--smoke"], ["not allowed"]),
        (["--frobnicate"], ["unrecognized arguments: --frobnicate"]),
    ],
)
def test_a_bad_command_line_exits_2_with_one_line(tmp_path, capsys, argv, words):
    out = tmp_path / "out"
    assert main(["--out", str(out), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gpu_check: ") and err.count("\n") == 1, err
    assert all(w in err for w in words), err
    assert not out.exists()


def test_out_is_required(capsys):
    assert main(["--smoke"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--out" in err


@CPU_ONLY
def test_without_cuda_a_full_run_fails_env_and_skips_the_rest(tmp_path):
    assert main(["--full", "--out", str(tmp_path), "--stage", "env,bench"]) == 1
    doc = json.loads((tmp_path / "results.json").read_text())
    assert doc["stages"]["env"]["status"] == "failed"
    assert doc["stages"]["env"]["error"].startswith("Failed: no CUDA device")
    assert doc["stages"]["bench"]["status"] == "skipped" and doc["stages"]["bench"]["reason"].startswith("needs CUDA")


def test_the_commit_says_when_the_tree_is_not_the_commit(tmp_path):
    def git(*args):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path, check=True)

    assert git_commit(tmp_path) is None  # no history
    git("init", "-q")
    (tmp_path / "a.py").write_text("1\n")
    git("add", "a.py")
    git("commit", "-q", "-m", "one")
    head = output(["git", "rev-parse", "HEAD"], tmp_path)
    assert git_commit(tmp_path) == head
    (tmp_path / "a.py").write_text("2\n")
    assert git_commit(tmp_path) == f"{head} + 1 paths changed"


def test_first_mismatch_names_the_tensor_the_index_and_both_values():
    a = {"out": torch.zeros(2, 3), "dq": torch.arange(6.0).view(2, 3)}
    b = {"out": torch.zeros(2, 3), "dq": torch.arange(6.0).view(2, 3)}
    assert first_mismatch(a, b) is None
    b["dq"][1, 2] = 5.5
    assert first_mismatch(a, b) == {"tensor": "dq", "index": [1, 2], "first": 5.0, "second": 5.5}
    nan = {"x": torch.tensor([math.nan], dtype=torch.bfloat16)}
    assert first_mismatch(nan, {"x": nan["x"].clone()}) is None  # bits, not ==
    signed = first_mismatch({"x": torch.tensor([0.0])}, {"x": torch.tensor([-0.0])})
    assert signed["index"] == [0]  # equal as numbers, not bitwise
    assert first_mismatch({"x": torch.zeros(2)}, {"x": torch.zeros(3)})["index"] is None


def test_kernel_rows_sum_each_device_kernel_by_name_per_call_of_the_case():
    """On CUDA a kernel's row is the durations of its launches on the device; the CPU operators the
    profiler records beside them are not counted (the smoke run covers the CPU's rows)."""
    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import FunctionEvent

    def event(name, device_type, start, end):
        kwargs = dict(id=0, name=name, thread=0, start_us=start, end_us=end)
        return FunctionEvent(**kwargs, device_type=device_type, use_device="cuda" if device_type else None)

    events = [
        event("gemm", DeviceType.CUDA, 0, 30),
        event("aten::mm", DeviceType.CPU, 0, 500),  # the launch on the host: not a kernel
        event("gelu", DeviceType.CUDA, 30, 40),
        event("gemm", DeviceType.CUDA, 40, 60),
        event("gemm", DeviceType.CUDA, 100, 130),
        event("gelu", DeviceType.CUDA, 130, 140),
        event("gemm", DeviceType.CUDA, 140, 160),
    ]
    rows = kernel_rows(events, DeviceType.CUDA, calls=2)
    assert rows == [
        {"kernel": "every kernel of the case", "calls_per_run": 3.0, "us_per_run": 60.0, "share": 1.0},
        {"kernel": "gemm", "calls_per_run": 2.0, "us_per_run": 50.0, "share": 0.833},
        {"kernel": "gelu", "calls_per_run": 1.0, "us_per_run": 10.0, "share": 0.167},
    ]


def test_graph_breaks_are_reported_by_reason_and_place():
    def breaks_once(x):
        y = x * 2
        torch._dynamo.graph_break()
        return y + 1

    line = inspect.getsourcelines(breaks_once)[1] + 2
    assert graph_breaks(breaks_once, torch.randn(3)) == [
        {"reason": "Call to `torch._dynamo.graph_break()`", "where": f"tests/test_gpu_check.py:{line}"}
    ]
    assert graph_breaks(lambda x: x + 1, torch.randn(3)) == []


def test_junit_counts(tmp_path):
    path = tmp_path / "junit.xml"
    path.write_text(
        '<?xml version="1.0" encoding="utf-8"?><testsuites>'
        '<testsuite tests="4" failures="1" errors="1" skipped="1" time="2.5">'
        '<testcase classname="tests.test_a" name="test_ok" time="1"/>'
        '<testcase classname="tests.test_a" name="test_bad[bf16]" time="1">'
        '<failure message="AssertionError: dq off&#10;more">'
        "trace</failure></testcase>"
        '<testcase classname="tests.test_a" name="test_setup" time="0.5">'
        '<error message="fixture failed">trace</error></testcase>'
        '<testcase classname="tests.test_b" name="test_gpu" time="0"><skipped message="needs a CUDA GPU"/></testcase>'
        "</testsuite></testsuites>"
    )
    assert junit_counts(path) == {
        "tests": 4,
        "passed": 1,
        "failed": 1,
        "errors": 1,
        "skipped": 1,
        "seconds": 2.5,
        "failures": [
            "tests.test_a::test_bad[bf16] (failure): AssertionError: dq off",
            "tests.test_a::test_setup (error): fixture failed",
        ],
        "skip_reasons": {"needs a CUDA GPU": 1},
    }


def test_model_flops_by_hand():
    config = fastformer.Config.tutorial(**TINY)  # d 32, heads 2 x 16, d_ff 64, 1 layer
    # one review of 3 real tokens, decoder [BOS]:
    # encoder 2*3*(4*32*32 + 2*32*64) + 4*9*32 = 50304
    # decoder 2*1*(6*32*32 + 2*32*64) + 2*3*2*32*32 + 2*1*1*32 + 4*1*3*32 = 33216; classifier 2*32*2 = 128
    assert model_flops(config, [3], [1], "infer") == 50304 + 33216 + 128
    assert model_flops(config, [3, 3], [1, 1], "train") == 6 * (50304 + 33216 + 128)


def test_the_model_stage_measures_its_plans_providers_in_order():
    """Each provider's train step then its inference (none for a way of stepping the optimizer), in
    the plan's order: the ones the targets read first, so that a spent budget leaves out the rest."""
    from types import SimpleNamespace

    assert sorted(MODEL_ORDER) == sorted(cases.MODEL_PROVIDERS)
    for plan in (SMOKE, QUICK, FULL):
        stub = SimpleNamespace(plan=plan, cuda=False, device=torch.device("cpu"))
        measured = [(c.bench, c.provider) for c in model_cases(stub)]
        assert measured == [
            (f"model_{kind}", p)
            for p in plan.model_providers
            for kind in ("train", "infer")
            if kind == "train" or p not in cases.TRAIN_ONLY
        ]
    assert "fastformer_autotune" not in QUICK.model_providers  # every kernel config timed: a full run's
    assert FULL.model_batch == 128  # bench/test_report.py: 128 reviews pad to a bucket length


def test_the_parts_of_the_one_run_cover_every_stage_and_each_fits_its_budget():
    """A lease is one command (tools/gpu_run.sh stops it at 570 s, the device tool at 600): each
    plan one_run can take adds up to ONE_SECONDS, and together they run every stage."""
    assert set(QUICK.stages) | set(REST.stages) | set(SWEEP_FIRST.stages) == set(STAGES)
    assert set(QUICK.stages) & set(REST.stages) == {"env", "tests"} and QUICK.tests != REST.tests
    for plan in (QUICK, REST, SWEEP_FIRST):
        assert sum(plan.budget_seconds[s] for s in plan.stages) == ONE_SECONDS
        assert plan.stages[0] == "env" and set(plan.budget_seconds) == set(plan.stages)
    assert SWEEP_FIRST.stages[:2] == ("env", "sweep") and SWEEP_FIRST.stages[-1] == "tests"  # the sweep first
    assert set(FULL.stages) == set(STAGES) == set(SMOKE.stages)


def test_the_one_runs_kernel_and_model_stages_measure_both_sides_of_every_target():
    """What decides comes in the one run's kernel and model stages: for each target, its provider
    and a peer (or its fallback's) in the quick bench list or the quick model stage's providers, in
    a case it reads."""
    quick = bench_cases("quick", "cpu")
    for target in TARGETS:
        if target.bench.startswith("model_"):
            assert targets.providers_needed(target) <= set(QUICK.model_providers), target.name
            continue
        read = {c.provider for c in quick if c.bench == target.bench and target.select(c.params)}
        assert target.ours in read, target.name
        assert not target.peers or set(target.peers) & read, target.name
        if target.fallback:
            assert set(target.fallback.peers) & read, target.name
    first = [c.provider for c in quick[:12]]  # the causal targets' cases lead the list
    assert first[:5] == ["fastformer", "sdpa", "sdpa_cudnn", "sdpa_flash", "sdpa_efficient"]


def test_copy_bandwidth_is_measured_on_any_device():
    assert copy_gbps("cpu", 2**16, rep=2, inner=2) > 0


def test_pytest_is_interrupted_at_the_budget():
    command = [sys.executable, "-c", "import time; print('started', flush=True); time.sleep(60)"]
    returncode, timed_out = stream(command, timeout=1)
    assert timed_out and returncode != 0
