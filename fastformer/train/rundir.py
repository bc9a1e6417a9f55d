"""The run directory `fastformer train` writes, and `evaluate`, `predict` and --resume read.

A run directory holds everything needed to use or continue the model:

    config.json     the model's Config (Config.load reads it; the tutorial's classes accept it)
    vocab.model     the SentencePiece vocab
    run.json        data files, options, device, backend and amp, and those of each --resume; the
                    sha256 of the data files, of vocab.model and of config.json, which evaluate,
                    predict and --resume check (check_pinned); each of them checks the whole file
                    against RUN_JSON first (load_run_json)
    checkpoint-N/   the checkpoint after epoch N: model.pt and trainer.pt (optimizer, schedule, scaler,
                    step, metrics so far, RNG states), written together as one directory
    checkpoint-N-step-K/  the same, taken inside epoch N after K of its steps (a run stopped by
                    --max-steps), from which --resume continues at step K + 1 of the epoch
    model.pt        the latest checkpoint's state_dict: the tutorial's own MovieClassification loads it
    metrics.json    per-epoch loss, accuracy and tokens/s, and the final test accuracy
    curves.png      loss and accuracy per epoch
    .lock           the writer's lock file (writing): who writes the run, or last wrote it

A run has one writer. `writing` holds an exclusive flock on .lock for as long as a train job runs,
from before its vocab is trained; a second job on the directory (a new run or a --resume) is
refused in one line naming the holder, and readers say that the run is still training. The kernel
drops the lock when its process ends, killed or not, so a lock left by a dead process is taken.

The directory is made when the job takes its lock; config.json and vocab.model are then written
into it, and run.json last, so that it is a run (is_run_dir) only once all three are there
(create_run_dir). Each epoch writes checkpoint-N into a staging directory that is renamed into
place (save_checkpoint), so a crash at any point leaves the previous checkpoint or the new one,
never a mix; a save removes the checkpoint the run wrote before it, by name, and nothing else. A
run killed before its first checkpoint can be resumed (it starts again) or replaced by a new run
with the same --out (check_out), its files removed by name: a directory is never removed. A run
directory is never made inside another one (check_out), and a directory named like a checkpoint
that is a run is never taken for one (checkpoints). Every file is written through a temporary name
and synced (write_file), and read with one-line errors naming the file.

A run made in runs/ (the default place) is linked from runs/latest when its job starts or resumes
it (mark_latest), and `--run last` names the run that link points at (resolve_run), saying so
when that run did not finish (unfinished). A run directory's path must be UTF-8 (SentencePiece
reads its vocab.model by path), and a symlink loop is named as one, not as a path not found.

torch is imported only by the functions that read or write tensors, so that `fastformer train`
checks the run directory before it imports torch.
"""

import contextlib
import datetime
import errno
import fcntl
import json
import os
import pickle
import re
import shlex
import shutil
import socket
import time
from typing import NamedTuple

from fastformer.config import Config, check_config, read_json_object
from fastformer.data.files import check_file, file_sha256
from fastformer.data.vocab import check_utf8_path, check_vocab_matches, load_vocab
from fastformer.train.checks import (
    COUNT,
    DEVICE_NAME,
    LR,
    N_OUTPUT,
    PATH,
    SEED,
    VOCAB_SIZE,
    WARMUP,
    WEIGHT_DECAY,
    Check,
    check_values,
)

RUN_FILES = ("config.json", "vocab.model", "run.json")  # a run directory has these from its start
CHECKPOINT = re.compile(r"checkpoint-(\d+)(?:-step-(\d+))?")
STAGING = ".checkpoint.tmp"
LOCK = ".lock"
PINNED = {"vocab.model": "vocab_sha256", "config.json": "config_sha256"}  # the run's files run.json pins
LOCK_WAIT = 1.0  # seconds a writer retries its lock: a reader's test holds it for microseconds
RUNS = "runs"  # where `fastformer train` makes a run by default, in the working directory
LATEST = "latest"  # RUNS/latest: a link to the run `fastformer train` started or resumed last there
LAST = "last"  # the --run that names it (resolve_run)


# Files: written through a temporary name and synced, read with one-line errors naming the file.


def _reason(error):
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def _remove(path):
    with contextlib.suppress(FileNotFoundError):
        os.remove(path)


def symlink_loop(path):
    """Whether following `path`'s symbolic links comes back to a link (os.stat fails with ELOOP,
    and os.path.exists says False, as it does of a path with nothing there)."""
    try:
        os.stat(path)
    except OSError as error:
        return error.errno == errno.ELOOP
    return False


def check_link(path, what):
    """Raise OSError when `path` is a symlink loop, FileNotFoundError when it is a symbolic link to
    nothing, `what` naming it: not "not found", which is what os.path.exists alone would say."""
    if symlink_loop(path):
        raise OSError(f"{what} is a symlink loop: following its links comes back to a link")
    if os.path.islink(path) and not os.path.exists(path):
        raise FileNotFoundError(f"{what} is a symlink to {os.readlink(path)}, which is not there")


_C_ESCAPES = {"\n": "\\n", "\t": "\\t", "\r": "\\r"}  # as $'...' writes them


def shell_word(path):
    """`path` as one word that a shell reads back as `path`, on one line, for a command the job
    says to run: shlex.quote's form, or where the path has a character that does not print (a
    newline, which would also cut a one-line message) bash's $'...' form, which zsh and ksh read
    too. A byte that is not UTF-8 (os.fsdecode's surrogate escape) is written as that byte."""
    path = os.fspath(path)
    if path.isprintable():
        return shlex.quote(path)

    def escaped(c):
        if c in "\\'":
            return "\\" + c
        if c.isprintable():
            return c
        if c in _C_ESCAPES:
            return _C_ESCAPES[c]
        code = ord(c)
        if 0xDC80 <= code <= 0xDCFF:
            return f"\\x{code - 0xDC00:02x}"
        return f"\\x{code:02x}" if code < 0x80 else f"\\U{code:08x}"

    return "$'" + "".join(escaped(c) for c in path) + "'"


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
    except pickle.UnpicklingError as error:
        if "Weights only load failed" not in str(error):
            raise ValueError(_damaged(path, size, error)) from None
        # weights_only (torch's default) met a Python object: a whole module saved with torch.save(model)
        raise ValueError(
            f"{path} holds pickled Python objects (a whole model saved with torch.save(model)?), not tensors alone: "
            "fastformer reads a state_dict, which runs no code when loaded; save one with "
            "torch.save(model.state_dict(), path)"
        ) from None
    except Exception as error:  # noqa: BLE001 (a damaged file fails as RuntimeError, OSError, EOFError, UnpicklingError, ...
        raise ValueError(_damaged(path, size, error)) from None


def _damaged(path, size, error):
    return f"{path} ({size} bytes) is not a readable PyTorch checkpoint: truncated or damaged ({type(error).__name__})"


def load_state_dict(model, state, path):
    """Load `state` (read from `path`) into `model`, or raise ValueError naming the file and the
    first key that does not fit, or the first tensor whose weights are not all finite."""
    import torch

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
    broken = [k for k, t in state.items() if torch.is_tensor(t) and t.is_floating_point() and not t.isfinite().all()]
    if broken:
        more = f" and {len(broken) - 1} more" if len(broken) > 1 else ""
        raise ValueError(
            f"{path} holds weights that are not finite (NaN or inf) in {broken[0]}{more}: a model with them "
            "answers nan; retrain, or resume from an earlier checkpoint"
        )
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


def mark_latest(run_dir):
    """Point runs/latest at `run_dir` when it is a run directory in runs/ (a relative link, replaced in
    one rename, so a reader sees the old run or the new one): `fastformer train` marks each run it
    starts or resumes there. A runs/latest that is not a link (a run named `latest`) is left alone."""
    parent, name = os.path.split(os.path.abspath(run_dir))
    if parent != os.path.abspath(RUNS) or name == LATEST:
        return
    link = os.path.join(RUNS, LATEST)
    if os.path.lexists(link) and not os.path.islink(link):
        return
    temporary = os.path.join(RUNS, f".{LATEST}.{os.getpid()}.tmp")
    with contextlib.suppress(FileNotFoundError):
        os.remove(temporary)
    os.symlink(name, temporary)
    os.replace(temporary, link)


def resolve_run(run):
    """The run directory `run` names: itself, or for "last" (where nothing of that name is in the
    working directory) the run runs/latest points at, the one `fastformer train` started or resumed
    last under runs/ (mark_latest). FileNotFoundError when there is no runs/latest, or it links to
    nothing; OSError when it is a symlink loop."""
    if run != LAST or os.path.lexists(run):
        return run
    link = os.path.join(RUNS, LATEST)
    if os.path.islink(link):
        check_link(link, f"--run {LAST}: {link}")
        return os.path.join(RUNS, os.readlink(link))
    if os.path.isdir(link):  # a run named `latest`
        return link
    raise FileNotFoundError(
        f"--run last: no {link} in {os.getcwd()} (`fastformer train` links it to the run it starts under "
        f"{RUNS}/, as it does by default); name the run directory"
    )


def unfinished(run_dir):
    """Why the run in `run_dir` is not a finished one, in words: it is still being trained, or it
    stopped before its epochs were done (Ctrl-C, a kill, --max-steps), and the checkpoint it stopped
    at, which its model.pt is. None when it finished, and when its files cannot tell (what is
    wrong with them is the readers' checks' to say). A run is finished when its latest checkpoint
    is checkpoint-N with N the epochs run.json says it has in total (each --resume sets them)."""
    try:
        epochs, found = load_run_json(run_dir).get("epochs"), checkpoints(run_dir)
    except (OSError, ValueError):
        return None
    holder = writer(run_dir)
    if holder is not None:
        newest = os.path.basename(found[-1][1]) if found else "none yet"
        return f"this run is still training ({holder}); its newest checkpoint is used ({newest})"
    if not found or epochs is None:
        return None
    (done, step), path = found[-1]
    if step == 0 and done >= epochs:
        return None
    where = f"step {step} of epoch {done + 1}" if step else f"epoch {done}"
    return (
        f"this run did not finish (stopped after {where} of {epochs}; its last checkpoint, "
        f"{os.path.basename(path)}, is used)"
    )


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
    """The run.json of a run directory, after checking that it is one, that its path is UTF-8, and
    that the file is what RUN_JSON says, with the `required` keys."""
    check_utf8_path(run_dir, "run directory")
    check_link(run_dir, f"run directory {run_dir}")
    if not os.path.isdir(run_dir):
        if os.path.exists(run_dir):
            raise ValueError(f"{run_dir} is a file, not a run directory")
        raise FileNotFoundError(f"run directory not found: {run_dir}")
    for name in RUN_FILES:
        check_link(os.path.join(run_dir, name), os.path.join(run_dir, name))
    missing = [f for f in RUN_FILES if not os.path.isfile(os.path.join(run_dir, f))]
    if missing:
        holder = writer(run_dir)
        if holder:  # a train job has taken it and not yet written its first files
            raise ValueError(
                f"{run_dir} is being created by a train job ({holder}): it has no {', '.join(missing)} "
                "and no checkpoint yet; it can be read once its first checkpoint is written"
            )
        raise ValueError(f"{run_dir} is not a fastformer run directory (missing {', '.join(missing)})")
    path = os.path.join(run_dir, "run.json")
    run_info = read_json_object(path, "run file")
    check_run_json(path, run_info, required)
    return run_info


# run.json, checked as a whole by load_run_json before --resume, evaluate or predict reads a key of
# it: a value of a JSON type or a range the job cannot use is one line naming its key (nested:
# `data_sha256.train`, `resumed[0].epochs`), never a check skipped or a Python error further on.
# A key absent is not refused here (a run.json written before the key was lacks it): each reader
# names the keys it cannot do without (load_run_json's `required`). A key RUN_JSON does not name is
# allowed and left alone, so that a run written by a newer fastformer, with keys this one does not
# know, stays readable.

_INTEGER, _NUMBER, _TEXT, _FLAG, _NULL = "an integer", "a number", "a string", "true or false", "null"
_LIST, _OBJECT = "a list", "an object"


class Value(NamedTuple):
    """A run.json value that is not a list or an object: the JSON types it may have (an integer is
    a number too) and the Check (fastformer.train.checks) whose rules a value other than null must
    pass, or None."""

    types: tuple
    check: Check | None = None


class ListOf(NamedTuple):
    """A run.json list, each of whose items is `item` (a Value, or an object's {key: spec}); `what`
    says what it is in words."""

    item: object
    what: str


SHA256 = Check(None, (lambda value: re.fullmatch("[0-9a-f]{64}", value), "must be a sha256 (64 hex digits), got {!r}"))
STEPS = Check(int, (lambda value: value >= 0, "must be 0 or more, got {}"))
TEXT, FLAG = Value((_TEXT,)), Value((_FLAG,))
FILE, FILE_OR_NULL = Value((_TEXT,), PATH), Value((_TEXT, _NULL), PATH)
# what each session of a run (its start, and each --resume) records: fastformer.train.job._session
SESSION = {
    "fastformer": TEXT,
    "epochs": Value((_INTEGER,), COUNT),
    "max_steps": Value((_INTEGER, _NULL), COUNT),
    "device": TEXT,
    "backend": TEXT,
    "kernels": TEXT,
    "amp": TEXT,
    "cuda_graphs": FLAG,
    "compile": FLAG,
    "pad_to_buckets": FLAG,
    "precompile": FLAG,
    "eager_because": Value((_TEXT, _NULL)),
    "autotune": FLAG,
    "world_size": Value((_INTEGER,), COUNT),
}
RUN_JSON = {
    # the options that make the run what it is (fastformer.train.run.RunOptions), checked as the
    # options are (fastformer.train.checks)
    "train": FILE,
    "test": FILE_OR_NULL,
    "vocab": FILE_OR_NULL,
    "vocab_size": Value((_INTEGER, _NULL), VOCAB_SIZE),
    "config": FILE_OR_NULL,
    "n_output": Value((_INTEGER, _TEXT), N_OUTPUT),
    "batch_size": Value((_INTEGER,), COUNT),
    "lr": Value((_NUMBER,), LR),
    "warmup": Value((_NUMBER,), WARMUP),
    "weight_decay": Value((_NUMBER,), WEIGHT_DECAY),
    "bucket": FLAG,
    "seed": Value((_INTEGER,), SEED),
    # the session that started the run; its epochs are the run's in total, set again by each --resume
    **SESSION,
    "demo_data": FLAG,
    "dataset": Value((_TEXT, _NULL)),
    "label_names": ListOf(TEXT, "a list of strings"),  # one a class: load_run counts them
    "data_sha256": {"train": Value((_TEXT,), SHA256), "test": Value((_TEXT, _NULL), SHA256)},
    "resumed": ListOf(
        {"from_epoch": Value((_INTEGER,), STEPS), "from_step": Value((_INTEGER,), STEPS), **SESSION},
        "a list of objects (a --resume each)",
    ),
    **{key: Value((_TEXT,), SHA256) for key in PINNED.values()},
}


def _json_type(value):
    """The JSON type a parsed value was written as."""
    if value is None:
        return _NULL
    if isinstance(value, bool):
        return _FLAG
    if isinstance(value, int):
        return _INTEGER
    if isinstance(value, float):
        return _NUMBER
    if isinstance(value, str):
        return _TEXT
    return _LIST if isinstance(value, list) else _OBJECT


def _expected(spec):
    """What a value of `spec` (a Value, a ListOf or an object's {key: spec}) must be, in words."""
    if isinstance(spec, Value):
        return " or ".join(spec.types)
    return spec.what if isinstance(spec, ListOf) else _OBJECT


def check_run_json(path, run_info, required=()):
    """Raise ValueError naming the first key of the run.json `run_info` (read from `path`) that is
    not what RUN_JSON says, with what it must be, or the `required` keys it lacks."""
    missing = [key for key in required if key not in run_info]
    if missing:
        lacks = ", ".join(f"{key!r} ({_expected(RUN_JSON[key])})" if key in RUN_JSON else repr(key) for key in missing)
        raise ValueError(f"{path} lacks {lacks}, which `fastformer train` writes in every run.json")
    _check_object(path, "", run_info, RUN_JSON)


def _check_object(path, prefix, obj, table):
    for key, spec in table.items():
        if key in obj:
            _check_value(path, f"{prefix}{key}", obj[key], spec)


def _check_value(path, name, value, spec):
    kind = _json_type(value)
    if isinstance(spec, Value):
        fits = kind in spec.types or (kind == _INTEGER and _NUMBER in spec.types)
    else:
        fits = kind == (_LIST if isinstance(spec, ListOf) else _OBJECT)
    if not fits:
        raise ValueError(f"{path}: {name!r} must be {_expected(spec)}, got {json.dumps(value)[:40]} ({kind})")
    if isinstance(spec, ListOf):
        for i, item in enumerate(value):
            _check_value(path, f"{name}[{i}]", item, spec.item)
    elif isinstance(spec, dict):
        _check_object(path, f"{name}.", value, spec)
    elif spec.check is not None and value is not None:
        for valid, must in spec.check.rules:
            try:
                fits = valid(value)
            except OverflowError:  # an integer too large for a float, where a number is asked for
                fits = False
            if not fits:
                raise ValueError(f"{path}: {name!r} {must.format(value)}")


def load_run_files(run_dir):
    """(config, vocab) of a run directory, each checked, and the vocab against the config."""
    config_file, vocab_file = os.path.join(run_dir, "config.json"), os.path.join(run_dir, "vocab.model")
    config = load_config(config_file, config_file)
    vocab = load_vocab(vocab_file)
    check_vocab_matches(vocab, config, vocab_file)
    return config, vocab


def enclosing_run(path):
    """The nearest directory above `path` that is a run directory (is_run_dir), or None."""
    path = os.path.realpath(path)
    parent = os.path.dirname(path)
    while parent != path:
        if all(os.path.isfile(os.path.join(parent, name)) for name in RUN_FILES):  # is_run_dir(parent)
            return parent
        path, parent = parent, os.path.dirname(parent)
    return None


VIRTUAL = ("/proc", "/sys", "/dev")  # file systems of the kernel, not places for files


def check_out(run_dir):
    """Raise ValueError unless `run_dir` can become the new run's directory: absent, empty, or a run
    that stopped before its first checkpoint (which the new run replaces), and not inside another
    run directory (whose checkpoints it could be taken for, or hold). A symbolic link is followed:
    the run is written into its target, which must exist. Whether another job is writing it is
    check_not_written's to say, and writing's to settle. Its path must be UTF-8 (check_utf8_path):
    readers load the run's vocab.model through it."""
    check_utf8_path(run_dir, "run directory")
    if symlink_loop(run_dir):
        raise ValueError(f"--out {run_dir} is a symlink loop: following its links comes back to a link")
    if os.path.islink(run_dir) and not os.path.exists(run_dir):
        raise ValueError(f"--out {run_dir} is a symbolic link to {os.readlink(run_dir)}, which does not exist")
    real = os.path.realpath(run_dir)
    virtual = next((top for top in VIRTUAL if real == top or real.startswith(top + "/")), None)
    if virtual is not None:
        raise ValueError(f"--out {run_dir} is under {virtual}, a file system of the kernel: choose a directory")
    outer = enclosing_run(run_dir)
    if outer is not None:
        raise ValueError(
            f"--out {run_dir} is inside the run directory {outer}; a run directory is never made inside another: "
            "choose a directory outside it"
        )
    if os.path.exists(run_dir):
        if not os.path.isdir(run_dir):
            raise ValueError(f"--out {run_dir} is a file, not a directory")
        check_replaceable(run_dir)
        return
    parent = os.path.dirname(os.path.abspath(run_dir))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"--out {run_dir}: cannot create it, {parent} is not a writable directory")


def check_replaceable(run_dir):
    """Raise ValueError unless the existing directory `run_dir` is empty or a run that stopped
    before its first checkpoint."""
    # a run stopped before its first checkpoint (or before all of its files were written, when it
    # holds this module's lock file) holds nothing but run files
    names = set(os.listdir(run_dir))
    ours = names - {LOCK, STAGING} - {f"{name}.tmp" for name in RUN_FILES}
    if names and not (ours <= set(RUN_FILES) and (LOCK in names or ours == set(RUN_FILES))):
        raise ValueError(f"--out {run_dir} exists and is not empty; choose another, or --resume it")


def create_run_dir(run_dir, vocab_file, config, run_info):
    """Write the new run's files into `run_dir`, which `writing` made and holds, and return its
    run.json. The files of a run that stopped before its first checkpoint, which this one replaces,
    are removed by name, run.json first (the directory stops being a run); then vocab.model and
    config.json are written, each through a temporary name, and run.json, with their sha256, last:
    a directory is a run (is_run_dir) from the moment its run.json is there."""
    for name in ("run.json", "config.json", "vocab.model"):
        _remove(os.path.join(run_dir, name))
    shutil.rmtree(os.path.join(run_dir, STAGING), ignore_errors=True)

    def copy_vocab(f):
        with open(vocab_file, "rb") as src:
            shutil.copyfileobj(src, f)

    write_file(os.path.join(run_dir, "vocab.model"), copy_vocab)
    write_json(os.path.join(run_dir, "config.json"), config)
    run_info = {**run_info, **pinned_digests(run_dir)}
    write_json(os.path.join(run_dir, "run.json"), run_info)
    _sync_dir(run_dir)
    return run_info


# The writer's lock and what run.json pins


def _holder_of(fd):
    """What the lock file open at `fd` says of the process that took it."""
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        holder = json.loads(os.read(fd, 4096).decode())
        return f"pid {holder['pid']} on {holder['host']} (since {holder['since']})"
    except (OSError, ValueError, KeyError, TypeError):
        return "another process"


def writer(run_dir):
    """Who holds `run_dir`'s writer lock ("pid N on HOST (since TIME)"), or None: the run is not
    being written. Reads only; the test takes a shared lock for microseconds and drops it."""
    try:
        fd = os.open(os.path.join(run_dir, LOCK), os.O_RDONLY)
    except OSError:
        return None  # no lock file: never written by a job that takes one
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _holder_of(fd)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def check_not_written(run_dir, option):
    """Raise ValueError when another process is writing `run_dir`."""
    holder = writer(run_dir)
    if holder is not None:
        raise _being_written(option, run_dir, holder)


def _being_written(option, run_dir, holder):
    return ValueError(
        f"{option} {run_dir} is being written by {holder}: a run has one writer; "
        "wait for that job to end, or choose another directory"
    )


_held = {}  # os.path.abspath(run_dir) -> the fd of its .lock, while this process writes the run


def went_away(run_dir, last):
    """If the run directory this process writes is no longer at `run_dir` (renamed, moved or
    removed while the job ran), a line saying so and where its last checkpoint `last` (a path under
    `run_dir`, or None) now is, found from the lock file the job holds open (Linux's /proc);
    else None."""
    fd = _held.get(os.path.abspath(run_dir))
    if fd is None:
        return None
    try:
        if os.path.samestat(os.stat(os.path.join(run_dir, LOCK)), os.fstat(fd)):
            return None  # still there: the error was something else
    except OSError:
        pass
    try:
        now = os.path.dirname(os.readlink(f"/proc/self/fd/{fd}"))
    except OSError:
        now = None
    if now is None or now.endswith(" (deleted)") or not os.path.isdir(now):
        where = "it was removed, or moved where this system cannot say"
        return f"the run directory {run_dir} went away while the job ran ({where}); {last_checkpoint_message(last)}"
    moved = os.path.join(now, os.path.relpath(last, run_dir)) if last else None
    return (
        f"the run directory {run_dir} went away while the job ran: it is now {now}; "
        f"{last_checkpoint_message(moved)}; `fastformer train --resume {now}` continues"
    )


@contextlib.contextmanager
def writing(run_dir, option):
    """Hold `run_dir`'s writer lock inside the block: an exclusive flock on <run_dir>/.lock, with
    this process's pid, host and start time written in it. The directory is made if absent; if the
    block ends with nothing in it but the lock file, what was made is removed again, so that a
    refused or failed job leaves nothing. Another holder: ValueError naming it (`option` names the
    directory: --out or --resume), and nothing is changed. For a new run (--out) the directory is
    checked again once held: empty, or a run stopped before its first checkpoint."""
    made = []
    path = os.path.abspath(run_dir)
    while not os.path.lexists(path):
        made.append(path)
        path = os.path.dirname(path)
    for directory in reversed(made):
        try:
            os.mkdir(directory)
        except FileExistsError:  # another job made it first: not ours to remove
            made.remove(directory)
    lock = os.path.join(run_dir, LOCK)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    held = False
    try:
        deadline = time.monotonic() + LOCK_WAIT
        while not held:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                held = True
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise _being_written(option, run_dir, _holder_of(fd)) from None
                time.sleep(0.02)
        since = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": since}).encode(), 0)
        if option == "--out":
            check_replaceable(run_dir)
        _held[os.path.abspath(run_dir)] = fd
        yield
    finally:
        _held.pop(os.path.abspath(run_dir), None)
        if held and made and os.path.isdir(run_dir) and os.listdir(run_dir) == [LOCK]:
            _remove(lock)
            for directory in made:
                with contextlib.suppress(OSError):
                    os.rmdir(directory)
        os.close(fd)  # drops the lock


def pinned_digests(run_dir):
    """{run.json key: sha256} of the run's files that run.json pins (PINNED)."""
    return {key: file_sha256(os.path.join(run_dir, name), name) for name, key in PINNED.items()}


def check_pinned(run_dir, run_info):
    """Raise ValueError naming the first of the run's files that is not the one run.json pins (a
    file whose key run.json lacks, as older runs' run.json do, is not checked)."""
    for name, key in PINNED.items():
        if key in run_info:
            path = os.path.join(run_dir, name)
            digest = file_sha256(path, name)
            if digest != run_info[key]:
                raise ValueError(
                    f"{path} is not the file this run was trained with (sha256 {digest[:12]}..., run.json pins "
                    f"{str(run_info[key])[:12]}...); put the run's own {name} back, or train a new run"
                )


def still_training(run_dir):
    """A line for readers of a run that is being written (None when it is not): still training,
    and the checkpoint its model.pt comes from."""
    holder = writer(run_dir)
    if holder is None:
        return None
    newest = latest_checkpoint(run_dir)
    return f"{run_dir} is still training ({holder}); newest checkpoint: {newest or 'none yet'}"


def check_run_dir(run_dir):
    """The run.json of a run directory that holds a model to use, checked without torch: it has a
    model.pt (a run still training has none before its first checkpoint)."""
    info = load_run_json(run_dir)
    check_link(os.path.join(run_dir, "model.pt"), os.path.join(run_dir, "model.pt"))
    if not os.path.isfile(os.path.join(run_dir, "model.pt")):
        holder = writer(run_dir)
        if holder is not None:
            raise ValueError(f"{run_dir} is still training ({holder}) and has no checkpoint yet")
        raise ValueError(f"{run_dir} has no model.pt: its training stopped before the first checkpoint")
    return info


def load_run(run_dir, device=None):
    """(config, vocab, model in eval mode, run info) from a run directory."""
    import torch

    from fastformer.model import MovieClassification
    from fastformer.train.runtime import resolve_device

    info = check_run_dir(run_dir)
    model_file = os.path.join(run_dir, "model.pt")
    if not isinstance(device, torch.device):
        check_values({"device": device}, {"device": ("--device", DEVICE_NAME)})
        device = resolve_device(device)
    config_file = os.path.join(run_dir, "config.json")
    config = load_config(config_file, config_file)
    vocab = load_vocab(os.path.join(run_dir, "vocab.model"))
    check_vocab_matches(vocab, config)
    check_pinned(run_dir, info)
    if isinstance(info.get("n_output"), int) and info["n_output"] != config.n_output:  # the settled count
        raise ValueError(
            f"{os.path.join(run_dir, 'run.json')}: 'n_output' is {info['n_output']}, but config.json's n_output is "
            f"{config.n_output}: one of the two was changed after training"
        )
    names = info.get("label_names")
    if names is not None and len(names) != config.n_output:
        raise ValueError(
            f"{os.path.join(run_dir, 'run.json')}: 'label_names' has {len(names)} names, but the model has "
            f"{config.n_output} classes (config.json's n_output): a name a class"
        )
    model = MovieClassification(config)
    load_state_dict(model, _load_torch(model_file), model_file)
    return config, vocab, model.to(device).eval(), info
