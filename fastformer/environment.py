"""What fastformer reads of its environment before torch or Triton is imported: the variables it
takes, and whether Triton is installed."""

import importlib.util
import os
import sys

BACKENDS = ("auto", "triton", "reference")  # fastformer.backend's choices
BACKEND_ENV = "FASTFORMER_BACKEND"  # the backend when none is chosen in Python or on the command line
TORCHRUN_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE")  # what torchrun sets in each process it starts

# How Triton reads a boolean variable (its getenv_bool, Triton 3.6 to 3.9): these values, in any
# case, are true, and every other value (unset, empty, " 1", "2") false
TRUE_VALUES = ("1", "true", "on", "yes", "y")


def interpreter_requested(environ=os.environ):
    """Whether TRITON_INTERPRET turns Triton's interpreter on, read as Triton reads it."""
    return environ.get("TRITON_INTERPRET", "").lower() in TRUE_VALUES


def under_torchrun(environ=os.environ):
    """Whether torchrun started this process (fastformer.train.runtime.torchrun_launch reads its values)."""
    return all(name in environ for name in TORCHRUN_ENV)


def triton_available():
    """(whether Triton is installed, whether its interpreter is on), as fastformer.kernels sees them
    or, before it is imported, will."""
    kernels = sys.modules.get("fastformer.kernels")
    if kernels is not None:
        return kernels.HAS_TRITON, kernels.INTERPRET
    return importlib.util.find_spec("triton") is not None, interpreter_requested()
