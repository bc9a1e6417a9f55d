"""The bench stage: the kernel cases the targets are judged on, fastformer against the peers
measured in the same run (bench/'s cases); then, for the pairs where fastformer trailed a peer on
the last GPU run (KERNEL_PROFILE), each one's kernels under torch.profiler: device time per kernel
per call, the most first (where the time goes, ours beside the peer's)."""

from collections import Counter

from bench import cases as suite
from bench.targets import judged
from tools.gpu_check.run import CPU_TARGETS, measure_cases, raise_for_cases


def stage(run):
    cases = bench_cases(run.plan.bench, run.device)
    profiled = {c.id for c in _profiled_cases(cases)}
    details = measure_cases(run, "bench", cases, run.plan.reps.kernel, profiled)
    details["summary"] = (
        f"{details['measured']} measured, {details['skipped']} skipped, {details['failed']} failed, "
        f"{details['not_run']} not run; " + (targets_note(run.targets()) if run.cuda else "targets " + CPU_TARGETS)
    )
    details["kernel_profile"] = {
        r["case"]: r["kernels"] for r in run.reports["bench"]["results"] if r.get("kernels") is not None
    }
    raise_for_cases(details)
    return details


def targets_note(targets):
    """The targets' verdicts in a few words: "targets: 3 met, 2 not met, 1 within noise, 7 not measured"."""
    counts = Counter(t["verdict"] for t in targets)
    return "targets: " + ", ".join(
        f"{counts[v]} {v}" for v in ("met", "not met", "within noise", "not measured") if counts[v]
    )


# The bench cases whose kernels the bench stage lists (torch.profiler, device time per kernel per
# call, bench.common.profile_kernels), fastformer's beside a peer's, for each pair the
# targets judge: (bench, the mask or the op, providers). Each takes the stage's first case of its
# bench and mask or op (in --quick: D 64, L 4096; the model's call at L 64; the tutorial's FFN layer).
KERNEL_PROFILE = (
    ("ffn_fwd_bwd", "feed_forward", ("fastformer", "eager")),
    ("attention_fwd", "causal", ("fastformer", "sdpa")),
    ("attention_fwd_bwd", "causal", ("fastformer", "sdpa")),
    ("attention_model_call", "padding", ("fastformer", "sdpa")),
)


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


# the long attention shape the kernel targets are judged at (B * L = 16384 tokens, H 16), as
# bench.cases.attention_cases builds it
LONG = dict(B=4, H=16, L=4096)
SDPA = ("sdpa", *suite.SDPA_BACKENDS)
MODEL_CALL_LENGTHS = (64, 128, 256)


def bench_cases(kind, device):
    """The bench stage's cases for a plan's `bench`, in the order measured: the cases the targets
    read first (fastformer and its peers), then the other masks, head dims and dtypes, and the
    compiled peers, the slowest to set up, last. "quick": D64 (and D128, fp16) at L 4096, the
    model's attention call at its three lengths, the tutorial's FFN and add + LayerNorm layers,
    attention over the bench batch's reviews packed against them padded;
    "full": those, then every other case a target reads (L 8192 and 16384, fastformer_autotune);
    "smoke": the same kinds of cases on tiny shapes, for a CPU."""
    if kind == "smoke":
        return _smoke_cases(device)
    cases = _quick_cases(device)
    if kind == "full":
        seen = {c.id for c in cases}
        more = suite.attention_cases(device) + suite.ffn_cases(device)
        cases += [c for c in more if c.id not in seen and judged(c)]
        cases += [
            _autotuned(c, device) for c in cases if c.provider == "fastformer" and c.bench.startswith("attention_f")
        ]
    return cases


def _autotuned(case, device):
    """An attention case's fastformer_autotune twin: every kernel config timed in place of the rules' picks."""
    p = case.params
    mode = case.bench.removeprefix("attention_")
    shape = (p["B"], p["H"], p["L"])
    return suite.attention_case(mode, p["dtype"], p["D"], p["mask"], *shape, "fastformer_autotune", device, p["shape"])


def _attention(modes, mask, providers, device, D=64, dtype="bf16"):
    return [
        suite.attention_case(mode, dtype, D, mask, LONG["B"], LONG["H"], LONG["L"], p, device)
        for mode in modes
        for p in providers
    ]


def _model_call(modes, providers, device, lengths=MODEL_CALL_LENGTHS, **shape):
    return [
        suite.attention_model_call_case(mode, L, p, device, **shape)
        for mode in modes
        for L in lengths
        for p in providers
    ]


def _quick_cases(device):
    ffn = dict(M=32768, d=256, d_ff=1024)
    both = ("fwd", "fwd_bwd")
    return [
        *_attention(both, "causal", ("fastformer", *SDPA), device),
        *_model_call(("fwd_bwd",), ("fastformer", *SDPA, "flex"), device),
        *[suite.ffn_case("fwd_bwd", "feed_forward", **ffn, provider=p, device=device) for p in ("fastformer", "eager")],
        # the same with tiles through tensor descriptors: what the rules would run if the sweep says so
        *_attention(both, "causal", ("fastformer_tma",), device),
        # and the backward in its two passes, where the rule takes one at L4096 (kernels/_backward_choice.py)
        *_attention(("fwd_bwd",), "causal", ("fastformer_two_pass",), device),
        *_model_call(("fwd_bwd",), ("fastformer_tma",), device),
        suite.ffn_case("fwd_bwd", "feed_forward", **ffn, provider="fastformer_tma", device=device),
        # and the product by cuBLAS, the activation by its own kernel (kernels.set_ffn_gemm)
        suite.ffn_case("fwd_bwd", "feed_forward", **ffn, provider="fastformer_cublas", device=device),
        *[suite.add_layer_norm_case("fwd_bwd", 32768, 256, p, device) for p in ("fastformer", "liger", "eager")],
        *_attention(both, "padding_causal", ("fastformer", "flex", *SDPA), device),
        *_attention(both, "none", ("fastformer", *SDPA, "flex"), device),
        *_model_call(("fwd",), ("fastformer", *SDPA), device),
        *_attention(both, "causal", ("fastformer", *SDPA), device, D=128),
        *_attention(both, "causal", ("fastformer", *SDPA), device, dtype="fp16"),
        # attention over packed reviews (kernels.attention_varlen) against the same reviews padded
        *[suite.attention_varlen_case("fwd_bwd", p, device) for p in ("fastformer_varlen", "fastformer", "sdpa")],
        *[suite.ffn_case("fwd", "feed_forward", **ffn, provider=p, device=device) for p in suite.FFN_PROVIDERS],
        suite.ffn_case("fwd", "feed_forward", **ffn, provider="fastformer_fused", device=device),
        *[suite.add_layer_norm_case("fwd", 32768, 256, p, device) for p in suite.ADD_LAYER_NORM_PROVIDERS],
        suite.add_layer_norm_case("fwd_bwd", 32768, 256, "compile", device),
        *[suite.ffn_case("fwd_bwd", "feed_forward", **ffn, provider=p, device=device) for p in suite.COMPILE_MODES],
    ]


def _smoke_cases(device):
    """Every provider and kind of case of the quick list, on shapes a CPU runs through Triton's
    interpreter in seconds (fp32 but for the fp16 row; B 2, H 2, L 13: no block multiple)."""
    tiny = dict(B=2, H=2, L=13)
    both = ("fwd", "fwd_bwd")

    def attention(modes, mask, providers, D=16, dtype="fp32"):
        return [
            suite.attention_case(m, dtype, D, mask, **tiny, provider=p, device=device, shape="tiny")
            for m in modes
            for p in providers
        ]

    ffn = dict(M=24, d=16, d_ff=32, dtype="fp32")
    return [
        *attention(both, "causal", ("fastformer", "fastformer_tma", *SDPA)),
        *attention(("fwd_bwd",), "causal", ("fastformer_two_pass",)),
        *_model_call(
            both,
            ("fastformer", "fastformer_tma", *SDPA, "flex", "reference"),
            device,
            (13,),
            B=2,
            H=2,
            D=16,
            dtype="fp32",
        ),
        *attention(both, "padding_causal", ("fastformer", "flex", *SDPA)),
        *attention(("fwd",), "none", ("fastformer", "sdpa", "reference", "compile")),
        *attention(("fwd",), "causal", ("fastformer", "sdpa"), D=128),
        *attention(("fwd",), "causal", ("fastformer", "sdpa"), dtype="fp16"),
        *[
            suite.attention_varlen_case("fwd_bwd", p, device, B=3, H=2, D=16, L=13, dtype="fp32", min_len=1)
            for p in ("fastformer_varlen", "fastformer", "sdpa")
        ],
        *[
            suite.ffn_case(m, "feed_forward", **ffn, provider=p, device=device)
            for m in both
            for p in suite.FFN_PROVIDERS
        ],
        suite.ffn_case("fwd", "feed_forward", **ffn, provider="fastformer_fused", device=device),
        *[
            suite.add_layer_norm_case(m, 24, 16, p, device, dtype="fp32")
            for m in both
            for p in suite.ADD_LAYER_NORM_PROVIDERS
        ],
    ]
