"""The device-time method and the judging of targets, on fake timings: percentiles and spread, the
interval of a ratio, "met" / "not met" / "within noise", the L2 flush before each timed call and
outside its events, the replayed figure preferred where both sides have one, the fastest peer, and
each kind of target (speed-up, TFLOP/s, memory, a fallback peer)."""

import pytest
import torch

from bench import targets, timing
from bench.common import Case
from bench.timing import MET, NOT_MEASURED, NOT_MET, WITHIN_NOISE, Ratio, Timing, verdict


def test_timing_is_the_median_with_the_20th_and_80th_percentiles():
    t = Timing.of([6.0, 1.0, 5.0, 2.0, 4.0, 3.0])  # any order
    assert (t.median, t.p20, t.p80, t.reps) == (3.5, 2.0, 5.0, 6)
    t = Timing.of(list(range(1, 11)))  # 1..10: positions 1.8 and 7.2 interpolated
    assert (t.median, t.p20, t.p80) == (5.5, pytest.approx(2.8), pytest.approx(8.2))
    assert Timing.of([2.5]) == Timing(2.5, 2.5, 2.5, 1)
    with pytest.raises(ValueError, match="no timings"):
        Timing.of([])


def test_a_ratio_carries_the_interval_both_spreads_allow():
    peer, ours = Timing(10.0, 9.0, 12.0, 25), Timing(5.0, 4.0, 6.0, 25)
    ratio = Ratio.of(peer, ours)
    assert (ratio.median, ratio.low, ratio.high) == (2.0, 1.5, 3.0)  # 9/6 and 12/4


@pytest.mark.parametrize(
    "low, high, required, at_most, expected",
    [
        (1.5, 3.0, 1.5, False, MET),  # the whole interval at or above
        (1.5, 3.0, 3.1, False, NOT_MET),  # the whole interval below
        (1.5, 3.0, 2.0, False, WITHIN_NOISE),  # the requirement inside the interval
        (0.3, 0.35, 0.4, True, MET),  # memory: at most
        (0.45, 0.5, 0.4, True, NOT_MET),
        (0.35, 0.45, 0.4, True, WITHIN_NOISE),
    ],
)
def test_a_verdict_is_met_or_not_only_when_the_interval_is_on_one_side(low, high, required, at_most, expected):
    assert verdict(Ratio((low + high) / 2, low, high), required, at_most) == expected


def test_device_times_flush_the_l2_before_each_call_outside_its_events(monkeypatch):
    """The CUDA path with fake events: warm-up calls untimed, then per repetition the flush, the
    start event, the call, the end event; each repetition's time is its pair of events'."""
    log = []

    class FakeEvent:
        count = 0

        def __init__(self, enable_timing):
            assert enable_timing
            FakeEvent.count += 1
            self.index = FakeEvent.count

        def record(self):
            log.append(f"event {self.index}")

        def elapsed_time(self, end):
            return float(end.index - self.index)  # 1.0 for every start/end pair below

    class FakeBuffer:
        def zero_(self):
            log.append("flush")

    def empty(size, dtype, device):
        assert size >= 2**28 and dtype == torch.int8  # larger than any GPU's L2
        return FakeBuffer()

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: log.append("sync"))
    monkeypatch.setattr(timing.torch, "empty", empty)
    times = timing.device_times(lambda: log.append("call"), "cuda", warmup=2, rep=3)
    assert times == [3.0, 3.0, 3.0]  # starts are events 1-3, ends 4-6
    assert log == [
        "call", "call", "sync",  # warm-up, untimed
        "flush", "event 1", "call", "event 4",
        "flush", "event 2", "call", "event 5",
        "flush", "event 3", "call", "event 6",
        "sync",
    ]  # fmt: skip


def test_on_a_cpu_device_time_falls_back_to_the_host_clock():
    calls = []
    times = timing.device_times(lambda: calls.append(1), "cpu", warmup=2, rep=5)
    assert len(calls) == 7 and len(times) == 5 and all(t >= 0 for t in times)
    with pytest.raises(RuntimeError, match="CUDA graphs need a CUDA device"):
        timing.capture(lambda: None, "cpu")


def record(provider, ms, spread=0.1, graph_ms=None, bench="attention_fwd", timing_kind="device", **params):
    """A result record as bench.common.measure writes it, with a symmetric spread."""
    params = {"D": 64, "mask": "causal", "L": 4096, "dtype": "bf16", **params}

    def figures(prefix, value):
        if value is None:
            return {f"{prefix}ms": None, f"{prefix}p20_ms": None, f"{prefix}p80_ms": None, f"{prefix}reps": None}
        return {
            f"{prefix}ms": value,
            f"{prefix}p20_ms": value * (1 - spread),
            f"{prefix}p80_ms": value * (1 + spread),
            f"{prefix}reps": 25,
        }

    return {
        "bench": bench,
        "provider": provider,
        "params": params,
        "timing": timing_kind,
        **figures("", ms),
        **figures("graph_", graph_ms),
        "flops": 1e12,
        "tflops": 1e12 / (ms * 1e-3) / 1e12,
        "peak_mem_mb": None,
    }


def judged(name, results):
    (target,) = [t for t in targets.TARGETS if t.name == name]
    return targets.evaluate(target, results)


SDPA_TARGET = "attention_fwd, D64 causal L>=4096: vs the fastest SDPA"


def test_the_fastest_peer_is_compared_on_the_replayed_figure_where_both_have_one():
    results = [
        record("fastformer", 1.0, spread=0.01, graph_ms=0.8),
        record("sdpa", 2.0, spread=0.01, graph_ms=1.6),
        record("sdpa_flash", 1.5, spread=0.01, graph_ms=1.2),  # the fastest SDPA backend
        record("sdpa_cudnn", 0.5, spread=0.01),  # faster as called, but never replayed: compared on events
    ]
    row = judged(SDPA_TARGET, results)
    assert row["peer"] == "sdpa_cudnn" and row["basis"] == "events"  # 0.5 / 1.0: the fastest, on events
    assert row["worst"] == pytest.approx(0.5) and row["verdict"] == NOT_MET and row["met"] is False
    row = judged(SDPA_TARGET, results[:3])
    assert row["peer"] == "sdpa_flash" and row["basis"] == "graph"
    assert row["worst"] == pytest.approx(1.5) and row["verdict"] == MET and row["met"] is True
    assert row["cases"] == 1 and row["low"] == pytest.approx(1.2 * 0.99 / (0.8 * 1.01))


def test_a_target_whose_interval_straddles_the_requirement_is_within_noise():
    results = [record("fastformer", 1.0, spread=0.2), record("sdpa", 1.05, spread=0.2)]
    row = judged(SDPA_TARGET, results)
    assert row["verdict"] == WITHIN_NOISE and row["met"] is None
    assert row["low"] < 1.0 < row["high"]


def test_the_worst_case_decides_and_a_missing_side_is_not_measured():
    results = [
        record("fastformer", 1.0, spread=0.0),
        record("sdpa", 2.0, spread=0.0),
        record("fastformer", 1.0, spread=0.0, L=8192),
        record("sdpa", 0.9, spread=0.0, L=8192),  # the worst case: 0.9x
        record("fastformer", 1.0, spread=0.0, L=16384),  # no peer here: not counted
        record("sdpa", 0.1, spread=0.0, L=1024),  # not a case of the target (L < 4096)
    ]
    row = judged(SDPA_TARGET, results)
    assert row["cases"] == 2 and row["worst"] == pytest.approx(0.9) and row["verdict"] == NOT_MET
    row = judged(SDPA_TARGET, [record("fastformer", 1.0)])
    assert row["verdict"] == NOT_MEASURED and row["met"] is None and row["worst"] is None


def test_tflops_memory_and_fallback_targets():
    fast = record("fastformer", 2.5, spread=0.0, graph_ms=2.0)  # 1e12 FLOP in 2.0 ms replayed: 500 TFLOP/s
    row = judged("attention_fwd, D64 causal L>=4096: TFLOP/s", [fast])
    assert row["worst"] == pytest.approx(500.0) and row["basis"] == "graph" and row["verdict"] == MET

    def step(provider, ms, peak):
        params = {"scenario": "classify", "B": 128, "n_layer": 6, "d_hidn": 256, "amp": provider != "reference_fp32"}
        r = record(provider, ms, bench="model_train", timing_kind="wall")
        return dict(r, params=params, peak_mem_mb=peak)

    steps = [step("fastformer", 40.0, 500.0), step("reference_fp32", 50.0, 1000.0), step("fastformer_graphs", 7.0, 0)]
    row = judged("model_train, tutorial: eager peak memory vs reference_fp32", steps)
    assert row["worst"] == 0.5 and row["verdict"] == NOT_MET  # 0.5x against at most 0.4x
    row = judged("model_train, tutorial: replayed step vs reference_fp32 eager", steps)
    assert row["basis"] == "wall" and row["worst"] == pytest.approx(50 / 7)

    def norm(provider, ms):
        return dict(record(provider, ms, spread=0.0, bench="add_layer_norm"), params={"mode": "fwd_bwd", "M": 8})

    name = "add_layer_norm fwd_bwd: vs Liger-Kernel"
    liger = judged(name, [norm("fastformer", 1.0), norm("liger", 1.2), norm("eager", 3.0)])
    assert liger["target"] == "add_layer_norm fwd_bwd: vs Liger-Kernel" and liger["peer"] == "liger"
    fallback = judged(name, [norm("fastformer", 1.0), norm("eager", 3.0)])
    assert fallback["target"] == "add_layer_norm fwd_bwd: vs eager (no Liger-Kernel)"
    assert fallback["peer"] == "eager" and fallback["verdict"] == MET  # 3.0x against at least 1.5x


def test_judged_names_the_cases_a_target_reads():
    params = {"D": 64, "mask": "causal", "L": 4096, "dtype": "bf16"}
    assert targets.judged(Case("attention_fwd", "sdpa_cudnn", params, setup=None))
    assert targets.judged(Case("attention_fwd", "fastformer", params, setup=None))
    assert not targets.judged(Case("attention_fwd", "reference", params, setup=None))
    assert not targets.judged(Case("attention_fwd", "sdpa", dict(params, L=1024), setup=None))
    norm = {"mode": "fwd_bwd", "M": 8}
    assert targets.judged(Case("add_layer_norm", "eager", norm, setup=None))  # the fallback's peer
