"""What the readers of a run directory say of one that is damaged or odd: run.json checked whole
against its table (rundir.RUN_JSON), `--run last` on a run that did not finish, symlink loops,
paths that are not UTF-8, resume commands a shell reads back, and `evaluate`'s advice on pieces of
another vocab. Every error is one line, exit status 2."""

import json
import os
import re
import shlex
import shutil
import subprocess

import pytest

from fastformer.cli import main
from fastformer.train import job
from fastformer.train.run import RUN_OPTIONS
from fastformer.train.rundir import RUN_JSON, SESSION, shell_word, writing
from tests.helpers import tiny_job_files, train_args


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return tiny_job_files(tmp_path_factory.mktemp("data"), n_train=96, n_test=24)


@pytest.fixture(scope="module")
def run_dir(files):
    """A finished run of 1 epoch, resumed for a 2nd: its run.json has a session under `resumed`."""
    out = files["root"] / "run"
    assert main(train_args(files, out, "--epochs", "1")) == 0
    assert main(["train", "--resume", str(out), "--epochs", "2"]) == 0
    return out


def copy_of(run_dir, tmp_path, name="copy"):
    copy = tmp_path / name
    shutil.copytree(run_dir, copy)
    return copy


_GONE = object()


def with_run_json(run_dir, tmp_path, changes, name="copy"):
    """A copy of the run whose run.json has `changes` made to it (a value _GONE: the key removed)."""
    copy = copy_of(run_dir, tmp_path, name)
    info = json.loads((copy / "run.json").read_text())
    for key, value in changes.items():
        if value is _GONE:
            del info[key]
        else:
            info[key] = value
    (copy / "run.json").write_text(json.dumps(info))
    return copy


def readers(run):
    """The three commands that read a run directory, by name."""
    return {
        "resume": ["train", "--resume", str(run), "--epochs", "3", "--device", "cpu"],
        "evaluate": ["evaluate", "--run", str(run), "--device", "cpu"],
        "predict": ["predict", "--run", str(run), "--device", "cpu", "the film was good"],
    }


def one_line_error(capsys, argv):
    """The one line of stderr with which `fastformer argv` fails, exit status 2."""
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"fastformer {argv[0]}: error: "), err
    assert "Traceback" not in err and "incompatible function arguments" not in err, err
    return err[len(f"fastformer {argv[0]}: error: ") : -1]


# run.json, checked whole


def test_the_table_covers_every_key_a_run_json_has(run_dir):
    """Every key `fastformer train` writes in run.json, and in each --resume's entry, is in
    RUN_JSON: a key left out would go unchecked."""
    info = json.loads((run_dir / "run.json").read_text())
    assert set(info) == set(RUN_JSON)
    assert len(info["resumed"]) == 1
    assert set(info["resumed"][0]) == {"from_epoch", "from_step", *SESSION}
    assert set(info["data_sha256"]) == set(RUN_JSON["data_sha256"])


# (the key named, the top-level key damaged, its new value): a value of a JSON type the key cannot
# have, for every key, then values of the right type out of range, and keys inside lists and objects
DAMAGED = [
    ("train", "train", 5),
    ("test", "test", ["test.txt"]),
    ("vocab", "vocab", 1.5),
    ("vocab_size", "vocab_size", "60"),
    ("config", "config", True),
    ("n_output", "n_output", 2.5),
    ("batch_size", "batch_size", "16"),
    ("lr", "lr", "3e-3"),
    ("warmup", "warmup", None),
    ("weight_decay", "weight_decay", []),
    ("bucket", "bucket", "yes"),
    ("seed", "seed", 1.0),
    ("fastformer", "fastformer", 1),
    ("epochs", "epochs", "2"),
    ("max_steps", "max_steps", "none"),
    ("device", "device", 0),
    ("backend", "backend", None),
    ("kernels", "kernels", []),
    ("amp", "amp", False),
    ("cuda_graphs", "cuda_graphs", "no"),
    ("compile", "compile", 0),
    ("pad_to_buckets", "pad_to_buckets", None),
    ("precompile", "precompile", 1),
    ("eager_because", "eager_because", 5),
    ("autotune", "autotune", "false"),
    ("world_size", "world_size", "1"),
    ("demo_data", "demo_data", "false"),
    ("dataset", "dataset", 1),
    ("label_names", "label_names", "negative positive"),
    ("data_sha256", "data_sha256", "3b0822e9aa9c"),
    ("resumed", "resumed", 5),
    ("vocab_sha256", "vocab_sha256", 12),
    ("config_sha256", "config_sha256", None),
    # the right type, out of range
    ("train", "train", ""),
    ("vocab_size", "vocab_size", 0),
    ("n_output", "n_output", -2),
    ("batch_size", "batch_size", 0),
    ("lr", "lr", -1e-3),
    ("lr", "lr", 10**400),  # an integer no float holds
    ("warmup", "warmup", 1.5),
    ("weight_decay", "weight_decay", -0.5),
    ("seed", "seed", -1),
    ("epochs", "epochs", 0),
    ("world_size", "world_size", 0),
    ("vocab_sha256", "vocab_sha256", "29c7f54e9daab3b9"),  # cut short
    # inside lists and objects
    ("data_sha256.train", "data_sha256", {"train": 5, "test": None}),
    ("data_sha256.test", "data_sha256", {"train": "0" * 64, "test": "not a digest"}),
    ("label_names[1]", "label_names", ["negative", 1]),
    ("resumed[0]", "resumed", ["epoch 2"]),
    ("resumed[0].from_epoch", "resumed", [{"from_epoch": "1", "from_step": 6}]),
    ("resumed[0].world_size", "resumed", [{"from_epoch": 1, "from_step": 6, "world_size": None}]),
]


@pytest.mark.parametrize("name, key, value", DAMAGED, ids=[f"{name}={value!r}"[:40] for name, _, value in DAMAGED])
def test_a_damaged_run_json_value_is_one_line_naming_it(run_dir, tmp_path, capsys, name, key, value):
    """--resume, evaluate and predict each refuse the run in one line: the run.json, the key (with
    where it is inside a list or object) and what it must be, before any of them reads it."""
    copy = with_run_json(run_dir, tmp_path, {key: value})
    for argv in readers(copy).values():
        err = one_line_error(capsys, argv)
        assert err.startswith(f"{copy / 'run.json'}: {name!r} "), err
        assert re.search(r"must be|is a fraction", err), err


@pytest.mark.parametrize("key", ["epochs", "demo_data", *RUN_OPTIONS])
def test_a_key_resume_needs_is_named_when_missing(run_dir, tmp_path, capsys, key):
    copy = with_run_json(run_dir, tmp_path, {key: _GONE})
    err = one_line_error(capsys, readers(copy)["resume"])
    assert err.startswith(f"{copy / 'run.json'} lacks {key!r} ("), err


def test_evaluate_without_test_names_the_test_key_it_lacks(run_dir, tmp_path, capsys):
    """Without --test, evaluate reads the run's test file from run.json: a run.json without the key
    is named, not taken for a run trained on a held-out split."""
    copy = with_run_json(run_dir, tmp_path, {"test": _GONE})
    err = one_line_error(capsys, readers(copy)["evaluate"])
    assert err.startswith(f"{copy / 'run.json'} lacks 'test' (a string or null)"), err


@pytest.mark.parametrize("names", [["negative"], ["negative", "positive", "neutral"]])
def test_label_names_that_are_not_one_a_class_are_refused(run_dir, tmp_path, capsys, names):
    """predict prints label_names[class]: a list of another length would name the wrong classes, or none."""
    copy = with_run_json(run_dir, tmp_path, {"label_names": names})
    err = one_line_error(capsys, readers(copy)["predict"])
    assert err == (
        f"{copy / 'run.json'}: 'label_names' has {len(names)} names, but the model has 2 classes "
        "(config.json's n_output): a name a class"
    )


def test_a_run_json_whose_classes_are_not_the_configs_is_refused(run_dir, tmp_path, capsys):
    copy = with_run_json(run_dir, tmp_path, {"n_output": 3})
    err = one_line_error(capsys, readers(copy)["evaluate"])
    assert err == (
        f"{copy / 'run.json'}: 'n_output' is 3, but config.json's n_output is 2: one of the two was changed "
        "after training"
    )


def test_a_key_the_table_does_not_know_is_read_past(run_dir, tmp_path, capsys):
    """A run.json of a newer fastformer, with a key this one does not know, is still read."""
    copy = with_run_json(run_dir, tmp_path, {"written_by_a_newer_fastformer": {"anything": [1, "two"]}})
    assert main(readers(copy)["predict"]) == 0


# --run last on a run that did not finish


def test_run_last_says_when_the_run_did_not_finish(files, tmp_path, monkeypatch, capsys):
    """A run stopped by --max-steps, after a whole epoch and then inside one, and a run still being
    trained: `--run last` follows runs/latest to it and says so in its line on stderr; a finished
    run gets the plain line. The hint to continue it quotes its path."""
    monkeypatch.chdir(tmp_path)
    out = os.path.join("runs", "my run")
    assert main(train_args(files, out, "--max-steps", "6")) == 0  # 3 epochs of 96 reviews at batch 16: 6 steps each
    assert "`fastformer train --resume 'runs/my run'` continues it" in capsys.readouterr().out
    assert main(["predict", "--run", "last", "--device", "cpu", "good"]) == 0
    assert capsys.readouterr().err == (
        "--run last: runs/my run: this run did not finish (stopped after epoch 1 of 3; its last checkpoint, "
        "checkpoint-1, is used)\n"
    )
    assert main(["train", "--resume", out, "--max-steps", "8"]) == 0
    capsys.readouterr()
    assert main(["evaluate", "--run", "last", "--device", "cpu"]) == 0
    assert capsys.readouterr().err.startswith(
        "--run last: runs/my run: this run did not finish (stopped after step 2 of epoch 2 of 3; its last "
        "checkpoint, checkpoint-2-step-2, is used)\n"
    )
    with writing(out, "--resume"):
        assert main(["predict", "--run", "last", "--device", "cpu", "good"]) == 0
        err = capsys.readouterr().err
    assert err.startswith(f"--run last: runs/my run: this run is still training (pid {os.getpid()} on "), err
    assert err.endswith("; its newest checkpoint is used (checkpoint-2-step-2)\n"), err
    assert main(["train", "--resume", out]) == 0
    capsys.readouterr()
    assert main(["predict", "--run", "last", "--device", "cpu", "good"]) == 0
    assert capsys.readouterr().err == "--run last: runs/my run\n"


# symlink loops


def test_a_symlink_loop_is_named_as_one(run_dir, tmp_path, monkeypatch, capsys):
    """runs/latest, --run DIR, a run's own file and --out, each a link that leads back to itself:
    "symlink loop", naming it, where os.path.exists alone would say "not found"."""
    monkeypatch.chdir(tmp_path)
    os.mkdir("runs")
    os.symlink("latest", os.path.join("runs", "latest"))
    err = one_line_error(capsys, ["predict", "--run", "last", "--device", "cpu", "good"])
    assert err == "--run last: runs/latest is a symlink loop: following its links comes back to a link"

    os.symlink("loop", "loop")
    err = one_line_error(capsys, ["evaluate", "--run", "loop", "--device", "cpu"])
    assert err == "run directory loop is a symlink loop: following its links comes back to a link"
    err = one_line_error(capsys, ["train", "--out", "loop", "--device", "cpu"])
    assert err == "--out loop is a symlink loop: following its links comes back to a link"
    assert os.path.islink("loop")

    for name, command in (("run.json", "resume"), ("model.pt", "predict")):
        copy = copy_of(run_dir, tmp_path, f"with-{name}")
        os.remove(copy / name)
        os.symlink(name, copy / name)
        err = one_line_error(capsys, readers(copy)[command])
        assert err == f"{copy / name} is a symlink loop: following its links comes back to a link"


# paths that are not UTF-8


def test_a_path_that_is_not_utf8_is_refused_up_front_naming_it(run_dir, files, tmp_path, capsys):
    """SentencePiece loads a vocab by a UTF-8 path: a run directory or vocab whose name has a byte
    that is not UTF-8 is refused before anything is read or written, naming its bytes."""
    bad = os.fsdecode(os.fsencode(str(tmp_path)) + b"/run\xff")
    shutil.copytree(run_dir, bad)
    shown = repr(os.fsencode(bad))
    for argv in readers(bad).values():
        err = one_line_error(capsys, argv)
        assert err == (
            f"the run directory path {shown} is not UTF-8: SentencePiece reads a vocab by a UTF-8 path, so the "
            "path of a run directory must be UTF-8; rename it"
        )

    new = bad + "new"
    err = one_line_error(capsys, train_args(files, new))
    assert err.startswith(f"the run directory path {os.fsencode(new)!r} is not UTF-8"), err
    assert not os.path.lexists(new)

    out = tmp_path / "out"
    vocab = os.path.join(bad, "vocab.model")
    err = one_line_error(capsys, [*train_args(files, out), "--vocab", vocab])
    assert err.startswith(f"the vocab file path {os.fsencode(vocab)!r} is not UTF-8"), err
    assert not out.exists()


# resume commands a shell reads back


@pytest.mark.parametrize(
    "path",
    ["runs/plain", "my runs/it's one", "two\nlines", "tab\there", "back\\slash", os.fsdecode(b"not utf-8 \xff")],
)
def test_shell_word_is_read_back_by_a_shell_as_the_path(path):
    word = shell_word(path)
    assert "\n" not in word
    if shutil.which("bash") is None:
        pytest.skip("no bash to read it back")
    printed = subprocess.run(["bash", "-c", f"printf %s {word}"], capture_output=True, check=True).stdout
    assert printed == os.fsencode(path)


def test_the_resume_hint_of_an_interrupted_run_quotes_its_path(files, tmp_path, monkeypatch, capsys):
    """Ctrl-C in epoch 2 of a run whose path has a space and a quote: the command the line gives
    continues that run when pasted into a shell."""

    def train_epoch(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real_train_epoch(*args, **kwargs)

    calls, real_train_epoch = [], job.train_epoch
    monkeypatch.setattr(job, "train_epoch", train_epoch)
    out = tmp_path / "it's a run"
    capsys.readouterr()
    assert main(train_args(files, out)) == 130
    line = capsys.readouterr().err.strip().splitlines()[-1].split("\r")[-1]
    command = re.search(r"`(fastformer train --resume .*)` continues$", line)
    assert command is not None, line
    assert shlex.split(command.group(1)) == ["fastformer", "train", "--resume", str(out)]


def test_a_world_size_hint_quotes_the_run(run_dir, tmp_path, capsys):
    copy = with_run_json(run_dir, tmp_path, {"world_size": 2}, "a run")
    err = one_line_error(capsys, readers(copy)["resume"])
    command = re.search(r"continue it with `(.*)`$", err)
    assert command is not None, err
    assert shlex.split(command.group(1))[-2:] == ["--resume", str(copy)]


# evaluate's advice on pieces of another vocab


def test_evaluate_advises_its_own_options_on_pieces_of_another_vocab(run_dir, tmp_path, capsys):
    rows = [json.dumps({"id": i, "doc": ["\u2581Wfilm", f"\u2581W{i}X"], "label": i % 2}) for i in range(20)]
    foreign = tmp_path / "foreign.json"
    foreign.write_text("\n".join(rows) + "\n")
    err = one_line_error(capsys, ["evaluate", "--run", str(run_dir), "--device", "cpu", "--test", str(foreign)])
    assert err.startswith(f"test file {foreign}: 100% of the SentencePiece pieces"), err
    assert err.endswith(
        "were they made with another vocab? evaluate reads them with the run's vocab.model: give --test a file "
        "of texts, or of its pieces"
    ), err
    assert "--vocab" not in err
