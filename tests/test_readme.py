"""The README's quick start and CI run the same test command."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TEST_COMMAND = "pip install -e '.[test]' && pytest"


def test_readme_quick_start_has_two_commands_and_ci_runs_the_test_one():
    readme = (ROOT / "README.md").read_text()
    quick_start = readme.split("## Quick start", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    commands = [line for line in quick_start.strip().splitlines() if line.strip()]
    assert commands == ["pip install -e . && fastformer train", TEST_COMMAND], commands
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert TEST_COMMAND in ci_lines
