"""What every benchmark shares: timing, peak memory, FLOP formulas, the environment record.

FLOP formulas (multiply-adds count 2):
- attention forward: 4 * B * H * Lq * Lk * D (QK^T and PV); causal counts half; backward is 2.5x
  the forward, so forward + backward is 3.5x. Padding is counted as the dense problem: every
  provider is credited the same FLOPs, so TFLOP/s ratios are time ratios.
- FFN forward: 2 * M * d * d_ff * 2 (two GEMMs); backward 2x the forward (dX and dW per GEMM).
- MFU: achieved TFLOP/s over the GPU's bf16 GEMM rate measured in the same run (8192^3 matmul).
"""

import datetime
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch


def attention_flops(B, H, Lq, Lk, D, causal, mode):
    forward = 4 * B * H * Lq * Lk * D * (0.5 if causal else 1.0)
    return forward * (3.5 if mode == "fwd_bwd" else 1.0)


def ffn_flops(M, d, d_ff, mode):
    forward = 2 * M * d * d_ff * 2
    return forward * (3.0 if mode == "fwd_bwd" else 1.0)


def synchronize(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn, device, warmup=3, rep=10):
    """Median wall time of fn() in ms, synchronizing the device around each call."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    times = []
    for _ in range(rep):
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


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

    @property
    def id(self):
        parts = [self.bench, self.provider] + [f"{k}={v}" for k, v in self.params.items()]
        return "-".join(str(p) for p in parts)


def measure(case, device, warmup=3, rep=10):
    """Run a case: check it, time it, and measure its peak memory; returns a result record."""
    run, check = case.setup()
    run()
    synchronize(device)
    check()
    ms = time_ms(run, device, warmup=warmup, rep=rep)
    peak = peak_memory_mb(run, device)
    return {
        "bench": case.bench,
        "provider": case.provider,
        "params": dict(case.params, **case.extra),
        "ms": ms,
        "tflops": case.flops / (ms * 1e-3) / 1e12 if case.flops else None,
        "tokens_per_s": case.tokens / (ms * 1e-3) if case.tokens else None,
        "peak_mem_mb": peak,
    }


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
