"""What each mode of the command runs: its stages, their budgets, sizes and repetitions (Plan).

one     the default, and what tools/gpu_run.sh runs with no argument: the one command of a GPU lease
        (15 minutes of device time in all, the machine's start included: one command of at most
        600 s), planned for ONE_SECONDS. What it runs follows from what the repository already holds
        (one_run): without a sweep committed for this GPU model, the sweep first, then the kernel
        and model stages with its winners in force, then the parity subset; with one, the kernel and
        model stages where no committed run has measured them on the table now installed, else what
        the last run did not reach (the other tests, compile, determinism, the default job). On a
        CPU the same plan at smoke sizes, the sweep a dry run: the rehearsal of the GPU's run.
full    every stage at full size (about 40 minutes): a lease long enough for it
quick   the kernel and model stages and the parity subset (the one run once a sweep is committed)
rest    the rest: the other parity tests and the cuda tests, compile, determinism, the default job
smoke   every stage on tiny shapes: a CPU's check of the command (CI runs it)

Budgets are the seconds a stage may take in the plan's run order, and the clock is the run's: a
stage must end by the sum of its budget and those of the stages before it, so that time an early
stage does not use goes to the ones after it, and the run ends within the sum of them all.
"""

import json
from dataclasses import dataclass, replace
from pathlib import Path

from tools.convergence import TINY

ROOT = Path(__file__).resolve().parent.parent.parent
STAGES = ("env", "sweep", "tests", "compile", "determinism", "bench", "model", "job")
ONE_SECONDS = 540  # the one run's plan: tools/gpu_run.sh stops it at 570 s, the device tool's command at 600
# the model stage's providers in the order it measures them, the ones the targets read first, so
# that a budget spent leaves out the least needed (bench.cases.MODEL_WAYS says what each is)
MODEL_ORDER = (
    "fastformer_graphs",
    "reference_fp32",
    "fastformer",
    "reference_graphs",
    "fastformer_tf32",
    "reference_tf32",
    "fastformer_graphs_foreach",
    "reference_compiled",
    "reference_reduce_overhead",
    "fastformer_reduce_overhead",
    "reference",
    "reference_sdpa",
    "fastformer_fused_adamw",
    "fastformer_compile",
    "fastformer_autotune",
)


@dataclass(frozen=True)
class Repetitions:
    """How many times the stages repeat their items."""

    compile: int  # timed steps of the compiled model and of the eager one (compile stage)
    attention: int  # attention runs compared bit for bit, per setting (determinism stage)
    train_steps: int  # training steps compared bit for bit (determinism stage)
    warmup: int  # untimed calls before each benchmark's timing (bench and model stages)
    kernel: int  # timed calls of each kernel case, as called and as replayed (bench stage)
    steps: int  # timed steps of each model case (model stage; the host profile's steps too)


@dataclass(frozen=True)
class Plan:
    """What one mode runs. Budgets are seconds per stage, checked between items (a case, a model,
    a repetition), so a stage ends at most one item after its budget; the tests stage's pytest and
    the job stage's runs are interrupted at theirs. A stage's items are ordered so that what the
    decisions need comes first, and what a spent budget leaves out is reported as not run."""

    stages: tuple  # the stages the mode runs when --stage does not say
    budget_seconds: dict
    bench: str  # the bench stage's cases: "full", "quick" or "smoke" (tools.gpu_check.bench)
    config: dict  # Config.tutorial overrides for the compile, determinism and model stages
    compile_layers: int | None  # n_layer / num_layers for the compile stage; None keeps the config's
    aladdinpersson: dict  # Aladdin Persson's seq2seq Transformer and its batch, for the compile stage
    model_batch: int
    attention_shape: tuple  # (B, H, L, D) for the determinism stage
    reps: Repetitions
    model_providers: tuple  # in the order measured
    host_profile: tuple  # model providers whose eager train step the model stage profiles
    copy_bytes: int
    convergence: dict  # batch, steps and reviews (the first of the file's fixed order, cycled)
    tests: str = "full"  # the tests stage's selection (tools.gpu_check.tests.SELECTIONS)
    sweep: "Sweep | None" = None  # what the sweep stage runs
    tiny: bool = False  # smoke sizes: the plan a CPU runs (the env stage passes without CUDA)
    plots: int = 4  # PNGs written into DIR at most
    why: tuple = ()  # lines saying why the plan runs what it runs (the one run's)


@dataclass(frozen=True)
class Sweep:
    """The sweep stage's tools.sweep: the families (names or parts of them, None for all), their
    quick shapes or the targets', timed or (dry_run) compiled only, reps timed calls per launch."""

    families: tuple | None
    quick: bool
    dry_run: bool
    reps: int


FULL = Plan(
    stages=STAGES,
    budget_seconds=dict(env=60, sweep=600, tests=600, compile=270, determinism=90, bench=600, model=480, job=300),
    bench="full",
    config={},
    compile_layers=None,
    aladdinpersson=dict(vocab=8000, embed_size=512, num_layers=6, heads=8, batch=32, length=100),
    model_batch=128,
    attention_shape=(128, 4, 256, 64),
    reps=Repetitions(compile=5, attention=100, train_steps=10, warmup=3, kernel=50, steps=20),
    model_providers=MODEL_ORDER,
    host_profile=("fastformer", "reference_fp32"),
    copy_bytes=2**30,
    convergence=dict(batch=32, steps=36, reviews=192),
    sweep=Sweep(families=None, quick=False, dry_run=False, reps=20),
)
# Parts of the one run, each within its ONE_SECONDS. Estimates from the H200 run of 2026-11-28: 15
# cuda tests took 160 s (cold kernel compiles), a torch.compile of the 2-layer model's train step
# 40-70 s, 15 kernel cases 33 s with two FlexAttention compiles.
QUICK = replace(
    FULL,
    stages=("env", "bench", "model", "tests"),
    budget_seconds=dict(env=15, bench=190, model=195, tests=140),
    bench="quick",
    compile_layers=2,
    aladdinpersson=dict(FULL.aladdinpersson, num_layers=2),
    reps=Repetitions(compile=3, attention=20, train_steps=5, warmup=2, kernel=25, steps=10),
    model_providers=tuple(p for p in MODEL_ORDER if p != "fastformer_autotune"),
    tests="quick",
)
REST = replace(
    QUICK,
    stages=("env", "tests", "compile", "determinism", "job"),
    budget_seconds=dict(env=15, tests=200, compile=100, determinism=25, job=200),
    tests="rest",
)
# the sweep first: the families the targets judge first, then the kernel and model stages with
# its winners in force, then the parity subset with what is left
SWEEP_FIRST = replace(
    QUICK,
    stages=("env", "sweep", "bench", "model", "tests"),
    budget_seconds=dict(env=15, sweep=240, bench=120, model=110, tests=55),
)
SMOKE = replace(
    QUICK,
    stages=STAGES,
    budget_seconds=dict.fromkeys(STAGES, 300),
    bench="smoke",
    config=TINY,
    compile_layers=None,
    aladdinpersson=dict(vocab=50, embed_size=32, num_layers=1, heads=2, batch=2, length=12),
    model_batch=2,
    attention_shape=(2, 2, 13, 16),  # L 13: not a multiple of any block
    reps=Repetitions(compile=1, attention=2, train_steps=2, warmup=0, kernel=2, steps=2),
    model_providers=MODEL_ORDER,
    # on a CPU fastformer's profile would be the interpreter's own Python: the reference's shows the rows
    host_profile=("reference_fp32",),
    copy_bytes=2**24,
    convergence=dict(batch=2, steps=3, reviews=6),
    tests="smoke",
    # the dry run of the smallest family: every variant of the FFN's GEMM compiled for sm_90a
    sweep=Sweep(families=("gemm ffn M8192",), quick=True, dry_run=True, reps=2),
    tiny=True,
)
PLANS = {"full": FULL, "quick": QUICK, "rest": REST, "smoke": SMOKE}


# ----------------------------------------------------------------------------------------------
# The one run: what the repository holds decides what it runs
# ----------------------------------------------------------------------------------------------
def committed_sweep(gpu, root=ROOT):
    """The path of the sweep report committed for this GPU model (tools/results/sweep-<gpu>.json,
    timed on a GPU of that name, every launch reached: not interrupted, none left "not timed"), or
    None: then the one run sweeps again."""
    from fastformer.kernels._tuned import gpu_slug

    path = Path(root) / "tools" / "results" / f"sweep-{gpu_slug(gpu)}.json"
    report = _json(path)
    if report is None or report.get("dry_run") or report.get("env", {}).get("gpu") != gpu:
        return None
    if report.get("interrupted") or any(r.get("status") == "not timed" for r in report.get("records", ())):
        return None
    return path


def installed_table_sha(gpu, root=ROOT):
    """The sha256 of the launches of the tuned table installed for this GPU model
    (kernels/tuned/<gpu>.json; tools.gpu_check.run.table_sha), or None where there is none."""
    from fastformer.kernels._tuned import gpu_slug
    from tools.gpu_check.run import table_sha

    table = _json(Path(root) / "kernels" / "tuned" / f"{gpu_slug(gpu)}.json")
    return None if table is None or table.get("gpu") != gpu else table_sha(table)


def last_run(gpu, root=ROOT):
    """(folder name, results.json) of the newest run committed under bench/results/gpu/ on this
    GPU model, or None."""
    runs = []
    for path in sorted((Path(root) / "bench" / "results" / "gpu").glob("*/results.json")):
        document = _json(path)
        if document is not None and document.get("env", {}).get("gpu") == gpu:
            runs.append((document.get("started") or "", path.parent.name, document))
    if not runs:
        return None
    _, name, document = max(runs, key=lambda r: r[:2])
    return name, document


def reached(document, stage, tests=None):
    """Whether a committed run ran `stage` to an end (passed or failed); for the tests stage, with
    the selection `tests` where given."""
    entry = document.get("stages", {}).get(stage)
    if entry is None or entry.get("status") not in ("passed", "failed"):
        return False
    return tests is None or (entry.get("details") or {}).get("selection") == tests


def one_run(gpu, cuda, root=ROOT, seconds=ONE_SECONDS):
    """The one run's Plan on this GPU (its device name) from what `root` holds, its budgets scaled
    to `seconds`, its `why` the lines that say what it runs and why:

    1. no sweep committed for the GPU model (tools/results/sweep-<gpu>.json): SWEEP_FIRST;
    2. else, no committed run (bench/results/gpu/) has measured the kernel and model stages with
       the tuned table now installed for it (the sha of its launches in the run's env.tuned): QUICK;
    3. else, what the last run did not reach: REST, or where it reached all of that too, QUICK again.

    Without CUDA it is SWEEP_FIRST at smoke sizes, the sweep a dry run: the rehearsal."""
    if not cuda:
        plan = replace(SMOKE, stages=SWEEP_FIRST.stages, budget_seconds=SWEEP_FIRST.budget_seconds, plots=0)
        why = [
            "no CUDA device: the rehearsal of the one run, at smoke sizes (the sweep a dry run of one family "
            "compiled for sm_90a, the kernels through Triton's interpreter)"
        ]
        return _scaled(replace(plan, why=tuple(why)), seconds)
    sweep = committed_sweep(gpu, root)
    table = installed_table_sha(gpu, root)
    last = last_run(gpu, root)
    measured = (
        last is not None
        and reached(last[1], "bench")
        and reached(last[1], "model")
        and (last[1].get("env", {}).get("tuned") or {}).get("sha256") == table
    )
    if sweep is None:
        plan = SWEEP_FIRST
        why = [
            f"no whole sweep committed for {gpu} (tools/results/sweep-<gpu>.json): the sweep first, its winners "
            "then in force for the kernel and model stages beside the peers, then the parity subset"
        ]
    elif not measured:
        plan = QUICK
        seen = "no committed run on it" if last is None else f"the last committed run ({last[0]}) did not"
        why = [
            f"a sweep is committed for {gpu} ({sweep.relative_to(root)}), but {seen} measured the kernel and "
            "model stages with its table installed: those, beside the peers, then the parity subset"
        ]
    elif not all(reached(last[1], s, "rest" if s == "tests" else None) for s in REST.stages if s != "env"):
        plan = REST
        why = [
            f"the last committed run ({last[0]}) measured the kernel and model stages on this table: "
            "what it did not reach, the other tests, compile, determinism and the default job"
        ]
    else:
        plan = QUICK
        why = [f"the last committed run ({last[0]}) reached every stage: the kernel and model stages again"]
    return _scaled(replace(plan, plots=0, why=tuple(why)), seconds)


def _scaled(plan, seconds):
    """The plan with its stages' budgets scaled to add up to `seconds`."""
    total = sum(plan.budget_seconds[s] for s in plan.stages)
    if seconds == total:
        return plan
    budgets = {s: plan.budget_seconds[s] * seconds / total for s in plan.stages}
    return replace(plan, budget_seconds=budgets)


def budget_line(plan):
    """The stages and their budgets in a line: "env 15 s, sweep 240 s, ..."."""
    return "stages: " + ", ".join(f"{s} {plan.budget_seconds[s]:.0f} s" for s in plan.stages)


def _json(path):
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
