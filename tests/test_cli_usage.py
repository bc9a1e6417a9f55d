"""How the `fastformer` command reads its arguments and shows its progress: options spelt in full, a
typo answered with the nearest option of the command it was given to, every command and option
described, and progress in a log as plain lines (fastformer.progress)."""

import argparse
import io
import os
import subprocess
import sys

import pytest
from tqdm.auto import tqdm

from fastformer.cli import build_parser
from fastformer.progress import LogLines, progress_bar
from tests.helpers import tiny_job_files, train_args


def parsers():
    """{prog: parser} of the command and of each of its subcommands."""
    parser = build_parser()
    (commands,) = [action for action in parser._actions if isinstance(action, argparse._SubParsersAction)]
    return {parser.prog: parser} | {sub.prog: sub for sub in commands.choices.values()}


@pytest.mark.parametrize(
    "argv",
    [
        ["train", "--epoch", "1"],  # --epochs
        ["train", "--epoch=1"],
        ["demo", "--batch", "2"],  # --batch-size
        ["--vers"],  # --version
    ],
)
def test_an_option_is_spelt_in_full(argv, capsys):
    """argparse takes an unambiguous prefix of an option for it unless allow_abbrev=False, which
    the subcommands' parsers must be given too: `--epoch 1` is a typo, refused."""
    assert all(parser.allow_abbrev is False for parser in parsers().values())
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(argv)
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.count("\n") == 1 and "unrecognized arguments" in err, err


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["train", "--epoch", "1"],
            "fastformer train: error: unrecognized arguments: --epoch 1 (did you mean --epochs? see fastformer train "
            "--help)",
        ),
        (
            ["train", "--epoch=1"],
            "fastformer train: error: unrecognized arguments: --epoch=1 (did you mean --epochs? see fastformer train "
            "--help)",
        ),
        (
            ["evaluate", "--run", "R", "--batchsize", "3"],
            "fastformer evaluate: error: unrecognized arguments: --batchsize 3 (did you mean --batch-size? see "
            "fastformer evaluate --help)",
        ),
        (  # nothing near: the subcommand's help all the same
            ["train", "--bogus", "3"],
            "fastformer train: error: unrecognized arguments: --bogus 3 (see fastformer train --help)",
        ),
        (
            ["trian"],
            "fastformer: error: argument COMMAND: invalid choice: 'trian' (choose from demo, train, data, evaluate, "
            "predict) (did you mean train? see fastformer --help)",
        ),
        (
            ["demo", "--amp", "fp61"],
            "fastformer demo: error: argument --amp: invalid choice: 'fp61' (choose from auto, bf16, fp16, off) (did "
            "you mean fp16? see fastformer demo --help)",
        ),
    ],
)
def test_a_typo_is_answered_with_the_nearest_option_of_its_command(argv, message, capsys):
    """The one-line error names the subcommand that was given the typo, its nearest option or
    choice and its help, in the same words on every Python version (argparse's own quote the
    choices or not, suggest or not)."""
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(argv)
    assert exited.value.code == 2
    assert capsys.readouterr().err == message + "\n"


def test_every_command_and_option_says_what_it_is():
    """`--help` describes the command and each subcommand, and every argument of each, the runtime
    flags and TrainOptions' fields included."""
    for prog, parser in parsers().items():
        assert parser.description, f"{prog} has no description"
        for action in parser._actions:
            assert action.help and action.help != argparse.SUPPRESS, f"{prog}: {action.dest} has no help"


def test_a_bar_in_a_log_is_a_line_at_its_start_every_interval_and_at_its_end():
    now = [100.0]
    log = io.StringIO()
    bar = LogLines(8, desc="Train 1/5", unit=" batch", interval=30.0, file=log, clock=lambda: now[0])
    for t in (110.0, 131.0, 140.0, 162.0):  # 31 s after the start, then 31 s after that line
        now[0] = t
        bar.update(1)
        bar.set_postfix_str(f"loss 0.{t:.0f}")
    now[0] = 170.0
    bar.close()
    bar.close()
    assert log.getvalue().splitlines() == [
        "Train 1/5: 0/8 batch (0%), 00:00 elapsed",
        "Train 1/5: 2/8 batch (25%), 00:31 elapsed, 01:33 left, loss 0.110",
        "Train 1/5: 4/8 batch (50%), 01:02 elapsed, 01:02 left, loss 0.140",
        "Train 1/5: 4/8 batch (50%), 01:10 elapsed, 01:10 left, loss 0.162",  # closed early: --max-steps
    ]


def test_a_bar_in_a_log_keeps_its_delay_and_silence():
    """A bar closed within its delay writes nothing, as tqdm's shows nothing; a disabled one (a
    torchrun job's processes but rank 0) never writes; a total not known is left out."""
    now = [0.0]
    log = io.StringIO()
    LogLines(10, unit=" texts", delay=2.0, interval=1.0, file=log, clock=lambda: now[0]).close()
    silent = LogLines(10, disable=True, interval=1.0, file=log, clock=lambda: now[0])
    counted = LogLines(desc="Vocab: reading", unit=" texts", delay=2.0, interval=1.0, file=log, clock=lambda: now[0])
    now[0] = 1.5
    counted.update(1500)  # within the delay
    now[0] = 63.0
    for bar in (silent, counted):
        bar.update(61500)
        bar.close()
    assert log.getvalue() == "Vocab: reading: 63,000 texts, 01:03 elapsed\n"


def test_a_bar_of_bytes_in_a_log_counts_them_with_si_prefixes():
    """The reading of a large file (fastformer.data.files' bar: unit "B", unit_scale)."""
    now = [0.0]
    log = io.StringIO()
    bar = LogLines(10_500_000, desc="Reading train.tsv", unit="B", unit_scale=True, file=log, clock=lambda: now[0])
    now[0] = 4.0
    bar.update(1_048_576)
    bar.close()
    assert log.getvalue().splitlines() == [
        "Reading train.tsv: 0.00B/10.5MB (0%), 00:00 elapsed",
        "Reading train.tsv: 1.05MB/10.5MB (10%), 00:04 elapsed, 00:36 left",
    ]


class _Terminal(io.StringIO):
    def isatty(self):
        return True


@pytest.mark.parametrize("stream, kind", [(_Terminal(), tqdm), (io.StringIO(), LogLines)])
def test_the_bar_is_tqdms_on_a_terminal_and_lines_elsewhere(stream, kind, monkeypatch):
    monkeypatch.setattr(sys, "stderr", stream)
    with progress_bar(total=3, desc="Test", unit=" batch") as bar:
        bar.update(3)
    assert type(bar) is kind
    assert ("\r" in stream.getvalue()) == (kind is tqdm)


def test_a_train_logged_to_a_file_has_no_bar_frames(tmp_path):
    """`fastformer train` with its stderr in a file: a line as each bar starts and one as it ends
    (each epoch's train and test), no carriage return, where tqdm wrote a frame at every redraw."""
    files = tiny_job_files(tmp_path)
    argv = train_args(files, tmp_path / "run", "--backend", "reference")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with open(tmp_path / "stderr.log", "w+") as err:
        done = subprocess.run(
            [sys.executable, "-m", "fastformer", *argv], stdout=subprocess.PIPE, stderr=err, text=True, env=env
        )
        err.seek(0)
        log = err.read()
    assert done.returncode == 0, log[-3000:]
    assert "\r" not in log and len(log) < 3000, log[-3000:]
    for epoch in (1, 2, 3):
        for line in (f"Train {epoch}/3: 0/15 batch (0%), ", f"Train {epoch}/3: 15/15 batch (100%), "):
            assert line in log, log
        assert f"Test  {epoch}/3: 0/4 batch (0%), " in log and f"Test  {epoch}/3: 4/4 batch (100%), " in log, log
