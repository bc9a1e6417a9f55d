"""The run of `fastformer train`, from its options to the one object every step of the job takes.

    train(epochs=3, lr=1e-3)                          # the Python API (fastformer.train.job.train)
    train(TrainOptions(epochs=3, lr=1e-3))            # the same
    train(TrainOptions.from_args(args))               # what `fastformer train` does

In the order a job meets them:
- TrainOptions: the keyword arguments of fastformer.train.job.train, which the command builds from
  its arguments in one place; each field declares its flag, its check and its default in a new run.
  RunOptions are the options that make a run what it is (run.json's); DEFAULTS what a new run
  takes for one not given, the run's own under --resume. Also the checks of the other commands'
  options.
- check_inputs: the options, the config and vocab given, the data and its classes, and the run
  directory a new run will make or the run --resume continues, with the data it started on,
  checked before torch is imported. A bad input is one line (ValueError or OSError) before the
  vocab is trained and before anything is written.
- settle: what only torch can tell (the device, the GPU's memory, the checkpoint's tensors),
  checked right after, before any work, into the frozen Run that goes to every step of the job by
  name. Each check runs once: what needs no torch ran before it.

Nothing here imports torch at module level: the command checks its inputs before it does.
"""

import argparse
import collections.abc
import contextlib
import dataclasses
import itertools
import numbers
import os
import random
import time
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

from fastformer.config import (
    BYTES_TO_BUILD,
    BYTES_TO_TRAIN,
    TUTORIAL,
    Config,
    activation_count,
    check_fits,
    host_memory,
    parameter_count,
    size_text,
)
from fastformer.data import demo, rotten_tomatoes
from fastformer.data.files import absent_classes, check_labels, cut, infer_classes, read_reviews, shared_reviews
from fastformer.data.vocab import BOS, N_SPECIAL, PAD, check_vocab_matches, load_vocab
from fastformer.environment import BACKEND_ENV, BACKENDS, triton_available, under_torchrun
from fastformer.train.checks import (
    COUNT,
    DEVICE_NAME,
    LR,
    N_OUTPUT,
    PATH,
    SEED,
    SWITCH,
    VOCAB_SIZE,
    WARMUP,
    WEIGHT_DECAY,
    check_values,
    one_of,
)
from fastformer.train.rundir import (
    RUNS,
    check_not_written,
    check_out,
    check_pinned,
    check_resumable_dir,
    load_checkpoint,
    load_config,
    load_run_files,
    load_run_json,
    shell_word,
    writing,
)

if TYPE_CHECKING:
    import torch

    from fastformer.train.runtime import Launch

# The options: TrainOptions and their checks.

PATH_OPTIONS = ("train", "test", "vocab", "config")
AMPS = ("auto", "bf16", "fp16", "off")
DATASETS = ("demo", "rotten-tomatoes")  # --dataset: the embedded set, or what `fastformer data` prepared


def _option(name):
    return f"--{name.replace('_', '-')}"


def check_backend(backend_name, has_triton):
    """Raise ValueError when --backend triton is asked for without the triton package."""
    if backend_name == "triton" and not has_triton:
        raise ValueError(
            "--backend triton needs the triton package, which is not installed; pass --backend auto or reference"
        )


def check_on_device(device, backend_name, interpret, *, cuda_graphs=False, compile=False):
    """Raise ValueError naming the option that cannot run on `device` (a checked name, or a
    torch.device: its type decides): --backend triton off CUDA without Triton's interpreter,
    --cuda-graphs off CUDA, --compile of the Triton kernels off CUDA (off CUDA "auto" and
    "reference" run the reference). A job calls it once, as soon as the device is known: before
    torch when --device is given, else on the device it resolves."""
    if str(device).split(":")[0] == "cuda":
        return
    if backend_name == "triton" and not interpret:
        raise ValueError(
            f"--backend triton on {device} needs a CUDA GPU, or Triton's interpreter (TRITON_INTERPRET=1 in the "
            "environment, which runs the kernels slowly on a CPU); pass --backend auto or reference"
        )
    if cuda_graphs:
        raise ValueError(f"--cuda-graphs needs a CUDA device; the device is {device}")
    if compile and backend_name == "triton":
        raise ValueError(
            f"--compile on {device} needs the reference kernels: torch.compile cannot trace the "
            "Triton kernels through Triton's CPU interpreter; pass --backend auto or reference"
        )


class StepModes(NamedTuple):
    """How a train job's steps run: as given and checked (step_modes), with None for what the
    device decides, then resolved (settle_steps). run.json records them; they change the speed and
    the rounding, not the math."""

    cuda_graphs: bool | None  # each step replayed from a CUDA graph (None: where it applies)
    compile: bool  # the model through torch.compile(fullgraph=True)
    pad_to_buckets: bool | None  # batches padded to bucket lengths (None: with CUDA graphs)
    precompile: bool | None  # the bucket shapes' kernels compiled before the first step (None: with buckets)


def step_modes(amp, distributed, *, cuda_graphs, compile, pad_to_buckets, precompile):
    """The StepModes of --cuda-graphs, --compile, --pad-to-buckets and --precompile as given (None:
    not given), with --amp as given and `distributed` (under torchrun); raise ValueError naming the
    option for a combination that cannot run. What the device decides (CUDA graphs where not
    given, and the defaults that follow them) is settle_steps'; what it cannot run,
    check_on_device's. ("auto" amp is never fp16, so amp as given decides.)"""
    if cuda_graphs:
        if compile:
            raise ValueError("--cuda-graphs and --compile are alternatives: pass one")
        if amp == "fp16":
            raise ValueError(
                "--cuda-graphs does not take --amp fp16: its GradScaler reads the host at every step; "
                "use --amp bf16 (the default on CUDA) or off"
            )
        if pad_to_buckets is False:
            raise ValueError(
                "--cuda-graphs needs --pad-to-buckets: a graph is captured per batch shape, and without "
                "buckets every review length is a shape"
            )
        if distributed:
            raise ValueError("--cuda-graphs is not supported under torchrun")
    if compile and distributed:
        raise ValueError("--compile is not supported under torchrun")
    if precompile and compile:
        raise ValueError(
            "--precompile and --compile are alternatives: torch.compile compiles the kernels of its "
            "own graph at its first step"
        )
    if precompile and pad_to_buckets is False:
        raise ValueError(PRECOMPILE_NEEDS_BUCKETS)
    return StepModes(cuda_graphs, compile, pad_to_buckets, precompile)


PRECOMPILE_NEEDS_BUCKETS = (
    "--precompile needs --pad-to-buckets: the kernels are compiled for the batch shapes, and without "
    "buckets every review length is a shape"
)


def eager_because(device, amp, distributed, compile, pad_to_buckets):
    """Why a job given neither --cuda-graphs nor --no-cuda-graphs runs its steps eagerly, in a few
    words, or None where it replays them from CUDA graphs (fastformer.train.graphs)."""
    if device.type != "cuda":
        return f"CUDA graphs need a CUDA device; the device is {device}"
    if amp == "fp16":
        return "--amp fp16: its GradScaler reads the host at every step, which a CUDA graph cannot"
    if compile:
        return "--compile runs torch.compile's graph instead"
    if distributed:
        return "CUDA graphs are not supported under torchrun"
    if pad_to_buckets is False:
        return "--no-pad-to-buckets: a graph is captured per batch shape, and every review length would be one"
    return None


def settle_steps(modes, device, amp, distributed):
    """(the StepModes of step_modes resolved on `device` under `amp`, why the steps run eagerly
    where CUDA graphs were not given and do not apply, else None). Where not given: CUDA graphs
    where they apply (eager_because), --pad-to-buckets with them, --precompile with buckets unless
    --compile; --precompile without buckets raises ValueError."""
    cuda_graphs, why = modes.cuda_graphs, None
    if cuda_graphs is None:
        why = eager_because(device, amp, distributed, modes.compile, modes.pad_to_buckets)
        cuda_graphs = why is None
    pad_to_buckets = cuda_graphs if modes.pad_to_buckets is None else modes.pad_to_buckets
    precompile = pad_to_buckets and not modes.compile if modes.precompile is None else modes.precompile
    if precompile and not pad_to_buckets:
        raise ValueError(PRECOMPILE_NEEDS_BUCKETS)
    return StepModes(cuda_graphs, modes.compile, pad_to_buckets, precompile), why


def parse_n_output(text):
    """--n-output: "auto" or a positive integer."""
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer or auto, got {text!r}")
    return value


BACKEND_HELP = (
    "where the math runs (default: $FASTFORMER_BACKEND when set, else auto: Triton kernels on CUDA, "
    "the PyTorch reference elsewhere)"
)
# The options every command that runs the model takes (train, evaluate, predict, demo): each field's
# flag as argparse takes it ("flag": the option's name where it is not --the-field-name).
RUNTIME_FLAGS = {
    "device": {"help": "cpu, cuda, cuda:1, ... (default: cuda if available)"},
    "backend_name": {"flag": "--backend", "choices": list(BACKENDS), "help": BACKEND_HELP},
    "amp": {
        "default": "auto",
        "choices": list(AMPS),
        "help": "autocast dtype (default auto: bf16 on CUDA, off on CPU)",
    },
}


def flag(value=None, *, check, run=False, new_run=None, **parser_args):
    """A TrainOptions field of default `value` with its `fastformer train` flag declared beside it:
    argparse's arguments (help, type, action, its own default where it parses to another value
    than the field's, ...; "flag" where the option is not --the-field-name), from which
    fastformer.cli builds the command's parser, in the fields' order. `run`: the option makes the
    run what it is (a RunOptions field: run.json records it, --resume refuses another value);
    `new_run`: what a new run takes when it is not given (DEFAULTS); `check`: what a value given
    must be (a Check; TrainOptions.checked and the other commands' checks read it, in CHECKS)."""
    metadata = {"argparse": parser_args, "check": check, "run": run, "new_run": new_run}
    return dataclasses.field(default=value, metadata=metadata)


@dataclasses.dataclass
class TrainOptions:
    """What `fastformer train` and fastformer.train.job.train take, field for option (--backend is
    backend_name), each field declared with its flag. None means not given: a new run takes
    DEFAULTS (or a default that depends on the device), a resumed one the run's value. A new
    option is a field here (its flag, whether it makes the run what it is and its default in a
    new run declared in `flag`) with its Check, and its use."""

    train: str | None = flag(
        check=PATH, run=True, metavar="FILE", help="training reviews (default: the embedded demo set)"
    )
    test: str | None = flag(
        check=PATH, run=True, metavar="FILE", help="test reviews (default: the demo test set, or 10%% of --train)"
    )
    dataset: str | None = flag(
        check=one_of(DATASETS),
        choices=list(DATASETS),
        help="instead of --train/--test: the embedded demo set (the default), or the Rotten Tomatoes snippets "
        "`fastformer data rotten-tomatoes` prepared",
    )
    vocab: str | None = flag(
        check=PATH, run=True, metavar="MODEL", help="an existing SentencePiece model (default: train one)"
    )
    vocab_size: int | None = flag(
        check=VOCAB_SIZE, run=True, new_run=8000, type=int, help="BPE pieces besides the 7 special ones (default 8000)"
    )
    config: str | None = flag(
        check=PATH, run=True, metavar="JSON", help="model config (default: the tutorial's on CUDA, smaller on CPU)"
    )
    n_output: int | str | None = flag(
        check=N_OUTPUT,
        run=True,
        type=parse_n_output,
        metavar="N|auto",
        help="number of classes (default: the config's n_output, 2 in the tutorial's); auto: from the training labels",
    )
    epochs: int | None = flag(check=COUNT, new_run=5, type=int, help="epochs in total (default 5)")
    # per process, under torchrun
    batch_size: int | None = flag(
        check=COUNT, run=True, type=int, help="reviews per batch (default 128 on CUDA, 64 on CPU)"
    )
    lr: float | None = flag(
        check=LR, run=True, new_run=5e-4, type=float, help="peak AdamW learning rate (default 5e-4)"
    )
    warmup: float | None = flag(
        check=WARMUP, run=True, new_run=0.1, type=float, help="fraction of steps of linear warm-up (default 0.1)"
    )
    weight_decay: float | None = flag(
        check=WEIGHT_DECAY,
        run=True,
        new_run=0.01,
        type=float,
        help="AdamW weight decay of the weight matrices (default 0.01)",
    )
    bucket: bool | None = flag(
        check=SWITCH,
        run=True,
        new_run=True,
        action=argparse.BooleanOptionalAction,
        help="batch reviews of similar length together to cut padding (default on)",
    )
    device: str | None = flag(check=DEVICE_NAME, **RUNTIME_FLAGS["device"])
    # not given on the command line: $FASTFORMER_BACKEND's (from_args)
    backend_name: str = flag("auto", check=one_of(BACKENDS), **RUNTIME_FLAGS["backend_name"])
    amp: str = flag("auto", check=one_of(AMPS), **RUNTIME_FLAGS["amp"])
    cuda_graphs: bool | None = flag(
        check=SWITCH,
        action=argparse.BooleanOptionalAction,
        help="capture each train and evaluation step as a CUDA graph once per batch shape and replay it, with "
        "--pad-to-buckets (default: on where it applies: CUDA, bf16 or no autocast, one process, no --compile; "
        "the job says why where it does not)",
    )
    compile: bool = flag(
        False,
        check=SWITCH,
        action="store_true",
        help="run the model through torch.compile(model, fullgraph=True) (the Triton kernels only on CUDA)",
    )
    pad_to_buckets: bool | None = flag(
        check=SWITCH,
        action=argparse.BooleanOptionalAction,
        help="pad each batch to its longest review rounded up to a multiple of 16 (at most the config's n_enc_seq), "
        "so that steps see few shapes (default: on with CUDA graphs, else off)",
    )
    precompile: bool | None = flag(
        check=SWITCH,
        action=argparse.BooleanOptionalAction,
        help="compile the Triton kernels of every batch shape before the first step, in parallel, with a "
        "progress bar (needs --pad-to-buckets, which makes the shapes known; default: on with it)",
    )
    autotune: bool = flag(
        False,
        check=SWITCH,
        action="store_true",
        help="time every candidate config of each Triton kernel on first use and keep the fastest, cached on disk "
        "per GPU model, instead of each kernel's rule picking one (as FASTFORMER_AUTOTUNE=1 does)",
    )
    out: str | None = flag(check=PATH, metavar="DIR", help="run directory (default runs/sentiment-<date>-<time>)")
    seed: int | None = flag(
        check=SEED,
        run=True,
        new_run=0,
        type=int,
        help="seed of the initial weights, the split and the data order (default 0)",
    )
    max_steps: int | None = flag(check=COUNT, type=int, help="stop after this many optimizer steps")
    resume: str | None = flag(
        check=PATH, metavar="DIR", help="continue a run directory up to --epochs, with the options it started with"
    )

    @classmethod
    def from_args(cls, args):
        """The options of an argparse namespace that has an attribute per field (and maybe more); a
        backend not given is $FASTFORMER_BACKEND's, else "auto" (default_backend)."""
        options = {field.name: getattr(args, field.name) for field in dataclasses.fields(cls)}
        if options["backend_name"] is None:
            options["backend_name"] = default_backend()
        return cls(**options)

    def checked(self):
        """These options checked, each by the Check its field declares (ValueError naming the first
        option whose value cannot be right: its type and range; the step modes together are
        step_modes' to check, what the device decides check_on_device's, the files check_inputs'),
        and with Python's own numbers: an integer or a float of another type (numpy's, say) becomes
        an int or a float, as json and torch take them."""
        values = {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}
        check_values(values, CHECKS)
        changes = {}
        for name, value in values.items():
            if type(value) in (int, float, bool, str) or value is None:
                continue
            if isinstance(value, numbers.Integral):
                changes[name] = int(value)
            elif isinstance(value, numbers.Real):
                changes[name] = float(value)
        return dataclasses.replace(self, **changes)


# {name: (option, Check)} of every TrainOptions field: what check_values checks a value given by
CHECKS = {
    field.name: (field.metadata["argparse"].get("flag", _option(field.name)), field.metadata["check"])
    for field in dataclasses.fields(TrainOptions)
}
# The options that make a run what it is (flag(run=True)), resolved: _new_run and
# resumed_options make them, and the batch size is settled once the device is known (None till
# then). run.json records them, and --resume refuses a value other than the run's for any. The
# paths are absolute (train the demo set's without --train; test None: a split of train's);
# vocab_size is None with a vocab given; n_output a number, "auto" (from the labels) or None (the
# config's).
RunOptions = dataclasses.make_dataclass(
    "RunOptions",
    [(field.name, field.type) for field in dataclasses.fields(TrainOptions) if field.metadata["run"]],
    frozen=True,
)
RunOptions.__module__ = __name__
RunOptions.__doc__ = "The options that make a run what it is, resolved (see the comment above it)."
RUN_OPTIONS = tuple(field.name for field in dataclasses.fields(RunOptions))
# what a new run takes for an option not given (flag's new_run); batch_size's depends on the device
DEFAULTS = {
    field.name: field.metadata["new_run"]
    for field in dataclasses.fields(TrainOptions)
    if field.metadata["new_run"] is not None
}


def default_backend():
    """The commands' --backend when none is given: $FASTFORMER_BACKEND when it is set (ValueError
    naming it when it is not a backend), else "auto"."""
    name = os.environ.get(BACKEND_ENV, "auto")
    check_values({"backend_name": name}, {"backend_name": (f"${BACKEND_ENV}", CHECKS["backend_name"][1])})
    return name


def check_run_options(device, backend_name, amp, batch_size=None):
    """Raise ValueError naming the first of the options `evaluate`, `predict` and `demo` share that
    cannot be right."""
    check_values({"batch_size": batch_size, "device": device, "backend_name": backend_name, "amp": amp}, CHECKS)


def check_texts(texts):
    """`predict`'s texts as a list: a str is one text, and any other iterable of str (a generator
    too) is read once. At least one, none empty or only whitespace (the model would see padding
    only, and still answer). TypeError for a value that is neither, or an item that is not a str."""
    if isinstance(texts, str):
        texts = [texts]
    elif isinstance(texts, (bytes, bytearray)) or not isinstance(texts, collections.abc.Iterable):
        raise TypeError(f"texts must be a str or an iterable of str, got {type(texts).__name__}")
    else:
        texts = list(texts)
    if not texts:
        raise ValueError("give at least one text to classify")
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise TypeError(f"text {i + 1} of {len(texts)} is a {type(text).__name__}, not a str")
        if not text.strip():
            raise ValueError(
                f"text {i + 1} of {len(texts)} ({text!r}) is empty or only whitespace: nothing to classify"
            )
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as error:
            raise ValueError(
                f"text {i + 1} of {len(texts)} ({cut(text)!r}) is not UTF-8: {_not_text(text[error.start])} at "
                f"character {error.start + 1}; give the text in UTF-8"
            ) from None
    return texts


def _not_text(char):
    """What a surrogate in a str stands for: a byte that was not UTF-8 (how Python reads such a byte
    of a command line, os.fsdecode's surrogateescape), or a lone surrogate."""
    if "\udc80" <= char <= "\udcff":
        return f"byte 0x{ord(char) - 0xDC00:02x}"
    return f"a lone surrogate U+{ord(char):04X}"


def check_demo_options(device, backend_name, amp, batch_size, seq_len, seed):
    """Raise ValueError naming the first option of `demo` that cannot be right: the batch of random
    reviews must fit the tutorial's model and this machine's memory."""
    check_run_options(device, backend_name, amp, batch_size)
    check_values({"seq_len": seq_len, "seed": seed}, {**CHECKS, "seq_len": ("--seq-len", COUNT)})
    if seq_len > TUTORIAL["n_enc_seq"]:
        raise ValueError(
            f"--seq-len {seq_len} is longer than the tutorial config's n_enc_seq, "
            f"{TUTORIAL['n_enc_seq']}: the longest review its model reads"
        )
    # a lower bound: every layer keeps at least its (bs, seq_len, d_hidn) fp32 output for the backward
    kept = batch_size * seq_len * TUTORIAL["d_hidn"] * 4 * (2 * TUTORIAL["n_layer"] + 1)
    memory = host_memory()
    if memory is not None and kept > memory:
        raise ValueError(
            f"--batch-size {batch_size} with --seq-len {seq_len}: the forward would keep at least {kept:,} bytes "
            f"({size_text(kept)}) of activations, more than this machine's memory ({size_text(memory)})"
        )


DEFAULT_BATCH_SIZE = {"cuda": 128, "cpu": 64}  # by device type: a new run's batch size when none is given


def default_out():
    return os.path.join(RUNS, time.strftime("sentiment-%Y%m%d-%H%M%S"))


def resumed_options(resume, previous, given):
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
    return RunOptions(**{name: previous[name] for name in RUN_OPTIONS})


def check_world_size(resume, previous, launch):
    """--resume needs the number of processes the run trained on: it fixes the batches and steps."""
    trained_on = previous.get("world_size", 1)
    if trained_on != launch.world_size:
        how = f"torchrun --nproc_per_node {trained_on} -m fastformer train" if trained_on > 1 else "fastformer train"
        raise ValueError(
            f"--resume {resume}: the run trained on {trained_on} process(es), this job has {launch.world_size}; "
            f"continue it with `{how} --resume {shell_word(resume)}`"
        )


def check_resumable(resume, checkpoint, epochs, max_steps):
    """Raise ValueError when the run's checkpoint (load_checkpoint's, or None) already has `epochs`
    epochs or `max_steps` steps: there would be nothing left to train."""
    done_epochs, done_steps = (checkpoint[2]["epoch"], checkpoint[2]["step"]) if checkpoint else (0, 0)
    if done_epochs >= epochs:
        raise ValueError(f"--resume {resume}: the run already has {done_epochs} epochs; pass --epochs > {done_epochs}")
    if max_steps is not None and done_steps >= max_steps:
        raise ValueError(f"--resume {resume}: the run already has {done_steps} steps; pass --max-steps > {done_steps}")


# The inputs, checked before torch: check_inputs.

# The tutorial's model is the CUDA default; on a CPU the job trains this smaller one (same shape
# of network, 3 layers of width 128) so that the default run finishes in a few minutes.
CPU_OVERRIDES = {"n_layer": 3, "d_hidn": 128, "n_head": 4, "d_head": 32, "d_ff": 512, "n_enc_seq": 128, "n_dec_seq": 8}
DATA_FILES = ("train", "test")  # the options whose files run.json keeps a digest of


def default_config(device_type, n_vocab, n_output):
    """The config of a run given no --config: the tutorial's on CUDA, CPU_OVERRIDES elsewhere."""
    overrides = {} if device_type == "cuda" else CPU_OVERRIDES
    return Config.tutorial(n_enc_vocab=n_vocab, n_dec_vocab=n_vocab, n_output=n_output, **overrides)


class Data(NamedTuple):
    train: list  # of Review
    test: list
    n_classes: int


class TrainInputs(NamedTuple):
    """What check_inputs found: everything fastformer.train.job.train needs that is not torch's."""

    options: TrainOptions  # as given, with --dataset's files as train and test
    run_options: RunOptions  # batch_size None until the device is known
    epochs: int  # in total
    run_dir: str
    writes: bool  # whether this process writes the run directory: rank 0 under torchrun, else always
    config: Config | None  # None: the default config, built once the device and vocab are known
    vocab: object  # the SentencePiece vocab, or None: trained on the data
    checkpoint: str | None  # the checkpoint --resume continues from; None: from the start
    previous: dict | None  # the run.json of the run resumed; None for a new run
    using_demo: bool
    data: Data | None = None  # None until read (check_inputs reads it)
    digests: dict | None = None  # the sha256 of each data file: {"train": ..., "test": ... or None}
    modes: StepModes | None = None  # how the steps run (check_inputs settles them)
    started: float | None = None  # time.monotonic() when check_inputs began: the job's clock (first step)


def check_inputs(options):
    """Check `options` (a TrainOptions) and every file they name, read the data and settle its
    classes, without torch; returns the TrainInputs, or raises ValueError or OSError in one line."""
    started = time.monotonic()
    options = options.checked()
    if options.dataset is not None:
        options = dataclasses.replace(
            options, **dict(zip(DATA_FILES, dataset_files(options.dataset, options.train, options.test)))
        )
    has_triton, interpret = triton_available()
    check_backend(options.backend_name, has_triton)
    if options.device is not None:  # else settle checks the device it resolves
        check_on_device(
            options.device, options.backend_name, interpret, cuda_graphs=options.cuda_graphs, compile=options.compile
        )
    modes = step_modes(
        options.amp,
        under_torchrun(),
        cuda_graphs=options.cuda_graphs,
        compile=options.compile,
        pad_to_buckets=options.pad_to_buckets,
        precompile=options.precompile,
    )
    resuming = options.resume is not None
    writes = int(os.environ.get("RANK", "0")) == 0  # under torchrun rank 0 alone writes the run directory
    inputs = _resumed_run(options, writes) if resuming else _new_run(options, writes)
    data, digests = read_data(inputs.run_options, inputs.config, resuming)
    if resuming:
        _check_same_data(options.resume, inputs.previous, inputs.run_options, digests)
    if inputs.vocab is None:
        _check_vocab_to_train(inputs.run_options, inputs.config, data.train)
    _check_fits_host(options, inputs.config, inputs.vocab, data.n_classes)
    if not resuming:
        _check_every_class(inputs.run_options, inputs.config, data)
    # the classes the data settled are the run's n_output
    run_options = dataclasses.replace(inputs.run_options, n_output=data.n_classes)
    return inputs._replace(run_options=run_options, data=data, digests=digests, modes=modes, started=started)


@contextlib.contextmanager
def run_dir_held(inputs):
    """Inside the block this process is the one writer of the run directory (run_dir.writing), from
    before the vocab is trained to the end of the job; under torchrun rank 0 holds it (the other
    ranks write nothing there)."""
    if not inputs.writes:
        yield
        return
    with writing(inputs.run_dir, "--out" if inputs.options.resume is None else "--resume"):
        yield


def dataset_files(dataset, train, test):
    """The (train, test) files of --dataset: (None, None) for the embedded demo set, the files
    `fastformer data rotten-tomatoes` wrote to its default cache; ValueError beside --train or
    --test, or when those files are not there."""
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


def _new_run(options, writes):
    """The TrainInputs of a new run but its data: its options, the config and vocab given (checked
    together), and its directory, checked to be one it can create."""
    # paths made absolute, the embedded demo set without --train, DEFAULTS for the rest but the
    # batch size, whose default depends on the device (settle)
    given = {name: getattr(options, name) for name in RUN_OPTIONS}
    using_demo = given["train"] is None
    if using_demo and given["test"] is not None:
        raise ValueError(
            f"--test {given['test']} needs --train: without --train the run trains and tests on the embedded "
            "demo set; pass --train FILE too"
        )
    if using_demo:
        given.update(train=demo.TRAIN_FILE, test=demo.TEST_FILE)
    run_options = {name: DEFAULTS.get(name) if value is None else value for name, value in given.items()}
    for name in PATH_OPTIONS:
        run_options[name] = given[name] and os.path.abspath(given[name])
    if given["vocab"] is not None:  # the vocab's pieces are its own
        run_options["vocab_size"] = None
    config = load_config(options.config, f"--config {options.config}") if options.config is not None else None
    if config is not None:
        check_decoder_vocab(config, f"--config {options.config}")
    vocab = load_vocab(options.vocab) if options.vocab is not None else None
    if vocab is not None:
        check_vocab_size_given(options.vocab_size, vocab, options.vocab)
    if vocab is not None and config is not None:
        check_vocab_matches(vocab, config, "--vocab")
    run_dir = options.out or default_out()
    if writes:  # the other ranks of a torchrun job would see rank 0's lock
        check_not_written(run_dir, "--out")
    check_out(run_dir)
    return TrainInputs(
        options,
        RunOptions(**run_options),
        epochs=options.epochs or DEFAULTS["epochs"],
        run_dir=run_dir,
        writes=writes,
        config=config,
        vocab=vocab,
        checkpoint=None,
        previous=None,
        using_demo=using_demo,
    )


def check_vocab_size_given(vocab_size, vocab, vocab_file):
    """--vocab-size is the size of a vocab to train: beside --vocab, whose pieces are its own, it
    must be that vocab's (its pieces besides the N_SPECIAL special ones), or it would be dropped."""
    has = vocab.get_piece_size() - N_SPECIAL
    if vocab_size is not None and vocab_size != has:
        raise ValueError(
            f"--vocab-size {vocab_size} and --vocab {vocab_file}: --vocab-size is the size of a vocab to train, and "
            f"the vocab given has {has:,} pieces besides the {N_SPECIAL} special ones; leave --vocab-size out"
        )


def check_decoder_vocab(config, what):
    """The classifier's decoder reads one token, [BOS]: its id must be in the decoder's vocab."""
    if config.n_dec_vocab <= BOS[0]:
        raise ValueError(
            f"{what}: config.n_dec_vocab is {config.n_dec_vocab}, but the classifier's decoder reads {BOS[1]}, "
            f"id {BOS[0]}: n_dec_vocab must be at least {BOS[0] + 1}"
        )


def _resumed_run(options, writes):
    """The TrainInputs of the run `options.resume` continues but its data: its options (any given
    must be the run's), config, vocab and the checkpoint to continue from."""
    resume = options.resume
    previous = load_run_json(resume, required=("epochs", "demo_data", *RUN_OPTIONS))
    if writes:
        check_not_written(resume, "--resume")
    _check_resume_only_options(options, previous)
    run_options = resumed_options(resume, previous, {name: getattr(options, name) for name in RUN_OPTIONS})
    config, vocab = load_run_files(resume)
    check_pinned(resume, previous)
    checkpoint = check_resumable_dir(resume)
    return TrainInputs(
        options,
        run_options,
        epochs=options.epochs or previous["epochs"],
        run_dir=resume,
        writes=writes,
        config=config,
        vocab=vocab,
        checkpoint=checkpoint,
        previous=previous,
        using_demo=previous["demo_data"],
    )


def _check_resume_only_options(options, previous):
    """--out and --dataset say where a new run goes and what it trains on: with --resume they must
    be the run's own (the run directory; its data set), as every run option must."""
    resume = options.resume
    if options.out is not None and os.path.realpath(options.out) != os.path.realpath(resume):
        raise ValueError(
            f"--resume {resume} writes into the run it continues; --out {options.out} differs: "
            "leave --out out, or start a new run there"
        )
    if options.dataset is not None:
        theirs = previous.get("dataset") or ("demo" if previous["demo_data"] else "the files of --train/--test")
        if options.dataset != theirs:
            raise ValueError(
                f"--resume {resume}: --dataset {options.dataset} differs from the run's ({theirs}); "
                "leave it out to continue the run as it started, or start a new run"
            )


def _check_same_data(resume, previous, run_options, digests):
    """--resume continues on the data the run started with: each file's sha256 must be the one
    run.json recorded (a run.json without them is not checked)."""
    recorded = previous.get("data_sha256") or {}
    for name in DATA_FILES:
        if name in recorded and recorded[name] != digests[name]:
            raise ValueError(
                f"--resume {resume}: the {name} file {getattr(run_options, name)} is not the one the run started with "
                f"(sha256 {str(digests[name])[:12]}..., the run's {str(recorded[name])[:12]}...); continue it "
                "on the same data, or start a new run"
            )


def read_data(options, config, resuming):
    """The run's reviews from its `options` (RunOptions), their labels checked against the classes:
    the config's (always under --resume), inferred with n_output "auto", else n_output or the
    tutorial's 2. Without a test file, 10% of the train reviews are held out. A new run's test file
    must not be its train file (by a link, or a copy of its bytes), and its classes must be two or
    more (that its train reviews hold each, _check_every_class checks once the model is known to
    fit). Sets n_output in `config` (None: the default config, built later). Returns the Data and
    the sha256 of each data file ({"train": ..., "test": ... or None}), from the pass that read it."""
    train, test = options.train, options.test
    if test is not None and not resuming:
        _check_not_train_file(train, test)
    train_reviews = read_reviews(train, "train", progress=True)
    test_reviews = read_reviews(test, "test", progress=True) if test is not None else None
    # the files' sha256, from the same pass as their reviews
    digests = {"train": train_reviews.sha256, "test": test_reviews and test_reviews.sha256}
    if test is not None and not resuming and digests["test"] == digests["train"]:
        raise ValueError(
            f"--test {test} holds the same bytes as --train {train} (sha256 {digests['train'][:12]}...): its "
            "accuracy would be the training accuracy; pass a file of other reviews, or leave --test out to hold "
            "out 10% of --train"
        )
    if test is not None and not resuming:
        _check_test_is_not_train(train, test, train_reviews, test_reviews)
    if config is not None and (resuming or options.n_output is None):
        n_classes = config.n_output
    elif options.n_output == "auto":
        n_classes = infer_classes(train_reviews, f"train file {train}")
    else:
        n_classes = options.n_output or TUTORIAL["n_output"]
    if n_classes < 2 and not resuming:
        raise ValueError(
            f"train file {train}: {_classes_from(options, config, n_classes)} gives {n_classes} class; a classifier "
            "needs 2 or more (with one, every answer is right and the accuracy is 1.0 whatever the model learns)"
        )
    hint = "" if resuming else "; pass --n-output with the number of classes, or --n-output auto"
    for reviews, source in ((train_reviews, f"train file {train}"), (test_reviews, f"test file {test}")):
        if reviews is None:  # no test file: the test reviews are held out of the train reviews
            continue
        try:
            check_labels(reviews, n_classes, source)
        except ValueError as error:
            raise ValueError(f"{error}{hint}") from None
    if test_reviews is None:
        train_reviews, test_reviews = _split(train_reviews, 0.1, options.seed)
    if config is not None:
        config.n_output = n_classes
    return Data(train_reviews, test_reviews, n_classes), digests


def _classes_from(options, config, n_classes):
    """What set a new run's number of classes, for messages."""
    if config is not None and options.n_output is None:
        return f"config.n_output of --config {options.config}"
    if options.n_output == "auto":
        return "--n-output auto, from its labels,"
    return f"--n-output {n_classes}" if options.n_output else f"the default n_output, {n_classes}"


def _check_every_class(options, config, data):
    """A new run's train reviews must hold every class (a resumed run's were checked when it
    started): a class no review has is never learnt, and its test accuracy says nothing of it. So
    must the train reviews left once the test split is held out of them (no --test)."""
    n_classes, train_labels = data.n_classes, data.train.labels
    split = options.test is None
    absent = absent_classes(itertools.chain(train_labels, data.test.labels) if split else train_labels, n_classes)
    if absent:
        raise ValueError(
            f"train file {options.train} has no review of label {absent}, of the {n_classes} classes "
            f"0..{n_classes - 1} ({_classes_from(options, config, n_classes)}): the model would never learn it; add "
            "reviews of that label, or pass --n-output with the number of classes the file has"
        )
    absent = absent_classes(train_labels, n_classes) if split else ""
    if absent:
        raise ValueError(
            f"holding out 10% of train file {options.train} as the test split left no review of label {absent} to "
            "train on; pass --test FILE, or add reviews of that label"
        )


def _check_not_train_file(train, test):
    """--test must not be --train by another name: a symlink, a hard link or the same path (a copy
    of its bytes is refused once both are read). A path that is not there is the readers' to report."""
    with contextlib.suppress(OSError):
        if os.path.samefile(train, test):
            how = "" if os.path.abspath(train) == os.path.abspath(test) else " by another name (a link)"
            raise ValueError(
                f"--test {test} is the same file as --train {train}{how}: its accuracy would be the training "
                "accuracy; pass a file of other reviews, or leave --test out to hold out 10% of --train"
            )


def _check_test_is_not_train(train, test, train_reviews, test_reviews):
    """--test's reviews must not be --train's: all of them, saved another way (CRLF line endings, a
    byte-order mark) or copied over, is an error; some of them a warning with the count."""
    shared = shared_reviews(train_reviews, test_reviews)
    same = "the same text, up to case and white space"
    if shared == len(test_reviews):
        raise ValueError(
            f"every review of --test {test} ({shared}) is also in --train {train} ({same}): its accuracy would be "
            "the training accuracy; pass a file of other reviews, or leave --test out to hold out 10% of --train"
        )
    if shared:
        warnings.warn(
            f"{shared} of the {len(test_reviews)} reviews of --test {test} are also in --train {train} ({same}): "
            "the test accuracy counts them, reviews the model learnt",
            stacklevel=3,
        )


def _split(reviews, fraction, seed):
    order = list(range(len(reviews)))
    random.Random(seed).shuffle(order)
    n_test = max(1, int(len(reviews) * fraction))
    if n_test >= len(reviews):
        raise ValueError(f"--train has {len(reviews)} reviews: too few to hold out a test split; pass --test")
    return reviews.take(order[n_test:]), reviews.take(order[:n_test])


def _check_vocab_to_train(options, config, reviews):
    """A vocab is trained on the train reviews' texts: they must be texts, and the vocab's ids must
    fit `config` (None: the default config, built to fit the vocab)."""
    if reviews.pieces:
        raise ValueError(f"{options.train} holds pieces of an existing vocab (JSONL); pass that vocab with --vocab")
    n_pieces = options.vocab_size
    if config is not None and n_pieces + N_SPECIAL > config.n_enc_vocab:
        raise ValueError(
            f"--vocab-size {n_pieces} gives up to {n_pieces + N_SPECIAL} pieces but config.n_enc_vocab is "
            f"{config.n_enc_vocab}: the ids would not fit the embedding; pass --vocab-size "
            f"{config.n_enc_vocab - N_SPECIAL} or less"
        )
    if config is not None and config.i_pad != PAD[0]:
        raise ValueError(f"config.i_pad is {config.i_pad} but a trained vocab pads with id {PAD[0]}")


def _check_fits_host(options, config, vocab, n_classes):
    """The model is built on the host before it moves to its device: its fp32 weights must fit this
    machine's memory. A default config is checked with the smaller (CPU) sizes and a vocab yet to
    be trained without its pieces; fastformer.train.job checks the rest once the device is known."""
    if config is None:
        device_type = None if options.device is None else options.device.split(":")[0]
        config = default_config(device_type, vocab.get_piece_size() if vocab else N_SPECIAL, n_classes)
    check_fits(config, host_memory(), "this machine's memory", BYTES_TO_BUILD, size_names(options))


def size_names(options):
    """How check_fits names a config size that an option set: --n-output."""
    return {"n_output": "--n-output"} if options.n_output is not None else {}


# The Run, settled once torch is imported: settle.


@dataclasses.dataclass(frozen=True)
class Run:
    """What a train job runs with: its inputs, where and how it runs, and where it starts."""

    inputs: TrainInputs  # the options as given, the data, config, vocab, run directory, run resumed
    options: RunOptions  # what makes the run what it is (run.json's), batch_size settled
    device: "torch.device"
    amp: str  # "bf16", "fp16" or "off"
    launch: "Launch"
    cuda_graphs: bool  # each step replayed from a CUDA graph
    compile: bool  # the model through torch.compile(fullgraph=True)
    pad_to_buckets: bool  # batches padded to bucket lengths
    precompile: bool  # the bucket shapes' kernels compiled before the first step
    eager_because: str | None  # why the steps run eagerly where CUDA graphs were not given (settle_steps)
    log: Callable  # the job's `log` on rank 0, quiet on the others
    checkpoint: tuple | None  # load_checkpoint's (model state, its file, trainer state); None: from the start
    epochs: int  # the run's epochs in total

    @property
    def run_dir(self):
        return self.inputs.run_dir

    @property
    def max_steps(self):
        """Where this invocation stops (None: at the end of the epochs)."""
        return self.inputs.options.max_steps

    @property
    def resuming(self):
        return self.inputs.options.resume is not None

    def step_modes(self):
        """The step modes as run.json records them."""
        names = ("cuda_graphs", "compile", "pad_to_buckets", "precompile", "eager_because")
        return {name: getattr(self, name) for name in names}


def settle(inputs, log):
    """The Run of checked inputs (check_inputs), after the checks that need torch, before
    any work. Raises ValueError/RuntimeError naming what does not fit."""
    from fastformer import kernels, packing
    from fastformer.train import runtime

    options, modes = inputs.options, inputs.modes
    packing.check_environment()  # the ops' and the model's variables: a bad value is refused here, before any work
    launch = runtime.torchrun_launch()
    device = runtime.resolve_device(options.device, launch.local_rank)
    if options.device is None:  # a device given was checked before torch
        check_on_device(
            device, options.backend_name, kernels.INTERPRET, cuda_graphs=modes.cuda_graphs, compile=modes.compile
        )
    if inputs.previous is not None:
        check_world_size(options.resume, inputs.previous, launch)
    if inputs.config is not None:  # the default config is checked once its vocab is known (job._train)
        check_fits_device(inputs, inputs.config, device)
    checkpoint = load_checkpoint(inputs.checkpoint) if inputs.checkpoint is not None else None
    if options.resume is not None:
        check_resumable(options.resume, checkpoint, inputs.epochs, options.max_steps)
    run_options = inputs.run_options
    if run_options.batch_size is None:
        run_options = dataclasses.replace(run_options, batch_size=DEFAULT_BATCH_SIZE[device.type])
    amp = runtime.resolve_amp(options.amp, device)
    modes, eager = settle_steps(modes, device, amp, launch.distributed)
    _warn_without_kernels(options, device, amp)
    return Run(
        inputs,
        run_options,
        device,
        amp,
        launch,
        **modes._asdict(),
        eager_because=eager,
        log=log if launch.rank == 0 else runtime.quiet,
        checkpoint=checkpoint,
        epochs=inputs.epochs,
    )


def _warn_without_kernels(options, device, amp):
    """--autotune and --precompile act on the Triton kernels compiled for a GPU: a warning where they
    would do nothing, the model running the PyTorch reference, or the kernels in Triton's
    interpreter (which compiles nothing ahead and tries one config)."""
    from fastformer import kernels
    from fastformer.train.runtime import kernels_in_use

    given = [name for name, on in (("--autotune", options.autotune), ("--precompile", options.precompile)) if on]
    if not given:
        return
    if kernels_in_use(device, amp) != "triton":
        where = "the model runs the PyTorch reference"
    elif kernels.INTERPRET:
        where = "the kernels run in Triton's interpreter"
    else:
        return
    warnings.warn(
        f"{' and '.join(given)} {'do' if len(given) > 1 else 'does'} nothing here: on {device} with --backend "
        f"{options.backend_name} and amp {amp} {where}, with nothing to compile ahead or tune",
        stacklevel=3,
    )


def check_activations_fit(config, batch_size, longest, device, amp, names=None):
    """One step at `batch_size` reviews as long as the longest train review (`longest` pieces)
    must fit the device's memory beside the model's weights, gradients and AdamW state: its
    activations counted by activation_count (a lower bound), 2 bytes each under bf16 or fp16
    autocast, else 4. The message names --batch-size and the config size that, set back to the
    tutorial's value, saves the most (as names[key] where an option set it)."""
    from fastformer.train.runtime import device_memory

    memory = device_memory(device)
    element = 2 if amp in ("bf16", "fp16") else 4
    weights = parameter_count(config) * BYTES_TO_TRAIN
    kept = activation_count(config, batch_size, longest) * element
    if memory is None or weights + kept <= memory:
        return
    keys = [k for k in ("d_hidn", "d_ff", "n_head", "d_head", "n_layer") if config[k] > TUTORIAL[k]]
    # the size that, set back to the tutorial's value, leaves the fewest activations
    key = min(keys, default=None, key=lambda k: activation_count({**config, k: TUTORIAL[k]}, batch_size, longest))
    size = f" with {(names or {}).get(key, f'config.{key}')} {config[key]}" if key else ""
    where = f"the memory of {device}" if device.type == "cuda" else "this machine's memory"
    raise ValueError(
        f"--batch-size {batch_size}{size}: one train step would keep at least {size_text(kept)} of activations "
        f"for the backward at the longest train review ({longest} pieces), with the {size_text(weights)} of the "
        f"weights, their gradients and AdamW's state more than {where} ({size_text(memory)}); "
        "a smaller --batch-size or config fits"
    )


def check_fits_device(inputs, config, device):
    """The model of `config` (its weights, gradients and AdamW state) must fit the device's memory."""
    from fastformer.train.runtime import device_memory

    where = f"the memory of {device}" if device.type == "cuda" else "this machine's memory"
    check_fits(config, device_memory(device), where, BYTES_TO_TRAIN, size_names(inputs.options))
