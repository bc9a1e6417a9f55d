"""The manual cannot rot: docs/ builds as a site with no broken link, and the examples of README.md
and docs/ run.

- `mkdocs build --strict` builds docs/ into a temporary folder (skipped, with the reason, where
  mkdocs is not installed: `pip install -e '.[docs]'`).
- The ```python blocks of each page run in order in one fresh Python process per page, so a block
  may use what an earlier block of its page defined. They run in a temporary folder holding the
  files the examples read (`example_dir` below): what a new user has after the Quick start. A
  block with `<!-- docs-test: skip REASON -->` on the last non-blank line above its fence is not
  run (one that needs a GPU, say); the reason is required.
- In ```bash blocks, every `fastformer ...` command (also after `torchrun ... -m`) is parsed by the
  command's own parser, and the `--help` ones run, so an option that no longer exists fails here;
  `evaluate` and `predict` on `--run last` run on the Quick start's run. Other shell lines are not
  run.
- The README's relative links point at files that exist (the site build checks docs/'s own).
"""

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from fastformer.cli import build_parser, main
from tests import aladdinpersson

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
SKIP_MARK = re.compile(r"<!--\s*docs-test:\s*skip\b(.*?)-->")
FENCE = re.compile(r"^(`{3,})\s*([\w-]*)\s*$")

# Runs one page's blocks in order in one namespace; the code is compiled at its line in the page,
# so a traceback names the page and the line of the example that failed.
RUNNER = """
import json, sys
namespace = {"__name__": "__main__"}
for block in json.load(open(sys.argv[1], encoding="utf-8")):
    exec(compile("\\n" * (block["line"] - 1) + block["code"], block["page"], "exec"), namespace)
"""


class Block(NamedTuple):
    page: Path
    line: int  # of the block's first line of code, counted from 1
    lang: str
    code: str
    skip: str | None  # the reason of a docs-test skip mark, or None


def read_blocks(page):
    """The fenced code blocks of a markdown page, with the skip mark above each, if any."""
    lines = page.read_text(encoding="utf-8").splitlines()
    found, above, i = [], "", 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            above = lines[i] if lines[i].strip() else above
            i += 1
            continue
        end = i + 1
        while end < len(lines) and lines[end].strip() != fence.group(1):
            end += 1
        mark = SKIP_MARK.search(above)
        found.append(Block(page, i + 2, fence.group(2), "\n".join(lines[i + 1 : end]), mark and mark.group(1).strip()))
        above, i = "", end + 1
    return found


def page_id(page):
    return str(page.relative_to(ROOT))


PYTHON_PAGES = [page for page in PAGES if any(b.lang == "python" for b in read_blocks(page))]


@pytest.fixture(scope="module")
def example_dir(tmp_path_factory):
    """What the examples read, as a new user has it after the Quick start: runs/, made by the Quick
    start's `fastformer train` (stopped after its first step: the files are those of a whole run,
    runs/latest linking to it); and seq2seq_checkpoint.pt, saved by the transcription of Aladdin
    Persson's Transformer with the sizes of docs/seq2seq.md's example."""
    folder = tmp_path_factory.mktemp("examples")
    result = _python(["-m", "fastformer", "train", "--max-steps", "1"], folder)
    assert result.returncode == 0, f"the Quick start's train failed:\n{result.stderr[-4000:]}"
    assert (folder / "runs" / "latest" / "model.pt").is_file()
    torch.manual_seed(0)
    seq2seq = aladdinpersson.Transformer(1000, 1000, 0, 0, embed_size=64, num_layers=2, heads=4)
    torch.save(seq2seq.state_dict(), folder / "seq2seq_checkpoint.pt")
    return folder


def test_every_page_has_its_python_examples_tested():
    """README.md has a Python example, and every skip mark gives its reason."""
    assert ROOT / "README.md" in PYTHON_PAGES
    for page in PAGES:
        for block in read_blocks(page):
            assert block.skip != "", f"{page_id(page)}:{block.line}: a docs-test skip mark needs a reason"


def _environment():
    return {key: value for key, value in os.environ.items() if key not in ("FASTFORMER_BACKEND", "PYTHONPATH")}


def _python(args, cwd):
    """`python ARGS` in a fresh process in `cwd`, this checkout first on its path; its output kept."""
    return subprocess.run(
        [sys.executable, *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        env={**_environment(), "PYTHONPATH": str(ROOT)},
    )


@pytest.mark.parametrize("page", PYTHON_PAGES, ids=page_id)
def test_python_examples_run(page, example_dir, tmp_path):
    blocks = [b for b in read_blocks(page) if b.lang == "python" and b.skip is None]
    to_run = [{"page": str(page), "line": b.line, "code": b.code} for b in blocks]
    if not to_run:
        pytest.skip(f"every example of {page_id(page)} is marked docs-test: skip")
    work = tmp_path / "work"
    work.mkdir()
    for fixture in example_dir.iterdir():
        (work / fixture.name).symlink_to(fixture)
    (tmp_path / "blocks.json").write_text(json.dumps(to_run), encoding="utf-8")
    result = _python(["-c", RUNNER, str(tmp_path / "blocks.json")], work)
    assert result.returncode == 0, f"an example of {page_id(page)} failed:\n{result.stderr[-4000:]}"


def _fastformer_commands(block):
    """The argument lists of the `fastformer` commands in a bash block, with their line numbers."""
    for offset, line in enumerate(block.code.splitlines()):
        words = shlex.split(line, comments=True)
        segment = []
        for word in [*words, "&&"]:
            if word not in ("&&", "||", ";", "|"):
                segment.append(word)
                continue
            while segment and "=" in segment[0] and not segment[0].startswith("-"):  # VAR=value before a command
                segment.pop(0)
            if segment[:1] == ["fastformer"]:
                yield block.line + offset, segment[1:]
            elif "-m" in segment and segment[segment.index("-m") + 1 :][:1] == ["fastformer"]:
                yield block.line + offset, segment[segment.index("-m") + 2 :]
            segment = []


COMMANDS = [
    (page, line, args)
    for page in PAGES
    for block in read_blocks(page)
    if block.lang == "bash"
    for line, args in _fastformer_commands(block)
]


@pytest.mark.parametrize("page, line, args", COMMANDS, ids=[f"{page_id(p)}:{line}" for p, line, _ in COMMANDS])
def test_fastformer_commands_parse(page, line, args, capsys):
    where = f"{page_id(page)}:{line}: fastformer {' '.join(args)}"
    if "--help" in args or "-h" in args:
        with pytest.raises(SystemExit) as exit_:
            main(args)
        assert exit_.value.code == 0, where
        assert "usage: fastformer" in capsys.readouterr().out, where
        return
    try:
        build_parser().parse_args(args)
    except SystemExit:
        pytest.fail(f"{where}\n{capsys.readouterr().err}")


READ_LAST = [
    (page, line, args)
    for page, line, args in COMMANDS
    if args[:1] in (["evaluate"], ["predict"]) and "--run" in args and args[args.index("--run") + 1 :][:1] == ["last"]
]


@pytest.mark.parametrize("page, line, args", READ_LAST, ids=[f"{page_id(p)}:{line}" for p, line, _ in READ_LAST])
def test_commands_that_read_the_last_run_run_on_the_quick_starts(page, line, args, example_dir, monkeypatch, capsys):
    """The docs' `evaluate --run last` and `predict --run last` commands run as written on the run a
    new user has after the Quick start."""
    monkeypatch.chdir(example_dir)
    status = main(args)
    assert status == 0, f"{page_id(page)}:{line}: fastformer {' '.join(args)}\n{capsys.readouterr().err}"


def test_the_docs_show_fastformer_commands():
    pages = {page for page, _, _ in COMMANDS}
    assert ROOT / "README.md" in pages and ROOT / "docs" / "training.md" in pages
    assert {args[0] for _, _, args in READ_LAST} == {"evaluate", "predict"}


def test_readme_links_point_at_files():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    targets = re.findall(r"\]\(([^)\s]+)\)", readme)
    local = [t.split("#", 1)[0] for t in targets if not re.match(r"[a-z]+:", t) and not t.startswith("#")]
    assert local, "the README links into docs/"
    missing = [t for t in local if not (ROOT / t).exists()]
    assert not missing, f"README.md links to files that do not exist: {missing}"


def test_readme_is_a_front_page():
    """At most 10,000 characters, with the drop-in example in the first 4,000."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme) <= 10_000, len(readme)
    assert readme.index("from fastformer import Config, MovieClassification") < 4_000


def test_the_site_builds_with_no_broken_link(tmp_path):
    pytest.importorskip("mkdocs", reason="mkdocs is not installed: pip install -e '.[docs]'")
    pytest.importorskip("material", reason="mkdocs-material is not installed: pip install -e '.[docs]'")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "--config-file",
            str(ROOT / "mkdocs.yml"),
            "--site-dir",
            str(tmp_path / "site"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},  # material's notice about its successor
    )
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stderr[-6000:]}"
    assert (tmp_path / "site" / "index.html").is_file()
