"""How a benchmark times a call, and how two timings are compared without over-reading noise.

Two methods, one per kind of case:

- **device** (kernel cases): CUDA events recorded around each call on the device's stream, the L2
  flushed before each call by zeroing a 256 MiB buffer (as `triton.testing.do_bench` does), after
  warm-up calls. Events measure the device's timeline, so a call whose host path is slower than
  its kernels still shows the gaps between them: the same call is therefore also captured in a
  CUDA graph and its replays timed the same way (`graph_times`), which leaves the host out. Both
  figures are reported; comparisons of kernels use the replayed figure where both sides have it.
- **wall** (train and inference steps: what a user waits for): the host clock around each call,
  the device synchronized after it.

On a CPU both methods fall back to the host clock (a CPU run checks the code paths; its figures
say nothing of a GPU), and graphs are not available.

Every figure is a `Timing`: the median of the repetitions with their 20th and 80th percentiles. A
ratio of two timings carries the interval its spreads allow (`Ratio`), and a target is judged
"met" or "not met" only when that whole interval is on one side of it, else "within noise".
"""

import math
import statistics
import time
from dataclasses import dataclass

import torch

FLUSH_BYTES = 256 * 2**20  # larger than any GPU's L2 (H100 50 MB, H200 50 MB, B200 126 MB)
GRAPH_WARMUP = 3  # calls on a side stream before a capture, as torch.cuda.graph's documentation asks
MET, NOT_MET, WITHIN_NOISE, NOT_MEASURED = "met", "not met", "within noise", "not measured"


@dataclass(frozen=True)
class Timing:
    """Milliseconds per call: the median of `reps` repetitions and its 20th and 80th percentiles."""

    median: float
    p20: float
    p80: float
    reps: int

    @classmethod
    def of(cls, times):
        """The Timing of a list of per-call milliseconds."""
        if not times:
            raise ValueError("no timings to summarize")
        ordered = sorted(times)
        return cls(statistics.median(ordered), percentile(ordered, 20), percentile(ordered, 80), len(ordered))


def percentile(ordered, p):
    """The p-th percentile of sorted values, linearly interpolated between the closest ranks (numpy's
    default): the 20th of [1, 2, 3, 4, 5, 6] is 2.0, the 80th is 5.0."""
    position = (len(ordered) - 1) * p / 100
    below, above = math.floor(position), math.ceil(position)
    return ordered[below] + (ordered[above] - ordered[below]) * (position - below)


def synchronize(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def wall_times(fn, device, warmup, rep):
    """Per-call wall milliseconds of fn(), the device synchronized after each call, after `warmup` calls."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    times = []
    for _ in range(rep):
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    return times


def device_times(fn, device, warmup, rep, flush=True):
    """Per-call device milliseconds of fn() between CUDA events, the L2 flushed before each call
    (outside the events), after `warmup` calls; on a CPU, wall_times."""
    device = torch.device(device)
    if device.type != "cuda":
        return wall_times(fn, device, warmup, rep)
    cache = torch.empty(FLUSH_BYTES, dtype=torch.int8, device=device) if flush else None
    for _ in range(warmup):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(rep)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(rep)]
    torch.cuda.synchronize(device)
    for start, end in zip(starts, ends):
        if cache is not None:
            cache.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize(device)
    return [start.elapsed_time(end) for start, end in zip(starts, ends)]


def capture(fn, device, warmup=GRAPH_WARMUP):
    """fn() captured in a CUDA graph after `warmup` calls on a side stream: returns the graph, whose
    replay() runs fn's kernels on the inputs fn read, with no host work but the one launch. Raises
    what the capture raises (a host sync, a CPU tensor, an op that cannot be captured)."""
    device = torch.device(device)
    if device.type != "cuda":
        raise RuntimeError("CUDA graphs need a CUDA device")
    stream = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)
    side.wait_stream(stream)
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    stream.wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def graph_times(fn, device, warmup, rep, flush=True):
    """device_times of fn() replayed from a CUDA graph (captured here, freed after)."""
    graph = capture(fn, device)
    try:
        return device_times(graph.replay, device, warmup, rep, flush)
    finally:
        del graph
        torch.cuda.empty_cache()


@dataclass(frozen=True)
class Ratio:
    """A ratio of two Timings with the interval their spreads allow: `low` puts each side at the
    end of its spread that makes the ratio smallest, `high` at the other."""

    median: float
    low: float
    high: float

    @classmethod
    def of(cls, numerator, denominator):
        """numerator / denominator for two Timings (a peer's time over ours: a speed-up)."""
        return cls(
            numerator.median / denominator.median,
            numerator.p20 / denominator.p80,
            numerator.p80 / denominator.p20,
        )


def verdict(ratio, required, at_most=False):
    """Whether `ratio` meets `required` (at least it; with at_most, at most it): MET or NOT_MET when
    the whole interval [low, high] is on one side of it, else WITHIN_NOISE."""
    low, high = (ratio.low, ratio.high) if not at_most else (-ratio.high, -ratio.low)
    bound = required if not at_most else -required
    if low >= bound:
        return MET
    if high < bound:
        return NOT_MET
    return WITHIN_NOISE
