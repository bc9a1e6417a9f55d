"""The options of `fastformer train`: TrainOptions (the keyword arguments of fastformer.job.train,
which the command builds from its arguments in one place), their checks, and the options a run
takes from them: DEFAULTS for a new run, the run's own under --resume.

    train(epochs=3, lr=1e-3)                          # the Python API
    train(TrainOptions(epochs=3, lr=1e-3))            # the same
    train(TrainOptions.from_args(args))               # what `fastformer train` does
"""
import dataclasses
import math
import os
import time
from typing import Optional, Union

from fastformer.data import demo

DEFAULTS = {"epochs": 5, "lr": 5e-4, "warmup": 0.1, "weight_decay": 0.01, "seed": 0, "vocab_size": 8000, "bucket": True}
# The options that make a run what it is: --resume refuses a value other than the run's for any.
RUN_OPTIONS = ("train", "test", "vocab", "vocab_size", "config", "n_output", "batch_size", "lr", "warmup",
               "weight_decay", "seed", "bucket")
PATH_OPTIONS = ("train", "test", "vocab", "config")


def check_positive(**values):
    """Raise ValueError naming the first option given (not None) that is not a positive number."""
    for name, value in values.items():
        if value is not None and not value > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {value}")


@dataclasses.dataclass
class TrainOptions:
    """What `fastformer train` and fastformer.job.train take, field for option (--backend is
    backend_name). None means not given: a new run takes DEFAULTS (or a default that depends on
    the device), a resumed one the run's value."""

    train: Optional[str] = None  # training reviews; None: the embedded demo set
    test: Optional[str] = None  # test reviews; None: the demo test set, or 10% of `train` held out
    dataset: Optional[str] = None  # instead of train/test: "demo" or "rotten-tomatoes"
    vocab: Optional[str] = None  # an existing SentencePiece model; None: train one
    config: Optional[str] = None  # a Config JSON; None: the tutorial's on CUDA, a smaller one on CPU
    n_output: Union[int, str, None] = None  # classes; None: the config's; "auto": from the train labels
    epochs: Optional[int] = None
    batch_size: Optional[int] = None  # per process; None: 128 on CUDA, 64 on CPU
    lr: Optional[float] = None
    device: Optional[str] = None
    backend_name: str = "auto"
    amp: str = "auto"
    out: Optional[str] = None  # None: runs/sentiment-<date>-<time>
    seed: Optional[int] = None
    max_steps: Optional[int] = None
    resume: Optional[str] = None  # a run directory to continue up to `epochs`
    vocab_size: Optional[int] = None
    warmup: Optional[float] = None
    weight_decay: Optional[float] = None
    bucket: Optional[bool] = None
    cuda_graphs: bool = False
    compile: bool = False
    pad_to_buckets: Optional[bool] = None  # None: on with cuda_graphs, which needs it

    @classmethod
    def from_args(cls, args):
        """The options of an argparse namespace that has an attribute per field (and maybe more)."""
        return cls(**{field.name: getattr(args, field.name) for field in dataclasses.fields(cls)})

    def check(self):
        """Raise ValueError naming the first option whose value cannot be right."""
        check_positive(epochs=self.epochs, batch_size=self.batch_size, lr=self.lr, max_steps=self.max_steps,
                       vocab_size=self.vocab_size)
        if self.lr is not None and not math.isfinite(self.lr):
            raise ValueError(f"--lr must be a finite number, got {self.lr}")
        if self.weight_decay is not None and not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise ValueError(f"--weight-decay must be a finite number >= 0, got {self.weight_decay}")
        if self.warmup is not None and not 0 <= self.warmup < 1:
            raise ValueError(f"--warmup is a fraction of the steps in [0, 1), got {self.warmup}")
        n_output = self.n_output
        if n_output is not None and n_output != "auto" and not (isinstance(n_output, int) and n_output > 0):
            raise ValueError(f"--n-output must be a positive integer or auto, got {n_output!r}")

    def given(self):
        """The RUN_OPTIONS, None where not given."""
        return {name: getattr(self, name) for name in RUN_OPTIONS}


def new_run_options(given, device):
    """The RUN_OPTIONS of a new run on `device` from those `given`: paths made absolute, the
    embedded demo set without --train, DEFAULTS for the rest. Returns (options, whether the data is
    the demo set)."""
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
    return options, using_demo


def default_out():
    return os.path.join("runs", time.strftime("sentiment-%Y%m%d-%H%M%S"))


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
    return {name: previous[name] for name in RUN_OPTIONS}


def check_world_size(resume, previous, launch):
    """--resume needs the number of processes the run trained on: it fixes the batches and steps."""
    trained_on = previous.get("world_size", 1)
    if trained_on != launch.world_size:
        how = f"torchrun --nproc_per_node {trained_on} -m fastformer train" if trained_on > 1 else "fastformer train"
        raise ValueError(
            f"--resume {resume}: the run trained on {trained_on} process(es), this job has {launch.world_size}; "
            f"continue it with `{how} --resume {resume}`"
        )


def check_resumable(resume, checkpoint, epochs, max_steps):
    """Raise ValueError when the run's checkpoint (load_checkpoint's, or None) already has `epochs`
    epochs or `max_steps` steps: there would be nothing left to train."""
    done_epochs, done_steps = (checkpoint[2]["epoch"], checkpoint[2]["step"]) if checkpoint else (0, 0)
    if done_epochs >= epochs:
        raise ValueError(f"--resume {resume}: the run already has {done_epochs} epochs; pass --epochs > {done_epochs}")
    if max_steps is not None and done_steps >= max_steps:
        raise ValueError(f"--resume {resume}: the run already has {done_steps} steps; pass --max-steps > {done_steps}")
