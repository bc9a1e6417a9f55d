"""The GPU check's tests stage: what tests/conftest.py marks `parity` (every test that takes the
`device` fixture) and how --parity-subset splits them, checked on a collection of tests/; and the
pytest command the stage builds per mode, on a GPU and on a CPU, with and without pytest-xdist."""

import ast
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.conftest import PARITY_QUICK, PARITY_QUICK_KEYWORD, spread, uses_device_fixture
from tools.gpu_check import tests as tests_stage
from tools.gpu_check.run import Skipped
from tools.gpu_check.tests import only_parity, pytest_args, selection, workers

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
GPU = "cuda or parity"
# The selections collected, each `pytest tests --collect-only -q ARGS`
COLLECTIONS = {
    "gpu": ["-m", GPU],
    "parity": ["-m", "parity"],
    "quick": ["-m", GPU, "--parity-subset", "quick"],
    "rest": ["-m", GPU, "--parity-subset", "rest"],
    "check_quick": selection("quick"),
    "check_rest": selection("rest"),
}
# pytest.main once per selection in one process: torch, Triton and the test modules imported once
COLLECT = """
import json, sys, pytest

class Collected:
    def __init__(self):
        self.ids, self.seen, self.deselected, self.errors = [], 0, 0, []
    def pytest_itemcollected(self, item):
        self.seen += 1
    def pytest_collectreport(self, report):
        if report.failed:
            self.errors.append(f"{report.nodeid}: {str(report.longrepr)[-1500:]}")
    def pytest_deselected(self, items):
        self.deselected += len(items)
    def pytest_collection_finish(self, session):
        self.ids = [item.nodeid for item in session.items]

found = {}
for name, args in json.loads(sys.argv[1]).items():
    collected = Collected()
    code = pytest.main(
        ["tests", "--collect-only", "-q", "-p", "no:cacheprovider", "--continue-on-collection-errors", *args],
        plugins=[collected],
    )
    found[name] = dict(
        code=int(code), ids=collected.ids, seen=collected.seen, deselected=collected.deselected, errors=collected.errors
    )
print(json.dumps(found))
"""


@pytest.fixture(scope="module")
def collected():
    """{selection: {code, ids, seen, deselected, errors}} of COLLECTIONS, from one subprocess (about 15 s)."""
    result = subprocess.run(
        [sys.executable, "-c", COLLECT, json.dumps(COLLECTIONS)], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    found = json.loads(result.stdout.strip().splitlines()[-1])
    for name, selected in found.items():
        assert selected["code"] == 0 or (selected["code"] == 1 and selected["errors"]), (name, selected["code"])
    return found


def ids(collected, name):
    return set(collected[name]["ids"])


def function_of(nodeid):
    """tests/test_x.py::[Class::]test_name of a test's node id."""
    return nodeid.split("[", 1)[0]


def functions_taking_device():
    """The test functions of tests/ with a `device` argument that no @pytest.mark.parametrize of
    theirs names: the ones the `device` fixture serves (read from the source, not pytest)."""
    found = set()
    for path in sorted(TESTS.glob("test_*.py")):
        tree = ast.parse(path.read_text())
        scopes = [(node, f"tests/{path.name}::") for node in tree.body]
        scopes += [
            (child, f"tests/{path.name}::{node.name}::")
            for node in tree.body
            if isinstance(node, ast.ClassDef)
            for child in node.body
        ]
        for node, prefix in scopes:
            if not (isinstance(node, ast.FunctionDef) and node.name.startswith("test")):
                continue
            if "device" in {arg.arg for arg in node.args.args} and "device" not in parametrized(node):
                found.add(prefix + node.name)
    return found


def parametrized(function):
    """The argument names a function's @pytest.mark.parametrize decorators give values."""
    names = set()
    for decorator in function.decorator_list:
        if isinstance(decorator, ast.Call) and ast.unparse(decorator.func).endswith("parametrize"):
            first = decorator.args[0] if decorator.args else None
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                names.update(name.strip() for name in first.value.split(","))
    return names


# ----------------------------------------------------------------------------------------------
# the selection: tests/conftest.py's `parity` marker and --parity-subset, on a collection
# ----------------------------------------------------------------------------------------------
def test_every_test_that_takes_device_is_a_selected_parity_test(collected):
    """A test module that does not import is left out of the collections (which go on past it, so
    that its error fails its own tests, not these): its device tests show up missing here."""
    expected = functions_taking_device()
    assert len(expected) > 50  # the source reading found the parity tests
    parity = {function_of(i) for i in ids(collected, "parity")}
    errors = "\n".join(collected["parity"]["errors"])
    assert expected - parity == set(), f"tests that take `device` but are not selected; collection errors:\n{errors}"
    assert expected - {function_of(i) for i in ids(collected, "gpu")} == set()
    # test_cuda_graphs' option checks name their own device (a parametrized argument): not parity
    assert not any(f.startswith("tests/test_cuda_graphs.py::test_step_options") for f in parity)
    assert ids(collected, "parity") <= ids(collected, "gpu")


def test_quick_and_rest_split_each_parity_test_and_leave_the_others_alone(collected):
    parity, everything = ids(collected, "parity"), ids(collected, "gpu")
    quick, rest = ids(collected, "quick"), ids(collected, "rest")
    assert quick & rest & parity == set()
    assert (quick | rest) & parity == parity
    assert quick - parity == rest - parity == everything - parity  # the cuda tests, in both
    functions = {}
    for nodeid in collected["parity"]["ids"]:  # collection order: each function's parametrizations in order
        functions.setdefault(function_of(nodeid), []).append(nodeid)
    for function, parametrizations in functions.items():
        kept = [i for i in parametrizations if i in quick]
        assert len(kept) == min(PARITY_QUICK, len(parametrizations)), function
        assert parametrizations[0] in quick and parametrizations[-1] in quick, function  # spread to both ends
    assert len(quick & parity) <= 300, "the quick subset should stay a few hundred tests"


def test_the_subsets_report_what_they_drop_as_deselected(collected):
    for name, selected in collected.items():
        assert len(selected["ids"]) + selected["deselected"] == selected["seen"], name
    assert collected["quick"]["deselected"] > collected["gpu"]["deselected"]


def test_the_checks_quick_then_rest_call_run_each_gpu_test_once(collected):
    """The stage's quick selection (the quick subset of the parity tests) and rest's partition the
    cuda and parity tests: rest holds every cuda test and the parity tests quick drops."""
    quick, rest, everything = ids(collected, "check_quick"), ids(collected, "check_rest"), ids(collected, "gpu")
    assert quick & rest == set()
    assert quick | rest == everything
    assert quick == ids(collected, "quick") & ids(collected, "parity")  # parity tests only
    assert everything - ids(collected, "parity") <= rest  # every cuda test that takes no `device`
    assert ids(collected, "rest") & ids(collected, "parity") <= rest  # the option's rest of the parity tests


# ----------------------------------------------------------------------------------------------
# tests/conftest.py's helpers
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "n, expected",
    [(0, set()), (1, {0}), (3, {0, 1, 2}), (4, {0, 2, 3}), (10, {0, 5, 9}), (65, {0, 32, 64})],
)
def test_spread_takes_the_ends_and_between(n, expected):
    assert spread(n, 3) == expected


def _item(fixturenames, params=None, path=TESTS / "test_x.py"):
    item = SimpleNamespace(fixturenames=fixturenames, path=path)
    if params is not None:
        item.callspec = SimpleNamespace(params=params)
    return item


def test_uses_device_fixture_directly_through_a_fixture_and_not_a_parameter_of_that_name():
    assert uses_device_fixture(_item(["device"]))
    # pytest's fixturenames is the closure: a fixture that takes `device` puts it there
    assert uses_device_fixture(_item(["inputs", "device"], params={"dtype": "fp16"}))
    assert not uses_device_fixture(_item(["device", "amp"], params={"device": "cpu", "amp": "off"}))
    assert not uses_device_fixture(_item(["benchmark"]))
    assert not uses_device_fixture(_item(["device"], path=ROOT / "bench" / "test_x.py"))  # not this fixture


# ----------------------------------------------------------------------------------------------
# the command per mode
# ----------------------------------------------------------------------------------------------
def _run(mode, cuda, out=None):
    """What the stage reads of a Run whose plan's tests selection is the mode's."""
    plan = SimpleNamespace(tests=mode, budget_seconds={"tests": 60})
    return SimpleNamespace(mode=mode, cuda=cuda, out=out, plan=plan, seconds_left=lambda stage: 60.0)


def test_the_stage_and_conftest_name_the_quick_keyword_alike():
    assert tests_stage.PARITY_QUICK_KEYWORD == PARITY_QUICK_KEYWORD


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("full", ["-m", GPU]),
        ("quick", ["-m", "parity", "--parity-subset", "quick"]),
        ("smoke", ["-m", "parity", "--parity-subset", "quick"]),
        ("rest", ["-m", GPU, "-k", f"not {PARITY_QUICK_KEYWORD}"]),
    ],
)
def test_selection_per_mode(mode, expected):
    assert selection(mode) == expected


def test_an_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="mode must be one of"):
        selection("fast")


def test_a_selection_narrowed_to_its_parity_tests():
    assert only_parity(["-m", GPU, "-k", "x"]) == ["-m", f"({GPU}) and parity", "-k", "x"]


@pytest.mark.parametrize("xdist", [True, False])
@pytest.mark.parametrize("cuda", [True, False])
def test_workers_only_on_a_gpu_with_xdist(monkeypatch, cuda, xdist):
    monkeypatch.setattr(tests_stage, "find_spec", lambda name: object() if xdist and name == "xdist" else None)
    assert workers(cuda) == (["-n", "4"] if cuda and xdist else [])


@pytest.mark.parametrize("xdist", [True, False])
@pytest.mark.parametrize("mode", ["full", "quick", "rest"])
def test_on_a_gpu_the_modes_selection_runs(monkeypatch, mode, xdist):
    monkeypatch.setattr(tests_stage, "find_spec", lambda name: object() if xdist else None)
    expected = selection(mode) + (["-n", "4"] if xdist else [])
    assert pytest_args(_run(mode, True)) == expected


@pytest.mark.parametrize("xdist", [True, False])
@pytest.mark.parametrize("mode", ["smoke", "full", "rest"])
def test_on_a_cpu_only_the_cuda_tests_run_and_never_in_workers(monkeypatch, mode, xdist):
    monkeypatch.setattr(tests_stage, "find_spec", lambda name: object() if xdist else None)
    assert pytest_args(_run(mode, False)) == ["-m", "cuda"]


JUNIT = (
    '<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite tests="2" failures="0" errors="0" '
    'skipped="{skipped}" time="1.5"><testcase classname="tests.test_a" name="test_gpu" time="1">{skip}</testcase>'
    '<testcase classname="tests.test_a" name="test_parity[fp32]" time="0.5">{skip}</testcase></testsuite></testsuites>'
)
DETAILS = {"command", "returncode", "timed_out", "tests", "passed", "failed", "errors", "skipped", "seconds"}
DETAILS |= {"failures", "skip_reasons", "summary", "selection", "gpu_command", "selected_on_gpu", "parity_on_gpu"}


def _fake_pytest(monkeypatch, out, skipped):
    """The stage's subprocesses replaced: pytest's run writes a JUnit report of two tests, the
    collections count 170 (120 with -m parity)."""
    ran = []

    def stream(command, timeout):
        ran.append(command)
        skip = '<skipped message="needs a CUDA GPU"/>' if skipped else ""
        (out / "junit.xml").write_text(JUNIT.format(skipped=2 if skipped else 0, skip=skip))
        return 0, False

    monkeypatch.setattr(tests_stage, "stream", stream)
    monkeypatch.setattr(tests_stage, "collected", lambda args, timeout: 120 if args[1].endswith(" and parity") else 170)
    return ran


def test_on_a_cpu_the_stage_counts_the_gpus_selection_and_skips(monkeypatch, tmp_path):
    ran = _fake_pytest(monkeypatch, tmp_path, skipped=True)
    with pytest.raises(Skipped, match=r"^needs CUDA: the 2 cuda tests selected all skip") as skip:
        tests_stage.stage(_run("smoke", False, tmp_path))
    details = skip.value.details
    assert set(details) == DETAILS
    assert details["selected_on_gpu"] == 170 and details["parity_on_gpu"] == 120
    assert details["command"].startswith("python -m pytest tests -m cuda -v ")
    assert details["gpu_command"] == "python -m pytest tests -m parity --parity-subset quick"
    assert details["summary"].startswith("the cuda tests of the smoke selection, on a CPU: 0 passed")
    assert "a GPU would run 170 tests, 120 of them parity" in details["summary"]
    assert len(ran) == 1 and "-n" not in ran[0]


def test_on_a_gpu_the_stage_runs_the_selection_and_says_which(monkeypatch, tmp_path):
    ran = _fake_pytest(monkeypatch, tmp_path, skipped=False)
    monkeypatch.setattr(tests_stage, "find_spec", lambda name: object())
    details = tests_stage.stage(_run("rest", True, tmp_path))
    assert set(details) == DETAILS and details["passed"] == 2
    assert details["selected_on_gpu"] is None and details["parity_on_gpu"] is None
    assert details["summary"].startswith("the rest selection (what quick leaves out")
    assert "2 passed" in details["summary"]
    assert ran[0][ran[0].index("tests") + 1 : ran[0].index("-v")] == [*selection("rest"), "-n", "4"]
