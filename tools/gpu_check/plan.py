"""What each mode of the command runs: its stages, their budgets, sizes and repetitions (Plan).

full    every stage at full size (about 40 minutes): a lease long enough for it
quick   the first call of a 560-second lease: what decides (the parity subset of the kernel tests on
        the GPU, the kernel cases by device time with their peers, the model stage with every provider)
rest    its second call: the rest (the other parity tests and the cuda tests, compile, determinism,
        the default job end to end)
smoke   every stage on tiny shapes: a CPU's check of the command (CI runs it)
"""

from dataclasses import dataclass, replace

from tools.convergence import TINY

STAGES = ("env", "tests", "compile", "determinism", "bench", "model", "job")
# the model stage's providers in the order it measures them, the ones the targets read first, so
# that a budget spent leaves out the least needed (tools.benchmarks.cases.MODEL_WAYS says what each is)
MODEL_ORDER = (
    "fastformer_graphs",
    "reference_fp32",
    "fastformer",
    "reference_graphs",
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


FULL = Plan(
    stages=STAGES,
    budget_seconds=dict(env=60, tests=600, compile=270, determinism=90, bench=600, model=480, job=300),
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
)
# The two calls of a 560-second lease (tools/gpu_run.sh stops the command at 535 s): each adds up
# to at most 510 s, leaving room for start-up and the item that overruns. Estimates from the H200
# run of 2026-11-28: 15 cuda tests took 160 s (cold kernel compiles), a torch.compile of the 2-layer
# model's train step 40-70 s, 15 kernel cases 33 s with two FlexAttention compiles.
QUICK = replace(
    FULL,
    stages=("env", "tests", "bench", "model"),
    budget_seconds=dict(env=15, tests=110, bench=190, model=195),
    bench="quick",
    compile_layers=2,
    aladdinpersson=dict(FULL.aladdinpersson, num_layers=2),
    reps=Repetitions(compile=3, attention=20, train_steps=5, warmup=2, kernel=25, steps=10),
    model_providers=tuple(p for p in MODEL_ORDER if p != "fastformer_autotune"),
)
REST = replace(
    QUICK,
    stages=("env", "tests", "compile", "determinism", "job"),
    budget_seconds=dict(env=15, tests=200, compile=100, determinism=25, job=170, bench=190, model=195),
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
)
PLANS = {"full": FULL, "quick": QUICK, "rest": REST, "smoke": SMOKE}
