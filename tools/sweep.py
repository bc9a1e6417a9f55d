"""The sweep that decides the kernels' variants and configs on a GPU: `python -m tools.sweep`.

    python -m tools.sweep --out DIR           # on a GPU (tools/gpu_run.sh's first part): DIR/sweep.json, DIR/sweep.md
    python -m tools.sweep --dry-run --quick   # on a CPU: small shapes compiled for sm_90a, nothing timed
    python -m tools.sweep --adopt DIR/sweep.json   # a GPU's report -> kernels/tuned/<gpu>.json, which the rules read

What: every kernel launch that has a choice to make, on the shapes its targets are judged at and on
the tutorial's (FAMILIES, in bf16): the attention forward, the backward's dQ and dK/dV passes and
the one-pass backward's dK/dV/dQ launch (kernels/_backward_choice.py; its small delta and dQ
launches are not timed), causal and padding + causal at B4 H16 L4096 D64, and the model's own call
(B128 H4 D64 on a fused QKV projection, key padding, dropout 0.1) at L 64, 128 and 256; and the
FFN's first GEMM with its GELU (d 256 -> d_ff 1024, M 32768 and 8192) and its backward's "dH" pass
(dH = dOut @ W2 with the activation gradient in the GEMM's epilogue; its "cublas" variant: cuBLAS's
dH, then the activation-gradient pass). Each in both variants, its tiles loaded through pointers
and through tensor descriptors (kernels/_tma.py), with every config its kernel's rule keeps for the
launch (kernels._configs.Configs' `fits`); the GEMM also in a third, "cublas": the product and its
bias by cuBLAS (torch.addmm), then the activation kernel reading it back (kernels/_gemm_choice.py),
timed together, whose one config is the activation kernel's. add + LayerNorm has one config and no
descriptors, so nothing to sweep.

How: a family at a time, in FAMILIES' order (the targets' first) until --budget seconds have
passed: its (launch, variant, config)s compiled in parallel (triton.AsyncCompileMode over a thread
per CPU, under kernels.compile_only), then each timed alone by device time: `reps` calls between
CUDA events, the L2 flushed before each (bench.timing.device_times), the median and its
20th to 80th percentile. The backward passes read the log-sum-exp of a forward run once before,
and dK/dV the delta of a dQ pass. sweep.json and sweep.md are rewritten (atomically) as each
family ends. On SIGINT (tools/gpu_run.sh's limit) the compiles not started are cancelled and both
files written with what was timed, the rest "not timed", the report marked interrupted (exit 130).

The table: per family and pass, the fastest (variant, config) beside the rule's pick (the config
the written rule picks, in the variant PREFERS_CUBLAS and PREFERS_TMA pick, with no tuned table in
force), each with its interval, the fastest's speed-up over the pick with the interval the spreads
allow (bench.timing.Ratio), and TFLOP/s: the products each pass computes, 2 * B * H *
Lq * Lk * D FLOPs each (half under a causal mask): the forward 2 (QK^T, PV), dQ 3 (QK^T, dO V^T,
dS K), dK/dV 4 (K Q^T, V dO^T, P^T dO, dS^T Q), dK/dV/dQ 5 (dK/dV's and dS K); the GEMM 2 * M * N * K.
Beside the table, each attention family's backward both ways (backward_ways): the two passes'
fastest summed against the one pass's.

What the rules take from it (`adopt`): a pass whose fastest beat the pick outside the noise runs
the fastest's variant and config on that GPU model; one within noise keeps the rule's pick. `--adopt`
writes that table to kernels/tuned/<gpu>.json (kernels/_tuned.py reads it) and the report to
tools/results/sweep-<gpu>.json, the pair a test holds to each other: no hand edit decides.

With --dry-run, on a CPU: tools.sm90's dry-run driver compiles every launch for sm_90a and launches
nothing; the records say "compiled" or the error, which rehearses the GPU run end to end (CI runs
it with --quick). The cuBLAS variant's product is not run there (its tensors are the CPU's, and
cuBLAS has nothing to compile): its activation kernel is. The kernels must be imported without
TRITON_INTERPRET.
"""

import argparse
import datetime
import functools
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from tools import interrupt_once, refuses_interpreter

REPO = Path(__file__).resolve().parent.parent
SCHEMA = "fastformer.sweep/1"
# each kind's variants: tiles loaded through pointers or through tensor descriptors, and for the
# GEMM, cuBLAS's product then the activation kernel
VARIANTS = {"attention": ("pointer", "tma"), "gemm": ("pointer", "tma", "cublas")}
# passes of attention and the products each computes (see the docstring); "dK/dV/dQ" is the
# one-pass backward's main launch (kernels/_backward_choice.py), timed without its delta and dQ launches
ATTENTION_PRODUCTS = {"forward": 2, "dQ": 3, "dK/dV": 4, "dK/dV/dQ": 5}


@dataclass(frozen=True)
class Family:
    """One shape family: a kernel (attention or gemm) on one shape. `quick` is the small shape a
    dry run compiles (the same flags, so the same kernels and rules)."""

    name: str
    kind: str  # "attention" | "gemm"
    shape: dict
    quick: dict


def _attention(name, mask, L, B, H, layout, dropout, quick_L):
    shape = dict(B=B, H=H, L=L, D=64, mask=mask, layout=layout, dropout=dropout)
    return Family(name, "attention", shape, dict(shape, B=2, H=2, L=quick_L))


FAMILIES = (
    _attention("attention causal L4096", "causal", 4096, 4, 16, "contiguous", 0.0, 256),
    _attention("attention padding+causal L4096", "pad+causal", 4096, 4, 16, "contiguous", 0.0, 256),
    _attention("attention model call L64", "pad", 64, 128, 4, "self", 0.1, 64),
    _attention("attention model call L128", "pad", 128, 128, 4, "self", 0.1, 128),
    _attention("attention model call L256", "pad", 256, 128, 4, "self", 0.1, 256),
    Family("gemm ffn M32768", "gemm", dict(M=32768, K=256, N=1024), dict(M=1024, K=256, N=1024)),
    Family("gemm ffn M8192", "gemm", dict(M=8192, K=256, N=1024), dict(M=512, K=256, N=1024)),
)


@dataclass
class Launch:
    """One pass of one family in one variant: its Configs, its (grid, args, kwargs) as its launcher
    makes them, what runs before it (`before`: the forward for the backward, the dQ pass for
    dK/dV), its FLOPs, the configs its rule keeps, `product`: fn() run before each launch and
    timed with it (the cuBLAS variant's product, which its kernel reads; None in a dry run), and
    `match`: (kernel, key, dtype), what a tuned table's entry for the pass holds (kernels/_tuned.py):
    the name of the kernel whose choice it is (the GEMM's for the cuBLAS variant too), its launch's
    key arguments but TMA, and its first tensor's dtype."""

    family: str
    pass_name: str
    variant: str
    configs: object
    grid: object
    args: tuple
    kwargs: dict
    flops: float
    before: list = field(default_factory=list)
    product: object = None
    match: tuple = None

    def __post_init__(self):
        if self.match is None:
            self.match = launch_match(self.configs, self.args, self.kwargs)

    def kept(self):
        """The candidates its rule keeps for this launch, the rule's pick first."""
        named = {**dict(zip(self.configs.kernel.arg_names, self.args)), **self.kwargs}
        fitting = [c for c in self.configs.candidates if self.configs.fits(*c, named)]
        return fitting

    def runner(self, meta, num_warps, num_stages):
        """fn() launching this pass with one config, as Configs does with its pick, after its
        product (not while only compiling: kernels.compile_only)."""
        from fastformer.kernels._runtime import compiling_only, ensure_allocator, launch

        grid = self.grid(meta) if callable(self.grid) else self.grid
        kernel = launch(self.configs.kernel)
        if self.kwargs.get("TMA"):
            ensure_allocator()

        def run():
            if self.product is not None and not compiling_only():
                self.product()
            kernel[grid](*self.args, **self.kwargs, **meta, num_warps=num_warps, num_stages=num_stages)

        return run


def launch_match(configs, args, kwargs):
    """(kernel, key, dtype) of a launch, as a tuned table's entry names it (Launch.match)."""
    named = {**dict(zip(configs.kernel.arg_names, args)), **kwargs}
    key = {name: named[name] for name in configs.key if name != "TMA"}
    dtype = next(str(a.dtype) for a in args if hasattr(a, "dtype"))
    return configs.name, key, dtype


def _qkv(B, H, L, D, dtype, layout, device):
    import torch

    if layout == "self":  # views of one fused (B, L, 3, H, D) projection, as the model's layers pass them
        q, k, v = torch.randn(B, L, 3, H, D, dtype=dtype, device=device).unbind(2)
        return [t.transpose(1, 2) for t in (q, k, v)]
    return [torch.randn(B, H, L, D, dtype=dtype, device=device) for _ in range(3)]


def attention_launches(family, shape, variant, device):
    """The passes of one attention family in one variant: [forward, dQ, dK/dV, dK/dV/dQ] Launches,
    the last the one-pass backward's main launch (its delta and dQ launches are not timed)."""
    import importlib

    import torch

    from fastformer import kernels

    attention = importlib.import_module("fastformer.kernels.attention")
    B, H, L, D = shape["B"], shape["H"], shape["L"], shape["D"]
    q, k, v = _qkv(B, H, L, D, torch.bfloat16, shape["layout"], device)
    pad = causal = None
    if "pad" in shape["mask"]:
        lengths = torch.linspace(max(1, L // 4), L, B, device=device).long()  # spread: padding at each row's end
        pad = torch.arange(L, device=device)[None, :] >= lengths[:, None]
    causal = "causal" in shape["mask"]
    p = shape["dropout"]
    seed = torch.tensor([7], dtype=torch.int64, device=device) if p else None
    with kernels.tma_loads(variant == "tma"):
        masking = attention._masking(q, pad, None, causal, p, D**-0.5)
        o, lse = attention._forward_outputs(q)
        fwd = attention._forward_launch(q, k, v, o, lse, seed, masking)
        do = torch.randn_like(o)
        outputs = attention._backward_outputs(q, k, v, lse)
        two = attention._backward_launches(do, q, k, v, o, lse, seed, *outputs, masking)
        one = attention._backward_launches(do, q, k, v, o, lse, seed, *outputs, masking, attention._dq_sums(q))
    products = 2 * B * H * L * L * D * (0.5 if causal else 1.0)
    made = []
    for (configs, *launch), name in zip(((attention._attn_fwd, *fwd), *two, one[1]), ATTENTION_PRODUCTS):
        made.append(Launch(family.name, name, variant, configs, *launch, ATTENTION_PRODUCTS[name] * products))
    made[1].before = [made[0]]  # the backward reads the forward's o and lse
    made[2].before = made[3].before = [made[0], made[1]]  # and dK/dV the delta dQ writes (dK/dV/dQ: as its own would)
    return made


def gemm_launches(family, shape, variant, device):
    """The FFN's first GEMM with its GELU, storing the pre-activation (a training forward): the
    Triton GEMM, or (variant "cublas") cuBLAS's product into the pre-activation, run on a GPU only,
    then the activation kernel; and its backward's dH pass (dh_launch) in the same variant."""
    import importlib

    import torch

    from fastformer import kernels

    linear_gelu = importlib.import_module("fastformer.kernels.linear_gelu")
    M, K, N = shape["M"], shape["K"], shape["N"]
    x = torch.randn(M, K, dtype=torch.bfloat16, device=device)
    w = torch.randn(N, K, 1, dtype=torch.bfloat16, device=device)[..., 0]  # a Conv1d weight's view
    b = torch.randn(N, dtype=torch.bfloat16, device=device)
    y, pre = linear_gelu._forward_outputs(x, N, True)
    with kernels.tma_loads(variant == "tma"):
        grid, args, kwargs = linear_gelu._forward_launch(x, w, b, y, pre, "gelu", True)
    gemm = linear_gelu._linear_gelu_fwd
    if variant == "cublas":  # the GEMM's choice: its launch's key names the entry
        match = launch_match(gemm, args, kwargs)
        grid, args, kwargs = linear_gelu._activation_forward_launch(pre, y, "gelu")
        product = None if device.type != "cuda" else functools.partial(linear_gelu._cublas_product, x, w, b, pre)
        configs = linear_gelu._activation_fwd
        return [
            Launch(
                family.name,
                "forward",
                variant,
                configs,
                grid,
                args,
                kwargs,
                2.0 * M * N * K,
                product=product,
                match=match,
            ),
            dh_launch(family, shape, variant, device),
        ]
    return [
        Launch(family.name, "forward", variant, gemm, grid, args, kwargs, 2.0 * M * N * K),
        dh_launch(family, shape, variant, device),
    ]


def dh_launch(family, shape, variant, device):
    """The FFN backward's dH = dOut @ W2 with the activation gradient (GELU, db1's partials, h
    written again, as the model's backward): the dH GEMM with its epilogue, or (variant "cublas")
    cuBLAS's product into dH, run on a GPU only, then the activation-gradient pass, timed together,
    whose one config is the pass's. d is the family's K, d_ff its N."""
    import importlib

    import torch

    from fastformer import kernels
    from fastformer.kernels._configs import Configs

    linear_gelu = importlib.import_module("fastformer.kernels.linear_gelu")
    M, d, d_ff = shape["M"], shape["K"], shape["N"]
    dout = torch.randn(M, d, dtype=torch.bfloat16, device=device)
    w2 = torch.randn(d, d_ff, 1, dtype=torch.bfloat16, device=device)[..., 0]  # a Conv1d weight's view
    pre = torch.randn(M, d_ff, dtype=torch.bfloat16, device=device)
    outputs = linear_gelu._activation_outputs(pre, True, True, linear_gelu.PARTIAL_ROWS)
    with kernels.tma_loads(variant == "tma"):
        gemm, grid, args, kwargs = linear_gelu._ffn_act_grad_launches(dout, w2, pre, *outputs, "gelu", True, True)[0]
    flops = 2.0 * M * d_ff * d
    if variant != "cublas":
        return Launch(family.name, "dH", variant, gemm, grid, args, kwargs, flops)
    match = launch_match(gemm, args, kwargs)  # the dH GEMM's choice: its launch's key names the entry
    dh = torch.empty(M, d_ff, dtype=torch.bfloat16, device=device)
    dpre, partial, db, h = linear_gelu._activation_outputs(pre, True, True)
    kernel, grid, args, kwargs = linear_gelu._activation_launches(dh, pre, dpre, partial, db, h, "gelu", True, True)[0]
    meta = {name: kwargs.pop(name) for name in ("BLOCK_M", "BLOCK_N")}
    # the pass's one config, as its launcher launches it (Triton's default 4 warps and 3 stages)
    configs = Configs(kernel, "ffn activation pass", [(meta, 4, 3)], ["N", "ACTIVATION"], interpreter_meta=meta)
    product = None if device.type != "cuda" else functools.partial(torch.mm, dout, w2, out=dh)
    return Launch(family.name, "dH", variant, configs, grid, args, kwargs, flops, product=product, match=match)


def launches(family, quick, device):
    """Every Launch of a family, each variant of its kind; a variant the device cannot run (TMA
    before sm_90) gives none: `launch.kwargs["TMA"]` says which variant a Launch really is."""
    shape = family.quick if quick else family.shape
    build = attention_launches if family.kind == "attention" else gemm_launches
    made = []
    for variant in VARIANTS[family.kind]:
        for launch in build(family, shape, variant, device):
            if bool(launch.kwargs.get("TMA")) == (variant == "tma"):
                made.append(launch)
    return made


@dataclass
class Record:
    """One (launch, config) of the sweep: what it is (its family, pass, variant and config, and
    its Launch.match: kernel, key, dtype), whether it is the rule's pick, and how it went."""

    family: str
    pass_name: str
    variant: str
    config: str
    rule_pick: bool
    status: str  # "timed", "compiled" (a dry run), "not timed" (the budget spent, or interrupted), "error"
    median_ms: float | None = None
    p20_ms: float | None = None
    p80_ms: float | None = None
    reps: int = 0
    tflops: float | None = None
    error: str | None = None
    kernel: str | None = None
    key: dict | None = None
    dtype: str | None = None
    meta: dict | None = None
    num_warps: int | None = None
    num_stages: int | None = None


def config_name(meta, num_warps, num_stages):
    return " ".join(f"{k}={v}" for k, v in sorted(meta.items())) + f" w{num_warps} s{num_stages}"


def record_of(launch, config, is_pick):
    """The Record of one (launch, config) before it runs: "not timed"."""
    kernel, key, dtype = launch.match
    meta, num_warps, num_stages = config
    return Record(
        launch.family, launch.pass_name, launch.variant, config_name(*config), is_pick, "not timed",
        kernel=kernel, key=key, dtype=dtype, meta=dict(meta), num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip


def _rule_pick(launch):
    """The (meta, warps, stages) the kernel's rule picks for this launch."""
    return launch.configs.pick(launch.args, launch.kwargs)


def compile_all(items, workers):
    """Compile every (launch, config) in parallel, launching nothing (kernels.compile_only under a
    triton.AsyncCompileMode); the returned errors by item index are the compiles that failed. On
    an interrupt the compiles not yet started are cancelled and those running left to finish in
    their threads, unwaited for, so that the caller can write what it has at once."""
    import triton

    from fastformer import kernels
    from fastformer.train.warmup import CompileThreads

    errors = {}
    pool = CompileThreads(workers)
    mode = triton.AsyncCompileMode(pool)
    try:
        with mode, kernels.compile_only():
            try:
                for i, (launch, config) in enumerate(items):
                    try:
                        launch.runner(*config)()
                    except Exception as error:  # noqa: BLE001  (a config that does not compile is a result)
                        errors[i] = _error_line(error)
            except KeyboardInterrupt:
                _abandon(pool, mode)
                raise
    except KeyboardInterrupt:
        _abandon(pool, mode)  # also when it came while AsyncCompileMode waited for the compiles
        raise
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    return errors


def _abandon(pool, mode):
    """Cancel the compiles not started and leave the running ones to their threads: AsyncCompileMode
    then waits for none on leaving (a compile cannot be stopped midway: ptxas is a process, the MLIR
    passes C++)."""
    pool.shutdown(wait=False, cancel_futures=True)
    mode.raw_futures, mode.future_kernels, mode.ignore_errors = [], {}, True


def _error_line(error):
    return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:300]


def sweep(
    quick=False, dry_run=False, budget=480.0, reps=20, families=None, workers=None, progress=print, on_family=None
):
    """Run the sweep, a family at a time (compile its launches in parallel, then time each), in
    FAMILIES' order until the budget is spent; returns the report (SCHEMA). `on_family(report)`
    is called with the report so far as each family ends (the command writes its files then), and
    on an interrupt, once more with what was timed (then the report says interrupted).

    The rule's pick is the written rule's, with no tuned table in force (kernels/_tuned.py): what
    the sweep times, and what tools.sweep.adopt judges a faster config against."""
    import torch

    from fastformer import kernels

    start = time.monotonic()
    device = torch.device("cpu" if dry_run else "cuda")
    chosen = [f for f in FAMILIES if families is None or any(s in f.name for s in families)]
    by_family, records = [], []  # [(family, items, records)], records of all
    with kernels.tuned(False):
        for family in chosen:
            items = []  # (launch, config, is the rule's pick)
            for launch in launches(family, quick, device):
                pick_variant = _rule_variant(launch)
                pick = _rule_pick(launch)
                for config in launch.kept():
                    items.append((launch, config, launch.variant == pick_variant and config == pick))
            made = [record_of(launch, config, is_pick) for launch, config, is_pick in items]
            by_family.append((family, items, made))
            records += made
    report = {
        "schema": SCHEMA,
        "env": _env(dry_run),
        "quick": quick,
        "dry_run": dry_run,
        "budget_seconds": budget,
        "seconds": 0.0,
        "interrupted": False,
        "reps": reps,
        "families": [f.name for f in chosen],
        "records": [],
        "best": [],
    }

    def spent():
        return time.monotonic() - start > budget

    def update():
        report["seconds"] = round(time.monotonic() - start, 1)
        report["records"] = [vars(r) for r in records]
        report["best"] = best_per_pass(records)
        if on_family is not None:
            on_family(report)

    families_text = f"{len(chosen)} famil{'y' if len(chosen) == 1 else 'ies'}"
    progress(f"sweep: {len(records)} launches in {families_text}, a budget of {budget:.0f} s")
    try:
        with kernels.tuned(False):
            for family, items, made in by_family:
                if not dry_run and spent():
                    progress(f"sweep: {family.name}: not timed, the budget of {budget:.0f} s spent")
                    continue
                began = time.monotonic()
                progress(f"sweep: {family.name}: compiling {len(items)} launches")
                errors = compile_all([(launch, config) for launch, config, _ in items], workers or os.cpu_count())
                progress(
                    f"sweep: {family.name}: compiled in {time.monotonic() - began:.0f} s, {len(errors)} failed; timing"
                )
                _time_each(items, made, errors, device, dry_run, reps, spent)
                update()
                progress(
                    f"sweep: {family.name}: done in {time.monotonic() - began:.0f} s; "
                    + family_line(report, family.name)
                )
    except KeyboardInterrupt:  # tools/gpu_run.sh's limit: the records so far, the rest "not timed"
        report["interrupted"] = True
        progress("sweep: interrupted; writing what was timed")
    update()
    return report


def family_line(report, family):
    """One family's best per pass in a line: "forward tma w8 s3 1.23x [1.10, 1.31]; dQ the rule's pick"."""
    parts = []
    for row in report["best"]:
        if row["family"] != family:
            continue
        fastest, pick = row["fastest"], row["pick"]
        if fastest is None:
            parts.append(f"{row['pass']} {'compiled' if report['dry_run'] else 'not timed'}")
        elif row["speedup"] is None:
            parts.append(f"{row['pass']} {fastest['variant']} {fastest['config']} (the pick not timed)")
        elif pick is not None and (fastest["variant"], fastest["config"]) == (pick["variant"], pick["config"]):
            parts.append(f"{row['pass']}: the rule's pick is the fastest")
        else:
            parts.append(
                f"{row['pass']}: {fastest['variant']} {fastest['config']} "
                f"{row['speedup']:.2f}x [{row['low']:.2f}, {row['high']:.2f}] the pick"
            )
    return "; ".join(parts) or "nothing"


def _time_each(items, records, errors, device, dry_run, reps, spent):
    """Time each compiled (launch, config) into its record, in order, until spent() (the budget);
    in a dry run, launch each once (its host path; the driver launches nothing) and time none."""
    from bench.timing import Timing, device_times

    ran_before = set()
    for i, ((launch, config, _), record) in enumerate(zip(items, records)):
        if i in errors:
            record.status, record.error = "error", errors[i]
            continue
        if not dry_run and spent():
            continue
        try:
            for before in launch.before:  # a backward pass's inputs: once per family and variant
                if id(before) not in ran_before:
                    before.runner(*_rule_pick(before))()
                    ran_before.add(id(before))
            run = launch.runner(*config)
            if dry_run:
                run()
                record.status = "compiled"
                continue
            timing = Timing.of(device_times(run, device, warmup=2, rep=reps))
        except Exception as error:  # noqa: BLE001  (recorded; the sweep goes on)
            record.status, record.error = "error", f"{type(error).__name__}: {error}"[:300]
            continue
        record.status = "timed"
        record.median_ms, record.p20_ms, record.p80_ms, record.reps = timing.median, timing.p20, timing.p80, timing.reps
        record.tflops = launch.flops / (timing.median * 1e-3) / 1e12


def _rule_variant(launch):
    """The variant its kernel's rule picks: "cublas" where its module's PREFERS_CUBLAS says so (the
    GEMM's, kernels/linear_gelu.py), else "tma" or "pointer" as its PREFERS_TMA says."""
    module = sys.modules[launch.configs.kernel.fn.__module__]
    if getattr(module, "PREFERS_CUBLAS", False):
        return "cublas"
    return "tma" if module.PREFERS_TMA else "pointer"


def best_per_pass(records):
    """Per (family, pass): the rule's pick and the fastest timed record, and the fastest's speed-up
    over the pick with its interval ({} for a pass with no timed pick)."""
    from bench.timing import Ratio, Timing

    rows = []
    keys = dict.fromkeys((r.family, r.pass_name) for r in records)
    for family, pass_name in keys:
        timed = [r for r in records if (r.family, r.pass_name) == (family, pass_name) and r.status == "timed"]
        pick = next((r for r in records if (r.family, r.pass_name) == (family, pass_name) and r.rule_pick), None)
        fastest = min(timed, key=lambda r: r.median_ms, default=None)
        row = {"family": family, "pass": pass_name, "pick": vars(pick) if pick else None}
        row["fastest"] = vars(fastest) if fastest else None
        row["speedup"] = row["low"] = row["high"] = None
        if pick is not None and pick.status == "timed" and fastest is not None:
            ratio = Ratio.of(*(Timing(r.median_ms, r.p20_ms, r.p80_ms, r.reps) for r in (pick, fastest)))
            row["speedup"], row["low"], row["high"] = ratio.median, ratio.low, ratio.high
        rows.append(row)
    return rows


def adopt(report, source=None):
    """The tuned table (kernels/_tuned.py) a GPU sweep's report decides: an entry for each (family,
    pass) whose fastest (variant, config) beat the rule's pick outside the noise (the speed-up's
    interval all above 1: the fastest's 80th percentile under the pick's 20th). A winner within
    noise of the pick, a pass whose pick was not timed, and a pass the pick won keep the rule's
    pick: no entry. `source`: the report's file, recorded in the table."""
    from fastformer.kernels import _tuned

    if report.get("schema") != SCHEMA:
        raise ValueError(f"not a sweep report (its schema must be {SCHEMA!r})")
    if report["dry_run"]:
        raise ValueError("a dry run timed nothing: there is nothing to adopt")
    launches = []
    for row in report["best"]:
        if row["speedup"] is None or row["low"] <= 1.0:
            continue
        fastest = row["fastest"]
        cublas = fastest["variant"] == "cublas"  # the product is cuBLAS's: no config of the GEMM's
        launches.append(
            {
                "kernel": fastest["kernel"],
                "family": row["family"],
                "pass": row["pass"],
                "key": fastest["key"],
                "dtype": fastest["dtype"],
                "variant": fastest["variant"],
                "meta": None if cublas else fastest["meta"],
                "num_warps": None if cublas else fastest["num_warps"],
                "num_stages": None if cublas else fastest["num_stages"],
                "speedup": round(row["speedup"], 4),
                "low": round(row["low"], 4),
                "high": round(row["high"], 4),
            }
        )
    env = report["env"]
    return {
        "schema": _tuned.SCHEMA,
        "gpu": env["gpu"],
        "source": {
            "sweep": source,
            "date": env["date"],
            "commit": env["commit"],
            "torch": env["torch"],
            "triton": env["triton"],
            "interrupted": report["interrupted"],
        },
        "launches": launches,
    }


def adopted_lines(table):
    """What a tuned table changes, a line per entry (or one saying the rules stand)."""
    if not table["launches"]:
        return [f"tuned table for {table['gpu']}: no winner outside the noise; the written rules stand"]
    lines = [f"tuned table for {table['gpu']}: {len(table['launches'])} of the sweep's passes take its winner"]
    for e in table["launches"]:
        config = (
            "cuBLAS's product" if e["variant"] == "cublas" else config_name(e["meta"], e["num_warps"], e["num_stages"])
        )
        lines.append(
            f"  {e['family']} {e['pass']}: {e['variant']} {config}, "
            f"{e['speedup']:.2f}x [{e['low']:.2f}, {e['high']:.2f}] the rule's pick"
        )
    return lines


def write_atomically(path, text):
    """path's text replaced at once (a temporary file beside it, then os.replace): a kill leaves
    the old file or the new one, never half of one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def write_report(out, report):
    """sweep.json and sweep.md in `out`, each atomically."""
    write_atomically(Path(out) / "sweep.json", json.dumps(report, indent=1) + "\n")
    write_atomically(Path(out) / "sweep.md", table(report))


def _env(dry_run):
    import torch
    import triton

    gpu = "dry-run sm_90a (no GPU)" if dry_run else torch.cuda.get_device_name()
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return {
        "gpu": gpu,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": commit or None,
    }


def _figure(r):
    if r is None:
        return "-"
    if r["status"] != "timed":
        return f"{r['variant']} {r['config']}: {r['status']}"
    return (
        f"{r['variant']} {r['config']}: {r['median_ms']:.4f} ms [{r['p20_ms']:.4f}, {r['p80_ms']:.4f}], "
        f"{r['tflops']:.1f} TFLOP/s"
    )


def backward_ways(report):
    """Per attention family with both ways timed: a line with the two passes' fastest dQ + dK/dV
    against the one pass's fastest dK/dV/dQ launch, and their ratio (attention.ONE_PASS_FROM is
    the rule these lines judge; the one pass's delta and dQ launches are not in its figure)."""
    fastest = {(row["family"], row["pass"]): row["fastest"] for row in report["best"] if row["fastest"]}
    lines = []
    for family in dict.fromkeys(row["family"] for row in report["best"]):
        dq, dkdv, one = (fastest.get((family, name)) for name in ("dQ", "dK/dV", "dK/dV/dQ"))
        if dq and dkdv and one and dq["median_ms"] and dkdv["median_ms"] and one["median_ms"]:
            two_ms = dq["median_ms"] + dkdv["median_ms"]
            lines.append(
                f"{family}: two passes {two_ms:.4f} ms, one pass {one['median_ms']:.4f} ms "
                f"({two_ms / one['median_ms']:.2f}x)"
            )
    return lines


def table(report):
    """The report as markdown: the best per pass beside the rule's pick, then every record."""
    env = report["env"]
    lines = [
        "# Kernel sweep",
        "",
        f"`python -m tools.sweep{' --dry-run' if report['dry_run'] else ''}{' --quick' if report['quick'] else ''}` "
        f"on {env['gpu']}, {env['date']}: torch {env['torch']}, Triton {env['triton']}, commit {env['commit']}; "
        f"{report['seconds']} s of a {report['budget_seconds']:.0f} s budget, {report['reps']} timed calls each "
        "(device time, L2 flushed; median [p20, p80]).",
        "",
    ]
    if report["dry_run"]:
        lines += ["A dry run: compiled for sm_90a on a CPU, nothing timed.", ""]
    if report["interrupted"]:
        lines += ["**Interrupted**: the launches not reached are marked not timed.", ""]
    lines += ["| family | pass | rule's pick | fastest | speed-up [interval] |", "|---|---|---|---|---|"]
    for row in report["best"]:
        speedup = "-" if row["speedup"] is None else f"{row['speedup']:.3f}x [{row['low']:.3f}, {row['high']:.3f}]"
        lines.append(
            f"| {row['family']} | {row['pass']} | {_figure(row['pick'])} | {_figure(row['fastest'])} | {speedup} |"
        )
    ways = backward_ways(report)
    if ways:
        lines += ["", "The attention backward both ways (fastest configs; one pass: its main launch alone):", ""]
        lines += [f"- {line}" for line in ways]
    if not report["dry_run"]:
        lines += ["", "What the rules take from it (tools.sweep.adopt; `--adopt` writes it to kernels/tuned/):", ""]
        lines += [f"- {line.strip()}" for line in adopted_lines(adopt(report))]
    lines += [
        "",
        "| family | pass | variant | config | pick | status | ms [p20, p80] | TFLOP/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in report["records"]:
        ms = "-" if r["median_ms"] is None else f"{r['median_ms']:.4f} [{r['p20_ms']:.4f}, {r['p80_ms']:.4f}]"
        tflops = "-" if r["tflops"] is None else f"{r['tflops']:.1f}"
        status = r["status"] + (f": {r['error']}" if r["error"] else "")
        lines.append(
            f"| {r['family']} | {r['pass_name']} | {r['variant']} | {r['config']} | {'yes' if r['rule_pick'] else ''} "
            f"| {status} | {ms} | {tflops} |"
        )
    return "\n".join(lines) + "\n"


def adopt_command(path, tables, results):
    """--adopt: the table of the sweep report at `path` into tables/<gpu>.json, and the report
    beside the committed ones as results/sweep-<gpu>.json when it is not there already."""
    from fastformer.kernels import _tuned

    path = Path(path)
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
        slug = _tuned.gpu_slug(report["env"]["gpu"])
        committed = Path(results) / f"sweep-{slug}.json"
        try:
            source = str(committed.relative_to(REPO))
        except ValueError:
            source = str(committed)
        table_doc = adopt(report, source)
    except (OSError, ValueError, KeyError, TypeError) as error:
        print(f"tools.sweep: --adopt {path}: {type(error).__name__}: {error}", file=sys.stderr)
        return 2
    if path.resolve() != committed.resolve():
        committed.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(committed, json.dumps(report, indent=1) + "\n")
        print(f"wrote {committed}")
    Path(tables).mkdir(parents=True, exist_ok=True)
    target = Path(tables) / f"{slug}.json"
    write_atomically(target, json.dumps(table_doc, indent=1) + "\n")
    print("\n".join(adopted_lines(table_doc)))
    print(f"wrote {target}")
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m tools.sweep", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out", type=Path, default=REPO / "tools" / "results", help="folder for sweep.json and sweep.md"
    )
    parser.add_argument(
        "--adopt",
        metavar="SWEEP_JSON",
        help="time nothing: write the tuned table a GPU's sweep.json decides into kernels/tuned/<gpu>.json "
        "(and the report into tools/results/sweep-<gpu>.json)",
    )
    parser.add_argument(
        "--tables", type=Path, default=REPO / "kernels" / "tuned", help="with --adopt: the tables' folder"
    )
    parser.add_argument(
        "--results", type=Path, default=REPO / "tools" / "results", help="with --adopt: the sweep reports' folder"
    )
    parser.add_argument("--quick", action="store_true", help="the families' small shapes")
    parser.add_argument("--dry-run", action="store_true", help="on a CPU: compile for sm_90a, time nothing")
    parser.add_argument("--budget", type=float, default=480.0, help="seconds, compiles included (default 480)")
    parser.add_argument("--reps", type=int, default=20, help="timed calls per launch (default 20)")
    parser.add_argument("--family", action="append", help="only families whose name contains this (repeatable)")
    parser.add_argument("--workers", type=int, help="compile threads (default: a CPU each)")
    args = parser.parse_args(argv)
    if args.adopt:
        return adopt_command(args.adopt, args.tables, args.results)
    if refuses_interpreter("sweep", "the sweep compiles the kernels for a GPU"):
        return 2
    if args.reps < 1 or args.budget <= 0:
        parser.error("--reps and --budget must be positive")
    if not args.dry_run:
        import torch

        if not torch.cuda.is_available():
            parser.error("no CUDA device: the sweep times kernels on a GPU (--dry-run compiles them on a CPU)")
    args.out.mkdir(parents=True, exist_ok=True)
    interrupt_once()
    run = functools.partial(
        sweep, args.quick, args.dry_run, args.budget, args.reps, args.family, args.workers,
        on_family=functools.partial(write_report, args.out),
    )  # fmt: skip
    if args.dry_run:
        from tools import sm90

        with sm90.dry_run(time_configs=False):
            report = run()
    else:
        report = run()
    best = table(report).split("\n\n| family | pass | variant")[0]  # the best per pass; sweep.md has every record
    print(best)
    if not args.dry_run:
        print("\n".join(adopted_lines(adopt(report))))
    print(f"wrote {args.out / 'sweep.json'} and {args.out / 'sweep.md'}")
    errors = [r for r in report["records"] if r["status"] == "error"]
    if report["interrupted"]:
        return 130
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
