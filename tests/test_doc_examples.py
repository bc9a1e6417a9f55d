"""The examples of README.md and docs/ run as written, on what a new user has: a CPU, the checkout,
the package installed, no GPU and no network.

- Every fenced block names its language: ```python and ```bash blocks are examples and run,
  ```text blocks (a command's output, a listing) do not.
- Each example is a test of its own, named by its page and line. The examples of a page run in
  order in one working folder of the page's own, a copy of the folder where the Quick start's
  `fastformer train` ran (`runs/`, `runs/latest` linking to the run): a block may read what an
  earlier block of its page wrote there. Each python block runs in a fresh `python`, so it imports
  what it uses; each bash block runs in `bash -e -o pipefail`. The environment is a user's shell:
  this interpreter's scripts (`python`, `fastformer`) first on PATH, and none of what
  tests/conftest.py sets for the tests (Triton's interpreter, the plan checks).
- A block that cannot run here has `<!-- docs-test: skip REASON -->` on the last non-blank line
  above its fence, and is reported as skipped with that reason; every other example must pass.
"""

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_docs import PAGES, ROOT, page_id, read_blocks

RUN = ("python", "bash")
LANGUAGES = (*RUN, "text")

# Runs one python block with its code compiled at its line in the page, so that a traceback names
# the page and the line of the example that failed.
RUNNER = """
import sys
page, line, code = sys.argv[1], int(sys.argv[2]), sys.argv[3]
exec(compile("\\n" * (line - 1) + code, page, "exec"), {"__name__": "__main__"})
"""

BLOCKS = [block for page in PAGES for block in read_blocks(page)]
EXAMPLES = [block for block in BLOCKS if block.lang in RUN]


def where(block):
    return f"{page_id(block.page)}:{block.line}"


def _user_environment():
    """This process's environment as a new user's shell has it: without the variables the tests set
    or a backend chosen by the environment, with this interpreter's scripts first on PATH."""
    dropped = ("FASTFORMER_BACKEND", "FASTFORMER_CHECK_PLANS", "TRITON_INTERPRET", "PYTHONPATH")
    env = {key: value for key, value in os.environ.items() if key not in dropped}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


def _run(command, cwd):
    return subprocess.run(
        command, cwd=cwd, env=_user_environment(), capture_output=True, text=True, timeout=600, check=False
    )


def _run_block(block, cwd):
    if block.lang == "python":
        return _run([sys.executable, "-c", RUNNER, str(block.page), str(block.line), block.code], cwd)
    return _run(["bash", "-e", "-o", "pipefail", "-c", block.code], cwd)


def _failure(block, result):
    return (
        f"the example at {where(block)} failed (exit status {result.returncode}):\n{block.code}\n"
        f"--- stdout\n{result.stdout[-3000:]}\n--- stderr\n{result.stderr[-5000:]}"
    )


def _quick_start_train():
    """The `fastformer train` that ends the first line of the README's Quick start."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Quick start", 1)[1]
    block = next(b for b in read_blocks(ROOT / "README.md") if b.lang == "bash" and b.code in section)
    command = shlex.split(block.code.splitlines()[0].split("&&")[-1])
    assert command[:2] == ["fastformer", "train"], command
    return command


@pytest.fixture(scope="session")
def quick_start_run(tmp_path_factory):
    """(the folder where a new user ran the Quick start's `fastformer train`: runs/, with the run
    and runs/latest linking to it; what the command printed on stdout)."""
    if shutil.which("fastformer", path=str(Path(sys.executable).parent)) is None:
        pytest.fail(f"no `fastformer` script beside {sys.executable}: install the package, pip install -e .")
    folder = tmp_path_factory.mktemp("quick_start")
    result = _run(_quick_start_train(), folder)
    assert result.returncode == 0, f"the Quick start's fastformer train failed:\n{result.stderr[-5000:]}"
    assert (folder / "runs" / "latest" / "model.pt").is_file()
    return folder, result.stdout


@pytest.fixture(scope="session")
def quick_start(quick_start_run):
    return quick_start_run[0]


def _as_pattern(line):
    """A regex of a listed line of output: its numbers (with their commas and points) and its run
    directory stand for any."""
    pattern = re.escape(line)
    pattern = re.sub(r"\d+(?:,\d{3})*(?:\\\.\d+)?", r"[\\d,.]+", pattern)
    return re.sub(r"/tmp/qs/sentiment|runs/sentiment\\-<date>\\-<time>", r"\\S+", pattern)


def test_the_default_runs_listing_is_what_it_prints(quick_start_run):
    """docs/training.md lists what the default run printed: the Quick start's run prints those
    lines, numbers and the run directory aside (issue 69, item 4)."""
    page = ROOT / "docs" / "training.md"
    section = page.read_text(encoding="utf-8").split("## The default run", 1)[1]
    listing = next(b for b in read_blocks(page) if b.lang == "text" and b.code in section)
    printed = quick_start_run[1].splitlines()
    assert len(printed) == len(listing.code.splitlines()), quick_start_run[1]
    for listed, line in zip(listing.code.splitlines(), printed):
        assert re.fullmatch(_as_pattern(listed), line), f"{where(listing)} lists\n  {listed}\nthe run printed\n  {line}"


@pytest.fixture(scope="session")
def page_folder(quick_start, tmp_path_factory):
    """page -> (its working folder, the lines of the examples run in it so far)."""
    folders = {}

    def folder_of(page):
        if page not in folders:
            folder = tmp_path_factory.mktemp(page_id(page).replace("/", "-"))
            shutil.copytree(quick_start, folder, symlinks=True, dirs_exist_ok=True)
            folders[page] = (folder, set())
        return folders[page]

    return folder_of


def _param(block):
    marks = [pytest.mark.skip(reason=f"{where(block)}: {block.skip}")] if block.skip else []
    return pytest.param(block, id=where(block), marks=marks)


@pytest.mark.parametrize("block", [_param(block) for block in EXAMPLES])
def test_example_runs_as_written(block, page_folder):
    folder, ran = page_folder(block.page)
    # The earlier examples of the page first, where this one runs alone (pytest -k): it may read
    # their files. In a whole run they have run already, as tests of their own.
    for earlier in EXAMPLES:
        if earlier.page == block.page and earlier.line < block.line and not earlier.skip and earlier.line not in ran:
            ran.add(earlier.line)
            result = _run_block(earlier, folder)
            assert result.returncode == 0, "an earlier example of the page: " + _failure(earlier, result)
    ran.add(block.line)
    result = _run_block(block, folder)
    assert result.returncode == 0, _failure(block, result)


def test_every_block_names_its_language():
    """A block with no language, or another one, would be neither run nor known to be output."""
    unnamed = [f"{where(b)}: ```{b.lang}" for b in BLOCKS if b.lang not in LANGUAGES]
    assert not unnamed, f"fence each block as one of {LANGUAGES} (```text for output and listings): {unnamed}"


def test_every_skip_mark_gives_its_reason_and_marks_an_example():
    for block in BLOCKS:
        assert block.skip != "", f"{where(block)}: a docs-test skip mark needs a reason"
        assert block.skip is None or block.lang in RUN, f"{where(block)}: a skip mark above a ```{block.lang} block"


def test_the_front_page_examples_run():
    """README's drop-in example and the manual's commands are among the examples that run."""
    running = [b for b in EXAMPLES if not b.skip]
    assert any(b.page == ROOT / "README.md" and "MovieClassification(config)" in b.code for b in running)
    assert any(b.lang == "bash" and "fastformer predict --run last" in b.code for b in running)
