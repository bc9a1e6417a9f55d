"""The jobs behind the `fastformer` commands, which only parse their arguments into these calls and
print their errors: `train` (the tutorial's NSMC sentiment pipeline: SentencePiece vocab,
MovieClassification, cross-entropy, per-epoch evaluation, in one call), `evaluate_run`, `predict`
and `demo`.

train runs in steps, a function each:
1. the inputs, checked without torch (fastformer.train.run.check_inputs): the options, the config
   and vocab given, the data and its classes, and the new run's directory or the run --resume
   continues (the command does this before it imports torch);
2. where and how it runs, settled into one frozen Run that every later step takes by name
   (fastformer.train.run.settle): the device and backend, checked to be there, the model's memory
   on the device, autocast, torchrun, CUDA graphs or torch.compile (fastformer.train.runtime), the
   run's options with the device's batch size, and the checkpoint --resume continues from;
3. the vocab, trained (train_run_vocab, the long part) only now that every input has been checked;
4. the model, the loaders (loaders), the optimizer and the schedule, restored from the checkpoint
   under --resume (_trainer);
5. the run directory (fastformer.train.rundir), created or its run.json extended by rank 0 once every
   process has checked its inputs (_open_run_dir);
6. with --pad-to-buckets, the Triton kernels of every batch shape compiled before the first step
   (fastformer.train.warmup; --precompile);
7. the epochs, each ending in a checkpoint, and a checkpoint where --max-steps stops the run
   inside an epoch (_train_epochs).
So a bad file or option leaves nothing behind.
"""

import contextlib
import dataclasses
import errno
import itertools
import os
import shutil
import tempfile
import threading
import time
import warnings
from collections.abc import Callable

import torch

from fastformer import backend, kernels, packing
from fastformer.config import Config
from fastformer.data.files import check_labels, cut, read_reviews, shared_reviews
from fastformer.data.reviews import LengthBucketSampler, MovieDataSet, ShardedBatchSampler, movie_collate_fn
from fastformer.data.vocab import N_SPECIAL, known_pieces, load_vocab, train_vocab
from fastformer.model import MovieClassification
from fastformer.train.checks import check_values
from fastformer.train.graphs import GraphedSteps, make_capturable
from fastformer.train.loop import (
    NonFiniteLossError,
    adamw,
    autocast,
    evaluate,
    keep_form,
    linear_warmup_decay_scheduler,
    predict_proba,
    train_epoch,
)
from fastformer.train.run import (
    CHECKS,
    TrainOptions,
    check_activations_fit,
    check_backend,
    check_demo_options,
    check_fits_device,
    check_inputs,
    check_on_device,
    check_run_options,
    check_texts,
    default_config,
    eager_because,
    run_dir_held,
    settle,
    size_names,
)
from fastformer.train.rundir import (
    LOCK,
    RUNS,
    check_run_json,
    create_run_dir,
    last_checkpoint_message,
    load_run,
    load_state_dict,
    mark_latest,
    pinned_digests,
    publish,
    resolve_run,
    save_checkpoint,
    shell_word,
    still_training,
    unfinished,
    went_away,
    write_file,
    write_json,
)
from fastformer.train.runtime import (
    barrier,
    kernels_in_use,
    process_group,
    replicated,
    resolve_amp,
    resolve_device,
    rng_state,
    set_rng_state,
    step_mode,
)
from fastformer.train.warmup import bucket_shapes, warm_up
from fastformer.version import __version__

LABEL_NAMES = {2: ["negative", "positive"]}


def quiet_if_none(log):
    """A job's `log`: print (the default), any callable taking a line, or None for no output."""
    if log is None:
        return lambda *_args, **_kwargs: None
    if not callable(log):
        raise TypeError(f"log must be a callable taking a line of text, or None, got {type(log).__name__}")
    return log


def label_names(n_output):
    return LABEL_NAMES.get(n_output, [str(i) for i in range(n_output)])


# train


def train(options=None, *, log=print, **kwargs):
    """Train MovieClassification end to end and write a run directory; returns its metrics dict.

    `options` is a TrainOptions; keyword arguments are its fields and override them, so
    `train(epochs=3, lr=1e-3)` and `train(TrainOptions(epochs=3, lr=1e-3))` are the same run.
    `log` takes each line the job reports, the epochs' included (print by default; None: none; the
    progress bars, on stderr, show while an epoch runs).
    With no data arguments it runs on the embedded demo set; `dataset="rotten-tomatoes"` takes the
    files `fastformer data rotten-tomatoes` prepared; with `train` only, 10% of it is held out as
    the test split. `n_output` is the number of classes (default: the config's), or "auto" to infer
    it from the training labels. `max_steps` stops the run after that many optimizer steps in
    all (the schedule still spans `epochs`), with a checkpoint there, inside an epoch if need be.
    `resume` continues a run directory up to `epochs` in total, from the step where it stopped,
    exactly as if it had not stopped; it refuses options that differ from the run's, and data files
    that differ from those it started on. Options left None take the run's values on resume, else
    DEFAULTS. Launched by torchrun, it trains with DistributedDataParallel (see fastformer.train.runtime);
    otherwise it starts no process group. `cuda_graphs` replays each step from a CUDA graph
    (fastformer.train.graphs; CUDA only, bf16 or no autocast), `compile` runs the model through
    torch.compile(model, fullgraph=True), and `pad_to_buckets` pads batches to bucket lengths
    (default: on with cuda_graphs, which needs it); fastformer.train.run.step_modes and
    check_on_device say which combinations run. `precompile` compiles the kernels of the bucket
    shapes before the first step (default: on with pad_to_buckets) and `autotune` times every
    kernel config instead of each kernel's rule picking one (kernels.autotuning). None of them
    changes what the run trains beyond rounding, so a resumed run may change them.

    A run directory has one writer: the call holds its lock (fastformer.train.rundir.writing) from
    before the vocab is trained until it returns, and a run being written by another process is
    refused. Errors in the inputs raise ValueError/OSError before the vocab is trained and before
    anything is written. A NaN or infinite loss raises NonFiniteLossError and Ctrl-C KeyboardInterrupt, both
    naming the last checkpoint, which is kept.
    """
    log = quiet_if_none(log)
    options = TrainOptions(**kwargs) if options is None else dataclasses.replace(options, **kwargs)
    inputs = check_inputs(options)
    with run_dir_held(inputs):
        return train_inputs(inputs, log=log)


def train_inputs(inputs, *, log=print):
    """train() from its inputs as fastformer.train.run.check_inputs returned them: where and how the
    job runs, settled and checked before any work (fastformer.train.run.settle), then the run."""
    with backend.use_backend(inputs.options.backend_name):
        run = settle(inputs, log)
        autotune = kernels.autotuning(True) if inputs.options.autotune else contextlib.nullcontext()
        # the attention backward bitwise repeatable (no atomics): --resume's promise (docs/training.md)
        with process_group(run.launch, run.device), autotune, kernels.attention_backward("two-pass"):
            return _train(run)


_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES)  # where TMPDIR elsewhere helps


def _scratch_dir():
    """A new directory in $TMPDIR for what the run writes before its run directory takes it (the
    vocab); an OSError names the place."""
    try:
        return tempfile.mkdtemp(prefix="fastformer-")
    except OSError as error:
        raise OSError(
            f"cannot make a scratch directory in {tempfile.gettempdir()} ($TMPDIR, else the system's): "
            f"{error.strerror or error}; set TMPDIR to a directory with room"
        ) from None


def _in_scratch(error):
    """What to add to an error writing into the scratch directory: where it is and how to move it."""
    if getattr(error, "errno", None) in _FULL:
        return f" (the scratch directory, in {tempfile.gettempdir()}: set TMPDIR to a directory with room)"
    return ""


@dataclasses.dataclass
class _Trainer:
    """The model, what trains it, and where the training stands."""

    model: MovieClassification
    trained: torch.nn.Module  # the model as the steps call it: itself, in DDP, or compiled
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler | None  # with fp16 autocast
    graphs: GraphedSteps | None  # with cuda_graphs
    train_loader: torch.utils.data.DataLoader
    test_loader: torch.utils.data.DataLoader
    set_epoch: Callable
    steps_per_epoch: int
    first_step_seconds: float | None = None  # from the job's start to this invocation's first step done
    epoch: int = 0  # whole epochs done
    epoch_step: int = 0  # steps done of the next epoch (a run stopped inside it)
    epoch_stats: dict | None = None  # train_epoch's figures of those steps
    step: int = 0  # optimizer steps done
    history: list = dataclasses.field(default_factory=list)  # a metrics dict per epoch done (or begun)


def _train(run):
    """The steps of train() after its inputs, under the backend and process group train_inputs set up."""
    inputs, data = run.inputs, run.inputs.data
    # rank 0's weights are every process's (DDP broadcasts them)
    torch.manual_seed(run.options.seed + run.launch.rank)
    scratch = _scratch_dir()
    try:
        vocab_file = run.options.vocab or os.path.join(scratch, "vocab.model")
        vocab = inputs.vocab
        if vocab is None:
            try:
                scratch_vocab = os.path.join(scratch, "vocab.model")
                vocab = train_run_vocab(run.options.vocab_size, data.train, run.launch, scratch_vocab, run.log)
            except OSError as error:
                raise OSError(f"{error}{_in_scratch(error)}") from None
        config = inputs.config
        if config is None:  # the default config, for the vocab's size
            config = default_config(run.device.type, vocab.get_piece_size(), data.n_classes)
            check_fits_device(inputs, config, run.device)
        trainer = _trainer(run, config, vocab)
        session = _session(run)
        run_info, where = _open_run_dir(run, config, vocab_file, trainer, session)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    _log_header(run, vocab, trainer.model, session, run_info, where)
    if run.precompile:
        _precompile(trainer, run)
    history = _train_epochs(trainer, run)
    metrics = {"epochs": history, "test_accuracy": history[-1]["test_accuracy"]}
    stopped = ""
    if trainer.epoch < run.epochs:
        stopped = f"; stopped by --max-steps {run.max_steps} {_position(trainer)}"
    run.log(
        f"test accuracy {metrics['test_accuracy']:.4f} on {len(data.test)} reviews{stopped}; run saved in {run.run_dir}"
    )
    if stopped:
        run.log(f"`fastformer train --resume {shell_word(run.run_dir)}` continues it")
    return metrics


def _precompile(trainer, run):
    """Compile the Triton kernels of the job's batch shapes before the first step (fastformer.train.warmup):
    a shape per bucket that the train and test reviews' lengths reach. Nothing where the kernels
    are not in use."""
    lengths = trainer.train_loader.dataset.lengths() + trainer.test_loader.dataset.lengths()
    shapes = bucket_shapes(trainer.model.config, run.options.batch_size, lengths)
    done = warm_up(trainer.model, shapes, device=run.device, amp=run.amp, progress=run.launch.rank == 0)
    if done["shapes"]:
        run.log(f"compiled the kernels of {done['shapes']} batch shapes in {done['seconds']:.0f} s")


def _position(trainer):
    """Where a stopped run stands, in words."""
    if trainer.epoch_step:
        return f"after step {trainer.epoch_step} of the {trainer.steps_per_epoch} of epoch {trainer.epoch + 1}"
    return f"after epoch {trainer.epoch}"


# The data once torch is there: the vocab trained on the reviews, and the loaders.


def train_run_vocab(n_pieces, reviews, launch, model_file, log):
    """The run's BPE vocab of n_pieces pieces (besides the special ones), trained on the train
    reviews' texts into `model_file` (check_inputs checked that it fits the config); in a torchrun
    job rank 0 trains it and sends the file to the other processes. Returns it loaded."""
    log(f"Training a BPE vocab of up to {n_pieces} + {N_SPECIAL} pieces on {len(reviews)} reviews")
    if launch.rank == 0:
        train_vocab(reviews.texts(), model_file, n_pieces=n_pieces, progress=True)
    if launch.distributed:
        model = [None]
        if launch.rank == 0:
            with open(model_file, "rb") as f:
                model = [f.read()]
        torch.distributed.broadcast_object_list(model, src=0)
        if launch.rank != 0:
            write_file(model_file, lambda f: f.write(model[0]))
    return load_vocab(model_file)


class _FromStep(torch.utils.data.Sampler):
    """The batches of a batch sampler from its `skip`-th on (skip is set by the loaders' set_epoch):
    the epoch's batches are drawn in full, as an uninterrupted epoch draws them, and the first
    `skip` left out, so a run resumed inside an epoch trains on the batches it had not."""

    def __init__(self, batches):
        self.batches = batches
        self.skip = 0

    def __len__(self):
        return len(self.batches) - self.skip

    def __iter__(self):
        return itertools.islice(iter(self.batches), self.skip, None)


def loaders(config, vocab, train_reviews, test_reviews, batch_size, bucket, seed, launch, pad_to_buckets=False):
    """The train and test loaders, and set_epoch(epoch, skip=0), which fixes the train order of an
    epoch from (seed, epoch) alone and leaves out its first `skip` batches, so a resumed run sees
    the batches an uninterrupted one would. Drawing them touches no global RNG: the loaders have
    generators of their own, so the dropout masks a run draws do not depend on where it resumed.
    In a torchrun job the batches are drawn at batch_size * world_size and shared out among the
    processes (ShardedBatchSampler), and each process evaluates every world_size-th test review.
    With pad_to_buckets, batches are padded to bucket_length of their longest review."""
    progress = launch.rank == 0
    train_set = MovieDataSet(
        vocab, train_reviews, max_len=config.n_enc_seq, progress=progress, name="the train reviews"
    )
    test_set = MovieDataSet(vocab, test_reviews, max_len=config.n_enc_seq, progress=progress, name="the test reviews")
    bucket_max_len = config.n_enc_seq if pad_to_buckets else None

    def collate(batch):
        return movie_collate_fn(batch, i_pad=config.i_pad, bucket_max_len=bucket_max_len)

    drawn = batch_size * launch.world_size
    # A DataLoader draws a seed for its workers from its generator each epoch (from the global RNG
    # without one); with no workers it is unused.
    generator = torch.Generator()
    if bucket:
        batches = LengthBucketSampler(train_set.lengths(), drawn, shuffle=True, seed=seed)
        order_epoch = batches.set_epoch
    else:
        # what DataLoader(shuffle=True, generator=generator) builds, the generator also seeding its iterators
        shuffled = torch.utils.data.RandomSampler(train_set, generator=generator)
        batches = torch.utils.data.BatchSampler(shuffled, drawn, drop_last=False)

        def order_epoch(epoch):
            generator.manual_seed(seed + epoch)

    if launch.distributed:
        batches = ShardedBatchSampler(batches, launch.world_size, launch.rank)
        test_set = torch.utils.data.Subset(test_set, range(launch.rank, len(test_set), launch.world_size))
    batches = _FromStep(batches)

    def set_epoch(epoch, skip=0):
        order_epoch(epoch)
        batches.skip = skip

    train_loader = torch.utils.data.DataLoader(
        train_set, batch_sampler=batches, collate_fn=collate, generator=generator
    )
    test_loader = torch.utils.data.DataLoader(
        test_set, batch_size=batch_size, shuffle=False, collate_fn=collate, generator=torch.Generator()
    )
    return train_loader, test_loader, set_epoch


def _trainer(run, config, vocab):
    """The model on the device, the loaders, AdamW (weight decay on the weight matrices only) and
    the warm-up and decay schedule over the run's epochs, restored from the checkpoint under
    --resume; and the model as the steps call it."""
    options, data = run.options, run.inputs.data
    train_loader, test_loader, set_epoch = loaders(
        config,
        vocab,
        data.train,
        data.test,
        options.batch_size,
        options.bucket,
        options.seed,
        run.launch,
        run.pad_to_buckets,
    )
    # before the model is built and the run directory written: a step's activations must fit too
    longest = max(train_loader.dataset.lengths(), default=1)
    check_activations_fit(config, options.batch_size, longest, run.device, run.amp, size_names(run.inputs.options))
    model = MovieClassification(config).to(run.device)
    # fused, eager or replayed: a CUDA graph captures the fused form too, made capturable below
    optimizer = adamw(model, options.lr, options.weight_decay, fused=True)
    # The schedule spans the run's epochs; --max-steps only says where this invocation stops, so that
    # a run stopped there and resumed trains as one that was not.
    total_steps = run.epochs * len(train_loader)
    scheduler = linear_warmup_decay_scheduler(optimizer, int(options.warmup * total_steps), total_steps)
    scaler = torch.amp.GradScaler(run.device.type) if run.amp == "fp16" else None
    trainer = _Trainer(
        model, model, optimizer, scheduler, scaler, None, train_loader, test_loader, set_epoch, len(train_loader)
    )
    if run.checkpoint is not None:
        _restore(trainer, run)
    # a checkpoint holds the form it was written in: fused or not, capturable or not
    make_capturable(keep_form(optimizer, fused=True), run.cuda_graphs)
    trainer.trained = replicated(model, run.launch, run.device)
    if run.cuda_graphs:
        trainer.graphs = GraphedSteps(model, optimizer, amp=run.amp)
    if run.compile:
        trainer.trained = torch.compile(trainer.trained, fullgraph=True)
    return trainer


def _restore(trainer, run):
    """Load a checkpoint (load_checkpoint's) into the trainer: the weights, the optimizer, the
    schedule and the scaler, where the training stands, and the RNG states."""
    model_state, model_file, state = run.checkpoint
    if state["epoch_step"] >= trainer.steps_per_epoch:
        raise ValueError(
            f"{os.path.dirname(model_file)} is at step {state['epoch_step']} of an epoch, but an epoch "
            f"of this run has {trainer.steps_per_epoch} steps"
        )
    load_state_dict(trainer.model, model_state, model_file)
    trainer.optimizer.load_state_dict(state["optimizer"])
    trainer.scheduler.load_state_dict(state["scheduler"])
    if trainer.scaler is not None and state["scaler"]:
        trainer.scaler.load_state_dict(state["scaler"])
    trainer.epoch, trainer.step, trainer.history = state["epoch"], state["step"], state["history"]
    trainer.epoch_step, trainer.epoch_stats = state["epoch_step"], state["epoch_stats"]
    set_rng_state(state["rng"], run.device, run.launch)


def _session(run):
    """What run.json records of this invocation: the run's start, or one --resume of it."""
    return {
        "fastformer": __version__,
        "epochs": run.epochs,
        "max_steps": run.max_steps,
        "device": str(run.device),
        "backend": backend.get_backend(),
        "kernels": kernels_in_use(run.device, run.amp),
        "amp": run.amp,
        **run.step_modes(),
        "autotune": kernels.autotune_enabled(),  # --autotune or FASTFORMER_AUTOTUNE=1
        "world_size": run.launch.world_size,
    }


def _open_run_dir(run, config, vocab_file, trainer, session):
    """Create the new run's directory, or add this session to the resumed run's run.json: by rank 0,
    once every process has checked its inputs. Returns the run.json and the header's line on the
    directory."""
    inputs, run_dir = run.inputs, run.run_dir
    # the directory holds the job's lock file: anything else is a run this one replaces (check_out)
    replaces = not run.resuming and bool(set(os.listdir(run_dir)) - {LOCK})
    barrier(run.launch)
    if not run.resuming:
        dataset = inputs.options.dataset or ("demo" if inputs.using_demo else None)
        run_info = {
            **dataclasses.asdict(run.options),
            **session,
            "demo_data": inputs.using_demo,
            "dataset": dataset,
            "label_names": label_names(config.n_output),
            "data_sha256": inputs.digests,
            "resumed": [],
        }
        if run.launch.rank == 0:
            run_info = create_run_dir(run_dir, vocab_file, config, run_info)
            mark_latest(run_dir)
        return run_info, f"{run_dir}{' (replacing a run that stopped before its first checkpoint)' if replaces else ''}"
    previous = inputs.previous
    resumed = [*previous.get("resumed", []), {"from_epoch": trainer.epoch, "from_step": trainer.step, **session}]
    # a run.json without the digests gets them now, for the next --resume
    pins = pinned_digests(run_dir) if run.launch.rank == 0 else {}
    run_info = {"data_sha256": inputs.digests, **pins, **previous, "epochs": run.epochs, "resumed": resumed}
    if run.launch.rank == 0:
        write_json(os.path.join(run_dir, "run.json"), run_info)
        mark_latest(run_dir)
        if trainer.history:  # a kill between a checkpoint and its copies leaves these one epoch behind
            publish(run_dir, inputs.checkpoint, trainer.history)
    return run_info, f"{run_dir} (resumed {_position(trainer)})"


def _log_header(run, vocab, model, session, run_info, where):
    n_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    config = model.config
    threads = f", {torch.get_num_threads()} CPU thread(s)" if run.device.type == "cpu" else ""
    processes = f", {run.launch.world_size} processes under torchrun" if run.launch.distributed else ""
    dataset = {"demo": " (the embedded demo set)", "rotten-tomatoes": " (Rotten Tomatoes snippets)"}.get(
        run_info.get("dataset", "demo" if run_info["demo_data"] else None), ""
    )
    run.log(
        f"fastformer train: {len(run.inputs.data.train)} train / {len(run.inputs.data.test)} test reviews{dataset}, "
        f"vocab {vocab.get_piece_size()} pieces"
    )
    run.log(
        f"  model    MovieClassification, {n_params / 1e6:.2f} M parameters: n_layer={config.n_layer} "
        f"d_hidn={config.d_hidn} n_head={config.n_head} d_ff={config.d_ff}"
    )
    # on a device without CUDA there is nothing to say of CUDA graphs: run.json alone keeps the reason
    why = run.eager_because if run.device.type == "cuda" else None
    steps = step_mode(run.cuda_graphs, run.compile, run.pad_to_buckets, why)
    run.log(
        f"  device   {run.device}{threads}{processes}, {session['kernels']} kernels (backend "
        f"{session['backend']!r}), amp {run.amp}{steps}"
    )
    run.log(f"  run dir  {where}")


def _train_epochs(trainer, run):
    """Train the epochs left, up to max_steps steps in all, each evaluated and saved as a checkpoint
    by rank 0, as is the part of an epoch where max_steps stops the run; returns the history. An
    error writing, a NaN loss or Ctrl-C names the last checkpoint."""
    last, max_steps = run.inputs.checkpoint, run.max_steps
    try:
        for epoch in range(trainer.epoch, run.epochs):
            if max_steps is not None and trainer.step >= max_steps:
                break
            record = _epoch(trainer, epoch, run, last)
            if trainer.history and trainer.history[-1]["epoch"] == record["epoch"]:
                trainer.history.pop()  # the part of this epoch trained before the run was resumed
            trainer.history.append(record)
            if record["complete"]:
                trainer.epoch, trainer.epoch_step, trainer.epoch_stats = epoch + 1, 0, None
            state = _trainer_state(trainer, run)
            if run.launch.rank == 0:
                last = save_checkpoint(run.run_dir, trainer.model, state, previous=last)
                publish(run.run_dir, last, trainer.history)
                run.log(_epoch_line(record, run.epochs, trainer.steps_per_epoch))  # the epoch's bars are closed
            if not record["complete"]:
                break
    except OSError as error:
        raise OSError(went_away(run.run_dir, last) or f"{error}; {last_checkpoint_message(last)}") from None
    except KeyboardInterrupt:
        if run.launch.rank != 0:  # rank 0 alone saves, so it alone knows the last checkpoint, and says it
            raise KeyboardInterrupt() from None
        raise KeyboardInterrupt(
            f"{last_checkpoint_message(last)}; `fastformer train --resume {shell_word(run.run_dir)}` continues"
        ) from None
    return trainer.history


def _epoch_line(record, epochs, steps_per_epoch):
    """The line an epoch ends with; one stopped by --max-steps says how far it went."""
    epoch = f"epoch {record['epoch']}/{epochs}"
    if not record["complete"]:
        epoch += f" stopped after {record['epoch_steps']} of its {steps_per_epoch} steps"
    first = record.get("first_step_seconds")
    return (
        f"{epoch}  train loss {record['train_loss']:.4f} acc {record['train_accuracy']:.3f}  "
        f"test loss {record['test_loss']:.4f} acc {record['test_accuracy']:.3f}  "
        f"{record['tokens_per_s']:,.0f} tok/s  {record['seconds']:.1f} s"
        + (f"  (first step done {first:.1f} s after the job started)" if first is not None else "")
    )


def _rate_of_step(scheduler, step):
    """The learning rate optimizer step `step` (from 0) of the run trained at, as its LambdaLR gives it."""
    return float(scheduler.base_lrs[0] * scheduler.lr_lambdas[0](step))


def _epoch(trainer, epoch, run, last):
    """Train epoch `epoch` (from 0), from the step where the run stopped inside it if it did, up to
    its end or max_steps, and evaluate the model after it; returns its record for the history.
    `last` is the last checkpoint, which a NaN loss names."""
    skip, epochs, max_steps = trainer.epoch_step, run.epochs, run.max_steps
    trainer.set_epoch(epoch, skip)
    # the rate of the epoch's first step ("lr"; "lr_end" its last step's): 0.0 at the run's first, in warm-up
    lr_now = float(trainer.scheduler.get_last_lr()[0])  # a tensor under --cuda-graphs: one sync an epoch
    if skip and trainer.history and trainer.history[-1]["epoch"] == epoch + 1:
        lr_now = trainer.history[-1]["lr"]  # the epoch's first
    timed = trainer.first_step_seconds is None  # this invocation's first epoch: time its first step

    def first_step():
        trainer.first_step_seconds = time.monotonic() - run.inputs.started

    try:
        train_stats = train_epoch(
            trainer.trained,
            trainer.train_loader,
            trainer.optimizer,
            trainer.scheduler,
            device=run.device,
            amp=run.amp,
            scaler=trainer.scaler,
            max_steps=None if max_steps is None else max_steps - trainer.step,
            desc=f"Train {epoch + 1}/{epochs}",
            graphs=trainer.graphs,
            first_step=first_step if timed else None,
        )
    except NonFiniteLossError as error:
        step = trainer.step + error.step
        raise NonFiniteLossError(
            f"the loss is {error.loss} at step {skip + error.step} of epoch {epoch + 1} (step {step} of the run): "
            f"training stopped; {last_checkpoint_message(last)}",
            step,
            error.loss,
        ) from None
    trainer.step += train_stats["steps"]
    trainer.epoch_step = skip + train_stats["steps"]
    train_stats = _joined(trainer.epoch_stats, train_stats)
    complete = trainer.epoch_step == trainer.steps_per_epoch
    trainer.epoch_stats = None if complete else train_stats
    evaluated = trainer.trained if run.compile else trainer.model
    test_stats = evaluate(
        evaluated,
        trainer.test_loader,
        device=run.device,
        amp=run.amp,
        desc=f"Test  {epoch + 1}/{epochs}",
        graphs=trainer.graphs,
    )
    return {
        "epoch": epoch + 1,
        "steps": trainer.step,
        "epoch_steps": trainer.epoch_step,
        "complete": complete,
        "lr": lr_now,
        "lr_end": _rate_of_step(trainer.scheduler, trainer.step - 1),
        "train_loss": train_stats["loss"],
        "train_accuracy": train_stats["accuracy"],
        "test_loss": test_stats["loss"],
        "test_accuracy": test_stats["accuracy"],
        "tokens_per_s": train_stats["tokens_per_s"],
        "seconds": train_stats["seconds"],
        # the job's start (its inputs' checks) to its first step done, in the epoch that took it
        "first_step_seconds": trainer.first_step_seconds if timed else None,
    }


def _joined(before, after):
    """train_epoch's figures of one epoch trained in two parts (`before`: None when it was not)."""
    if before is None:
        return after
    reviews, tokens, seconds = (before[k] + after[k] for k in ("reviews", "tokens", "seconds"))
    return {
        "loss": (before["loss"] * before["reviews"] + after["loss"] * after["reviews"]) / max(reviews, 1),
        "accuracy": (before["accuracy"] * before["reviews"] + after["accuracy"] * after["reviews"]) / max(reviews, 1),
        "steps": before["steps"] + after["steps"],
        "reviews": reviews,
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
    }


def _trainer_state(trainer, run):
    """trainer.pt of a checkpoint: where the training stands, with what continues it exactly (a
    collective under torchrun: rng_state)."""
    return {
        "optimizer": trainer.optimizer.state_dict(),
        "scheduler": trainer.scheduler.state_dict(),
        "scaler": trainer.scaler.state_dict() if trainer.scaler is not None else None,
        "epoch": trainer.epoch,
        "epoch_step": trainer.epoch_step,
        "epoch_stats": trainer.epoch_stats,
        "step": trainer.step,
        "history": trainer.history,
        "rng": rng_state(run.device, run.launch),
    }


# evaluate, predict, demo


def evaluate_run(
    *, run, test=None, batch_size=128, device=None, backend_name="auto", amp="auto", cuda_graphs=None, log=print
):
    """Accuracy and loss of a saved run on a test file (default: the run's own test file). Its
    batches are replayed from CUDA graphs, one per bucket length (their encoder ids padded to
    bucket lengths, fastformer.data.reviews.bucket_length), where `cuda_graphs` says so, or where
    it is None and they apply (CUDA, bf16 or no autocast); the last line says how they ran."""
    log = quiet_if_none(log)
    check_run_options(device, backend_name, amp, batch_size)
    check_values({"cuda_graphs": cuda_graphs}, CHECKS)
    packing.check_environment()  # the ops' variables and FASTFORMER_PACKING
    run = _run_dir(run, log)
    device = resolve_device(device)
    check_backend(backend_name, kernels.HAS_TRITON)
    check_on_device(device, backend_name, kernels.INTERPRET)
    amp = resolve_amp(amp, device)
    why = eager_because(device, amp, False, False, None)
    if cuda_graphs and why:
        raise ValueError(f"--cuda-graphs cannot run here: {why}")
    replay = why is None if cuda_graphs is None else cuda_graphs
    with backend.use_backend(backend_name):
        # a --test that cannot be read is reported before the model loads
        reviews = read_reviews(test, "test", progress=True) if test is not None else None
        config, vocab, model, info = load_run(run, device)
        _say_if_training(run, log)
        if test is None:
            check_run_json(os.path.join(run, "run.json"), info, required=("test",))
            test = info["test"]
        if test is None:
            raise ValueError(f"{run} was trained with a held-out split of --train; pass --test FILE")
        if reviews is None:
            reviews = read_reviews(test, "test", progress=True)
        check_labels(reviews, config.n_output, f"test file {test}")
        if reviews.sha256 == (info.get("data_sha256") or {}).get("train"):
            warnings.warn(
                f"--test {test} holds the bytes of the file the run trained on (the same sha256): this accuracy is "
                "on reviews the model learnt, not a test of it",
                stacklevel=2,
            )
        else:
            _warn_if_trained_on(reviews, test, info.get("train"))
        dataset = MovieDataSet(
            vocab,
            reviews,
            max_len=config.n_enc_seq,
            name=f"test file {test}",
            advice="evaluate reads them with the run's vocab.model: give --test a file of texts, or of its pieces",
        )
        bucket = config.n_enc_seq if replay else None  # a graph a bucket length, not a review length
        loader = torch.utils.data.DataLoader(
            dataset,
            batch_size=batch_size,
            collate_fn=lambda b: movie_collate_fn(b, i_pad=config.i_pad, bucket_max_len=bucket),
        )
        graphs = GraphedSteps(model, amp=amp) if replay else None
        stats = evaluate(model, loader, device=device, amp=amp, desc="Test", graphs=graphs)
    said = why and cuda_graphs is None and device.type == "cuda"  # on a CPU, nothing to say of CUDA graphs
    how = "CUDA graphs" if replay else f"eager ({why})" if said else "eager"
    log(f"accuracy {stats['accuracy']:.4f}  loss {stats['loss']:.4f}  on {stats['n']} reviews from {test}; {how}")
    return stats


def _warn_if_trained_on(reviews, test, train):
    """Warn with the count where some or all of the test reviews are the run's train file's (the
    same text, up to case and white space: rows copied over, or the file saved again with CRLF line
    endings or a byte-order mark). A train file no longer there, or unreadable, is not checked."""
    if train is None or not os.path.isfile(train):
        return
    try:
        with warnings.catch_warnings():  # its reading's own notes (skipped reviews) were said in training
            warnings.simplefilter("ignore")
            shared = shared_reviews(read_reviews(train, "train"), reviews)
    except (OSError, ValueError):
        return
    if shared:
        which = "all" if shared == len(reviews) else f"{shared} of the {len(reviews)}"
        warnings.warn(
            f"{which} reviews of --test {test} are also in the file the run trained on, {train} (the same text, up "
            "to case and white space): this accuracy counts them, reviews the model learnt",
            stacklevel=3,
        )


def predict(*, run, texts, device=None, backend_name="auto", amp="auto", log=print):
    """The predicted label and its probability for each text; returns [(label_name, prob)]. `texts`:
    a str (one text) or an iterable of str, read once; an empty or whitespace-only text, or one with
    no piece the run's vocab knows (emoji, another script), raises ValueError, a value that is not
    text TypeError."""
    log = quiet_if_none(log)
    texts = check_texts(texts)
    check_run_options(device, backend_name, amp)
    packing.check_environment()  # the ops' variables and FASTFORMER_PACKING
    run = _run_dir(run, log)
    device = resolve_device(device)
    check_backend(backend_name, kernels.HAS_TRITON)
    check_on_device(device, backend_name, kernels.INTERPRET)
    with backend.use_backend(backend_name):
        config, vocab, model, info = load_run(run, device)
        for i, text in enumerate(texts):  # as a blank text: the model would read nothing and still answer
            if not known_pieces(vocab, text):
                raise ValueError(
                    f"text {i + 1} of {len(texts)} ({cut(text)!r}) has no piece the run's vocab knows: the model "
                    "would read [UNK] only; nothing to classify"
                )
        _say_if_training(run, log)
        probs = predict_proba(
            model, vocab, texts, device=device, amp=resolve_amp(amp, device), max_len=config.n_enc_seq
        )
    names = info.get("label_names") or label_names(config.n_output)
    results = []
    for text, p in zip(texts, probs):
        label = int(p.argmax())
        results.append((names[label], float(p[label])))
        log(f"{names[label]:>8}  {float(p[label]):.3f}  {one_line(text)}")
    return results


def one_line(text):
    """A text as predict prints it, one line whatever it holds: as it is where every character of it
    prints, else as Python writes the string (quoted, a newline as \\n), so that a text with a
    line break or a control character in it is still one line, and one that says so."""
    return text if text.isprintable() else repr(text)


def _run_dir(run, log):
    """The run directory `run` names (run_dir.resolve_run: "last" is the run runs/latest points at),
    said when it is not `run` itself, with why it is not a finished run where it is not one."""
    found = resolve_run(run)
    if found != run:
        note = unfinished(found)
        log(f"run {found} ({RUNS}/latest){f': {note}' if note else ''}")
    return found


def _say_if_training(run, log):
    note = still_training(run)
    if note is not None:
        log(f"note: {note}; its model.pt is that checkpoint's")


@contextlib.contextmanager
def _still_running(what, log, enabled, every=15.0):
    """While the block runs (when `enabled`), a line every `every` seconds saying that `what` still
    runs and for how long, then one with the time it took: the progress of a pass that takes
    minutes, as one through Triton's interpreter does."""
    if not enabled:
        yield
        return
    done = threading.Event()
    start = time.perf_counter()

    def tick():
        while not done.wait(every):
            log(f"  ...      {what} still running, {time.perf_counter() - start:.0f} s")

    ticker = threading.Thread(target=tick, name=f"fastformer-{what}-progress", daemon=True)
    ticker.start()
    try:
        yield
    finally:
        done.set()
        ticker.join()
    log(f"  ...      {what} done in {time.perf_counter() - start:.1f} s")


def demo(*, device=None, backend_name="auto", amp="auto", batch_size=8, seq_len=64, seed=0, log=print):
    """Build the tutorial's MovieClassification, run one forward and backward on a batch of random
    reviews under autocast (`amp` as `fastformer train` takes it: "auto" is what train would use),
    and say what happened. Returns the loss, the gradient norm and the seconds the two passes took."""
    log = quiet_if_none(log)
    check_demo_options(device, backend_name, amp, batch_size, seq_len, seed)
    device = resolve_device(device)
    check_backend(backend_name, kernels.HAS_TRITON)
    check_on_device(device, backend_name, kernels.INTERPRET)
    with backend.use_backend(backend_name):
        torch.manual_seed(seed)
        config = Config.tutorial()
        model = MovieClassification(config).to(device)
        n_params = sum(p.numel() for p in model.parameters() if p.requires_grad)

        # Reviews of random lengths, padded to the batch maximum; the decoder reads [BOS] (id 2).
        lengths = torch.randint(seq_len // 4, seq_len + 1, (batch_size,), device=device)
        enc_inputs = torch.randint(4, config.n_enc_vocab, (batch_size, seq_len), device=device)
        enc_inputs = enc_inputs.masked_fill(torch.arange(seq_len, device=device) >= lengths[:, None], config.i_pad)
        dec_inputs = torch.full((batch_size, 1), 2, device=device)
        labels = torch.randint(0, config.n_output, (batch_size,), device=device)

        amp = resolve_amp(amp, device)  # auto: bf16 on a CUDA GPU that has it, as `fastformer train`
        with autocast(device, amp):
            uses_triton = backend.uses_triton(enc_inputs)
        log(f"fastformer {__version__}: tutorial MovieClassification, {n_params / 1e6:.2f} M trainable parameters")
        log(
            f"  config   n_layer={config.n_layer} d_hidn={config.d_hidn} n_head={config.n_head} "
            f"d_head={config.d_head} d_ff={config.d_ff}"
        )
        log(
            f"  device   {device}, amp {amp}, backend {backend.get_backend()!r} -> "
            f"{'Triton kernels' if uses_triton else 'PyTorch reference'}"
        )
        log(
            f"  batch    {batch_size} reviews, lengths {lengths.min().item()}..{lengths.max().item()} "
            f"padded to {seq_len}"
        )

        interpreted = uses_triton and kernels.INTERPRET
        if interpreted:
            log(
                "  note     the Triton kernels run through Triton's interpreter (TRITON_INTERPRET=1): minutes on a "
                "CPU at this size (--batch-size 2 --seq-len 16 is quicker); each pass says how long it has run"
            )
        model.train()
        start = time.perf_counter()
        with _still_running("forward", log, interpreted), autocast(device, amp):
            logits = model(enc_inputs, dec_inputs)[0]
            loss = torch.nn.functional.cross_entropy(logits, labels)
        with _still_running("backward", log, interpreted):
            loss.backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - start
    grad_norm = torch.sqrt(sum((p.grad.float() ** 2).sum() for p in model.parameters() if p.grad is not None))
    log(f"  forward  logits {tuple(logits.shape)}, loss {loss.item():.4f}")
    log(f"  backward gradient norm {grad_norm.item():.4f} over {n_params / 1e6:.2f} M parameters")
    log(f"  time     {seconds * 1e3:.1f} ms for forward + backward")
    return {"loss": loss.item(), "grad_norm": grad_norm.item(), "seconds": seconds}
