"""The model stage: MovieClassification with the tutorial's config on batches of NSMC-like reviews
(8 to 128 tokens, padded), its train step and inference for every provider and variant of the
plan (tokens/s on real tokens, peak memory, MFU against the env stage's GEMM ceiling); where the
eager train step's host time goes (cProfile) and what single calls cost this host; and
convergence: the same config trained from one seed on the Triton kernels and on the reference,
against fp64."""

import time

import torch
import torch.nn.functional as F

import fastformer
from bench import cases as suite
from bench.cases import MODEL_PROVIDERS, TRAIN_ONLY
from bench.common import model_flops, synchronize
from bench.targets import ratio_text, speedup
from fastformer import kernels
from tools.convergence import CONVERGENCE_LR, LOSS_ATOL, compare_curves, convergence_curves, convergence_setup
from tools.gpu_check.run import ROOT, Failed, error_text, measure_cases, raise_for_cases


def stage(run):
    cases = model_cases(run)
    profiled = {c.id for c in cases if c.bench == "model_train" and c.provider in STEP_KERNELS_OF}
    details = measure_cases(run, "model", cases, run.plan.reps.steps, profiled)
    results = run.reports["model"]["results"]
    details["rows"] = [{k: r[k] for k in ROW_KEYS} for r in results]
    details["mfu_note"] = None if run.gemm_rate() else "needs CUDA: the MFU denominator is the GPU's bf16 GEMM rate"
    details["step_kernels"] = step_kernels(results)
    details["memory_phases"] = _memory_phases(run)
    details["host_profile"] = _host_profile(run)
    details["host_calls"] = _host_calls(run)
    convergence = details["convergence"] = _convergence(run)
    parts = [step_note(results, bench) for bench in ("model_train", "model_infer")]
    parts.append(_convergence_note(convergence))
    details["summary"] = "; ".join(p for p in parts if p) or "nothing measured"
    raise_for_cases(details)
    if not convergence.get("agree"):
        raise Failed(details["summary"], details)
    return details


ROW_KEYS = (
    "bench",
    "provider",
    "ms",
    "p20_ms",
    "p80_ms",
    "tokens_per_s",
    "peak_mem_mb",
    "resident_mb",
    "tflops",
    "mfu",
)
# the train steps whose kernels the stage lists (one step each under torch.profiler): fastformer's
# replayed and eager steps, and every reference, of which step_kernels keeps the fastest
STEP_KERNELS_OF = ("fastformer_graphs", "fastformer", *(p for p in MODEL_PROVIDERS if p.startswith("reference")))


def best_reference(rows):
    """The fastest reference provider's record among {provider: record} of one bench, or None."""
    references = [r for p, r in rows.items() if p.startswith("reference")]
    return min(references, key=lambda r: r["ms"], default=None)


def step_kernels(results):
    """{provider: kernel rows} of the profiled train steps: fastformer's replayed step (else its
    eager one) and the fastest reference's, where the time goes once the host is out of the way."""
    rows = {r["provider"]: r for r in results if r["bench"] == "model_train" and r.get("kernels") is not None}
    ours = rows.get("fastformer_graphs") or rows.get("fastformer")
    chosen = [r for r in (ours, best_reference(rows)) if r is not None]
    return {r["provider"]: r["kernels"] for r in chosen}


def step_note(results, bench):
    """One bench's steps in a line: fastformer's replayed step and eager step in tokens/s, each as
    a speed-up (with its interval) over the fp32 reference and over the fastest reference."""
    rows = {r["provider"]: r for r in results if r["bench"] == bench}
    best = best_reference(rows)
    notes = []
    for name in ("fastformer_graphs", "fastformer"):
        ours = rows.get(name)
        if ours is None:
            continue
        peers = [rows.get("reference_fp32"), best]
        ratios = []
        for peer in dict.fromkeys(p["provider"] for p in peers if p):
            ratio, _ = speedup(ours, rows[peer])
            ratios.append(f"{ratio_text(ratio)} {peer}")
        notes.append(f"{name} {ours['tokens_per_s']:,.0f} tok/s" + (f" ({', '.join(ratios)})" if ratios else ""))
    return f"{bench.removeprefix('model_')}: " + "; ".join(notes) if notes else ""


def _memory_phases(run):
    """{path: peaks} of tools.memory.phases on CUDA: a train step of fastformer and of the fp32
    reference at the model stage's config and batch, each phase's peak allocated (forward, backward,
    optimizer) above what the step started with (its weights and optimizer state), which it gives
    too; {"not_run": reason} on a CPU or when the stage's budget is spent."""
    from tools.memory import phases

    if not run.cuda:
        return {"not_run": "needs CUDA: torch.cuda.max_memory_allocated (python -m tools.memory counts on a CPU)"}
    if time.monotonic() > run.deadline("model"):
        return {"not_run": f"the model stage's budget of {run.plan.budget_seconds['model']} s was spent"}
    return {path: phases(path, run.plan.config, run.plan.model_batch, run.device) for path in MEMORY_PATHS}


MEMORY_PATHS = ("fastformer", "reference_fp32")  # tools.memory's paths
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
    amp = None if run.cuda else False  # as model_cases
    steps, profile = max(run.plan.reps.steps, 1), {}
    for provider in run.plan.host_profile:
        case = suite.model_case("train", provider, run.device, B=run.plan.model_batch, config=config, amp=amp)
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
    from tools.host_overhead import floors

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
    for name, call in floors(device).items():
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
            rows.append({"call": name, "us_per_call": None, "error": error_text(error)})
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


def model_cases(run):
    """MovieClassification's train step and inference on review batches for each of the plan's
    providers in its order (bench.cases.model_case), each credited its model FLOPs
    (model_flops) so the report computes TFLOP/s and MFU."""
    config = fastformer.Config.tutorial(**run.plan.config)
    amp = None if run.cuda else False  # None: each provider's own (fastformer bf16, reference_fp32 fp32, ...)
    enc, dec, _ = suite.review_batch(config, run.plan.model_batch, False, "cpu")  # the batch the cases build
    lengths = enc.ne(config.i_pad).sum(1).tolist(), dec.ne(config.i_pad).sum(1).tolist()
    cases = []
    for provider in run.plan.model_providers:
        for kind in ("train", "infer"):
            if kind == "infer" and provider in TRAIN_ONLY:
                continue
            case = suite.model_case(kind, provider, run.device, B=run.plan.model_batch, config=config, amp=amp)
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
