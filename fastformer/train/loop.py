"""Training utilities from the tutorials: schedules, the padding-masked loss, and the loops.

- `adamw` and `linear_warmup_decay`: the tutorial's training script, AdamW (weight decay on the
  matrices only) with the learning rate rising linearly over the warm-up steps, then falling
  linearly to 0 at the last step.
- `inverse_sqrt_warmup`: the TensorFlow/Keras Transformer tutorial's schedule,
  lr = d_model^-0.5 * min(step^-0.5, step * warmup^-1.5).
- `sequence_cross_entropy`: cross-entropy over sequence outputs that ignores padding positions.
- `train_epoch` / `evaluate`: the tutorial's train_epoch and eval_epoch for MovieClassification,
  with progress bars showing loss, accuracy and tokens/s (fastformer.progress: tqdm's on a
  terminal, a line now and then in a log), and optional autocast. `train_epoch` raises
  NonFiniteLossError when a loss is NaN or infinite. In a torchrun job their figures are summed
  over the processes and only rank 0 shows bars. Given `graphs` (a fastformer.train.graphs.GraphedSteps),
  both replay CUDA graphs of their steps instead of running them eagerly.
- `train_step` / `loss_curve`: one optimizer step of train_epoch, and the losses of a run of them.
"""

import contextlib
import math
import time

import torch
import torch.nn.functional as F

from fastformer.data.reviews import movie_collate_fn
from fastformer.data.vocab import BOS
from fastformer.packing import replay_rows
from fastformer.progress import progress_bar

AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class NonFiniteLossError(FloatingPointError):
    """A training loss was NaN or infinite; `step` is the epoch's step (from 1) that gave it."""

    def __init__(self, message, step, loss):
        super().__init__(message)
        self.step = step
        self.loss = loss


def adamw(model, lr, weight_decay, *, fused, foreach=None):
    """`fastformer train`'s optimizer: torch's AdamW over the parameters that take a gradient,
    weight decay on the matrices only (the biases' and LayerNorm's vectors take none).

    fused: torch's fused implementation, per parameter group one kernel per chunk of parameters for
    the whole update, the step counts on the parameters' device; foreach (torch's CUDA default)
    runs seven ops over every chunk and keeps the counts on the host, reading each one per step.
    On the tutorial's 255 trainable parameters the fused step took a third of foreach's host time
    on a CPU (docs/host-path.md). The job takes it eager and replayed: graphs.make_capturable makes
    it a CUDA graph's, 11 launches a step where the capturable foreach form makes 68 (tools.work).
    fused=False leaves torch's default for the device (on CUDA the foreach form), or with
    foreach=True names the foreach form on any device (the instruments compare the two forms)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    form = {"fused": True} if fused else {"foreach": foreach}
    return torch.optim.AdamW(groups, lr=lr, **form)


def keep_form(optimizer, fused):
    """Give an AdamW made by `adamw` the form it was made in again after optimizer.load_state_dict,
    which takes the form a checkpoint was written in from its parameter groups' options (a run
    written before `fastformer train` took the fused form, or one trained with --cuda-graphs, holds
    torch's default): fused, or torch's default. Left so, a fused AdamW would step in the foreach
    form with a GradScaler's fused-only arguments. graphs.make_capturable places the step counts
    after it. Returns the optimizer."""
    for group in optimizer.param_groups:
        group["fused"] = True if fused else None
        group["foreach"] = None
    return optimizer


def linear_warmup_decay(step, warmup_steps, total_steps):
    """The lr multiplier at `step` (0-based): step / warmup_steps while warming up, then a linear
    decay reaching 0 at total_steps."""
    if step < warmup_steps:
        return step / max(1, warmup_steps)
    return max(0.0, (total_steps - step) / max(1, total_steps - warmup_steps))


def inverse_sqrt_warmup(step, d_model, warmup_steps=4000):
    """The Keras tutorial's learning rate at `step` (counted from 1):
    d_model^-0.5 * min(step^-0.5, step * warmup^-1.5). Step 0 is treated as step 1."""
    step = max(step, 1)
    return d_model**-0.5 * min(step**-0.5, step * warmup_steps**-1.5)


def linear_warmup_decay_scheduler(optimizer, warmup_steps, total_steps):
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: linear_warmup_decay(step, warmup_steps, total_steps)
    )


def inverse_sqrt_scheduler(optimizer, d_model, warmup_steps=4000):
    """The Keras tutorial's schedule as a LambdaLR; give the optimizer lr=1.0, since the schedule is the lr."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: inverse_sqrt_warmup(step + 1, d_model, warmup_steps)
    )


def sequence_cross_entropy(logits, targets, pad_idx):
    """Mean cross-entropy over the positions whose target is not padding (the Keras tutorial's masked loss).

    logits: (bs, n_seq, n_vocab); targets: (bs, n_seq). A batch of padding only gives 0.
    """
    losses = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="none")
    keep = targets.flatten().ne(pad_idx)
    return (losses * keep).sum() / keep.sum().clamp(min=1)


def autocast(device, amp, cache=True):
    """torch.autocast for amp "bf16"/"fp16" on `device`, or a no-op context for "off". `cache`
    is autocast's cast cache (off for CUDA graph captures; the values are the same either way)."""
    if amp == "off":
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=AMP_DTYPES[amp], cache_enabled=cache)


def _synchronize(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _count_tokens(enc_inputs, dec_inputs, i_pad):
    return enc_inputs.ne(i_pad).sum() + dec_inputs.ne(i_pad).sum()


def _in_process_group():
    """Whether this process is one of a torchrun job's (torch.distributed is initialized)."""
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _is_main_process():
    """Whether this process shows progress: a plain run, or rank 0 of a torchrun job."""
    return not _in_process_group() or torch.distributed.get_rank() == 0


def _summed(*values):
    """The values (tensors or numbers) as floats, each summed over the processes of a torchrun job
    in one all-reduce (on the first value's device); outside one, as they are."""
    if not _in_process_group():
        return [float(v) for v in values]
    device = values[0].device
    packed = torch.stack([torch.as_tensor(v, device=device).double() for v in values])
    torch.distributed.all_reduce(packed)
    return packed.tolist()


def train_step(model, batch, optimizer, scheduler=None, *, device, amp="off", scaler=None, cache=True):
    """One optimizer step of the tutorial's train_epoch on batch = (labels, enc_inputs, dec_inputs):
    cross-entropy on logits[0], backward (through the GradScaler when given), step. Returns the
    loss and the logits, detached, without a host sync. `cache`: autocast's cast cache (off in a
    CUDA graph's capture, fastformer.train.graphs, which captures this step)."""
    labels, enc_inputs, dec_inputs = (t.to(device, non_blocking=True) for t in batch)
    optimizer.zero_grad(set_to_none=True)
    with autocast(device, amp, cache):
        logits = model(enc_inputs, dec_inputs)[0]
    loss = F.cross_entropy(logits.float(), labels)
    if scaler is not None:
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    else:
        loss.backward()
        optimizer.step()
    if scheduler is not None:
        scheduler.step()
    return loss.detach(), logits.detach()


def loss_curve(model, batches, optimizer, *, device, amp="off"):
    """train_step on each batch in order; the loss of every step, as floats. With dropout 0 the
    curve depends on the backend only through rounding: the convergence checks compare them."""
    model.train()
    losses = [train_step(model, batch, optimizer, device=device, amp=amp)[0] for batch in batches]
    return torch.stack(losses).tolist()


def train_epoch(
    model,
    loader,
    optimizer,
    scheduler=None,
    *,
    device,
    amp="off",
    scaler=None,
    max_steps=None,
    desc="Train",
    log_every=10,
    graphs=None,
    first_step=None,
):
    """One epoch of the tutorial's train_epoch (cross-entropy on logits[0]).

    Stops early after `max_steps` optimizer steps. The bar shows the running loss, accuracy and
    tokens/s, refreshed every `log_every` steps (each refresh is one host sync). A NaN or infinite
    loss is seen at the next refresh, which raises NonFiniteLossError naming the first step that
    gave one (the optimizer has stepped on it: the model is no longer usable).
    In a torchrun job (`model` wrapped in DistributedDataParallel), the figures are summed over the
    processes at each refresh, only rank 0 shows the bar, and every process raises together.
    With `graphs` (a fastformer.train.graphs.GraphedSteps of `model` and `optimizer`; no scaler), each
    step is graphs.train_step, a CUDA graph replay, followed by scheduler.step().
    `first_step()` is called when the epoch's first step is done on the device (one host sync).
    Returns {"loss", "accuracy", "steps", "reviews", "tokens", "seconds", "tokens_per_s"}.
    """
    model.train()
    i_pad = getattr(model, "module", model).config.i_pad  # DistributedDataParallel keeps the model as .module
    total_loss = torch.zeros((), device=device)
    correct = torch.zeros((), device=device, dtype=torch.long)
    tokens = torch.zeros((), device=device, dtype=torch.long)
    seen = steps = 0
    window = []  # the losses since the last refresh, read back only when one is not finite
    n_steps = len(loader) if max_steps is None else min(len(loader), max_steps)
    start = time.perf_counter()
    with progress_bar(total=n_steps, desc=desc, unit=" batch", disable=not _is_main_process()) as bar:
        for labels, enc_inputs, dec_inputs in loader:
            if steps == n_steps:
                break
            rows = None if graphs is None else replay_rows(enc_inputs, i_pad)  # read while on the host
            labels, enc_inputs, dec_inputs = (t.to(device, non_blocking=True) for t in (labels, enc_inputs, dec_inputs))
            if graphs is None:
                loss, logits = train_step(
                    model, (labels, enc_inputs, dec_inputs), optimizer, scheduler, device=device, amp=amp, scaler=scaler
                )
            else:
                loss, logits = graphs.train_step((labels, enc_inputs, dec_inputs), rows)
                if scheduler is not None:
                    scheduler.step()
            total_loss += loss * labels.numel()
            window.append(loss)
            correct += logits.argmax(1).eq(labels).sum()
            tokens += _count_tokens(enc_inputs, dec_inputs, i_pad)
            seen += labels.numel()
            steps += 1
            if steps == 1 and first_step is not None:
                _synchronize(device)
                first_step()
            bar.update(1)
            if steps % log_every == 0 or steps == n_steps:
                sums = _summed(total_loss, correct, tokens, seen)
                mean_loss = sums[0] / sums[3]
                if not math.isfinite(mean_loss):
                    _raise_non_finite(window, steps)
                window.clear()
                elapsed = time.perf_counter() - start
                bar.set_postfix_str(f"loss {mean_loss:.3f} acc {sums[1] / sums[3]:.3f} {sums[2] / elapsed:,.0f} tok/s")
    _synchronize(device)
    seconds = time.perf_counter() - start
    total_loss, correct, tokens, seen = _summed(total_loss, correct, tokens, seen)
    return {
        "loss": total_loss / max(seen, 1),
        "accuracy": correct / max(seen, 1),
        "steps": steps,
        "reviews": int(seen),
        "tokens": int(tokens),
        "seconds": seconds,
        "tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
    }


def _raise_non_finite(window, steps):
    """NonFiniteLossError for the first non-finite loss of `window`, the losses of the steps up to
    `steps` (summed over the processes of a torchrun job, so that every process names the same step)."""
    losses = _summed(*window)
    first = next(i for i, loss in enumerate(losses) if not math.isfinite(loss))
    step = steps - len(losses) + first + 1
    raise NonFiniteLossError(f"the loss is {losses[first]} at step {step}", step, losses[first])


@torch.no_grad()
def evaluate(model, loader, *, device, amp="off", desc="Valid", graphs=None):
    """The tutorial's eval_epoch: accuracy of argmax(logits), plus the mean loss. In a torchrun job
    each process evaluates its part of the set and the sums are added up over the processes. With
    `graphs` (a fastformer.train.graphs.GraphedSteps of `model`), the logits come from CUDA graph replays.
    Returns {"loss", "accuracy", "n"}."""
    model.eval()
    i_pad = getattr(model, "module", model).config.i_pad  # DistributedDataParallel keeps the model as .module
    total_loss = torch.zeros((), device=device)
    correct = torch.zeros((), device=device, dtype=torch.long)
    seen = 0
    with progress_bar(total=len(loader), desc=desc, unit=" batch", disable=not _is_main_process()) as bar:
        for labels, enc_inputs, dec_inputs in loader:
            rows = None if graphs is None else replay_rows(enc_inputs, i_pad)  # read while on the host
            labels, enc_inputs, dec_inputs = (t.to(device, non_blocking=True) for t in (labels, enc_inputs, dec_inputs))
            if graphs is None:
                with autocast(device, amp):
                    logits = model(enc_inputs, dec_inputs)[0]
            else:
                logits = graphs.logits(enc_inputs, dec_inputs, rows)
            total_loss += F.cross_entropy(logits.float(), labels, reduction="sum")
            correct += logits.argmax(1).eq(labels).sum()
            seen += labels.numel()
            bar.update(1)
    total_loss, correct, seen = _summed(total_loss, correct, seen)
    return {"loss": total_loss / max(seen, 1), "accuracy": correct / max(seen, 1), "n": int(seen)}


@torch.no_grad()
def predict_proba(model, vocab, texts, *, device, amp="off", max_len=None):
    """Class probabilities (len(texts), n_output) for raw texts, one batch. A text with no pieces
    (empty or only whitespace) raises ValueError: the model would see padding only and still answer."""
    ids = [vocab.encode_as_ids(text)[:max_len] for text in texts]
    blank = next((i for i, pieces in enumerate(ids) if not pieces), None)
    if blank is not None:
        raise ValueError(
            f"text {blank + 1} of {len(texts)} ({texts[blank]!r}) is empty or only whitespace: nothing to classify"
        )
    model.eval()
    bos = vocab.piece_to_id(BOS[1])
    items = [(torch.tensor(0), torch.tensor(pieces), torch.tensor([bos])) for pieces in ids]
    _, enc_inputs, dec_inputs = movie_collate_fn(items, i_pad=model.config.i_pad)
    with autocast(device, amp):
        logits = model(enc_inputs.to(device), dec_inputs.to(device))[0]
    return logits.float().softmax(-1).cpu()
