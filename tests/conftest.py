"""Test setup: the Triton interpreter where there is no GPU, the `cuda` marker, a clean backend."""
import os

import pytest
import torch

# Triton reads this when a kernel is decorated, so it must be set before `fastformer.kernels` is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import fastformer.backend  # noqa: E402  (after TRITON_INTERPRET on purpose)

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
def device():
    return torch.device("cuda" if HAS_CUDA else "cpu")
