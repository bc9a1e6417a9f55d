"""Compile a job's Triton kernels before its first step: `warm_up(model, shapes, device=..., amp=...)`.

A kernel is compiled the first time a launch needs its specialization, so without this the first
step of every new batch shape waits for its compiles, one after another. `warm_up` runs the steps
the job will run, one train step's forward and backward and one evaluation forward per batch
shape, on dummy batches, before the first real one:

- Every launch inside it compiles and runs nothing (`kernels.compile_only()`), under a
  `triton.AsyncCompileMode` whose executor is a thread pool: a launch submits its compile and the
  model goes on to the next, so the compiles of all the shapes run in parallel, in the threads
  (Triton releases the interpreter lock in its MLIR passes and ptxas runs as a process; see
  `CompileThreads` for the one trap of compiling in threads). This is
  sound because what a launch compiles depends only on its arguments' types, shapes, strides,
  alignment and flags, which the dummy batch has as a real one would, never on values: the
  kernels' outputs are left unwritten, and the warm-up's results are thrown away. A launch that
  is not a warm-up waits for its own compile (Triton's `run` takes the compiled kernel before it
  launches), so the warm-up cannot run real steps and compile in parallel at once.
- With autotuning on (FASTFORMER_AUTOTUNE=1), that pass compiles every config the autotuner will
  time; a second pass then runs the steps for real, so the autotuner times each new key with
  kernels already compiled (or reads its timings from the disk cache) before the job's first step.

The model is left as it was: its parameters' gradients, its train or eval mode, and the random
number generators of the CPU and of `device` (the warm-up draws dropout seeds), so a job with a
warm-up trains bit for bit as one without. No optimizer runs. Pass the model itself, not a
DistributedDataParallel or torch.compile wrapper of it (their first calls do work of their own).
Nothing happens where the kernels are not in use (the PyTorch reference, the interpreter).
"""

import contextlib
import os
import time
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F

from fastformer import kernels
from fastformer.data.reviews import bucket_length
from fastformer.progress import progress_bar
from fastformer.train.loop import autocast
from fastformer.train.runtime import kernels_in_use


def bucket_shapes(config, batch_size, lengths=None):
    """The encoder batch shapes of a job that pads to buckets (--pad-to-buckets): (batch_size, L)
    for every length L that fastformer.data.reviews.bucket_length gives for reviews of `lengths`
    pieces (default: every length from 1 to n_enc_seq). A batch is padded to the bucket of its
    longest review, so the buckets of the data's review lengths are all a job can see. A last,
    smaller batch needs no shape of its own: the kernels do not specialize on the number of rows."""
    if lengths is None:
        lengths = range(1, config.n_enc_seq + 1)
    return sorted({(batch_size, bucket_length(n, config.n_enc_seq)) for n in lengths})


def warm_up(model, shapes, *, device, amp="off", dec_len=1, train=True, evaluate=True, workers=None, progress=True):
    """Compile the kernels that a train step and an evaluation of `model` (a MovieClassification)
    launch for each encoder batch shape in `shapes` ((batch, length) pairs, such as
    bucket_shapes gives), the decoder reading `dec_len` tokens (the job's one [BOS]). `amp` is the
    job's autocast ("bf16", "fp16" or "off"). Compiles run in `workers` threads (default: the
    CPUs this process may use). A progress bar shows the shapes, then the wait for the last compiles.

    Returns {"shapes": how many were warmed up, "seconds": the wall time}; nothing is done, and
    0 shapes returned, where the model does not run the Triton kernels."""
    import triton

    device = torch.device(device)
    shapes = sorted(set(shapes))
    if kernels.INTERPRET or not shapes or kernels_in_use(device, amp) != "triton":
        return {"shapes": 0, "seconds": 0.0}
    start = time.perf_counter()
    workers = workers or len(os.sched_getaffinity(0))
    autotuning = kernels.autotune_enabled()
    bar = progress_bar(
        total=len(shapes) * (2 if autotuning else 1), desc="compiling kernels", unit="shape", disable=not progress
    )
    with _model_kept(model, device):
        with CompileThreads(workers) as pool, triton.AsyncCompileMode(pool), kernels.compile_only():
            for i, shape in enumerate(shapes):
                bar.set_description(f"compiling kernels: shape {i + 1}/{len(shapes)}")
                _steps(model, shape, dec_len, device, amp, train, evaluate)
                bar.update()
            bar.set_description("compiling kernels: waiting for the compiler")
        for i, shape in enumerate(shapes if autotuning else []):
            bar.set_description(f"autotuning kernels: shape {i + 1}/{len(shapes)}")
            _steps(model, shape, dec_len, device, amp, train, evaluate)
            bar.update()
    bar.close()
    return {"shapes": len(shapes), "seconds": time.perf_counter() - start}


class CompileThreads(ThreadPoolExecutor):
    """The warm-up's compile threads. Triton parses each kernel's source with ast.parse, and
    CPython (3.11 at least) keeps ast.parse's recursion count per interpreter, not per thread: two
    threads parsing at once can raise a spurious SystemError ("AST constructor recursion depth
    mismatch"). The tree is right whenever none is raised, and nothing is written before the parse,
    so such a compile is run again."""

    def submit(self, fn, /, *args, **kwargs):
        return super().submit(_parse_race_retried, fn, *args, **kwargs)


def _parse_race_retried(fn, *args, **kwargs):
    for attempt in range(1, 11):
        try:
            return fn(*args, **kwargs)
        except SystemError as error:
            if "AST constructor recursion depth mismatch" not in str(error) or attempt == 10:
                raise


def _steps(model, shape, dec_len, device, amp, train, evaluate):
    """A train step's forward and backward (no optimizer step) and an evaluation forward on a dummy
    batch of `shape`: token ids of one piece past the special ones, the second half of each row
    padding but its first piece, as reviews of mixed lengths are."""
    batch, length = shape
    config = model.config
    enc = torch.full((batch, length), 4, dtype=torch.long, device=device)
    enc[:, 1 + length // 2 :] = config.i_pad
    dec = torch.full((batch, dec_len), 2, dtype=torch.long, device=device)  # [BOS]
    labels = torch.zeros(batch, dtype=torch.long, device=device)
    if train:
        model.train()
        with autocast(device, amp):
            logits = model(enc, dec)[0]
        F.cross_entropy(logits.float(), labels).backward()
    if evaluate:
        model.eval()
        with torch.no_grad(), autocast(device, amp):
            model(enc, dec)


@contextlib.contextmanager
def _model_kept(model, device):
    """Restores the model's gradients and mode, and the CPU's and the device's RNG, after the block."""
    grads = [(p, p.grad) for p in model.parameters()]
    training = model.training
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        try:
            yield
        finally:
            for p, grad in grads:
                p.grad = grad
            model.train(training)
