"""Test setup: the Triton interpreter where there is no GPU, corrected for bf16 and spared its
repeated patching, plans checked on every call, the `cuda` marker, a clean backend."""

import importlib.util
import os

import pytest
import torch

from fastformer.environment import interpreter_requested

# Triton reads this when a kernel is decorated, so it must be set before `fastformer.kernels` is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Every eager op call of a signature already seen makes its plan again and compares (kernels._runtime,
# Plans): a plan keyed on less than what it depends on fails a test instead of reusing a stale launch.
os.environ.setdefault("FASTFORMER_CHECK_PLANS", "1")
if interpreter_requested() and importlib.util.find_spec("triton"):
    from tests import interpreter_bf16, interpreter_speed

    interpreter_bf16.install()  # bf16 dots and casts as a GPU computes them (see its docstring)
    interpreter_speed.install()  # triton.language patched once per module and launch, not per helper call

import fastformer.backend  # after TRITON_INTERPRET, on purpose

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; this machine has none (run `pytest -m cuda` on a GPU)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _restore_backend(monkeypatch):
    """Each test starts on the default backend with no FASTFORMER_BACKEND in the environment."""
    monkeypatch.delenv(fastformer.backend.ENV_VAR, raising=False)
    saved = fastformer.backend._backend
    fastformer.backend._backend = None
    yield
    fastformer.backend._backend = saved


@pytest.fixture
def uncorrected_interpreter(monkeypatch):
    """Under the interpreter: Triton's interpreter as it ships, wrong in bf16, and the kernels'
    cached answer to their bf16 probe forgotten, so they ask again and refuse bf16. Elsewhere
    nothing changes."""
    from fastformer.kernels import _runtime

    if not (_runtime.INTERPRET and _runtime.HAS_TRITON):
        yield
        return
    monkeypatch.setattr(_runtime, "_interpreter_bf16_ok", None)
    with interpreter_bf16.uncorrected():
        yield


@pytest.fixture
def device():
    return torch.device("cuda" if HAS_CUDA else "cpu")
