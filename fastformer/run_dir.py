"""The run directory `fastformer train` writes, and `evaluate`, `predict` and --resume read.

A run directory holds everything needed to use or continue the model:

    config.json     the model's Config (Config.load reads it; the tutorial's classes accept it)
    vocab.model     the SentencePiece vocab
    run.json        data files, options, device, backend and amp, and those of each --resume
    checkpoint-N/   the checkpoint after epoch N: model.pt and trainer.pt (optimizer, schedule, scaler,
                    step, metrics so far, RNG states), written together as one directory
    checkpoint-N-step-K/  the same, taken inside epoch N after K of its steps (a run stopped by
                    --max-steps), from which --resume continues at step K + 1 of the epoch
    model.pt        the latest checkpoint's state_dict: the tutorial's own MovieClassification loads it
    metrics.json    per-epoch loss, accuracy and tokens/s, and the final test accuracy
    curves.png      loss and accuracy per epoch

The directory appears in one step, with config.json, vocab.model and run.json (create_run_dir);
each epoch then writes checkpoint-N into a staging directory that is renamed into place
(save_checkpoint), so a crash at any point leaves the previous checkpoint or the new one, never a
mix; a save removes the checkpoint the run wrote before it, by name, and nothing else. A run killed
before its first checkpoint can be resumed (it starts again) or replaced by a new run with the same
--out (check_out). A run directory is never made inside another one (check_out), and a directory
named like a checkpoint that is a run is never taken for one (checkpoints). Every file is written
through a temporary name and synced (write_file), and read with one-line errors naming the file.

torch is imported only by the functions that read or write tensors, so that `fastformer train`
checks the run directory before it imports torch.
"""

import contextlib
import json
import os
import re
import shutil

from fastformer.config import Config, check_config, read_json_object
from fastformer.data.files import check_file
from fastformer.data.vocab import check_vocab_matches, load_vocab

RUN_FILES = ("config.json", "vocab.model", "run.json")  # a run directory has these from its start
CHECKPOINT = re.compile(r"checkpoint-(\d+)(?:-step-(\d+))?")
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
    import torch

    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
    except OSError as error:
        raise OSError(f"could not read {path}: {_reason(error)}") from None
    if size == 0:
        raise ValueError(f"{path} is empty (0 bytes)")
    try:
        return torch.load(path, map_location="cpu")
    except Exception as error:  # noqa: BLE001 (a damaged file fails as RuntimeError, OSError, EOFError, UnpicklingError, ...
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
    check_file(path, "config file")
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


def checkpoint_name(epoch, epoch_step=0):
    """checkpoint-<epoch> after `epoch` whole epochs; checkpoint-<epoch + 1>-step-<epoch_step> when
    the run stopped `epoch_step` steps into the next epoch."""
    return f"checkpoint-{epoch}" if epoch_step == 0 else f"checkpoint-{epoch + 1}-step-{epoch_step}"


def is_run_dir(path):
    """Whether `path` is a run directory: it holds config.json, vocab.model and run.json."""
    return all(os.path.isfile(os.path.join(path, name)) for name in RUN_FILES)


def checkpoints(run_dir):
    """The checkpoint directories in `run_dir`, oldest first, as ((epochs done, steps into the next
    epoch), path). A run directory named like a checkpoint (a run made inside this one) raises
    ValueError: its files are not this run's to read or remove."""
    found = []
    for name in os.listdir(run_dir):
        path = os.path.join(run_dir, name)
        match = CHECKPOINT.fullmatch(name)
        if match is None or not os.path.isdir(path):
            continue
        if is_run_dir(path):
            raise ValueError(
                f"{path} is a run directory made inside the run {run_dir}, not one of its checkpoints; "
                f"move it out of {run_dir}, then resume {run_dir}"
            )
        epoch, epoch_step = int(match.group(1)), int(match.group(2) or 0)
        found.append(((epoch - 1, epoch_step) if epoch_step else (epoch, 0), path))
    return sorted(found)


def latest_checkpoint(run_dir):
    """The path of the run's latest checkpoint directory, or None before its first was written."""
    found = checkpoints(run_dir)
    return found[-1][1] if found else None


def last_checkpoint_message(path):
    """What a stopped run says of its last checkpoint, `path` (None before the first)."""
    return f"last checkpoint: {path}" if path else "no checkpoint yet (the first epoch did not end)"


def save_checkpoint(run_dir, model, trainer, previous=None):
    """Write the checkpoint of `trainer` (trainer.pt's dict: checkpoint_name of its epoch and
    epoch_step) with the model's model.pt, as one unit, then remove `previous`, the checkpoint this
    run wrote (or resumed from) before, if it is another: only that, by name. Returns its path."""
    import torch

    staging = os.path.join(run_dir, STAGING)
    final = os.path.join(run_dir, checkpoint_name(trainer["epoch"], trainer["epoch_step"]))
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
    if previous is not None and os.path.abspath(previous) != os.path.abspath(final):
        shutil.rmtree(previous, ignore_errors=True)
    return final


def publish(run_dir, checkpoint, history):
    """Copy a checkpoint's model.pt to the top of the run directory, with its metrics and curves."""

    def copy_model(f):
        with open(os.path.join(checkpoint, "model.pt"), "rb") as src:
            shutil.copyfileobj(src, f)

    write_file(os.path.join(run_dir, "model.pt"), copy_model)
    write_json(
        os.path.join(run_dir, "metrics.json"), {"epochs": history, "test_accuracy": history[-1]["test_accuracy"]}
    )
    plot_curves(history, os.path.join(run_dir, "curves.png"))


def check_resumable_dir(run_dir):
    """The path of the checkpoint --resume continues from (None: the run starts again), after
    checking that the directory can be resumed: its checkpoint-N entries are checkpoints."""
    path = latest_checkpoint(run_dir)
    if path is None and os.path.exists(os.path.join(run_dir, "model.pt")):
        raise ValueError(f"{run_dir} has a model.pt but no checkpoint-N directory to resume from")
    return path


def load_checkpoint(path):
    """(model state_dict, its file, trainer state) of the checkpoint directory `path`. A trainer.pt
    written before checkpoints were taken inside an epoch has no epoch_step: it is 0."""
    trainer_file = os.path.join(path, "trainer.pt")
    trainer = _load_torch(trainer_file)
    keys = ("optimizer", "scheduler", "scaler", "epoch", "step", "history", "rng")
    missing = [k for k in keys if not isinstance(trainer, dict) or k not in trainer]
    if missing:
        raise ValueError(f"{trainer_file} lacks {', '.join(missing)}")
    trainer.setdefault("epoch_step", 0)
    trainer.setdefault("epoch_stats", None)
    if checkpoint_name(trainer["epoch"], trainer["epoch_step"]) != os.path.basename(path):
        where = checkpoint_name(trainer["epoch"], trainer["epoch_step"])
        raise ValueError(f"{trainer_file} is the checkpoint {where}, not the one its directory names")
    model_file = os.path.join(path, "model.pt")
    return _load_torch(model_file), model_file, trainer


# The directory


def load_run_json(run_dir, required=()):
    """The run.json of a run directory, after checking that it is one and that the file has the
    `required` keys."""
    if not os.path.isdir(run_dir):
        if os.path.exists(run_dir):
            raise ValueError(f"{run_dir} is a file, not a run directory")
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


def enclosing_run(path):
    """The nearest directory above `path` that is a run directory, or None."""
    path = os.path.realpath(path)
    parent = os.path.dirname(path)
    while parent != path:
        if is_run_dir(parent):
            return parent
        path, parent = parent, os.path.dirname(parent)
    return None


def check_out(run_dir):
    """Raise ValueError unless `run_dir` can become the new run's directory: absent, empty, or a run
    that stopped before its first checkpoint (which the new run replaces), and not inside another
    run directory (whose checkpoints it could be taken for, or hold)."""
    outer = enclosing_run(run_dir)
    if outer is not None:
        raise ValueError(
            f"--out {run_dir} is inside the run directory {outer}; a run directory is never made inside another: "
            "choose a directory outside it"
        )
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


def check_run_dir(run_dir):
    """The run.json of a run directory that holds a model to use, checked without torch."""
    info = load_run_json(run_dir)
    if not os.path.isfile(os.path.join(run_dir, "model.pt")):
        raise ValueError(f"{run_dir} has no model.pt: its training stopped before the first checkpoint")
    return info


def load_run(run_dir, device=None):
    """(config, vocab, model in eval mode, run info) from a run directory."""
    from fastformer.model import MovieClassification
    from fastformer.runtime import resolve_device

    info = check_run_dir(run_dir)
    model_file = os.path.join(run_dir, "model.pt")
    device = resolve_device(device)
    config_file = os.path.join(run_dir, "config.json")
    config = load_config(config_file, config_file)
    vocab = load_vocab(os.path.join(run_dir, "vocab.model"))
    check_vocab_matches(vocab, config)
    model = MovieClassification(config)
    load_state_dict(model, _load_torch(model_file), model_file)
    return config, vocab, model.to(device).eval(), info
