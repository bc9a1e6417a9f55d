"""torch.compile(fullgraph=True) of the drop-in models on the GPU code path, with CPU tensors.

A GPU user's `fastformer train --compile` runs Dynamo, AOT autograd and Inductor over fastformer's
Triton ops on their torch and Triton. Here the same path runs on a CPU: tools.sm90's dry-run
driver makes Triton compile real sm_90a binaries and launch nothing, and the ops take the Triton
path on CPU tensors as they would on CUDA ones. The model runs in train mode with dropout, padded
batches and bf16 autocast, at two sequence lengths, forward and backward. Backends:

- aot_eager: Dynamo traces the whole model as one graph (fullgraph: a graph break is an error),
  AOT autograd makes the forward and backward graphs, and both run, the ops launching dry.
- inductor: Inductor lowers each graph, the forward and then the backward, then generates and
  loads its code: C++ for the CPU ops, and the ops' Triton kernels, which it compiles for the
  graph's device with its own signature (a Python float is fp64 there, fp32 in a launch) and
  options. Triton has no backend for target cpu, so those compiles are made for sm_90a instead,
  as they would be on a GPU; an error in them fails the run. The graphs' other ops, which on a
  GPU Inductor would fuse into Triton kernels of its own, run as ATen calls (its
  `fallback_by_default`): on CPU tensors they would be C++ that g++ compiles, nothing a GPU runs,
  and 78 g++ runs took 83 s of the harness's 492 (profile, this CPU, 2026-12-07). The graph is then run as it was
  given (as aot_eager would: the dry-run launches of Inductor's code would compute nothing), so
  AOT autograd reaches the backward, and Inductor lowers that too.

The kernels must be imported without TRITON_INTERPRET, so the tests run this in a subprocess:

    python -m tests.compile_harness --models movie seq2seq --backends aot_eager inductor

It prints a JSON list, one object per (model, backend): per sequence length, whether the forward
and backward ran; the graphs Inductor lowered; the kernels Inductor had compiled for sm_90a; the
Triton kernels launched; the error, if any.

With --bucketed it also follows the drop-in user's loop of docs/drop-in.md, the tutorial's train
step on MovieClassification compiled as `torch.compile(model, mode="reduce-overhead")` compiles it
(fullgraph here: a graph break is an error), over batches of reviews of different lengths padded by
fastformer.pad_to_bucket: what Dynamo compiles per batch, which must be one graph per bucket
length and none again for a batch of a bucket met before. Dynamo's part of that mode (its
tracing, guards and recompiles) is the same whatever the backend: aot_eager runs the graphs here;
Inductor's CUDA graphs need a GPU (tests/test_cuda_graphs.py checks them there).

With --export it also exports the classifier with torch.export on the same path, and lists the
fastformer ops the exported program holds.
"""

import argparse
import contextlib
import copy
import json
import re
import sys
import traceback

import torch
import torch._inductor.config

import fastformer
from fastformer.compat import aladdinpersson
from tests.helpers import small_config, token_batch
from tools import sm90

LENGTHS = (13, 20)  # two sequence lengths: the second recompiles with dynamic shapes


def movie_classification():
    """The tutorial's classifier (small), and a batch of each length: encoder and decoder ids."""
    config = small_config(dropout=0.1, d_head=16, n_layer=1)
    model = fastformer.MovieClassification(config)
    batches = [token_batch(config, enc_len=length, dec_len=length // 2 + 1) for length in LENGTHS]
    return model, batches, lambda outputs: outputs[0]  # the logits


def seq2seq_transformer():
    """The einsum seq2seq Transformer of Aladdin Persson's tutorial (small): source with padding
    (one row all padding), target ids."""
    model = aladdinpersson.Transformer(
        src_vocab_size=23,
        trg_vocab_size=19,
        src_pad_idx=0,
        trg_pad_idx=0,
        embed_size=64,
        num_layers=1,
        forward_expansion=2,
        heads=4,
        dropout=0.1,
        max_length=24,
    )
    g = torch.Generator().manual_seed(0)
    batches = []
    for length in LENGTHS:
        src = torch.randint(1, 23, (3, length), generator=g)
        src[0, length // 2 :] = 0
        src[-1, :] = 0
        batches.append((src, torch.randint(1, 19, (3, length // 2 + 1), generator=g)))
    return model, batches, lambda outputs: outputs  # the logits


MODELS = {"movie": movie_classification, "seq2seq": seq2seq_transformer}


INDUCTOR_COMPILED = []  # names of the Triton kernels Inductor compiled (for sm_90a), in order
FP64_MATH = []  # the names of those whose PTX computes in fp64 (a float argument not cast to fp32)
# PTX's fp64 arithmetic: add.f64, mul.rn.f64, fma.rn.f64, div.rn.f64, ... (a cvt from .f64 is not)
FP64_ARITHMETIC = re.compile(r"^\s*(add|sub|mul|div|fma|max|min|sqrt|rcp|neg|abs)(\.\w+)*\.f64\b", re.MULTILINE)


@contextlib.contextmanager
def _inductor_compiles_for_sm90():
    """Inside the block, a Triton compile for target cpu (Inductor's, for CPU tensors; Triton has no
    such backend) compiles the same source with the same options for sm_90a instead, and records
    the kernel's name in INDUCTOR_COMPILED, and in FP64_MATH too if its PTX does fp64 arithmetic.
    Its errors propagate."""
    import triton
    from triton.backends.compiler import GPUTarget

    real = triton.compile

    def compile_for_sm90(src, target=None, options=None, **kwargs):
        if target is not None and target.backend == "cpu":
            binary = real(src, target=GPUTarget("cuda", 90, 32), options=options)
            INDUCTOR_COMPILED.append(src.name)
            if FP64_ARITHMETIC.search(binary.asm["ptx"]):
                FP64_MATH.append(src.name)
            return binary
        return real(src, target=target, options=options, **kwargs)

    triton.compile = compile_for_sm90  # Inductor calls triton.compile
    try:
        yield
    finally:
        triton.compile = real


class InductorForSm90:
    """A torch.compile backend: Inductor's compile_fx, whose per-graph compile runs Inductor to the
    end (its Triton kernels compiled for sm_90a under _inductor_compiles_for_sm90), records the
    graph as lowered, and returns the graph as it was given, to run as aot_eager would."""

    def __init__(self):
        self.lowered = []  # "forward" / "backward", one per graph Inductor lowered

    def __call__(self, gm, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(gm, example_inputs, inner_compile=self.inner_compile)

    def inner_compile(self, gm, example_inputs, **kwargs):
        from functorch.compile import make_boxed_func
        from torch._inductor.compile_fx import compile_fx_inner

        as_given = copy.deepcopy(gm)  # Inductor's passes rewrite gm in place
        with torch._inductor.config.patch(fallback_by_default=True):  # no C++ for the CPU ops
            compile_fx_inner(gm, example_inputs, **kwargs)  # its errors propagate
        self.lowered.append("backward" if kwargs.get("is_backward") else "forward")
        return make_boxed_func(as_given)


def run(model_name, backend_name):
    """Compile and run the model at each length; returns the JSON-ready result."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, batches, logits_of = MODELS[model_name]()
    model.train()
    inductor = InductorForSm90() if backend_name == "inductor" else None
    compiled = torch.compile(model, fullgraph=True, backend=inductor or backend_name)
    first_launch, first_compile, first_fp64 = len(LAUNCHED), len(INDUCTOR_COMPILED), len(FP64_MATH)
    result = {"model": model_name, "backend": backend_name, "torch": torch.__version__, "lengths": {}}
    with (
        sm90.dry_run(time_configs=False),
        fastformer.use_backend("triton"),
        _recording_launches(),
        _inductor_compiles_for_sm90(),
    ):
        for inputs in batches:
            length = inputs[0].shape[1]
            step = {"forward": False, "backward": False}
            result["lengths"][length] = step
            try:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    logits = logits_of(compiled(*inputs))
                step["forward"] = True
                logits.float().logsumexp(-1).sum().backward()
                step["backward"] = True
            except Exception as error:  # noqa: BLE001  (reported in the result)
                traceback.print_exc()
                result["error"] = f"{type(error).__name__}: {error}"[:4000]
                break
    result["lowered"] = inductor.lowered if inductor else []
    result["inductor_compiled"] = sorted(set(INDUCTOR_COMPILED[first_compile:]))
    result["fp64_math"] = sorted(set(FP64_MATH[first_fp64:]))
    result["kernels"] = sorted(set(LAUNCHED[first_launch:]))
    result["triton"] = sys.modules["triton"].__version__
    return result


# --bucketed: the longest review of each batch, in order (small_config's n_enc_seq is 24: buckets 16 and 24)
BUCKETED_LENGTHS = (5, 9, 14, 20, 3, 24, 12)


def run_bucketed():
    """The drop-in loop over BUCKETED_LENGTHS: per batch its bucket length and the frames Dynamo
    had compiled by its end; the error, if any."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    torch.manual_seed(0)
    config = small_config(dropout=0.1, d_head=16, n_layer=1)
    model = fastformer.MovieClassification(config).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, fullgraph=True, backend=counter)
    result = {"model": "movie", "loop": "reduce-overhead, bucketed", "batches": []}
    with sm90.dry_run(time_configs=False), fastformer.use_backend("triton"):
        for i, length in enumerate(BUCKETED_LENGTHS):
            enc, dec = token_batch(config, enc_len=length, dec_len=1, seed=i)
            enc = fastformer.pad_to_bucket(enc, config)
            labels = torch.randint(0, config.n_output, (enc.size(0),))
            try:
                optimizer.zero_grad(set_to_none=True)
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    logits = compiled(enc, dec)[0]
                torch.nn.functional.cross_entropy(logits.float(), labels).backward()
                optimizer.step()
            except Exception as error:  # noqa: BLE001  (reported in the result)
                traceback.print_exc()
                result["error"] = f"{type(error).__name__}: {error}"[:4000]
                break
            result["batches"].append({"longest": length, "bucket": enc.size(1), "frames": counter.frame_count})
    return result


def run_export():
    """torch.export of the tutorial's classifier (eval, bf16 autocast) on the Triton path, as a GPU
    user exports it: the fastformer ops the program holds; the error, if any."""
    torch.manual_seed(0)
    config = small_config(dropout=0.1, d_head=16, n_layer=1)
    model = fastformer.MovieClassification(config).eval()
    enc, dec = token_batch(config, enc_len=LENGTHS[0], dec_len=1)
    result = {"model": "movie", "loop": "torch.export"}
    autocast = torch.autocast("cpu", dtype=torch.bfloat16)
    with sm90.dry_run(time_configs=False), fastformer.use_backend("triton"), autocast:
        try:
            program = torch.export.export(model, (enc, dec))
            result["ops"] = sorted({str(n.target) for n in program.graph.nodes if "fastformer" in str(n.target)})
        except Exception as error:  # noqa: BLE001  (reported in the result)
            traceback.print_exc()
            result["error"] = f"{type(error).__name__}: {error}"[:4000]
    return result


LAUNCHED = []  # names of the Triton kernels launched (dry), in order, by every run of this process


@contextlib.contextmanager
def _recording_launches():
    """Inside the block, every kernel the dry-run driver loads records its launches in LAUNCHED.
    A kernel loaded by an earlier run keeps the launcher it was loaded with, which records there too."""
    from triton.runtime.driver import driver

    active = driver.active

    class Recording(active.launcher_cls):
        def __init__(self, src, metadata):
            super().__init__(src, metadata)
            self.name = getattr(metadata, "name", None) or getattr(src, "name", "?")

        def __call__(self, *args, **kwargs):
            LAUNCHED.append(self.name)

    previous, active.launcher_cls = active.launcher_cls, Recording
    try:
        yield
    finally:
        active.launcher_cls = previous


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=sorted(MODELS))
    parser.add_argument("--backends", nargs="+", choices=("aot_eager", "inductor"), default=("aot_eager", "inductor"))
    parser.add_argument("--bucketed", action="store_true", help="also the drop-in loop over bucketed batches")
    parser.add_argument("--export", action="store_true", help="also torch.export of the classifier")
    args = parser.parse_args(argv)
    torch._inductor.config.compile_threads = 1  # compile in this process, where triton.compile is replaced
    results = [run(model, backend) for model in args.models for backend in args.backends]
    results += [run_bucketed()] if args.bucketed else []
    print(json.dumps(results + ([run_export()] if args.export else [])))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
