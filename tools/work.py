"""The work a step of the tutorial's model gives a GPU, counted on a CPU: `python -m tools.work`.

    python -m tools.work                      # the bench batch, the demo set, Rotten Tomatoes: work.json
    python -m tools.work --quick              # a small config on the bench batch (CI)

For MovieClassification with the tutorial's config, a train step (forward, loss, backward, the
optimizer) and an inference step, fastformer's (the Triton backend under bf16 autocast, as the
default CUDA job runs) and the fp32 reference's, on three workloads: the bench batch (128 reviews
of 8 to 128 pieces padded to the longest, bench.cases.review_batch), and the default
job's batches of the demo set and of Rotten Tomatoes (length buckets of 128 reviews padded to a
multiple of 16, fastformer.train.job.loaders; one step per distinct batch shape, weighted by how
many batches of the epoch have it: an eager step, which computes on the real tokens alone
(fastformer.packing), has the work of its shape's first batch, the real tokens' FLOPs too).
The train step twice: eager, on the real tokens, and replayed, on the padded batch, as a CUDA
graph captures it (a capture cannot read the count of real tokens); inference as an eager step.

Every kernel the step launches on CUDA, as tools.launches counts them (a TorchDispatchMode sees
each aten op, Triton's launches are hooked), with:
- FLOPs of its matrix products (a multiply-add is 2): aten's mm, addmm, bmm, baddbmm and
  convolutions from their shapes; Triton's GEMMs 2 M N K; attention's passes 2 D per (query, key)
  pair they compute, times their products (forward 2, dQ 3, dK/dV 4, the one-pass backward's
  dK/dV/dQ 5 with its delta and dQ launches none; the probabilities 1), the
  keys of a row being those of the key blocks the kernel reads (up to the batch row's last real key
  rounded up to the block, or to the diagonal under a causal mask). Elementwise and reduction
  arithmetic is not counted: at a Hopper's 206 FLOP per byte of bandwidth it hides under the bytes.
- HBM bytes, first touch: every tensor it reads and every tensor it writes, once each (its
  distinct elements: a broadcast dimension counts once). A lower bound: re-reads from L2 are free,
  spills and re-reads past L2 are not counted.
- a roofline time at the GPU's peaks (PEAKS: H200 989 TFLOP/s dense bf16, 67 fp32 without TF32,
  4.8 TB/s), and its bound: the roofline or the floor of a launch (LAUNCH_FLOOR_US), whichever is
  longer. The sum of the bounds is a lower bound of the step's device time that a GPU run can be
  held against; the kernels under the floor are counted apart.
- the optimizer twice: the eager job's fused AdamW (fastformer.train.loop.adamw) and the replayed
  step's, the same made capturable (fastformer.train.graphs.make_capturable), its _foreach and
  fused ops counted per CUDA launch (multi_tensor_apply's chunks: foreach_launches) on fake CUDA
  tensors.

And the FFN op alone (FFN_OP: M 32768 rows, d 256, d_ff 1024, bf16, the shape of the kernel
review's roofline), its forward and backward with every gradient, kernel by kernel: the cut of
the FFN's backward is counted there (docs/launches.md).

How: under tools.sm90's dry-run sm_90a driver, so the Triton kernels compile for Hopper and launch
nothing, with PyTorch's matrix products uncomputed (tools.sm90.no_matmuls): every shape, stride and
mask is the step's own, no value but the token ids and masks is. Written to tools/results/work.json
with a table per workload (docs/launches.md).
"""

import argparse
import collections
import itertools
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from tools import refuses_interpreter, write_report

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "tools" / "results" / "work.json"
# dense peaks of the GPU the bound is reckoned at (NVIDIA's H200 SXM datasheet): FLOP/s per dtype of
# the product's inputs, bytes/s of HBM
PEAKS = {"gpu": "H200", "flops": {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12}, "bytes": 4.8e12}
LAUNCH_FLOOR_US = 3.0  # a kernel's shortest time between its neighbours', replayed from a CUDA graph
BATCH = 128  # the bench batch, and the default job's (fastformer.train.run.DEFAULT_BATCH_SIZE)
QUICK_CONFIG = {"n_layer": 1, "d_hidn": 64, "n_head": 2, "d_head": 32, "d_ff": 128, "n_enc_seq": 64, "n_dec_seq": 8}
PROVIDERS = ("fastformer", "reference_fp32")
WORKLOADS = ("bench", "demo", "rotten-tomatoes")
KINDS = ("attention", "FFN GEMM (Triton)", "add + LayerNorm", "GEMM (cuBLAS)", "optimizer", "small ops")
# attention passes' products; _attn_bwd_kernel's by pass (DQ_PASS: 3, else 4); the one-pass backward's
# delta and dQ launches have none
PRODUCTS = {
    "_attn_fwd_kernel": 2, "_attn_probs_kernel": 1, "_attn_bwd_one_pass_kernel": 5,
    "_attn_bwd_delta_kernel": 0, "_attn_bwd_dq_convert_kernel": 0,
}  # fmt: skip
MATMULS = {"mm", "addmm", "bmm", "baddbmm", "convolution", "convolution_backward"}
# CUDA's multi_tensor_apply (aten/src/ATen/native/cuda/MultiTensorApply.cuh): tensors and blocks a
# launch holds by the number of tensor lists, and the elements a block takes
FOREACH_MAX_TENSORS = {1: 110, 2: 64, 3: 48, 4: 36, 5: 30}
FOREACH_MAX_BLOCKS = 320
FOREACH_CHUNK = 65536


@dataclass
class Kernel:
    """One kernel of a step: its phase, layer type (tools.launches' attribution), name, launches,
    matrix-product FLOPs, the dtype of those products' inputs, and first-touch HBM bytes."""

    phase: str
    layer: str
    name: str
    launches: int
    flops: float
    dtype: str
    bytes: float

    def kind(self):
        if self.phase == "optimizer":
            return "optimizer"
        if self.name.startswith("triton._attn"):
            return "attention"
        if self.name.startswith(("triton._linear_gelu", "triton._activation", "triton._ffn")):
            return "FFN GEMM (Triton)"
        if self.name.startswith("triton._add_ln"):
            return "add + LayerNorm"
        if self.name.removeprefix("aten.") in MATMULS:
            return "GEMM (cuBLAS)"
        return "small ops"

    def roofline_us(self, peaks=PEAKS):
        """The longer of its products' time at the peak of their dtype and its bytes' at HBM's, per launch."""
        flops = self.flops / peaks["flops"].get(self.dtype, peaks["flops"]["fp32"])
        return max(flops, self.bytes / peaks["bytes"]) * 1e6 / max(self.launches, 1)

    def bound_us(self, peaks=PEAKS, floor=LAUNCH_FLOOR_US):
        """Its lower bound: each launch the longer of its roofline and the floor."""
        return max(self.roofline_us(peaks), floor) * self.launches


def _dtype(t):
    return {"torch.bfloat16": "bf16", "torch.float16": "fp16"}.get(str(t.dtype), "fp32")


def distinct_bytes(t):
    """The bytes of t's distinct elements: a dimension of stride 0 (broadcast) counts once."""
    elements = math.prod(n for n, s in zip(t.shape, t.stride()) if s != 0) if t.dim() else 1
    return elements * t.element_size() if t.numel() else 0


def matmul_flops(name, inputs, outputs):
    """FLOPs of an aten matrix product from its tensors (a multiply-add is 2); 0 for any other op."""
    if name in ("mm", "bmm"):
        a, b = inputs[:2]
        return 2 * a.numel() * b.shape[-1]
    if name in ("addmm", "baddbmm"):
        a, b = inputs[1:3]
        return 2 * a.numel() * b.shape[-1]
    if name == "convolution":  # (N, C_in, L) * (C_out, C_in / groups, k) -> (N, C_out, L_out)
        weight, out = inputs[1], outputs[0]
        return 2 * out.numel() * weight[0].numel()
    if name == "convolution_backward":  # the input's and the weight's gradients: twice the forward
        grad, weight = inputs[0], inputs[2]
        return 4 * grad.numel() * weight[0].numel()
    return 0


def attention_flops(name, args, kwargs):
    """FLOPs of an attention pass (see the module docstring) from its launch's arguments by name."""
    named = {**args, **kwargs}
    products = PRODUCTS.get(name)
    if products is None:
        products = 3 if named.get("DQ_PASS") else 4
    if products == 0:
        return 0
    import torch

    q, pad = named["Q"], named.get("PAD")
    block = named.get("BLOCK_N", 1)
    if named.get("VARLEN"):  # packed sequences (kernels.attention_varlen): each its own lengths
        H, D = q.shape[1:]
        cu_q, cu_k = (named[name].cpu().tolist() for name in ("CU_Q", "CU_K"))
        lengths = [(q1 - q0, k1 - k0) for (q0, q1), (k0, k1) in zip(itertools.pairwise(cu_q), itertools.pairwise(cu_k))]
        # (Lq, Lk, the keys of the blocks read): a sequence's key blocks end at its last key
        shapes = [(lq, lk, -(-lk // block) * block) for lq, lk in lengths]
    else:
        B, H, Lq, D = q.shape
        Lk = named["K"].shape[2]
        if pad is not None and named.get("HAS_PAD"):  # key blocks past a row's last real key are skipped
            real = ~pad.bool().cpu()  # (B, Lk), True = a real key
            last = (real * torch.arange(1, Lk + 1)).amax(dim=1).tolist()
            keys = [min(Lk, -(-n // block) * block) for n in last]
        else:
            keys = [Lk] * B
        shapes = [(Lq, Lk, k) for k in keys]
    pairs = 0
    for Lq, Lk, k in shapes:
        if named.get("IS_CAUSAL"):  # a query sees the keys up to its diagonal (bottom-right aligned)
            pairs += sum(min(k, max(0, i + 1 + Lk - Lq)) for i in range(Lq))
        else:
            pairs += Lq * k
    return 2 * D * H * pairs * products


def foreach_launches(lists):
    """CUDA launches of a _foreach op over `lists` (its tensor lists, the first the one it walks), as
    multi_tensor_apply packs them: a launch holds at most FOREACH_MAX_TENSORS[depth] tensors and
    FOREACH_MAX_BLOCKS chunks of FOREACH_CHUNK elements; a tensor cut by a full launch goes on in
    the next."""
    max_tensors = FOREACH_MAX_TENSORS[max(1, min(len(lists), 5))]
    sizes = [t.numel() for t in lists[0] if t.numel()]
    launches = tensors = blocks = 0
    for i, numel in enumerate(sizes):
        tensors += 1
        chunks = -(-numel // FOREACH_CHUNK)
        for chunk in range(chunks):
            blocks += 1
            last_chunk = chunk == chunks - 1
            full = (tensors == max_tensors and last_chunk) or blocks == FOREACH_MAX_BLOCKS
            if full or (last_chunk and i == len(sizes) - 1):
                launches += 1
                blocks = 0
                tensors = 0 if last_chunk else 1
    return launches


def _work_counter(device):
    """tools.launches.KernelCounter that also keeps each kernel's FLOPs and bytes (Kernel records)."""
    from torch.utils import _pytree as pytree

    from tools.launches import KernelCounter

    class WorkCounter(KernelCounter):
        def __init__(self):
            super().__init__(device)
            self.records = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "prim":  # metadata (prim.device, which a fake CUDA tensor's step asks)
                return func(*args, **(kwargs or {}))
            name = func.overloadpacket.__name__
            if name.startswith(("_foreach_", "_fused_adam")) and not self.paused:  # a launch per chunk
                kwargs = kwargs or {}
                lists = [a for a in pytree.tree_leaves((args, kwargs), is_leaf=_is_list) if _is_list(a)]
                # the capturable step's overload, its lr a tensor, has no fake kernel (torch 2.11 to 2.13):
                # in place on its lists and returning nothing, it needs none to be counted
                out = None if func._overloadname == "tensor_lr" else func(*args, **kwargs)
                outputs = [t for t in pytree.tree_leaves(out) if hasattr(t, "dtype")]
                # the fused AdamW walks params, grads and both moments together: depth 4 (its step counts apart)
                launches = foreach_launches(lists[:4] if name.startswith("_fused") else lists) if lists else 1
                layer = self.layer()
                self.kernels[self.phase, layer, f"aten.{name}"] += launches
                touched = _foreach_bytes(name, lists, outputs)
                self.records.append(Kernel(self.phase, layer, f"aten.{name}", launches, 0.0, "fp32", touched))
                return out
            return super().__torch_dispatch__(func, types, args, kwargs)

        def _record(self, name, inputs, outputs, kernels=1):
            before = sum(self.kernels.values())
            super()._record(name, inputs, outputs, kernels)
            if sum(self.kernels.values()) == before:  # a host read or a host op: no kernel
                return
            flops = matmul_flops(name, inputs, outputs)
            dtype = _dtype(inputs[0]) if inputs else "fp32"
            touched = sum(distinct_bytes(t) for t in inputs + outputs)
            self.records.append(Kernel(self.phase, self.layer(), f"aten.{name}", kernels, flops, dtype, touched))

        def _mark(self):
            return len(self.records)

        def _record_composite(self, name, inputs, outputs, kernels, mark):
            """An op built of ops (masked_fill: a clone and a masked_fill_): one record under its
            name, with the kernels, FLOPs and bytes of the ops it ran in place of theirs."""
            inner = self.records[mark:]
            del self.records[mark:]
            self._record(name, inputs, outputs, kernels)
            if inner and len(self.records) > mark:
                record = self.records[-1]
                record.flops = sum(k.flops for k in inner)
                record.bytes = sum(k.bytes for k in inner)

        def record_launch(self, kernel, args, kwargs):
            super().record_launch(kernel, args, kwargs)
            name = kernel.fn.__name__
            named = dict(zip(kernel.arg_names, args))
            tensors = [v for v in {**named, **kwargs}.values() if hasattr(v, "data_ptr")]
            attention = name.startswith("_attn_")
            flops = attention_flops(name, named, kwargs) if attention else triton_gemm_flops(name, named)
            dtype = _dtype(tensors[0]) if tensors else "fp32"
            touched = sum(distinct_bytes(t) for t in tensors)
            self.records.append(Kernel(self.phase, self.layer(), f"triton.{name}", 1, flops, dtype, touched))

    return WorkCounter()


def _is_list(value):
    return isinstance(value, list) and bool(value) and all(hasattr(t, "dtype") for t in value)


def _foreach_bytes(name, lists, outputs):
    """A _foreach op's bytes: each tensor of its lists read once, and written: the first list where
    it updates in place (its name ends in _), else its outputs; the fused AdamW writes the params
    and both moments."""
    read = sum(distinct_bytes(t) for lst in lists for t in lst)
    if name.startswith("_fused_adam"):
        written = [t for i in (0, 2, 3) if i < len(lists) for t in lists[i]]
    else:
        written = lists[0] if name.endswith("_") and lists else outputs
    return read + sum(distinct_bytes(t) for t in written)


def triton_gemm_flops(name, named):
    """FLOPs of the Triton GEMMs (2 M N K; the fused FFN's two products), 0 for the other kernels."""
    if name in ("_linear_gelu_fwd_kernel", "_ffn_act_grad_kernel"):  # the FFN's dH GEMM: M d_ff d
        return 2 * named["M"] * named["N"] * named["K"]
    if name == "_ffn_fused_fwd_kernel":
        return 2 * named["M"] * named["N"] * named["K"] * 2
    return 0


# ----------------------------------------------------------------------------------------------
# the workloads and their steps
# ----------------------------------------------------------------------------------------------
@dataclass
class Workload:
    """A model config and its batches: [(weight, labels, enc, dec)] per mode ("train", "eval"), a
    batch per distinct shape and its weight the batches of an epoch that have that shape."""

    name: str
    source: str
    config: object
    batches: dict


def bench_workload(quick):
    import fastformer
    from bench.cases import review_batch

    config = fastformer.Config.tutorial(**(QUICK_CONFIG if quick else {}))
    enc, dec, labels = review_batch(config, BATCH, False, "cpu")
    source = f"{BATCH} reviews of 8 to {min(128, config.n_enc_seq)} pieces padded to the longest ({enc.shape[1]})"
    batch = [(1, labels, enc, dec)]
    return Workload("bench", source, config, {"train": batch, "eval": batch})


def job_workload(dataset, quick, rotten_tomatoes=None):
    """The default CUDA job's batches of `dataset` ("demo" or "rotten-tomatoes"): its vocab trained
    on the train reviews, the tutorial's config for it, length buckets padded to a multiple of 16."""
    import tempfile

    from fastformer.data.vocab import train_vocab
    from fastformer.train.job import loaders
    from fastformer.train.run import default_config
    from fastformer.train.runtime import Launch
    from tools.cold_start import _reviews

    data, source = _reviews("demo" if dataset == "demo" else "rotten_tomatoes", rotten_tomatoes)
    with tempfile.TemporaryDirectory(prefix="work-") as scratch:
        vocab = train_vocab((r.doc for r in data.train), os.path.join(scratch, "vocab.model"), n_pieces=8000)
    config = default_config("cuda", vocab.get_piece_size(), data.n_classes)
    if quick:
        config.update(QUICK_CONFIG)
    train, test, set_epoch = loaders(config, vocab, data.train, data.test, BATCH, True, 0, Launch(), True)
    set_epoch(0)
    batches = {}
    for mode, loader in (("train", train), ("eval", test)):
        shapes = collections.OrderedDict()
        for labels, enc, dec in loader:
            key = (tuple(enc.shape), tuple(dec.shape))
            if key in shapes:
                shapes[key][0] += 1
            else:
                shapes[key] = [1, labels, enc, dec]
        batches[mode] = [tuple(entry) for entry in shapes.values()]
    return Workload(dataset, source, config, batches)


def real_tokens(batches, config):
    """(encoder lengths, decoder lengths) of the real tokens of each batch, as lists."""
    enc, dec = batches[2], batches[3]
    return (enc != config.i_pad).sum(1).tolist(), (dec != config.i_pad).sum(1).tolist()


def count_steps(workload, provider):
    """{"train": [(weight, [Kernel])], "train_padded": [...], "infer": [...]}: the forward, loss and
    backward of a train step (no optimizer) per train batch and an inference step per eval batch,
    under the dry-run driver, each counted after the same step once uncounted (what a model does
    once, the count leaves out). "train" and "infer" as an eager step runs them, on the real tokens
    alone (fastformer.packing); "train_replayed" the train step as the job's CUDA graph captures it
    (a capture cannot read the count of real tokens): in the token bucket of the batch's
    replay_rows, padded where it has none."""
    import contextlib

    import torch

    import fastformer
    from fastformer.packing import replay_rows, token_bucket, use_packing
    from tools import sm90
    from tools.launches import counting

    torch.manual_seed(0)
    model = fastformer.MovieClassification(workload.config)
    backend, amp = ("triton", torch.bfloat16) if provider == "fastformer" else ("reference", None)
    steps = {"train": [], "train_replayed": [], "infer": []}
    with fastformer.use_backend(backend), sm90.no_matmuls():
        for name, step, mode in (
            ("train", "train", "train"),
            ("train_replayed", "train", "train"),
            ("infer", "infer", "eval"),
        ):
            model.train(step == "train")
            for weight, labels, enc, dec in workload.batches[mode]:
                packing = contextlib.nullcontext()
                if name == "train_replayed":
                    rows = replay_rows(enc, workload.config.i_pad)
                    packing = use_packing(False) if rows is None else token_bucket(rows)
                with packing:
                    _step(model, step, labels, enc, dec, amp, None)
                    counter = _work_counter("cpu")
                    with counting("cpu", counter):
                        _step(model, step, labels, enc, dec, amp, counter)
                steps[name].append((weight, counter.records))
    return steps


def _step(model, step, labels, enc, dec, amp, counter):
    """A train step's forward, loss and backward, or an inference forward, its phases marked on `counter`."""
    import torch
    import torch.nn.functional as F

    def phase(name, autocast=False):
        if counter is not None:
            counter.phase, counter.autocast = name, autocast

    phase("forward", amp is not None)
    autocast = torch.autocast("cpu", dtype=amp or torch.bfloat16, enabled=amp is not None)
    with autocast, torch.set_grad_enabled(step == "train"):
        logits = model(enc, dec)[0]
    if step == "train":
        phase("loss")
        loss = F.cross_entropy(logits.float(), labels)
        phase("backward")
        loss.backward()
        model.zero_grad(set_to_none=True)


# the FFN op on its own at the shape the kernel review's roofline takes (M rows of d_hidn 256, d_ff 1024)
FFN_OP = {"M": 32768, "d": 256, "d_ff": 1024, "dtype": "bf16"}
FFN_OP_QUICK = {"M": 256, "d": 64, "d_ff": 128, "dtype": "bf16"}


def count_ffn_op(M, d, d_ff, dtype):
    """[Kernel] of kernels.feed_forward's forward and backward (GELU, every input needing its
    gradient, the weights as the model's Conv1d views) on (M, d) rows, as the training step calls
    it, under the dry-run driver: counted after one uncounted call."""
    import torch

    from fastformer import kernels
    from tools import sm90
    from tools.launches import counting

    t = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    x = torch.zeros(M, d, dtype=t, requires_grad=True)
    w1 = torch.zeros(d_ff, d, 1, dtype=t).squeeze(-1).requires_grad_()
    w2 = torch.zeros(d, d_ff, 1, dtype=t).squeeze(-1).requires_grad_()
    b1, b2 = (torch.zeros(n, dtype=t, requires_grad=True) for n in (d_ff, d))
    dout = torch.zeros(M, d, dtype=t)

    def step(counter):
        for t in (x, w1, b1, w2, b2):
            t.grad = None  # as a step's zero_grad(set_to_none=True): no gradient accumulates
        if counter is not None:
            counter.phase = "forward"
        y = kernels.feed_forward(x, w1, b1, w2, b2)
        if counter is not None:
            counter.phase = "backward"
        y.backward(dout)

    with sm90.no_matmuls():
        step(None)
        counter = _work_counter("cpu")
        with counting("cpu", counter):
            step(counter)
    return counter.records


def count_optimizers(config):
    """{"eager": [Kernel], "replayed": [Kernel]}: one AdamW step over the model's parameters, as the
    eager job steps it (fused) and as a replayed step captures it (fused and capturable: its lr a
    device tensor), on fake CUDA tensors of the parameters' shapes (the second step: the first
    makes the state)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    import fastformer
    from fastformer.train.graphs import make_capturable
    from fastformer.train.loop import adamw

    shapes = [p.shape for p in fastformer.MovieClassification(config).parameters() if p.requires_grad]

    class Params:
        def __init__(self, params):
            self.params = params

        def parameters(self):
            return iter(self.params)

    counted = {}
    for name, capturable in (("eager", False), ("replayed", True)):
        with FakeTensorMode(allow_non_fake_inputs=True):
            params = [torch.nn.Parameter(torch.empty(s, device="cuda")) for s in shapes]
            for p in params:
                p.grad = torch.empty_like(p)
            optimizer = adamw(Params(params), 5e-4, 0.01, fused=True)
            optimizer.step()  # its lr a number: the tensor-lr overload has no fake kernel to run
            make_capturable(optimizer, capturable)
            counter = _work_counter("cuda")
            counter.phase = "optimizer"
            with counter:
                optimizer.step()
        counted[name] = counter.records
    return counted


# ----------------------------------------------------------------------------------------------
# the report
# ----------------------------------------------------------------------------------------------
def summarize(batches, optimizer, real_flops, peaks=PEAKS, floor=LAUNCH_FLOOR_US):
    """One step's work, the mean over an epoch's batches ([(weight, [Kernel])]) plus the optimizer's
    kernels (or None): kernels, those under the floor, executed product FLOPs and their ratio to
    `real_flops` (the step's on real tokens, per step), bytes, the roofline and the bound in ms,
    by kind and by phase, and the ten kernels with the largest bound."""
    total = sum(w for w, _ in batches)
    rows = collections.defaultdict(lambda: {"kernels": 0.0, "flops": 0.0, "bytes": 0.0, "bound_ms": 0.0})
    summary = {"kernels": 0.0, "under_floor": 0.0, "flops": 0.0, "bytes": 0.0, "roofline_ms": 0.0, "bound_ms": 0.0}
    by_kind, by_phase, largest = (collections.defaultdict(lambda: dict(rows.default_factory())) for _ in range(3))
    parts = [(w / total, kernels) for w, kernels in batches] + ([(1.0, optimizer)] if optimizer else [])
    for share, kernels in parts:
        for k in kernels:
            bound, roofline = k.bound_us(peaks, floor), k.roofline_us(peaks) * k.launches
            figures = {"kernels": k.launches, "flops": k.flops, "bytes": k.bytes, "bound_ms": bound / 1e3}
            for table, key in ((by_kind, k.kind()), (by_phase, k.phase), (largest, (k.name, k.layer, k.phase))):
                for field, value in figures.items():
                    table[key][field] += share * value
            summary["kernels"] += share * k.launches
            summary["under_floor"] += share * k.launches * (k.roofline_us(peaks) < floor)
            summary["flops"] += share * k.flops
            summary["bytes"] += share * k.bytes
            summary["roofline_ms"] += share * roofline / 1e3
            summary["bound_ms"] += share * bound / 1e3
    summary["real_flops"] = real_flops
    summary["flops_over_real"] = summary["flops"] / real_flops if real_flops else None
    summary["by_kind"] = {kind: _rounded(by_kind[kind]) for kind in KINDS if kind in by_kind}
    summary["by_phase"] = {phase: _rounded(v) for phase, v in by_phase.items()}
    top = sorted(largest.items(), key=lambda item: -item[1]["bound_ms"])[:10]
    summary["largest"] = [{"kernel": n, "layer": layer, "phase": phase, **_rounded(v)} for (n, layer, phase), v in top]
    return _rounded(summary)


def _rounded(figures):
    return {k: round(v, 6) if isinstance(v, float) else v for k, v in figures.items()}


def measure(workloads, providers=PROVIDERS, quick=False, rotten_tomatoes=None, progress=print):
    """The report work.json holds: per workload and provider, the train step (eager, on the real
    tokens, and replayed, padded, each with its optimizer) and the inference step (eager)."""
    import torch

    from bench.common import environment, model_flops

    report = {
        "env": environment(torch.device("cpu")),
        "counted_on": "a CPU, under tools.sm90's dry-run sm_90a driver (Triton compiles, launches nothing) "
        "and tools.sm90.no_matmuls (PyTorch's products uncomputed)",
        "peaks": PEAKS,
        "launch_floor_us": LAUNCH_FLOOR_US,
        "quick": quick,
        "workloads": {},
    }
    for name in workloads:
        progress(f"work: {name}: reading the batches")
        workload = bench_workload(quick) if name == "bench" else job_workload(name, quick, rotten_tomatoes)
        config = workload.config
        real = {}
        for step, mode, kind in (("train", "train", "train"), ("infer", "eval", "infer")):
            batches = workload.batches[mode]
            total = sum(b[0] for b in batches)
            real[step] = sum(b[0] * model_flops(config, *real_tokens(b, config), kind) for b in batches) / total
        entry = {
            "source": workload.source,
            "config": dict(config),
            "batches": {
                mode: {"steps": sum(b[0] for b in bs), "shapes": [[b[0], list(b[2].shape)] for b in bs]}
                for mode, bs in workload.batches.items()
            },
            "providers": {},
        }
        optimizers = count_optimizers(config)
        for provider in providers:
            progress(f"work: {name}: {provider}")
            steps = count_steps(workload, provider)
            entry["providers"][provider] = {
                "train_eager": summarize(steps["train"], optimizers["eager"], real["train"]),
                "train_replayed": summarize(steps["train_replayed"], optimizers["replayed"], real["train"]),
                "infer": summarize(steps["infer"], None, real["infer"]),
            }
        report["workloads"][name] = entry
    shape = FFN_OP_QUICK if quick else FFN_OP
    progress(f"work: the FFN op at {shape}")
    report["ops"] = {"feed_forward": {**shape, **summarize([(1, count_ffn_op(**shape))], None, 0.0)}}
    return report


STEP_NAMES = {"train_eager": "train, eager", "train_replayed": "train, replayed", "infer": "inference"}


def tables(report):
    """Markdown: per workload, a row per provider and step; then fastformer's replayed train step by kind."""
    out = []
    for name, entry in report["workloads"].items():
        out += [f"### {name}: {entry['source']}", ""]
        out += [
            "| provider | step | kernels | under the floor | GFLOP (products) | x real tokens' | MB "
            "| roofline ms | bound ms |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for provider, steps in entry["providers"].items():
            for step, s in steps.items():
                ratio = "-" if s["flops_over_real"] is None else f"{s['flops_over_real']:.2f}"
                out.append(
                    f"| {provider} | {STEP_NAMES[step]} | {s['kernels']:.0f} | {s['under_floor']:.0f} | "
                    f"{s['flops'] / 1e9:.1f} | {ratio} | {s['bytes'] / 2**20:.0f} | {s['roofline_ms']:.3f} | "
                    f"{s['bound_ms']:.3f} |"
                )
        ours = entry["providers"].get("fastformer", {}).get("train_replayed")
        if ours:
            out += ["", "| fastformer's replayed train step, by kind | kernels | GFLOP | MB | bound ms |"]
            out.append("|---|---:|---:|---:|---:|")
            for kind, k in ours["by_kind"].items():
                out.append(
                    f"| {kind} | {k['kernels']:.0f} | {k['flops'] / 1e9:.1f} | {k['bytes'] / 2**20:.0f} | "
                    f"{k['bound_ms']:.3f} |"
                )
        out.append("")
    for name, op in report.get("ops", {}).items():
        out += [
            f"### {name}, forward + backward, alone: M {op['M']}, d {op['d']}, d_ff {op['d_ff']}, {op['dtype']}",
            "",
            "| kernel | phase | launches | GFLOP | MB | bound ms |",
            "|---|---|---:|---:|---:|---:|",
        ]
        for k in op["largest"]:
            out.append(
                f"| {k['kernel']} | {k['phase']} | {k['kernels']:.0f} | {k['flops'] / 1e9:.1f} | "
                f"{k['bytes'] / 2**20:.0f} | {k['bound_ms']:.3f} |"
            )
        out += [
            f"| all | | {op['kernels']:.0f} | {op['flops'] / 1e9:.1f} | {op['bytes'] / 2**20:.0f} | "
            f"{op['bound_ms']:.3f} |",
            "",
        ]
    return "\n".join(out)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m tools.work", description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    parser.add_argument("--providers", nargs="+", choices=PROVIDERS, default=list(PROVIDERS))
    parser.add_argument("--quick", action="store_true", help=f"a small config ({QUICK_CONFIG}), for CI")
    parser.add_argument(
        "--rotten-tomatoes", help="the folder `fastformer data rotten-tomatoes` wrote (default: its cache)"
    )
    parser.add_argument("--out", type=Path, default=RESULTS, help="the JSON file (default tools/results/work.json)")
    args = parser.parse_args(argv)
    if refuses_interpreter("work", "the count compiles the kernels for sm_90a under the dry-run driver"):
        return 2
    from tools import sm90

    with sm90.dry_run(time_configs=False):
        report = measure(args.workloads, args.providers, args.quick, args.rotten_tomatoes)
    write_report(args.out, report, tables(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
