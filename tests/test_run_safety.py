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
from fastformer.train import job
from tests.helpers import TINY, pin_thread_count, write_reviews

SCRIPT = os.path.join(os.path.dirname(__file__), "signal_at_save.py")


@pytest.fixture(scope="module", autouse=True)
def one_thread_count():
    """Every job of this module, in this process and in subprocesses, on one thread count: their
    weights are compared bit for bit (pin_thread_count)."""
    with pytest.MonkeyPatch.context() as patch:
        pin_thread_count(patch)
        yield


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
        "train",
        "--train",
        files["train"],
        "--test",
        files["test"],
        "--config",
        files["config"],
        "--vocab",
        files["vocab"],
        "--epochs",
        str(epochs),
        "--batch-size",
        "16",
        "--lr",
        "3e-3",
        "--device",
        "cpu",
        "--out",
        str(out),
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
        ".checkpoint.tmp",
        ".lock",
        "checkpoint-1",
        "config.json",
        "curves.png",
        "metrics.json",
        "model.pt",
        "run.json",
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
    assert sorted(os.listdir(out)) == [".checkpoint.tmp", ".lock", "config.json", "run.json", "vocab.model"]
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
        ".lock",
        "checkpoint-1",
        "config.json",
        "curves.png",
        "metrics.json",
        "model.pt",
        "run.json",
        "vocab.model",
    ]


@pytest.mark.parametrize("name", ["SIGTERM", "SIGHUP"])
def test_a_stop_signal_stops_as_ctrl_c_does_in_one_line_with_its_status(files, tmp_path, name):
    """SIGTERM (a scheduler's, `timeout`'s) and SIGHUP (a closed terminal) during epoch 2's save:
    one line naming the signal and the last checkpoint, exit 128 + the signal's number, the
    staging directory gone and epoch 1's checkpoint whole, as on Ctrl-C (SIGQUIT and SIGUSR1 take
    the same handler: fastformer.cli.STOP_SIGNALS)."""
    out = tmp_path / "run"
    stopped = run_until_signal(train_args(files, out), name, at_save=3)
    signum = getattr(signal, name)
    assert stopped.returncode == 128 + signum, stopped.stderr
    last_line = stopped.stderr.strip().splitlines()[-1].split("\r")[-1]
    assert last_line == (
        f"fastformer train: stopped by {name}; last checkpoint: {out}/checkpoint-1; "
        f"`fastformer train --resume {out}` continues"
    )
    assert "Traceback" not in stopped.stderr
    assert ".checkpoint.tmp" not in os.listdir(out) and "checkpoint-1" in os.listdir(out)


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
        ".lock",
        "checkpoint-1",
        "config.json",
        "curves.png",
        "metrics.json",
        "model.pt",
        "run.json",
        "vocab.model",
    ]
    assert torch.load(out / "checkpoint-1" / "trainer.pt")["epoch"] == 1
    assert (out / "model.pt").read_bytes() == (out / "checkpoint-1" / "model.pt").read_bytes()


@pytest.mark.parametrize("removed", [False, True], ids=["renamed", "removed"])
def test_a_run_directory_that_goes_away_while_training_is_said_so(files, tmp_path, monkeypatch, capsys, removed):
    """The run directory renamed (or removed) after epoch 1's checkpoint: the job stops in one line
    that says the directory went away and, renamed, where it and its last checkpoint are now, the
    new place resumable (issue 69, item 18); it used to stop with `[Errno 2] ...: 'run'`."""
    monkeypatch.chdir(tmp_path)
    publish, moved = job.publish, tmp_path / "moved"

    def publish_then_move(run_dir, *args, **kwargs):
        publish(run_dir, *args, **kwargs)
        if removed:
            shutil.rmtree(run_dir)
        else:
            os.rename(run_dir, moved)

    monkeypatch.setattr(job, "publish", publish_then_move)
    assert main(train_args(files, "run")) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1].split("\r")[-1]
    if removed:
        assert err == (
            "fastformer train: error: the run directory run went away while the job ran (it was removed, or "
            "moved where this system cannot say); last checkpoint: run/checkpoint-1"
        )
    else:
        assert err == (
            f"fastformer train: error: the run directory run went away while the job ran: it is now {moved}; "
            f"last checkpoint: {moved}/checkpoint-1; `fastformer train --resume {moved}` continues"
        )
        assert (moved / "checkpoint-1" / "trainer.pt").is_file()
    assert not (tmp_path / "run").exists()


def test_max_steps_stops_inside_an_epoch_and_resume_ends_bitwise_where_an_uninterrupted_run_does(
    files, uninterrupted, tmp_path, capsys
):
    """--max-steps 2 stops inside epoch 1 (of 6 steps), a resume with --max-steps 9 inside epoch 2,
    a last resume ends the run: each stop is a checkpoint at its step (the one before it removed),
    the epoch line does not claim a whole epoch, and the weights end as the uninterrupted run's."""
    out = tmp_path / "run"
    assert main([*train_args(files, out), "--max-steps", "2"]) == 0
    stdout = capsys.readouterr().out
    assert "epoch 1/2 stopped after 2 of its 6 steps  train loss" in stdout
    assert "stopped by --max-steps 2 after step 2 of the 6 of epoch 1" in stdout
    assert [name for name in os.listdir(out) if name.startswith("checkpoint")] == ["checkpoint-1-step-2"]
    metrics = json.loads((out / "metrics.json").read_text())["epochs"]
    assert [(e["epoch"], e["steps"], e["epoch_steps"], e["complete"]) for e in metrics] == [(1, 2, 2, False)]

    assert main(["train", "--resume", str(out), "--max-steps", "9"]) == 0
    stdout = capsys.readouterr().out
    assert f"run dir  {out} (resumed after step 2 of the 6 of epoch 1)" in stdout
    assert "epoch 1/2  train loss" in stdout and "epoch 2/2 stopped after 3 of its 6 steps" in stdout
    assert [name for name in os.listdir(out) if name.startswith("checkpoint")] == ["checkpoint-2-step-3"]

    assert main(["train", "--resume", str(out)]) == 0
    assert [name for name in os.listdir(out) if name.startswith("checkpoint")] == ["checkpoint-2"]
    assert_same_state(out, uninterrupted)
    ours, theirs = (json.loads((run / "metrics.json").read_text())["epochs"] for run in (out, uninterrupted))
    assert [(e["epoch"], e["steps"], e["complete"]) for e in ours] == [(1, 6, True), (2, 12, True)]
    for key in ("train_loss", "train_accuracy", "test_loss", "test_accuracy", "lr"):
        assert [e[key] for e in ours] == pytest.approx([e[key] for e in theirs], rel=1e-6), key
    run = json.loads((out / "run.json").read_text())
    assert [(r["from_epoch"], r["from_step"], r["max_steps"]) for r in run["resumed"]] == [(0, 2, 9), (1, 9, None)]


def test_a_save_removes_only_the_checkpoint_the_run_wrote(files, uninterrupted, tmp_path, capsys):
    """Directories in a run that the run did not write stay, whatever their names; a run made
    inside it before that was refused is named, and the run is not resumed over it."""
    out = tmp_path / "run"
    shutil.copytree(uninterrupted, out)
    (out / "checkpoint-1").mkdir()
    (out / "checkpoint-1" / "notes.txt").write_text("mine")
    shutil.copytree(uninterrupted, out / "checkpoint-7")  # a run made at --out RUN/checkpoint-7
    assert main(["train", "--resume", str(out), "--epochs", "3"]) == 2
    assert capsys.readouterr().err == (
        f"fastformer train: error: {out}/checkpoint-7 is a run directory made inside the run {out}, not one of its "
        f"checkpoints; move it out of {out}, then resume {out}\n"
    )
    shutil.move(out / "checkpoint-7", tmp_path / "moved")
    assert main(["train", "--resume", str(out), "--epochs", "3"]) == 0
    assert sorted(name for name in os.listdir(out) if name.startswith("checkpoint")) == ["checkpoint-1", "checkpoint-3"]
    assert (out / "checkpoint-1" / "notes.txt").read_text() == "mine"


def test_without_buckets_a_run_stopped_inside_an_epoch_resumes_bitwise(files, tmp_path):
    """The other batch order (--no-bucket: torch's RandomSampler) continues inside an epoch too."""
    whole, stopped = tmp_path / "whole", tmp_path / "stopped"
    assert main([*train_args(files, whole), "--no-bucket"]) == 0
    assert main([*train_args(files, stopped), "--no-bucket", "--max-steps", "8"]) == 0
    assert main(["train", "--resume", str(stopped)]) == 0
    assert_same_state(stopped, whole)


def test_a_tmpdir_that_cannot_hold_the_scratch_directory_is_named(files, tmp_path, monkeypatch, capsys):
    """The vocab is trained in a scratch directory in $TMPDIR: a TMPDIR that is a file, and a full
    disk while the vocab is written there, are one line each naming the place and TMPDIR."""
    import tempfile

    import fastformer.data.vocab as vocab_module

    not_a_dir = tmp_path / "not-a-dir"
    not_a_dir.write_text("")
    args = [arg for arg in train_args(files, tmp_path / "run") if arg not in ("--vocab", files["vocab"])]
    args += ["--vocab-size", "60"]
    with monkeypatch.context() as patch:
        patch.setattr(tempfile, "tempdir", str(not_a_dir))
        assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"fastformer train: error: cannot make a scratch directory in {not_a_dir} ($TMPDIR"), err

    def full(path, mode="r", *rest, **kwargs):
        if "w" in mode:
            raise OSError(28, "No space left on device")
        return open(path, mode, *rest, **kwargs)

    monkeypatch.setattr(vocab_module, "open", full, raising=False)
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "[Errno 28] No space left on device: '" in err and "vocab.model'" in err, err
    assert err.endswith(f"(the scratch directory, in {tempfile.gettempdir()}: set TMPDIR to a directory with room)")


def test_past_ulimit_f_a_write_fails_naming_its_file(files, tmp_path):
    """Past the file size limit (`ulimit -f`) a write fails (Python ignores SIGXFSZ, whose default
    action would end the process without a word): the vocab trained in the scratch directory is
    more than the limit, and the one-line error names its file; exit 2, no run directory left."""
    import resource

    out = tmp_path / "run"
    args = [arg for arg in train_args(files, out) if arg not in ("--vocab", files["vocab"])]

    def limit_file_size():
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, resource.RLIM_INFINITY))

    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")  # no byte-code cache written past the limit
    limited = subprocess.run(
        [sys.executable, "-m", "fastformer", *args, "--vocab-size", "60"],
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=limit_file_size,
        env=env,
    )
    assert limited.returncode == 2, limited.stderr[-2000:]
    last_line = limited.stderr.strip().splitlines()[-1].split("\r")[-1]
    assert "[Errno 27] File too large: '" in last_line and "vocab.model'" in last_line, limited.stderr[-2000:]
    assert "TMPDIR" not in last_line  # room elsewhere would not help
    assert os.listdir(tmp_path) == []
