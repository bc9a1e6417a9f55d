"""The determinism stage: attention forward + backward repeated on one input (without and with
dropout), and train steps of the tutorial model from one seed, twice: every output, gradient and
final weight bitwise equal, or the first mismatch (tensor, index, the two values)."""

import json
import time

import torch
import torch.nn.functional as F

import fastformer
from bench import cases as suite
from fastformer import kernels
from fastformer.train.loop import autocast
from tools.gpu_check.run import Failed


def first_mismatch(first, second):
    """The first tensor of two {name: tensor} dicts whose bits differ, with its first differing
    element: {tensor, index, first, second}; None when every tensor is bitwise equal."""
    for name, a in first.items():
        b = second[name]
        if a.shape != b.shape or a.dtype != b.dtype:
            return {
                "tensor": name,
                "index": None,
                "first": f"{a.dtype} {tuple(a.shape)}",
                "second": f"{b.dtype} {tuple(b.shape)}",
            }
        differ = _bits(a) != _bits(b)  # bits, so NaN == NaN and -0.0 != 0.0
        if bool(differ.any()):
            index = tuple(int(i) for i in differ.nonzero()[0])
            return {"tensor": name, "index": list(index), "first": a[index].item(), "second": b[index].item()}
    return None


def _bits(t):
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.detach().contiguous().view(ints[t.element_size()])


ATTENTION_SETTINGS = (("padding + causal", True, 0.0), ("padding, dropout 0.1", False, 0.1))


def stage(run):
    deadline = run.deadline("determinism")
    attention = _attention_repeats(run, deadline)
    training = _training_twice(run, deadline)
    mismatches = [s for s in attention["settings"] if s["mismatch"]] + ([training] if training["mismatch"] else [])
    short = [s["setting"] for s in attention["settings"] if s["repetitions"] < run.plan.reps.attention]
    parts = [f"attention x{s['repetitions']} ({s['setting']})" for s in attention["settings"]]
    parts.append(f"{training['steps']} train steps twice")
    details = {"summary": "bitwise equal: " + ", ".join(parts), "attention": attention, "training": training}
    if mismatches:
        m = mismatches[0]["mismatch"]
        details["summary"] = (
            f"not bitwise reproducible: {m['tensor']} at {m['at']}, index {m['index']}: "
            f"{m['first']!r} then {m['second']!r}"
        )
        raise Failed(details["summary"], details)
    if short or training["steps"] < run.plan.reps.train_steps:
        details["summary"] = f"cut by the stage's budget of {run.plan.budget_seconds['determinism']} s: " + ", ".join(
            parts
        )
        raise Failed(details["summary"], details)
    return details


def _attention_repeats(run, deadline):
    """kernels.attention forward + backward on one input, repeated, against the first call's bits."""
    B, H, L, D = run.plan.attention_shape
    dtype = "bf16" if run.amp == "bf16" else "fp32"
    q, k, v, key_padding, _ = suite.attention_inputs(B, H, L, D, suite.DTYPES[dtype], "padding", run.device, True)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(run.device, q.dtype)

    def once(causal, dropout_p):
        torch.manual_seed(0)  # the dropout mask's seed
        out = kernels.attention(q, k, v, key_padding_mask=key_padding, causal=causal, dropout_p=dropout_p)
        return dict(zip(("out", "dq", "dk", "dv"), (out, *torch.autograd.grad(out, (q, k, v), do))))

    settings = []
    for setting, causal, dropout_p in ATTENTION_SETTINGS:
        first, repetitions, mismatch = once(causal, dropout_p), 1, None
        while repetitions < run.plan.reps.attention and mismatch is None and time.monotonic() < deadline:
            repetitions += 1
            mismatch = first_mismatch(first, once(causal, dropout_p))
            if mismatch:
                mismatch["at"] = f"repetition {repetitions}"
        settings.append({"setting": setting, "repetitions": repetitions, "mismatch": mismatch})
        print(
            f"attention ({setting}): {repetitions} repetitions, "
            f"{'bitwise equal' if mismatch is None else 'MISMATCH ' + json.dumps(mismatch)}",
            flush=True,
        )
    return {"shape": {"B": B, "H": H, "L": L, "D": D}, "dtype": dtype, "mask": "padding", "settings": settings}


def _training_twice(run, deadline):
    """The plan's train steps of MovieClassification from one seed, twice: every step's logits,
    loss and gradients, and the final weights, compared bit for bit."""
    config = fastformer.Config.tutorial(**run.plan.config)
    batches = [
        suite.review_batch(config, run.plan.model_batch, False, run.device, seed=s)
        for s in range(run.plan.reps.train_steps)
    ]
    first = _train_trace(run, config, batches, deadline)
    second = _train_trace(run, config, batches[: len(first) - 1], deadline)  # never more steps than the first
    steps = len(second) - 1
    pairs = [(f"step {i + 1}", first[i], second[i]) for i in range(steps)]
    if steps == len(first) - 1:
        pairs.append((f"the weights after step {steps}", first[-1], second[-1]))
    mismatch = None
    for label, a, b in pairs:
        mismatch = first_mismatch(a, b)
        if mismatch:
            mismatch["at"] = label
            break
    print(
        f"training: {steps} steps twice, {'bitwise equal' if mismatch is None else 'MISMATCH ' + json.dumps(mismatch)}",
        flush=True,
    )
    config_summary = {k: config[k] for k in ("n_layer", "d_hidn", "n_head", "d_head", "d_ff", "dropout")}
    return {
        "config": config_summary,
        "batch": run.plan.model_batch,
        "amp": run.amp,
        "steps": steps,
        "mismatch": mismatch,
    }


def _train_trace(run, config, batches, deadline):
    """Per step {logits, loss, every gradient}, then the final weights; stops early at the deadline."""
    torch.manual_seed(0)
    model = fastformer.MovieClassification(config).to(run.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    trace = []
    with fastformer.use_backend("triton"):
        for enc, dec, labels in batches:
            if trace and time.monotonic() > deadline:
                break
            optimizer.zero_grad(set_to_none=True)
            with autocast(run.device, run.amp):
                logits = model(enc, dec)[0]
            loss = F.cross_entropy(logits.float(), labels)
            loss.backward()
            grads = {f"{name}.grad": p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
            trace.append({"logits": logits.detach().clone(), "loss": loss.detach().clone(), **grads})
            optimizer.step()
    trace.append({name: p.detach().clone() for name, p in model.named_parameters()})
    return trace
