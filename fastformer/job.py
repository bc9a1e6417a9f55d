"""The jobs behind the `fastformer` commands, which only parse their arguments into these calls and
print their errors: `train` (the tutorial's NSMC sentiment pipeline: SentencePiece vocab,
MovieClassification, cross-entropy, per-epoch evaluation, in one call), `evaluate_run`, `predict`
and `demo`.

train runs in steps, a function each:
1. the options (fastformer.options) and the files that are not data, of a new run (_new_run) or of
   the run --resume continues (_resumed_run);
2. the data and its classes (fastformer.job_data.read_data);
3. the vocab, trained (the long part) only now that every input has been checked;
4. the model, the loaders, the optimizer and the schedule, restored from the checkpoint under
   --resume (_trainer);
5. the run directory (fastformer.run_dir), created or its run.json extended by rank 0 once every
   process has checked its inputs (_open_run_dir);
6. the epochs, each ending in a checkpoint (_train_epochs).
So a bad file or option leaves nothing behind. Where and how it runs (the device, autocast,
torchrun, CUDA graphs or torch.compile) is fastformer.runtime's.
"""
import dataclasses
import os
import shutil
import tempfile
import time
from typing import Callable, NamedTuple, Optional

import torch
from tqdm.auto import tqdm

from fastformer import backend
from fastformer.config import Config
from fastformer.data.reviews import MovieDataSet, check_labels, movie_collate_fn, read_reviews
from fastformer.data.vocab import check_vocab_matches, load_vocab
from fastformer.graphs import GraphedSteps, make_capturable
from fastformer.job_data import dataset_files, loaders, read_data, train_run_vocab
from fastformer.model import MovieClassification
from fastformer.options import (
    DEFAULTS,
    RUN_OPTIONS,
    TrainOptions,
    check_positive,
    check_resumable,
    check_world_size,
    default_out,
    new_run_options,
    resumed_options,
)
from fastformer.run_dir import (
    check_out,
    create_run_dir,
    last_checkpoint_message,
    latest_checkpoint,
    load_checkpoint,
    load_config,
    load_run,
    load_run_files,
    load_run_json,
    load_state_dict,
    publish,
    save_checkpoint,
    write_json,
)
from fastformer.runtime import (
    Launch,
    barrier,
    check_step_options,
    kernels_in_use,
    process_group,
    quiet,
    replicated,
    resolve_amp,
    resolve_device,
    rng_state,
    set_rng_state,
    step_mode,
    torchrun_launch,
)
from fastformer.training import (
    NonFiniteLossError,
    autocast,
    evaluate,
    linear_warmup_decay_scheduler,
    predict_proba,
    train_epoch,
)
from fastformer.version import __version__

# The tutorial's model is the CUDA default; on a CPU the job trains this smaller one (same shape
# of network, 3 layers of width 128) so that the default run finishes in a few minutes.
CPU_OVERRIDES = {"n_layer": 3, "d_hidn": 128, "n_head": 4, "d_head": 32, "d_ff": 512, "n_enc_seq": 128, "n_dec_seq": 8}
LABEL_NAMES = {2: ["negative", "positive"]}


def label_names(n_output):
    return LABEL_NAMES.get(n_output, [str(i) for i in range(n_output)])


def default_config(device, n_vocab, n_output):
    overrides = {} if device.type == "cuda" else CPU_OVERRIDES
    return Config.tutorial(n_enc_vocab=n_vocab, n_dec_vocab=n_vocab, n_output=n_output, **overrides)


# train


def train(options=None, *, log=print, **kwargs):
    """Train MovieClassification end to end and write a run directory; returns its metrics dict.

    `options` is a TrainOptions; keyword arguments are its fields and override them, so
    `train(epochs=3, lr=1e-3)` and `train(TrainOptions(epochs=3, lr=1e-3))` are the same run.
    With no data arguments it runs on the embedded demo set; `dataset="rotten-tomatoes"` takes the
    files `fastformer data rotten-tomatoes` prepared; with `train` only, 10% of it is held out as
    the test split. `n_output` is the number of classes (default: the config's), or "auto" to infer
    it from the training labels. `resume` continues a run directory up to `epochs` in total,
    exactly as if it had not stopped; it refuses options that differ from the run's. Options left
    None take the run's values on resume, else DEFAULTS. Launched by torchrun, it trains with
    DistributedDataParallel (see fastformer.runtime); otherwise it starts no process group.
    `cuda_graphs` replays each step from a CUDA graph (fastformer.graphs; CUDA only, bf16 or no
    autocast), `compile` runs the model through torch.compile(model, fullgraph=True), and
    `pad_to_buckets` pads batches to bucket lengths (default: on with cuda_graphs, which needs it);
    check_step_options says which combinations run. None of them changes what the run trains, so
    a resumed run may change them.

    Errors in the inputs raise ValueError/OSError before anything is written. A NaN or infinite
    loss raises NonFiniteLossError and Ctrl-C KeyboardInterrupt, both naming the last checkpoint,
    which is kept.
    """
    options = TrainOptions(**kwargs) if options is None else dataclasses.replace(options, **kwargs)
    options.check()
    if options.dataset is not None:
        options.train, options.test = dataset_files(options.dataset, options.train, options.test)
    launch = torchrun_launch()
    device = resolve_device(options.device, launch.local_rank)
    amp = resolve_amp(options.amp, device)
    with backend.use_backend(options.backend_name):
        pad_to_buckets = check_step_options(
            device, amp, kernels_in_use(device, amp), launch, cuda_graphs=options.cuda_graphs,
            compile=options.compile, pad_to_buckets=options.pad_to_buckets,
        )
        steps = {"cuda_graphs": options.cuda_graphs, "compile": options.compile, "pad_to_buckets": pad_to_buckets}
        with process_group(launch, device):
            return _train(options, _Env(device, amp, launch, steps, log if launch.rank == 0 else quiet))


class _Env(NamedTuple):
    """How this process runs the job, settled by train() before any file is read."""

    device: torch.device
    amp: str  # "bf16", "fp16" or "off"
    launch: Launch
    steps: dict  # cuda_graphs, compile and pad_to_buckets, checked together
    log: Callable  # `log` on rank 0, quiet on the others


class _Start(NamedTuple):
    """Where a run starts, once its options and the files that are not data are checked."""

    options: dict  # the values of RUN_OPTIONS
    epochs: int  # in total
    run_dir: str
    config: Optional[Config]  # None: the default config, built once the vocab is known
    vocab: object  # the SentencePiece vocab, or None: trained on the data
    checkpoint: Optional[tuple]  # load_checkpoint's (model state, its file, trainer state)
    previous: Optional[dict]  # the run.json of the run resumed; None for a new run
    using_demo: bool


@dataclasses.dataclass
class _Trainer:
    """The model, what trains it, and where the training stands."""

    model: MovieClassification
    trained: torch.nn.Module  # the model as the steps call it: itself, in DDP, or compiled
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: Optional[torch.amp.GradScaler]  # with fp16 autocast
    graphs: Optional[GraphedSteps]  # with cuda_graphs
    train_loader: torch.utils.data.DataLoader
    test_loader: torch.utils.data.DataLoader
    set_epoch: Callable
    epoch: int = 0  # epochs done
    step: int = 0  # optimizer steps done
    history: list = dataclasses.field(default_factory=list)  # a metrics dict per epoch done


def _train(options, env):
    """The steps of train(), under the backend and process group it set up."""
    resuming = options.resume is not None
    start = _resumed_run(options, env.launch) if resuming else _new_run(options, env.device)
    torch.manual_seed(start.options["seed"] + env.launch.rank)  # rank 0's weights are every process's (DDP broadcasts them)
    data = read_data(start.options, start.config, resuming)
    scratch = tempfile.mkdtemp(prefix="fastformer-")
    try:
        vocab_file = start.options["vocab"] or os.path.join(scratch, "vocab.model")
        vocab = start.vocab
        if vocab is None:
            vocab = train_run_vocab(start.options, start.config, data.train, env.launch,
                                    os.path.join(scratch, "vocab.model"), env.log)
        config = start.config
        if config is None:
            config = default_config(env.device, vocab.get_piece_size(), data.n_classes)
        trainer = _trainer(config, vocab, data, start, env, options.max_steps)
        session = _session(options, start, env)
        run_info, where = _open_run_dir(options, start, config, vocab_file, trainer, session, env)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    _log_header(env, data, vocab, trainer.model, session, run_info, where)
    history = _train_epochs(trainer, start, env, options.max_steps)
    metrics = {"epochs": history, "test_accuracy": history[-1]["test_accuracy"]}
    env.log(f"test accuracy {metrics['test_accuracy']:.4f} on {len(data.test)} reviews; run saved in {start.run_dir}")
    return metrics


def _new_run(options, device):
    """The start of a new run: its options, the config and vocab given (checked together), and its
    directory, checked to be one it can create."""
    run_options, using_demo = new_run_options(options.given(), device)
    config = load_config(options.config, f"--config {options.config}") if options.config is not None else None
    vocab = load_vocab(options.vocab) if options.vocab is not None else None
    if vocab is not None and config is not None:
        check_vocab_matches(vocab, config, "--vocab")
    run_dir = options.out or default_out()
    check_out(run_dir)
    return _Start(run_options, options.epochs or DEFAULTS["epochs"], run_dir, config, vocab, None, None, using_demo)


def _resumed_run(options, launch):
    """The start of the run `options.resume` continues: its options (any given must be the run's),
    config, vocab and latest checkpoint, and the epochs and steps left to train."""
    resume = options.resume
    previous = load_run_json(resume, required=("epochs", "demo_data", *RUN_OPTIONS))
    run_options = resumed_options(resume, previous, options.given())
    check_world_size(resume, previous, launch)
    epochs = options.epochs or previous["epochs"]
    config, vocab = load_run_files(resume)
    checkpoint = load_checkpoint(resume)
    check_resumable(resume, checkpoint, epochs, options.max_steps)
    return _Start(run_options, epochs, resume, config, vocab, checkpoint, previous, previous["demo_data"])


def _trainer(config, vocab, data, start, env, max_steps):
    """The model on the device, the loaders, AdamW (weight decay on the weight matrices only) and
    the warm-up and decay schedule over the run's steps, restored from the checkpoint under
    --resume; and the model as the steps call it."""
    options, steps = start.options, env.steps
    train_loader, test_loader, set_epoch = loaders(
        config, vocab, data.train, data.test, options["batch_size"], options["bucket"], options["seed"], env.launch,
        steps["pad_to_buckets"],
    )
    model = MovieClassification(config).to(env.device)
    decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": options["weight_decay"]}, {"params": no_decay, "weight_decay": 0.0}],
        lr=options["lr"],
    )
    total_steps = start.epochs * len(train_loader)
    total_steps = total_steps if max_steps is None else min(max_steps, total_steps)
    scheduler = linear_warmup_decay_scheduler(optimizer, int(options["warmup"] * total_steps), total_steps)
    scaler = torch.amp.GradScaler(env.device.type) if env.amp == "fp16" else None
    trainer = _Trainer(model, model, optimizer, scheduler, scaler, None, train_loader, test_loader, set_epoch)
    if start.checkpoint is not None:
        _restore(trainer, start.checkpoint, env)
    make_capturable(optimizer, steps["cuda_graphs"])  # a checkpoint holds the form it was written in
    trainer.trained = replicated(model, env.launch, env.device)
    if steps["cuda_graphs"]:
        trainer.graphs = GraphedSteps(model, optimizer, amp=env.amp)
    if steps["compile"]:
        trainer.trained = torch.compile(trainer.trained, fullgraph=True)
    return trainer


def _restore(trainer, checkpoint, env):
    """Load a checkpoint (load_checkpoint's) into the trainer: the weights, the optimizer, the
    schedule and the scaler, where the training stands, and the RNG states."""
    model_state, model_file, state = checkpoint
    load_state_dict(trainer.model, model_state, model_file)
    trainer.optimizer.load_state_dict(state["optimizer"])
    trainer.scheduler.load_state_dict(state["scheduler"])
    if trainer.scaler is not None and state["scaler"]:
        trainer.scaler.load_state_dict(state["scaler"])
    trainer.epoch, trainer.step, trainer.history = state["epoch"], state["step"], state["history"]
    set_rng_state(state["rng"], env.device, env.launch)


def _session(options, start, env):
    """What run.json records of this invocation: the run's start, or one --resume of it."""
    return {
        "fastformer": __version__,
        "epochs": start.epochs,
        "max_steps": options.max_steps,
        "device": str(env.device),
        "backend": backend.get_backend(),
        "kernels": kernels_in_use(env.device, env.amp),
        "amp": env.amp,
        **env.steps,
        "world_size": env.launch.world_size,
    }


def _open_run_dir(options, start, config, vocab_file, trainer, session, env):
    """Create the new run's directory, or add this session to the resumed run's run.json: by rank 0,
    once every process has checked its inputs. Returns the run.json and the header's line on the
    directory."""
    run_dir = start.run_dir
    replaces = options.resume is None and os.path.isdir(run_dir) and bool(os.listdir(run_dir))
    barrier(env.launch)
    if options.resume is None:
        dataset = options.dataset or ("demo" if start.using_demo else None)
        run_info = {
            **start.options, **session, "demo_data": start.using_demo, "dataset": dataset,
            "label_names": label_names(config.n_output), "resumed": [],
        }
        if env.launch.rank == 0:
            create_run_dir(run_dir, vocab_file, config, run_info)
        return run_info, f"{run_dir}{' (replacing a run that stopped before its first checkpoint)' if replaces else ''}"
    resumed = [*start.previous.get("resumed", []), {"from_epoch": trainer.epoch, **session}]
    run_info = {**start.previous, "epochs": start.epochs, "resumed": resumed}
    if env.launch.rank == 0:
        write_json(os.path.join(run_dir, "run.json"), run_info)
        if trainer.history:  # a kill between a checkpoint and its copies leaves these one epoch behind
            publish(run_dir, latest_checkpoint(run_dir), trainer.history)
    return run_info, f"{run_dir} (resumed after epoch {trainer.epoch})"


def _log_header(env, data, vocab, model, session, run_info, where):
    n_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    config = model.config
    threads = f", {torch.get_num_threads()} CPU thread(s)" if env.device.type == "cpu" else ""
    processes = f", {env.launch.world_size} processes under torchrun" if env.launch.distributed else ""
    dataset = {"demo": " (the embedded demo set)", "rotten-tomatoes": " (Rotten Tomatoes snippets)"}.get(
        run_info.get("dataset", "demo" if run_info["demo_data"] else None), ""
    )
    env.log(f"fastformer train: {len(data.train)} train / {len(data.test)} test reviews{dataset}, "
            f"vocab {vocab.get_piece_size()} pieces")
    env.log(
        f"  model    MovieClassification, {n_params / 1e6:.2f} M parameters: n_layer={config.n_layer} "
        f"d_hidn={config.d_hidn} n_head={config.n_head} d_ff={config.d_ff}"
    )
    env.log(f"  device   {env.device}{threads}{processes}, {session['kernels']} kernels (backend "
            f"{session['backend']!r}), amp {env.amp}{step_mode(**env.steps)}")
    env.log(f"  run dir  {where}")


def _train_epochs(trainer, start, env, max_steps):
    """Train the epochs left (up to max_steps steps), each evaluated and saved as a checkpoint by
    rank 0; returns the history. An error writing, a NaN loss or Ctrl-C names the last checkpoint."""
    last = latest_checkpoint(start.run_dir) if start.previous is not None else None
    try:
        for epoch in range(trainer.epoch, start.epochs):
            if max_steps is not None and trainer.step >= max_steps:
                break
            record = _epoch(trainer, epoch, start.epochs, env, max_steps, last)
            trainer.history.append(record)
            trainer.epoch = epoch + 1
            state = _trainer_state(trainer, env)
            if env.launch.rank == 0:
                last = save_checkpoint(start.run_dir, trainer.model, state)
                publish(start.run_dir, last, trainer.history)
                tqdm.write(
                    f"epoch {epoch + 1}/{start.epochs}  train loss {record['train_loss']:.4f} "
                    f"acc {record['train_accuracy']:.3f}  test loss {record['test_loss']:.4f} "
                    f"acc {record['test_accuracy']:.3f}  {record['tokens_per_s']:,.0f} tok/s  "
                    f"{record['seconds']:.1f} s"
                )
    except OSError as error:
        raise OSError(f"{error}; {last_checkpoint_message(last)}") from None
    except KeyboardInterrupt:
        raise KeyboardInterrupt(
            f"{last_checkpoint_message(last)}; `fastformer train --resume {start.run_dir}` continues"
        ) from None
    return trainer.history


def _epoch(trainer, epoch, epochs, env, max_steps, last):
    """Train epoch `epoch` (from 0) and evaluate the model after it; returns its record for the
    history. `last` is the last checkpoint, which a NaN loss names."""
    trainer.set_epoch(epoch)
    lr_now = float(trainer.scheduler.get_last_lr()[0])  # a tensor under --cuda-graphs: one sync an epoch
    try:
        train_stats = train_epoch(
            trainer.trained, trainer.train_loader, trainer.optimizer, trainer.scheduler, device=env.device,
            amp=env.amp, scaler=trainer.scaler, max_steps=None if max_steps is None else max_steps - trainer.step,
            desc=f"Train {epoch + 1}/{epochs}", graphs=trainer.graphs,
        )
    except NonFiniteLossError as error:
        step = trainer.step + error.step
        raise NonFiniteLossError(
            f"{error} of epoch {epoch + 1} (step {step} of the run): training stopped; {last_checkpoint_message(last)}",
            step, error.loss,
        ) from None
    trainer.step += train_stats["steps"]
    evaluated = trainer.trained if env.steps["compile"] else trainer.model
    test_stats = evaluate(evaluated, trainer.test_loader, device=env.device, amp=env.amp,
                          desc=f"Test  {epoch + 1}/{epochs}", graphs=trainer.graphs)
    return {
        "epoch": epoch + 1,
        "steps": trainer.step,
        "lr": lr_now,
        "train_loss": train_stats["loss"],
        "train_accuracy": train_stats["accuracy"],
        "test_loss": test_stats["loss"],
        "test_accuracy": test_stats["accuracy"],
        "tokens_per_s": train_stats["tokens_per_s"],
        "seconds": train_stats["seconds"],
    }


def _trainer_state(trainer, env):
    """trainer.pt of the checkpoint of the epochs done (a collective under torchrun: rng_state)."""
    return {
        "optimizer": trainer.optimizer.state_dict(),
        "scheduler": trainer.scheduler.state_dict(),
        "scaler": trainer.scaler.state_dict() if trainer.scaler is not None else None,
        "epoch": trainer.epoch,
        "step": trainer.step,
        "history": trainer.history,
        "rng": rng_state(env.device, env.launch),
    }


# evaluate, predict, demo


def evaluate_run(*, run, test=None, batch_size=128, device=None, backend_name="auto", amp="auto", log=print):
    """Accuracy and loss of a saved run on a test file (default: the run's own test file)."""
    check_positive(batch_size=batch_size)
    with backend.use_backend(backend_name):
        config, vocab, model, info = load_run(run, device)
        device = next(model.parameters()).device
        test = test or info.get("test")
        if test is None:
            raise ValueError(f"{run} was trained with a held-out split of --train; pass --test FILE")
        reviews = read_reviews(test, "test")
        check_labels(reviews, config.n_output, f"test file {test}")
        dataset = MovieDataSet(vocab, reviews, max_len=config.n_enc_seq)
        loader = torch.utils.data.DataLoader(
            dataset, batch_size=batch_size, collate_fn=lambda b: movie_collate_fn(b, i_pad=config.i_pad)
        )
        stats = evaluate(model, loader, device=device, amp=resolve_amp(amp, device), desc="Test")
    log(f"accuracy {stats['accuracy']:.4f}  loss {stats['loss']:.4f}  on {stats['n']} reviews from {test}")
    return stats


def predict(*, run, texts, device=None, backend_name="auto", amp="auto", log=print):
    """The predicted label and its probability for each text; returns [(label_name, prob)]. An
    empty or whitespace-only text raises ValueError."""
    if not texts:
        raise ValueError("give at least one text to classify")
    with backend.use_backend(backend_name):
        config, vocab, model, info = load_run(run, device)
        device = next(model.parameters()).device
        probs = predict_proba(
            model, vocab, texts, device=device, amp=resolve_amp(amp, device), max_len=config.n_enc_seq
        )
    names = info.get("label_names") or label_names(config.n_output)
    results = []
    for text, p in zip(texts, probs):
        label = int(p.argmax())
        results.append((names[label], float(p[label])))
        log(f"{names[label]:>8}  {float(p[label]):.3f}  {text}")
    return results


def demo(*, device=None, backend_name="auto", batch_size=8, seq_len=64, seed=0, log=print):
    """Build the tutorial's MovieClassification, run one forward and backward on a batch of random
    reviews under the autocast `fastformer train` would use, and say what happened. Returns the
    loss, the gradient norm and the seconds the two passes took."""
    check_positive(batch_size=batch_size, seq_len=seq_len)
    device = resolve_device(device)
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

        amp = resolve_amp("auto", device)  # bf16 on a CUDA GPU that has it, as `fastformer train`
        with autocast(device, amp):
            uses_triton = backend.uses_triton(enc_inputs)
        log(f"fastformer {__version__}: tutorial MovieClassification, {n_params / 1e6:.2f} M trainable parameters")
        log(f"  config   n_layer={config.n_layer} d_hidn={config.d_hidn} n_head={config.n_head} "
            f"d_head={config.d_head} d_ff={config.d_ff}")
        log(f"  device   {device}, amp {amp}, backend {backend.get_backend()!r} -> "
            f"{'Triton kernels' if uses_triton else 'PyTorch reference'}")
        log(f"  batch    {batch_size} reviews, lengths {lengths.min().item()}..{lengths.max().item()} "
            f"padded to {seq_len}")

        model.train()
        start = time.perf_counter()
        with autocast(device, amp):
            logits = model(enc_inputs, dec_inputs)[0]
            loss = torch.nn.functional.cross_entropy(logits, labels)
        loss.backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - start
    grad_norm = torch.sqrt(sum((p.grad.float() ** 2).sum() for p in model.parameters() if p.grad is not None))
    log(f"  forward  logits {tuple(logits.shape)}, loss {loss.item():.4f}")
    log(f"  backward gradient norm {grad_norm.item():.4f} over {n_params / 1e6:.2f} M parameters")
    log(f"  time     {seconds * 1e3:.1f} ms for forward + backward")
    return {"loss": loss.item(), "grad_norm": grad_norm.item(), "seconds": seconds}
