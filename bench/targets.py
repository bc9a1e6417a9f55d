"""The performance targets, and how one run's records are compared and judged.

A comparison pairs fastformer's record of a case with a peer's record of the same case (same bench
and params; `PROVIDER_PARAMS` say how a provider ran, not what it ran). Its figure is the pair's
common best basis: for kernel cases the time replayed from a CUDA graph where both were replayed
(the host's launch cost out), else the CUDA-event time; for steps the wall time. The speed-up is
the peer's time over ours, with the interval the two spreads allow (timing.Ratio).

A target names the bench and the cases it covers, the provider judged ("ours") and the peers: the
fastest of them in each case is the one compared, so "the fastest SDPA backend that runs the case"
is one target. Its verdict is the worst case's: "met" when every case's whole interval clears the
requirement, "not met" when some case's whole interval misses it, else "within noise"; "not
measured" when no case has both sides. The targets are those of the open performance issues:
the kernels against the fastest peer a user would pick (device time), and the tutorial's train
and inference steps against the reference at its best (wall time).
"""

import json
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

from bench.timing import MET, NOT_MEASURED, NOT_MET, WITHIN_NOISE, Ratio, Timing, verdict

# params that describe how a provider ran, not the case: the SDPA backend that ran, autocast
# (reference_fp32 is the model without it; the other providers run under bf16 autocast) and TF32
# (fastformer_tf32 and reference_tf32: the fp32 model with TF32 matmuls)
PROVIDER_PARAMS = ("sdpa_backend", "amp", "tf32")
SDPA_PEERS = ("sdpa", "sdpa_cudnn", "sdpa_flash", "sdpa_efficient")
REFERENCE_BEST = ("reference_compiled", "reference_reduce_overhead", "reference_graphs")


def case_key(record):
    """(bench, params as JSON without PROVIDER_PARAMS): the records of one case share it."""
    params = {k: v for k, v in record["params"].items() if k not in PROVIDER_PARAMS}
    return record["bench"], json.dumps(params, sort_keys=True)


def groups(results):
    """{case_key: {provider: record}}: each case with its providers' records."""
    by_case = defaultdict(dict)
    for record in results:
        by_case[case_key(record)][record["provider"]] = record
    return by_case


def timing(record, basis):
    """The record's Timing on `basis` ("graph": replayed; "events" or "wall": as called). A record
    of a run from before spreads were kept (its median alone) reads as a spread of zero."""
    prefix = "graph_" if basis == "graph" else ""
    median = record[f"{prefix}ms"]
    return Timing(
        median,
        record.get(f"{prefix}p20_ms", median),
        record.get(f"{prefix}p80_ms", median),
        record.get(f"{prefix}reps") or 0,
    )


def basis(ours, peer):
    """The figure two records of a case are compared on: "graph" where both were replayed from a
    CUDA graph, else "events" (device time as called) for kernel cases and "wall" for steps."""
    if ours.get("graph_ms") is not None and peer.get("graph_ms") is not None:
        return "graph"
    # a record without "timing" is from a run before device time: every case by wall clock
    return "events" if ours.get("timing") == peer.get("timing") == "device" else "wall"


def ratio_text(ratio):
    """A Ratio as "1.23x [1.20-1.26]": two decimals, or two significant digits below 0.1."""

    def number(x):
        return f"{x:.2f}" if x >= 0.1 else f"{x:.2g}"

    return f"{number(ratio.median)}x [{number(ratio.low)}-{number(ratio.high)}]"


def speedup(ours, peer):
    """(Ratio of the peer's time over ours, the basis): above 1, fastformer is faster."""
    on = basis(ours, peer)
    return Ratio.of(timing(peer, on), timing(ours, on)), on


@dataclass(frozen=True)
class Target:
    """One requirement: in every case of `bench` that `select(params)` keeps, `ours` against the
    fastest of `peers` measured there. kind "speedup": the peer's time over ours at least
    `required`; "tflops": ours at least `required` TFLOP/s; "memory": our peak memory over the
    peer's at most `required`. `fallback` is judged in its place where none of `peers` was
    measured in any case (a peer that may not be installed)."""

    name: str
    bench: str
    select: Callable
    ours: str
    peers: tuple
    required: float
    kind: str = "speedup"
    fallback: "Target | None" = None


def _long_d64(mask):
    return lambda p: p["D"] == 64 and p["mask"] == mask and p["L"] >= 4096 and p["dtype"] == "bf16"


def _tutorial(p):
    return p["scenario"] == "classify" and p["n_layer"] == 6 and p["d_hidn"] == 256


# fmt: off
LIGER_FALLBACK = Target("add_layer_norm fwd_bwd: vs eager (no Liger-Kernel)", "add_layer_norm",
                        lambda p: p["mode"] == "fwd_bwd", "fastformer", ("eager",), 1.5)
TARGETS = (
    # the kernels: device time against the fastest peer a user would pick instead
    Target("attention_fwd, D64 causal L>=4096: vs the fastest SDPA", "attention_fwd",
           _long_d64("causal"), "fastformer", SDPA_PEERS, 1.0),
    Target("attention_fwd_bwd, D64 causal L>=4096: vs the fastest SDPA", "attention_fwd_bwd",
           _long_d64("causal"), "fastformer", SDPA_PEERS, 1.0),
    Target("attention_fwd, D64 causal L>=4096: TFLOP/s", "attention_fwd",
           _long_d64("causal"), "fastformer", (), 350.0, kind="tflops"),
    Target("attention_fwd, D64 padding + causal L>=4096: vs flex", "attention_fwd",
           _long_d64("padding_causal"), "fastformer", ("flex",), 1.3),
    Target("attention_fwd_bwd, D64 padding + causal L>=4096: vs flex", "attention_fwd_bwd",
           _long_d64("padding_causal"), "fastformer", ("flex",), 1.3),
    Target("attention_model_call fwd_bwd (padding, dropout 0.1): vs the fastest SDPA", "attention_model_call",
           lambda p: p["mode"] == "fwd_bwd", "fastformer", SDPA_PEERS, 1.5),
    Target("ffn_fwd_bwd, the tutorial's layer: vs eager", "ffn_fwd_bwd",
           lambda p: p["op"] == "feed_forward" and (p["M"], p["d"], p["d_ff"]) == (32768, 256, 1024),
           "fastformer", ("eager",), 1.15),
    Target("add_layer_norm fwd_bwd: vs Liger-Kernel", "add_layer_norm",
           lambda p: p["mode"] == "fwd_bwd", "fastformer", ("liger",), 1.0, fallback=LIGER_FALLBACK),
    # the tutorial's steps: wall time against the reference at its best
    Target("model_train, tutorial: replayed step vs reference_fp32 eager", "model_train",
           _tutorial, "fastformer_graphs", ("reference_fp32",), 6.0),
    Target("model_train, tutorial: replayed step vs the reference at its best", "model_train",
           _tutorial, "fastformer_graphs", REFERENCE_BEST, 1.5),
    Target("model_infer, tutorial: replayed vs the reference at its best", "model_infer",
           _tutorial, "fastformer_graphs", REFERENCE_BEST, 1.5),
    Target("model_train, tutorial: reduce-overhead drop-in vs the replayed step", "model_train",
           _tutorial, "fastformer_reduce_overhead", ("fastformer_graphs",), 1 / 1.1),
    Target("model_train, tutorial: eager peak memory vs reference_fp32", "model_train",
           _tutorial, "fastformer", ("reference_fp32",), 0.4, kind="memory"),
)
# fmt: on


def providers_needed(target):
    """Every provider whose records a target (and its fallback) reads."""
    needed = {target.ours, *target.peers}
    return needed | (providers_needed(target.fallback) if target.fallback else set())


def judged(case):
    """Whether some target reads this case's record (a bench.report Case, or anything with bench,
    provider and params)."""
    return any(
        case.bench == t.bench and t.select(case.params) and case.provider in providers_needed(t) for t in _all(TARGETS)
    )


def _all(targets):
    for target in targets:
        yield target
        if target.fallback:
            yield from _all((target.fallback,))


def _case_ratio(target, group):
    """(Ratio, basis, peer) of one case for a target, or None when a side is missing."""
    ours = group.get(target.ours)
    if ours is None:
        return None
    if target.kind == "tflops":
        if not ours.get("flops"):
            return None
        on = "graph" if ours.get("graph_ms") is not None else "events"
        t = timing(ours, on)
        gigaflops = ours["flops"] / 1e9  # over milliseconds: TFLOP/s
        return Ratio(gigaflops / t.median, gigaflops / t.p80, gigaflops / t.p20), on, None
    peers = [group[p] for p in target.peers if p in group]
    if not peers:
        return None
    if target.kind == "memory":
        peer = peers[0]
        if not ours.get("peak_mem_mb") or not peer.get("peak_mem_mb"):
            return None
        share = ours["peak_mem_mb"] / peer["peak_mem_mb"]
        return Ratio(share, share, share), "peak memory", peer["provider"]
    fastest = min(peers, key=lambda r: timing(r, basis(ours, r)).median)
    ratio, on = speedup(ours, fastest)
    return ratio, on, fastest["provider"]


def evaluate(target, results):
    """A target judged on a run's records: {target, kind, required, cases, worst, low, high, basis,
    peer, verdict, met}; worst is the median ratio of the worst case, [low, high] its interval, peer
    the provider it was compared with; met is True, False, or None (within noise, not measured)."""
    at_most = target.kind == "memory"
    measured = []
    for (bench, params), group in groups(results).items():
        if bench == target.bench and target.select(json.loads(params)):
            found = _case_ratio(target, group)
            if found:
                measured.append(found)
    if not measured and target.fallback is not None:
        return evaluate(target.fallback, results)
    row = {"target": target.name, "kind": target.kind, "required": target.required, "cases": len(measured)}
    if not measured:
        return dict(row, worst=None, low=None, high=None, basis=None, peer=None, verdict=NOT_MEASURED, met=None)
    verdicts = [verdict(ratio, target.required, at_most) for ratio, _, _ in measured]
    worst_ratio, on, peer = (max if at_most else min)(measured, key=lambda m: m[0].median)
    overall = NOT_MET if NOT_MET in verdicts else WITHIN_NOISE if WITHIN_NOISE in verdicts else MET
    return dict(
        row,
        worst=worst_ratio.median,
        low=worst_ratio.low,
        high=worst_ratio.high,
        basis=on,
        peer=peer,
        verdict=overall,
        met={MET: True, NOT_MET: False}.get(overall),
    )


def evaluate_targets(results):
    """Every target judged on one run's records, in TARGETS' order."""
    return [evaluate(target, results) for target in TARGETS]
