"""One command that validates fastformer on a CUDA GPU and leaves the answers in files.

    python -m tools.gpu_check --out DIR                      # every stage (25 minutes at most)
    python -m tools.gpu_check --out DIR --stage env,tests    # a subset; each stage alone ends within 9 minutes
    python -m tools.gpu_check --out DIR --quick              # a reduced matrix of every stage, under 9 minutes
    python -m tools.gpu_check --out DIR --smoke              # tiny shapes; on a CPU, kernels through the interpreter

Run it from the repository root of an installed checkout (`pip install -e .`; offline, with torch,
Triton and setuptools there: `pip install --no-deps --no-build-isolation --no-index -e .`): it
installs nothing and needs no network. The stages run in this order, whatever order --stage gives:

  env          GPU name, compute capability, SM count, memory, driver, CUDA, torch, Triton and
               Python versions; two ceilings measured on the spot: a bf16 GEMM of 8192^3
               (2 * 8192^3 FLOP per call) and a 1 GiB device-to-device copy (bytes read + written)
  tests        `pytest -m cuda` in a subprocess (bf16 parity included), writing junit.xml
  compile      torch.compile(model, fullgraph=True) of MovieClassification and of Aladdin
               Persson's einsum seq2seq Transformer: a train step (forward, loss, backward) checked finite, then the
               eval-mode logits against eager; on failure, Dynamo's graph breaks by reason and place
  determinism  attention forward + backward repeated on one input (without and with dropout), and
               train steps of the tutorial model from one seed, twice: every output, gradient and
               final weight bitwise equal, or the first mismatch (tensor, index, the two values)
  bench        the cases `python -m bench.report --targets` runs, fastformer against the peers
               measured in the same run; then, for the pairs where fastformer trailed a peer on the
               last GPU run (KERNEL_PROFILE), each one's kernels under torch.profiler: device time
               per kernel per call, the most first (where the time goes, ours beside the peer's)
  model        MovieClassification with the tutorial's config on batches of NSMC-like reviews (8 to
               128 tokens, padded): train step and inference for fastformer (bf16 autocast), the
               reference in fp32, under bf16 autocast, and compiled: tokens/s on real tokens, peak
               memory, MFU against the env stage's GEMM ceiling. Beside them, fastformer's ways of
               running a step (MODEL_VARIANTS): eager (the fastformer row), replayed from CUDA graphs
               (fastformer.train.graphs, `fastformer train --cuda-graphs`), torch.compile(model,
               fullgraph=True) over the Triton kernels (`--compile`), and the eager train step with
               `fastformer train`'s fused AdamW where the other rows step torch's default (the
               optimizer's part of the step). Then where the eager train step's host time goes:
               cProfile over the timed steps of fastformer and of the fp32 reference, each one's
               PROFILE_ROWS functions with the most time of their own (the host runs Python while
               the GPU waits), and what single calls cost this host (host_calls: an allocation, an
               aten op, the products, a Triton launch four ways). Then convergence: the same config
               (dropout 0) trained from one seed for a few dozen steps on real reviews
               (tests/data/rotten_tomatoes_200.tsv) on the Triton kernels and on the reference,
               both under the run's autocast, and on the reference in fp64; at every step
               |fastformer - fp64| <= 2 * max over the steps |reference - fp64| + atol

Each stage is timed and has a time budget (Plan below), checked between its items: cases left
when it is spent are reported as not run, and the stage fails. A stage's failure is recorded with
its traceback and the next stage runs. A stage that cannot run here is "skipped" with the reason
("needs CUDA: ..."). Exit status: 0 when no stage failed, 1 when one did, 2 for a bad command line.

--smoke runs the same pipeline on tiny shapes, on the GPU when there is one, else on the CPU with
the kernels through Triton's interpreter (so CI exercises it): there the ceilings, the compile
stage and the cuda tests say "needs CUDA", and the figures measured are CPU figures of tiny
shapes, never GPU ceilings. Without CUDA and without --smoke, env fails and the rest is skipped.

Files in DIR, at most 8 (earlier files of these names are replaced; other files are left alone):
  summary.md    stage table, targets, each stage's details, the benchmark tables, every traceback
  results.json  the schema below
  log.txt       everything printed, flushed as it goes (the pytest run's output included)
  junit.xml     the tests stage's pytest report
  plot-*.png    at most four: attention TFLOP/s against sequence length per provider, model tokens/s
results.json and summary.md are rewritten atomically (a temporary file, then os.replace) as each
stage starts and ends, and after each case in bench and model: a killed run leaves the stages it
finished and "running" on the one it was in.

results.json, schema "fastformer.gpu_check/1" (every key is always present; null where not known):
  schema, command, mode ("full" | "quick" | "smoke"), device ("cuda" | "cpu"),
  started, finished     ISO 8601 times; finished is null until the run ends
  env                   gpu (the device name, "cpu" without CUDA), torch, triton, cuda, date,
                        bf16_gemm_tflops, d2d_copy_gbps (null until measured; never on a CPU)
  units                 the unit of every figure, by key or key suffix (UNITS below)
  stages                {name: {status, seconds, reason, error, traceback, details}} for each stage
                        asked for, in run order; status is pending, running, passed, failed,
                        skipped or interrupted; reason says why a stage was skipped; error is
                        "Type: message" and traceback the full one for a failure; details holds
                        the stage's figures and always a one-line "summary":
      env           device, gpu, capability, sm_count, memory_gib, driver, cuda, torch, triton,
                    python, git_commit, bf16_gemm_tflops, d2d_copy_gbps, ceilings_note
      tests         command, returncode, timed_out, tests, passed, failed, errors, skipped,
                    seconds, failures (names and first message lines), skip_reasons
      compile       models: {name: {compiled, first_call_seconds, eval_first_call_seconds, step_ms,
                    eager_step_ms, max_abs_diff, tolerance, graph_breaks: [{reason, where}], error}}
      determinism   attention: {shape, dtype, mask, settings: [{setting, repetitions, mismatch}]},
                    training: {config, batch, amp, steps, mismatch}; a mismatch is {tensor, at,
                    index, first, second} (the first differing element of the first differing tensor)
      bench, model  cases, measured, skipped, failed, not_run; bench also kernel_profile: {case
                    id: [{kernel, calls_per_run, us_per_run, share}], the first row the case's
                    total, or {error}}, or {not_run}; model also rows (bench, provider,
                    ms, tokens_per_s, peak_mem_mb, tflops, mfu; the providers include
                    MODEL_VARIANTS), mfu_note, host_profile, host_calls ([{call, us_per_call, error?}]) and
                    convergence: {config,
                    batch, steps, reviews, amp, lr, curve: [{step, fastformer_loss, reference_loss,
                    reference_fp64_loss}], max_loss_diff, reference_max_loss_diff, loss_atol,
                    loss_tolerance, worst_step, agree}, or {not_run} when the budget was spent
  targets               bench.report's targets judged on this run's records: [{target, required,
                        worst, cases, met}]; worst is the worst ratio measured, met null when none
                        was (and on a CPU, where targets_note says why nothing is judged)
  targets_note          null on a GPU
  report                bench.report's schema ({env, results, skipped, failed}) holding the bench
                        and model stages' records (model's first where both measured a case), so
                        `python -m bench.report --from results.json` writes bench/results/<gpu>.json
  plots                 names of the PNGs written
"""

import argparse
import datetime
import json
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
import xml.etree.ElementTree as ET
from collections import Counter
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch.autograd import DeviceType

# Triton reads this when a kernel is decorated, so it must be set before `fastformer.kernels` is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import fastformer  # after TRITON_INTERPRET, on purpose
from fastformer import kernels
from fastformer.compat.aladdinpersson import Transformer as AladdinTransformer
from fastformer.train.loop import autocast, sequence_cross_entropy
from tools.benchmarks import cases as suite
from tools.benchmarks import report as bench_report
from tools.benchmarks.cases import MODEL_VARIANTS, TRAIN_VARIANTS, model_variant_case
from tools.benchmarks.common import environment, gemm_tflops, synchronize, time_ms
from tools.convergence import (
    CONVERGENCE_LR,
    LOSS_ATOL,
    TINY,
    compare_curves,
    convergence_curves,
    convergence_setup,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCHEMA = "fastformer.gpu_check/1"
STAGES = ("env", "tests", "compile", "determinism", "bench", "model")
OUTPUTS = ("summary.md", "results.json", "log.txt", "junit.xml")
PLOT_PREFIX = "plot"
MAX_PLOTS = 4
UNITS = {
    "seconds, *_seconds": "seconds of wall time",
    "ms, *_ms": "milliseconds per call (median of the timed calls)",
    "tflops, *_tflops": "TFLOP/s: 1e12 floating-point operations per second, a multiply-add counting 2",
    "*_gbps": "GB/s: 1e9 bytes per second; a copy counts the bytes read and the bytes written",
    "*_gib": "GiB (2**30 bytes)",
    "peak_mem_mb": (
        "MiB (2**20 bytes) of CUDA memory allocated at the peak of a call, above what was allocated before it"
    ),
    "tokens_per_s": "real (non-padding) tokens per second",
    "mfu": "achieved TFLOP/s over env.bf16_gemm_tflops (a fraction)",
    "required, worst": "ratios: a peer's time over fastformer's, or for memory fastformer's peak over the peer's",
    "max_abs_diff, tolerance": "absolute difference of logits",
    "dropout": "a probability",
    "*_loss, *_loss_diff, loss_atol, loss_tolerance": "cross-entropy in nats (a step's mean over its batch)",
    "lr": "AdamW learning rate",
    "calls_per_step, own_ms_per_step, cum_ms_per_step": (
        "the model stage's host profile, per eager train step under cProfile: a function's calls, the "
        "milliseconds in its own code, and in it with what it calls"
    ),
    "us_per_call": "the model stage's host_calls: microseconds of the host per call, enqueued back to back",
    "calls_per_run, us_per_run, share": (
        "the bench stage's kernel profile, per call of a case: a kernel's launches, its microseconds on "
        "the device (on a CPU, an operator's own CPU time), and its fraction of the case's total"
    ),
}
# The cuda tests --quick and --smoke leave out: the dense-mask attention path (the models never
# take it), the inference-only fused FFN (not wired into the models) and the B*H > 65535 grid test
# (one large allocation), and the whole `fastformer train` runs with --cuda-graphs and --compile
# (minutes of first-call kernel compiles); the parity of every op the models run, bf16 included,
# and the graph replays against eager steps stay.
REDUCED_TESTS = (
    "not dense_mask and not fused_parity and not 65535 and not train_with_cuda_graphs and not compile_on_cuda_trains"
)
# fastformer's ways of running a model step, timed beside its eager row ("fastformer") in the
# model stage: replayed from CUDA graphs, and through torch.compile(model, fullgraph=True)
COMPILED_PROVIDERS = ("compile", "flex", "fastformer_compile")
CPU_TARGETS = "not judged: a CPU run (the targets are GPU targets; CPU ratios say nothing of them)"
BENCH_ORDER = ("model_train", "ffn_fwd_bwd", "attention_fwd", "attention_fwd_bwd")


@dataclass(frozen=True)
class Repetitions:
    """How many times the stages repeat their items."""

    compile: int  # timed steps of the compiled model and of the eager one (compile stage)
    attention: int  # attention runs compared bit for bit, per setting (determinism stage)
    train_steps: int  # training steps compared bit for bit (determinism stage)
    warmup: int  # untimed runs before each benchmark's timing (bench and model stages)
    measure: int  # timed runs of each benchmark (bench and model stages)


@dataclass(frozen=True)
class Plan:
    """What one mode runs. Budgets are seconds per stage, checked between items (a case, a model,
    a repetition), so a stage ends at most one item after its budget; the tests stage's pytest is
    interrupted at its budget. The full budgets add up to 22.5 minutes, the quick ones to 8,
    leaving room for the item that overruns and for start-up."""

    budget_seconds: dict
    tests_filter: str | None  # pytest -k for the cuda tests; None runs them all
    config: dict  # Config.tutorial overrides for the compile, determinism and model stages
    compile_layers: int | None  # n_layer / num_layers for the compile stage; None keeps the config's
    aladdinpersson: dict  # Aladdin Persson's seq2seq Transformer and its batch, for the compile stage
    model_batch: int
    attention_shape: tuple  # (B, H, L, D) for the determinism stage
    reps: Repetitions
    model_providers: tuple
    model_variants: tuple  # of MODEL_VARIANTS
    host_profile: tuple  # model providers whose eager train step the model stage profiles
    copy_bytes: int
    convergence: dict  # batch, steps and reviews (the first of the file's fixed order, cycled)


FULL = Plan(
    budget_seconds=dict(env=60, tests=330, compile=270, determinism=90, bench=330, model=270),
    tests_filter=None,
    config={},
    compile_layers=None,
    aladdinpersson=dict(vocab=8000, embed_size=512, num_layers=6, heads=8, batch=32, length=100),
    model_batch=128,
    attention_shape=(128, 4, 256, 64),
    reps=Repetitions(compile=5, attention=100, train_steps=10, warmup=3, measure=10),
    model_providers=suite.MODEL_PROVIDERS,
    model_variants=MODEL_VARIANTS,
    host_profile=("fastformer", "reference_fp32"),
    copy_bytes=2**30,
    convergence=dict(batch=32, steps=36, reviews=192),
)
QUICK = replace(
    FULL,
    # on an H100 a cuda test takes 3 to 28 s, mostly cold kernel compiles; determinism, bench and
    # model took 17, 33 and 34 s of theirs (bench/results/gpu/h100-2026-11-26)
    budget_seconds=dict(env=30, tests=160, compile=100, determinism=30, bench=80, model=80),
    tests_filter=REDUCED_TESTS,
    compile_layers=2,
    aladdinpersson=dict(FULL.aladdinpersson, num_layers=2),
    reps=Repetitions(compile=3, attention=20, train_steps=5, warmup=2, measure=5),
    model_providers=tuple(p for p in suite.MODEL_PROVIDERS if p not in ("compile", "fastformer_autotune")),
    model_variants=("fastformer_graphs", "fastformer_fused_adamw"),
)
SMOKE = replace(
    QUICK,
    budget_seconds=dict.fromkeys(STAGES, 300),
    config=TINY,
    compile_layers=None,
    aladdinpersson=dict(vocab=50, embed_size=32, num_layers=1, heads=2, batch=2, length=12),
    model_batch=2,
    attention_shape=(2, 2, 13, 16),  # L 13: not a multiple of any block
    reps=Repetitions(compile=1, attention=2, train_steps=2, warmup=0, measure=1),
    model_providers=suite.MODEL_PROVIDERS,
    model_variants=MODEL_VARIANTS,
    # on a CPU fastformer's profile would be the interpreter's own Python: the reference's shows the rows
    host_profile=("reference_fp32",),
    copy_bytes=2**24,
    convergence=dict(batch=2, steps=3, reviews=6),
)
PLANS = {"full": FULL, "quick": QUICK, "smoke": SMOKE}


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


class UsageError(Exception):
    """A bad command line: reported in one line, exit status 2."""


# ----------------------------------------------------------------------------------------------
# figures
# ----------------------------------------------------------------------------------------------
def copy_gbps(device, nbytes, rep=10, inner=10):
    """Device-to-device copy bandwidth in GB/s, counting the bytes read and written (the ceiling
    of a memory-bound kernel); each timed call runs `inner` copies, so launch and sync costs vanish."""
    src = torch.zeros(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)

    def copies():
        for _ in range(inner):
            dst.copy_(src)

    ms = time_ms(copies, device, warmup=2, rep=rep) / inner
    return 2 * src.numel() * src.element_size() / (ms * 1e-3) / 1e9


def model_flops(config, enc_lengths, dec_lengths, kind):
    """FLOPs of one MovieClassification call on the real tokens of a batch (a multiply-add is 2).

    Per layer and sequence, with n real encoder tokens, m real decoder tokens, d = d_hidn,
    a = n_head * d_head and f = d_ff:
        encoder   2n(4da + 2df)     Q, K, V and output projections; the two FFN GEMMs
                  + 4n^2 a          QK^T and PV
        decoder   2m(6da + 2df)     self Q, K, V, output; cross Q, output; the FFN
                  + 2n(2da)         cross-attention K and V of the encoder output
                  + 2m^2 a          causal self-attention (half of 4m^2 a)
                  + 4mna            cross-attention
    plus 2 d n_output per sequence for the classifier. A train step is 3x (backward = 2x forward).
    Padding is not counted, so every provider is credited the same work: MFU compares like with like.
    """
    d, a, f = config.d_hidn, config.n_head * config.d_head, config.d_ff
    total = 0
    for n, m in zip(enc_lengths, dec_lengths):
        encoder = 2 * n * (4 * d * a + 2 * d * f) + 4 * n * n * a
        decoder = 2 * m * (6 * d * a + 2 * d * f) + 2 * n * 2 * d * a + 2 * m * m * a + 4 * m * n * a
        total += config.n_layer * (encoder + decoder) + 2 * d * config.n_output
    return total * (3 if kind == "train" else 1)


def first_mismatch(first, second):
    """The first tensor of two {name: tensor} dicts whose bits differ, with its first differing
    element: {tensor, index, first, second}; None when every tensor is bitwise equal."""
    for name, a in first.items():
        b = second[name]
        if a.shape != b.shape or a.dtype != b.dtype:
            return {
                "tensor": name,
                "index": None,
                "first": f"{a.dtype} {tuple(a.shape)}",
                "second": f"{b.dtype} {tuple(b.shape)}",
            }
        differ = _bits(a) != _bits(b)  # bits, so NaN == NaN and -0.0 != 0.0
        if bool(differ.any()):
            index = tuple(int(i) for i in differ.nonzero()[0])
            return {"tensor": name, "index": list(index), "first": a[index].item(), "second": b[index].item()}
    return None


def _bits(t):
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.detach().contiguous().view(ints[t.element_size()])


def graph_breaks(fn, *args):
    """Dynamo's graph breaks in fn(*args) as [{reason, where}]: each reason's first line and the
    user frame it points at. Runs fn once (through Dynamo, compiling nothing)."""
    torch._dynamo.reset()
    try:
        explanation = torch._dynamo.explain(fn)(*args)
    except Exception as error:  # noqa: BLE001 (the compile error is already recorded; say why there is no list)
        return [
            {"reason": f"torch._dynamo.explain failed too: {type(error).__name__}: {_first_line(error)}", "where": None}
        ]
    finally:
        torch._dynamo.reset()
    breaks = []
    for reason in explanation.break_reasons:
        frame = reason.user_stack[-1] if reason.user_stack else None
        where = None
        if frame is not None:
            path = frame.filename
            where = f"{os.path.relpath(path, ROOT) if path.startswith(ROOT + os.sep) else path}:{frame.lineno}"
        item = {"reason": reason.reason.strip().splitlines()[0], "where": where}
        if item not in breaks:
            breaks.append(item)
    return breaks


def junit_counts(path):
    """Counts, failing tests (with their first message line) and skip reasons of a pytest JUnit XML."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    counts = {key: sum(int(s.get(key, 0)) for s in suites) for key in ("tests", "failures", "errors", "skipped")}
    failures, skip_reasons = [], Counter()
    for case in root.iter("testcase"):
        for tag in ("failure", "error"):
            element = case.find(tag)
            if element is not None:
                message = (element.get("message") or element.text or "").strip().splitlines()
                failures.append(
                    f"{case.get('classname')}::{case.get('name')} ({tag}): {message[0][:300] if message else ''}"
                )
        skipped = case.find("skipped")
        if skipped is not None:
            skip_reasons[skipped.get("message") or ""] += 1
    return {
        "tests": counts["tests"],
        "passed": max(0, counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]),
        "failed": counts["failures"],
        "errors": counts["errors"],
        "skipped": counts["skipped"],
        "seconds": sum(float(s.get("time", 0)) for s in suites),
        "failures": failures,
        "skip_reasons": dict(skip_reasons),
    }


def _first_line(error):
    lines = str(error).strip().splitlines()
    return lines[0] if lines else ""


def _error_text(error, limit=400):
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

    def __init__(self, out, stages, mode, command):
        self.out, self.mode, self.command = out, mode, command
        self.plan = PLANS[mode]
        self.cuda = torch.cuda.is_available()
        self.device = torch.device("cuda" if self.cuda else "cpu")
        # bf16 autocast on a GPU; fp32 on a CPU, where Triton's interpreter as shipped computes bf16 dots wrongly
        self.amp = "bf16" if self.cuda else "off"
        self.env = dict(environment(self.device), bf16_gemm_tflops=None, d2d_copy_gbps=None)
        self.started = _now()
        self.finished = None
        self.stages = {name: _entry("pending") for name in stages}
        self.reports = {}  # stage -> bench.report-schema report of its records
        self.plots = []
        self._plotted = None
        self.stage_started = None  # time.monotonic() at the start of the stage running

    def deadline(self, stage):
        return self.stage_started + self.plan.budget_seconds[stage]

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
        """bench.report's targets on this run's records; on a CPU, ratios only, judged nowhere."""
        targets = bench_report.evaluate_targets(self.report()["results"])
        if not self.cuda:
            for target in targets:
                target["met"] = None
        return targets

    def document(self):
        union = self.report()
        return {
            "schema": SCHEMA,
            "command": self.command,
            "mode": self.mode,
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
        if plots:
            self._write_plots(document["report"])
            document["plots"] = self.plots
        _write_text(os.path.join(self.out, "results.json"), json.dumps(document, indent=1, default=str) + "\n")
        _write_text(os.path.join(self.out, "summary.md"), summary_markdown(document))

    def _write_plots(self, union):
        """At most MAX_PLOTS PNGs through bench.report.plot: model tokens/s, and attention TFLOP/s
        for the (bench, head dim) groups measured, head dim 64 first."""
        results = union["results"]
        if self._plotted == len(results):
            return
        groups = sorted(
            {(r["bench"], r["params"]["D"]) for r in results if r["bench"].startswith("attention") and r["tflops"]},
            key=lambda g: (g[1] != 64, g),
        )
        has_model = any(r["bench"].startswith("model") and r["tokens_per_s"] for r in results)
        keep = set(groups[: MAX_PLOTS - has_model])
        chosen = [
            r for r in results if not r["bench"].startswith("attention") or (r["bench"], r["params"]["D"]) in keep
        ]
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


def _entry(status):
    return {"status": status, "seconds": None, "reason": None, "error": None, "traceback": None, "details": {}}


def _now():
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


def _write_text(path, text):
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def _clear_outputs(out):
    """Remove this command's files from an earlier run in DIR (temporary ones of a killed run
    included), so DIR describes this run only."""
    for name in os.listdir(out):
        plot = name.endswith(".png") and name.startswith((f"{PLOT_PREFIX}-", f".{PLOT_PREFIX}-tmp"))
        if name in OUTPUTS or plot or (name.endswith(".tmp") and name[:-4] in OUTPUTS):
            os.remove(os.path.join(out, name))


def run_stage(run, name):
    """Run one stage: time it, record its details, or its reason, or its error with the traceback."""
    entry = run.stages[name]
    entry["status"] = "running"
    run.write(plots=False)
    print(f"\n=== {name} ===", flush=True)
    run.stage_started = time.monotonic()
    try:
        if not run.cuda and run.mode != "smoke" and name != "env":
            raise Skipped("needs CUDA: this machine has no CUDA device (--smoke is the CPU check of this command)")
        details = STAGE_FUNCTIONS[name](run)
        entry.update(status="passed", details=details)
    except Skipped as skip:
        entry.update(status="skipped", reason=str(skip), details=skip.details)
    except Exception as error:  # noqa: BLE001 (a failing stage is recorded; the next one runs)
        entry.update(
            status="failed",
            error=f"{type(error).__name__}: {error}",
            traceback=traceback.format_exc(),
            details=getattr(error, "details", {}),
        )
        print(entry["traceback"], end="", flush=True)
    finally:
        entry["seconds"] = time.monotonic() - run.stage_started
        _release(run)
    print(f"=== {name}: {entry['status']} in {entry['seconds']:.1f} s: {_note(entry)}", flush=True)
    run.write()


def _release(run):
    """Drop compiled code and cached GPU memory between stages. After a CUDA fault this can fail
    too: say so, and let the next stage report what still works."""
    try:
        torch._dynamo.reset()
        if run.cuda:
            torch.cuda.empty_cache()
    except Exception as error:  # noqa: BLE001
        print(f"gpu_check: cleaning up after the stage failed: {type(error).__name__}: {error}", flush=True)


# ----------------------------------------------------------------------------------------------
# stages
# ----------------------------------------------------------------------------------------------
def stage_env(run):
    details = {
        "device": str(run.device),
        "gpu": run.env["gpu"],
        "capability": None,
        "sm_count": None,
        "memory_gib": None,
        "driver": None,
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "triton": run.env["triton"],
        "python": platform.python_version(),
        "git_commit": _git_commit(),
        "bf16_gemm_tflops": None,
        "d2d_copy_gbps": None,
        "ceilings_note": None,
    }
    versions = f"torch {details['torch']}, Triton {details['triton']}, CUDA {details['cuda']}"
    if not run.cuda:
        details["ceilings_note"] = "needs CUDA: the ceilings are GPU figures and are not measured on a CPU"
        if run.mode != "smoke":
            raise Failed(
                f"no CUDA device: torch.cuda.is_available() is False ({versions}); the other stages need one", details
            )
        details["summary"] = f"no CUDA device, a CPU smoke run: {versions}; ceilings not measured (needs CUDA)"
        return details
    props = torch.cuda.get_device_properties(run.device)
    details.update(
        capability=f"{props.major}.{props.minor}",
        sm_count=props.multi_processor_count,
        memory_gib=props.total_memory / 2**30,
        driver=_driver_version(run.device),
    )
    details["bf16_gemm_tflops"] = run.gemm_rate()
    details["d2d_copy_gbps"] = run.env["d2d_copy_gbps"] = copy_gbps(run.device, run.plan.copy_bytes)
    details["summary"] = (
        f"{details['gpu']} (sm_{props.major}{props.minor}, {details['sm_count']} SMs, {details['memory_gib']:.0f} GiB, "
        f"driver {details['driver']}), {versions}; bf16 GEMM {details['bf16_gemm_tflops']:.0f} TFLOP/s, "
        f"copy {details['d2d_copy_gbps']:.0f} GB/s"
    )
    return details


def _driver_version(device):
    if shutil.which("nvidia-smi") is None:
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _output(["nvidia-smi", f"--id={index}", "--query-gpu=driver_version", "--format=csv,noheader"])


def _git_commit(root=ROOT):
    """The commit of the tree under test, "<sha> + N paths changed" where the tree is not that
    commit's (a device tool's copy of a working tree can carry an older .git), None where the copy
    has no git history."""
    if shutil.which("git") is None:
        return None
    head = _output(["git", "rev-parse", "HEAD"], root)
    changed = _output(["git", "status", "--porcelain", "--untracked-files=no"], root)
    if head is None or changed is None:
        return head
    return f"{head} + {len(changed.splitlines())} paths changed"


def _output(command, cwd=ROOT):
    """A short command's stripped stdout, or None when it fails or prints nothing."""
    try:
        result = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if result.returncode != 0:
        return None
    return result.stdout.strip() or None


def stage_tests(run):
    junit = os.path.join(run.out, "junit.xml")
    command = [
        sys.executable,
        "-m",
        "pytest",
        "tests",
        "-m",
        "cuda",
        "-v",
        "--tb=short",
        "-p",
        "no:cacheprovider",
        f"--junitxml={junit}",
    ]
    if run.plan.tests_filter:
        command += ["-k", run.plan.tests_filter]
    budget = run.plan.budget_seconds["tests"]
    returncode, timed_out = _stream(command, budget)
    details = {"command": shlex.join(["python", *command[1:]]), "returncode": returncode, "timed_out": timed_out}
    if not os.path.exists(junit):
        raise Failed(f"pytest exited {returncode} without writing junit.xml (see log.txt)", details)
    details.update(junit_counts(junit))
    counts = ", ".join(f"{details[key]} {key}" for key in ("passed", "failed", "errors", "skipped"))
    details["summary"] = counts
    if timed_out:
        raise Failed(f"stopped at the stage's budget of {budget} s: {counts} by then", details)
    if details["failed"] or details["errors"] or returncode not in (0, 5):
        raise Failed(f"pytest exited {returncode}: {counts}", details)
    if details["passed"] == 0:
        if not run.cuda:
            raise Skipped(
                f"needs CUDA: the {details['skipped']} cuda tests selected all skip on this machine "
                "(pytest ran them, junit.xml has each reason)",
                details,
            )
        raise Failed(f"no cuda test passed: {counts}", details)
    return details


def _stream(command, timeout):
    """Run command from the repository root, echoing its output as it comes (into log.txt too);
    at `timeout` seconds interrupt it (pytest then still writes its report), and kill it a minute
    later. Returns (returncode, timed_out)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
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
        returncode = process.wait()
    finally:
        timer.cancel()
    return returncode, expired.is_set()


def stage_compile(run):
    if not run.cuda:
        raise Skipped(
            "needs CUDA: torch.compile lowers fastformer's Triton ops for CUDA tensors only (on a CPU, "
            "tests/test_backend.py and tests/test_aladdinpersson.py trace the models with backend='eager')"
        )
    deadline = run.deadline("compile")
    models = {}
    for name, build in (
        ("MovieClassification", _movie_classification),
        ("aladdinpersson.Transformer", _aladdinpersson),
    ):
        entry = models[name] = {
            "compiled": False,
            "first_call_seconds": None,
            "eval_first_call_seconds": None,
            "step_ms": None,
            "eager_step_ms": None,
            "max_abs_diff": None,
            "tolerance": None,
            "graph_breaks": [],
            "error": None,
        }
        if time.monotonic() > deadline:
            entry["error"] = f"not run: the stage's budget of {run.plan.budget_seconds['compile']} s was spent"
            continue
        print(f"compiling {name} (fullgraph=True)", flush=True)
        try:
            _compile_check(run, entry, *build(run))
        except Exception as error:  # noqa: BLE001 (recorded; the other model is still checked)
            print(traceback.format_exc(), end="", flush=True)
            entry["error"] = f"{_error_text(error)} (traceback in log.txt)"
    broken = {name: m["error"] for name, m in models.items() if m["error"]}
    summary = "; ".join(
        f"{name}: "
        + (
            broken[name]
            if name in broken
            else f"one graph, compiled step {m['step_ms']:.1f} ms vs eager {m['eager_step_ms']:.1f} ms"
        )
        for name, m in models.items()
    )
    details = {"summary": summary, "models": models}
    if broken:
        raise Failed(summary, details)
    return details


def _layers(run):
    return {} if run.plan.compile_layers is None else {"n_layer": run.plan.compile_layers}


def _movie_classification(run):
    """MovieClassification (the plan's config, tutorial dropout) and a batch of reviews."""
    config = fastformer.Config.tutorial(**{**run.plan.config, **_layers(run)})
    torch.manual_seed(0)
    model = fastformer.MovieClassification(config).to(run.device)
    enc, dec, labels = suite._review_batch(config, run.plan.model_batch, False, run.device)
    return model, (enc, dec), lambda out: F.cross_entropy(out[0].float(), labels), lambda out: out[0]


def _aladdinpersson(run):
    """Aladdin Persson's einsum seq2seq Transformer (dropout 0.1) on padded sources, with teacher forcing."""
    sizes = dict(run.plan.aladdinpersson)
    vocab, n, length = sizes.pop("vocab"), sizes.pop("batch"), sizes.pop("length")
    if run.plan.compile_layers is not None:
        sizes["num_layers"] = run.plan.compile_layers
    torch.manual_seed(0)
    model = AladdinTransformer(vocab, vocab, 0, 0, dropout=0.1, max_length=length, **sizes).to(run.device)
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(length // 4, length + 1, (n,), generator=g)
    src = torch.randint(1, vocab, (n, length), generator=g).masked_fill(torch.arange(length) >= lengths[:, None], 0)
    trg = torch.randint(1, vocab, (n, length), generator=g)
    src, trg = src.to(run.device), trg.to(run.device)
    return model, (src, trg[:, :-1]), lambda out: sequence_cross_entropy(out, trg[:, 1:], 0), lambda out: out


def _compile_check(run, entry, model, inputs, loss_of, logits_of):
    """Compile `model` with fullgraph=True and fill `entry`: a train step (finite loss, a finite
    gradient wherever eager gives one), its time against eager, and the eval-mode logits against
    eager; on a failed compile, Dynamo's graph breaks."""

    def step(fn):
        model.zero_grad(set_to_none=True)
        with fastformer.use_backend("triton"), autocast(run.device, run.amp):
            loss = loss_of(fn(*inputs))
        loss.backward()
        return loss

    step(model)
    eager_grads = {name for name, p in model.named_parameters() if p.grad is not None}
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    start = time.perf_counter()
    try:
        loss = step(compiled)
        synchronize(run.device)
    except Exception as error:  # noqa: BLE001 (recorded with the graph breaks that explain it)
        print(traceback.format_exc(), end="", flush=True)
        with fastformer.use_backend("triton"), autocast(run.device, run.amp):
            entry["graph_breaks"] = graph_breaks(model, *inputs)
        breaks = "; ".join(b["reason"] + (f" at {b['where']}" if b["where"] else "") for b in entry["graph_breaks"])
        entry["error"] = f"{_error_text(error)}; graph breaks: {breaks or 'none found'}"
        return
    entry["first_call_seconds"] = time.perf_counter() - start
    entry["compiled"] = True
    bad = sorted(
        name
        for name, p in model.named_parameters()
        if name in eager_grads and (p.grad is None or not bool(torch.isfinite(p.grad).all()))
    )
    if not bool(torch.isfinite(loss)) or bad:
        entry["error"] = f"compiled train step: loss {loss.item():.4g}; missing or non-finite gradients: {bad[:5]}"
        return
    entry["step_ms"] = time_ms(lambda: step(compiled), run.device, warmup=1, rep=run.plan.reps.compile)
    entry["eager_step_ms"] = time_ms(lambda: step(model), run.device, warmup=1, rep=run.plan.reps.compile)
    model.eval()
    try:
        with torch.no_grad(), fastformer.use_backend("triton"), autocast(run.device, run.amp):
            start = time.perf_counter()
            got = logits_of(compiled(*inputs)).float()
            synchronize(run.device)
            entry["eval_first_call_seconds"] = time.perf_counter() - start
            expected = logits_of(model(*inputs)).float()
    finally:
        model.train()
    entry["max_abs_diff"] = (got - expected).abs().max().item()
    entry["tolerance"] = suite.ATOL["bf16" if run.amp == "bf16" else "fp32"] * (expected.abs().max().item() or 1.0)
    if not entry["max_abs_diff"] <= entry["tolerance"]:
        entry["error"] = (
            f"eval-mode logits differ from eager by {entry['max_abs_diff']:.3g} (tolerance {entry['tolerance']:.3g})"
        )


ATTENTION_SETTINGS = (("padding + causal", True, 0.0), ("padding, dropout 0.1", False, 0.1))


def stage_determinism(run):
    deadline = run.deadline("determinism")
    attention = _attention_repeats(run, deadline)
    training = _training_twice(run, deadline)
    mismatches = [s for s in attention["settings"] if s["mismatch"]] + ([training] if training["mismatch"] else [])
    short = [s["setting"] for s in attention["settings"] if s["repetitions"] < run.plan.reps.attention]
    parts = [f"attention x{s['repetitions']} ({s['setting']})" for s in attention["settings"]]
    parts.append(f"{training['steps']} train steps twice")
    details = {"summary": "bitwise equal: " + ", ".join(parts), "attention": attention, "training": training}
    if mismatches:
        m = mismatches[0]["mismatch"]
        details["summary"] = (
            f"not bitwise reproducible: {m['tensor']} at {m['at']}, index {m['index']}: "
            f"{m['first']!r} then {m['second']!r}"
        )
        raise Failed(details["summary"], details)
    if short or training["steps"] < run.plan.reps.train_steps:
        details["summary"] = f"cut by the stage's budget of {run.plan.budget_seconds['determinism']} s: " + ", ".join(
            parts
        )
        raise Failed(details["summary"], details)
    return details


def _attention_repeats(run, deadline):
    """kernels.attention forward + backward on one input, repeated, against the first call's bits."""
    B, H, L, D = run.plan.attention_shape
    dtype = "bf16" if run.amp == "bf16" else "fp32"
    q, k, v, key_padding, _ = suite._attention_inputs(B, H, L, D, suite.DTYPES[dtype], "padding", run.device, True)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(run.device, q.dtype)

    def once(causal, dropout_p):
        torch.manual_seed(0)  # the dropout mask's seed
        out = kernels.attention(q, k, v, key_padding_mask=key_padding, causal=causal, dropout_p=dropout_p)
        return dict(zip(("out", "dq", "dk", "dv"), (out, *torch.autograd.grad(out, (q, k, v), do))))

    settings = []
    for setting, causal, dropout_p in ATTENTION_SETTINGS:
        first, repetitions, mismatch = once(causal, dropout_p), 1, None
        while repetitions < run.plan.reps.attention and mismatch is None and time.monotonic() < deadline:
            repetitions += 1
            mismatch = first_mismatch(first, once(causal, dropout_p))
            if mismatch:
                mismatch["at"] = f"repetition {repetitions}"
        settings.append({"setting": setting, "repetitions": repetitions, "mismatch": mismatch})
        print(
            f"attention ({setting}): {repetitions} repetitions, "
            f"{'bitwise equal' if mismatch is None else 'MISMATCH ' + json.dumps(mismatch)}",
            flush=True,
        )
    return {"shape": {"B": B, "H": H, "L": L, "D": D}, "dtype": dtype, "mask": "padding", "settings": settings}


def _training_twice(run, deadline):
    """The plan's train steps of MovieClassification from one seed, twice: every step's logits,
    loss and gradients, and the final weights, compared bit for bit."""
    config = fastformer.Config.tutorial(**run.plan.config)
    batches = [
        suite._review_batch(config, run.plan.model_batch, False, run.device, seed=s)
        for s in range(run.plan.reps.train_steps)
    ]
    first = _train_trace(run, config, batches, deadline)
    second = _train_trace(run, config, batches[: len(first) - 1], deadline)  # never more steps than the first
    steps = len(second) - 1
    pairs = [(f"step {i + 1}", first[i], second[i]) for i in range(steps)]
    if steps == len(first) - 1:
        pairs.append((f"the weights after step {steps}", first[-1], second[-1]))
    mismatch = None
    for label, a, b in pairs:
        mismatch = first_mismatch(a, b)
        if mismatch:
            mismatch["at"] = label
            break
    print(
        f"training: {steps} steps twice, {'bitwise equal' if mismatch is None else 'MISMATCH ' + json.dumps(mismatch)}",
        flush=True,
    )
    config_summary = {k: config[k] for k in ("n_layer", "d_hidn", "n_head", "d_head", "d_ff", "dropout")}
    return {
        "config": config_summary,
        "batch": run.plan.model_batch,
        "amp": run.amp,
        "steps": steps,
        "mismatch": mismatch,
    }


def _train_trace(run, config, batches, deadline):
    """Per step {logits, loss, every gradient}, then the final weights; stops early at the deadline."""
    torch.manual_seed(0)
    model = fastformer.MovieClassification(config).to(run.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    trace = []
    with fastformer.use_backend("triton"):
        for enc, dec, labels in batches:
            if trace and time.monotonic() > deadline:
                break
            optimizer.zero_grad(set_to_none=True)
            with autocast(run.device, run.amp):
                logits = model(enc, dec)[0]
            loss = F.cross_entropy(logits.float(), labels)
            loss.backward()
            grads = {f"{name}.grad": p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
            trace.append({"logits": logits.detach().clone(), "loss": loss.detach().clone(), **grads})
            optimizer.step()
    trace.append({name: p.detach().clone() for name, p in model.named_parameters()})
    return trace


def stage_bench(run):
    cases = _bench_cases(run)
    details = _measure(run, "bench", cases)
    targets = run.targets()
    met = sum(t["met"] is True for t in targets)
    judged = sum(t["met"] is not None for t in targets)
    verdict = (
        f"targets met {met} of {judged} measured ({len(targets)} in all)" if run.cuda else "targets " + CPU_TARGETS
    )
    details["summary"] = (
        f"{details['measured']} measured, {details['skipped']} skipped, {details['failed']} failed, "
        f"{details['not_run']} not run; {verdict}"
    )
    details["kernel_profile"] = _kernel_profile(run, cases)
    _raise_for_cases(details)
    return details


# The bench cases whose kernels the bench stage lists, fastformer's beside a peer's, for each pair
# fastformer trailed on the last GPU run (bench/results/gpu/h200-2026-11-28): (bench, the mask or the
# op, providers). Each takes the stage's first case of its bench and mask or op (in --quick: D 64,
# L 4096; the tutorial's FFN layer).
KERNEL_PROFILE = (
    ("ffn_fwd_bwd", "feed_forward", ("fastformer", "eager")),
    ("attention_fwd", "causal", ("fastformer", "sdpa")),
    ("attention_fwd_bwd", "causal", ("fastformer", "sdpa")),
)
KERNEL_ROWS = 8  # kernels listed per case, the most device time first


def _profiled_cases(cases):
    """The cases KERNEL_PROFILE names, in its order, from the stage's cases."""
    chosen = []
    for bench, kind, providers in KERNEL_PROFILE:
        for provider in providers:
            chosen += [
                c
                for c in cases
                if c.bench == bench and c.provider == provider and kind in (c.params.get("mask"), c.params.get("op"))
            ][:1]
    return chosen


def _kernel_profile(run, cases):
    """{case id: rows} for the KERNEL_PROFILE cases: torch.profiler over the plan's timed calls of
    each case after its warm-up calls, each kernel's device time (on a CPU: each operator's own CPU
    time, the code path only); the KERNEL_ROWS kernels with the most, per call of the case: calls,
    µs and share of the case's total, which the first row gives (calls: every kernel launched).
    {"not_run": reason} when the bench stage's budget is spent; a case that fails gives {"error"}."""
    from torch.profiler import ProfilerActivity, profile

    if time.monotonic() > run.deadline("bench"):
        return {"not_run": f"the bench stage's budget of {run.plan.budget_seconds['bench']} s was spent"}
    activity, device_type = (
        (ProfilerActivity.CUDA, DeviceType.CUDA) if run.cuda else (ProfilerActivity.CPU, DeviceType.CPU)
    )
    calls, profiles = max(run.plan.reps.measure, 1), {}
    for case in _profiled_cases(cases):
        try:
            fn, _ = case.setup()
            for _ in range(max(run.plan.reps.warmup, 1)):
                fn()
            synchronize(run.device)
            with profile(activities=[activity]) as profiler:
                for _ in range(calls):
                    fn()
                synchronize(run.device)
            profiles[case.id] = _kernel_rows(profiler.events(), device_type, calls)
        except Exception as error:  # noqa: BLE001 (a profile is a diagnosis: the stage's figures stand without it)
            profiles[case.id] = {"error": _error_text(error)}
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return profiles


def _kernel_rows(events, device_type, calls):
    """Rows of _kernel_profile from a profiler's events: those of device_type summed by name (on
    CUDA the kernels, copies and fills, each its duration on the device; on a CPU each operator's
    own time), per call of the case."""
    totals, counts = Counter(), Counter()
    cpu = device_type == DeviceType.CPU
    for event in events:
        if event.device_type == device_type:
            totals[event.name] += event.self_cpu_time_total if cpu else event.time_range.elapsed_us()
            counts[event.name] += 1
    whole = sum(totals.values())
    rows = [
        {
            "kernel": "every kernel of the case",
            "calls_per_run": sum(counts.values()) / calls,
            "us_per_run": round(whole / calls, 2),
            "share": 1.0,
        }
    ]
    for name, total in totals.most_common(KERNEL_ROWS):
        rows.append(
            {
                "kernel": name if len(name) <= 90 else name[:87] + "...",
                "calls_per_run": counts[name] / calls,
                "us_per_run": round(total / calls, 2),
                "share": round(total / whole, 3) if whole else None,
            }
        )
    return rows


def _bench_cases(run):
    """bench.report --targets' cases (in --quick, D 64 at L 4096, the tutorial's FFN layer, no compiled
    model), the model first; in --smoke a few tiny cases of every kind the report draws."""
    if run.mode == "smoke":

        def wanted(c):
            if c.bench == "attention_fwd":
                return (c.params["mask"], c.params["L"]) in (("padding_causal", 13), ("causal", 16))
            if c.bench == "attention_fwd_bwd":
                return c.params["mask"] == "causal" and c.params["L"] == 8 and c.provider != "reference"
            return c.bench == "ffn_fwd_bwd"

        return [c for c in suite.smoke_suite(run.device) if wanted(c)]
    cases = [c for c in suite.full_suite(run.device) if bench_report.judged(c)]
    if run.mode == "quick":

        def wanted(c):
            if c.bench.startswith("attention"):
                return c.params["D"] == 64 and c.params["L"] == 4096
            if c.bench.startswith("ffn"):
                return c.params["M"] == 32768
            return c.provider in run.plan.model_providers

        cases = [c for c in cases if wanted(c)]
    return sorted(cases, key=lambda c: BENCH_ORDER.index(c.bench) if c.bench in BENCH_ORDER else len(BENCH_ORDER))


def stage_model(run):
    details = _measure(run, "model", _model_cases(run))
    results = run.reports["model"]["results"]
    details["rows"] = [
        {k: r[k] for k in ("bench", "provider", "ms", "tokens_per_s", "peak_mem_mb", "tflops", "mfu")} for r in results
    ]
    details["mfu_note"] = None if run.gemm_rate() else "needs CUDA: the MFU denominator is the GPU's bf16 GEMM rate"
    parts = []
    for bench in ("model_train", "model_infer"):
        rows = {r["provider"]: r for r in results if r["bench"] == bench}
        variants = {p: rows.pop(p) for p in MODEL_VARIANTS if p in rows}
        ours = rows.pop("fastformer", None)
        if ours:
            peers = ", ".join(f"{r['ms'] / ours['ms']:.2f}x vs {p}" for p, r in rows.items())
            mfu = f", MFU {ours['mfu']:.1%}" if ours["mfu"] else ""
            speedups = f" (speed-up {peers})" if peers else ""
            parts.append(f"{bench[6:]}: fastformer {ours['tokens_per_s']:,.0f} tok/s{mfu}{speedups}")
            parts += [
                f"{bench[6:]}: {p} {r['tokens_per_s']:,.0f} tok/s ({ours['ms'] / r['ms']:.2f}x eager)"
                for p, r in variants.items()
            ]
    details["host_profile"] = _host_profile(run)
    details["host_calls"] = _host_calls(run)
    convergence = details["convergence"] = _convergence(run)
    parts.append(_convergence_note(convergence))
    details["summary"] = "; ".join(p for p in parts if p) or "nothing measured"
    _raise_for_cases(details)
    if not convergence.get("agree"):
        raise Failed(details["summary"], details)
    return details


PROFILE_ROWS = 15


def _host_profile(run):
    """{provider: rows} for the eager train step of the plan's host_profile providers at the model
    stage's batch: after the plan's warm-up steps, cProfile over its timed steps' number, the
    device synchronized before the profile ends; the PROFILE_ROWS functions with the most time of
    their own (Python, or a C function such as an aten op's binding), per step: calls, own ms,
    cumulative ms. The first row is the whole step's wall time under the profiler.
    {"not_run": reason} when the stage's budget is spent."""
    import cProfile
    import pstats

    if time.monotonic() > run.deadline("model"):
        return {"not_run": f"the model stage's budget of {run.plan.budget_seconds['model']} s was spent"}
    config = fastformer.Config.tutorial(**run.plan.config)
    amp = None if run.cuda else False  # as _model_cases
    steps, profile = max(run.plan.reps.measure, 1), {}
    for provider in run.plan.host_profile:
        case = suite.model_case(
            "train", "classify", provider, run.device, B=run.plan.model_batch, config=config, amp=amp
        )
        step, _ = case.setup()
        for _ in range(max(run.plan.reps.warmup, 1)):  # the first step plans, allocates and compiles
            step()
        synchronize(run.device)
        profiler = cProfile.Profile()
        start = time.perf_counter()
        profiler.enable()
        for _ in range(steps):
            step()
        synchronize(run.device)
        profiler.disable()
        wall = (time.perf_counter() - start) / steps * 1e3
        top = sorted(pstats.Stats(profiler).stats.items(), key=lambda item: -item[1][2])[:PROFILE_ROWS]
        whole = {"function": "the whole step (wall)", "calls_per_step": 1, "own_ms_per_step": None}
        profile[provider] = [{**whole, "cum_ms_per_step": round(wall, 3)}] + [
            {
                "function": _where(file, line, name),
                "calls_per_step": calls / steps,
                "own_ms_per_step": round(own / steps * 1e3, 3),
                "cum_ms_per_step": round(cum / steps * 1e3, 3),
            }
            for (file, line, name), (_, calls, own, cum, _) in top
        ]
    return profile


HOST_CALLS = 2000  # calls of each kind per round on CUDA (2 on a CPU, where it only checks the code)


def _host_calls(run):
    """[{call, us_per_call}] ({call, us_per_call None, error} for a call that failed): single
    launches and an allocation on this machine's host, each kind
    enqueued back to back, the device synchronized between rounds, best of 3 rounds: an aten
    allocation, an elementwise op, bf16 products (torch.mm, F.linear with and without a bias, under
    autocast as the model calls them), and tools.host_overhead's floors, a one-pointer Triton
    kernel launched four ways (Triton's `kernel[grid]`, fastformer's `launch(kernel)[grid]`, a
    PreparedLaunch as the ops' plans launch it, a torch.library triton_op). Each kernel is tiny,
    so the host sets the pace: what one call costs here, to read the host profile against (the
    instrument times the floors on a CPU, without a driver).
    {"not_run": reason} when the model stage's budget is spent."""
    from tools.host_overhead import _floors

    if time.monotonic() > run.deadline("model"):
        return {"not_run": f"the model stage's budget of {run.plan.budget_seconds['model']} s was spent"}
    device, calls = run.device, HOST_CALLS if run.cuda else 2
    a, w, b = (torch.randn(*shape, device=device, dtype=torch.bfloat16) for shape in ((64, 64), (64, 64), (64,)))
    x = torch.zeros(16, device=device)
    autocast_type = "cuda" if run.cuda else "cpu"

    def autocast_linear():
        with torch.autocast(autocast_type, dtype=torch.bfloat16):
            return F.linear(a, w, b)

    kinds = {
        "torch.empty(1024)": lambda: torch.empty(1024, device=device),
        "x.add_(1)": lambda: x.add_(1),
        "torch.mm, bf16 64 x 64": lambda: torch.mm(a, w),
        "F.linear with a bias, bf16 64 x 64": lambda: F.linear(a, w, b),
        "F.linear without a bias": lambda: F.linear(a, w),
        "F.linear with a bias, under bf16 autocast": autocast_linear,
    }
    for name, call in _floors(device).items():
        # torch 2.11's wrap_triton refuses the interpreter's kernels: no triton_op floor in a CPU smoke run
        if not (kernels.INTERPRET and name == "triton_op"):
            kinds[f"one-pointer Triton kernel, {name}"] = call
    rows = []
    for name, call in kinds.items():
        try:
            call()  # compiles, or allocates the library's handles
            synchronize(device)
            best = float("inf")
            for _ in range(3):
                start = time.perf_counter()
                for _ in range(calls):
                    call()
                best = min(best, time.perf_counter() - start)
                synchronize(device)
        except Exception as error:  # noqa: BLE001 (a diagnosis: the stage's figures stand without it)
            rows.append({"call": name, "us_per_call": None, "error": _error_text(error)})
            continue
        rows.append({"call": name, "us_per_call": round(best / calls * 1e6, 2)})
    return rows


def _where(file, line, name):
    """A profiled function as path:line(name), the path from site-packages or the repository, or a
    C function's name."""
    if file == "~":
        return name
    for root in ("site-packages/", ROOT + "/"):
        if root in file:
            file = file.split(root)[-1]
    return f"{file}:{line}({name})"


def _model_cases(run):
    """MovieClassification train step and inference on review batches (tools.benchmarks.cases.model_case),
    each credited its model FLOPs (model_flops) so the report computes TFLOP/s and MFU."""
    config = fastformer.Config.tutorial(**run.plan.config)
    amp = None if run.cuda else False  # None: each provider's own (fastformer bf16, reference_fp32 fp32, ...)
    # without autocast (a CPU), "reference" would repeat reference_fp32; compile stays, to show its skip
    providers = run.plan.model_providers if run.cuda else tuple(p for p in run.plan.model_providers if p != "reference")
    enc, dec, _ = suite._review_batch(config, run.plan.model_batch, False, "cpu")  # the batch the cases build
    lengths = enc.ne(config.i_pad).sum(1).tolist(), dec.ne(config.i_pad).sum(1).tolist()
    cases = []
    for kind in ("train", "infer"):
        for provider in providers:
            case = suite.model_case(
                kind, "classify", provider, run.device, B=run.plan.model_batch, config=config, amp=amp
            )
            case.flops = model_flops(config, *lengths, kind)
            cases.append(case)
        for variant in run.plan.model_variants:
            if kind != "train" and variant in TRAIN_VARIANTS:
                continue
            case = model_variant_case(kind, variant, run.device, run.plan.model_batch, config, amp=run.cuda)
            case.flops = model_flops(config, *lengths, kind)
            cases.append(case)
    return cases


def _convergence(run):
    """convergence_curves at the plan's config, batch and steps on this run's device and autocast,
    judged by compare_curves; {"not_run": reason} when the stage's budget is spent."""
    if time.monotonic() > run.deadline("model"):
        return {"not_run": f"the model stage's budget of {run.plan.budget_seconds['model']} s was spent"}
    plan = run.plan.convergence
    config, batches = convergence_setup(run.plan.config, plan["batch"], plan["steps"], plan["reviews"])
    curves = convergence_curves(config, batches, run.device, run.amp)
    result = compare_curves(curves, LOSS_ATOL[run.amp])
    curve = [
        dict(step=i + 1, **{f"{name}_loss": values[i] for name, values in curves.items()}) for i in range(len(batches))
    ]
    sizes = {
        k: config[k] for k in ("n_layer", "d_hidn", "n_head", "d_head", "d_ff", "n_enc_seq", "n_enc_vocab", "dropout")
    }
    print(
        f"convergence: {len(batches)} steps, max |fastformer - fp64| {result['max_loss_diff']:.3g} "
        f"(tolerance {result['loss_tolerance']:.3g}), {'agree' if result['agree'] else 'DISAGREE'}",
        flush=True,
    )
    return {"config": sizes, **plan, "amp": run.amp, "lr": CONVERGENCE_LR, "curve": curve, **result}


def _convergence_note(convergence):
    if "not_run" in convergence:
        return f"convergence not run: {convergence['not_run']}"
    verdict = "agree" if convergence["agree"] else f"DISAGREE at step {convergence['worst_step']}"
    return (
        f"convergence over {convergence['steps']} steps: triton and reference loss curves {verdict} "
        f"(max |fastformer - fp64| {convergence['max_loss_diff']:.2g}, "
        f"tolerance {convergence['loss_tolerance']:.2g})"
    )


def _measure(run, stage, cases):
    """bench.report.run, one case at a time, into run.reports[stage]: the budget is checked and
    results.json rewritten after each case. Compiled providers start from a reset Dynamo, so no
    shared compiled function reaches Dynamo's recompile limit (past it, Dynamo silently runs the
    function eagerly). Returns the stage's counts."""
    gemm_rate = run.gemm_rate()
    report = run.reports[stage] = {"env": run.env, "results": [], "skipped": [], "failed": []}
    deadline, not_run = run.deadline(stage), 0
    for i, case in enumerate(cases, 1):
        if time.monotonic() > deadline:
            reason = f"not run: the {stage} stage's budget of {run.plan.budget_seconds[stage]} s was spent"
            report["skipped"].append(
                {"bench": case.bench, "provider": case.provider, "params": case.params, "reason": reason}
            )
            not_run += 1
            continue
        print(f"[{stage} {i}/{len(cases)}] {case.id}", flush=True)
        if case.provider in COMPILED_PROVIDERS:
            torch._dynamo.reset()
        part = bench_report.run(
            [case],
            run.device,
            warmup=run.plan.reps.warmup,
            rep=run.plan.reps.measure,
            gemm_rate=gemm_rate,
            log=lambda line: print(line, flush=True),
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


def _raise_for_cases(details):
    if details["failed"] or details["not_run"]:
        raise Failed(
            f'{details["failed"]} cases failed (errors in the report\'s "failed" list), '
            f"{details['not_run']} not run: {details['summary']}",
            details,
        )


STAGE_FUNCTIONS = {
    "env": stage_env,
    "tests": stage_tests,
    "compile": stage_compile,
    "determinism": stage_determinism,
    "bench": stage_bench,
    "model": stage_model,
}


# ----------------------------------------------------------------------------------------------
# summary
# ----------------------------------------------------------------------------------------------
def _note(entry):
    if entry["status"] == "skipped":
        return entry["reason"]
    if entry["status"] == "failed":
        return entry["details"].get("summary") or entry["error"]
    return entry["details"].get("summary", "")


def _required(target):
    sign = "<=" if target["target"] == bench_report.MEMORY_TARGET[0] else ">="
    return f"{sign} {target['required']}x"


def _met(target, judged):
    if not judged:
        return "not judged (CPU)"
    return "not measured" if target["met"] is None else ("met" if target["met"] else "NOT MET")


def _worst(target):
    return "-" if target["worst"] is None else f"{target['worst']:.2f}x"


def summary_table(document):
    """The plain-text table printed at the end: stages, then targets."""
    lines = [f"{'stage':<12} {'status':<8} {'time':>8}  note"]
    for name, entry in document["stages"].items():
        seconds = "-" if entry["seconds"] is None else f"{entry['seconds']:.1f} s"
        lines.append(f"{name:<12} {entry['status']:<8} {seconds:>8}  {_note(entry)}")
    width = max(len(t["target"]) for t in document["targets"])
    lines += ["", f"{'target':<{width}}  {'required':>9}  {'measured':>8}  result"]
    for t in document["targets"]:
        lines.append(
            f"{t['target']:<{width}}  {_required(t):>9}  {_worst(t):>8}  {_met(t, not document['targets_note'])}"
        )
    return "\n".join(lines)


def summary_markdown(document):
    env = document["env"]
    if document["finished"]:
        status = f"finished {document['finished']}"
    else:
        status = "**not finished**: still running, or killed (a stage marked running did not end)"
    lines = [
        f"# gpu_check on {env['gpu']} ({document['mode']})",
        "",
        f"torch {env['torch']}, Triton {env['triton']}, CUDA {env['cuda']}; started {document['started']}, {status}.",
        f"Command: `{document['command']}`",
        "",
        "| stage | status | time | note |",
        "|---|---|---|---|",
    ]
    for name, entry in document["stages"].items():
        seconds = "-" if entry["seconds"] is None else f"{entry['seconds']:.1f} s"
        lines.append(f"| {name} | {entry['status']} | {seconds} | {_cell(_note(entry))} |")
    lines += ["", "## Targets", ""]
    if document["targets_note"]:
        lines += [f"Targets {document['targets_note']}.", ""]
    lines += ["| target | required | measured (worst) | cases | result |", "|---|---|---|---|---|"]
    judged = not document["targets_note"]
    lines += [
        f"| {t['target']} | {_required(t)} | {_worst(t)} | {t['cases']} | {_met(t, judged)} |"
        for t in document["targets"]
    ]
    for name, entry in document["stages"].items():
        lines += ["", f"## {name}: {entry['status']}", ""]
        if entry["reason"]:
            lines.append(f"Reason: {entry['reason']}")
        lines += _markdown_details(entry["details"])
        if entry["traceback"]:
            lines += ["", "```text", entry["traceback"].rstrip(), "```"]
    if document["report"]["results"] or document["report"]["failed"]:
        lines += ["", "## Benchmarks", "", bench_report.markdown(document["report"], targets=False).rstrip()]
        for failure in document["report"]["failed"]:
            lines.append(f"- failed: {failure['bench']} {failure['provider']} {failure['params']}: {failure['error']}")
    if document["plots"]:
        lines += ["", "Plots: " + ", ".join(document["plots"])]
    return "\n".join(lines) + "\n"


def _cell(text):
    return str(text).replace("|", "\\|").replace("\n", " ")


def _markdown_details(details, prefix=""):
    """A stage's details: lists of records and {name: record} as tables, other lists as bullets,
    a dict holding records or lists through its keys (`attention.settings`), anything else on a line."""
    lines = []
    for key, value in details.items():
        name = prefix + key
        if key == "summary" and not prefix:
            continue
        if isinstance(value, dict) and value and all(isinstance(v, dict) for v in value.values()):
            lines += _markdown_table(name, list(value.values()), list(value))
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            lines += _markdown_table(name, value)
        elif isinstance(value, dict) and any(isinstance(v, (dict, list)) for v in value.values()):
            lines += _markdown_details(value, prefix=f"{name}.")
        elif isinstance(value, list):
            lines.append(f"- {name}: " + ("none" if not value else ""))
            lines += [f"  - {_cell(_fmt(v))}" for v in value[:30]]
            if len(value) > 30:
                lines.append(f"  - ... {len(value) - 30} more (results.json has them all)")
        else:
            lines.append(f"- {name}: {_cell(_fmt(value))}")
    return lines


def _markdown_table(name, rows, labels=None):
    columns = list(dict.fromkeys(k for row in rows for k in row))
    head = ([""] if labels else []) + columns
    lines = ["", f"{name}:", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for i, row in enumerate(rows):
        cells = ([labels[i]] if labels else []) + [_cell(_fmt(row.get(c))) for c in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return [*lines, ""]


def _fmt(value):
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (dict, list)):
        return json.dumps(value, default=str)
    return "-" if value is None else str(value)


# ----------------------------------------------------------------------------------------------
# the command
# ----------------------------------------------------------------------------------------------
class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(f"{message} (see --help)")


class _Tee:
    """A text stream that writes to the console and to log.txt, flushing both at every write."""

    def __init__(self, stream, log):
        self._stream, self._log = stream, log

    def write(self, text):
        self._stream.write(text)
        self._stream.flush()
        self._log.write(text)
        self._log.flush()
        return len(text)

    def flush(self):
        self._stream.flush()
        self._log.flush()

    def __getattr__(self, name):
        return getattr(self._stream, name)


def parse_args(argv):
    parser = _Parser(prog="python -m tools.gpu_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, metavar="DIR", help="the folder the files go to (created if needed)")
    parser.add_argument(
        "--stage",
        default=",".join(STAGES),
        help=f"comma-separated stages to run, from: {', '.join(STAGES)} (default: all)",
    )
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="a reduced matrix of every stage (under 9 minutes)")
    size.add_argument("--smoke", action="store_true", help="tiny shapes; on a CPU through Triton's interpreter")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.stage.split(",") if n.strip()]
    unknown = [n for n in names if n not in STAGES]
    if unknown:
        raise UsageError(f"--stage: unknown stage {', '.join(map(repr, unknown))}; the stages are {', '.join(STAGES)}")
    if not names:
        raise UsageError(f"--stage: no stage given; the stages are {', '.join(STAGES)}")
    args.stages = [s for s in STAGES if s in names]
    args.mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    return args


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = parse_args(argv)
    except UsageError as error:
        print(f"gpu_check: {error}", file=sys.stderr)
        return 2
    try:
        os.makedirs(args.out, exist_ok=True)
        _clear_outputs(args.out)
    except OSError as error:
        print(f"gpu_check: --out {args.out}: {error}", file=sys.stderr)
        return 2
    run = Run(args.out, args.stages, args.mode, shlex.join(["python", "-m", "tools.gpu_check", *argv]))
    with open(os.path.join(args.out, "log.txt"), "w", encoding="utf-8", errors="replace") as log:
        stdout, stderr = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = _Tee(stdout, log), _Tee(stderr, log)
        try:
            print(
                f"gpu_check {run.mode} on {run.env['gpu']} ({run.device.type}): stages {', '.join(args.stages)}; "
                f"torch {run.env['torch']}, Triton {run.env['triton']}; writing into {args.out}",
                flush=True,
            )
            for name in args.stages:
                run_stage(run, name)
            run.finished = _now()
        finally:
            try:
                for entry in run.stages.values():
                    if entry["status"] == "running":
                        entry["status"] = "interrupted"
                run.write()
                print("\n" + summary_table(run.document()), flush=True)
            finally:
                sys.stdout, sys.stderr = stdout, stderr
    return 1 if any(e["status"] == "failed" for e in run.stages.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
