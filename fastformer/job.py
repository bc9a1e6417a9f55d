"""The main job behind `fastformer train`, `evaluate` and `predict`: the tutorial's NSMC sentiment
pipeline (SentencePiece vocab, MovieClassification, cross-entropy, per-epoch evaluation) in one call.

A run directory holds everything needed to use or continue the model:

    config.json     the model's Config (Config.load reads it; the tutorial's classes accept it)
    vocab.model     the SentencePiece vocab
    run.json        data files, options, device, backend and amp, and those of each --resume
    checkpoint-N/   the checkpoint of epoch N: model.pt and trainer.pt (optimizer, schedule, scaler,
                    step, metrics so far, RNG states), written together as one directory
    model.pt        the latest checkpoint's state_dict: the tutorial's own MovieClassification loads it
    metrics.json    per-epoch loss, accuracy and tokens/s, and the final test accuracy
    curves.png      loss and accuracy per epoch

Every input is checked before the directory is created, so a bad file or option leaves nothing.
The directory appears in one step, with config.json, vocab.model and run.json; each epoch then
writes checkpoint-N into a staging directory that is renamed into place, so a crash at any point
leaves the previous checkpoint or the new one, never a mix. A run killed before its first
checkpoint can be resumed (it starts again) or replaced by a new run with the same --out.

Under torchrun (`torchrun --nproc_per_node N -m fastformer train ...`) each process trains a
DistributedDataParallel replica: the process group comes from the environment torchrun sets (nccl
on CUDA, each process on the GPU of its LOCAL_RANK; gloo on a CPU), --batch-size is per process,
and every batch of batch_size * N reviews is shared out by ShardedBatchSampler, so N processes at
batch b train on the batches one process draws at N * b. Rank 0 trains the vocab and sends it to
the others, and alone writes the run directory and shows progress; the metrics are summed over the
processes. A checkpoint keeps every process's RNG state, and --resume needs the same N.

How each step runs (check_step_options): eagerly by default; with --cuda-graphs, as replays of
CUDA graphs captured once per batch shape (fastformer.graphs), the loaders padding the encoder ids
to bucket lengths (fastformer.data.reviews.bucket_length) so that there are few shapes; with
--compile, through torch.compile(model, fullgraph=True). These, and --pad-to-buckets, change the
speed and the rounding, not the math: a run may resume with other values of them.
"""
import contextlib
import json
import math
import os
import random
import re
import shutil
import tempfile
import time
from typing import NamedTuple, Optional

import torch
from tqdm.auto import tqdm

from fastformer import backend
from fastformer.config import TUTORIAL, Config, check_config, read_json_object
from fastformer.data import demo, rotten_tomatoes
from fastformer.data.reviews import (
    BUCKET_MULTIPLE,
    LengthBucketSampler,
    MovieDataSet,
    ShardedBatchSampler,
    check_labels,
    infer_classes,
    movie_collate_fn,
    read_reviews,
)
from fastformer.data.vocab import N_SPECIAL, PAD, check_vocab_matches, load_vocab, train_vocab
from fastformer.graphs import GraphedSteps, make_capturable
from fastformer.model import MovieClassification
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
DEFAULTS = {"epochs": 5, "lr": 5e-4, "warmup": 0.1, "weight_decay": 0.01, "seed": 0, "vocab_size": 8000, "bucket": True}
# The options that make a run what it is: --resume refuses a value other than the run's for any.
RUN_OPTIONS = ("train", "test", "vocab", "vocab_size", "config", "n_output", "batch_size", "lr", "warmup",
               "weight_decay", "seed", "bucket")
PATH_OPTIONS = ("train", "test", "vocab", "config")
RUN_FILES = ("config.json", "vocab.model", "run.json")  # a run directory has these from its start
DATASETS = ("demo", "rotten-tomatoes")  # --dataset: the embedded set, or what `fastformer data` prepared
TORCHRUN_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE")
CHECKPOINT = re.compile(r"checkpoint-(\d+)")
STAGING = ".checkpoint.tmp"


def cpu_threads():
    """Threads for torch's CPU ops: $OMP_NUM_THREADS when set, else the cores this process may run
    on that are not already busy (their count less the 1-minute load average, at least 1). Threads
    that outnumber the free cores spin in OpenMP: on a 2-core machine shared with one other busy
    process, the CPU job ran 3.6x slower on 2 threads than on 1; on the idle machine, 2 threads ran
    it 2x faster than 1."""
    if "OMP_NUM_THREADS" in os.environ:
        return torch.get_num_threads()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    busy = round(os.getloadavg()[0]) if hasattr(os, "getloadavg") else 0
    return max(1, min(cores, cores - busy))


def resolve_device(name, local_rank=None):
    """The device `name` names (default: cuda if available, else cpu). In a torchrun job
    (`local_rank` given) a CUDA device is the GPU of the process's local rank."""
    if name is None:
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device: not a device: {name!r}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: CUDA is not available on this machine")
    if device.type == "cuda" and local_rank is not None:
        if device.index is not None:
            raise ValueError(f"--device {name}: under torchrun each process takes the GPU of its LOCAL_RANK; "
                             "pass --device cuda")
        device = torch.device("cuda", local_rank)
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


class Launch(NamedTuple):
    """Where this process stands: (rank, world_size, local_rank) in a torchrun job, and whether it
    is one; a plain run is (0, 1, None, False) and starts no process group."""

    rank: int = 0
    world_size: int = 1
    local_rank: Optional[int] = None
    distributed: bool = False


def torchrun_launch():
    """The Launch torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE) describes, or a plain one."""
    if not all(name in os.environ for name in TORCHRUN_ENV):
        return Launch()
    try:
        rank, local_rank, world_size = (int(os.environ[name]) for name in TORCHRUN_ENV)
    except ValueError:
        values = ", ".join(f"{name}={os.environ[name]!r}" for name in TORCHRUN_ENV)
        raise ValueError(f"torchrun's environment is not integers: {values}") from None
    if not 0 <= rank < world_size:
        raise ValueError(f"RANK {rank} is outside 0..WORLD_SIZE-1 (WORLD_SIZE {world_size})")
    return Launch(rank, world_size, local_rank, True)


@contextlib.contextmanager
def process_group(launch, device):
    """Join the torchrun job's process group for the block (nccl on CUDA, gloo on a CPU, set up from
    the environment) and leave it after; a plain run starts none."""
    if not launch.distributed:
        yield
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        yield
    finally:
        torch.distributed.destroy_process_group()


def _barrier(launch):
    if launch.distributed:
        torch.distributed.barrier()


def _quiet(*args, **kwargs):
    """The log of the processes other than rank 0."""


def resolve_amp(amp, device):
    """"auto" is bf16 autocast on a CUDA GPU that supports it, else off."""
    if amp == "auto":
        return "bf16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "off"
    return amp


def _kernels_in_use(device, amp):
    """Where attention and the feed-forward run under this device, amp and backend: "triton" or
    "reference" (the "auto" backend keeps fp32 off the kernels on CUDA, see fastformer.backend)."""
    with autocast(device, amp):
        return "triton" if backend.uses_triton(torch.empty(0, device=device)) else "reference"


def check_step_options(device, amp, kernels, launch, *, cuda_graphs, compile, pad_to_buckets):
    """Raise ValueError naming the option for a combination of --cuda-graphs, --compile and
    --pad-to-buckets that cannot run on this device, autocast ("bf16", "fp16", "off"), kernels
    ("triton" or "reference") and launch; return whether to pad to buckets (default: with
    --cuda-graphs, which needs it, and not otherwise)."""
    if cuda_graphs:
        if device.type != "cuda":
            raise ValueError(f"--cuda-graphs needs a CUDA device; the device is {device}")
        if compile:
            raise ValueError("--cuda-graphs and --compile are alternatives: pass one")
        if amp == "fp16":
            raise ValueError("--cuda-graphs does not take --amp fp16: its GradScaler reads the host at every step; "
                             "use --amp bf16 (the default on CUDA) or off")
        if pad_to_buckets is False:
            raise ValueError("--cuda-graphs needs --pad-to-buckets: a graph is captured per batch shape, and without "
                             "buckets every review length is a shape")
        if launch.distributed:
            raise ValueError("--cuda-graphs is not supported under torchrun")
    if compile:
        if device.type != "cuda" and kernels == "triton":
            raise ValueError(f"--compile on {device} needs the reference kernels: torch.compile cannot trace the "
                             "Triton kernels through Triton's CPU interpreter; pass --backend auto or reference")
        if launch.distributed:
            raise ValueError("--compile is not supported under torchrun")
    return cuda_graphs if pad_to_buckets is None else pad_to_buckets


def _step_mode(cuda_graphs, compile, pad_to_buckets):
    """How the steps run, for the header: "" for the default (eager, padded to the longest review)."""
    parts = ["CUDA graphs"] if cuda_graphs else ["torch.compile"] if compile else []
    if pad_to_buckets:
        parts.append(f"padded to multiples of {BUCKET_MULTIPLE}")
    return "".join(f", {part}" for part in parts)


def label_names(n_output):
    return LABEL_NAMES.get(n_output, [str(i) for i in range(n_output)])


def check_positive(**values):
    """Raise ValueError naming the first option given (not None) that is not a positive number."""
    for name, value in values.items():
        if value is not None and not value > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {value}")


# Files: written through a temporary name and synced, read with one-line errors naming the file.


def _reason(error):
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def _remove(path):
    with contextlib.suppress(FileNotFoundError):
        os.remove(path)


def _write_file(path, write, binary=True):
    """Call write(f) on a temporary file beside `path`, sync it to disk and rename it to `path`, so
    a crash leaves the old file or the new one. On failure the temporary file is removed, and an
    error writing raises OSError naming `path`."""
    tmp = f"{path}.tmp"
    try:
        with open(tmp, "wb") if binary else open(tmp, "w", encoding="utf-8") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except (OSError, RuntimeError) as error:  # torch.save reports some failed writes as RuntimeError
        _remove(tmp)
        raise OSError(f"could not write {path}: {_reason(error)}") from None
    except BaseException:
        _remove(tmp)
        raise


def _write_json(path, obj):
    def write(f):
        json.dump(obj, f, indent=2, default=str)
        f.write("\n")

    _write_file(path, write, binary=False)


def _sync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _load_torch(path):
    """torch.load to the CPU, with one-line errors naming the file: missing, empty, truncated or damaged."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
    except OSError as error:
        raise OSError(f"could not read {path}: {_reason(error)}") from None
    if size == 0:
        raise ValueError(f"{path} is empty (0 bytes)")
    try:
        return torch.load(path, map_location="cpu")
    except Exception as error:  # a damaged file fails as RuntimeError, OSError, EOFError, UnpicklingError, ...
        raise ValueError(
            f"{path} ({size} bytes) is not a readable PyTorch checkpoint: truncated or damaged ({type(error).__name__})"
        ) from None


def _load_state_dict(model, state, path):
    """Load `state` (read from `path`) into `model`, or raise ValueError naming the file and the
    first key that does not fit."""
    if not isinstance(state, dict):
        raise ValueError(f"{path} holds a {type(state).__name__}, not a model's state_dict")
    expected = model.state_dict()
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    reshaped = [k for k in expected if k in state and getattr(state[k], "shape", None) != expected[k].shape]
    if missing or unexpected or reshaped:
        if missing:
            problem = f"{len(missing)} parameter(s) missing, first {missing[0]}"
        elif unexpected:
            problem = f"{len(unexpected)} unexpected key(s), first {unexpected[0]}"
        else:
            key = reshaped[0]
            shape = tuple(getattr(state[key], "shape", ()))
            problem = f"{key} has shape {shape}, the config needs {tuple(expected[key].shape)}"
        raise ValueError(f"{path} does not fit config.json: {problem}")
    model.load_state_dict(state)


def _load_config(path, what):
    """Config.load and check_config, with errors naming `what` (the option or the file)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"config file not found: {path}")
    config = Config.load(path)
    try:
        check_config(config)
    except ValueError as error:
        raise ValueError(f"{what}: {error}") from None
    return config


def plot_curves(history, path):
    """Loss and accuracy per epoch, train and test, side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    epochs = [h["epoch"] for h in history]
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 4))
    try:
        for split in ("train", "test"):
            ax_loss.plot(epochs, [h[f"{split}_loss"] for h in history], marker="o", label=split)
            ax_acc.plot(epochs, [h[f"{split}_accuracy"] for h in history], marker="o", label=split)
        ax_loss.set(xlabel="epoch", ylabel="cross-entropy", title="loss")
        ax_acc.set(xlabel="epoch", ylabel="accuracy", title="accuracy")
        for ax in (ax_loss, ax_acc):
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.legend()
            ax.grid(alpha=0.3)
        fig.tight_layout()
        _write_file(path, lambda f: fig.savefig(f, format="png", dpi=100))
    finally:
        plt.close(fig)


# Checkpoints


def _checkpoint_epochs(run_dir):
    """The epochs of the checkpoint-N directories in `run_dir`, in order."""
    return sorted(
        int(match.group(1))
        for name in os.listdir(run_dir)
        if (match := CHECKPOINT.fullmatch(name)) and os.path.isdir(os.path.join(run_dir, name))
    )


def latest_checkpoint(run_dir):
    """The path of the run's latest checkpoint-N directory, or None before its first epoch ended."""
    epochs = _checkpoint_epochs(run_dir)
    return os.path.join(run_dir, f"checkpoint-{epochs[-1]}") if epochs else None


def _rng_state(device, launch):
    """This process's RNG states; in a torchrun job {"ranks": [every process's, by rank]} (a
    collective: every process calls it)."""
    state = {"torch": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state_all() if device.type == "cuda" else None}
    if not launch.distributed:
        return state
    states = [None] * launch.world_size
    torch.distributed.all_gather_object(states, state)
    return {"ranks": states}


def _set_rng_state(state, device, launch):
    if "ranks" in state:
        state = state["ranks"][launch.rank]
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and state["cuda"] is not None:
        torch.cuda.set_rng_state_all(state["cuda"])


def _save_checkpoint(run_dir, model, trainer):
    """Write checkpoint-<epoch> (model.pt, trainer.pt) as one unit and drop the older checkpoints.
    Returns its path."""
    staging = os.path.join(run_dir, STAGING)
    final = os.path.join(run_dir, f"checkpoint-{trainer['epoch']}")
    state_dict = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    shutil.rmtree(staging, ignore_errors=True)  # left by a run killed while saving
    try:
        os.mkdir(staging)
        _write_file(os.path.join(staging, "model.pt"), lambda f: torch.save(state_dict, f))
        _write_file(os.path.join(staging, "trainer.pt"), lambda f: torch.save(trainer, f))
        os.rename(staging, final)
        _sync_dir(run_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    for epoch in _checkpoint_epochs(run_dir):
        if epoch != trainer["epoch"]:
            shutil.rmtree(os.path.join(run_dir, f"checkpoint-{epoch}"))
    return final


def _publish(run_dir, checkpoint, history):
    """Copy a checkpoint's model.pt to the top of the run directory, with its metrics and curves."""
    def copy_model(f):
        with open(os.path.join(checkpoint, "model.pt"), "rb") as src:
            shutil.copyfileobj(src, f)

    _write_file(os.path.join(run_dir, "model.pt"), copy_model)
    _write_json(os.path.join(run_dir, "metrics.json"), {"epochs": history, "test_accuracy": history[-1]["test_accuracy"]})
    plot_curves(history, os.path.join(run_dir, "curves.png"))


def _load_checkpoint(run_dir):
    """(model state_dict, its file, trainer state) of the run's latest checkpoint, or None if it has none."""
    path = latest_checkpoint(run_dir)
    if path is None:
        if os.path.exists(os.path.join(run_dir, "model.pt")):
            raise ValueError(f"{run_dir} has a model.pt but no checkpoint-N directory to resume from")
        return None
    trainer_file = os.path.join(path, "trainer.pt")
    trainer = _load_torch(trainer_file)
    keys = ("optimizer", "scheduler", "scaler", "epoch", "step", "history", "rng")
    missing = [k for k in keys if not isinstance(trainer, dict) or k not in trainer]
    if missing:
        raise ValueError(f"{trainer_file} lacks {', '.join(missing)}")
    if f"checkpoint-{trainer['epoch']}" != os.path.basename(path):
        raise ValueError(f"{trainer_file} is from epoch {trainer['epoch']}, not the epoch its directory names")
    model_file = os.path.join(path, "model.pt")
    return _load_torch(model_file), model_file, trainer


# The run directory


def _load_run_json(run_dir, required=()):
    if not os.path.isdir(run_dir):
        raise FileNotFoundError(f"run directory not found: {run_dir}")
    missing = [f for f in RUN_FILES if not os.path.isfile(os.path.join(run_dir, f))]
    if missing:
        raise ValueError(f"{run_dir} is not a fastformer run directory (missing {', '.join(missing)})")
    path = os.path.join(run_dir, "run.json")
    run_info = read_json_object(path, "run file")
    missing = [key for key in required if key not in run_info]
    if missing:
        raise ValueError(f"{path} lacks {', '.join(missing)}")
    return run_info


def _is_unstarted_run(path):
    """Whether `path` is a run directory killed or stopped before its first checkpoint."""
    names = set(os.listdir(path))
    return set(RUN_FILES) <= names <= {*RUN_FILES, STAGING}


def _check_out(run_dir):
    """Raise ValueError unless `run_dir` can become the new run's directory: absent, empty, or a run
    that stopped before its first checkpoint (which the new run replaces)."""
    if os.path.exists(run_dir):
        if not os.path.isdir(run_dir):
            raise ValueError(f"--out {run_dir} is a file, not a directory")
        if os.listdir(run_dir) and not _is_unstarted_run(run_dir):
            raise ValueError(f"--out {run_dir} exists and is not empty; choose another, or --resume it")
        return
    parent = os.path.dirname(os.path.abspath(run_dir))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"--out {run_dir}: cannot create it, {parent} is not a writable directory")


def _create_run_dir(run_dir, vocab_file, config, run_info):
    """Make the run directory in one step: config.json, vocab.model and run.json are written into
    a staging directory beside it, which is then renamed into place."""
    run_dir = os.path.abspath(run_dir)
    staging = os.path.join(os.path.dirname(run_dir), f".{os.path.basename(run_dir)}.tmp")
    shutil.rmtree(staging, ignore_errors=True)  # left by a run killed while creating it
    try:
        os.makedirs(staging)
        shutil.copyfile(vocab_file, os.path.join(staging, "vocab.model"))
        _write_json(os.path.join(staging, "config.json"), config)
        _write_json(os.path.join(staging, "run.json"), run_info)
        if os.path.isdir(run_dir):  # empty, or a run that never reached a checkpoint (see _check_out)
            shutil.rmtree(run_dir)
        os.rename(staging, run_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _resumed_options(resume, previous, given):
    """The run's options from its run.json; ValueError naming every given option that differs."""
    conflicts = []
    for name, value in given.items():
        if value is not None and (os.path.abspath(value) if name in PATH_OPTIONS else value) != previous[name]:
            conflicts.append((name, value, previous[name]))
    if conflicts:
        ours = ", ".join(f"--{name.replace('_', '-')} {value}" for name, value, _ in conflicts)
        theirs = ", ".join(f"{name} {value}" for name, _, value in conflicts)
        raise ValueError(
            f"--resume {resume}: {ours} {'differs' if len(conflicts) == 1 else 'differ'} from the run's ({theirs}); "
            "leave them out to continue the run as it started, or start a new run"
        )
    return {name: previous[name] for name in RUN_OPTIONS}


def default_config(device, n_vocab, n_output):
    overrides = {} if device.type == "cuda" else CPU_OVERRIDES
    return Config.tutorial(n_enc_vocab=n_vocab, n_dec_vocab=n_vocab, n_output=n_output, **overrides)


def _split(reviews, fraction, seed):
    order = list(range(len(reviews)))
    random.Random(seed).shuffle(order)
    n_test = max(1, int(len(reviews) * fraction))
    if n_test >= len(reviews):
        raise ValueError(f"--train has {len(reviews)} reviews: too few to hold out a test split; pass --test")
    return [reviews[i] for i in order[n_test:]], [reviews[i] for i in order[:n_test]]


def _loaders(config, vocab, train_reviews, test_reviews, batch_size, bucket, seed, launch, pad_to_buckets=False):
    """The train and test loaders, and set_epoch(epoch), which fixes the train order of an epoch
    from (seed, epoch) alone, so a resumed run sees the batches an uninterrupted one would. In a
    torchrun job the batches are drawn at batch_size * world_size and shared out among the
    processes (ShardedBatchSampler), and each process evaluates every world_size-th test review.
    With pad_to_buckets, batches are padded to bucket_length of their longest review."""
    progress = launch.rank == 0
    train_set = MovieDataSet(vocab, train_reviews, max_len=config.n_enc_seq, progress=progress)
    test_set = MovieDataSet(vocab, test_reviews, max_len=config.n_enc_seq, progress=progress)
    bucket_max_len = config.n_enc_seq if pad_to_buckets else None

    def collate(batch):
        return movie_collate_fn(batch, i_pad=config.i_pad, bucket_max_len=bucket_max_len)

    drawn = batch_size * launch.world_size
    if bucket:
        batches = LengthBucketSampler(train_set.lengths(), drawn, shuffle=True, seed=seed)
        set_epoch, generator = batches.set_epoch, None
    else:
        # what DataLoader(shuffle=True, generator=generator) builds, the generator also seeding its iterators
        generator = torch.Generator()
        shuffled = torch.utils.data.RandomSampler(train_set, generator=generator)
        batches = torch.utils.data.BatchSampler(shuffled, drawn, drop_last=False)

        def set_epoch(epoch):
            generator.manual_seed(seed + epoch)

    if launch.distributed:
        batches = ShardedBatchSampler(batches, launch.world_size, launch.rank)
        test_set = torch.utils.data.Subset(test_set, range(launch.rank, len(test_set), launch.world_size))
    train_loader = torch.utils.data.DataLoader(
        train_set, batch_sampler=batches, collate_fn=collate, generator=generator
    )
    test_loader = torch.utils.data.DataLoader(test_set, batch_size=batch_size, shuffle=False, collate_fn=collate)
    return train_loader, test_loader, set_epoch


def _check_labels(reviews, n_classes, source, hint):
    try:
        check_labels(reviews, n_classes, source)
    except ValueError as error:
        raise ValueError(f"{error}{hint}") from None


def _dataset_files(dataset, train, test):
    """The (train, test) files of --dataset: (None, None) for the embedded demo set, the files
    `fastformer data rotten-tomatoes` wrote to its default cache; ValueError beside --train or
    --test, or when those files are not there."""
    if dataset not in DATASETS:
        raise ValueError(f"--dataset must be one of {', '.join(DATASETS)}, got {dataset!r}")
    if train is not None or test is not None:
        raise ValueError(f"--dataset {dataset} and --train/--test are alternatives: pass one or the other")
    if dataset == "demo":
        return None, None
    files = rotten_tomatoes.split_files()
    missing = next((path for path in files.values() if not os.path.isfile(path)), None)
    if missing is not None:
        raise ValueError(
            f"--dataset {dataset}: {missing} not found; run `fastformer data rotten-tomatoes` first "
            "(it downloads 2.5 MB with pip), or pass the files with --train and --test"
        )
    return files["train"], files["test"]


def _check_world_size(resume, previous, launch):
    """--resume needs the number of processes the run trained on: it fixes the batches and steps."""
    trained_on = previous.get("world_size", 1)
    if trained_on != launch.world_size:
        how = f"torchrun --nproc_per_node {trained_on} -m fastformer train" if trained_on > 1 else "fastformer train"
        raise ValueError(
            f"--resume {resume}: the run trained on {trained_on} process(es), this job has {launch.world_size}; "
            f"continue it with `{how} --resume {resume}`"
        )


def _shared_vocab(launch, reviews, model_file, n_pieces):
    """train_vocab on the reviews' texts into `model_file`; in a torchrun job rank 0 trains it and
    sends the file to the other processes. Returns the loaded vocab."""
    if launch.rank == 0:
        train_vocab((r.doc for r in reviews), model_file, n_pieces=n_pieces)
    if launch.distributed:
        model = [None]
        if launch.rank == 0:
            with open(model_file, "rb") as f:
                model = [f.read()]
        torch.distributed.broadcast_object_list(model, src=0)
        if launch.rank != 0:
            _write_file(model_file, lambda f: f.write(model[0]))
    return load_vocab(model_file)


def _replicated(model, launch, device):
    """`model` wrapped in DistributedDataParallel in a torchrun job (its construction broadcasts
    rank 0's weights); the model itself in a plain run."""
    if not launch.distributed:
        return model
    device_ids = [device.index] if device.type == "cuda" else None
    return torch.nn.parallel.DistributedDataParallel(model, device_ids=device_ids)


def train(
    *, train=None, test=None, dataset=None, vocab=None, config=None, n_output=None, epochs=None, batch_size=None,
    lr=None, device=None, backend_name="auto", amp="auto", out=None, seed=None, max_steps=None, resume=None,
    vocab_size=None, warmup=None, weight_decay=None, bucket=None, cuda_graphs=False, compile=False,
    pad_to_buckets=None, log=print,
):
    """Train MovieClassification end to end and write a run directory; returns its metrics dict.

    With no data arguments it runs on the embedded demo set; `dataset="rotten-tomatoes"` takes the
    files `fastformer data rotten-tomatoes` prepared; with `train` only, 10% of it is held out as
    the test split. `n_output` is the number of classes (default: the config's), or "auto" to infer
    it from the training labels. `resume` continues a run directory up to `epochs` in total,
    exactly as if it had not stopped; it refuses options that differ from the run's. Options left
    None take the run's values on resume, else DEFAULTS. Launched by torchrun, it trains with
    DistributedDataParallel (see the module docstring); otherwise it starts no process group.
    `cuda_graphs` replays each step from a CUDA graph (fastformer.graphs; CUDA only, bf16 or no
    autocast), `compile` runs the model through torch.compile(model, fullgraph=True), and
    `pad_to_buckets` pads batches to bucket lengths (default: on with cuda_graphs, which needs it);
    check_step_options says which combinations run. None of them changes what the run trains, so
    a resumed run may change them.

    Errors in the inputs raise ValueError/OSError before anything is written. A NaN or infinite
    loss raises NonFiniteLossError and Ctrl-C KeyboardInterrupt, both naming the last checkpoint,
    which is kept.
    """
    check_positive(epochs=epochs, batch_size=batch_size, lr=lr, max_steps=max_steps, vocab_size=vocab_size)
    if lr is not None and not math.isfinite(lr):
        raise ValueError(f"--lr must be a finite number, got {lr}")
    if weight_decay is not None and not (math.isfinite(weight_decay) and weight_decay >= 0):
        raise ValueError(f"--weight-decay must be a finite number >= 0, got {weight_decay}")
    if warmup is not None and not 0 <= warmup < 1:
        raise ValueError(f"--warmup is a fraction of the steps in [0, 1), got {warmup}")
    if n_output is not None and n_output != "auto" and not (isinstance(n_output, int) and n_output > 0):
        raise ValueError(f"--n-output must be a positive integer or auto, got {n_output!r}")
    if dataset is not None:
        train, test = _dataset_files(dataset, train, test)
    launch = torchrun_launch()
    device = resolve_device(device, launch.local_rank)
    given = {
        "train": train, "test": test, "vocab": vocab, "vocab_size": vocab_size, "config": config,
        "n_output": n_output, "batch_size": batch_size, "lr": lr, "warmup": warmup,
        "weight_decay": weight_decay, "seed": seed, "bucket": bucket,
    }
    amp = resolve_amp(amp, device)
    with backend.use_backend(backend_name):
        pad_to_buckets = check_step_options(device, amp, _kernels_in_use(device, amp), launch, cuda_graphs=cuda_graphs,
                                            compile=compile, pad_to_buckets=pad_to_buckets)
        with process_group(launch, device):
            return _train(
                given, dataset=dataset, epochs=epochs, out=out, max_steps=max_steps, resume=resume, device=device,
                amp=amp, launch=launch, log=log if launch.rank == 0 else _quiet,
                steps={"cuda_graphs": cuda_graphs, "compile": compile, "pad_to_buckets": pad_to_buckets},
            )


def _train(given, *, dataset, epochs, out, max_steps, resume, device, amp, launch, log, steps):
    """The body of train() for the options `given` (RUN_OPTIONS, None where not given), on `device`
    under the backend and process group train() set up; `steps` holds the options of how the steps
    run (cuda_graphs, compile, pad_to_buckets), already checked."""
    # 1. options, and the files that are not data: all checked before any long work
    checkpoint = None
    if resume is not None:
        previous = _load_run_json(resume, required=("epochs", "demo_data", *RUN_OPTIONS))
        options = _resumed_options(resume, previous, given)
        _check_world_size(resume, previous, launch)
        epochs = epochs or previous["epochs"]
        config = _load_config(os.path.join(resume, "config.json"), os.path.join(resume, "config.json"))
        sp = load_vocab(os.path.join(resume, "vocab.model"))
        check_vocab_matches(sp, config, os.path.join(resume, "vocab.model"))
        checkpoint = _load_checkpoint(resume)
        done_epochs, done_steps = (checkpoint[2]["epoch"], checkpoint[2]["step"]) if checkpoint else (0, 0)
        if done_epochs >= epochs:
            raise ValueError(f"--resume {resume}: the run already has {done_epochs} epochs; pass --epochs > {done_epochs}")
        if max_steps is not None and done_steps >= max_steps:
            raise ValueError(f"--resume {resume}: the run already has {done_steps} steps; pass --max-steps > {done_steps}")
        run_dir = resume
    else:
        train, test, vocab, config = given["train"], given["test"], given["vocab"], given["config"]
        using_demo = train is None
        if using_demo:
            train, test = demo.TRAIN_FILE, demo.TEST_FILE
        options = {name: DEFAULTS.get(name) if value is None else value for name, value in given.items()}
        options.update(
            train=os.path.abspath(train), test=test and os.path.abspath(test), vocab=vocab and os.path.abspath(vocab),
            config=config and os.path.abspath(config), vocab_size=None if vocab else options["vocab_size"],
            batch_size=given["batch_size"] or (128 if device.type == "cuda" else 64),
        )
        epochs = epochs or DEFAULTS["epochs"]
        config = _load_config(config, f"--config {config}") if config is not None else None
        sp = load_vocab(vocab) if vocab is not None else None
        if sp is not None and config is not None:
            check_vocab_matches(sp, config, "--vocab")
        run_dir = out or os.path.join("runs", time.strftime("sentiment-%Y%m%d-%H%M%S"))
        _check_out(run_dir)
    train, test, seed = options["train"], options["test"], options["seed"]
    torch.manual_seed(seed + launch.rank)  # rank 0's weights are every process's (DDP broadcasts them)

    # 2. data and classes
    if test is not None and resume is None and test == train:
        raise ValueError("--test is the same file as --train")
    train_reviews = read_reviews(train, "train")
    test_reviews = read_reviews(test, "test") if test is not None else None
    if config is not None and (resume is not None or options["n_output"] is None):
        n_classes = config.n_output
    elif options["n_output"] == "auto":
        n_classes = infer_classes(train_reviews, f"train file {train}")
    else:
        n_classes = options["n_output"] or TUTORIAL["n_output"]
    hint = "" if resume is not None else "; pass --n-output with the number of classes, or --n-output auto"
    _check_labels(train_reviews, n_classes, f"train file {train}", hint)
    if test_reviews is not None:
        _check_labels(test_reviews, n_classes, f"test file {test}", hint)
    else:
        train_reviews, test_reviews = _split(train_reviews, 0.1, seed)
    if config is not None:
        config.n_output = n_classes
    options["n_output"] = n_classes

    # 3. the vocab: trained (the long part) only now that every input has been checked
    scratch = tempfile.mkdtemp(prefix="fastformer-")
    try:
        if sp is None:
            if any(not isinstance(r.doc, str) for r in train_reviews):
                raise ValueError(f"{train} holds pieces of an existing vocab (JSONL); pass that vocab with --vocab")
            n_pieces = options["vocab_size"]
            if config is not None and n_pieces + N_SPECIAL > config.n_enc_vocab:
                raise ValueError(
                    f"--vocab-size {n_pieces} gives up to {n_pieces + N_SPECIAL} pieces but config.n_enc_vocab is "
                    f"{config.n_enc_vocab}: the ids would not fit the embedding; pass --vocab-size "
                    f"{config.n_enc_vocab - N_SPECIAL} or less"
                )
            if config is not None and config.i_pad != PAD[0]:
                raise ValueError(f"config.i_pad is {config.i_pad} but a trained vocab pads with id {PAD[0]}")
            log(f"Training a BPE vocab of up to {n_pieces} + {N_SPECIAL} pieces on {len(train_reviews)} reviews")
            sp = _shared_vocab(launch, train_reviews, os.path.join(scratch, "vocab.model"), n_pieces)
        vocab_file = options["vocab"] or os.path.join(scratch, "vocab.model")
        if config is None:
            config = default_config(device, sp.get_piece_size(), n_classes)

        # 4. model, data loaders, optimizer, schedule
        batch_size = options["batch_size"]
        train_loader, test_loader, set_epoch = _loaders(
            config, sp, train_reviews, test_reviews, batch_size, options["bucket"], seed, launch, steps["pad_to_buckets"]
        )
        model = MovieClassification(config).to(device)
        decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() >= 2]
        no_decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() < 2]
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": options["weight_decay"]}, {"params": no_decay, "weight_decay": 0.0}],
            lr=options["lr"],
        )
        total_steps = epochs * len(train_loader) if max_steps is None else min(max_steps, epochs * len(train_loader))
        scheduler = linear_warmup_decay_scheduler(optimizer, int(options["warmup"] * total_steps), total_steps)
        scaler = torch.amp.GradScaler(device.type) if amp == "fp16" else None
        history, start_epoch, step = [], 0, 0
        if checkpoint is not None:
            model_state, model_file, state = checkpoint
            _load_state_dict(model, model_state, model_file)
            optimizer.load_state_dict(state["optimizer"])
            scheduler.load_state_dict(state["scheduler"])
            if scaler is not None and state["scaler"]:
                scaler.load_state_dict(state["scaler"])
            start_epoch, step, history = state["epoch"], state["step"], state["history"]
            _set_rng_state(state["rng"], device, launch)
        make_capturable(optimizer, steps["cuda_graphs"])  # a checkpoint holds the form it was written in
        trained = _replicated(model, launch, device)
        graphs = GraphedSteps(model, optimizer, amp=amp) if steps["cuda_graphs"] else None
        if steps["compile"]:
            trained = torch.compile(trained, fullgraph=True)

        # 5. the run directory: created (or its run.json extended) only now, by rank 0 once every
        # process has checked its inputs
        session = {
            "fastformer": __version__,
            "epochs": epochs,
            "max_steps": max_steps,
            "device": str(device),
            "backend": backend.get_backend(),
            "kernels": _kernels_in_use(device, amp),
            "amp": amp,
            **steps,
            "world_size": launch.world_size,
        }
        replaces = resume is None and os.path.isdir(run_dir) and bool(os.listdir(run_dir))
        _barrier(launch)
        if resume is None:
            run_info = {
                **options, **session, "demo_data": using_demo, "dataset": dataset or ("demo" if using_demo else None),
                "label_names": label_names(config.n_output), "resumed": [],
            }
            if launch.rank == 0:
                _create_run_dir(run_dir, vocab_file, config, run_info)
        else:
            resumed = [*previous.get("resumed", []), {"from_epoch": start_epoch, **session}]
            run_info = {**previous, "epochs": epochs, "resumed": resumed}
            if launch.rank == 0:
                _write_json(os.path.join(run_dir, "run.json"), run_info)
                if history:  # a kill between a checkpoint and its copies leaves these one epoch behind
                    _publish(run_dir, latest_checkpoint(run_dir), history)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    n_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    threads = f", {torch.get_num_threads()} CPU thread(s)" if device.type == "cpu" else ""
    processes = f", {launch.world_size} processes under torchrun" if launch.distributed else ""
    data = {"demo": " (the embedded demo set)", "rotten-tomatoes": " (Rotten Tomatoes snippets)"}.get(
        run_info.get("dataset", "demo" if run_info["demo_data"] else None), ""
    )
    log(f"fastformer train: {len(train_reviews)} train / {len(test_reviews)} test reviews{data}, "
        f"vocab {sp.get_piece_size()} pieces")
    log(
        f"  model    MovieClassification, {n_params / 1e6:.2f} M parameters: n_layer={config.n_layer} "
        f"d_hidn={config.d_hidn} n_head={config.n_head} d_ff={config.d_ff}"
    )
    log(f"  device   {device}{threads}{processes}, {session['kernels']} kernels (backend {session['backend']!r}), "
        f"amp {amp}{_step_mode(**steps)}")
    if resume is not None:
        log(f"  run dir  {run_dir} (resumed after epoch {start_epoch})")
    else:
        log(f"  run dir  {run_dir}{' (replacing a run that stopped before its first checkpoint)' if replaces else ''}")

    last = latest_checkpoint(run_dir) if resume is not None else None
    try:
        for epoch in range(start_epoch, epochs):
            if max_steps is not None and step >= max_steps:
                break
            set_epoch(epoch)
            lr_now = float(scheduler.get_last_lr()[0])  # a tensor under --cuda-graphs: one sync an epoch
            try:
                train_stats = train_epoch(
                    trained, train_loader, optimizer, scheduler, device=device, amp=amp, scaler=scaler,
                    max_steps=None if max_steps is None else max_steps - step, desc=f"Train {epoch + 1}/{epochs}",
                    graphs=graphs,
                )
            except NonFiniteLossError as error:
                raise NonFiniteLossError(
                    f"{error} of epoch {epoch + 1} (step {step + error.step} of the run): training stopped; "
                    f"{_last_checkpoint(last)}", step + error.step, error.loss,
                ) from None
            step += train_stats["steps"]
            test_stats = evaluate(trained if steps["compile"] else model, test_loader, device=device, amp=amp,
                                  desc=f"Test  {epoch + 1}/{epochs}", graphs=graphs)
            history.append({
                "epoch": epoch + 1,
                "steps": step,
                "lr": lr_now,
                "train_loss": train_stats["loss"],
                "train_accuracy": train_stats["accuracy"],
                "test_loss": test_stats["loss"],
                "test_accuracy": test_stats["accuracy"],
                "tokens_per_s": train_stats["tokens_per_s"],
                "seconds": train_stats["seconds"],
            })
            trainer = {
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "scaler": scaler.state_dict() if scaler is not None else None,
                "epoch": epoch + 1,
                "step": step,
                "history": history,
                "rng": _rng_state(device, launch),
            }
            if launch.rank == 0:
                last = _save_checkpoint(run_dir, model, trainer)
                _publish(run_dir, last, history)
                tqdm.write(
                    f"epoch {epoch + 1}/{epochs}  train loss {train_stats['loss']:.4f} "
                    f"acc {train_stats['accuracy']:.3f}  test loss {test_stats['loss']:.4f} "
                    f"acc {test_stats['accuracy']:.3f}  {train_stats['tokens_per_s']:,.0f} tok/s  "
                    f"{train_stats['seconds']:.1f} s"
                )
    except OSError as error:
        raise OSError(f"{error}; {_last_checkpoint(last)}") from None
    except KeyboardInterrupt:
        raise KeyboardInterrupt(f"{_last_checkpoint(last)}; `fastformer train --resume {run_dir}` continues") from None
    metrics = {"epochs": history, "test_accuracy": history[-1]["test_accuracy"]}
    log(f"test accuracy {metrics['test_accuracy']:.4f} on {len(test_reviews)} reviews; run saved in {run_dir}")
    return metrics


def _last_checkpoint(path):
    return f"last checkpoint: {path}" if path else "no checkpoint yet (the first epoch did not end)"


def load_run(run_dir, device=None):
    """(config, vocab, model in eval mode, run info) from a run directory."""
    info = _load_run_json(run_dir)
    model_file = os.path.join(run_dir, "model.pt")
    if not os.path.isfile(model_file):
        raise ValueError(f"{run_dir} has no model.pt: its training stopped before the first epoch ended")
    device = resolve_device(device)
    config = _load_config(os.path.join(run_dir, "config.json"), os.path.join(run_dir, "config.json"))
    vocab = load_vocab(os.path.join(run_dir, "vocab.model"))
    check_vocab_matches(vocab, config)
    model = MovieClassification(config)
    _load_state_dict(model, _load_torch(model_file), model_file)
    return config, vocab, model.to(device).eval(), info


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
