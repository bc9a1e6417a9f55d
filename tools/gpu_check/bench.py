"""The bench stage: the kernel cases the targets are judged on, fastformer against the peers
measured in the same run (tools.benchmarks); then, for the pairs where fastformer trailed a peer on
the last GPU run (KERNEL_PROFILE), each one's kernels under torch.profiler: device time per kernel
per call, the most first (where the time goes, ours beside the peer's)."""

import time
from collections import Counter

import torch
from torch.autograd import DeviceType

from tools.benchmarks import cases as suite
from tools.benchmarks import report as bench_report
from tools.benchmarks.common import synchronize
from tools.gpu_check.run import CPU_TARGETS, error_text, measure_cases, raise_for_cases

BENCH_ORDER = ("model_train", "ffn_fwd_bwd", "attention_fwd", "attention_fwd_bwd")


def stage(run):
    cases = _bench_cases(run)
    details = measure_cases(run, "bench", cases)
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
    raise_for_cases(details)
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
            profiles[case.id] = kernel_rows(profiler.events(), device_type, calls)
        except Exception as error:  # noqa: BLE001 (a profile is a diagnosis: the stage's figures stand without it)
            profiles[case.id] = {"error": error_text(error)}
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return profiles


def kernel_rows(events, device_type, calls):
    """Rows of the kernel profile from a profiler's events: those of device_type summed by name (on
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
