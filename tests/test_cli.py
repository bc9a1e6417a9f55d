"""The `fastformer` command."""
import subprocess
import sys

import pytest

import fastformer
from fastformer.cli import main


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"fastformer {fastformer.__version__}"


def test_no_command_prints_help(capsys):
    assert main([]) == 0
    assert "demo" in capsys.readouterr().out


def test_demo_runs_forward_and_backward(capsys):
    assert main(["demo", "--device", "cpu", "--backend", "reference", "--batch-size", "2", "--seq-len", "8"]) == 0
    out = capsys.readouterr().out
    assert "PyTorch reference" in out
    assert "logits (2, 2)" in out and "gradient norm" in out


def test_module_entry_point_runs():
    result = subprocess.run([sys.executable, "-m", "fastformer", "--help"], capture_output=True, text=True, check=True)
    assert "usage: fastformer" in result.stdout
