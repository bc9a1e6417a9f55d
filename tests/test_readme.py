"""The README's install lines and quick start, docs/install.md and CI say the same commands."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GPU_INSTALL = "pip install -e ."
CPU_INSTALL = "pip install -e . --extra-index-url https://download.pytorch.org/whl/cpu"
TEST_COMMAND = "pip install -e '.[test]' && pytest"


def _first_bash_block(text):
    block = text.split("```bash", 1)[1].split("```", 1)[0]
    return [line.split("#", 1)[0].strip() for line in block.strip().splitlines() if line.strip()]


def test_readme_quick_start_has_two_commands_and_ci_runs_the_test_one():
    readme = (ROOT / "README.md").read_text()
    commands = _first_bash_block(readme.split("## Quick start", 1)[1])
    assert commands == [f"{CPU_INSTALL} && fastformer train", TEST_COMMAND], commands
    assert f"`{GPU_INSTALL} && fastformer train`" in readme.split("## Quick start", 1)[1], "the GPU line"
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert TEST_COMMAND in ci_lines


def test_readme_and_the_install_page_show_one_line_with_a_gpu_and_one_without():
    readme = (ROOT / "README.md").read_text()
    assert _first_bash_block(readme.split("## Install", 1)[1]) == [GPU_INSTALL, CPU_INSTALL]
    assert _first_bash_block((ROOT / "docs" / "install.md").read_text()) == [GPU_INSTALL, CPU_INSTALL]
