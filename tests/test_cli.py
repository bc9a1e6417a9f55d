"""The `fastformer` command."""

import argparse
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fastformer
from fastformer.cli import build_parser, main
from fastformer.train.run import TrainOptions

ROOT = Path(__file__).resolve().parent.parent


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


def test_demo_shares_the_runtime_options_of_evaluate_and_predict(capsys):
    """demo takes --device, --backend and --amp as evaluate and predict take them (one declaration,
    _add_runtime_options): the demo runs under the autocast --amp names, and their help is the same."""
    for amp in ("off", "bf16"):
        argv = ["demo", "--device", "cpu", "--backend", "reference", "--amp", amp, "--batch-size", "2"]
        assert main([*argv, "--seq-len", "8"]) == 0
        assert f"amp {amp}, backend 'reference'" in capsys.readouterr().out
    help_texts = {}
    for command in ("demo", "evaluate"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        out = " ".join(capsys.readouterr().out.split())
        out = out[out.index("options:") :]
        help_texts[command] = [out[out.index(flag) :].split(" --")[0] for flag in ("--device", "--backend", "--amp")]
    assert help_texts["demo"] == help_texts["evaluate"]
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--amp", "fp8"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1 and "argument --amp: invalid choice: 'fp8'" in err, err


def test_demo_runs_on_its_backend_and_leaves_the_process_on_the_previous_one(capsys):
    with fastformer.use_backend("triton"):
        assert main(["demo", "--device", "cpu", "--backend", "reference", "--batch-size", "2", "--seq-len", "8"]) == 0
        assert fastformer.get_backend() == "triton"
    assert "backend 'reference' -> PyTorch reference" in capsys.readouterr().out


def test_the_backend_not_given_is_the_environments(monkeypatch, capsys):
    """FASTFORMER_BACKEND, which sets the backend of fastformer's modules, is also every command's
    --backend default; --backend overrides it, and a bad value is one line and exit 2."""
    from fastformer.train import job

    seen = []
    monkeypatch.setattr(job, "demo", lambda **options: seen.append(options["backend_name"]))
    demo = ["demo", "--device", "cpu", "--batch-size", "2", "--seq-len", "8"]
    monkeypatch.setenv("FASTFORMER_BACKEND", "reference")
    assert main(demo) == 0 and main([*demo, "--backend", "auto"]) == 0
    monkeypatch.delenv("FASTFORMER_BACKEND")
    assert main(demo) == 0
    assert seen == ["reference", "auto", "auto"]
    monkeypatch.setenv("FASTFORMER_BACKEND", "reference")
    assert TrainOptions.from_args(build_parser().parse_args(["train"])).backend_name == "reference"
    monkeypatch.setenv("FASTFORMER_BACKEND", "bogus")
    capsys.readouterr()
    assert main(demo) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "$FASTFORMER_BACKEND" in err and "'bogus'" in err
    assert seen == ["reference", "auto", "auto"]


def test_train_arguments_become_one_train_options_with_the_apis_defaults():
    parser = build_parser()
    assert TrainOptions.from_args(parser.parse_args(["train"])) == TrainOptions()
    args = parser.parse_args(
        [
            "train",
            "--backend",
            "reference",
            "--lr",
            "1e-3",
            "--no-bucket",
            "--cuda-graphs",
            "--n-output",
            "auto",
            "--max-steps",
            "7",
            "--no-precompile",
            "--autotune",
        ]
    )
    assert TrainOptions.from_args(args) == TrainOptions(
        backend_name="reference",
        lr=1e-3,
        bucket=False,
        cuda_graphs=True,
        n_output="auto",
        max_steps=7,
        precompile=False,
        autotune=True,
    )


def test_module_entry_point_runs():
    result = subprocess.run([sys.executable, "-m", "fastformer", "--help"], capture_output=True, text=True, check=True)
    assert "usage: fastformer" in result.stdout


def test_help_and_version_do_not_import_torch_or_triton():
    code = (
        "import sys\n"
        "from fastformer.cli import main\n"
        "for argv in (['--help'], ['--version'], ['train', '--help'], ['predict', '--help']):\n"
        "    try:\n"
        "        main(argv)\n"
        "    except SystemExit:\n"
        "        pass\n"
        "print(sorted(m for m in ('torch', 'triton', 'fastformer.kernels', 'sentencepiece') if m in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a CUDA device the ops register at import")
def test_a_process_that_can_run_no_kernel_loads_neither_dynamo_nor_inductor():
    """On a CPU without TRITON_INTERPRET (`fastformer predict`, `evaluate`) the model runs the
    PyTorch reference, so fastformer's torch.library ops, whose registration imports torch._inductor
    and torch._dynamo (1 to 1.5 s), wait; the dry-run driver, which lets the Triton path run on CPU
    tensors, registers them on entry (issue 69, item 3)."""
    code = (
        "import sys, torch\n"
        "from tests.helpers import small_config\n"
        "from fastformer import MovieClassification\n"
        "model = MovieClassification(small_config()).eval()\n"
        "with torch.no_grad():\n"
        "    model(torch.tensor([[5, 6, 7, 0]]), torch.tensor([[1]]))\n"
        "print(sorted(m for m in ('torch._dynamo', 'torch._inductor') if m in sys.modules))\n"
        "from tools import sm90\n"
        "with sm90.dry_run(time_configs=False):\n"
        "    print(hasattr(torch.ops.fastformer, 'attention_forward'))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["[]", "True"], result.stdout


@pytest.mark.parametrize(
    "argv, message",
    [
        (["demo", "--batch-size", "0"], "fastformer demo: error: --batch-size must be positive, got 0"),
        (["demo", "--seq-len", "-3"], "fastformer demo: error: --seq-len must be positive, got -3"),
        pytest.param(
            ["demo", "--device", "cuda"],
            "fastformer demo: error: --device cuda: CUDA is not available on this machine",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA"),
        ),
        (["demo", "--device", "tpu9"], "fastformer demo: error: --device tpu9: fastformer runs on cpu, cuda or cuda:N"),
        (
            ["evaluate", "--run", "nowhere", "--batch-size", "0"],
            "fastformer evaluate: error: --batch-size must be positive",
        ),
        (["train", "--precompile"], "fastformer train: error: --precompile needs --pad-to-buckets"),
        (
            ["train", "--precompile", "--pad-to-buckets", "--compile"],
            "fastformer train: error: --precompile and --compile are alternatives",
        ),
    ],
)
def test_bad_options_are_one_line_exit_2(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1, err


def test_each_train_option_is_its_fields_flag(monkeypatch):
    """`fastformer train`'s parser is built from TrainOptions' fields (options.flag declares each
    field's flag beside it): one option per field, in the fields' order, each with its help, and
    the options left out parse to TrainOptions() itself (no flag whose default is another value)."""
    monkeypatch.delenv("FASTFORMER_BACKEND", raising=False)
    parser = build_parser()
    (commands,) = [action for action in parser._actions if isinstance(action, argparse._SubParsersAction)]
    train = commands.choices["train"]
    options = [action for action in train._actions if action.dest != "help"]
    assert [action.dest for action in options] == [field.name for field in dataclasses.fields(TrainOptions)]
    assert all(action.help for action in options)
    assert TrainOptions.from_args(parser.parse_args(["train"])) == TrainOptions()


def test_train_help_lists_how_steps_run(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--cuda-graphs, --no-cuda-graphs" in out and "--pad-to-buckets, --no-pad-to-buckets" in out
    assert "--precompile, --no-precompile" in out and "--autotune" in out and "FASTFORMER_AUTOTUNE=1" in out
    assert "(default: on where it applies: CUDA, bf16 or no autocast, one process, no --compile" in out
    assert "--compile" in out and "the Triton kernels only on CUDA" in out


def test_usage_errors_are_one_line(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--epochs", "many"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == (
        "fastformer train: error: argument --epochs: invalid int value: 'many' (see fastformer train --help)\n"
    )


@pytest.mark.parametrize("argv", [["predict", "--run", "R", "-bad"], ["predict", "--run", "R", "good", "-bad"]])
def test_a_text_that_starts_with_a_dash_is_pointed_to_double_dash(argv, capsys):
    """argparse reads "-bad" as an unknown option; the one-line error says where such a text goes.
    A negative number or a mistyped --option gets no such hint."""
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "(a text that starts with '-', such as '-bad', goes after `--`; see fastformer" in err, err
    assert err.count("\n") == 1
    for argv in (["train", "--lr", "-1e-3x", "--epochs"], ["train", "--bogus", "3"]):
        with pytest.raises(SystemExit):
            main(argv)
        assert "goes after `--`" not in capsys.readouterr().err


def test_demo_help_says_what_it_does_and_what_each_option_is(capsys):
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "run one forward and backward on a batch of random reviews" in out and "Nothing is written" in out
    for text in ("random reviews in the batch (default: 8)", "at most the config's 256 (default: 64)", "(default: 0)"):
        assert text in out, text
