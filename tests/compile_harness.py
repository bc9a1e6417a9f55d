"""torch.compile(fullgraph=True) of the drop-in models on the GPU code path, with CPU tensors.

A GPU user's `fastformer train --compile` runs Dynamo, AOT autograd and Inductor over fastformer's
Triton ops on their torch and Triton. Here the same path runs on a CPU: tools.sm90's dry-run
driver makes Triton compile real sm_90a binaries and launch nothing, and the ops take the Triton
path on CPU tensors as they would on CUDA ones. The model runs in train mode with dropout, padded
batches and bf16 autocast, at two sequence lengths, forward and backward. Backends:

- aot_eager: Dynamo traces the whole model as one graph (fullgraph: a graph break is an error),
  AOT autograd makes the forward and backward graphs, and both run, the ops launching dry.
- inductor: Inductor lowers each graph, the forward and then the backward, and generates its
  code; loading that code compiles the ops' Triton kernels for the graph's device, and for
  target cpu Triton has no backend. That stop, and only that stop, is where a CPU must end: the
  graph is then run as aot_eager would, so the backward is reached and lowered too.

The kernels must be imported without TRITON_INTERPRET, so the tests run this in a subprocess:

    python -m tests.compile_harness --models movie seq2seq --backends aot_eager inductor

It prints a JSON list, one object per (model, backend): per sequence length, whether the forward
and backward ran; the graphs Inductor lowered; the Triton kernels launched; the error, if any.
"""

import argparse
import contextlib
import copy
import json
import sys
import traceback

import torch
import torch._inductor.config

import fastformer
from fastformer.compat import aladdinpersson
from tests.helpers import small_config, token_batch
from tools import sm90

LENGTHS = (13, 20)  # two sequence lengths: the second recompiles with dynamic shapes
# Triton's message when it is asked to compile for a device it has no backend for (3.6 to 3.9)
NO_CPU_BACKEND = "compatible backends for target (cpu)"


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


class InductorUntilTriton:
    """A torch.compile backend: Inductor's compile_fx, whose per-graph compile runs Inductor until
    it stops at compiling a Triton kernel for target cpu, records the graph as lowered, and runs
    the graph as it was given (as aot_eager would), so AOT autograd reaches the backward."""

    def __init__(self):
        self.lowered = []  # "forward" / "backward", one per graph Inductor lowered

    def __call__(self, gm, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(gm, example_inputs, inner_compile=self.inner_compile)

    def inner_compile(self, gm, example_inputs, **kwargs):
        from functorch.compile import make_boxed_func
        from torch._inductor.compile_fx import compile_fx_inner

        graph = "backward" if kwargs.get("is_backward") else "forward"
        as_given = copy.deepcopy(gm)  # Inductor's passes rewrite gm in place
        try:
            compile_fx_inner(gm, example_inputs, **kwargs)
        except Exception as error:  # only the expected stop is let through
            if NO_CPU_BACKEND not in str(error):
                raise
            self.lowered.append(graph)
            return make_boxed_func(as_given)
        raise AssertionError(f"Inductor compiled the {graph} graph's Triton kernels for target cpu")


def run(model_name, backend_name):
    """Compile and run the model at each length; returns the JSON-ready result."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, batches, logits_of = MODELS[model_name]()
    model.train()
    inductor = InductorUntilTriton() if backend_name == "inductor" else None
    compiled = torch.compile(model, fullgraph=True, backend=inductor or backend_name)
    first_launch = len(LAUNCHED)
    result = {"model": model_name, "backend": backend_name, "torch": torch.__version__, "lengths": {}}
    with sm90.dry_run(time_configs=False), fastformer.use_backend("triton"), _recording_launches():
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
    result["kernels"] = sorted(set(LAUNCHED[first_launch:]))
    result["triton"] = sys.modules["triton"].__version__
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
    args = parser.parse_args(argv)
    torch._inductor.config.compile_threads = 1  # compile in this process: the stop must be seen here
    print(json.dumps([run(model, backend) for model in args.models for backend in args.backends]))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
