"""What an option's value must be (Check), the checks the options share, and check_values, which
names the first option given a value it cannot take. fastformer.train.run declares each option of
`fastformer train` with its Check; fastformer.train.rundir checks the device a run is loaded onto.
No torch: the command checks its inputs before it imports it."""

import math
import numbers
import os
import re

from fastformer.data.vocab import N_SPECIAL

DEVICE = re.compile(r"(cpu|cuda)(?::(\d+))?")  # the devices the job runs on
MAX_VOCAB_PIECES = 2**31 - 1 - N_SPECIAL  # SentencePiece counts the pieces in a 32-bit int
MAX_SEED = 2**32 - 1  # any 32-bit seed; with an epoch or a rank added it stays a valid 64-bit torch seed


class Check:
    """Check(kind, *rules): what an option's value must be, declared with its flag (flag's `check`)
    and read by check_values. `kind`: int or float, which the value must be (a bool is neither; a
    float option takes any real number, as json and torch take them), or None; each rule, tried in
    order, a pair (valid(value), what the option must be: "must be positive, got {}", formatted
    with the value)."""

    __slots__ = ("kind", "rules")

    def __init__(self, kind, *rules):
        self.kind, self.rules = kind, rules


POSITIVE = (lambda value: value > 0, "must be positive, got {}")
COUNT = Check(int, POSITIVE)
PATH = Check(
    None, (lambda value: isinstance(value, (str, os.PathLike)) and bool(str(value)), "must be a path, got {!r}")
)
SWITCH = Check(None, (lambda value: isinstance(value, bool), "must be True or False, got {!r}"))
VOCAB_SIZE = Check(
    int,
    POSITIVE,
    (
        lambda value: value <= MAX_VOCAB_PIECES,
        f"must be at most {MAX_VOCAB_PIECES:,} (SentencePiece counts pieces in 32 bits), got {{:,}}",
    ),
)
N_OUTPUT = Check(
    None,
    (
        lambda value: (
            value == "auto" or (isinstance(value, numbers.Integral) and not isinstance(value, bool) and value > 0)
        ),
        "must be a positive integer or auto, got {!r}",
    ),
)
LR = Check(float, (math.isfinite, "must be a finite number, got {}"), POSITIVE)
WARMUP = Check(float, (lambda value: 0 <= value < 1, "is a fraction of the steps in [0, 1), got {}"))
WEIGHT_DECAY = Check(float, (lambda value: math.isfinite(value) and value >= 0, "must be a finite number >= 0, got {}"))
SEED = Check(int, (lambda value: 0 <= value <= MAX_SEED, f"must be an integer from 0 to {MAX_SEED:,}, got {{}}"))
# whether the machine has the device is fastformer.train.runtime.resolve_device's to say
DEVICE_NAME = Check(None, (lambda value: DEVICE.fullmatch(str(value)), "{}: fastformer runs on cpu, cuda or cuda:N"))


def one_of(choices):
    """The Check of an option that takes one of `choices`."""
    return Check(None, (lambda value: value in choices, f"must be one of {', '.join(choices)}, got {{!r}}"))


def check_values(values, checks):
    """Raise ValueError naming the first option of `values` ({name: value}) that is given (not
    None) and is not what its Check says: checks is {name: (option, Check)} (fastformer.train.run's
    CHECKS: every option of `fastformer train`)."""
    for name, value in values.items():
        if value is None:
            continue
        option, check = checks[name]
        if check.kind is int and (isinstance(value, bool) or not isinstance(value, numbers.Integral)):
            raise ValueError(f"{option} must be an integer, got {value!r}")
        if check.kind is float and (isinstance(value, bool) or not isinstance(value, numbers.Real)):
            raise ValueError(f"{option} must be a float, got {value!r} (a {type(value).__name__})")
        for valid, must in check.rules:
            if not valid(value):
                raise ValueError(f"{option} {must.format(value)}")
