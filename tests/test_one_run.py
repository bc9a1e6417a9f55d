"""The one run of a GPU lease, `bash tools/gpu_run.sh` with no argument, rehearsed on a CPU: the
plan it reads from the repository (a sweep committed or not, the last committed run), the sweep
stage's winners put in force, and the whole run under the dry-run driver and the interpreter,
whole and interrupted at three points (the sweep's compiles, the bench stage's timing, the model
stage), each leaving valid files, at most 7 of them, and the summary's lines in the output's tail
(the device tool brings back its last 12,000 characters even when no file comes back).
The whole run and the interrupt during the sweep's compiles are marked `versions`: CI's oldest lane
(the GPU machines' torch 2.11 and Triton 3.6) runs them too, as they compile through Triton; the
plans and the other interrupts are Python of this repository's alone."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tools import sweep as sweep_tool
from tools.gpu_check import plan as plans
from tools.gpu_check import sweep as sweep_stage
from tools.gpu_check.run import OUTPUTS, table_sha

ROOT = Path(__file__).resolve().parent.parent
TAIL = 12_000  # characters of the output the device tool returns
GPU = "NVIDIA H200"


# ----------------------------------------------------------------------------------------------
# the plan, from what a made-up repository holds
# ----------------------------------------------------------------------------------------------
def _sweep_report(gpu=GPU, dry_run=False):
    return {"schema": sweep_tool.SCHEMA, "env": {"gpu": gpu}, "dry_run": dry_run}


def _run_document(gpu, started, stages, sha):
    return {
        "env": {"gpu": gpu, "tuned": {"sha256": sha}},
        "started": started,
        "stages": {
            name: {"status": status, "details": {"selection": selection} if name == "tests" else {}}
            for name, (status, selection) in stages.items()
        },
    }


def _repo(tmp_path, sweep=None, table=None, runs=()):
    """A folder laid out as the repository's committed results."""
    (tmp_path / "tools" / "results").mkdir(parents=True)
    (tmp_path / "kernels" / "tuned").mkdir(parents=True)
    if sweep is not None:
        (tmp_path / "tools" / "results" / "sweep-h200.json").write_text(json.dumps(sweep))
    if table is not None:
        (tmp_path / "kernels" / "tuned" / "h200.json").write_text(json.dumps(table))
    for name, document in runs:
        folder = tmp_path / "bench" / "results" / "gpu" / name
        folder.mkdir(parents=True)
        (folder / "results.json").write_text(json.dumps(document))
    return tmp_path


TABLE = {"schema": "fastformer.tuned/1", "gpu": GPU, "launches": []}
MEASURED = {"env": ("passed", None), "bench": ("passed", None), "model": ("failed", None), "tests": ("passed", "quick")}
REST_REACHED = {
    **MEASURED,
    "tests": ("passed", "rest"),
    "compile": ("passed", None),
    "determinism": ("passed", None),
    "job": ("failed", None),
}


def test_without_a_committed_sweep_the_sweep_comes_first(tmp_path):
    # a dry run's report and another GPU's do not count
    repo = _repo(tmp_path, sweep=_sweep_report(dry_run=True))
    plan = plans.one_run(GPU, True, repo)
    assert plan.stages == ("env", "sweep", "bench", "model", "tests") and plan.tests == "quick"
    assert "no whole sweep committed for NVIDIA H200" in plan.why[0]
    assert sum(plan.budget_seconds[s] for s in plan.stages) == plans.ONE_SECONDS
    assert plan.plots == 0 and plan.sweep == plans.FULL.sweep  # every family, timed
    assert (
        plans.one_run("NVIDIA H100 80GB HBM3", True, _repo(tmp_path / "b", sweep=_sweep_report())).stages[1] == "sweep"
    )


def test_a_sweep_cut_short_is_swept_again(tmp_path):
    """A committed sweep that a stop cut short (interrupted, or launches it did not reach) leaves
    families untimed: the next run sweeps first again."""
    for i, cut in enumerate(({"interrupted": True}, {"records": [{"status": "timed"}, {"status": "not timed"}]})):
        repo = _repo(tmp_path / str(i), sweep={**_sweep_report(), **cut}, table=TABLE)
        assert plans.one_run(GPU, True, repo).stages[1] == "sweep", cut


def test_with_a_sweep_committed_the_kernel_and_model_stages_on_its_table(tmp_path):
    old = _run_document(GPU, "2026-11-28T10:00:00+00:00", MEASURED, sha=None)  # before any table
    repo = _repo(tmp_path, sweep=_sweep_report(), table=TABLE, runs=[("h200-2026-11-28", old)])
    plan = plans.one_run(GPU, True, repo)
    assert plan.stages == ("env", "bench", "model", "tests") and plan.tests == "quick"
    assert "the last committed run (h200-2026-11-28) did not" in plan.why[0]


def test_once_measured_on_the_table_the_rest_then_the_kernels_again(tmp_path):
    sha = table_sha(TABLE)
    measured = _run_document(GPU, "2026-12-03T10:00:00+00:00", MEASURED, sha)
    older = _run_document(GPU, "2026-12-01T10:00:00+00:00", {}, sha)
    elsewhere = _run_document("NVIDIA H100 80GB HBM3", "2026-12-04T10:00:00+00:00", REST_REACHED, sha)
    runs = [("h200-2026-12-03", measured), ("h200-2026-12-01", older), ("h100-2026-12-04", elsewhere)]
    plan = plans.one_run(GPU, True, _repo(tmp_path / "a", sweep=_sweep_report(), table=TABLE, runs=runs))
    assert plan.stages == plans.REST.stages and plan.tests == "rest"
    assert "(h200-2026-12-03) measured the kernel and model stages" in plan.why[0]
    done = _run_document(GPU, "2026-12-05T10:00:00+00:00", REST_REACHED, sha)
    plan = plans.one_run(GPU, True, _repo(tmp_path / "b", sweep=_sweep_report(), table=TABLE, runs=[("h200-x", done)]))
    assert plan.stages == plans.QUICK.stages and "reached every stage" in plan.why[0]


def test_on_a_cpu_the_one_run_is_its_rehearsal_and_its_budgets_scale():
    plan = plans.one_run("cpu", False, seconds=54)
    assert plan.stages == plans.SWEEP_FIRST.stages and plan.tiny and plan.sweep.dry_run
    assert plan.bench == "smoke" and plan.plots == 0
    assert sum(plan.budget_seconds[s] for s in plan.stages) == pytest.approx(54)
    assert plan.budget_seconds["sweep"] == pytest.approx(24)


def test_the_one_run_keeps_room_for_a_stray_file():
    """The device tool brings back 8 files: the one run writes at most 6 (no plots), so a temporary
    file a kill leaves behind still costs no result."""
    assert len(OUTPUTS) <= 6
    assert plans.one_run("cpu", False).plots == 0


# ----------------------------------------------------------------------------------------------
# the sweep stage: its report read, its winners in force
# ----------------------------------------------------------------------------------------------
def _timed(pass_name, variant, config, pick, median, spread, family="attention causal L4096"):
    meta = {"BLOCK_M": 128, "BLOCK_N": 128 if config == "big" else 64}
    kernels = {"forward": "attention forward", "dQ": "attention dQ"}
    return sweep_tool.Record(
        family, pass_name, variant, config, pick, "timed", median, median - spread, median + spread, 20, 1.0,
        kernel=kernels[pass_name], key={"HEAD_DIM": 64, "LQ_BUCKET": 4096}, dtype="torch.bfloat16", meta=meta,
        num_warps=8, num_stages=3,
    )  # fmt: skip


def test_the_sweep_stage_puts_its_winners_in_force_for_the_rest_of_the_run(tmp_path, monkeypatch):
    from fastformer.kernels import _tuned

    monkeypatch.delenv(_tuned.ENV_VAR, raising=False)
    records = [
        _timed("forward", "pointer", "small", True, 1.0, 0.02),
        _timed("forward", "tma", "big", False, 0.8, 0.02),  # 1.25x [1.18, 1.32]: adopted
        _timed("dQ", "pointer", "small", True, 1.0, 0.05),
        _timed("dQ", "tma", "small", False, 0.97, 0.05),  # within noise: the rule's pick stays
    ]
    report = {
        "schema": sweep_tool.SCHEMA,
        "env": {"gpu": GPU, "date": "d", "commit": "c", "torch": "t", "triton": "3.6"},
        "dry_run": False,
        "interrupted": False,
        "seconds": 12.0,
        "families": ["attention causal L4096"],
        "records": [vars(r) for r in records],
        "best": sweep_tool.best_per_pass(records),
    }
    (tmp_path / "sweep.json").write_text(json.dumps(report))
    run = SimpleNamespace(out=str(tmp_path), env={"gpu": GPU})
    details = sweep_stage.read(run)
    try:
        assert details["timed"] == 4 and details["errors"] == 0 and not details["interrupted"]
        assert details["adopted"][0] == f"tuned table for {GPU}: 1 of the sweep's passes take its winner"
        assert "attention causal L4096 forward: tma BLOCK_M=128 BLOCK_N=128 w8 s3, 1.25x" in details["adopted"][1]
        table = _tuned.tuned_choice()  # FASTFORMER_TUNED names the table: this process and its pytest read it
        assert isinstance(table, _tuned.Table) and table.gpu == GPU and len(table) == 1
        assert run.env["tuned"]["launches"] == 1 and run.env["tuned"]["sha256"] == table_sha(table.document)
        assert details["summary"].startswith("4 launches in 1 family: 4 timed; tuned table for NVIDIA H200: 1 of")
    finally:
        os.remove(os.environ.pop(_tuned.ENV_VAR))


def test_a_dry_run_sweep_puts_nothing_in_force_and_its_command_line_follows_the_plan(tmp_path, monkeypatch):
    from fastformer.kernels import _tuned

    monkeypatch.delenv(_tuned.ENV_VAR, raising=False)
    run = SimpleNamespace(out=str(tmp_path), env={"gpu": "cpu"}, plan=plans.SMOKE)
    line = sweep_stage.command(run, 42.4)
    assert line[1:] == [
        "-m", "tools.sweep", "--out", str(tmp_path), "--budget", "42", "--reps", "2", "--quick", "--dry-run",
        "--family", "gemm ffn M8192",
    ]  # fmt: skip
    assert sweep_stage.read(run) == {}  # no sweep.json yet
    report = {**_sweep_report("dry-run sm_90a (no GPU)", True), "interrupted": True, "seconds": 1.0}
    report.update(families=["gemm ffn M8192"], records=[], best=[])
    (tmp_path / "sweep.json").write_text(json.dumps(report))
    details = sweep_stage.read(run)
    assert details["interrupted"] and details["adopted"] == [
        "a dry run: nothing timed, the written rules stay in force"
    ]
    assert _tuned.ENV_VAR not in os.environ


# ----------------------------------------------------------------------------------------------
# the run itself, on this CPU: whole, and interrupted at three points
# ----------------------------------------------------------------------------------------------
def _children(pid):
    """The pids whose parent is `pid` (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def one_run(tmp_path, interrupt_at=None, args=()):
    """`bash tools/gpu_run.sh` with no argument but `args`, as the GPU machine runs it. With
    interrupt_at, once a line of the output starts with it, SIGINT goes to the script's `timeout`,
    which passes it to the process group of the run, as at its limit. Returns (returncode, output,
    out folder, seconds from the interrupt to the end)."""
    out = tmp_path / "out"
    env = dict(os.environ, PYTHON=sys.executable, OUT=str(out), TMPDIR=str(tmp_path), GPU_CARRY=str(tmp_path / "none"))
    env.pop("TRITON_INTERPRET", None)  # gpu_check sets it for itself on a CPU; the sweep compiles without it
    process = subprocess.Popen(
        ["bash", "tools/gpu_run.sh", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines, sent = [], []
    watchdog = threading.Timer(900, process.kill)
    watchdog.start()
    try:
        for line in process.stdout:
            lines.append(line)
            if interrupt_at and not sent and line.startswith(interrupt_at):
                timeouts = [
                    p for p in _children(process.pid) if Path(f"/proc/{p}/comm").read_text().strip() == "timeout"
                ]
                assert timeouts, "gpu_run.sh runs the command under timeout"
                os.kill(timeouts[0], signal.SIGINT)
                sent.append(time.monotonic())
        returncode = process.wait()
    finally:
        watchdog.cancel()
    if interrupt_at:
        assert sent, f"no line started with {interrupt_at!r}:\n" + "".join(lines)[-3000:]
    return returncode, "".join(lines), out, (time.monotonic() - sent[0]) if sent else None


def _files(out):
    names = sorted(p.name for p in out.iterdir())
    assert len(names) <= 7 and not [n for n in names if n.endswith(".tmp")], names
    return names


def _document(out):
    document = json.loads((out / "results.json").read_text())
    assert document["mode"] == "one" and document["plan"][0].startswith("no CUDA device: the rehearsal")
    return document


def _tail_has_the_summary(output, stages):
    tail = output[-TAIL:]
    assert "plan: no CUDA device: the rehearsal of the one run" in tail
    for name, status in stages.items():
        assert any(line.startswith(f"{name:<12} {status:<8}") for line in tail.splitlines()), (name, status, tail)
    assert "target" in tail and "torch.cuda.is_available(): " in tail.split("== done:")[1]  # the versions last


@pytest.mark.versions
def test_the_whole_run_on_a_cpu(tmp_path):
    returncode, output, out, _ = one_run(tmp_path)
    assert returncode == 0, output[-5000:]
    head = output.split("== tools.gpu_check --one, stopped after ", 1)[1]
    assert head.splitlines()[2].startswith("plan: no CUDA device")  # what it runs and why, first
    assert _files(out) == sorted(OUTPUTS)  # 6 files, no plots
    document = _document(out)
    statuses = {name: entry["status"] for name, entry in document["stages"].items()}
    assert statuses == {"env": "passed", "sweep": "passed", "bench": "passed", "model": "passed", "tests": "skipped"}
    sweep = json.loads((out / "sweep.json").read_text())
    assert sweep["dry_run"] and not sweep["interrupted"] and {r["status"] for r in sweep["records"]} == {"compiled"}
    assert document["stages"]["sweep"]["details"]["compiled"] == len(sweep["records"])
    _tail_has_the_summary(output, {**statuses, "tests": "skipped"})
    assert "sweep: gemm ffn M8192: forward compiled" in output[-TAIL:]


@pytest.mark.parametrize(
    "at, stopped, before",
    [
        pytest.param("sweep: gemm ffn M8192: compiling", "sweep", ["env"], marks=pytest.mark.versions),  # compiles
        ("[bench 3/", "bench", ["env", "sweep"]),  # while the kernel cases are timed
        ("[model 2/", "model", ["env", "sweep", "bench"]),  # during the model stage
    ],
)
def test_an_interrupt_leaves_valid_files_and_the_summary(tmp_path, at, stopped, before):
    returncode, output, out, after = one_run(tmp_path, interrupt_at=at)
    assert after < 30, f"{after:.0f} s from the interrupt to the end"  # inside gpu_run.sh's 15-s kill and a margin
    names = _files(out)
    assert {"results.json", "summary.md", "log.txt", "sweep.json", "sweep.md"} <= set(names)
    document = _document(out)
    statuses = {name: entry["status"] for name, entry in document["stages"].items()}
    assert statuses[stopped] == "interrupted" and all(statuses[s] == "passed" for s in before), statuses
    assert document["finished"] is None and "**not finished**" in (out / "summary.md").read_text()
    sweep = json.loads((out / "sweep.json").read_text())
    assert sweep["interrupted"] == (stopped == "sweep")
    if stopped == "sweep":  # what the interrupted sweep wrote is in the stage's details
        assert {r["status"] for r in sweep["records"]} == {"not timed"}
        assert document["stages"]["sweep"]["details"]["interrupted"]
    else:  # the cases it reached before the interrupt are in the report, measured or skipped with the reason
        report = document["report"]
        reached = [
            r for r in report["results"] + report["skipped"] if r["bench"].startswith("model_") == (stopped == "model")
        ]
        assert reached, report
    _tail_has_the_summary(output, statuses)
    assert f"gpu_check: interrupted in the {stopped} stage" in output[-TAIL:]
    assert returncode == 130 and "Traceback" not in output.split(f"=== {stopped} ===")[1]
