"""The run directory `fastformer train` writes, and `evaluate`, `predict` and --resume read.

A run directory holds everything needed to use or continue the model:

    config.json     the model's Config (Config.load reads it; the tutorial's classes accept it)
    vocab.model     the SentencePiece vocab
    run.json        data files, options, device, backend and amp, and those of each --resume
    checkpoint-N/   the checkpoint of epoch N: model.pt and trainer.pt (optimizer, schedule, scaler,
                    step, metrics so far, RNG states), written together as one directory
    model.pt        the latest checkpoint's state_dict: the tutorial's own MovieClassification loads it
    metrics.json    per-epoch loss, accuracy and tokens/s, and the final test accuracy
    curves.png      loss and accuracy per epoch

The directory appears in one step, with config.json, vocab.model and run.json (create_run_dir);
each epoch then writes checkpoint-N into a staging directory that is renamed into place
(save_checkpoint), so a crash at any point leaves the previous checkpoint or the new one, never a
mix. A run killed before its first checkpoint can be resumed (it starts again) or replaced by a new
run with the same --out (check_out). Every file is written through a temporary name and synced
(write_file), and read with one-line errors naming the file.
"""
import contextlib
import json
import os
import re
import shutil

import torch

from fastformer.config import Config, check_config, read_json_object
from fastformer.data.vocab import check_vocab_matches, load_vocab
from fastformer.model import MovieClassification
from fastformer.runtime import resolve_device

RUN_FILES = ("config.json", "vocab.model", "run.json")  # a run directory has these from its start
CHECKPOINT = re.compile(r"checkpoint-(\d+)")
STAGING = ".checkpoint.tmp"


# Files: written through a temporary name and synced, read with one-line errors naming the file.


def _reason(error):
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def _remove(path):
    with contextlib.suppress(FileNotFoundError):
        os.remove(path)


def write_file(path, write, binary=True):
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


def write_json(path, obj):
    def write(f):
        json.dump(obj, f, indent=2, default=str)
        f.write("\n")

    write_file(path, write, binary=False)


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


def load_state_dict(model, state, path):
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


def load_config(path, what):
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
        write_file(path, lambda f: fig.savefig(f, format="png", dpi=100))
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


def last_checkpoint_message(path):
    """What a stopped run says of its last checkpoint, `path` (None before the first)."""
    return f"last checkpoint: {path}" if path else "no checkpoint yet (the first epoch did not end)"


def save_checkpoint(run_dir, model, trainer):
    """Write checkpoint-<epoch> (model.pt, trainer.pt) as one unit and drop the older checkpoints.
    Returns its path."""
    staging = os.path.join(run_dir, STAGING)
    final = os.path.join(run_dir, f"checkpoint-{trainer['epoch']}")
    state_dict = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    shutil.rmtree(staging, ignore_errors=True)  # left by a run killed while saving
    try:
        os.mkdir(staging)
        write_file(os.path.join(staging, "model.pt"), lambda f: torch.save(state_dict, f))
        write_file(os.path.join(staging, "trainer.pt"), lambda f: torch.save(trainer, f))
        os.rename(staging, final)
        _sync_dir(run_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    for epoch in _checkpoint_epochs(run_dir):
        if epoch != trainer["epoch"]:
            shutil.rmtree(os.path.join(run_dir, f"checkpoint-{epoch}"))
    return final


def publish(run_dir, checkpoint, history):
    """Copy a checkpoint's model.pt to the top of the run directory, with its metrics and curves."""
    def copy_model(f):
        with open(os.path.join(checkpoint, "model.pt"), "rb") as src:
            shutil.copyfileobj(src, f)

    write_file(os.path.join(run_dir, "model.pt"), copy_model)
    write_json(os.path.join(run_dir, "metrics.json"), {"epochs": history, "test_accuracy": history[-1]["test_accuracy"]})
    plot_curves(history, os.path.join(run_dir, "curves.png"))


def load_checkpoint(run_dir):
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


# The directory


def load_run_json(run_dir, required=()):
    """The run.json of a run directory, after checking that it is one and that the file has the
    `required` keys."""
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


def load_run_files(run_dir):
    """(config, vocab) of a run directory, each checked, and the vocab against the config."""
    config_file, vocab_file = os.path.join(run_dir, "config.json"), os.path.join(run_dir, "vocab.model")
    config = load_config(config_file, config_file)
    vocab = load_vocab(vocab_file)
    check_vocab_matches(vocab, config, vocab_file)
    return config, vocab


def _is_unstarted_run(path):
    """Whether `path` is a run directory killed or stopped before its first checkpoint."""
    names = set(os.listdir(path))
    return set(RUN_FILES) <= names <= {*RUN_FILES, STAGING}


def check_out(run_dir):
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


def create_run_dir(run_dir, vocab_file, config, run_info):
    """Make the run directory in one step: config.json, vocab.model and run.json are written into
    a staging directory beside it, which is then renamed into place."""
    run_dir = os.path.abspath(run_dir)
    staging = os.path.join(os.path.dirname(run_dir), f".{os.path.basename(run_dir)}.tmp")
    shutil.rmtree(staging, ignore_errors=True)  # left by a run killed while creating it
    try:
        os.makedirs(staging)
        shutil.copyfile(vocab_file, os.path.join(staging, "vocab.model"))
        write_json(os.path.join(staging, "config.json"), config)
        write_json(os.path.join(staging, "run.json"), run_info)
        if os.path.isdir(run_dir):  # empty, or a run that never reached a checkpoint (see check_out)
            shutil.rmtree(run_dir)
        os.rename(staging, run_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def load_run(run_dir, device=None):
    """(config, vocab, model in eval mode, run info) from a run directory."""
    info = load_run_json(run_dir)
    model_file = os.path.join(run_dir, "model.pt")
    if not os.path.isfile(model_file):
        raise ValueError(f"{run_dir} has no model.pt: its training stopped before the first epoch ended")
    device = resolve_device(device)
    config_file = os.path.join(run_dir, "config.json")
    config = load_config(config_file, config_file)
    vocab = load_vocab(os.path.join(run_dir, "vocab.model"))
    check_vocab_matches(vocab, config)
    model = MovieClassification(config)
    load_state_dict(model, _load_torch(model_file), model_file)
    return config, vocab, model.to(device).eval(), info
