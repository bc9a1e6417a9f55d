"""Every benchmark case, defined once: the pytest-benchmark suites, `python -m bench.report` and the
GPU check's bench and model stages run these. A case builds its inputs, times one provider, and
checks the result it times against an fp32 PyTorch computation, so a fast wrong kernel fails its
benchmark. The benches and their providers (the peers a user would pick instead of fastformer):

  attention_fwd, attention_fwd_bwd   kernels.attention on (B, H, L, D) with a mask (MASKS):
      fastformer, fastformer_autotune, fastformer_tma, fastformer_two_pass (forward + backward),
      reference (kernels.attention_reference),
      sdpa (PyTorch's choice of backend, the one that ran named in the record), sdpa_cudnn, sdpa_flash,
      sdpa_efficient (pinned; a case a backend refuses is skipped with its reasons), flex
      (FlexAttention, compiled), compile (torch.compile of the reference)
  attention_model_call               the tutorial encoder's call: self-attention of a fused QKV
      projection with key padding and dropout 0.1: fastformer, fastformer_tma, reference, the SDPA
      providers, flex
  attention_varlen                   self-attention over packed reviews of mixed lengths (the
      benchmarks' batch): fastformer_varlen (kernels.attention_varlen on the real rows), and padded
      to the longest: fastformer (kernels.attention with key padding), the SDPA providers
  ffn_fwd, ffn_fwd_bwd               the feed-forward (or linear + GELU): fastformer, fastformer_tma,
      fastformer_cublas (the first product by cuBLAS, then the activation kernel), eager, compile,
      compile_max_autotune; on ffn_fwd also fastformer_fused (the inference-only FFN)
  add_layer_norm                     bias + residual + LayerNorm: fastformer, eager, compile,
      liger (Liger-Kernel's LayerNorm after an eager add, where it is installed)
  model_train, model_infer           MovieClassification's step, each provider a Way (MODEL_WAYS)

`full_suite(device)` is what runs on CUDA; `smoke_suite()` is a few tiny cases for a CPU, used by
the tests to exercise every code path of the report without a GPU.
"""

import math
import warnings
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import fastformer
from bench.common import Case, Skip, assert_close_to, attention_flops, ffn_flops, profiling
from fastformer import kernels
from fastformer.train.graphs import GraphedSteps, make_capturable
from fastformer.train.loop import adamw, autocast

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# the tolerance of a benchmark's check against fp32, per dtype: loose enough for rounding, far
# below what a wrong mask or a wrong row would give
ATOL = {"bf16": 3e-2, "fp16": 5e-3, "fp32": 1e-4}
REFERENCE_SCORES_LIMIT_GB = 8  # the reference provider materializes (B, H, L, L) scores

# SDPA pinned to one backend (torch.nn.attention.sdpa_kernel): a case it does not run is skipped
# with SDPA's own reasons; plain "sdpa" lets PyTorch choose, and its record names what ran
SDPA_BACKENDS = {
    "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
    "sdpa_flash": SDPBackend.FLASH_ATTENTION,
    "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION,
}
# fastformer_autotune: fastformer with every kernel config timed (kernels.autotuning) in place of each
# kernel's rule picking one, so a GPU run shows what the rule leaves on the table; fastformer_tma:
# fastformer with its tiles loaded through tensor descriptors (kernels.tma_loads(True)) where TMA
# can serve, whatever the kernels' rules say (tools.sweep times the variants pass by pass);
# fastformer_two_pass (forward + backward only): the attention backward in its two passes
# (kernels.attention_backward), where the rule takes one pass from 1,024 tokens. (autotune, tma, way)
OURS = {
    "fastformer": (False, None, None),
    "fastformer_autotune": (True, None, None),
    "fastformer_tma": (False, True, None),
    "fastformer_two_pass": (False, None, "two-pass"),
}
ATTENTION_PROVIDERS = (*OURS, "reference", "sdpa", *SDPA_BACKENDS, "flex", "compile")
MODEL_CALL_PROVIDERS = ("fastformer", "fastformer_tma", "reference", "sdpa", *SDPA_BACKENDS, "flex")
MASKS = ("none", "causal", "padding", "padding_causal")
# the FFN's and add + LayerNorm's compiled peers: torch.compile of the eager code, by mode
COMPILE_MODES = {"compile": None, "compile_max_autotune": "max-autotune-no-cudagraphs"}
# fastformer_cublas: fastformer with the FFN's first product by cuBLAS and the activation kernel
# (kernels.ffn_gemm("cublas")) in place of the Triton GEMM with its fused epilogue, whatever
# linear_gelu's rule says (tools.sweep times the two ways' forwards alone)
FFN_PROVIDERS = ("fastformer", "fastformer_tma", "fastformer_cublas", "eager", *COMPILE_MODES)
ADD_LAYER_NORM_PROVIDERS = ("fastformer", "eager", "compile", "liger")
# the aten op each SDPA backend dispatches to, as torch.profiler records it
SDPA_OPS = {
    "aten::_scaled_dot_product_cudnn_attention": "cudnn",
    "aten::_scaled_dot_product_flash_attention": "flash",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "flash (CPU)",
    "aten::_scaled_dot_product_efficient_attention": "efficient",
    "aten::_scaled_dot_product_fused_attention_overrideable": "overrideable",
    "aten::_scaled_dot_product_attention_math": "math",
}


def _cuda_only(device, provider):
    if torch.device(device).type != "cuda":
        raise Skip(f"{provider} is benchmarked on CUDA only (torch.compile over Triton code needs a GPU)")


def _compiled(fn, mode=None):
    """torch.compile(fn, mode=mode) for one case, called in the case's setup. Dynamo's caches are
    reset first: it keeps at most `recompile_limit` (8) graphs per function and past that silently
    runs the function eagerly, so a suite of more shapes would time eager code under the "compile"
    and "flex" names. Each case compiles its own shape (compile time is not timed)."""
    torch._dynamo.reset()
    return torch.compile(fn, dynamic=False, mode=mode)


def sdpa(provider, attn_mask=None, is_causal=False, dropout_p=0.0):
    """fn(q, k, v) -> F.scaled_dot_product_attention(q, k, v, ...): for an sdpa_* provider pinned to
    its backend (SDPA_BACKENDS), for "sdpa" on the backend PyTorch picks."""
    pinned = SDPA_BACKENDS.get(provider)

    def fn(q, k, v):
        with sdpa_kernel(pinned) if pinned is not None else nullcontext():
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal
            )

    return fn


def sdpa_backend_ran(run):
    """The SDPA backend one call of run() dispatched to, from the aten op torch.profiler recorded
    (SDPA_OPS), or None when it called no SDPA op."""
    from torch.profiler import ProfilerActivity

    with profiling([ProfilerActivity.CPU]) as profiler:
        run()
    names = {event.name for event in profiler.events()}
    return next((backend for op, backend in SDPA_OPS.items() if op in names), None)


def _name_sdpa_backend(case, run):
    """For an SDPA provider, call run() once: a pinned backend that refuses the case raises Skip
    with SDPA's reasons (its warnings say why each backend declined); the backend that ran goes
    into the case's record (params' sdpa_backend)."""
    if case.provider != "sdpa" and case.provider not in SDPA_BACKENDS:
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            case.extra["sdpa_backend"] = sdpa_backend_ran(run)
        except RuntimeError as error:
            if case.provider == "sdpa":
                raise
            raise Skip(
                f"{case.provider}: SDPA's {SDPA_BACKENDS[case.provider].name} does not run this case: "
                + _sdpa_reasons([str(w.message) for w in caught] + [str(error)])
            ) from None


def _sdpa_reasons(messages):
    """SDPA's warnings and error in one line: each distinct reason once, without the C++ source
    locations ("(Triggered internally at ...)")."""
    lines = []
    for message in messages:
        for line in message.splitlines():
            line = line.split("(Triggered internally at")[0].strip()
            if line and line not in lines:
                lines.append(line)
    return "; ".join(lines)


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
    if provider in OURS:
        tuned, tma, _ = OURS[provider]  # the backward's way is read by the backward: attention_case sets it

        def fn(q, k, v):
            with kernels.autotuning(tuned), kernels.tma_loads(tma):
                return kernels.attention(q, k, v, key_padding_mask=key_padding, causal=causal)

        return fn
    if provider == "reference":
        return lambda q, k, v: kernels.attention_reference(q, k, v, key_padding_mask=key_padding, causal=causal)
    if provider == "compile":
        _cuda_only(device, provider)
        ref = _compiled(kernels.attention_reference)
        return lambda q, k, v: ref(q, k, v, key_padding_mask=key_padding, causal=causal)
    if provider == "sdpa" or provider in SDPA_BACKENDS:
        if key_padding is None:
            return sdpa(provider, is_causal=causal)
        # the smallest boolean mask SDPA takes (True = attend): it refuses a mask with is_causal
        keep = ~key_padding[:, None, None, :]  # (B, 1, 1, L)
        if causal:
            keep = keep & torch.ones(L, L, dtype=torch.bool, device=device).tril()  # (B, 1, L, L)
        return sdpa(provider, attn_mask=keep)
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
        rows = torch.unique(torch.tensor([0, 1, L // 3, L // 2, L - 2, L - 1], device=device).clamp(0, L - 1))
        if mode == "fwd":

            def run():
                with torch.no_grad():
                    return fn(q, k, v)

            def check():
                _attention_rows_check(q, k, v, key_padding, causal, rows, run(), atol=ATOL[dtype])
        else:
            do = torch.randn_like(q)
            way = OURS[provider][2] if provider in OURS else None  # None: the choice as it stands

            def run():
                with kernels.attention_backward(way):
                    out = fn(q, k, v)
                    return (out, *torch.autograd.grad(out, (q, k, v), do))

            def check():
                out, dq, _, _ = run()
                _attention_rows_check(q, k, v, key_padding, causal, rows, out, dq, do, atol=ATOL[dtype])

        _name_sdpa_backend(case, run)
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
                            if provider == "fastformer_two_pass" and mode == "fwd":
                                continue  # the forward is fastformer's
                            shape = "tutorial" if shapes[0] == (B, H, L) else "long"
                            cases.append(attention_case(mode, dtype, D, mask, B, H, L, provider, device, shape))
    return cases


def _self_attention_provider(provider, key_padding, n_head):
    """fn(qkv, dropout_p) -> context for the model's call: attention of the heads of one fused QKV
    projection (B, L, 3 * H * D), the context (B, L, H * D) as the output projection reads it.
    fastformer and the reference take qkv as the model hands it; SDPA takes q, k and v as strided
    views of it and its output is transposed back, as a model written with SDPA does."""
    if provider in ("fastformer", "fastformer_tma"):
        tma = OURS[provider][1]

        def ours(qkv, p):
            with kernels.tma_loads(tma):
                return kernels.self_attention(qkv, n_head, key_padding_mask=key_padding, dropout_p=p)

        return ours
    if provider == "reference":
        return lambda qkv, p: kernels.self_attention_reference(qkv, n_head, key_padding_mask=key_padding, dropout_p=p)
    if provider == "sdpa" or provider in SDPA_BACKENDS:
        keep = ~key_padding[:, None, None, :]  # (B, 1, 1, L), True = attend

        def fn(qkv, p):
            B, L, _ = qkv.shape
            q, k, v = qkv.unflatten(-1, (3, n_head, -1)).permute(2, 0, 3, 1, 4).unbind(0)  # (B, H, L, D) each
            return sdpa(provider, attn_mask=keep, dropout_p=p)(q, k, v).transpose(1, 2).reshape(B, L, -1)

        return fn
    if provider == "flex":
        raise Skip("flex: FlexAttention has no dropout of the attention probabilities, which the model's call has")
    raise ValueError(f"unknown provider of the model's attention call {provider!r}")


def attention_model_call_case(mode, L, provider, device, B=128, H=4, D=64, dropout_p=0.1, dtype="bf16"):
    """The attention call the tutorial's encoder makes in training: self-attention of a fused QKV
    projection, key padding (each review padded to the batch's longest), dropout 0.1 on the
    probabilities. Checked without dropout (the same call at p=0, rows of batch 0 against fp32), and
    with it: finite, and not the output without dropout."""
    params = {"mode": mode, "dtype": dtype, "D": D, "mask": "padding", "dropout": dropout_p, "B": B, "H": H, "L": L}
    flops = attention_flops(B, H, L, L, D, False, mode)
    case = Case("attention_model_call", provider, params, setup=None, flops=flops, tokens=B * L)

    def setup():
        g = torch.Generator(device="cpu").manual_seed(0)
        qkv = torch.randn(B, L, 3 * H * D, generator=g).to(device, DTYPES[dtype]).requires_grad_(mode == "fwd_bwd")
        lengths = torch.randint(max(1, L // 8), L + 1, (B,), generator=g)  # reviews shorter than the longest
        lengths[0] = L
        key_padding = (torch.arange(L) >= lengths[:, None]).to(device)  # (B, L), True = padding
        fn = _self_attention_provider(provider, key_padding, H)
        dout = torch.randn(B, L, H * D, generator=g).to(device, DTYPES[dtype])

        def run():
            if mode == "fwd":
                with torch.no_grad():
                    return (fn(qkv, dropout_p),)
            out = fn(qkv, dropout_p)
            return (out, *torch.autograd.grad(out, qkv, dout))

        def check():
            q, k, v = qkv.unflatten(-1, (3, H, D)).permute(2, 0, 3, 1, 4).unbind(0)
            with torch.no_grad():
                plain = fn(qkv, 0.0)
            heads = plain.unflatten(-1, (H, D)).transpose(1, 2)  # (B, H, L, D)
            rows = torch.unique(torch.tensor([0, 1, L // 2, L - 1], device=device).clamp(0, L - 1))
            _attention_rows_check(q, k, v, key_padding, False, rows, heads, atol=ATOL[dtype])
            dropped = run()
            assert all(bool(torch.isfinite(t).all()) for t in dropped), "not finite with dropout"
            assert not torch.equal(dropped[0], plain), "dropout 0.1 left the output unchanged"

        _name_sdpa_backend(case, run)
        return run, check

    case.setup = setup
    return case


def attention_model_call_cases(device, providers=MODEL_CALL_PROVIDERS):
    """The model's call at the tutorial's batch, B 128 H 4 D 64, at lengths 64, 128 and 256."""
    return [
        attention_model_call_case(mode, L, provider, device)
        for mode in ("fwd", "fwd_bwd")
        for L in (64, 128, 256)
        for provider in providers
    ]


VARLEN_PROVIDERS = ("fastformer_varlen", "fastformer", "sdpa", *SDPA_BACKENDS)


def _varlen_provider(provider, lengths, L, device):
    """fn(q, k, v) -> out on the packed sequences' rows (total, H, D): fastformer_varlen takes them as
    they are (kernels.attention_varlen); the padded providers get them scattered into a (B, H, L, D)
    batch with its key padding, as a caller without a varlen op would, and give back the real rows;
    the scatter and gather are timed with them, being part of what that caller runs."""
    B = len(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    if provider == "fastformer_varlen":
        return lambda q, k, v: kernels.attention_varlen(q, k, v, cu, cu, L, L)
    real = (torch.arange(L)[None, :] < torch.tensor(lengths)[:, None]).to(device)  # (B, L), True = a token
    if provider == "fastformer":
        op = lambda q, k, v: kernels.attention(q, k, v, key_padding_mask=~real)  # noqa: E731
    elif provider == "sdpa" or provider in SDPA_BACKENDS:
        op = sdpa(provider, attn_mask=real[:, None, None, :])
    else:
        raise ValueError(f"unknown provider of attention over packed sequences {provider!r}")

    def fn(q, k, v):
        batch = [q.new_zeros(B, L, *q.shape[1:]).index_put((real,), t) for t in (q, k, v)]
        return op(*(t.transpose(1, 2) for t in batch)).transpose(1, 2)[real]

    return fn


def attention_varlen_case(mode, provider, device, B=128, H=4, D=64, L=128, dtype="bf16", min_len=8):
    """Self-attention over B reviews of min_len to L tokens (one of L), the benchmarks' batch: packed
    (kernels.attention_varlen) against padded to the longest (kernels.attention with key padding,
    SDPA with the mask). FLOPs of the real tokens' attention (each review over its own keys), so
    every provider's TFLOP/s counts the same work."""
    g = torch.Generator(device="cpu").manual_seed(0)
    lengths = torch.randint(min_len, L + 1, (B,), generator=g)
    lengths[0] = L
    lengths = lengths.tolist()
    params = {"dtype": dtype, "D": D, "B": B, "H": H, "L": L, "min_len": min_len}
    flops = sum(attention_flops(1, H, n, n, D, False, mode) for n in lengths)
    case = Case("attention_varlen", provider, params, setup=None, flops=flops, tokens=sum(lengths))

    def setup():
        q, k, v = (
            torch.randn(sum(lengths), H, D, generator=g).to(device, DTYPES[dtype]).requires_grad_(mode == "fwd_bwd")
            for _ in range(3)
        )
        fn = _varlen_provider(provider, lengths, L, device)
        do = torch.randn_like(q)

        def run():
            if mode == "fwd":
                with torch.no_grad():
                    return (fn(q, k, v),)
            out = fn(q, k, v)
            return (out, *torch.autograd.grad(out, (q, k, v), do))

        def check():
            n = lengths[0]  # the first review, over its own keys, in fp32
            q0, k0, v0 = (t[:n].detach().float().transpose(0, 1) for t in (q, k, v))  # (H, n, D)
            expected = (q0 @ k0.transpose(-1, -2) / math.sqrt(D)).softmax(-1) @ v0
            assert_close_to("out", run()[0][:n].transpose(0, 1), expected, ATOL[dtype])

        _name_sdpa_backend(case, run)
        return run, check

    case.setup = setup
    return case


def attention_varlen_cases(device, providers=VARLEN_PROVIDERS):
    """The benchmarks' batch, B 128 reviews of 8 to 128 tokens, H 4, D 64, bf16, both modes."""
    return [attention_varlen_case(mode, p, device) for mode in ("fwd", "fwd_bwd") for p in providers]


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
        if provider == "fastformer_tma":  # its GEMM's tiles through tensor descriptors (kernels.tma_loads)
            op_fn = getattr(kernels, op)

            def fn(*args):
                with kernels.tma_loads(True):
                    return op_fn(*args)

        if provider == "fastformer_cublas":  # the first product by cuBLAS, then the activation kernel
            op_fn = getattr(kernels, op)

            def fn(*args):
                with kernels.ffn_gemm("cublas"):
                    return op_fn(*args)

        if provider == "fastformer_fused":  # the inference-only fully fused FFN, timed against the two-kernel one
            if mode != "fwd" or op != "feed_forward":
                raise ValueError("fastformer_fused is the no-grad feed_forward only")
            fn = kernels.feed_forward_fused
        if provider in COMPILE_MODES:
            _cuda_only(device, provider)
            fn = _compiled(eager, COMPILE_MODES[provider])
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


def _liger_add_layer_norm(device):
    """The residual add in eager PyTorch, then Liger-Kernel's LayerNorm (its Triton kernels, forward
    and backward): what a user of Liger would write for the tutorial's sublayer end."""
    if torch.device(device).type != "cuda":
        raise Skip("liger: Liger-Kernel's LayerNorm runs on CUDA only")
    try:
        from liger_kernel.ops.layer_norm import LigerLayerNormFunction
    except ImportError as error:
        raise Skip(
            f"liger: Liger-Kernel is not installed here ({error}); tools/gpu_carry.sh fetches its wheel into "
            "gpu-carry/wheels, which tools/gpu_run.sh installs"
        ) from None
    return lambda x, r, w, b: LigerLayerNormFunction.apply(r + x, w, b, 1e-12)


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
        elif provider == "liger":
            fn = _liger_add_layer_norm(device)
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


def ffn_cases(device, providers=FFN_PROVIDERS, norm_providers=ADD_LAYER_NORM_PROVIDERS):
    """The tutorial's layer at batch 128 (M 32768, d 256, d_ff 1024) and a wide one (M 8192, d 1024,
    d_ff 4096); add + LayerNorm at the tutorial's rows (M 32768, d 256) and wide ones (8192, 1024)."""
    cases = []
    for mode in ("fwd", "fwd_bwd"):
        for M, d, d_ff in ((32768, 256, 1024), (8192, 1024, 4096)):
            for op in ("feed_forward", "linear_gelu"):
                cases += [ffn_case(mode, op, M, d, d_ff, p, device) for p in providers]
            if mode == "fwd" and "fastformer" in providers:
                cases.append(ffn_case(mode, "feed_forward", M, d, d_ff, "fastformer_fused", device))
        for M, d in ((32768, 256), (8192, 1024)):
            cases += [add_layer_norm_case(mode, M, d, p, device) for p in norm_providers]
    return cases


# ----------------------------------------------------------------------------------------------
# the model
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Way:
    """How one provider runs MovieClassification's step."""

    backend: str  # "triton", "reference", or "sdpa": bench.sdpa_model, the model written with SDPA
    amp: bool  # bf16 autocast (else fp32), unless the case is given another
    run: str  # "eager", "graphs" (fastformer.train.graphs), or torch.compile: COMPILED_RUNS
    optimizer: str = "adamw"  # torch.optim.AdamW's default (foreach), or "fused": `fastformer train`'s
    autotune: bool = False  # every kernel config timed (kernels.autotuning) in place of the rules' picks
    tf32: bool = False  # fp32 matmuls in TF32 (torch.set_float32_matmul_precision("high")), the kernels' too


def matmul_precision(tf32):
    """torch.set_float32_matmul_precision("high") inside the block where `tf32`, restored by the
    same API after it; nothing otherwise."""
    if not tf32:
        return nullcontext()
    return _high_precision()


@contextmanager
def _high_precision():
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


# torch.compile(model, **options) per Way.run
COMPILED_RUNS = {
    "compile": {},  # the default mode
    "compile_fullgraph": {"fullgraph": True},  # `fastformer train --compile`
    "reduce_overhead": {"mode": "reduce-overhead"},  # Inductor's CUDA graphs (cudagraph trees)
}
MODEL_WAYS = {
    "fastformer": Way("triton", True, "eager"),
    "fastformer_autotune": Way("triton", True, "eager", autotune=True),
    "fastformer_fused_adamw": Way("triton", True, "eager", optimizer="fused"),
    # the job's replayed step: its fused AdamW made capturable, 11 launches a step (tools.work)
    "fastformer_graphs": Way("triton", True, "graphs", optimizer="fused"),
    # replayed with torch's default AdamW (foreach) made capturable, 68 launches: the job's step
    # before 2026-12-03, and a drop-in user's who makes their own AdamW capturable
    "fastformer_graphs_foreach": Way("triton", True, "graphs"),
    "fastformer_compile": Way("triton", True, "compile_fullgraph"),
    "fastformer_reduce_overhead": Way("triton", True, "reduce_overhead"),
    "reference_fp32": Way("reference", False, "eager"),  # the tutorial as it runs
    # the tutorial's fp32 model where PyTorch's matmuls take TF32: the kernels under "auto", and the
    # tutorial under the same setting (cuBLAS in TF32), its peer
    "fastformer_tf32": Way("triton", False, "eager", tf32=True),
    "reference_tf32": Way("reference", False, "eager", tf32=True),
    "reference": Way("reference", True, "eager"),
    "reference_sdpa": Way("sdpa", True, "eager"),
    "reference_compiled": Way("reference", True, "compile"),
    "reference_reduce_overhead": Way("reference", True, "reduce_overhead"),
    "reference_graphs": Way("reference", True, "graphs"),
}
MODEL_PROVIDERS = tuple(MODEL_WAYS)
TRAIN_ONLY = ("fastformer_fused_adamw", "fastformer_graphs_foreach")  # ways of stepping the optimizer: no inference


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


def _cuda_reason(way):
    """Why a Way is benchmarked on CUDA only, or None."""
    if way.run == "graphs":
        return "CUDA graphs need a GPU"
    if way.run in COMPILED_RUNS:
        return "torch.compile over Triton code needs a GPU, and the reference's is timed beside it"
    if way.optimizer == "fused":
        return "on a CPU, python -m tools.host_overhead times the optimizer's step"
    if way.autotune:
        return "under Triton's interpreter autotuning picks one config: it would time fastformer's case again"
    if way.tf32:
        return "a CPU has no TF32: it would time the fp32 case again"
    return None


def _optimizer(way, model):
    if way.run == "graphs":
        return make_capturable(torch.optim.AdamW(model.parameters(), lr=1e-4, fused=way.optimizer == "fused" or None))
    if way.optimizer == "fused":
        return adamw(model, 1e-4, 0.01, fused=True)
    return torch.optim.AdamW(model.parameters(), lr=1e-4)


def _network(way, config, weights, device):
    """The module a Way runs: fastformer's MovieClassification (on the Triton or the reference
    backend), or the model written with SDPA, holding `weights`."""
    if way.backend == "sdpa":
        from bench.sdpa_model import SdpaMovieClassification

        net = SdpaMovieClassification(config).to(device)
    else:
        net = fastformer.MovieClassification(config).to(device)
    net.load_state_dict(weights)
    return net


def model_case(kind, provider, device, B=128, config=None, amp=None, scenario="classify"):
    """MovieClassification's train step (forward, loss, backward, AdamW) or inference, by wall time
    per step, run the way MODEL_WAYS[provider] says; `amp` overrides the Way's autocast (a CPU run
    passes False: Triton's interpreter as shipped computes bf16 dots wrongly). The batch: review_batch.
    Every provider starts from the same weights and is checked the same way: its eval-mode logits on
    those weights against fp32 reference logits, and for a train step, a finite loss. The first calls
    (capture, compile) are not timed. A graph's memory is allocated when it is captured, so a
    replayed step's peak_mem_mb (allocated during the timed call) leaves its pool out; the record's
    resident_mb (allocated and held once the case has run) counts it."""
    if provider not in MODEL_WAYS:
        raise ValueError(f"provider must be one of {', '.join(MODEL_WAYS)}, got {provider!r}")
    if provider in TRAIN_ONLY and kind != "train":
        raise ValueError(f"{provider} is a way of stepping the optimizer: there is no inference case")
    way = MODEL_WAYS[provider]
    config = config or fastformer.Config.tutorial()
    amp = way.amp if amp is None else amp
    params = {"scenario": scenario, "B": B, "n_layer": config.n_layer, "d_hidn": config.d_hidn, "amp": amp}
    if way.tf32:
        params["tf32"] = True  # how the provider ran (bench.targets.PROVIDER_PARAMS), as amp
    case = Case(f"model_{kind}", provider, params, setup=None, timing="wall")
    amp_name = "bf16" if amp else "off"
    backend_name = "triton" if way.backend == "triton" else "reference"

    def setup():
        reason = _cuda_reason(way)
        if reason and torch.device(device).type != "cuda":
            raise Skip(f"{provider} is benchmarked on CUDA only ({reason})")
        enc, dec, labels = review_batch(config, B, scenario == "seq2seq", device)
        case.tokens = int(enc.ne(config.i_pad).sum() + dec.ne(config.i_pad).sum())
        case.extra["enc_len"] = enc.shape[1]
        torch.manual_seed(0)
        oracle = fastformer.MovieClassification(config).to(device)
        initial = {k: v.clone() for k, v in oracle.state_dict().items()}
        net = _network(way, config, initial, device)
        optimizer = _optimizer(way, net)
        graphs = GraphedSteps(net, optimizer, amp=amp_name) if way.run == "graphs" else None
        forward = net
        if way.run in COMPILED_RUNS:
            torch._dynamo.reset()
            forward = torch.compile(net, **COMPILED_RUNS[way.run])

        def ways():
            return fastformer.use_backend(backend_name), kernels.autotuning(way.autotune), matmul_precision(way.tf32)

        def logits():
            backend, tuning, precision = ways()
            with backend, tuning, precision:
                if graphs is not None:
                    return graphs.logits(enc, dec)
                with torch.no_grad(), autocast(device, amp_name):
                    return forward(enc, dec)[0]

        def step():
            backend, tuning, precision = ways()
            with backend, tuning, precision:
                if graphs is not None:
                    return graphs.train_step((labels, enc, dec))[0]
                if way.run == "reduce_overhead":
                    torch.compiler.cudagraph_mark_step_begin()
                optimizer.zero_grad(set_to_none=True)
                with autocast(device, amp_name):
                    loss = F.cross_entropy(forward(enc, dec)[0].float(), labels)
                loss.backward()
                optimizer.step()
                return loss

        def check():
            """The provider's eval-mode logits on the initial weights against fp32 reference logits."""
            trained = {k: v.clone() for k, v in net.state_dict().items()}
            net.load_state_dict(initial)  # in place: a graph reads the parameters where they are
            net.eval()
            got = logits().float()
            oracle.eval()
            with torch.no_grad(), fastformer.use_backend("reference"):
                expected = oracle(enc, dec)[0].float()
            net.load_state_dict(trained)
            net.train(kind == "train")
            scale = expected.abs().max().item() or 1.0
            # TF32 keeps fp16's 10 mantissa bits (and fp32's exponent): fp16's tolerance
            atol = ATOL["bf16"] if amp else ATOL["fp16"] if way.tf32 else ATOL["fp32"]
            assert_close_to("logits", got, expected, atol * 4 * scale)
            if kind == "train":
                assert bool(torch.isfinite(step())), "training loss is not finite"

        net.train(kind == "train")
        return (step if kind == "train" else logits), check

    case.setup = setup
    return case


def model_cases(device, providers=MODEL_PROVIDERS):
    return [
        model_case(kind, provider, device, scenario=scenario)
        for kind in ("train", "infer")
        for scenario in ("classify", "seq2seq")
        for provider in providers
        if kind == "train" or provider not in TRAIN_ONLY
    ]


def full_suite(device):
    attention = attention_cases(device) + attention_model_call_cases(device) + attention_varlen_cases(device)
    return attention + ffn_cases(device) + model_cases(device)


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
    tiny_varlen = dict(B=3, H=2, D=16, L=13, dtype="fp32", min_len=1)
    varlen = ("fastformer_varlen", "fastformer", "sdpa")
    cases += [attention_varlen_case(m, p, device, **tiny_varlen) for m in ("fwd", "fwd_bwd") for p in varlen]
    for kind in ("train", "infer"):
        # no autocast: Triton's interpreter as shipped computes bf16 dots wrongly, so smoke runs stay in fp32
        cases += [model_case(kind, p, device, B=2, config=tiny, amp=False) for p in ("reference_fp32", "fastformer")]
    return cases
