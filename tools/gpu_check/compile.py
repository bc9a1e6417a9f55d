"""The compile stage: torch.compile(model, fullgraph=True) of MovieClassification and of Aladdin
Persson's einsum seq2seq Transformer: a train step (forward, loss, backward) checked finite, then
the eval-mode logits against eager; on failure, Dynamo's graph breaks by reason and place."""

import os
import time
import traceback

import torch
import torch.nn.functional as F

import fastformer
from bench import cases as suite
from bench.common import synchronize, time_ms
from fastformer.compat.aladdinpersson import Transformer as AladdinTransformer
from fastformer.train.loop import autocast, sequence_cross_entropy
from tools.gpu_check.run import ROOT, Failed, Skipped, error_text, first_line


def graph_breaks(fn, *args):
    """Dynamo's graph breaks in fn(*args) as [{reason, where}]: each reason's first line and the
    user frame it points at. Runs fn once (through Dynamo, compiling nothing)."""
    torch._dynamo.reset()
    try:
        explanation = torch._dynamo.explain(fn)(*args)
    except Exception as error:  # noqa: BLE001 (the compile error is already recorded; say why there is no list)
        return [
            {"reason": f"torch._dynamo.explain failed too: {type(error).__name__}: {first_line(error)}", "where": None}
        ]
    finally:
        torch._dynamo.reset()
    breaks = []
    for reason in explanation.break_reasons:
        frame = reason.user_stack[-1] if reason.user_stack else None
        where = None
        if frame is not None:
            path = frame.filename
            where = f"{os.path.relpath(path, ROOT) if path.startswith(ROOT + os.sep) else path}:{frame.lineno}"
        item = {"reason": reason.reason.strip().splitlines()[0], "where": where}
        if item not in breaks:
            breaks.append(item)
    return breaks


def stage(run):
    if not run.cuda:
        raise Skipped(
            "needs CUDA: torch.compile lowers fastformer's Triton ops for CUDA tensors only (on a CPU, "
            "tests/test_backend.py and tests/test_aladdinpersson.py trace the models with backend='eager')"
        )
    deadline = run.deadline("compile")
    models = {}
    for name, build in (
        ("MovieClassification", _movie_classification),
        ("aladdinpersson.Transformer", _aladdinpersson),
    ):
        entry = models[name] = {
            "compiled": False,
            "first_call_seconds": None,
            "eval_first_call_seconds": None,
            "step_ms": None,
            "eager_step_ms": None,
            "max_abs_diff": None,
            "tolerance": None,
            "graph_breaks": [],
            "error": None,
        }
        if time.monotonic() > deadline:
            entry["error"] = f"not run: the stage's budget of {run.plan.budget_seconds['compile']} s was spent"
            continue
        print(f"compiling {name} (fullgraph=True)", flush=True)
        try:
            _compile_check(run, entry, *build(run))
        except Exception as error:  # noqa: BLE001 (recorded; the other model is still checked)
            print(traceback.format_exc(), end="", flush=True)
            entry["error"] = f"{error_text(error)} (traceback in log.txt)"
    broken = {name: m["error"] for name, m in models.items() if m["error"]}
    summary = "; ".join(
        f"{name}: "
        + (
            broken[name]
            if name in broken
            else f"one graph, compiled step {m['step_ms']:.1f} ms vs eager {m['eager_step_ms']:.1f} ms"
        )
        for name, m in models.items()
    )
    details = {"summary": summary, "models": models}
    if broken:
        raise Failed(summary, details)
    return details


def _layers(run):
    return {} if run.plan.compile_layers is None else {"n_layer": run.plan.compile_layers}


def _movie_classification(run):
    """MovieClassification (the plan's config, tutorial dropout) and a batch of reviews."""
    config = fastformer.Config.tutorial(**{**run.plan.config, **_layers(run)})
    torch.manual_seed(0)
    model = fastformer.MovieClassification(config).to(run.device)
    enc, dec, labels = suite.review_batch(config, run.plan.model_batch, False, run.device)
    return model, (enc, dec), lambda out: F.cross_entropy(out[0].float(), labels), lambda out: out[0]


def _aladdinpersson(run):
    """Aladdin Persson's einsum seq2seq Transformer (dropout 0.1) on padded sources, with teacher forcing."""
    sizes = dict(run.plan.aladdinpersson)
    vocab, n, length = sizes.pop("vocab"), sizes.pop("batch"), sizes.pop("length")
    if run.plan.compile_layers is not None:
        sizes["num_layers"] = run.plan.compile_layers
    torch.manual_seed(0)
    model = AladdinTransformer(vocab, vocab, 0, 0, dropout=0.1, max_length=length, **sizes).to(run.device)
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(length // 4, length + 1, (n,), generator=g)
    src = torch.randint(1, vocab, (n, length), generator=g).masked_fill(torch.arange(length) >= lengths[:, None], 0)
    trg = torch.randint(1, vocab, (n, length), generator=g)
    src, trg = src.to(run.device), trg.to(run.device)
    return model, (src, trg[:, :-1]), lambda out: sequence_cross_entropy(out, trg[:, 1:], 0), lambda out: out


def _compile_check(run, entry, model, inputs, loss_of, logits_of):
    """Compile `model` with fullgraph=True and fill `entry`: a train step (finite loss, a finite
    gradient wherever eager gives one), its time against eager, and the eval-mode logits against
    eager; on a failed compile, Dynamo's graph breaks."""

    def step(fn):
        model.zero_grad(set_to_none=True)
        with fastformer.use_backend("triton"), autocast(run.device, run.amp):
            loss = loss_of(fn(*inputs))
        loss.backward()
        return loss

    step(model)
    eager_grads = {name for name, p in model.named_parameters() if p.grad is not None}
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    start = time.perf_counter()
    try:
        loss = step(compiled)
        synchronize(run.device)
    except Exception as error:  # noqa: BLE001 (recorded with the graph breaks that explain it)
        print(traceback.format_exc(), end="", flush=True)
        with fastformer.use_backend("triton"), autocast(run.device, run.amp):
            entry["graph_breaks"] = graph_breaks(model, *inputs)
        breaks = "; ".join(b["reason"] + (f" at {b['where']}" if b["where"] else "") for b in entry["graph_breaks"])
        entry["error"] = f"{error_text(error)}; graph breaks: {breaks or 'none found'}"
        return
    entry["first_call_seconds"] = time.perf_counter() - start
    entry["compiled"] = True
    bad = sorted(
        name
        for name, p in model.named_parameters()
        if name in eager_grads and (p.grad is None or not bool(torch.isfinite(p.grad).all()))
    )
    if not bool(torch.isfinite(loss)) or bad:
        entry["error"] = f"compiled train step: loss {loss.item():.4g}; missing or non-finite gradients: {bad[:5]}"
        return
    entry["step_ms"] = time_ms(lambda: step(compiled), run.device, warmup=1, rep=run.plan.reps.compile)
    entry["eager_step_ms"] = time_ms(lambda: step(model), run.device, warmup=1, rep=run.plan.reps.compile)
    model.eval()
    try:
        with torch.no_grad(), fastformer.use_backend("triton"), autocast(run.device, run.amp):
            start = time.perf_counter()
            got = logits_of(compiled(*inputs)).float()
            synchronize(run.device)
            entry["eval_first_call_seconds"] = time.perf_counter() - start
            expected = logits_of(model(*inputs)).float()
    finally:
        model.train()
    entry["max_abs_diff"] = (got - expected).abs().max().item()
    entry["tolerance"] = suite.ATOL["bf16" if run.amp == "bf16" else "fp32"] * (expected.abs().max().item() or 1.0)
    if not entry["max_abs_diff"] <= entry["tolerance"]:
        entry["error"] = (
            f"eval-mode logits differ from eager by {entry['max_abs_diff']:.3g} (tolerance {entry['tolerance']:.3g})"
        )
