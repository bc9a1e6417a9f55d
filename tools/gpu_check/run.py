"""The run: one invocation's mode, plan and device, each stage's entry, the measured records, and
the files it keeps in DIR (results.json and summary.md rewritten atomically as it goes). Also what
several stages share: running a stage, measuring benchmark cases within a budget, a subprocess
stopped at its budget, and an error's one-line text."""

import datetime
import hashlib
import json
import os
import signal
import subprocess
import threading
import time

import torch

from bench import reporting as bench_report
from bench.common import environment, gemm_tflops
from bench.targets import evaluate_targets
from tools.gpu_check.report import summary_markdown

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCHEMA = "fastformer.gpu_check/1"
# every file the command writes into DIR: six, and no plots in the one run, so that a stray temporary
# file a kill leaves (or two) still keeps DIR within the device tool's 8 files
OUTPUTS = ("summary.md", "results.json", "log.txt", "junit.xml", "sweep.json", "sweep.md")
PLOT_PREFIX = "plot"
INTERRUPT_GRACE_SECONDS = 10  # a subprocess interrupted with the run: the time it has to write its files
UNITS = {
    "seconds, *_seconds": "seconds of wall time",
    "ms, *_ms": (
        "milliseconds per call: the median of the timed calls, and p20_ms / p80_ms their 20th and 80th "
        "percentiles; a kernel case's ms is device time as called (CUDA events, L2 flushed), graph_ms the "
        "same replayed from a CUDA graph; a step's ms is wall time (bench.timing)"
    ),
    "flops": "floating-point operations of one call, a multiply-add counting 2 (bench.common)",
    "tflops, *_tflops": "TFLOP/s: 1e12 floating-point operations per second, a multiply-add counting 2",
    "*_gbps": "GB/s: 1e9 bytes per second; a copy counts the bytes read and the bytes written",
    "*_gib": "GiB (2**30 bytes)",
    "peak_mem_mb": (
        "MiB (2**20 bytes) of CUDA memory allocated at the peak of a call, above what was allocated before it"
    ),
    "resident_mb": (
        "MiB of CUDA memory allocated and held once a case is set up and has run once (inputs, weights, "
        "optimizer state, a CUDA graph's pool)"
    ),
    "*_mb": "MiB (2**20 bytes); the model stage's memory_phases: allocated at a phase's peak above the step's start",
    "tokens_per_s": "real (non-padding) tokens per second",
    "mfu": "achieved TFLOP/s over env.bf16_gemm_tflops (a fraction)",
    "required, worst, low, high": (
        "a target's requirement, its worst case's figure and the interval the two spreads (p20-p80) allow: "
        "a speed-up (the peer's time over fastformer's), TFLOP/s (kind tflops), or fastformer's peak memory "
        "over the peer's (kind memory)"
    ),
    "max_abs_diff, tolerance": "absolute difference of logits",
    "dropout": "a probability",
    "accuracy": "the fraction of the test reviews classified right (0 to 1)",
    "*_loss, *_loss_diff, loss_atol, loss_tolerance": "cross-entropy in nats (a step's mean over its batch)",
    "lr": "AdamW learning rate",
    "calls_per_step, own_ms_per_step, cum_ms_per_step": (
        "the model stage's host profile, per eager train step under cProfile: a function's calls, the "
        "milliseconds in its own code, and in it with what it calls"
    ),
    "us_per_call": "the model stage's host_calls: microseconds of the host per call, enqueued back to back",
    "calls_per_run, us_per_run, share": (
        "a kernel profile (the bench stage's kernel_profile, the model stage's step_kernels), per call of a "
        "case: a kernel's launches, its microseconds on the device (on a CPU, an operator's own CPU time), and "
        "its fraction of the case's total"
    ),
}
CPU_TARGETS = "not judged: a CPU run (the targets are GPU targets; CPU ratios say nothing of them)"
NOT_JUDGED = "not judged (CPU)"


class Skipped(Exception):
    """A stage that cannot run here; the message is the reason ("needs CUDA: ...")."""

    def __init__(self, reason, details=None):
        super().__init__(reason)
        self.details = details or {}


class Failed(Exception):
    """A stage that ran and found a problem; `details` keeps what it measured."""

    def __init__(self, message, details=None):
        super().__init__(message)
        self.details = details or {}


def first_line(error):
    lines = str(error).strip().splitlines()
    return lines[0] if lines else ""


def error_text(error, limit=400):
    """An exception's first line, and Dynamo's "Explanation:" line when it has one (it names the
    op or construct that failed)."""
    lines = [line.strip() for line in str(error).strip().splitlines()]
    text = f"{type(error).__name__}: {lines[0] if lines else ''}"
    explanation = next((line for line in lines[1:] if line.startswith("Explanation:")), None)
    if explanation:
        text += f" ({explanation[:limit]})"
    return text


# ----------------------------------------------------------------------------------------------
# the run: its state, and its files
# ----------------------------------------------------------------------------------------------
class Run:
    """One invocation: its mode and plan, the device, each stage's entry, the measured records,
    and the writing of DIR."""

    def __init__(self, out, stages, mode, command, plan):
        self.out, self.mode, self.command, self.plan = out, mode, command, plan
        self.cuda = torch.cuda.is_available()
        self.device = torch.device("cuda" if self.cuda else "cpu")
        # bf16 autocast on a GPU; fp32 on a CPU, where Triton's interpreter as shipped computes bf16 dots wrongly
        self.amp = "bf16" if self.cuda else "off"
        self.env = dict(environment(self.device), bf16_gemm_tflops=None, d2d_copy_gbps=None)
        self.env["tuned"] = tuned_in_force(self.env["gpu"] if self.cuda else None)
        self.started = now()
        self.finished = None
        self.stages = {name: stage_entry("pending") for name in stages}
        self.reports = {}  # stage -> bench.report-schema report of its records
        self.plots = []
        self._plotted = None
        self.clock = None  # time.monotonic() at the start of the first stage: the plan's budgets count from it
        self.interrupted = False  # a KeyboardInterrupt stopped the run
        self.stage_started = None  # time.monotonic() at the start of the stage running

    def deadline(self, stage):
        """When `stage` must end: the run's clock plus its budget and those of the stages before it
        in the run (tools.gpu_check.plan: time an early stage leaves goes to the later ones)."""
        order = list(self.stages)
        spent = sum(self.plan.budget_seconds[s] for s in order[: order.index(stage) + 1])
        return (self.clock if self.clock is not None else self.stage_started) + spent

    def seconds_left(self, stage):
        """The seconds `stage` has from now (at least 1)."""
        return max(1.0, self.deadline(stage) - time.monotonic())

    def gemm_rate(self):
        """The bf16 GEMM TFLOP/s of this run (the MFU denominator): env's, else measured now; None on a CPU."""
        if self.env["bf16_gemm_tflops"] is None and self.cuda:
            self.env["bf16_gemm_tflops"] = gemm_tflops(self.device)
        return self.env["bf16_gemm_tflops"]

    def report(self):
        """The bench and model stages' records as one bench.report report (model's first)."""
        parts = [self.reports[s] for s in ("model", "bench") if s in self.reports]
        merged = bench_report.merge(parts) if parts else {"results": [], "skipped": [], "failed": []}
        return dict(merged, env=self.env)

    def targets(self):
        """The targets judged on this run's records (bench.targets); on a CPU, ratios
        only, judged nowhere (verdict "not judged (CPU)")."""
        targets = evaluate_targets(self.report()["results"])
        if not self.cuda:
            for target in targets:
                target.update(met=None, verdict=NOT_JUDGED)
        return targets

    def document(self):
        union = self.report()
        return {
            "schema": SCHEMA,
            "command": self.command,
            "mode": self.mode,
            "plan": list(self.plan.why),
            "device": self.device.type,
            "started": self.started,
            "finished": self.finished,
            "env": self.env,
            "units": UNITS,
            "stages": self.stages,
            "targets": self.targets(),
            "targets_note": None if self.cuda else CPU_TARGETS,
            "report": union,
            "plots": self.plots,
        }

    def write(self, plots=True):
        """results.json and summary.md (atomically), and the plots when their records changed."""
        document = self.document()
        if plots and self.plan.plots:
            self._write_plots(document["report"])
            document["plots"] = self.plots
        write_text(os.path.join(self.out, "results.json"), json.dumps(document, indent=1, default=str) + "\n")
        write_text(os.path.join(self.out, "summary.md"), summary_markdown(document))

    def _write_plots(self, union):
        """At most the plan's `plots` PNGs through bench.reporting.plot: model tokens/s, and attention
        TFLOP/s for the (bench, head dim) groups measured, head dim 64 first."""
        results = union["results"]
        if self._plotted == len(results):
            return
        sweeps = ("attention_fwd", "attention_fwd_bwd")  # the benches bench.reporting.plot draws
        groups = sorted(
            {(r["bench"], r["params"]["D"]) for r in results if r["bench"] in sweeps and r["tflops"]},
            key=lambda g: (g[1] != 64, g),
        )
        has_model = any(r["bench"].startswith("model") and r["tokens_per_s"] for r in results)
        keep = set(groups[: self.plan.plots - has_model])
        chosen = [r for r in results if r["bench"] not in sweeps or (r["bench"], r["params"]["D"]) in keep]
        staging = os.path.join(self.out, f".{PLOT_PREFIX}-tmp")
        try:
            written = bench_report.plot(dict(union, results=chosen), staging)
        except Exception as error:  # noqa: BLE001 (a plot is not worth the run; say why it is missing)
            print(f"gpu_check: plots not written: {type(error).__name__}: {error}", flush=True)
            return
        names = []
        for path in written:
            name = PLOT_PREFIX + os.path.basename(path)[len(os.path.basename(staging)) :]
            os.replace(path, os.path.join(self.out, name))
            names.append(name)
        for stale in set(self.plots) - set(names):
            os.remove(os.path.join(self.out, stale))
        self.plots, self._plotted = sorted(names), len(results)


def stage_entry(status):
    return {"status": status, "seconds": None, "reason": None, "error": None, "traceback": None, "details": {}}


def now():
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


def table_sha(table):
    """The sha256 of a tuned table's launches (kernels/_tuned.py): what a run measured with, by
    content, so a committed table made again from the same sweep has the same."""
    return hashlib.sha256(json.dumps(table["launches"], sort_keys=True).encode()).hexdigest()


def tuned_in_force(gpu):
    """What the run's launches read of a tuned table (kernels/_tuned.py), for results.json's
    env.tuned: {source, gpu, launches, sha256}; the sha None where the written rules alone run."""
    from fastformer.kernels import _tuned

    choice = _tuned.tuned_choice()
    if choice is False:
        return {"source": f"none ({_tuned.ENV_VAR}=0 or set_tuned(False))", "gpu": None, "launches": 0, "sha256": None}
    table = choice if choice is not None else _tuned.installed().get(gpu) if gpu else None
    if table is None:
        return {"source": "none: the written rules", "gpu": None, "launches": 0, "sha256": None}
    where = table.where
    if os.path.isabs(where) and os.path.commonpath([where, ROOT]) == ROOT:
        where = os.path.relpath(where, ROOT)
    return {"source": where, "gpu": table.gpu, "launches": len(table), "sha256": table_sha(table.document)}


def write_text(path, text):
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def clear_outputs(out):
    """Remove this command's files from an earlier run in DIR (temporary ones of a killed run
    included), so DIR describes this run only."""
    for name in os.listdir(out):
        plot = name.endswith(".png") and name.startswith((f"{PLOT_PREFIX}-", f".{PLOT_PREFIX}-tmp"))
        if name in OUTPUTS or plot or (name.endswith(".tmp") and name[:-4] in OUTPUTS):
            os.remove(os.path.join(out, name))


def release(run):
    """Drop compiled code and cached GPU memory between stages. After a CUDA fault this can fail
    too: say so, and let the next stage report what still works."""
    try:
        torch._dynamo.reset()
        if run.cuda:
            torch.cuda.empty_cache()
    except Exception as error:  # noqa: BLE001
        print(f"gpu_check: cleaning up after the stage failed: {type(error).__name__}: {error}", flush=True)


def stream(command, timeout, on_line=None, env=None):
    """Run command from the repository root, echoing its output as it comes (into log.txt too) and
    handing each line to on_line(line) where given; at `timeout` seconds interrupt it (pytest then
    still writes its report), and kill it a minute later. `env`: the environment (default this
    process's). Returns (returncode, timed_out). Interrupted itself (the run's limit: tools/gpu_run.sh
    signals the whole process group), it gives the command INTERRUPT_GRACE_SECONDS to write its
    files and end, then raises KeyboardInterrupt on."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    process = subprocess.Popen(
        command,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        # SIGINT as the default in the child even where this process was started with it ignored
        # (a shell's background job: `cmd &`), so the interrupt at the budget reaches it
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    expired = threading.Event()

    def interrupt():
        expired.set()
        process.send_signal(signal.SIGINT)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()

    timer = threading.Timer(timeout, interrupt)
    timer.daemon = True
    timer.start()
    try:
        for line in process.stdout:
            print(line, end="", flush=True)
            if on_line is not None:
                on_line(line.rstrip("\n"))
        returncode = process.wait()
    except KeyboardInterrupt:
        _wind_down(process)
        raise
    finally:
        timer.cancel()
    return returncode, expired.is_set()


def _wind_down(process):
    """An interrupted run's subprocess, which the interrupt reached too (tools/gpu_run.sh's
    `timeout` signals the process group; a terminal's Ctrl-C its foreground group): given
    INTERRUPT_GRACE_SECONDS to write its files and end while its last lines are still echoed, then
    killed. Not signalled again: a second SIGINT would cut pytest's writing of its report short."""

    def echo():
        for line in process.stdout:
            print(line, end="", flush=True)

    reader = threading.Thread(target=echo, daemon=True)  # a grandchild may hold the pipe open
    reader.start()
    deadline = time.monotonic() + INTERRUPT_GRACE_SECONDS
    while process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)  # (tools.interrupt_once: no second interrupt comes)
    if process.poll() is None:
        process.kill()
    reader.join(1)


def measure_cases(run, stage, cases, rep, profiled=frozenset()):
    """bench.reporting.run, one case at a time (the plan's warm-up calls, then `rep` timed ones; the
    cases whose ids are in `profiled` also record their kernels), into run.reports[stage]: the
    budget is checked and results.json rewritten after each case. Each case starts from a reset
    Dynamo, so no shared compiled function reaches Dynamo's recompile limit (past it, Dynamo
    silently runs the function eagerly). Returns the stage's counts."""
    gemm_rate = run.gemm_rate()
    report = run.reports[stage] = {"env": run.env, "results": [], "skipped": [], "failed": []}
    deadline, not_run = run.deadline(stage), 0
    for i, case in enumerate(cases, 1):
        if time.monotonic() > deadline:
            reason = f"not run: the {stage} stage's budget of {run.plan.budget_seconds[stage]:.0f} s was spent"
            report["skipped"].append(
                {"bench": case.bench, "provider": case.provider, "params": case.params, "reason": reason}
            )
            not_run += 1
            continue
        print(f"[{stage} {i}/{len(cases)}] {case.id}", flush=True)
        torch._dynamo.reset()
        part = bench_report.run(
            [case],
            run.device,
            warmup=run.plan.reps.warmup,
            rep=rep,
            gemm_rate=gemm_rate,
            log=lambda line: print(line, flush=True),
            profiled=profiled,
        )
        for key in ("results", "skipped", "failed"):
            report[key] += part[key]
        run.write(plots=False)
    return {
        "cases": len(cases),
        "measured": len(report["results"]),
        "skipped": len(report["skipped"]) - not_run,
        "failed": len(report["failed"]),
        "not_run": not_run,
    }


def raise_for_cases(details):
    if details["failed"] or details["not_run"]:
        raise Failed(
            f'{details["failed"]} cases failed (errors in the report\'s "failed" list), '
            f"{details['not_run']} not run: {details['summary']}",
            details,
        )
