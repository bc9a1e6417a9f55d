"""Every benchmark case, defined once: the pytest-benchmark suites and `python -m bench.report`
both run these. A case builds its inputs, times one provider, and checks the result it times
against an fp32 PyTorch computation, so a fast wrong kernel fails its benchmark.

`full_suite(device)` is what runs on CUDA; `smoke_suite()` is a few tiny cases for a CPU, used by
the tests to exercise every code path of the report without a GPU.
"""

import math

import torch
import torch.nn.functional as F

import fastformer
from fastformer import kernels
from fastformer.train.graphs import GraphedSteps, make_capturable
from fastformer.train.loop import adamw, autocast
from tools.benchmarks.common import Case, Skip, assert_close_to, attention_flops, ffn_flops

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# the tolerance of a benchmark's check against fp32, per dtype: loose enough for rounding, far
# below what a wrong mask or a wrong row would give
ATOL = {"bf16": 3e-2, "fp16": 5e-3, "fp32": 1e-4}
REFERENCE_SCORES_LIMIT_GB = 8  # the reference provider materializes (B, H, L, L) scores

# fastformer_autotune: fastformer with every kernel config timed (kernels.autotuning) in place of each
# kernel's rule picking one, so a GPU run shows what the rule leaves on the table
ATTENTION_PROVIDERS = ("fastformer", "fastformer_autotune", "reference", "sdpa", "flex", "compile")
MASKS = ("none", "causal", "padding", "padding_causal")


def _cuda_only(device, provider):
    if torch.device(device).type != "cuda":
        raise Skip(f"{provider} is benchmarked on CUDA only (torch.compile over Triton code needs a GPU)")


def _compiled(fn):
    """torch.compile(fn) for one case, called in the case's setup. Dynamo's caches are reset first:
    it keeps at most `recompile_limit` (8) graphs per function and past that silently runs the
    function eagerly, so a suite of more shapes would time eager code under the "compile" and
    "flex" names. Each case compiles its own shape (compile time is not timed)."""
    torch._dynamo.reset()
    return torch.compile(fn, dynamic=False)


# ----------------------------------------------------------------------------------------------
# attention
# ----------------------------------------------------------------------------------------------
def attention_inputs(B, H, L, D, dtype, mask, device, grad):
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(B, H, L, D, generator=g).to(device, dtype).requires_grad_(grad) for _ in range(3))
    key_padding = None
    if "padding" in mask:
        lengths = torch.randint(L // 2, L + 1, (B,), generator=g).to(device)
        key_padding = torch.arange(L, device=device) >= lengths[:, None]  # (B, L), True = padding
    return q, k, v, key_padding, "causal" in mask


def _attention_provider(provider, key_padding, causal, B, L, device):
    """fn(q, k, v) -> out for one provider, expressing the same mask."""
    if provider in ("fastformer", "fastformer_autotune"):
        tuned = provider == "fastformer_autotune"

        def fn(q, k, v):
            with kernels.autotuning(tuned):
                return kernels.attention(q, k, v, key_padding_mask=key_padding, causal=causal)

        return fn
    if provider == "reference":
        return lambda q, k, v: kernels.attention_reference(q, k, v, key_padding_mask=key_padding, causal=causal)
    if provider == "compile":
        _cuda_only(device, provider)
        ref = _compiled(kernels.attention_reference)
        return lambda q, k, v: ref(q, k, v, key_padding_mask=key_padding, causal=causal)
    if provider == "sdpa":
        if key_padding is None:
            return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        keep = ~key_padding[:, None, None, :]  # (B, 1, 1, L), True = attend
        if causal:
            keep = keep & torch.ones(L, L, dtype=torch.bool, device=device).tril()
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
    if provider == "flex":
        _cuda_only(device, provider)
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        flex = _compiled(flex_attention)
        if key_padding is None and not causal:
            return lambda q, k, v: flex(q, k, v)
        lengths = (~key_padding).sum(1) if key_padding is not None else None

        def mask_mod(b, h, q_idx, kv_idx):
            keep = (kv_idx < lengths[b]) if lengths is not None else (kv_idx >= 0)
            return keep & (q_idx >= kv_idx) if causal else keep

        block_mask = create_block_mask(mask_mod, B if lengths is not None else None, None, L, L, device=device)
        return lambda q, k, v: flex(q, k, v, block_mask=block_mask)
    raise ValueError(f"unknown attention provider {provider!r}")


def _attention_rows_check(q, k, v, key_padding, causal, rows, out, dq=None, do=None, atol=0.0):
    """Check output (and dq) rows of batch 0 against fp32 attention over the full keys: only the
    sampled rows' scores are built, so the check stays small at any length."""
    L, D = k.shape[2], k.shape[3]
    qs = q[:1, :, rows].detach().float().requires_grad_(dq is not None)
    scores = qs @ k[:1].detach().float().transpose(-1, -2) / math.sqrt(D)  # (1, H, r, L)
    masked = torch.zeros(len(rows), L, dtype=torch.bool, device=q.device)
    if key_padding is not None:
        masked |= key_padding[0][None, :]
    if causal:
        masked |= torch.arange(L, device=q.device)[None, :] > rows[:, None]
    expected = scores.masked_fill(masked, float("-inf")).softmax(-1) @ v[:1].detach().float()
    assert_close_to("out", out[:1, :, rows], expected, atol)
    if dq is not None:
        (grad,) = torch.autograd.grad(expected, qs, do[:1, :, rows].float())
        assert_close_to("dq", dq[:1, :, rows], grad, atol * 4, rtol=0.05)


def attention_case(mode, dtype, D, mask, B, H, L, provider, device, shape="long"):
    bench = f"attention_{mode}"
    params = {"shape": shape, "dtype": dtype, "D": D, "mask": mask, "B": B, "H": H, "L": L}
    case = Case(
        bench, provider, params, setup=None, flops=attention_flops(B, H, L, L, D, "causal" in mask, mode), tokens=B * L
    )

    def setup():
        if provider == "reference" and B * H * L * L * 4 / 2**30 > REFERENCE_SCORES_LIMIT_GB:
            raise Skip(f"reference would materialize {B * H * L * L * 4 / 2**30:.0f} GB of fp32 scores")
        q, k, v, key_padding, causal = attention_inputs(B, H, L, D, DTYPES[dtype], mask, device, mode == "fwd_bwd")
        fn = _attention_provider(provider, key_padding, causal, B, L, device)
        if provider == "sdpa":
            choice = torch._fused_sdp_choice(
                q,
                k,
                v,
                None if key_padding is None else ~key_padding[:, None, None, :],
                0.0,
                causal and key_padding is None,
            )
            case.extra["sdpa_backend"] = torch.nn.attention.SDPBackend(choice).name
        rows = torch.unique(torch.tensor([0, 1, L // 3, L // 2, L - 2, L - 1], device=device).clamp(0, L - 1))
        if mode == "fwd":

            def run():
                with torch.no_grad():
                    return fn(q, k, v)

            def check():
                _attention_rows_check(q, k, v, key_padding, causal, rows, run(), atol=ATOL[dtype])
        else:
            do = torch.randn_like(q)

            def run():
                out = fn(q, k, v)
                return (out, *torch.autograd.grad(out, (q, k, v), do))

            def check():
                out, dq, _, _ = run()
                _attention_rows_check(q, k, v, key_padding, causal, rows, out, dq, do, atol=ATOL[dtype])

        return run, check

    case.setup = setup
    return case


def attention_cases(device, modes=("fwd", "fwd_bwd"), providers=ATTENTION_PROVIDERS):
    """The tutorial's shape (B 128, H 4, L 256, D 64) and long ones (B * L = 16384, H 16), every
    mask, D 64 and 128; bf16 everywhere, fp16 at the tutorial's shape and L 4096."""
    shapes = [(128, 4, 256)] + [(16384 // L, 16, L) for L in (512, 1024, 2048, 4096, 8192, 16384)]
    cases = []
    for mode in modes:
        for B, H, L in shapes:
            for D in (64, 128):
                for dtype in ("bf16", "fp16"):
                    if dtype == "fp16" and L not in (256, 4096):
                        continue
                    for mask in MASKS:
                        for provider in providers:
                            shape = "tutorial" if shapes[0] == (B, H, L) else "long"
                            cases.append(attention_case(mode, dtype, D, mask, B, H, L, provider, device, shape))
    return cases


# ----------------------------------------------------------------------------------------------
# FFN and add + LayerNorm
# ----------------------------------------------------------------------------------------------
def _run_and_check(fn, eager, inputs, dy, names, atol):
    """run() and check() of a case timing fn(*inputs): run returns the output and, when the inputs
    require grad, their gradients for the output gradient `dy`; check compares each (named by
    `names`) with `eager` on fp32 copies of the inputs, to `atol` times its largest magnitude."""
    grad = inputs[0].requires_grad

    def run():
        if not grad:
            with torch.no_grad():
                return (fn(*inputs),)
        y = fn(*inputs)
        return (y, *torch.autograd.grad(y, inputs, dy))

    def check():
        got = run()
        leaves = [t.detach().float().requires_grad_(grad) for t in inputs]
        with torch.enable_grad() if grad else torch.no_grad():
            y32 = eager(*leaves)
            expected = (y32, *torch.autograd.grad(y32, leaves, dy.float())) if grad else (y32,)
        for name, a, e in zip(names, got, expected):
            scale = e.abs().max().item() or 1.0
            assert_close_to(name, a, e, atol * scale)

    return run, check


def _eager_ffn(x, w1, b1, w2, b2):
    return F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)


def _eager_linear_gelu(x, w, b):
    return F.gelu(F.linear(x, w, b))


def ffn_case(mode, op, M, d, d_ff, provider, device, dtype="bf16"):
    params = {"op": op, "dtype": dtype, "M": M, "d": d, "d_ff": d_ff}
    flops = ffn_flops(M, d, d_ff, mode) / (2 if op == "linear_gelu" else 1)
    case = Case(f"ffn_{mode}", provider, params, setup=None, flops=flops, tokens=M)

    def setup():
        eager = _eager_ffn if op == "feed_forward" else _eager_linear_gelu
        fn = {"fastformer": getattr(kernels, op), "eager": eager}.get(provider)
        if provider == "fastformer_fused":  # the inference-only fully fused FFN, timed against the two-kernel one
            if mode != "fwd" or op != "feed_forward":
                raise ValueError("fastformer_fused is the no-grad feed_forward only")
            fn = kernels.feed_forward_fused
        if provider == "compile":
            _cuda_only(device, provider)
            fn = _compiled(eager)
        if fn is None:
            raise ValueError(f"unknown FFN provider {provider!r}")
        g = torch.Generator(device="cpu").manual_seed(0)
        grad = mode == "fwd_bwd"
        x = torch.randn(M, d, generator=g).to(device, DTYPES[dtype]).requires_grad_(grad)
        weights = [torch.randn(d_ff, d, generator=g) / d**0.5, torch.randn(d_ff, generator=g) * 0.1]
        if op == "feed_forward":
            weights += [torch.randn(d, d_ff, generator=g) / d_ff**0.5, torch.randn(d, generator=g) * 0.1]
        weights = [w.to(device, DTYPES[dtype]).requires_grad_(grad) for w in weights]
        dy = torch.randn(M, d if op == "feed_forward" else d_ff, generator=g).to(device, DTYPES[dtype])
        return _run_and_check(fn, eager, (x, *weights), dy, ("y", "dx", "dw1", "db1", "dw2", "db2"), ATOL[dtype])

    case.setup = setup
    return case


def _eager_add_layer_norm(x, residual, weight, bias):
    return F.layer_norm(residual + x, weight.shape, weight, bias, 1e-12)


def add_layer_norm_case(mode, M, d, provider, device, dtype="bf16"):
    params = {"mode": mode, "dtype": dtype, "M": M, "d": d}
    case = Case("add_layer_norm", provider, params, setup=None, tokens=M)

    def setup():
        if provider == "fastformer":

            def fn(x, r, w, b):
                return kernels.add_layer_norm(x, r, w, b, 1e-12, 0.0)
        elif provider == "eager":
            fn = _eager_add_layer_norm
        elif provider == "compile":
            _cuda_only(device, provider)
            fn = _compiled(_eager_add_layer_norm)
        else:
            raise ValueError(f"unknown add_layer_norm provider {provider!r}")
        g = torch.Generator(device="cpu").manual_seed(0)
        grad = mode == "fwd_bwd"
        x, r = (torch.randn(M, d, generator=g).to(device, DTYPES[dtype]).requires_grad_(grad) for _ in range(2))
        w = (1 + 0.1 * torch.randn(d, generator=g)).to(device, DTYPES[dtype]).requires_grad_(grad)
        b = (0.1 * torch.randn(d, generator=g)).to(device, DTYPES[dtype]).requires_grad_(grad)
        dy = torch.randn(M, d, generator=g).to(device, DTYPES[dtype])
        return _run_and_check(
            fn, _eager_add_layer_norm, (x, r, w, b), dy, ("y", "dx", "dresidual", "dw", "db"), ATOL[dtype]
        )

    case.setup = setup
    return case


def ffn_cases(device, providers=("fastformer", "eager", "compile")):
    """The tutorial's layer at batch 128 (M 32768, d 256, d_ff 1024) and a wide one (M 8192, d 1024, d_ff 4096)."""
    cases = []
    for mode in ("fwd", "fwd_bwd"):
        for M, d, d_ff in ((32768, 256, 1024), (8192, 1024, 4096)):
            for op in ("feed_forward", "linear_gelu"):
                cases += [ffn_case(mode, op, M, d, d_ff, p, device) for p in providers]
            if mode == "fwd" and "fastformer" in providers:
                cases.append(ffn_case(mode, "feed_forward", M, d, d_ff, "fastformer_fused", device))
        for M, d in ((32768, 256), (8192, 1024)):
            cases += [add_layer_norm_case(mode, M, d, p, device) for p in providers]
    return cases


# ----------------------------------------------------------------------------------------------
# the model
# ----------------------------------------------------------------------------------------------
# fastformer's step run other ways, timed beside its eager step by the GPU check's model stage
MODEL_VARIANTS = ("fastformer_graphs", "fastformer_compile", "fastformer_fused_adamw")
TRAIN_VARIANTS = ("fastformer_fused_adamw",)  # variants of the train step alone
MODEL_PROVIDERS = ("fastformer", "fastformer_autotune", "reference_fp32", "reference", "compile")


def review_batch(config, B, seq2seq, device, seed=0):
    """Encoder ids of lengths 8..128 padded to the batch maximum (short reviews); decoder [BOS], or
    for seq2seq a decoder sequence as long as the encoder's."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    lengths = torch.randint(8, 129, (B,), generator=g).clamp(max=config.n_enc_seq)  # a small config caps them
    L = int(lengths.max())
    enc = torch.randint(7, config.n_enc_vocab, (B, L), generator=g)
    enc = enc.masked_fill(torch.arange(L) >= lengths[:, None], config.i_pad)
    dec = torch.full((B, 1), 2) if not seq2seq else enc.clone().masked_fill(enc.eq(config.i_pad), config.i_pad)
    if seq2seq:
        dec[:, 0] = 2
    labels = torch.randint(0, config.n_output, (B,), generator=g)
    return enc.to(device), dec.to(device), labels.to(device)


def model_case(kind, scenario, provider, device, B=128, config=None, amp=None):
    """MovieClassification train step (forward, backward, AdamW) or inference. Providers:
    fastformer (Triton backend, bf16 autocast; each kernel's rule picks its config), fastformer_autotune
    (the same with every config timed), reference_fp32 (as the tutorial runs), reference (bf16
    autocast), compile (torch.compile of the reference model, bf16 autocast)."""
    config = config or fastformer.Config.tutorial()
    amp = provider != "reference_fp32" if amp is None else amp
    params = {"scenario": scenario, "B": B, "n_layer": config.n_layer, "d_hidn": config.d_hidn, "amp": amp}
    case = Case(f"model_{kind}", provider, params, setup=None)
    backend_name = "triton" if provider.startswith("fastformer") else "reference"

    def setup():
        if provider == "compile":
            _cuda_only(device, provider)
        enc, dec, labels = review_batch(config, B, scenario == "seq2seq", device)
        case.tokens = int(enc.ne(config.i_pad).sum() + dec.ne(config.i_pad).sum())
        case.extra["enc_len"] = enc.shape[1]
        torch.manual_seed(0)
        model = fastformer.MovieClassification(config).to(device)
        initial = {k: v.clone() for k, v in model.state_dict().items()}
        forward = _compiled(model) if provider == "compile" else model
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def logits():
            with (
                fastformer.use_backend(backend_name),
                kernels.autotuning(provider == "fastformer_autotune"),
                torch.autocast(torch.device(device).type, torch.bfloat16, enabled=amp),
            ):
                return forward(enc, dec)[0]

        def run():
            if kind == "infer":
                with torch.no_grad():
                    return logits()
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(logits().float(), labels)
            loss.backward()
            optimizer.step()
            return loss

        def check():
            """The provider's eval-mode logits on the initial weights against fp32 reference logits."""
            trained = {k: v.clone() for k, v in model.state_dict().items()}
            model.load_state_dict(initial)
            model.eval()
            with torch.no_grad():
                got = logits().float()
                with fastformer.use_backend("reference"):
                    expected = model(enc, dec)[0].float()
            model.train()
            model.load_state_dict(trained)
            scale = expected.abs().max().item() or 1.0
            assert_close_to("logits", got, expected, (ATOL["bf16"] if amp else ATOL["fp32"]) * 4 * scale)
            if kind == "train":
                assert bool(torch.isfinite(run())), "training loss is not finite"

        model.train(kind == "train")
        return run, check

    case.setup = setup
    return case


def model_variant_case(kind, variant, device, B, config, amp):
    """model_case's fastformer case (Triton backend, bf16 autocast when `amp`; the same
    batch, params and check), its step run another way: "fastformer_graphs" replays the train step
    or the inference forward from a CUDA graph (fastformer.train.graphs.GraphedSteps, with the capturable
    AdamW it needs), "fastformer_compile" runs the model through torch.compile(model,
    fullgraph=True), as `fastformer train --compile` does, and "fastformer_fused_adamw" (a train
    step only: TRAIN_VARIANTS) runs the eager step with `fastformer train`'s optimizer, the fused
    AdamW (fastformer.train.loop.adamw), where every other row steps torch's default. The batch is
    padded to its longest review, which for the stage's batch of 128 is a bucket length already
    (128 tokens, a multiple of 16; bench/test_report.py checks it), so it is the shape
    --cuda-graphs pads it to. They skip without CUDA: a graph needs a GPU, torch.compile cannot
    trace the Triton kernels through the interpreter, and on a CPU `python -m tools.host_overhead`
    times the optimizer's step alone. The first call (capture, or compile) is not timed. A replay
    allocates only its outputs (the graph's memory is allocated at capture), so fastformer_graphs'
    peak_mem_mb does not compare with the eager rows'."""
    if variant not in MODEL_VARIANTS:
        raise ValueError(f"variant must be one of {', '.join(MODEL_VARIANTS)}, got {variant!r}")
    if variant in TRAIN_VARIANTS and kind != "train":
        raise ValueError(f"{variant} is a variant of the train step: an inference step steps no optimizer")
    params = {"scenario": "classify", "B": B, "n_layer": config.n_layer, "d_hidn": config.d_hidn, "amp": amp}
    case = Case(f"model_{kind}", variant, params, setup=None)
    amp_name = "bf16" if amp else "off"

    def setup():
        if torch.device(device).type != "cuda":
            reason = {
                "fastformer_graphs": "CUDA graphs need a GPU",
                "fastformer_compile": "torch.compile over Triton code needs a GPU",
                "fastformer_fused_adamw": "on a CPU, python -m tools.host_overhead times the optimizer's step",
            }[variant]
            raise Skip(f"{variant} is benchmarked on CUDA only ({reason})")
        enc, dec, labels = review_batch(config, B, False, device)
        case.tokens = int(enc.ne(config.i_pad).sum() + dec.ne(config.i_pad).sum())
        case.extra["enc_len"] = enc.shape[1]
        torch.manual_seed(0)
        model = fastformer.MovieClassification(config).to(device)
        initial = {k: v.clone() for k, v in model.state_dict().items()}
        if variant == "fastformer_graphs":
            optimizer = make_capturable(torch.optim.AdamW(model.parameters(), lr=1e-4))
            graphs = GraphedSteps(model, optimizer, amp=amp_name)
        elif variant == "fastformer_compile":
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
            forward = torch.compile(model, fullgraph=True)
        else:  # the eager model, `fastformer train`'s optimizer
            optimizer = adamw(model, 1e-4, 0.01, fused=True)
            forward = model

        def logits():
            with fastformer.use_backend("triton"):
                if variant == "fastformer_graphs":
                    return graphs.logits(enc, dec)
                with torch.no_grad(), autocast(device, amp_name):
                    return forward(enc, dec)[0]

        def step():
            with fastformer.use_backend("triton"):
                if variant == "fastformer_graphs":
                    return graphs.train_step((labels, enc, dec))[0]
                optimizer.zero_grad(set_to_none=True)
                with autocast(device, amp_name):
                    loss = F.cross_entropy(forward(enc, dec)[0].float(), labels)
                loss.backward()
                optimizer.step()
                return loss

        def check():
            """The variant's eval-mode logits on the initial weights against fp32 reference logits,
            with model_case's tolerance; for the train step, a finite loss."""
            trained = {k: v.clone() for k, v in model.state_dict().items()}
            model.load_state_dict(initial)  # in place: the graphs read the parameters where they are
            model.eval()
            got = logits().float()
            with torch.no_grad(), fastformer.use_backend("reference"):
                expected = model(enc, dec)[0].float()
            model.load_state_dict(trained)
            model.train(kind == "train")
            scale = expected.abs().max().item() or 1.0
            assert_close_to("logits", got, expected, (ATOL["bf16"] if amp else ATOL["fp32"]) * 4 * scale)
            if kind == "train":
                assert bool(torch.isfinite(step())), "training loss is not finite"

        model.train(kind == "train")
        return (step if kind == "train" else logits), check

    case.setup = setup
    return case


def model_cases(device, providers=MODEL_PROVIDERS):
    return [
        model_case(kind, scenario, provider, device)
        for kind in ("train", "infer")
        for scenario in ("classify", "seq2seq")
        for provider in providers
    ]


def full_suite(device):
    return attention_cases(device) + ffn_cases(device) + model_cases(device)


def smoke_suite(device="cpu"):
    """Tiny shapes for a CPU: the report's code paths without a GPU (reference-side providers,
    and fastformer through Triton's interpreter when TRITON_INTERPRET=1 is set)."""
    tiny = fastformer.Config.tutorial(
        n_layer=1, d_hidn=32, n_head=2, d_head=16, d_ff=64, n_enc_vocab=50, n_dec_vocab=50, n_enc_seq=12, n_dec_seq=12
    )
    providers = ("fastformer", "reference", "sdpa")
    cases = []
    for mode in ("fwd", "fwd_bwd"):
        for mask in MASKS:
            cases += [
                attention_case(mode, "fp32", 16, mask, 2, 2, L, p, device, "tiny") for L in (8, 13) for p in providers
            ]
        cases += [ffn_case(mode, "feed_forward", 24, 16, 32, p, device, dtype="fp32") for p in ("fastformer", "eager")]
        if mode == "fwd":
            cases.append(ffn_case(mode, "feed_forward", 24, 16, 32, "fastformer_fused", device, dtype="fp32"))
        cases += [add_layer_norm_case(mode, 24, 16, p, device, dtype="fp32") for p in ("fastformer", "eager")]
    cases.append(attention_case("fwd", "fp32", 16, "causal", 2, 2, 16, "flex", device, "tiny"))  # skipped on a CPU
    for kind in ("train", "infer"):
        # no autocast: Triton's interpreter as shipped computes bf16 dots wrongly, so smoke runs stay in fp32
        cases += [
            model_case(kind, "classify", p, device, B=2, config=tiny, amp=False)
            for p in ("reference_fp32", "fastformer")
        ]
    return cases
