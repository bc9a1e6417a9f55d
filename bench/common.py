"""What every benchmark shares: timing, peak memory, FLOP formulas, the environment record.

FLOP formulas (multiply-adds count 2):
- attention forward: 4 * B * H * Lq * Lk * D (QK^T and PV); causal counts half; backward is 2.5x
  the forward, so forward + backward is 3.5x. Padding is counted as the dense problem: every
  provider is credited the same FLOPs, so TFLOP/s ratios are time ratios.
- FFN forward: 2 * M * d * d_ff * 2 (two GEMMs); backward 2x the forward (dX and dW per GEMM).
- MFU: achieved TFLOP/s over the GPU's bf16 GEMM rate measured in the same run (8192^3 matmul).
"""

import contextlib
import datetime
import os
import re
import statistics
import sys
import tempfile
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.autograd import DeviceType

from bench.timing import Timing, device_times, graph_times, synchronize, wall_times


def attention_flops(B, H, Lq, Lk, D, causal, mode):
    forward = 4 * B * H * Lq * Lk * D * (0.5 if causal else 1.0)
    return forward * (3.5 if mode == "fwd_bwd" else 1.0)


def ffn_flops(M, d, d_ff, mode):
    forward = 2 * M * d * d_ff * 2
    return forward * (3.0 if mode == "fwd_bwd" else 1.0)


def time_ms(fn, device, warmup=3, rep=10):
    """Median wall time of fn() in ms, synchronizing the device after each call."""
    return statistics.median(wall_times(fn, device, warmup, rep))


def peak_memory_mb(fn, device):
    """Peak CUDA memory allocated while fn() runs, in MB (None on a CPU)."""
    device = torch.device(device)
    if device.type != "cuda":
        fn()
        return None
    synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    fn()
    synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - base) / 2**20


def gemm_tflops(device, dtype=torch.bfloat16, n=8192):
    """The measured dense GEMM rate (TFLOP/s) of this device: the MFU denominator."""
    device = torch.device(device)
    if device.type != "cuda":
        n = 512
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    ms = time_ms(lambda: a @ b, device, warmup=3, rep=10)
    return 2 * n**3 / (ms * 1e-3) / 1e12


def environment(device):
    device = torch.device(device)
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": torch.version.cuda,
        "date": datetime.date.today().isoformat(),
    }


class Skip(Exception):
    """A provider that cannot run a case here (say why); the report records it, pytest skips it."""


@dataclass
class Case:
    """One measurement: `run` is the timed callable; `check()` raises if its result is wrong.

    `setup()` builds the inputs and returns (run, check); it may raise Skip.
    """

    bench: str  # attention_fwd, attention_fwd_bwd, ffn_fwd, ffn_fwd_bwd, add_layer_norm, model_train, model_infer
    provider: str  # fastformer, reference, reference_fp32, sdpa, flex, compile, eager
    params: dict
    setup: Callable
    flops: float | None = None
    tokens: int | None = None
    extra: dict = field(default_factory=dict)
    timing: str = "device"  # "device": a kernel case (events, and graph replays); "wall": a step

    @property
    def id(self):
        parts = [self.bench, self.provider] + [f"{k}={v}" for k, v in self.params.items()]
        return "-".join(str(p) for p in parts)


KERNEL_ROWS = 8  # kernels listed per profiled case, the most device time first


# Kineto's own lines, which the C++ side writes to stderr around every profile: `USDT:<time> <pid>:<tid>
# SyncActivityProfilerHandler.cpp:52] profiler_start` and its stop, and on torch 2.11 without a GPU
# `ERROR:... DeviceProperties.cpp:48] gpuGetDeviceCount failed with code 35`. They say nothing of the
# benchmarks, and mixed into a report's table on stdout's terminal they break it up.
KINETO_NOISE = re.compile(
    r"(USDT|ERROR):\d{4}-\d\d-\d\d [\d:]+ \d+:\d+ \w+\.cpp:\d+\] (profiler_st(art|op)|gpuGetDeviceCount failed)"
)


@contextlib.contextmanager
def profiling(activities):
    """torch.profiler.profile(activities=activities), with Kineto's lines on stderr (KINETO_NOISE)
    held back: what else is written to stderr meanwhile goes on to it when the block ends."""
    from torch.profiler import profile

    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            with profile(activities=activities) as profiler:
                yield profiler
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            for line in held.read().decode(errors="replace").splitlines(keepends=True):
                if not KINETO_NOISE.match(line):
                    sys.stderr.write(line)


def profile_kernels(fn, device, calls=3):
    """Where a call's device time goes: torch.profiler over `calls` calls of fn() (already warm),
    each kernel's time on the device (on a CPU: each operator's own CPU time, the code path only),
    as kernel_rows: the KERNEL_ROWS kernels with the most, per call, after a row for the whole."""
    from torch.profiler import ProfilerActivity

    cuda = torch.device(device).type == "cuda"
    activity, device_type = (ProfilerActivity.CUDA, DeviceType.CUDA) if cuda else (ProfilerActivity.CPU, DeviceType.CPU)
    synchronize(device)
    with profiling([activity]) as profiler:
        for _ in range(calls):
            fn()
        synchronize(device)
    return kernel_rows(profiler.events(), device_type, calls)


def kernel_rows(events, device_type, calls):
    """Rows of profile_kernels from a profiler's events: those of device_type summed by name (on
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


def measure(case, device, warmup=3, rep=25, profile=False):
    """Run a case: check it, time it (bench.timing: a kernel case by device time as called
    and replayed from a CUDA graph, a step by wall time; `rep` repetitions after `warmup` calls),
    and its memory: peak_mem_mb, allocated at the peak of a timed call above what was allocated before
    it, and resident_mb, allocated and held once the case is set up and has run (inputs, weights,
    optimizer state, a CUDA graph's pool); with `profile`, also its kernels (profile_kernels, or
    {"error"}: a profile is a diagnosis, the figures stand without it). Returns a result record
    (RECORD_KEYS, and "kernels" when profiled)."""
    cuda = torch.device(device).type == "cuda"
    base = torch.cuda.memory_allocated(device) if cuda else None
    run, check = case.setup()
    run()
    synchronize(device)
    check()
    resident = (torch.cuda.memory_allocated(device) - base) / 2**20 if cuda else None
    if case.timing == "wall":
        timed = Timing.of(wall_times(run, device, warmup, rep))
    else:
        timed = Timing.of(device_times(run, device, warmup, rep))
    replayed, graph_note = None, _graph_note(case, device)
    if graph_note is None:
        try:
            replayed = Timing.of(graph_times(run, device, warmup, rep))
        except Exception as error:  # noqa: BLE001 (a provider that cannot be captured: said in the record)
            graph_note = f"not captured: {type(error).__name__}: {str(error).strip().splitlines()[0][:200]}"
    peak = peak_memory_mb(run, device)
    record = {
        "case": case.id,
        "bench": case.bench,
        "provider": case.provider,
        "params": dict(case.params, **case.extra),
        "timing": case.timing,
        **_figures("", timed),
        **_figures("graph_", replayed),
        "graph_note": graph_note,
        "flops": case.flops,
        "tflops": case.flops / (timed.median * 1e-3) / 1e12 if case.flops else None,
        "graph_tflops": case.flops / (replayed.median * 1e-3) / 1e12 if case.flops and replayed else None,
        "tokens_per_s": case.tokens / (timed.median * 1e-3) if case.tokens else None,
        "peak_mem_mb": peak,
        "resident_mb": resident,
    }
    if profile:
        try:
            record["kernels"] = profile_kernels(run, device, calls=3 if torch.device(device).type == "cuda" else 1)
        except Exception as error:  # noqa: BLE001 (said in the record)
            record["kernels"] = {"error": f"{type(error).__name__}: {str(error).strip().splitlines()[0][:200]}"}
    return record


RECORD_KEYS = (
    "case", "bench", "provider", "params", "timing", "ms", "p20_ms", "p80_ms", "reps", "graph_ms", "graph_p20_ms",
    "graph_p80_ms", "graph_reps", "graph_note", "flops", "tflops", "graph_tflops", "tokens_per_s", "peak_mem_mb",
    "resident_mb",
)  # fmt: skip


def _graph_note(case, device):
    """Why a case is not replayed from a CUDA graph, or None when it is to be."""
    if case.timing == "wall":
        return "a step: timed as a user calls it (its replayed form is a provider of its own)"
    if torch.device(device).type != "cuda":
        return "needs CUDA: a CUDA graph replays device work"
    return None


def _figures(prefix, timed):
    keys = (f"{prefix}ms", f"{prefix}p20_ms", f"{prefix}p80_ms", f"{prefix}reps")
    values = (timed.median, timed.p20, timed.p80, timed.reps) if timed else (None,) * 4
    return dict(zip(keys, values))


def assert_close_to(name, out, expected, atol, rtol=0.0):
    """Raise AssertionError naming the worst element when out is not within atol + rtol*|expected|."""
    out, expected = out.float(), expected.float()
    err = (out - expected).abs()
    bound = atol + rtol * expected.abs()
    if not bool((err <= bound).all()):
        worst = int((err - bound).flatten().argmax())
        raise AssertionError(
            f"{name}: max error {err.max().item():.3g} exceeds atol {atol} (+ rtol {rtol}); worst at flat index "
            f"{worst}: got {out.flatten()[worst].item():.6g}, expected {expected.flatten()[worst].item():.6g}"
        )


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
