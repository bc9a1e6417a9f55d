"""What each mode of the command runs: the stages' budgets, sizes and repetitions (Plan), one per
mode: "full", "quick" (the first GPU call) and "smoke" (tiny shapes, a CPU's check of the command)."""

from dataclasses import dataclass, replace

from tools.benchmarks import cases as suite
from tools.benchmarks.cases import MODEL_VARIANTS
from tools.convergence import TINY

STAGES = ("env", "tests", "compile", "determinism", "bench", "model")
# The cuda tests --quick and --smoke leave out: the dense-mask attention path (the models never
# take it), the inference-only fused FFN (not wired into the models) and the B*H > 65535 grid test
# (one large allocation), and the whole `fastformer train` runs with --cuda-graphs and --compile
# (minutes of first-call kernel compiles); the parity of every op the models run, bf16 included,
# and the graph replays against eager steps stay.
REDUCED_TESTS = (
    "not dense_mask and not fused_parity and not 65535 and not train_with_cuda_graphs and not compile_on_cuda_trains"
)


@dataclass(frozen=True)
class Repetitions:
    """How many times the stages repeat their items."""

    compile: int  # timed steps of the compiled model and of the eager one (compile stage)
    attention: int  # attention runs compared bit for bit, per setting (determinism stage)
    train_steps: int  # training steps compared bit for bit (determinism stage)
    warmup: int  # untimed runs before each benchmark's timing (bench and model stages)
    measure: int  # timed runs of each benchmark (bench and model stages)


@dataclass(frozen=True)
class Plan:
    """What one mode runs. Budgets are seconds per stage, checked between items (a case, a model,
    a repetition), so a stage ends at most one item after its budget; the tests stage's pytest is
    interrupted at its budget. The full budgets add up to 22.5 minutes, the quick ones to 8,
    leaving room for the item that overruns and for start-up."""

    budget_seconds: dict
    tests_filter: str | None  # pytest -k for the cuda tests; None runs them all
    config: dict  # Config.tutorial overrides for the compile, determinism and model stages
    compile_layers: int | None  # n_layer / num_layers for the compile stage; None keeps the config's
    aladdinpersson: dict  # Aladdin Persson's seq2seq Transformer and its batch, for the compile stage
    model_batch: int
    attention_shape: tuple  # (B, H, L, D) for the determinism stage
    reps: Repetitions
    model_providers: tuple
    model_variants: tuple  # of MODEL_VARIANTS
    host_profile: tuple  # model providers whose eager train step the model stage profiles
    copy_bytes: int
    convergence: dict  # batch, steps and reviews (the first of the file's fixed order, cycled)


FULL = Plan(
    budget_seconds=dict(env=60, tests=330, compile=270, determinism=90, bench=330, model=270),
    tests_filter=None,
    config={},
    compile_layers=None,
    aladdinpersson=dict(vocab=8000, embed_size=512, num_layers=6, heads=8, batch=32, length=100),
    model_batch=128,
    attention_shape=(128, 4, 256, 64),
    reps=Repetitions(compile=5, attention=100, train_steps=10, warmup=3, measure=10),
    model_providers=suite.MODEL_PROVIDERS,
    model_variants=MODEL_VARIANTS,
    host_profile=("fastformer", "reference_fp32"),
    copy_bytes=2**30,
    convergence=dict(batch=32, steps=36, reviews=192),
)
QUICK = replace(
    FULL,
    # on an H100 a cuda test takes 3 to 28 s, mostly cold kernel compiles; determinism, bench and
    # model took 17, 33 and 34 s of theirs (bench/results/gpu/h100-2026-11-26)
    budget_seconds=dict(env=30, tests=160, compile=100, determinism=30, bench=80, model=80),
    tests_filter=REDUCED_TESTS,
    compile_layers=2,
    aladdinpersson=dict(FULL.aladdinpersson, num_layers=2),
    reps=Repetitions(compile=3, attention=20, train_steps=5, warmup=2, measure=5),
    model_providers=tuple(p for p in suite.MODEL_PROVIDERS if p not in ("compile", "fastformer_autotune")),
    model_variants=("fastformer_graphs", "fastformer_fused_adamw"),
)
SMOKE = replace(
    QUICK,
    budget_seconds=dict.fromkeys(STAGES, 300),
    config=TINY,
    compile_layers=None,
    aladdinpersson=dict(vocab=50, embed_size=32, num_layers=1, heads=2, batch=2, length=12),
    model_batch=2,
    attention_shape=(2, 2, 13, 16),  # L 13: not a multiple of any block
    reps=Repetitions(compile=1, attention=2, train_steps=2, warmup=0, measure=1),
    model_providers=suite.MODEL_PROVIDERS,
    model_variants=MODEL_VARIANTS,
    # on a CPU fastformer's profile would be the interpreter's own Python: the reference's shows the rows
    host_profile=("reference_fp32",),
    copy_bytes=2**24,
    convergence=dict(batch=2, steps=3, reviews=6),
)
PLANS = {"full": FULL, "quick": QUICK, "smoke": SMOKE}
