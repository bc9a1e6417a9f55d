"""Test setup: the Triton interpreter where there is no GPU, corrected for bf16 and spared its
repeated patching, plans checked on every call, the `cuda` and `parity` markers, --parity-subset,
a clean backend."""

import importlib.util
import os
from pathlib import Path

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
from tests import compile_early, sm90_early

HAS_CUDA = torch.cuda.is_available()
HERE = Path(__file__).resolve().parent
# Parametrizations of each parity test function that --parity-subset quick keeps: the first, the
# last and one between, so that the ends of a list (odd lengths, bf16, masks) are among them.
PARITY_QUICK = 3
# The -k keyword of the parity tests --parity-subset quick keeps: tools/gpu_check/tests.py's rest
# selection, `-k "not parity_subset_quick"`, is everything quick leaves out, cuda tests included.
PARITY_QUICK_KEYWORD = "parity_subset_quick"


def pytest_addoption(parser):
    parser.addoption(
        "--parity-subset",
        choices=("quick", "rest"),
        help=f"keep (quick) or drop (rest) {PARITY_QUICK} parametrizations of each parity test, spread over "
        "its list; the two together run every parity test once. Tests not marked `parity` are left alone.",
    )


def uses_device_fixture(item):
    """Whether a test gets this file's `device` fixture, itself or through another fixture. A test
    that parametrizes an argument named `device` (test_cuda_graphs' option checks) gets the value
    it names instead; tests outside this folder see no such fixture."""
    params = getattr(item, "callspec", None)
    return (
        "device" in getattr(item, "fixturenames", ())
        and "device" not in (params.params if params else {})
        and HERE in item.path.parents
    )


def spread(n, k):
    """Indices of k of n items: the first, the last and evenly between (all n when n <= k)."""
    if n <= k:
        return set(range(n))
    return {(i * (n - 1) + (k - 1) // 2) // (k - 1) for i in range(k)}


@pytest.hookimpl(tryfirst=True)  # before -m and -k read the markers and keywords added here
def pytest_collection_modifyitems(config, items):
    """Mark the tests that take `device` `parity` (what a GPU run adds to the `cuda` tests), tag
    the ones --parity-subset quick keeps with PARITY_QUICK_KEYWORD, apply --parity-subset, run
    tests/test_compile.py last (tests/compile_early.py), and skip the `cuda` tests where there is
    no GPU."""
    functions = {}  # (parent, function name): its parity tests in collection order
    for item in items:
        if uses_device_fixture(item):
            item.add_marker(pytest.mark.parity)
            functions.setdefault((item.parent.nodeid, getattr(item, "originalname", item.name)), []).append(item)
    quick, rest = set(), set()
    for parametrizations in functions.values():
        kept = spread(len(parametrizations), PARITY_QUICK)
        for i, item in enumerate(parametrizations):
            (quick if i in kept else rest).add(item)
    for item in quick:
        item.extra_keyword_matches.add(PARITY_QUICK_KEYWORD)
    drop = {"quick": rest, "rest": quick, None: set()}[config.getoption("parity_subset")]
    if drop:
        config.hook.pytest_deselected(items=[item for item in items if item in drop])
        items[:] = [item for item in items if item not in drop]
    compile_early.last(items)  # the compile harness's module last: its harness is begun first
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; this machine has none (run `pytest -m cuda` on a GPU)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def pytest_collection_finish(session):
    sm90_early.start(session)  # the sm_90a compile check's workers, at nice 19, beside the tests before it
    compile_early.start(session)  # tests/test_compile.py's harness, at nice 19, beside the tests before it


def pytest_unconfigure(config):
    sm90_early.cancel(config)
    compile_early.cancel(config)


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
def tf32():
    """PyTorch's fp32 CUDA matmuls, and with them the kernels' fp32 products, in TF32 for the test,
    as torch.set_float32_matmul_precision("high") makes them; the precision before restored by the
    same API (restored by the newer fp32_precision one, the legacy flag's reads would raise).
    Without a GPU, TF32 is emulated on both sides (tests/tf32_emulation.py): the interpreter's TF32
    dots and torch's CPU matmuls round their fp32 operands to TF32, as a GPU's would."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        if HAS_CUDA or not interpreter_requested():
            yield
        else:
            from tests import tf32_emulation

            with tf32_emulation.emulated():
                yield
    finally:
        torch.set_float32_matmul_precision(before)


@pytest.fixture
def device():
    return torch.device("cuda" if HAS_CUDA else "cpu")
