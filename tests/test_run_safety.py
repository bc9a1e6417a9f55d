"""`fastformer train` killed, interrupted or failing at chosen points: the run directory stays
usable, checkpoints are whole, and a resumed run ends bitwise where an uninterrupted one does.

The signals are sent from a subprocess that runs tests/signal_at_save.py: it wraps torch.save to
signal its own process at the n-th call, then runs the command. Each epoch saves twice (model.pt,
then trainer.pt), so call 2k+1 is epoch k+1's model.pt and call 2k+2 its trainer.pt.
"""
import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch

from fastformer.cli import main
from fastformer.data import read_reviews, train_vocab
from tests.helpers import TINY, write_reviews

SCRIPT = os.path.join(os.path.dirname(__file__), "signal_at_save.py")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("safety")
    config = root / "tiny.json"
    config.write_text(json.dumps(dict(TINY, dropout=0.1)), encoding="utf-8")  # dropout: the RNG state matters
    train = write_reviews(root / "train.txt", 96, seed=0)
    vocab = root / "vocab.model"
    train_vocab([review.doc for review in read_reviews(train)], str(vocab), n_pieces=60)
    test = write_reviews(root / "test.txt", 24, seed=1)
    return {"train": train, "test": test, "config": str(config), "vocab": str(vocab), "root": root}


def train_args(files, out, epochs=2):
    return [
        "train", "--train", files["train"], "--test", files["test"], "--config", files["config"],
        "--vocab", files["vocab"], "--epochs", str(epochs), "--batch-size", "16", "--lr", "3e-3",
        "--device", "cpu", "--out", str(out),
    ]


def run_until_signal(args, signal_name, at_save):
    return subprocess.run(
        [sys.executable, SCRIPT, signal_name, str(at_save), *args], capture_output=True, text=True, timeout=300
    )


@pytest.fixture(scope="module")
def uninterrupted(files):
    out = files["root"] / "uninterrupted"
    assert main(train_args(files, out)) == 0
    return out


def assert_same_state(run_a, run_b):
    a, b = torch.load(run_a / "model.pt"), torch.load(run_b / "model.pt")
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_killed_between_model_and_trainer_resumes_exactly(files, uninterrupted, tmp_path):
    """kill -9 after epoch 2's model.pt is written but before its trainer.pt: epoch 1's checkpoint
    is the one found, and --resume ends with the uninterrupted run's weights, bit for bit."""
    out = tmp_path / "run"
    killed = run_until_signal(train_args(files, out), "SIGKILL", at_save=4)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert sorted(os.listdir(out)) == [
        ".checkpoint.tmp", "checkpoint-1", "config.json", "curves.png", "metrics.json", "model.pt", "run.json",
        "vocab.model",
    ]
    assert main(["train", "--resume", str(out)]) == 0
    assert ".checkpoint.tmp" not in os.listdir(out) and "checkpoint-1" not in os.listdir(out)
    assert_same_state(out, uninterrupted)
    metrics = json.loads((out / "metrics.json").read_text())
    assert [e["epoch"] for e in metrics["epochs"]] == [1, 2]
    assert json.loads((out / "run.json").read_text())["resumed"][0]["from_epoch"] == 1


def test_killed_in_the_first_epoch_blocks_neither_resume_nor_a_rerun(files, uninterrupted, tmp_path):
    out = tmp_path / "run"
    killed = run_until_signal(train_args(files, out), "SIGKILL", at_save=1)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert sorted(os.listdir(out)) == [".checkpoint.tmp", "config.json", "run.json", "vocab.model"]
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    assert main(["predict", "--run", str(out), "--device", "cpu", "the film was good"]) == 2  # nothing to predict with

    assert main(["train", "--resume", str(copy)]) == 0  # starts again from the first epoch
    assert_same_state(copy, uninterrupted)
    assert main(train_args(files, out)) == 0  # the same --out: the unstarted run is replaced
    assert_same_state(out, uninterrupted)
    assert json.loads((out / "run.json").read_text())["resumed"] == []


def test_ctrl_c_prints_one_line_exits_130_and_keeps_the_last_checkpoint(files, tmp_path):
    out = tmp_path / "run"
    interrupted = run_until_signal(train_args(files, out, epochs=3), "SIGINT", at_save=3)  # during epoch 2's save
    assert interrupted.returncode == 130, interrupted.stderr
    last_line = interrupted.stderr.strip().splitlines()[-1].split("\r")[-1]
    assert last_line == (
        f"fastformer train: interrupted; last checkpoint: {out}/checkpoint-1; "
        f"`fastformer train --resume {out}` continues"
    )
    assert "Traceback" not in interrupted.stderr
    assert sorted(os.listdir(out)) == [
        "checkpoint-1", "config.json", "curves.png", "metrics.json", "model.pt", "run.json", "vocab.model",
    ]


def test_a_failed_write_is_one_line_naming_the_file_and_leaves_no_temporary_files(files, tmp_path, monkeypatch, capsys):
    """A full disk while writing epoch 2's trainer.pt: the error names the file, the staging
    directory is gone and epoch 1's checkpoint and published files are intact."""
    out = tmp_path / "run"
    save = torch.save

    def save_until_the_disk_is_full(obj, f, *args, **kwargs):
        if "epoch" in obj and obj["epoch"] == 2:
            f.write(b"partial")
            raise OSError(28, "No space left on device")
        return save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save_until_the_disk_is_full)
    assert main(train_args(files, out)) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1].split("\r")[-1]
    assert err == (
        f"fastformer train: error: could not write {out}/.checkpoint.tmp/trainer.pt: No space left on device; "
        f"last checkpoint: {out}/checkpoint-1"
    )
    assert sorted(os.listdir(out)) == [
        "checkpoint-1", "config.json", "curves.png", "metrics.json", "model.pt", "run.json", "vocab.model",
    ]
    assert torch.load(out / "checkpoint-1" / "trainer.pt")["epoch"] == 1
    assert (out / "model.pt").read_bytes() == (out / "checkpoint-1" / "model.pt").read_bytes()
