"""CUDA graphs of the train step and of evaluation: how `fastformer train` runs its steps on CUDA by
default (and with --cuda-graphs), and `fastformer evaluate` its batches.

At batch 128 of reviews 10 to 60 pieces long, a kernel of the tutorial's model runs for
microseconds and an eager train step launches hundreds of them (docs/launches.md counts
them), so the GPU waits on the CPU. A CUDA graph records a step's kernels once and replays them
all with one launch. `GraphedSteps` does this for MovieClassification:

- One graph per kind of step (train, or the evaluation forward), model mode and batch shape. The
  job's loaders pad the encoder ids to a few bucket lengths (fastformer.data.reviews.bucket_length),
  so a run captures a handful.
- A graph reads its batch from buffers of its own: each step copies the batch into them and
  replays. The loss and logits it returns are copies, since the next replay overwrites its outputs.
- Nothing in a graph waits on the host. The model skips its token-id range check while a graph is
  captured, so replayed steps trust their ids (the job's come from the vocab). The optimizer must
  be capturable, with its lr a tensor on the device (`make_capturable`), which an LR scheduler
  fills between replays: LambdaLR fills a tensor lr in place, one kernel and no sync. There is no
  GradScaler (it reads found-inf on the host at every step), so no fp16 autocast: use bf16.
- Before a capture the step runs `warmup_steps` (3) times on a side stream, as torch.cuda.graph's
  documentation asks, so that cuBLAS, the caching allocator and Triton's autotuner do their
  first-call work outside the capture. Those warm-up steps train: the weights, the optimizer's
  state and the RNG states are saved before them and put back after (optimizer state the warm-up
  created is put back to the zeros Adam and AdamW start from), so the first replay starts where
  an eager step would: N replayed steps are N eager steps, kernel for kernel.
- autocast's cast cache is off inside graphed steps, as torch.cuda.make_graphed_callables
  requires: every replay casts the weights it reads afresh.
- Dropout's seeds are drawn on the device from torch's CUDA generator, which torch.cuda.graph
  advances at every replay, so each replay draws new masks.
- On real tokens (fastformer.packing): given a batch's `rows` (`fastformer.packing.replay_rows`,
  which the job's loops read from the batch's encoder ids while they are still on the host: its
  count of real tokens rounded up to an eighth of its positions), a step is captured and replayed
  in `token_bucket(rows)`, its encoder on the real tokens and fillers up to `rows`; one graph per
  shape and rows. Without (`rows=None`: packing off, nothing to leave out, a review of padding
  alone, the model not packing, the ids already on the device) it runs padded.

The graphs share one memory pool and are replayed one at a time, in any order: each replay writes
every buffer it reads. After a replay, the parameters' `.grad` are buffers of the graph captured
last, not the gradients of that step: read the weights, not the gradients. Under torchrun
(DistributedDataParallel) graphs are not supported.
"""

import warnings
from typing import NamedTuple

import torch

from fastformer.packing import token_bucket, use_packing
from fastformer.train.loop import autocast, train_step

WARMUP_STEPS = 3


def make_capturable(optimizer, capturable=True):
    """Switch an optimizer with a `capturable` option (Adam, AdamW) between its eager form (a float
    lr, step counts on the CPU) and the form a CUDA graph captures (capturable=True, the lr a 0-dim
    fp32 tensor and the step counts on the parameters' device), keeping every value, so that a
    checkpoint written in either form resumes in either. optimizer.load_state_dict brings back the
    form the checkpoint was written in: call this after it. Reading a tensor lr is one host sync.
    `fastformer train` makes its fused AdamW capturable (fastformer.train.loop.adamw): per group a
    count increment and one fused update a chunk of parameters, no host read. Not fused, leave
    `foreach` to its CUDA default (True): with foreach=False, PyTorch 2.13's capturable Adam gives
    NaN where the lr is exactly 0 and a gradient is 0, as at the first step of a warm-up. A fused
    optimizer keeps its step counts on the parameters' device in either form, as it requires.
    Returns the optimizer."""
    for group in optimizer.param_groups:
        if "capturable" not in group:
            raise TypeError(f"{type(optimizer).__name__} has no capturable option; use torch.optim.AdamW")
        device = group["params"][0].device
        group["capturable"] = capturable
        lr = float(group["lr"])
        group["lr"] = torch.tensor(lr, dtype=torch.float32, device=device) if capturable else lr
        for param in group["params"]:
            state = optimizer.state.get(param, {})
            if "step" in state:
                state["step"] = state["step"].to(device if capturable or group.get("fused") else "cpu")
    return optimizer


def _packing(rows):
    """The packing a step with these rows is warmed up and captured in: token_bucket(rows), or
    padded where it has none."""
    return token_bucket(rows) if rows is not None else use_packing(False)


class _Captured(NamedTuple):
    """A captured step: its graph, the buffers it reads its batch from, and those it writes."""

    graph: torch.cuda.CUDAGraph
    inputs: tuple
    outputs: tuple

    def replay(self, batch):
        for buffer, tensor in zip(self.inputs, batch):
            buffer.copy_(tensor, non_blocking=True)
        self.graph.replay()
        return tuple(output.clone() for output in self.outputs)


class GraphedSteps:
    """MovieClassification's train step and evaluation forward, each captured as a CUDA graph on
    its first batch of a shape and replayed for the later ones (see the module docstring).

        optimizer = make_capturable(torch.optim.AdamW(model.parameters(), lr=5e-4))
        graphs = GraphedSteps(model, optimizer, amp="bf16")
        loss, logits = graphs.train_step((labels, enc_inputs, dec_inputs))  # then scheduler.step()
        logits = graphs.logits(enc_inputs, dec_inputs)                      # after model.eval()

    `train_step` is fastformer.train.loop.train_step (without a scaler) and `logits` is
    model(enc_inputs, dec_inputs)[0] under the same autocast: the same kernels on the same inputs.
    `captured` counts the graphs captured so far. With no optimizer (`fastformer evaluate`), only
    the evaluation forward is replayed.
    """

    def __init__(self, model, optimizer=None, *, amp="off", warmup_steps=WARMUP_STEPS):
        self.device = next(model.parameters()).device
        if self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need the model on a CUDA device; it is on {self.device}")
        if amp == "fp16":
            raise ValueError(
                "CUDA graphs do not take fp16 autocast: its GradScaler reads the host at every step; use bf16"
            )
        if optimizer is not None and not all(
            group.get("capturable") and isinstance(group["lr"], torch.Tensor) for group in optimizer.param_groups
        ):
            raise ValueError(
                "the optimizer is not capturable with a tensor lr (a float lr would be captured as a "
                "constant): pass it through fastformer.train.graphs.make_capturable first"
            )
        self.model, self.optimizer, self.amp, self.warmup_steps = model, optimizer, amp, warmup_steps
        self.pool = torch.cuda.graph_pool_handle()
        self._graphs = {}

    @property
    def captured(self):
        return len(self._graphs)

    def train_step(self, batch, rows=None):
        """One optimizer step on batch = (labels, enc_inputs, dec_inputs), replayed: returns the loss
        and the logits, detached copies, without a host sync. rows: replay_rows of the batch's
        encoder ids, its encoder run on its real tokens in that many rows; None: padded."""
        if self.optimizer is None:
            raise ValueError("these graphs were made without an optimizer: they replay the evaluation forward only")
        loss, logits = self._replay("train", self._train_body, batch, rows)
        return loss, logits

    def logits(self, enc_inputs, dec_inputs, rows=None):
        """model(enc_inputs, dec_inputs)[0] without autograd, replayed (a copy); rows as train_step's."""
        return self._replay("eval", self._eval_body, (enc_inputs, dec_inputs), rows)[0]

    def _replay(self, kind, body, batch, rows):
        if rows is not None and not self._packs(batch[-2], rows):
            rows = None  # the model runs padded (a hook, a swapped module, the reference backend)
        key = (kind, self.model.training, rows, *((tuple(t.shape), t.dtype) for t in batch))
        if key not in self._graphs:
            self._graphs[key] = self._capture(body, batch, rows)
        return self._graphs[key].replay(batch)

    def _packs(self, enc_inputs, rows):
        """Whether the model packs a batch of these ids in token_bucket(rows) (Transformer.packs)."""
        with token_bucket(rows):
            return self.model.transformer.packs(enc_inputs)

    def _train_body(self, labels, enc_inputs, dec_inputs):
        with torch.enable_grad():
            batch = (labels, enc_inputs, dec_inputs)
            return train_step(self.model, batch, self.optimizer, device=self.device, amp=self.amp, cache=False)

    def _eval_body(self, enc_inputs, dec_inputs):
        with torch.no_grad(), autocast(self.device, self.amp, cache=False):
            return (self.model(enc_inputs, dec_inputs)[0],)

    def _capture(self, body, batch, rows):
        inputs = tuple(t.to(self.device, copy=True) for t in batch)  # allocated outside the graphs' pool
        saved = self._save()
        stream = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(stream)
        # warmed up as captured: in the token bucket's rows, or padded (a capture cannot read the
        # count of real tokens: fastformer.packing)
        with torch.cuda.stream(side), warnings.catch_warnings(), _packing(rows):
            # uncaptured on purpose: the optimizer's one-time advice against capturable=True outside graphs
            warnings.filterwarnings("ignore", message="This instance was constructed with capturable=True")
            for _ in range(self.warmup_steps):
                body(*inputs)
        stream.wait_stream(side)
        self._restore(saved)
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)  # the captured backward allocates .grad in the pool
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool), _packing(rows):
            outputs = body(*inputs)
        return _Captured(graph, inputs, outputs)

    def _save(self):
        """Copies of what a warm-up step changes: the weights, the optimizer's state, the RNG states."""
        return {
            "model": {name: t.detach().clone() for name, t in self.model.state_dict().items()},
            "optimizer": {
                p: {k: v.clone() for k, v in state.items() if isinstance(v, torch.Tensor)}
                for p, state in (self.optimizer.state.items() if self.optimizer is not None else ())
            },
            "rng": (torch.get_rng_state(), torch.cuda.get_rng_state(self.device)),
        }

    @torch.no_grad()
    def _restore(self, saved):
        """Put back what _save copied, in place (the graph reads these tensors where they are)."""
        for name, t in self.model.state_dict().items():
            t.copy_(saved["model"][name])
        for param, state in self.optimizer.state.items() if self.optimizer is not None else ():
            before = saved["optimizer"].get(param, {})
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and key in before:
                    value.copy_(before[key])
                elif isinstance(value, torch.Tensor):
                    value.zero_()
        torch.set_rng_state(saved["rng"][0])
        torch.cuda.set_rng_state(saved["rng"][1], self.device)
