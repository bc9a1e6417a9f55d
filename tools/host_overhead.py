"""Host time of fastformer's op calls and of a train step, on a CPU: `python -m tools.host_overhead`.

    python -m tools.host_overhead                 # prints the table, writes tools/results/host_overhead.json
    python -m tools.host_overhead --quick --json /tmp/h.json   # fewer repetitions (the CI test)

On a GPU the tutorial's model is bound by the host: its kernels run for microseconds, so the Python
between a module and each launch sets the step's time. This measures that Python under tools.sm90's
dry-run sm_90a driver, on CPU tensors: every launch runs Triton's whole host path (or fastformer's,
kernels._runtime.launch) and the driver launches nothing. Kernels compile once, in the warm-up.

Rows, each the best of `repeats` rounds of `calls` calls, the rows taking turns in each round, in
microseconds per call:
  floors      a one-pointer kernel: `kernel[grid](x)` (Triton's JITFunction.run), the same through
              fastformer's launch(), as a PreparedLaunch (how the ops' plans launch), and through a
              torch.library.triton_op with wrap_triton (how a custom op launches a Triton kernel
              for torch.compile)
  ops         each public op's forward call, and its forward + backward, at small shapes (bf16):
              attention with key padding, causal, key padding + dropout (the model's training
              call); linear_gelu; add_layer_norm with dropout, as the model calls it
  train step  MovieClassification at the tutorial's depth (6 layers, 4 heads) with tiny widths,
              batch 2 of 16 tokens, bf16 autocast, forward, loss, backward and a foreach AdamW step,
              on the Triton path and on the reference, their rounds interleaved; and the same
              with the fused AdamW `fastformer train` steps (train.loop.adamw), on both paths
  FFN         the FFN's forward + backward as the bench's ffn_fwd_bwd case calls it (the output's
              gradient taken for x and the four weights) through kernels.feed_forward and through
              eager PyTorch (linear, gelu, linear), interleaved, in fp32 at tiny widths: the CPU's
              fp32 products take a microsecond, where its bf16 ones take tens, which on a GPU
              would be launches. On a GPU whose host sets the case's time, its ratio is the bench's
  optimizer   the AdamW step alone on that model's 255 trainable parameters, gradients set:
              foreach (torch's CUDA default, the step above) and fused (`fastformer train`'s,
              train.loop.adamw), interleaved; the CPU runs their arithmetic too, a few
              microseconds at these widths
Each op row is also given as a ratio to the triton_op floor measured in the same run, the step as
the Triton path's time over the reference's: their best times', and the median over the rounds of
the ratio of the two times of each round (paired), which a machine whose speed moves between
rounds moves less.

The kernels must be imported without TRITON_INTERPRET: run this in a process that has not set it.
"""

import argparse
import itertools
import platform
import statistics
import sys
import time
from pathlib import Path

from tools import refuses_interpreter, write_report

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "tools" / "results" / "host_overhead.json"
# the tutorial's head dim, small widths and a tiny batch: the aten ops that run for real on the CPU
# (the FFN's backward GEMMs, say) take little of the time measured
SHAPE = dict(B=2, H=4, L=16, D=64, d=64, d_ff=128)


def _timed(fn, calls, repeats):
    """Best of `repeats` rounds of `calls` calls of fn(), in microseconds per call."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def _rounds(fns, calls, repeats):
    """name -> [microseconds per call of fns[name]() in each of `repeats` rounds of `calls` calls],
    the rows taking turns in every round: a busy moment of the machine slows a floor and the ops
    measured against it alike, not one row alone."""
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            times[name].append(_timed(fn, calls, 1))
    return times


def _interleaved(fns, calls, repeats):
    """name -> the best of _rounds' times of fns[name]."""
    return {name: min(times) for name, times in _rounds(fns, calls, repeats).items()}


def _paired(rounds, name, reference):
    """The median over the rounds of rounds[name] / rounds[reference], each ratio of two rows timed
    one after the other in a round: robust to the machine's speed moving between rounds, which can
    give two rows' best times from moments of different speeds."""
    return statistics.median(t / r for t, r in zip(rounds[name], rounds[reference]))


def floors(device="cpu"):
    """name -> fn() of the one-pointer kernel launched four ways, on a tensor on `device` (the GPU
    check times the same calls on a GPU machine's host: tools.gpu_check's host_calls)."""
    import torch
    import triton
    import triton.language as tl

    from fastformer.kernels._runtime import PreparedLaunch, launch

    @triton.jit
    def _touch(X):
        tl.store(X, tl.load(X) + 1)

    @torch.library.triton_op("host_overhead::touch", mutates_args={"x"})
    def touch(x: torch.Tensor) -> None:
        torch.library.wrap_triton(_touch)[(1,)](x)

    x = torch.zeros(16, device=device)
    prepared = PreparedLaunch(_touch, (1,), (x,), {})
    return {
        "kernel[grid]": lambda: _touch[(1,)](x),
        "launch(kernel)[grid]": lambda: launch(_touch)[(1,)](x),
        "PreparedLaunch": lambda: prepared(x),
        "triton_op": lambda: touch(x),
    }


def _ops():
    """name -> fn() of the public ops' calls, forward and forward + backward."""
    import torch

    from fastformer import kernels
    from fastformer.kernels._dropout import draw_seeds

    B, H, L, D, d, d_ff = (SHAPE[k] for k in ("B", "H", "L", "D", "d", "d_ff"))
    dtype = torch.bfloat16
    g = torch.Generator().manual_seed(0)

    def leaf(*shape):
        return torch.randn(*shape, generator=g).to(dtype).requires_grad_()

    def parameter(*shape):  # the model's weights are nn.Parameters
        return torch.nn.Parameter(torch.randn(*shape, generator=g).to(dtype))

    qkv = leaf(B, L, 3 * H * D)
    q, k, v = (t.view(B, L, H, D).transpose(1, 2) for t in qkv.split(H * D, dim=-1))  # the model's views
    pad = torch.zeros(B, L, dtype=torch.bool)
    pad[0, L // 2 :] = True
    seed = draw_seeds(4, "cpu")[1:2]
    x, w1, b1 = leaf(B, L, d), parameter(d_ff, d), parameter(d_ff)
    h, res, w, b = leaf(B, L, d), leaf(B, L, d), parameter(d), parameter(d)

    def backward(out):
        out.float().sum().backward()

    calls = {
        "attention, key padding": lambda: kernels.attention(q, k, v, key_padding_mask=pad),
        "attention, causal": lambda: kernels.attention(q, k, v, causal=True),
        "attention, key padding + dropout": lambda: kernels.attention(
            q, k, v, key_padding_mask=pad, dropout_p=0.1, seed=seed
        ),
        "linear_gelu": lambda: kernels.linear_gelu(x, w1, b1),
        "add_layer_norm, dropout": lambda: kernels.add_layer_norm(h, res, w, b, 1e-6, 0.1, seed=seed),
    }
    rows = {}
    for name, call in calls.items():
        rows[f"{name}: forward"] = lambda call=call: call()
        rows[f"{name}: forward + backward"] = lambda call=call: backward(call())
    return rows


def _ffn_pair():
    """name -> fn() of the FFN's forward + backward, fastformer's and eager PyTorch's (see the docstring)."""
    import torch
    import torch.nn.functional as F

    from fastformer import kernels

    g = torch.Generator().manual_seed(0)
    M, d, d_ff = 16, SHAPE["d"] // 2, SHAPE["d_ff"] // 2
    inputs = [
        torch.randn(*shape, generator=g).requires_grad_() for shape in ((M, d), (d_ff, d), (d_ff,), (d, d_ff), (d,))
    ]
    dy = torch.randn(M, d, generator=g)

    def eager(x, w1, b1, w2, b2):
        return F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)

    def forward_backward(ffn):
        return lambda: torch.autograd.grad(ffn(*inputs), inputs, dy)

    return {"feed_forward": forward_backward(kernels.feed_forward), "eager": forward_backward(eager)}


def _config():
    """The tutorial's depth (6 layers, 4 heads) at tiny widths: what the host does, not the CPU's arithmetic."""
    from fastformer import Config

    return Config.tutorial(
        n_enc_vocab=64, n_dec_vocab=64, n_enc_seq=16, n_dec_seq=4, d_hidn=32, d_head=8, d_ff=64, n_output=2
    )


def _train_steps():
    """{name: step()} of a MovieClassification train step at the tutorial's depth, on each backend
    ("triton", "reference"), with a foreach AdamW and (", fused AdamW") with the optimizer
    `fastformer train` steps (train.loop.adamw, fused)."""
    import torch

    import fastformer
    from fastformer import MovieClassification
    from fastformer.train.loop import adamw

    config = _config()
    g = torch.Generator().manual_seed(0)
    enc = torch.randint(1, 64, (SHAPE["B"], SHAPE["L"]), generator=g)
    enc[0, SHAPE["L"] // 2 :] = config.i_pad
    dec = torch.full((SHAPE["B"], 1), 2)
    labels = torch.tensor([0, 1])
    steps = {}
    for backend, fused in itertools.product(("triton", "reference"), (False, True)):
        torch.manual_seed(0)
        model = MovieClassification(config).train()
        if fused:
            optimizer = adamw(model, 1e-4, 0.01, fused=True)
        else:
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)

        def step(model=model, optimizer=optimizer, backend=backend):
            with fastformer.use_backend(backend), torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model(enc, dec)[0]
            torch.nn.functional.cross_entropy(logits.float(), labels).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        steps[f"{backend}, fused AdamW" if fused else backend] = step
    return steps


def _optimizer_steps():
    """{form: step()} of AdamW on the train step's model's parameters, in its foreach form and in
    `fastformer train`'s (fused), every gradient set once (the steps reuse them)."""
    import torch

    from fastformer import MovieClassification
    from fastformer.train.loop import adamw

    config = _config()
    steps = {}
    for form in ("foreach", "fused"):
        torch.manual_seed(0)
        model = MovieClassification(config)
        optimizer = adamw(model, 1e-4, 0.01, fused=form == "fused", foreach=True)  # foreach: when not fused
        for group in optimizer.param_groups:
            for p in group["params"]:
                p.grad = torch.full_like(p, 1e-3)
        steps[form] = optimizer.step
    return steps


def measure(calls=200, repeats=15, step_calls=10):
    """Run every row under the dry-run driver; returns the JSON-ready report."""
    import torch
    import triton

    from tools import sm90

    torch.set_num_threads(1)
    # the driver launches nothing, so a kernel's outputs hold whatever their memory held; the aten
    # ops after them (the FFN's second product, the backward's products) then do arithmetic on it,
    # and a denormal in it slows the CPU's arithmetic many times over, a cost no GPU pays
    torch.set_flush_denormal(True)
    with sm90.dry_run(time_configs=False):
        floor_calls, ops = floors(), _ops()
        for fn in [*floor_calls.values(), *ops.values()]:
            fn()  # compile
        rows = _interleaved({**floor_calls, **ops}, calls, repeats)
        steps = _train_steps()
        for step in steps.values():
            step()
        step_rounds = _rounds(steps, step_calls, repeats)
        times = {name: min(rounds) for name, rounds in step_rounds.items()}
        ffn = _ffn_pair()
        for fn in ffn.values():
            fn()
        ffn_rounds = _rounds(ffn, calls, repeats)
        optimizers = _optimizer_steps()
        for step in optimizers.values():
            step()
        optimizer_times = _interleaved(optimizers, step_calls, repeats)
    floor = rows["triton_op"]
    report = {
        "schema": "fastformer.host_overhead/1",
        "date": time.strftime("%Y-%m-%d"),
        "machine": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "shape": SHAPE,
        "calls": calls,
        "repeats": repeats,
        "unit": "microseconds per call, best of the rounds; ratios are to the triton_op floor of the same run",
        "floors": {name: rows[name] for name in floor_calls},
        "ops": {name: {"us": rows[name], "x_triton_op": rows[name] / floor} for name in ops},
        "train_step": {
            "triton_us": times["triton"],
            "reference_us": times["reference"],
            "triton_over_reference": times["triton"] / times["reference"],
            "triton_over_reference_paired": _paired(step_rounds, "triton", "reference"),
            "fused_adamw": {
                "triton_us": times["triton, fused AdamW"],
                "reference_us": times["reference, fused AdamW"],
                "triton_over_reference": times["triton, fused AdamW"] / times["reference, fused AdamW"],
                "triton_over_reference_paired": _paired(step_rounds, "triton, fused AdamW", "reference, fused AdamW"),
            },
        },
        "ffn_forward_backward": {
            "feed_forward_us": min(ffn_rounds["feed_forward"]),
            "eager_us": min(ffn_rounds["eager"]),
            "feed_forward_over_eager": min(ffn_rounds["feed_forward"]) / min(ffn_rounds["eager"]),
            "feed_forward_over_eager_paired": _paired(ffn_rounds, "feed_forward", "eager"),
        },
        "optimizer_step": {
            **optimizer_times,
            "fused_over_foreach": optimizer_times["fused"] / optimizer_times["foreach"],
        },
    }
    return report


def table(report):
    lines = [
        f"host time per call, torch {report['torch']}, Triton {report['triton']}, {report['date']} "
        f"(dry-run sm_90a driver, CPU tensors, 1 thread)",
        "",
        "| call | µs | x triton_op |",
        "|---|---|---|",
    ]
    floor = report["floors"]["triton_op"]
    lines += [f"| {name} (floor) | {us:.1f} | {us / floor:.2f} |" for name, us in report["floors"].items()]
    lines += [f"| {name} | {row['us']:.1f} | {row['x_triton_op']:.2f} |" for name, row in report["ops"].items()]
    step = report["train_step"]
    lines += [
        "",
        f"train step, tutorial depth: Triton path {step['triton_us'] / 1e3:.2f} ms, reference "
        f"{step['reference_us'] / 1e3:.2f} ms: {step['triton_over_reference']:.2f}x the reference's host time "
        f"(per round, paired: median {step['triton_over_reference_paired']:.2f}x)",
    ]
    fused = step["fused_adamw"]
    lines.append(
        f"the same with the fused AdamW `fastformer train` steps: Triton path {fused['triton_us'] / 1e3:.2f} ms, "
        f"reference {fused['reference_us'] / 1e3:.2f} ms: {fused['triton_over_reference']:.2f}x "
        f"(paired: {fused['triton_over_reference_paired']:.2f}x)"
    )
    ffn = report["ffn_forward_backward"]
    lines.append(
        f"FFN forward + backward, fp32: feed_forward {ffn['feed_forward_us']:.1f} µs, eager {ffn['eager_us']:.1f} µs: "
        f"{ffn['feed_forward_over_eager']:.2f}x (paired: {ffn['feed_forward_over_eager_paired']:.2f}x)"
    )
    opt = report["optimizer_step"]
    lines.append(
        f"AdamW step alone: foreach {opt['foreach'] / 1e3:.2f} ms, fused {opt['fused'] / 1e3:.2f} ms "
        f"({opt['fused_over_foreach']:.2f}x)"
    )
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="few repetitions: checks the instrument, not the figures")
    parser.add_argument("--json", type=Path, default=RESULTS, help=f"where the report goes (default {RESULTS})")
    args = parser.parse_args(argv)
    if refuses_interpreter("host_overhead", "this times compiled kernels' launches"):
        return 2
    report = measure(calls=5, repeats=1, step_calls=1) if args.quick else measure()
    write_report(args.json, report, table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
