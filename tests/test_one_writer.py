"""A run directory has one writer, and a resume, evaluate or predict uses only what the run was
trained with: the lock on a run being written (held by another process, then released by its
death), where --out may point, the files run.json pins, and the options --resume refuses."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fastformer.cli import main
from fastformer.data import read_reviews, train_vocab
from fastformer.train import job
from fastformer.train.rundir import LOCK, is_run_dir
from tests.helpers import TINY, tiny_job_files, train_args

ROOT = Path(__file__).resolve().parent.parent
# A process that takes a run directory's writer lock, says so, and holds it until its stdin closes.
HOLDER = """
import sys
from fastformer.train.rundir import writing
with writing(sys.argv[1], sys.argv[2]):
    print("held", flush=True)
    sys.stdin.read()
"""


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return tiny_job_files(tmp_path_factory.mktemp("writer"), n_train=120, n_test=30)


@pytest.fixture(scope="module")
def run_dir(files):
    out = files["root"] / "run"
    assert main(train_args(files, out, "--epochs", "1")) == 0
    return out


@pytest.fixture
def copy(run_dir, tmp_path):
    """A copy of the trained run, to change or hold."""
    path = tmp_path / "run"
    shutil.copytree(run_dir, path)
    return path


@pytest.fixture
def holder():
    """hold(run_dir, option): a subprocess holding run_dir's writer lock; killed at the end."""
    procs = []

    def hold(path, option="--out"):
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        proc = subprocess.Popen(
            [sys.executable, "-c", HOLDER, str(path), option],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        procs.append(proc)
        assert proc.stdout.readline().strip() == "held"
        return proc

    yield hold
    for proc in procs:
        proc.kill()
        proc.wait()


def snapshot(path):
    """Every file under `path` with its bytes."""
    return {p.relative_to(path): p.read_bytes() for p in sorted(Path(path).rglob("*")) if p.is_file()}


def one_line_error(capsys):
    out, err = capsys.readouterr()
    err = err.strip()
    assert err.startswith("fastformer ") and "\n" not in err, err
    return out, err


def test_a_second_train_into_a_run_being_written_is_refused_and_touches_nothing(files, tmp_path, holder, capsys):
    out = tmp_path / "run"
    proc = holder(out)
    before = snapshot(out)
    assert main(train_args(files, out)) == 2
    stdout, err = one_line_error(capsys)
    assert f"--out {out} is being written by pid {proc.pid} on {socket.gethostname()}" in err, err
    assert "Training a BPE vocab" not in stdout  # refused before any work
    assert snapshot(out) == before


def test_two_trains_at_once_into_one_directory_give_one_run(files, tmp_path):
    """Two real `fastformer train --out run` processes started together: one trains, the other is
    refused in one line, and the run directory is the winner's alone."""
    out = tmp_path / "run"
    command = [sys.executable, "-m", "fastformer", *train_args(files, out, "--epochs", "1")]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    pipes = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    procs = [subprocess.Popen(command, env=env, **pipes) for _ in "ab"]
    results = [(proc.wait(timeout=300), *proc.communicate()) for proc in procs]
    assert sorted(code for code, _, _ in results) == [0, 2], [(code, err[-500:]) for code, _, err in results]
    (winner,) = [p for p, (code, _, _) in zip(procs, results) if code == 0]
    (_, _, refused) = next(r for r in results if r[0] == 2)
    assert f"--out {out} " in refused and "is being written by pid" in refused and refused.count("\n") == 1, refused
    assert is_run_dir(out) and (out / "checkpoint-1").is_dir()
    assert json.loads((out / LOCK).read_text())["pid"] == winner.pid


def test_a_lock_left_by_a_killed_holder_is_taken(files, tmp_path, holder):
    out = tmp_path / "run"
    proc = holder(out)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert main(train_args(files, out, "--epochs", "1")) == 0  # the kernel dropped the lock with its process
    assert is_run_dir(out)
    assert json.loads((out / LOCK).read_text())["pid"] == os.getpid()


def test_a_resume_of_a_run_being_written_is_refused_and_readers_say_it_is_training(copy, holder, capsys):
    proc = holder(copy, "--resume")
    before = snapshot(copy)
    assert main(["train", "--resume", str(copy), "--epochs", "2"]) == 2
    _, err = one_line_error(capsys)
    assert f"--resume {copy} is being written by pid {proc.pid}" in err, err
    assert snapshot(copy) == before
    assert main(["evaluate", "--run", str(copy), "--device", "cpu"]) == 0
    out, _ = capsys.readouterr()
    assert f"note: {copy} is still training (pid {proc.pid}" in out and "newest checkpoint:" in out, out
    assert main(["predict", "--run", str(copy), "--device", "cpu", "good movie"]) == 0
    assert "is still training" in capsys.readouterr().out
    os.remove(copy / "model.pt")  # as before the first checkpoint
    assert main(["evaluate", "--run", str(copy), "--device", "cpu"]) == 2
    _, err = one_line_error(capsys)
    assert f"{copy} is still training (pid {proc.pid}" in err and "has no checkpoint yet" in err, err


def test_readers_of_a_run_being_created_say_so(tmp_path, holder, capsys):
    """A job holds the directory but has written none of its files yet (the vocab's training, say):
    evaluate and predict say it is being created, not that it is no run directory (issue 69, 17)."""
    out = tmp_path / "run"
    proc = holder(out)
    for argv in (["evaluate", "--run", str(out), "--device", "cpu"], ["predict", "--run", str(out), "good movie"]):
        assert main(argv) == 2
        _, err = one_line_error(capsys)
        assert f"{out} is being created by a train job (pid {proc.pid}" in err and "no checkpoint yet" in err, err
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert main(["evaluate", "--run", str(out), "--device", "cpu"]) == 2  # no holder: an empty directory
    assert "is not a fastformer run directory" in one_line_error(capsys)[1]


def test_out_dot_in_an_empty_directory_writes_there_and_removes_nothing(files, tmp_path, monkeypatch):
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    inode = os.stat(".").st_ino
    assert main(train_args(files, ".", "--epochs", "1")) == 0
    assert os.stat(".").st_ino == inode and os.path.samefile(os.getcwd(), here)
    assert is_run_dir(here)


def test_out_through_a_symlink_writes_into_its_target(files, tmp_path):
    target = tmp_path / "target"
    target.mkdir()
    link = tmp_path / "link"
    link.symlink_to(target)
    assert main(train_args(files, link, "--epochs", "1")) == 0
    assert link.is_symlink() and is_run_dir(target)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda tmp: (tmp / "dangling").symlink_to(tmp / "nowhere") or tmp / "dangling", "which does not exist"),
        (lambda tmp: Path("/proc/fastformer-run"), "is under /proc, a file system of the kernel"),
        (lambda tmp: Path("/sys"), "is under /sys"),
        (lambda tmp: (tmp / "file").write_text("x") and tmp / "file", "is a file, not a directory"),
    ],
    ids=["dangling link", "proc", "sys", "file"],
)
def test_an_output_path_that_cannot_hold_a_run_is_refused_before_any_work(files, tmp_path, capsys, make, message):
    out = make(tmp_path)
    before = sorted(os.listdir(tmp_path))
    assert main(train_args(files, out)) == 2
    stdout, err = one_line_error(capsys)
    assert message in err, err
    assert "Training a BPE vocab" not in stdout
    assert sorted(os.listdir(tmp_path)) == before


def test_a_swapped_vocab_or_config_is_refused_by_evaluate_predict_and_resume(files, copy, capsys):
    other = files["root"] / "other-vocab.model"
    if not other.exists():  # a valid vocab of the same size, trained on other texts
        train_vocab([r.doc for r in read_reviews(files["test"])], str(other), n_pieces=60)
    shutil.copyfile(other, copy / "vocab.model")
    for argv in (
        ["evaluate", "--run", str(copy), "--device", "cpu"],
        ["predict", "--run", str(copy), "--device", "cpu", "good movie"],
        ["train", "--resume", str(copy), "--epochs", "2"],
    ):
        assert main(argv) == 2, argv
        _, err = one_line_error(capsys)
        assert f"{copy / 'vocab.model'} is not the file this run was trained with" in err, (argv, err)
    with pytest.raises(ValueError, match=r"vocab\.model is not the file"):
        job.predict(run=str(copy), texts=["good movie"], device="cpu")


def test_an_edited_config_is_refused_by_resume(run_dir, copy, capsys):
    shutil.copyfile(run_dir / "vocab.model", copy / "vocab.model")
    config = json.loads((copy / "config.json").read_text())
    config.update(n_head=4, d_head=8)  # the same weight shapes: the checkpoint would load
    (copy / "config.json").write_text(json.dumps(config))
    before = snapshot(copy)
    assert main(["train", "--resume", str(copy), "--epochs", "2"]) == 2
    _, err = one_line_error(capsys)
    assert f"{copy / 'config.json'} is not the file this run was trained with" in err, err
    assert snapshot(copy) == before


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--out", "OTHER"], "writes into the run it continues; --out"),
        (["--dataset", "demo"], "--dataset demo differs from the run's (the files of --train/--test)"),
    ],
)
def test_resume_refuses_an_output_or_data_set_other_than_the_run(copy, tmp_path, capsys, extra, message):
    extra = [str(tmp_path / "other") if arg == "OTHER" else arg for arg in extra]
    before = snapshot(copy)
    assert main(["train", "--resume", str(copy), "--epochs", "2", *extra]) == 2
    _, err = one_line_error(capsys)
    assert message in err, err
    assert snapshot(copy) == before and not (tmp_path / "other").exists()


def test_resume_with_its_own_directory_as_out_continues(copy):
    assert main(["train", "--resume", str(copy), "--epochs", "2", "--out", str(copy)]) == 0
    assert (copy / "checkpoint-2").is_dir()
    info = json.loads((copy / "run.json").read_text())
    assert {"vocab_sha256", "config_sha256"} <= info.keys() and len(info["resumed"]) == 1


def test_refusals_after_the_lock_leave_no_directory(files, tmp_path, capsys):
    """A bad config, and a run that fails once the lock is taken, leave nothing behind."""
    config = tmp_path / "two.json"
    config.write_text(json.dumps(dict(TINY, n_dec_vocab=2)))
    out = tmp_path / "deep" / "run"
    args = train_args(dict(files, config=str(config)), out)
    assert main(args) == 2
    _, err = one_line_error(capsys)
    assert "config.n_dec_vocab is 2, but the classifier's decoder reads [BOS], id 2" in err, err
    assert not (tmp_path / "deep").exists()
    # a failure after the lock is taken (an unknown device), before anything is written
    assert main([*train_args(files, out)[:-4], "--device", "cuda:7", "--out", str(out)]) == 2
    capsys.readouterr()
    assert not (tmp_path / "deep").exists()


def test_a_numpy_seed_from_python_trains(files, tmp_path):
    out = tmp_path / "run"
    job.train(
        train=files["train"],
        test=files["test"],
        config=files["config"],
        vocab_size=60,
        epochs=1,
        batch_size=np.int64(16),
        device="cpu",
        out=str(out),
        seed=np.int64(3),
        log=lambda *_: None,
    )
    assert json.loads((out / "run.json").read_text())["seed"] == 3
