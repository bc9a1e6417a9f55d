"""Device kernels per step of the tutorial's workload: `python -m tools.launches`.

The tutorial's train step is launch-bound (docs/launches.md): at batch 128 of short reviews a kernel runs
for microseconds, so the number of kernels per step sets the step's time. This counts them for
MovieClassification with the tutorial's Config, per train step (forward, loss, backward, AdamW
step, as `fastformer train` runs it) and per inference step, for three providers:

    reference_fp32   fastformer's modules on the reference backend (the tutorial's math), fp32
    reference_bf16   the same under torch.autocast(bfloat16)
    fastformer       the Triton backend under torch.autocast(bfloat16)

It prints the counts per layer type and per phase and writes tools/results/launches.json.

What counts as a kernel:
- an aten op that reaches the dispatcher below autograd, where a TorchDispatchMode sees it, except
  the ops that launch nothing on CUDA: views and in-place view ops (`OpOverload.is_view`, the
  `inplace_view` tag: view, t, transpose, expand, select, unbind, detach, ...), the ops in NO_KERNEL
  (allocations without a fill: empty, empty_like, empty_strided, new_empty, ...; `_unsafe_view`;
  profiler ranges), the `prim` namespace (metadata: prim.device, ...), and ops that touch no tensor
  (dtype arithmetic: promote_types). Host reads (`_local_scalar_dense`, what .item() runs;
  `Tensor.tolist`; on CUDA a copy to the CPU) are a copy and a host sync, not a kernel: they are
  counted apart, as syncs;
- an op with no kernel of its own counts, under its own name, the kernels of the ops it runs, at
  least one: a CompositeExplicitAutograd op without a CPU kernel (masked_fill is clone and
  masked_fill_: two; isinf, abs and eq: two; zeros, one fill), and a CompositeImplicitAutograd op,
  which reaches the counter undecomposed only below autograd, inside a torch.library op (`.to` casts
  or not, `reshape` copies or not). `_foreach_*` ops are composite on a CPU only (CUDA has fused
  kernels): one each;
- a Triton kernel launch (`JITFunction.run`, and the interpreter's `InterpretedFunction.run`, hooked
  while counting; what the interpreter itself runs inside a launch is not counted), under its jit
  function's name: attention's backward, one kernel launched in two passes, counts two
  `triton._attn_bwd_kernel`. fastformer's torch.library ops are no kernels themselves: the
  counter runs their Python implementation under itself, so it sees the aten ops and Triton
  launches inside them.
An aten op with a kernel counts one, which on CUDA is a lower bound for a few ops: a `_foreach_*`
op (AdamW) launches one kernel per chunk of at most 36 to 110 tensors, `embedding_dense_backward` a
sort and segment sums (about ten kernels), `cat` one per 128 inputs, a cuBLAS GEMM may add a
split-K reduction.

Layer types: an op belongs to the innermost function or class of the model's code (fastformer.model
and fastformer.plan; LAYERS) on the Python stack that launched it; an op of the backward, to the one
whose forward created the autograd node it runs in (anomaly mode records the forward's stack in
every node; its NaN checks stay off, so it adds no ops). The loss, the optimizer and the gradient
seed of `loss.backward()` are their own rows; "other" is whatever matches none (none does in the
tutorial's steps: a test checks).

Without a GPU the steps run on the CPU, the Triton kernels through Triton's interpreter
(TRITON_INTERPRET=1, set here before `fastformer.kernels` is imported). The CPU dispatches every op as CUDA
does, except where listed; the counter makes up for each:
- dropout: CUDA's `aten::dropout` is one `native_dropout`; a CPU's is bernoulli_, div_ and mul.
  While counting, F.dropout takes CUDA's branch (cuda_dropout).
- AdamW: `fastformer train`'s (fastformer.train.loop.adamw), the fused form, which keeps its step
  counts on the parameters' device and runs as CUDA does: per parameter group, one `_foreach_add_`
  on the counts and one `_fused_adamw_`.
- autocast: CUDA's fp32 list casts fp16/bf16 inputs of layer_norm, exp, log, pow, ... to fp32; a
  CPU's does not. The counter records any such op reached with a half-precision input under
  autocast (CUDA_FP32_AUTOCAST) as a mismatch; the tutorial's steps have none (a test checks).
- bf16: Triton's interpreter as shipped computes bf16 dots wrongly (the tests correct it,
  tests/interpreter_bf16.py), so fastformer counts under fp16 autocast on a CPU, which takes the
  same code paths.
- shapes: a batch of SHAPE (the interpreter is slow); the counts do not depend on batch or review
  length as long as both exceed 1 (a test counts two shapes). The decoder input is the tutorial's
  [BOS]. Widths are the tutorial's (d_hidn 256, 4 heads of 64, d_ff 1024, 6 layers).
On a CUDA machine the steps run on the GPU, with bf16 for fastformer (that path has not been run
yet). On a CPU a run takes about ten minutes, most of it fastformer's steps in the interpreter.
"""

import argparse
import collections
import contextlib
import inspect
import json
import os
import re
import sys

import torch

if not torch.cuda.is_available():
    # Triton reads this when a kernel is decorated: before `fastformer.kernels` is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.nn.functional as F
from torch._library.custom_ops import OPDEFS  # torch.library ops by qualified name
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import fastformer
import fastformer.model
import fastformer.packing
import fastformer.plan
from bench.common import environment
from fastformer import kernels
from fastformer.train.loop import adamw

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "launches.json")
SHAPE = {"batch": 2, "enc_len": 8}  # the decoder input is [BOS], length 1
PROVIDERS = {  # name: (backend, autocast dtype)
    "reference_fp32": ("reference", None),
    "reference_bf16": ("reference", torch.bfloat16),
    "fastformer": ("triton", torch.bfloat16),
}
STEPS = ("train", "infer")
PHASES = ("forward", "loss", "backward", "optimizer")

NO_KERNEL = {
    "empty",
    "empty_like",
    "empty_strided",
    "empty_permuted",
    "new_empty",
    "new_empty_strided",
    "resize_",
    "_unsafe_view",
    "_record_function_enter",
    "_record_function_enter_new",
    "_record_function_exit",
}
CUDA_FP32_AUTOCAST = {  # ops CUDA's autocast runs in fp32, casting half inputs, and a CPU's does not
    "native_layer_norm",
    "native_group_norm",
    "exp",
    "expm1",
    "log",
    "log10",
    "log1p",
    "log2",
    "pow",
    "reciprocal",
    "rsqrt",
    "acos",
    "asin",
    "cosh",
    "sinh",
    "tan",
    "erfinv",
    "softplus",
    "logsumexp",
    "renorm",
    "dist",
    "_pdist_forward",
    "_cdist_forward",
}
LAYERS = [  # (function or class of the model's code, layer type): an op takes the innermost on its stack
    (fastformer.model.check_token_ids, "token-id checks"),
    (fastformer.model.position_ids, "embedding + masks"),
    (fastformer.packing.lengths, "embedding + masks"),  # the real tokens' rows (fastformer.packing)
    (fastformer.packing.make_packing, "embedding + masks"),
    (fastformer.packing.make_static_packing, "embedding + masks"),
    (fastformer.packing.Packing, "embedding + masks"),
    (fastformer.model.Transformer.packed, "embedding + masks"),
    (fastformer.plan.LayerPlan.add_norm, "add + LayerNorm"),
    (fastformer.plan.gather_weights, "weight cat + cast"),
    (fastformer.plan.CastWeights, "weight cat + cast"),
    (fastformer.plan.Layout, "weight cat + cast"),
    (fastformer.plan.dropout_seeds, "dropout seeds"),
    (fastformer.model.ScaledDotProductAttention, "attention"),
    (fastformer.model.MultiHeadAttention, "attention"),
    (fastformer.model.PoswiseFeedForwardNet, "feed-forward"),
    (fastformer.model.EncoderLayer, "other"),
    (fastformer.model.DecoderLayer, "other"),
    (fastformer.model.Encoder, "embedding + masks"),
    (fastformer.model.Decoder, "embedding + masks"),
    (fastformer.model.Transformer, "other"),
    (fastformer.model.MovieClassification, "classifier head"),
]
LAYER_ORDER = (
    "token-id checks",
    "embedding + masks",
    "weight cat + cast",
    "dropout seeds",
    "attention",
    "feed-forward",
    "add + LayerNorm",
    "classifier head",
    "loss",
    "optimizer",
    "other",
)
_TRACEBACK_FRAME = re.compile(r'File "(.+)", line (\d+), in ')


def _spans():
    """{file: [(first line, last line, layer type)]} of the LAYERS, narrowest first, from their code
    objects (the source on disk may have changed since the import)."""
    spans = collections.defaultdict(list)
    for obj, layer in LAYERS:
        members = [obj] if inspect.isfunction(obj) else vars(obj).values()
        functions = [getattr(f, "__func__", f) for f in members]  # a staticmethod's function
        functions = [f for f in functions if inspect.isfunction(f)]
        lines = [line for f in functions for _, _, line in f.__code__.co_lines() if line is not None]
        lines += [f.__code__.co_firstlineno for f in functions]
        spans[os.path.abspath(functions[0].__code__.co_filename)].append((min(lines), max(lines), layer))
    for file_spans in spans.values():
        file_spans.sort(key=lambda span: span[1] - span[0])  # a method lies inside its class
    return spans


def _has_kernel(func, dispatch_key):
    return torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), dispatch_key)


def _built_of_ops(func, name):
    """Whether an aten op runs other ops on every device: a CompositeExplicitAutograd kernel and no
    CPU one. `_foreach_*` ops are such on a CPU only: CUDA has fused kernels for them."""
    if name.startswith("_foreach_"):
        return False
    return _has_kernel(func, "CompositeExplicitAutograd") and not _has_kernel(func, "CPU")


def _tensors(tree):
    return [t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


_dropout = F.dropout


def cuda_dropout(input, p=0.5, training=True, inplace=False):
    """F.dropout as CUDA's aten::dropout runs it: one native_dropout when it drops anything."""
    if training and 0.0 < p < 1.0 and input.numel() > 0 and not inplace:
        return torch.native_dropout(input, p, True)[0]
    return _dropout(input, p, training, inplace)


class KernelCounter(TorchDispatchMode):
    """Counts the device kernels of what runs under it (see the module docstring) by phase, layer
    type and op: `kernels[phase, layer, "aten.mm" or "triton._attn_fwd_kernel"]`, and the host
    syncs: `syncs[phase, layer]`. The caller sets `phase` (one of PHASES) and `autocast` (whether
    the forward runs under autocast). Use it through `counting()`, which hooks Triton's launches."""

    def __init__(self, device):
        super().__init__()
        self.device = torch.device(device)
        self.phase = "forward"
        self.autocast = False
        self.kernels = collections.Counter()
        self.syncs = collections.Counter()
        self.autocast_mismatches = collections.Counter()  # op -> calls CUDA's autocast would cast
        self.paused = False  # inside a Triton launch
        self._spans = _spans()

    def ops(self, phase):
        """{op: count} of one phase, over every layer type."""
        counts = collections.Counter()
        for (p, _, op), n in self.kernels.items():
            if p == phase:
                counts[op] += n
        return dict(counts)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.paused:
            return func(*args, **kwargs)
        if func._schema.name in OPDEFS:
            with self:  # a torch.library op: count what its implementation launches
                return OPDEFS[func._schema.name]._init_fn(*args, **kwargs)
        if _has_kernel(func, "CompositeImplicitAutograd"):
            with self:  # reached below autograd (inside a torch.library op): count what it runs
                return func.decompose(*args, **kwargs)
        name = func.overloadpacket.__name__
        if func.namespace == "prim" or func.is_view or torch.Tag.inplace_view in func.tags or name in NO_KERNEL:
            return func(*args, **kwargs)
        if not _built_of_ops(func, name):
            out = func(*args, **kwargs)
            self._record(name, _tensors((args, kwargs)), _tensors(out))
            return out
        # count the kernels of the ops it runs under its own name (masked_fill: clone and
        # masked_fill_, two), or one where it runs its work directly (copy_)
        kernels, syncs = self.kernels, sum(self.syncs.values())
        self.kernels = collections.Counter()
        mark = self._mark()
        try:
            with self:
                out = func._op_dk(torch._C.DispatchKey.CompositeExplicitAutograd, *args, **kwargs)
        finally:
            inner, self.kernels = sum(self.kernels.values()), kernels
        if inner or sum(self.syncs.values()) == syncs:
            self._record_composite(name, _tensors((args, kwargs)), _tensors(out), max(inner, 1), mark)
        return out

    def _mark(self):
        """Where a subclass's own records stand before an op built of ops runs (tools.work's)."""
        return None

    def _record_composite(self, name, inputs, outputs, kernels, mark):
        """An op built of ops, after them: recorded under its own name with their kernels."""
        self._record(name, inputs, outputs, kernels)

    def _record(self, name, inputs, outputs, kernels=1):
        if not inputs + outputs or self._on_host(inputs + outputs):
            return
        if name == "_local_scalar_dense" or (
            name in ("_to_copy", "copy_") and any(t.is_cuda for t in inputs) and not all(t.is_cuda for t in outputs)
        ):
            self.syncs[self.phase, self.layer()] += 1
            return
        if (
            self.autocast
            and name in CUDA_FP32_AUTOCAST
            and any(t.dtype in (torch.float16, torch.bfloat16) for t in inputs)
        ):
            self.autocast_mismatches[f"aten.{name}"] += 1
        self.kernels[self.phase, self.layer(), f"aten.{name}"] += kernels

    def _on_host(self, tensors):
        """Whether an op runs on the host when the step runs on CUDA: there, one with no CUDA tensor;
        on a CPU, none (the fused AdamW's step counts are on the parameters' device, as on CUDA)."""
        return self.device.type == "cuda" and not any(t.is_cuda for t in tensors)

    def record_launch(self, kernel, args, kwargs):
        """A Triton launch of `kernel` (a JITFunction, or the interpreter's InterpretedFunction) with
        its arguments; called paused, so what a subclass computes of them is not counted."""
        self.kernels[self.phase, self.layer(), f"triton.{kernel.fn.__name__}"] += 1

    def record_tolist(self, tensor):
        """Tensor.tolist reads CPU memory without dispatching an op (on CUDA its copy dispatches)."""
        if tensor.device.type == "cpu" and not self._on_host([tensor]):
            self.syncs[self.phase, self.layer()] += 1

    def layer(self):
        """The layer type of the op being run (see the module docstring)."""
        if self.phase in ("loss", "optimizer"):
            return self.phase
        if self.phase == "forward":
            frames, frame = [], sys._getframe(1)
            while frame is not None:
                frames.append((frame.f_code.co_filename, frame.f_lineno))
                frame = frame.f_back
            return self._innermost(frames) or "other"
        node = torch._C._current_autograd_node()
        if node is None:  # the gradient seed of loss.backward()
            return "loss"
        matches = map(_TRACEBACK_FRAME.search, node.metadata.get("traceback_", []))
        frames = [(match.group(1), int(match.group(2))) for match in matches if match]
        layer = self._innermost(reversed(frames))
        if layer is None and any(os.path.abspath(file) == os.path.abspath(__file__) for file, _ in frames):
            return "loss"  # nodes the loss created
        return layer or "other"

    def _innermost(self, frames):
        """The layer type of the first of `frames` (file, line), innermost first, inside a LAYERS span."""
        for file, line in frames:
            for first, last, layer in self._spans.get(os.path.abspath(file), ()):
                if first <= line <= last:
                    return layer
        return None


def _hooked_run(run, counter):
    def hooked(self, *args, grid, warmup, **kwargs):
        if warmup or counter.paused:
            return run(self, *args, grid=grid, warmup=warmup, **kwargs)
        counter.paused = True  # the interpreter's copies of the arguments are no kernels
        try:
            counter.record_launch(self, args, kwargs)
            return run(self, *args, grid=grid, warmup=warmup, **kwargs)
        finally:
            counter.paused = False

    return hooked


def _no_hook(*args, **kwargs):
    """A launch-enter hook that does nothing: with one in place every launch takes Triton's own
    path (kernels._runtime's kept launchers step aside for a profiler's hook), so none is missed."""


def _hooked_tolist(tolist, counter):
    def hooked(self):
        counter.record_tolist(self)
        return tolist(self)

    return hooked


@contextlib.contextmanager
def counting(device, counter=None):
    """A KernelCounter (or `counter`, one of its subclasses') in force, with Triton's launches and
    Tensor.tolist hooked, anomaly mode on (forward stacks in autograd nodes, no NaN checks) and
    F.dropout taking CUDA's branch."""
    import triton.runtime.interpreter
    import triton.runtime.jit
    from triton import knobs

    counter = KernelCounter(device) if counter is None else counter
    jit, interpreted = triton.runtime.jit.JITFunction, triton.runtime.interpreter.InterpretedFunction
    patches = [
        (jit, "run", _hooked_run(jit.run, counter)),
        (interpreted, "run", _hooked_run(interpreted.run, counter)),
        (torch.Tensor, "tolist", _hooked_tolist(torch.Tensor.tolist, counter)),
        (F, "dropout", cuda_dropout),
    ]
    saved = [(owner, name, owner.__dict__.get(name)) for owner, name, _ in patches]
    for owner, name, value in patches:
        setattr(owner, name, value)
    knobs.runtime.launch_enter_hook.add(_no_hook)
    try:
        with torch.autograd.set_detect_anomaly(True, check_nan=False), counter:
            yield counter
    finally:
        knobs.runtime.launch_enter_hook.remove(_no_hook)
        for owner, name, value in saved:
            if value is None:
                delattr(owner, name)  # torch.Tensor inherits tolist
            else:
                setattr(owner, name, value)


# ----------------------------------------------------------------------------------------------
# the tutorial's steps
# ----------------------------------------------------------------------------------------------
def review_batch(config, batch, enc_len, device, seed=0):
    """Encoder ids of lengths enc_len // 2 .. enc_len padded to enc_len, the first review the
    shortest (so that every batch of two tokens or more has padding, which the model leaves out:
    fastformer.packing), decoder [BOS], labels."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    lengths = torch.randint(enc_len // 2, enc_len + 1, (batch,), generator=g)
    lengths[0] = max(1, enc_len // 2)
    enc = torch.randint(7, config.n_enc_vocab, (batch, enc_len), generator=g)
    enc = enc.masked_fill(torch.arange(enc_len) >= lengths[:, None], config.i_pad)
    dec = torch.full((batch, 1), 2)
    labels = torch.randint(0, config.n_output, (batch,), generator=g)
    return enc.to(device), dec.to(device), labels.to(device)


def amp_dtype(provider):
    """The provider's autocast dtype here (fp16 for bf16 under Triton's interpreter), or None."""
    backend, dtype = PROVIDERS[provider]
    if dtype is torch.bfloat16 and backend == "triton" and kernels.INTERPRET:
        return torch.float16
    return dtype


def _loss(logits, labels):
    return F.cross_entropy(logits.float(), labels)


def _run_step(step, model, batch, optimizer, counter, dtype):
    """One train step (as fastformer.train.loop.train_step) or inference step, its phases marked."""
    enc, dec, labels = batch
    autocast = torch.autocast(counter.device.type, dtype=dtype, enabled=dtype is not None)
    counter.phase, counter.autocast = "forward", dtype is not None
    if step == "infer":
        with torch.no_grad(), autocast:
            model(enc, dec)
        return
    optimizer.zero_grad(set_to_none=True)
    with autocast:
        logits = model(enc, dec)[0]
    counter.phase, counter.autocast = "loss", False
    loss = _loss(logits, labels)
    counter.phase = "backward"
    loss.backward()
    counter.phase = "optimizer"
    optimizer.step()


def count_step(provider, step, config=None, batch=SHAPE["batch"], enc_len=SHAPE["enc_len"], device=None):
    """The KernelCounter of one step of `provider` ("train" or "infer") after a warm-up step (AdamW
    creates its state, the autotuners pick their configs)."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    config = config or fastformer.Config.tutorial()
    torch.manual_seed(0)
    model = fastformer.MovieClassification(config).to(device).train(step == "train")
    optimizer = adamw(model, 5e-4, 0.01, fused=True) if step == "train" else None
    data = review_batch(config, batch, enc_len, device)
    with fastformer.use_backend(PROVIDERS[provider][0]):
        for _ in range(2):
            with counting(device) as counter:
                _run_step(step, model, data, optimizer, counter, amp_dtype(provider))
    return counter


def summary(counter):
    """A counter's counts, JSON-ready: totals, by phase, by layer type, and by op within each layer
    type and phase (`ops[layer][phase][op]`)."""
    by_phase, by_layer = collections.Counter(), collections.Counter()
    ops = collections.defaultdict(lambda: collections.defaultdict(dict))
    for (phase, layer, op), n in sorted(counter.kernels.items(), key=lambda item: (-item[1], item[0])):
        by_phase[phase] += n
        by_layer[layer] += n
        ops[layer][phase][op] = n
    return {
        "kernels": sum(by_phase.values()),
        "triton": sum(n for (_, _, op), n in counter.kernels.items() if op.startswith("triton.")),
        "syncs": sum(counter.syncs.values()),
        "by_phase": {phase: by_phase[phase] for phase in PHASES if by_phase[phase]},
        "by_layer": {layer: by_layer[layer] for layer in LAYER_ORDER if by_layer[layer]},
        "ops": {
            layer: {phase: ops[layer][phase] for phase in PHASES if phase in ops[layer]}
            for layer in LAYER_ORDER
            if layer in ops
        },
        "autocast_mismatches": dict(counter.autocast_mismatches),
    }


def measure(providers=tuple(PROVIDERS), batch=SHAPE["batch"], enc_len=SHAPE["enc_len"]):
    """Count both steps of every provider; returns the report that launches.json holds."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = fastformer.Config.tutorial()
    report = {
        "env": environment(device),
        "counted_on": "cuda" if device.type == "cuda" else "cpu, Triton kernels through the interpreter",
        "config": dict(config),
        "shape": {"batch": batch, "enc_len": enc_len, "dec_len": 1},
        "providers": {},
    }
    for provider in providers:
        dtype = amp_dtype(provider)
        entry = {"backend": PROVIDERS[provider][0], "autocast": None if dtype is None else str(dtype)[len("torch.") :]}
        for step in STEPS:
            entry[step] = summary(count_step(provider, step, config, batch, enc_len, device))
        report["providers"][provider] = entry
    return report


def _markdown(rows):
    """Rows of cells as a markdown table, the first row the header, the other columns right-aligned."""
    lines = [rows[0], ["---"] + ["---:"] * (len(rows[0]) - 1), *rows[1:]]
    return "\n".join("| " + " | ".join(str(cell) for cell in line) + " |" for line in lines)


def tables(report):
    """Markdown: the kernels per layer type of the train and inference steps, then per phase of the
    train step."""
    providers = report["providers"]
    columns = [(step, provider) for step in STEPS for provider in providers]
    rows = [["layer type", *[f"{step} {provider}" for step, provider in columns]]]
    for layer in LAYER_ORDER:
        if any(layer in providers[p][step]["by_layer"] for step, p in columns):
            rows.append([layer, *[providers[p][step]["by_layer"].get(layer, 0) for step, p in columns]])
    for label, key in (("**kernels**", "kernels"), ("of which Triton", "triton"), ("host syncs", "syncs")):
        rows.append([label, *[providers[p][step][key] for step, p in columns]])
    if "reference_fp32" in providers:
        base = {step: providers["reference_fp32"][step]["kernels"] for step in STEPS}
        ratios = [f"{providers[p][step]['kernels'] / base[step]:.2f}x" for step, p in columns]
        rows.append(["vs reference_fp32", *ratios])
    phases = [["train step phase", *providers]]
    phases += [[phase, *[providers[p]["train"]["by_phase"].get(phase, 0) for p in providers]] for phase in PHASES]
    return _markdown(rows) + "\n\n" + _markdown(phases)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m tools.launches", description=__doc__.split("\n\n")[0])
    parser.add_argument("--providers", nargs="+", choices=list(PROVIDERS), default=list(PROVIDERS))
    parser.add_argument("--batch", type=int, default=SHAPE["batch"])
    parser.add_argument("--enc-len", type=int, default=SHAPE["enc_len"])
    parser.add_argument("--out", default=RESULTS, help="the JSON file to write (default tools/results/launches.json)")
    args = parser.parse_args(argv)
    if min(args.batch, args.enc_len) < 2:
        parser.error("--batch and --enc-len must be at least 2 (a size of 1 changes which reshapes copy)")
    report = measure(args.providers, args.batch, args.enc_len)
    print(tables(report))
    for provider, entry in report["providers"].items():
        for step in STEPS:
            if entry[step]["autocast_mismatches"]:
                print(
                    f"warning: CUDA's autocast would cast inputs of {entry[step]['autocast_mismatches']} in "
                    f"{provider}'s {step} step; the count leaves those casts out",
                    file=sys.stderr,
                )
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
        f.write("\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
