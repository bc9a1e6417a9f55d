"""The inputs of `fastformer train`, checked before torch is imported (check_inputs): the options,
the config and vocab given, the data and its classes, and the run directory a new run will make or
the run --resume continues, with the data it started on. A bad input is one line (ValueError or
OSError) before the vocab is trained and before anything is written; what only torch can tell (the
device, the GPU's memory, the checkpoint's tensors) fastformer.train.job checks right after, before any
work.
"""

import contextlib
import dataclasses
import importlib.util
import os
import random
import sys
from typing import NamedTuple

from fastformer.config import BYTES_TO_BUILD, TUTORIAL, Config, check_fits, host_memory
from fastformer.data import rotten_tomatoes
from fastformer.data.files import check_labels, infer_classes, read_reviews
from fastformer.data.vocab import BOS, N_SPECIAL, PAD, check_vocab_matches, load_vocab
from fastformer.environment import interpreter_requested, under_torchrun
from fastformer.train.options import (
    DEFAULTS,
    RUN_OPTIONS,
    RunOptions,
    StepModes,
    TrainOptions,
    check_backend,
    check_on_device,
    default_out,
    new_run_options,
    resumed_options,
    step_modes,
)
from fastformer.train.rundir import (
    check_not_written,
    check_out,
    check_pinned,
    check_resumable_dir,
    load_config,
    load_run_files,
    load_run_json,
    writing,
)

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
    config: Config | None  # None: the default config, built once the device and vocab are known
    vocab: object  # the SentencePiece vocab, or None: trained on the data
    checkpoint: str | None  # the checkpoint --resume continues from; None: from the start
    previous: dict | None  # the run.json of the run resumed; None for a new run
    using_demo: bool
    data: Data | None = None  # None until read (check_inputs reads it)
    digests: dict | None = None  # the sha256 of each data file: {"train": ..., "test": ... or None}
    modes: StepModes | None = None  # how the steps run (check_inputs settles them)


def check_inputs(options):
    """Check `options` (a TrainOptions) and every file they name, read the data and settle its
    classes, without torch; returns the TrainInputs, or raises ValueError or OSError in one line."""
    options.check()
    options = options.plain()
    if options.dataset is not None:
        options = dataclasses.replace(
            options, **dict(zip(DATA_FILES, dataset_files(options.dataset, options.train, options.test)))
        )
    has_triton, interpret = triton_available()
    check_backend(options.backend_name, has_triton)
    if options.device is not None:  # else fastformer.train.run.settle checks the device it resolves
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
    inputs = _resumed_run(options) if resuming else _new_run(options)
    data, digests = read_data(inputs.run_options, inputs.config, resuming)
    if resuming:
        _check_same_data(options.resume, inputs.previous, inputs.run_options, digests)
    if inputs.vocab is None:
        _check_vocab_to_train(inputs.run_options, inputs.config, data.train)
    _check_fits_host(options, inputs.config, inputs.vocab, data.n_classes)
    # the classes the data settled are the run's n_output
    run_options = dataclasses.replace(inputs.run_options, n_output=data.n_classes)
    return inputs._replace(run_options=run_options, data=data, digests=digests, modes=modes)


def writes_run_dir():
    """Whether this process writes the run directory: under torchrun rank 0 alone, else always."""
    return int(os.environ.get("RANK", "0")) == 0


@contextlib.contextmanager
def run_dir_held(inputs):
    """Inside the block this process is the one writer of the run directory (run_dir.writing), from
    before the vocab is trained to the end of the job; under torchrun rank 0 holds it (the other
    ranks write nothing there)."""
    if not writes_run_dir():
        yield
        return
    with writing(inputs.run_dir, "--out" if inputs.options.resume is None else "--resume"):
        yield


def triton_available():
    """(whether Triton is installed, whether its interpreter is on), as fastformer.kernels sees them
    or, before it is imported, will."""
    kernels = sys.modules.get("fastformer.kernels")
    if kernels is not None:
        return kernels.HAS_TRITON, kernels.INTERPRET
    return importlib.util.find_spec("triton") is not None, interpreter_requested()


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


def _new_run(options):
    """The TrainInputs of a new run but its data: its options, the config and vocab given (checked
    together), and its directory, checked to be one it can create."""
    run_options, using_demo = new_run_options(options.given())
    config = load_config(options.config, f"--config {options.config}") if options.config is not None else None
    if config is not None:
        check_decoder_vocab(config, f"--config {options.config}")
    vocab = load_vocab(options.vocab) if options.vocab is not None else None
    if vocab is not None and config is not None:
        check_vocab_matches(vocab, config, "--vocab")
    run_dir = options.out or default_out()
    if writes_run_dir():  # the other ranks of a torchrun job would see rank 0's lock
        check_not_written(run_dir, "--out")
    check_out(run_dir)
    return TrainInputs(
        options,
        run_options,
        epochs=options.epochs or DEFAULTS["epochs"],
        run_dir=run_dir,
        config=config,
        vocab=vocab,
        checkpoint=None,
        previous=None,
        using_demo=using_demo,
    )


def check_decoder_vocab(config, what):
    """The classifier's decoder reads one token, [BOS]: its id must be in the decoder's vocab."""
    if config.n_dec_vocab <= BOS[0]:
        raise ValueError(
            f"{what}: config.n_dec_vocab is {config.n_dec_vocab}, but the classifier's decoder reads {BOS[1]}, "
            f"id {BOS[0]}: n_dec_vocab must be at least {BOS[0] + 1}"
        )


def _resumed_run(options):
    """The TrainInputs of the run `options.resume` continues but its data: its options (any given
    must be the run's), config, vocab and the checkpoint to continue from."""
    resume = options.resume
    previous = load_run_json(resume, required=("epochs", "demo_data", *RUN_OPTIONS))
    if writes_run_dir():
        check_not_written(resume, "--resume")
    _check_resume_only_options(options, previous)
    run_options = resumed_options(resume, previous, options.given())
    config, vocab = load_run_files(resume)
    check_pinned(resume, previous)
    checkpoint = check_resumable_dir(resume)
    return TrainInputs(
        options,
        run_options,
        epochs=options.epochs or previous["epochs"],
        run_dir=resume,
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
    tutorial's 2. Without a test file, 10% of the train reviews are held out. Sets n_output in
    `config` (None: the default config, built later). Returns the Data and the sha256 of each data
    file ({"train": ..., "test": ... or None}), from the pass that read it."""
    train, test = options.train, options.test
    if test is not None and not resuming and test == train:
        raise ValueError("--test is the same file as --train")
    train_reviews = read_reviews(train, "train", progress=True)
    test_reviews = read_reviews(test, "test", progress=True) if test is not None else None
    # the files' sha256, from the same pass as their reviews
    digests = {"train": train_reviews.sha256, "test": test_reviews and test_reviews.sha256}
    if config is not None and (resuming or options.n_output is None):
        n_classes = config.n_output
    elif options.n_output == "auto":
        n_classes = infer_classes(train_reviews, f"train file {train}")
    else:
        n_classes = options.n_output or TUTORIAL["n_output"]
    hint = "" if resuming else "; pass --n-output with the number of classes, or --n-output auto"
    _check_labels(train_reviews, n_classes, f"train file {train}", hint)
    if test_reviews is not None:
        _check_labels(test_reviews, n_classes, f"test file {test}", hint)
    else:
        train_reviews, test_reviews = _split(train_reviews, 0.1, options.seed)
    if config is not None:
        config.n_output = n_classes
    return Data(train_reviews, test_reviews, n_classes), digests


def _check_labels(reviews, n_classes, source, hint):
    try:
        check_labels(reviews, n_classes, source)
    except ValueError as error:
        raise ValueError(f"{error}{hint}") from None


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
