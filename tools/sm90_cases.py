"""What the sm_90a compile check compiles: every `@triton.jit` kernel under `kernels/`, through its
real launcher, with tensors laid out as the model lays them out.

`ci_cases()` is the matrix `tests/test_sm90_compile.py` runs on every CI run (`ci_cases_here()`:
with every config on the GPU machines' Triton, CI's oldest lane; the rules' picks on the newest
lane's); `full_cases()` adds
the rest of the product (every head dim in both dtypes with every mask, odd lengths) for
`python -m tools.sm90_report --full`; `tf32_cases()` is fp32 with TF32 products (`--tf32`), for
the rules that would send an fp32 model's products to the kernels. Tensors are CPU tensors: nothing
is launched (see tools.sm90).
"""

import contextlib
import dataclasses
import itertools
import sys

import torch

from tools.sm90 import Case

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
# The kernels built on tl.dot compile for fp16 and bf16: the model's "auto" backend runs fp32
# attention and FFN on the PyTorch reference (fastformer/backend.py), and only LayerNorm's kernel
# takes fp32 there.
DOT_DTYPES = ("fp16", "bf16")
# name -> (key padding, causal, dense mask); the model uses the first two (encoder and decoder
# self-attention; cross-attention is "pad" with a K/V projection), the public op all five
MASKS = {
    "pad": (True, False, False),
    "pad+causal": (True, True, False),
    "causal": (False, True, False),
    "none": (False, False, False),
    "dense": (False, False, True),
}
HEAD_DIMS = (16, 32, 64, 72, 80, 128)  # 72 and 80 are padded to a block of 128 inside the kernels
TUTORIAL = {"B": 8, "H": 4, "L": 256, "D": 64, "d_hidn": 256, "d_ff": 1024}
TUTORIAL_FFN = (TUTORIAL["d_hidn"], TUTORIAL["d_ff"], 8 * 256)  # d, d_ff and the rows M of ffn_case
LARGE = {"d_hidn": 1024, "d_ff": 4096, "M": 8192}


def _name(dtype):
    return str(DTYPES[dtype]).replace("torch.", "")


def _module(name):
    __import__(name)
    return sys.modules[name]


def _qkv(B, H, Lq, Lk, D, dtype, layout):
    """q, k, v as (B, H, L, D) views: of one fused (B, L, 3, H, D) projection ("self"), of a Q and a
    fused K/V projection ("cross"), or contiguous tensors ("contiguous")."""
    if layout == "self":
        q, k, v = torch.zeros(B, Lq, 3, H, D, dtype=dtype).unbind(2)
    elif layout == "cross":
        q = torch.zeros(B, Lq, H, D, dtype=dtype)
        k, v = torch.zeros(B, Lk, 2, H, D, dtype=dtype).unbind(2)
    else:
        return [torch.zeros(B, H, L, D, dtype=dtype) for L in (Lq, Lk, Lk)]
    return [t.transpose(1, 2) for t in (q, k, v)]


@contextlib.contextmanager
def tf32_precision(dtype):
    """For an fp32 case, PyTorch's fp32 CUDA matmuls in TF32 inside the block (the newer API,
    restored by it), so the kernels' fp32 products compile as TF32 (kernels._runtime.dot_precision):
    the products an fp32 model would give them where PyTorch's matmuls take TF32. Other dtypes:
    nothing changes."""
    if dtype != "fp32":
        yield
        return
    before = torch.backends.cuda.matmul.fp32_precision
    torch.backends.cuda.matmul.fp32_precision = "tf32"
    try:
        yield
    finally:
        torch.backends.cuda.matmul.fp32_precision = before


def attention_case(
    dtype,
    D,
    mask,
    dropout,
    layout="self",
    L=256,
    Lk=None,
    B=2,
    H=4,
    probs=False,
    tma=False,
    autotune=True,
    one_pass=False,
):
    """The attention passes on one call; `tma`: their tile loads through tensor descriptors
    (kernels/_tma.py, set_tma(True)), where the default is the kernels' rule; `one_pass`: the
    backward in one pass (kernels/_backward_choice.py), where the default is attention's rule
    (two passes at these lengths but L4096's); `autotune` as Case's.
    In fp32 the products are TF32 (tf32_precision), as PyTorch's matmuls under
    set_float32_matmul_precision("high")."""
    attention = _module("fastformer.kernels.attention")
    pad, causal, dense = MASKS[mask]
    Lk = L if Lk is None else Lk
    p = 0.1 if dropout else 0.0
    name = f"attention/{dtype}/d{D}/{mask}{'+dropout' if dropout else ''}/{layout}/L{L}" + (f"x{Lk}" if Lk != L else "")
    name += "/tma" if tma else ""
    name += "/one-pass" if one_pass else ""

    def run():
        kernels = _module("fastformer.kernels")
        kernels.set_tma(True if tma else None)
        try:
            with tf32_precision(dtype), kernels.attention_backward("one-pass" if one_pass else None):
                _attention_passes(attention, dtype, D, pad, causal, dense, p, layout, L, Lk, B, H, probs, not one_pass)
        finally:
            kernels.set_tma(None)

    return Case(name + ("+probs" if probs else ""), run, _name(dtype), autotune=autotune)


def _attention_passes(attention, dtype, D, pad, causal, dense, p, layout, L, Lk, B, H, probs, forward=True):
    """attention_case's launches: the forward (unless not `forward`: the one pass's cases, whose
    forward the other cases compile; nothing runs, so empty outputs stand for it), the backward's
    (two passes, or the one pass's three launches) and (probs) the probabilities."""
    q, k, v = _qkv(B, H, L, Lk, D, DTYPES[dtype], layout)
    key_padding_mask = torch.zeros(B, Lk, dtype=torch.bool) if pad else None
    attn_mask = torch.zeros(B, L, Lk, dtype=torch.bool) if dense else None
    masking = attention._masking(q, key_padding_mask, attn_mask, causal, p, D**-0.5)
    seed = torch.zeros(1, dtype=torch.int64) if p else None
    o, lse = attention._attn_forward(q, k, v, masking, seed) if forward else attention._forward_outputs(q)
    do = torch.zeros_like(o)
    attention._attn_backward(do, q, k, v, o, lse, seed, masking)
    if probs:
        attention._attn_probs(q, k, lse, seed, masking)


VARLEN_LENGTHS = (5, 1, 64, 37, 256, 130, 17, 200)  # the packed sequences of varlen_case: odd, 1, block multiples


def varlen_case(dtype, D, causal, dropout, cross=False, autotune=False, one_pass=False):
    """attention_varlen's passes (the kernels' VARLEN path) on packed sequences of mixed lengths
    (VARLEN_LENGTHS; `cross`: as many keys, in another order, and a K/V projection's rows), as
    self-attention views of one fused projection's rows; `one_pass` as attention_case's."""
    lengths_q = VARLEN_LENGTHS
    lengths_k = VARLEN_LENGTHS[::-1] if cross else VARLEN_LENGTHS
    name = f"attention-varlen/{dtype}/d{D}/{'causal' if causal else 'none'}{'+dropout' if dropout else ''}"
    name += ("/cross" if cross else "/self") + ("/one-pass" if one_pass else "")

    def run():
        kernels = _module("fastformer.kernels")
        varlen = _module("fastformer.kernels.attention_varlen")
        H, dt = 4, DTYPES[dtype]
        cu_q, cu_k = (torch.tensor([0, *itertools.accumulate(n)], dtype=torch.int32) for n in (lengths_q, lengths_k))
        if cross:
            q = torch.zeros(sum(lengths_q), H, D, dtype=dt)
            k, v = torch.zeros(sum(lengths_k), 2, H, D, dtype=dt).unbind(1)
        else:
            q, k, v = torch.zeros(sum(lengths_q), 3, H, D, dtype=dt).unbind(1)
        args = (cu_q, cu_k, max(lengths_q), max(lengths_k), causal, 0.1 if dropout else 0.0, D**-0.5)
        seed = torch.zeros(1, dtype=torch.int64) if dropout else None
        with tf32_precision(dtype), kernels.attention_backward("one-pass" if one_pass else None):
            o, lse = varlen._varlen_forward(q, k, v, *args, seed)
            varlen._varlen_backward(torch.zeros_like(o), q, k, v, o, lse, seed, *args)

    return Case(name, run, _name(dtype), autotune=autotune)


def ffn_case(dtype, activation, train, d, d_ff, M, tma=False, autotune=True, cublas=False):
    """The model's FFN: Conv1d weights (out, in, 1) read as (out, in) views; training stores the
    pre-activation and runs the FFN's backward through it (the dH GEMM with the activation gradient
    in its epilogue) and linear_gelu's (the activation-gradient kernel), each with the activation
    written again (for the second product's weight gradient) and without; inference also runs the
    fused FFN. The first product by the Triton GEMM, or (`cublas`)
    by cuBLAS and the activation kernel (kernels/_gemm_choice.py), that forward alone (the
    backward and the fused FFN are the other cases'), under kernels.compile_only: cuBLAS has no
    kernel to compile, and no record needs its product, which would run on these CPU tensors.
    `tma`: the GEMM's tiles through tensor descriptors (kernels/_tma.py); `autotune` as Case's."""
    linear_gelu = _module("fastformer.kernels.linear_gelu")
    feed_forward = _module("fastformer.kernels.feed_forward")
    name = f"ffn/{dtype}/{activation}/{'train' if train else 'inference'}/d{d}x{d_ff}/M{M}" + ("/tma" if tma else "")
    name += "/cublas" if cublas else ""

    def run():
        kernels = _module("fastformer.kernels")
        kernels.set_tma(True if tma else None)
        kernels.set_ffn_gemm("cublas" if cublas else "triton")
        try:
            with kernels.compile_only() if cublas else contextlib.nullcontext(), tf32_precision(dtype):
                _ffn_launches(linear_gelu, feed_forward, dtype, activation, train, d, d_ff, M, cublas)
        finally:
            kernels.set_tma(None)
            kernels.set_ffn_gemm(None)

    return Case(name, run, _name(dtype), autotune=autotune)


def _ffn_launches(linear_gelu, feed_forward, dtype, activation, train, d, d_ff, M, cublas):
    """ffn_case's launches."""
    t = DTYPES[dtype]
    x = torch.zeros(M, d, dtype=t)
    w1 = torch.zeros(d_ff, d, 1, dtype=t).squeeze(-1)
    w2 = torch.zeros(d, d_ff, 1, dtype=t).squeeze(-1)
    b1, b2 = torch.zeros(d_ff, dtype=t), torch.zeros(d, dtype=t)
    _, pre = linear_gelu._linear_gelu_forward(x, w1, b1, activation, train)
    if cublas:
        return
    if train:
        # the FFN's backward (the dH GEMM with the activation gradient in its epilogue) with h written
        # again, as the model's, and without (a frozen W2) in the rule's config only: one store less
        # in the epilogue; and linear_gelu's (the activation-gradient kernel, one config) both ways
        kernels = _module("fastformer.kernels")
        dout = torch.zeros(M, d, dtype=t)
        linear_gelu._ffn_activation_backward_op(dout, w2, pre, activation, True, True)
        with kernels.autotuning(False):
            linear_gelu._ffn_activation_backward_op(dout, w2, pre, activation, True, False)
        for write_h in (True, False):
            linear_gelu._activation_backward_op(torch.zeros_like(pre), pre, activation, True, write_h)
    else:
        feed_forward._ffn_fused_forward(x, w1, b1, w2, b2, activation)


def layer_norm_case(dtype, d, dropout, rows=1024, fused=False, train=True):
    """add + LayerNorm in one dtype, or (fused) as the model calls it under autocast: x in dtype, the
    residual stream, the parameters and x_bias in fp32, dropout, y in fp32 and its copy in dtype.
    Training writes the sum the backward reads (save_sum) and runs the backward, adding both
    gradients and reducing d(x_bias) with dW and db; inference (train=False) runs the forward
    alone, without the sum, as a call with no gradient to take does (fused: as the model evaluates,
    without dropout)."""
    add_layer_norm = _module("fastformer.kernels.add_layer_norm")
    p = 0.1 if dropout or (fused and train) else 0.0
    name = f"add_layer_norm/{dtype}/d{d}"
    name += ("/x_bias+lowp" + ("+dropout" if p else "")) if fused else ("/dropout" if p else "")
    name += "" if train else "/inference"

    def run():
        t = DTYPES[dtype]
        stream = torch.float32 if fused else t
        x, residual = torch.zeros(rows, d, dtype=t), torch.zeros(rows, d, dtype=stream)
        weight, bias = torch.ones(d, dtype=stream), torch.zeros(d, dtype=stream)
        x_bias = torch.zeros(d, dtype=stream) if fused else None
        seed = torch.zeros(1, dtype=torch.int64) if p else None
        lowp = t if fused else None
        y, y_low, mean, rstd, s = add_layer_norm._add_ln_forward(
            x, residual, weight, bias, x_bias, seed, 1e-12, p, stream, lowp, train
        )
        if not train:
            return
        add_layer_norm._add_layer_norm_backward_op(
            torch.zeros_like(y),
            torch.zeros_like(y_low) if fused else None,
            s,
            weight,
            mean,
            rstd,
            seed,
            p,
            True,
            fused,
            torch.float32,
            x.dtype,
            residual.dtype,
        )

    return Case(name, run, _name(dtype))


def dropout_mask_case():
    dropout = _module("fastformer.kernels._dropout")

    def run():
        seed = torch.zeros(1, dtype=torch.int64)
        dropout._dropout_mask(torch.empty(256, 256, dtype=torch.uint8), seed, 0.1)
        dropout._attention_mask(torch.empty(2, 100, 100, dtype=torch.uint8), seed, 0.1)

    return Case("dropout_mask", run, "")


def model_case(B=32, L=64, tma=False, dtype="bf16"):
    """One train step and one evaluation of the tutorial's MovieClassification as `fastformer train`
    runs them on a GPU: the tutorial config, bf16 autocast, dropout 0.1, reviews padded to L
    tokens (lengths spread up to L) and the one-token [BOS] decoder input. It runs without
    autotuning, as a default GPU run does: what it compiles is the config each launch's rule picks
    for the model's own layouts and flags. `tma`: with tile loads through tensor descriptors.
    dtype "fp32": the tutorial's own fp32 model, no autocast, with TF32 allowed (tf32_precision),
    as the "auto" backend runs it on the kernels."""
    fastformer = _module("fastformer")
    name = f"model/tutorial/{dtype}/train+eval/B{B}xL{L}" + ("/tma" if tma else "")

    def run():
        _module("fastformer.kernels").set_tma(True if tma else None)
        try:
            with tf32_precision(dtype):
                _model_step(fastformer, B, L, autocast=dtype != "fp32")
        finally:
            _module("fastformer.kernels").set_tma(None)

    return Case(name, run, _name(dtype), autotune=False)


def _model_step(fastformer, B, L, autocast=True):
    """model_case's train step and evaluation (under bf16 autocast, or as the model's fp32)."""
    torch.manual_seed(0)
    config = fastformer.Config.tutorial()
    model = fastformer.MovieClassification(config)
    lengths = torch.linspace(1, L, B).long()
    enc = torch.randint(4, config.n_enc_vocab, (B, L)).masked_fill(torch.arange(L) >= lengths[:, None], config.i_pad)
    dec = torch.full((B, 1), 2)  # [BOS]
    labels = torch.randint(0, config.n_output, (B,))
    with fastformer.use_backend("triton"), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = model.train()(enc, dec)[0]
        torch.nn.functional.cross_entropy(logits.float(), labels).backward()
        with torch.no_grad():
            model.eval()(enc, dec)


def _common_cases(dtypes):
    cases = [dropout_mask_case()]
    for dtype in dtypes:
        for activation, train in itertools.product(("gelu", "relu"), (True, False)):
            cases.append(ffn_case(dtype, activation, train, TUTORIAL["d_hidn"], TUTORIAL["d_ff"], 8 * 256))
            cases.append(ffn_case(dtype, activation, train, LARGE["d_hidn"], LARGE["d_ff"], LARGE["M"]))
        for d, dropout in itertools.product((TUTORIAL["d_hidn"], LARGE["d_hidn"]), (False, True)):
            cases.append(layer_norm_case(dtype, d, dropout))
        cases += [layer_norm_case(dtype, d, True, fused=True) for d in (TUTORIAL["d_hidn"], LARGE["d_hidn"])]
        cases.append(layer_norm_case(dtype, TUTORIAL["d_hidn"], False, fused=True, train=False))  # the forward alone
    return cases


# (mask, dropout) of CI's fp16 attention cases compiled with the rules' picks only, not every config:
# each one's flags are a subset of other cases', which compile every config (no mask: of the
# padding, causal and dense masks; no mask with dropout: of padding, and dense, with dropout; causal
# with dropout: of padding + causal with dropout), and a kernel with fewer flags has fewer code
# paths. On the whole CI matrix of 2026-12-03 (this CPU), every (pass, config) of these three
# compiled without a spill, in at most its supersets' shared memory, on Triton 3.9 and 3.6;
# registers are not ordered so (3.6: none+dropout's dQ 64x64 w4 s2 took 214, its supersets 183
# and 163; three such of 63 on 3.6, one on 3.9), so a spill is not ruled out, only unseen. They
# were 11% (3.9) and 17% (3.6) of a lane's compile seconds. `full_cases` compiles every config.
SUBSET_MASKS = {  # (mask, dropout): the cases whose flags it is a subset of
    ("none", False): (("pad", False), ("causal", False), ("dense", False)),
    ("none", True): (("pad", True), ("dense", True)),
    ("causal", True): (("pad+causal", True),),
}


# The GPU machines' Triton (major.minor), CI's oldest lane: where CI compiles every config
GPU_TRITON = "3.6"


def ci_cases_here():
    """The CI matrix as CI compiles it on the Triton installed here. On the GPU machines' Triton
    (GPU_TRITON, the oldest lane) every config a case's launches can select, as autotuning and the
    sweep on a GPU choose from them; on any other (the newest lane) every case with its launches'
    rules' picks, as a GPU run takes by default: every kernel, variant, mask, head dim, layout and
    dtype still compiled and held to the rules, and the configs' own verdicts left to the Triton a
    GPU runs (tools/results/sm90-compile.md has every config on 3.9; `python -m tools.sm90_report`
    compiles them). On this 2-core CPU (2026-12-08, two workers and nothing else running) the
    picks took 282 compiles in 317 s; every config takes 795 distinct compiles (tools.sm90._shards),
    about 12 minutes of two cores (tests/sm90_early.py), which both lanes' matrices spent on CI's
    second core beside the oldest lane's tests."""
    import triton

    cases = ci_cases()
    if ".".join(triton.__version__.split(".")[:2]) == GPU_TRITON:
        return cases
    return [dataclasses.replace(case, autotune=False) for case in cases]


def ci_cases():
    """Sized for CI: in fp16 every op variant, every mask and dropout at the tutorial's head dim
    (every config, but for the three whose flags are a subset of another case's: SUBSET_MASKS) and
    every head dim with the model's masks, each with every config; in bf16 the model's masks and
    the tutorial's FFN with the config each rule picks, and the model; in fp32 (TF32) the model and
    its encoder's attention and the FFN with the rules' picks; LayerNorm in fp32 too; the
    other layouts, an odd length and Lq != Lk once each. bf16 compiles as fp16 does (same tiles,
    same instructions but the type): on the 2026-11-29 tables, 112 (kernel, config) pairs of bf16
    and fp16 cases had the same shared memory, spills, wgmma and pipelining and verdict on both
    Triton versions, registers within 12, so bf16's every config would add 270 s of a worker's
    1,590 (this CPU, 2026-12-02) and no verdict; tests/test_sm90_compile.py holds each bf16
    compile to its fp16 twin, and `full_cases` compiles every config in both."""
    cases = _common_cases(["fp16"])
    cases += [layer_norm_case("fp32", TUTORIAL["d_hidn"], dropout) for dropout in (False, True)]
    cases += [
        ffn_case("bf16", "gelu", train, TUTORIAL["d_hidn"], TUTORIAL["d_ff"], 8 * 256, autotune=False)
        for train in (True, False)
    ]
    cases += [layer_norm_case("bf16", TUTORIAL["d_hidn"], dropout) for dropout in (False, True)]
    cases.append(layer_norm_case("bf16", TUTORIAL["d_hidn"], True, fused=True))
    cases.append(layer_norm_case("bf16", TUTORIAL["d_hidn"], False, fused=True, train=False))
    for mask, dropout in itertools.product(MASKS, (False, True)):
        probs = mask == "pad" and not dropout
        every = (mask, dropout) not in SUBSET_MASKS
        cases.append(attention_case("fp16", TUTORIAL["D"], mask, dropout, probs=probs, autotune=every))
    for mask, dropout in itertools.product(("pad", "pad+causal"), (False, True)):
        cases.append(attention_case("bf16", TUTORIAL["D"], mask, dropout, autotune=False))
    for D in HEAD_DIMS:
        if TUTORIAL["D"] != D:
            for mask, dropout in (("pad", True), ("pad+causal", False)):
                cases.append(attention_case("fp16", D, mask, dropout))
    cases.append(attention_case("bf16", 64, "pad", False, layout="cross", L=97, Lk=61))  # odd, Lq != Lk
    cases.append(attention_case("fp16", 64, "causal", False, layout="contiguous", L=4096))
    cases.append(attention_case("fp16", 72, "pad", False, layout="contiguous"))  # rows 144 B apart: ROW_ALIGN
    cases.append(model_case())
    # fp32 with TF32 products, as the "auto" backend runs an fp32 model where PyTorch's matmuls take
    # TF32: the model, its encoder's call at 256 tokens and the FFN, with the rules' picks; tf32_cases
    # compiles every config (tests/test_kernel_configs.py holds the fp32 rules to its tables)
    cases.append(model_case(dtype="fp32"))
    cases.append(attention_case("fp32", TUTORIAL["D"], "pad", True, autotune=False))
    cases.append(ffn_case("fp32", "gelu", True, *TUTORIAL_FFN, autotune=False))  # linear_gelu's backward too
    # tile loads through tensor descriptors (kernels/_tma.py), each launch with its rule's pick: every
    # mask, with and without dropout, at the tutorial's head dim, the other head dims with the
    # model's masks, and the model; full_cases compiles every config
    for mask, dropout in itertools.product(MASKS, (False, True)):
        cases.append(attention_case("fp16", TUTORIAL["D"], mask, dropout, tma=True, autotune=False))
    for D in HEAD_DIMS:
        if TUTORIAL["D"] != D:
            cases.append(attention_case("fp16", D, "pad+causal", True, tma=True, autotune=False))
    cases.append(attention_case("fp16", 64, "causal", False, layout="contiguous", L=4096, tma=True, autotune=False))
    for (d, d_ff, M), train in itertools.product(((256, 1024, 8 * 256), (1024, 4096, 8192)), (True, False)):
        cases.append(ffn_case("fp16", "gelu", train, d, d_ff, M, tma=True, autotune=False))
    cases.append(model_case(tma=True))
    # the one-pass backward (kernels/_backward_choice.py), its rule's picks: the model's flags in
    # fp16 and bf16, the targets' causal call at 4096 tokens on both load paths; one_pass_cases
    # (python -m tools.sm90_report --one-pass) compiles every config
    for dtype in ("fp16", "bf16"):
        cases.append(attention_case(dtype, TUTORIAL["D"], "pad", True, autotune=False, one_pass=True))
    for tma in (False, True):
        long = {"layout": "contiguous", "L": 4096, "tma": tma}
        cases.append(attention_case("fp16", 64, "causal", False, autotune=False, one_pass=True, **long))
    # attention over packed sequences (attention_varlen: the kernels' VARLEN path), the rules' picks:
    # the model's self-attention with dropout and a causal mask in fp16 and bf16, cross-attention
    # with dropout, head dim 128, and the one-pass backward
    cases += [
        varlen_case("fp16", TUTORIAL["D"], True, True),
        varlen_case("bf16", TUTORIAL["D"], True, True),
        varlen_case("fp16", TUTORIAL["D"], False, True, cross=True),
        varlen_case("fp16", 128, True, False),
        varlen_case("fp16", TUTORIAL["D"], True, False, one_pass=True),
    ]
    # the first product by cuBLAS, then the activation kernel (its one config): both activations in
    # fp16, GELU in bf16, training (the activation beside the pre-activation) and inference (over it)
    for dtype, activation, train in (("fp16", "gelu", True), ("fp16", "relu", False), ("bf16", "gelu", True)):
        cases.append(ffn_case(dtype, activation, train, *TUTORIAL_FFN, cublas=True, autotune=False))
    return cases


def full_cases():
    """The whole product: every head dim x mask x dropout x dtype, and the odd-length layouts."""
    cases = _common_cases(DOT_DTYPES)
    cases += [
        layer_norm_case("fp32", d, dropout) for d in (TUTORIAL["d_hidn"], LARGE["d_hidn"]) for dropout in (False, True)
    ]
    for dtype, D, mask, dropout in itertools.product(DOT_DTYPES, HEAD_DIMS, MASKS, (False, True)):
        cases.append(attention_case(dtype, D, mask, dropout))
    for dtype, D in itertools.product(DOT_DTYPES, HEAD_DIMS):
        cases.append(attention_case(dtype, D, "pad", False, layout="cross", L=97, Lk=61))
        cases.append(attention_case(dtype, D, "causal", False, layout="contiguous", L=1025))
    for dtype, D, mask, dropout in itertools.product(DOT_DTYPES, HEAD_DIMS, MASKS, (False, True)):
        cases.append(attention_case(dtype, D, mask, dropout, tma=True))  # every config, through descriptors
    for dtype, train in itertools.product(DOT_DTYPES, (True, False)):
        cases.append(ffn_case(dtype, "gelu", train, TUTORIAL["d_hidn"], TUTORIAL["d_ff"], 8 * 256, tma=True))
        cases.append(ffn_case(dtype, "gelu", train, LARGE["d_hidn"], LARGE["d_ff"], LARGE["M"], tma=True))
    for dtype, activation, train in itertools.product(DOT_DTYPES, ("gelu", "relu"), (True, False)):
        cases.append(ffn_case(dtype, activation, train, *TUTORIAL_FFN, cublas=True))
        cases.append(ffn_case(dtype, activation, train, LARGE["d_hidn"], LARGE["d_ff"], LARGE["M"], cublas=True))
    cases.append(model_case(tma=True))
    return cases


def tf32_cases():
    """fp32 with TF32 products, every config (`python -m tools.sm90_report --tf32`): the attention
    passes at every head dim with the model's masks, with and without dropout, a long causal call,
    the FFN at both sizes, training and inference. Not in CI (ci_cases has the
    fp32 rules' picks); what the fp32 rules are written from: tools/results/sm90-compile-tf32.md and
    its Triton 3.6 twin, generated 2026-12-03 before those rules narrowed the lists, so that they
    show every config of the fp16/bf16 lists (a run now compiles only what the fp32 rules keep; the
    activation-gradient kernel's rows show its 128-column tile, which fp32 no longer takes).
    """
    cases = []
    for D, mask, dropout in itertools.product(HEAD_DIMS, ("pad", "pad+causal"), (False, True)):
        cases.append(attention_case("fp32", D, mask, dropout))
    cases.append(attention_case("fp32", 64, "causal", False, layout="contiguous", L=4096))
    large = (LARGE["d_hidn"], LARGE["d_ff"], LARGE["M"])
    for (d, d_ff, M), train in itertools.product((TUTORIAL_FFN, large), (True, False)):
        cases.append(ffn_case("fp32", "gelu", train, d, d_ff, M))
    return cases


# The attention configs in one warp group that autotuning and the sweep time beyond the rules'
# picks (kernels/attention.py, _one_warp_group_fits): each pass's Configs and its candidate tiles,
# (BLOCK_M, BLOCK_N, num_warps)
CANDIDATES = {"_attn_fwd": ((128, 64, 4), (128, 32, 4)), "_attn_bwd_dkdv": ((32, 64, 4),)}


def candidate_case(name, config, dtype, D, mask, dropout, **kwargs):
    """attention_case (its keywords `kwargs`) with the pass `name` given the one candidate `config`
    (meta, num_warps, num_stages) to compile; the other passes compile their rules' picks."""
    inner = attention_case(dtype, D, mask, dropout, autotune=False, **kwargs)
    meta, num_warps, num_stages = config

    def run():
        attention = _module("fastformer.kernels.attention")
        configs = getattr(attention, name)
        only = _module("fastformer.kernels._configs").Configs(
            configs.kernel, configs.name, [config], configs.key, configs.fits,
            interpreter_meta=configs.interpreter_meta, tma_bases=configs.tma_bases,
        )  # fmt: skip
        setattr(attention, name, only)
        try:
            inner.run()
        finally:
            setattr(attention, name, configs)

    label = {"_attn_fwd": "forward", "_attn_bwd_dkdv": "dKdV"}[name]
    tile = f"{meta['BLOCK_M']}x{meta['BLOCK_N']}w{num_warps}s{num_stages}"
    return Case(f"{label}-{tile}/{inner.name}", run, inner.dtype, autotune=False)


def candidates_cases():
    """Each candidate config wherever its rule keeps it (`python -m tools.sm90_report
    --candidates`): every head dim, mask and dropout in fp16 (bf16 compiles alike: ci_cases), through
    pointers and through descriptors, at 256 tokens. What _one_warp_group_fits is written from is
    the same product with every candidate compiled (docs/kernels.md)."""
    attention = _module("fastformer.kernels.attention")
    cases = []
    for name, tiles in CANDIDATES.items():
        configs = getattr(attention, name)
        for (meta, num_warps, num_stages), D, mask, dropout, tma in itertools.product(
            configs.candidates, HEAD_DIMS, MASKS, (False, True), (False, True)
        ):
            if (meta["BLOCK_M"], meta["BLOCK_N"], num_warps) not in tiles:
                continue
            pad, causal, dense = MASKS[mask]
            launch = {
                "HEAD_DIM": D, "BLOCK_D": attention._head_block(D), "LQ_BUCKET": 256, "LK_BUCKET": 256,
                "HAS_PAD": pad, "IS_CAUSAL": causal, "HAS_MASK": dense, "HAS_DROPOUT": dropout, "TMA": tma,
            }  # fmt: skip
            if configs.fits(meta, num_warps, num_stages, launch):
                cases.append(candidate_case(name, (meta, num_warps, num_stages), "fp16", D, mask, dropout, tma=tma))
    return cases


def one_pass_cases():
    """The one-pass backward (kernels/_backward_choice.py) with every config its rule keeps
    (`python -m tools.sm90_report --one-pass`): every head dim, mask and dropout in fp16 (bf16
    compiles alike: ci_cases), through pointers, at 256 tokens; through descriptors at the tutorial's
    head dim; causal at L4096, the targets' family, both ways; and fp32 (TF32) with the model's
    masks. What attention._one_pass_fits is written from."""
    cases = [
        attention_case("fp16", D, mask, dropout, one_pass=True)
        for D, mask, dropout in itertools.product(HEAD_DIMS, MASKS, (False, True))
    ]
    cases += [
        attention_case("fp16", TUTORIAL["D"], mask, dropout, tma=True, one_pass=True)
        for mask, dropout in itertools.product(MASKS, (False, True))
    ]
    for tma in (False, True):
        cases.append(attention_case("fp16", 64, "causal", False, layout="contiguous", L=4096, tma=tma, one_pass=True))
    cases += [attention_case("fp32", D, "pad", True, one_pass=True) for D in (32, 64, 128)]
    return cases
