"""Where a train step's memory goes: `python -m tools.memory`.

    python -m tools.memory                         # the tutorial's step at batch 128: tools/results/memory.json
    python -m tools.memory --quick --json /tmp/m.json   # a small config and batch (the CI test)
    python -m tools.memory --device cuda           # on a GPU: each phase's peak too

One train step (forward, loss, backward, AdamW) of MovieClassification with the tutorial's config
on the GPU check's model batch (128 reviews of 8 to 128 tokens, padded to the longest), on two
paths: fastformer (the Triton kernels under bf16 autocast, stepped by `fastformer train`'s fused
AdamW) and the fp32 reference as the tutorial runs it (torch's AdamW). Per path, in MiB:

  weights     the parameters
  gradients   their gradients after the backward
  optimizer   AdamW's state after its step (exp_avg and exp_avg_sq of every parameter, step counts)
  saved       what autograd keeps from the forward for the backward, counted once per storage by
              torch.autograd.graph.saved_tensors_hooks, a row per place that saved it (the innermost
              frame of fastformer's, the kernels' or torch.nn.functional's code) and dtype; copies of
              the weights (autocast's casts) on rows of their own, the weights themselves not (they
              are counted once, above)
  at backward the weights, the optimizer's state (held from the step before, in a run) and what
              the forward saved: what the step holds when its backward starts, before the gradients
              grow and the saved tensors go

On a CPU fastformer's kernels run under tools.sm90's dry-run driver, which launches nothing (what
a step allocates does not depend on the values), and the ops take the paths they take on a GPU,
their plans included (a dispatch mode, such as sm90.no_matmuls, would send them down their
ordinary paths, which keep other tensors): the matrix products run, in bf16 a few seconds a step.
With --device cuda the step also runs for real, after one step that makes the optimizer's state,
and each phase's peak is measured with torch.cuda.max_memory_allocated, above what was allocated
before the step: the forward (with the loss), the backward, the optimizer's step.

The kernels must be imported without TRITON_INTERPRET: run this in a process that has not set it.
"""

import argparse
import collections
import contextlib
import platform
import sys
from pathlib import Path

from tools import refuses_interpreter, write_report

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "tools" / "results" / "memory.json"
BATCH = 128  # the GPU check's model batch (tools.gpu_check.plan)
QUICK = dict(
    config=dict(n_layer=1, d_hidn=64, n_head=2, d_head=32, d_ff=128, n_enc_vocab=500, n_dec_vocab=500), batch=8
)
MIB = 2**20
# where a saved tensor is attributed: the innermost frame of these (a repository path, or torch's functional.py)
SITES = (str(REPO / "kernels"), str(REPO / "fastformer"), "torch/nn/functional.py")


def _site():
    """The innermost frame of SITES' code in the stack: "path:qualname" (the path from the repository
    or from torch), or "torch (autograd)" where none is there."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if any(site in path for site in SITES):
            name = getattr(frame.f_code, "co_qualname", frame.f_code.co_name)
            where = path.split(str(REPO) + "/")[-1] if str(REPO) in path else "torch/" + path.split("torch/")[-1]
            return f"{where}:{name}"
        frame = frame.f_back
    return "torch (autograd)"


class SavedTensors:
    """saved_tensors_hooks that record each storage autograd keeps once: its bytes, where it was
    saved and its dtype, and whether it is a weight's copy (a parameter's shape in another dtype).
    The parameters' own storages are left out."""

    def __init__(self, model):
        self.parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.shapes = {tuple(p.shape) for p in model.parameters() if p.dim() >= 2}
        self.rows = collections.Counter()  # (site, dtype, weight copy) -> bytes
        self.tensors = collections.Counter()
        self.seen = set()

    def pack(self, tensor):
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key and key not in self.seen and key not in self.parameters:
            self.seen.add(key)
            shape = tuple(tensor.shape)
            copy = shape in self.shapes or shape[::-1] in self.shapes
            row = (_site(), str(tensor.dtype).replace("torch.", ""), copy)
            self.rows[row] += storage.nbytes()
            self.tensors[row] += 1
        return tensor

    @contextlib.contextmanager
    def counting(self):
        import torch

        with torch.autograd.graph.saved_tensors_hooks(self.pack, lambda tensor: tensor):
            yield


def _nbytes(tensors):
    """The bytes of the storages under `tensors`, each storage once (a gradient can be a view of a
    buffer that several gradients share)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def _path(name):
    """(backend, autocast, fused AdamW) of a path."""
    return {"fastformer": ("triton", True, True), "reference_fp32": ("reference", False, False)}[name]


def _model_and_batch(config_overrides, batch, device):
    import torch

    import fastformer
    from bench.cases import review_batch

    config = fastformer.Config.tutorial(**config_overrides)
    torch.manual_seed(0)
    model = fastformer.MovieClassification(config).to(device).train()
    return model, review_batch(config, batch, False, device)


def _step(model, data, optimizer, autocast, phase=lambda name: contextlib.nullcontext()):
    import torch
    import torch.nn.functional as F

    enc, dec, labels = data
    optimizer.zero_grad(set_to_none=True)
    with phase("forward"), torch.autocast(enc.device.type, torch.bfloat16, enabled=autocast):
        loss = F.cross_entropy(model(enc, dec)[0].float(), labels)
    with phase("backward"):
        loss.backward()
    with phase("optimizer"):
        optimizer.step()


def _optimizer(model, fused):
    import torch

    from fastformer.train.loop import adamw

    return adamw(model, 5e-4, 0.01, fused=fused) if fused else torch.optim.AdamW(model.parameters(), lr=5e-4)


def count(name, config_overrides, batch):
    """The CPU count of one path: its rows and totals in MiB (see the module's docstring)."""
    import fastformer
    from tools import sm90

    backend, autocast, _ = _path(name)
    model, data = _model_and_batch(config_overrides, batch, "cpu")
    saved = SavedTensors(model)
    optimizer = _optimizer(model, fused=False)  # the fused form's state is the same bytes; it steps on CUDA
    with sm90.dry_run(time_configs=False), fastformer.use_backend(backend), saved.counting():
        _step(model, data, optimizer, autocast)
    state = [v for s in optimizer.state.values() for v in s.values() if hasattr(v, "untyped_storage")]
    rows = [
        {
            "site": site,
            "dtype": dtype,
            "weight_copy": copy,
            "tensors": saved.tensors[(site, dtype, copy)],
            "mb": round(nbytes / MIB, 3),
        }
        for (site, dtype, copy), nbytes in saved.rows.most_common()
    ]
    totals = {
        "weights_mb": _nbytes(model.parameters()) / MIB,
        "gradients_mb": _nbytes(p.grad for p in model.parameters() if p.grad is not None) / MIB,
        "optimizer_mb": _nbytes(state) / MIB,
        "saved_mb": sum(saved.rows.values()) / MIB,
        "saved_weight_copies_mb": sum(n for (_, _, copy), n in saved.rows.items() if copy) / MIB,
    }
    totals["at_backward_mb"] = totals["weights_mb"] + totals["optimizer_mb"] + totals["saved_mb"]
    return {**{k: round(v, 3) for k, v in totals.items()}, "saved": rows}


def phases(name, config_overrides, batch, device):
    """On CUDA: the peak MiB allocated during each phase of a step (after one step that made the
    optimizer's state), above what was allocated before the step; and what that was."""
    import torch

    import fastformer

    backend, autocast, fused = _path(name)
    model, data = _model_and_batch(config_overrides, batch, device)
    optimizer = _optimizer(model, fused)
    with fastformer.use_backend(backend):
        _step(model, data, optimizer, autocast)
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        peaks = {}

        @contextlib.contextmanager
        def phase(label):
            torch.cuda.reset_peak_memory_stats(device)
            yield
            torch.cuda.synchronize(device)
            peaks[f"{label}_peak_mb"] = round((torch.cuda.max_memory_allocated(device) - base) / MIB, 3)

        _step(model, data, optimizer, autocast, phase)
    return {"before_step_mb": round(base / MIB, 3), **peaks}


def measure(quick=False, device="cpu"):
    import torch
    import triton

    overrides, batch = (QUICK["config"], QUICK["batch"]) if quick else ({}, BATCH)
    paths = {name: count(name, overrides, batch) for name in ("fastformer", "reference_fp32")}
    if device != "cpu":
        for name in paths:
            paths[name]["phases"] = phases(name, overrides, batch, torch.device(device))
    ours, theirs = paths["fastformer"], paths["reference_fp32"]
    return {
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "device": device,
        "config": overrides or "tutorial",
        "batch": batch,
        "unit": "MiB (2**20 bytes)",
        "paths": paths,
        "at_backward_ratio": round(ours["at_backward_mb"] / theirs["at_backward_mb"], 3),
    }


def table(report):
    paths = report["paths"]
    lines = [
        f"memory of a train step, batch {report['batch']}, config {report['config']} (MiB)",
        "",
        "| | " + " | ".join(paths) + " |",
        "|---|" + "---|" * len(paths),
    ]
    for key in ("weights_mb", "gradients_mb", "optimizer_mb", "saved_mb", "saved_weight_copies_mb", "at_backward_mb"):
        lines.append(f"| {key[:-3]} | " + " | ".join(f"{p[key]:,.1f}" for p in paths.values()) + " |")
    if "phases" in paths["fastformer"]:
        for key in paths["fastformer"]["phases"]:
            lines.append(f"| {key[:-3]} | " + " | ".join(f"{p['phases'][key]:,.1f}" for p in paths.values()) + " |")
    lines += ["", f"at backward, fastformer over the reference: {report['at_backward_ratio']:.2f}x"]
    for name, path in paths.items():
        lines += ["", f"{name}: saved for the backward", "", "| where | dtype | weight copy | tensors | MiB |"]
        lines.append("|---|---|---|---|---|")
        lines += [
            f"| {r['site']} | {r['dtype']} | {'yes' if r['weight_copy'] else ''} | {r['tensors']} | {r['mb']:,.1f} |"
            for r in path["saved"]
        ]
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small config and batch (the CI test)")
    parser.add_argument("--device", default="cpu", help="cpu (counts), or cuda: each phase's peak too")
    parser.add_argument("--json", type=Path, default=RESULTS, help=f"where the report goes (default {RESULTS})")
    args = parser.parse_args(argv)
    if refuses_interpreter("memory", "the dry-run driver compiles the kernels for a GPU"):
        return 2
    report = measure(args.quick, args.device)
    write_report(args.json, report, table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
