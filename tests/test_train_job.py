"""`fastformer train`, `evaluate` and `predict` end to end on a tiny separable set, on CPU."""

import contextlib
import dataclasses
import json
import os
import re
import shutil
from decimal import Decimal
from pathlib import Path

import pytest
import torch

from fastformer import Config, MovieClassification, kernels
from fastformer.cli import main
from fastformer.data import load_vocab
from fastformer.train import job, runtime
from fastformer.train.loop import adamw, predict_proba
from fastformer.train.run import DEFAULT_BATCH_SIZE, RUN_OPTIONS, TrainOptions
from tests import tutorial
from tests.helpers import TINY, pin_thread_count, tiny_job_files, train_args, write_reviews


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return tiny_job_files(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def run_dir(files):
    out = files["root"] / "run"
    assert main(train_args(files, out)) == 0
    return out


def test_train_learns_and_writes_a_complete_run_directory(run_dir):
    assert sorted(os.listdir(run_dir)) == [
        ".lock",
        "checkpoint-3",
        "config.json",
        "curves.png",
        "metrics.json",
        "model.pt",
        "run.json",
        "vocab.model",
    ]
    assert sorted(os.listdir(run_dir / "checkpoint-3")) == ["model.pt", "trainer.pt"]
    assert (run_dir / "model.pt").read_bytes() == (run_dir / "checkpoint-3" / "model.pt").read_bytes()
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert [e["epoch"] for e in metrics["epochs"]] == [1, 2, 3]
    assert metrics["test_accuracy"] == metrics["epochs"][-1]["test_accuracy"] >= 0.9  # chance is 0.5
    assert all(e["tokens_per_s"] > 0 for e in metrics["epochs"])
    # the time from the job's start to its first step done: in the epoch that took it
    first = [e["first_step_seconds"] for e in metrics["epochs"]]
    assert 0 < first[0] < metrics["epochs"][0]["seconds"] + 60 and first[1:] == [None, None]
    assert (run_dir / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert Config.load(run_dir / "config.json") == Config(TINY)


def test_one_frozen_run_goes_to_every_step_and_run_json_records_its_options(files, tmp_path, monkeypatch):
    """train settles one Run before any work (fastformer.train.run.settle) and its steps take it by
    name: frozen, so that no step changes what another reads; run.json records its RunOptions, the
    batch size the device settled included (the CPU's default, none given), and a resume settles
    the same options from run.json."""
    runs = []
    train_run = job._train
    monkeypatch.setattr(job, "_train", lambda run: runs.append(run) or train_run(run))
    out = tmp_path / "run"
    args = train_args(files, out, "--max-steps", "1")
    args.remove("--batch-size")
    args.remove("16")
    assert main(args) == 0
    run = runs[0]
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.amp = "fp16"
    recorded = json.loads((out / "run.json").read_text())
    assert {name: recorded[name] for name in RUN_OPTIONS} == dataclasses.asdict(run.options)
    assert run.options.batch_size == DEFAULT_BATCH_SIZE["cpu"] and run.options.lr == 3e-3
    assert main(["train", "--resume", str(out), "--max-steps", "2"]) == 0
    epochs = json.loads((out / "metrics.json").read_text())["epochs"]
    assert epochs[-1]["first_step_seconds"] > 0  # the resumed invocation's own first step
    assert runs[1].options == run.options and runs[1].checkpoint is not None


def test_the_steps_take_the_fused_adamw_and_a_resume_loads_its_state(files, tmp_path, monkeypatch):
    """Eager steps update the weights with AdamW's fused form (loop.adamw: one kernel per chunk of
    parameters), and a resume loads its state into another fused AdamW and steps on."""
    built = []
    monkeypatch.setattr(job, "adamw", lambda *args, **kwargs: built.append(adamw(*args, **kwargs)) or built[-1])
    out = tmp_path / "run"
    assert main(train_args(files, out, "--max-steps", "2")) == 0
    assert main(["train", "--resume", str(out), "--max-steps", "3"]) == 0
    assert [optimizer.defaults["fused"] for optimizer in built] == [True, True]
    assert {state["step"].item() for state in built[1].state.values()} == {3.0}


def test_a_run_written_before_the_fused_adamw_resumes_in_it(files, tmp_path, monkeypatch):
    """A checkpoint written before `fastformer train` took the fused AdamW holds torch's default form
    in its parameter groups, which load_state_dict brings back: the resumed run steps in the fused
    form all the same (loop.keep_form), under a GradScaler too, whose fused-only arguments the
    default form refuses."""
    built = []
    monkeypatch.setattr(job, "adamw", lambda *args, **kwargs: built.append(adamw(*args, **kwargs)) or built[-1])
    out = tmp_path / "run"
    assert main(train_args(files, out, "--epochs", "1", "--amp", "fp16")) == 0
    (trainer_file,) = out.glob("checkpoint-*/trainer.pt")
    trainer = torch.load(trainer_file, weights_only=False)
    for group in trainer["optimizer"]["param_groups"]:  # as the default form writes them
        group["fused"], group["foreach"] = None, None
    torch.save(trainer, trainer_file)
    assert main(["train", "--resume", str(out), "--epochs", "2", "--amp", "fp16"]) == 0
    assert all(group["fused"] is True for group in built[1].param_groups)
    assert [session["amp"] for session in json.loads((out / "run.json").read_text())["resumed"]] == ["fp16"]


def test_metrics_record_the_rate_of_each_epochs_first_and_last_step(run_dir):
    """metrics.json's `lr` is the rate of the epoch's first step (0.0 at the run's first: warm-up
    starts there) and `lr_end` that of its last: 3 epochs of 15 steps, lr 3e-3, warm-up 4 steps."""
    from fastformer.train.loop import linear_warmup_decay

    epochs = json.loads((run_dir / "metrics.json").read_text())["epochs"]
    rates = [rate for e in epochs for rate in (e["lr"], e["lr_end"])]
    expected = [3e-3 * linear_warmup_decay(step, 4, 45) for first in (0, 15, 30) for step in (first, first + 14)]
    assert rates == pytest.approx(expected) and rates[0] == 0.0 and rates[1] > 0


def test_saved_run_reloads_and_predicts_the_same(run_dir, files):
    """Config.load + MovieClassification + model.pt give the predictions of the trained model, and
    the tutorial's own classes load the checkpoint strictly and agree."""
    config = Config.load(run_dir / "config.json")
    vocab = load_vocab(str(run_dir / "vocab.model"))
    state = torch.load(run_dir / "model.pt")
    model = MovieClassification(config)
    model.load_state_dict(state, strict=True)
    texts = ["the film was great lovely", "the film was awful dull boring", "the film was good"]
    probs = predict_proba(model, vocab, texts, device="cpu")
    assert probs.argmax(1).tolist() == [1, 0, 1]

    theirs = tutorial.MovieClassification(config)
    theirs.load_state_dict(state, strict=True)
    theirs.eval()
    enc = torch.tensor([vocab.encode_as_ids(texts[0])])
    with torch.no_grad():
        torch.testing.assert_close(theirs(enc, torch.tensor([[2]]))[0].softmax(-1), probs[:1], rtol=0, atol=1e-5)


@pytest.mark.parametrize("text", ["", "   \t "])
def test_predict_refuses_an_empty_text(run_dir, text, capsys):
    capsys.readouterr()
    assert main(["predict", "--run", str(run_dir), "--device", "cpu", "the film was good", text]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert (
        err == f"fastformer predict: error: text 2 of 2 ({text!r}) is empty or only whitespace: nothing to classify\n"
    )


@pytest.mark.parametrize("text", ["\U0001f600\U0001f600\U0001f600", "\u611f\u52d5\u7684\u306a\u6620\u753b"])
def test_predict_refuses_a_text_with_no_piece_the_vocab_knows(run_dir, text, capsys):
    """Emoji, or a script the vocab never saw, encode as [UNK] after a word-boundary mark: the
    model would read nothing it knows and still answer, so the text is refused as a blank one."""
    capsys.readouterr()
    assert main(["predict", "--run", str(run_dir), "--device", "cpu", "the film was good", text]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err == (
        f"fastformer predict: error: text 2 of 2 ({text!r}) has no piece the run's vocab knows: the model would "
        "read [UNK] only; nothing to classify\n"
    )
    with pytest.raises(ValueError, match="has no piece the run's vocab knows"):
        job.predict(run=run_dir, texts=text, device="cpu", log=None)
    assert job.predict(run=run_dir, texts=f"the film was good {text}", device="cpu", log=None)  # known pieces too


def test_job_predict_takes_a_str_as_one_text_and_reads_an_iterable_once(run_dir):
    one = job.predict(run=run_dir, texts="the film was great lovely", device="cpu", log=lambda *a: None)
    assert len(one) == 1 and one[0][0] == "positive"
    texts = ["the film was great lovely", "the film was awful dull boring"]
    as_list = job.predict(run=run_dir, texts=texts, device="cpu", log=lambda *a: None)
    as_generator = job.predict(run=run_dir, texts=(t for t in texts), device="cpu", log=lambda *a: None)
    assert as_generator == as_list and [label for label, _ in as_list] == ["positive", "negative"]
    for bad, message in (
        (b"great", "texts must be a str or an iterable of str, got bytes"),
        (3, "got int"),
        (["great", 3], "text 2 of 2 is a int, not a str"),
    ):
        with pytest.raises(TypeError, match=re.escape(message)):
            job.predict(run=run_dir, texts=bad, device="cpu", log=lambda *a: None)


def test_log_none_is_quiet_and_a_number_that_is_not_a_float_is_named(files, tmp_path, capsys):
    """job.train(log=None) writes no line to stdout (the epochs' lines go through `log` too); a
    `log` that cannot be called, and an lr, weight decay or warmup that is a Decimal or a str, are
    refused with their type named, before anything is written."""
    capsys.readouterr()
    out = tmp_path / "quiet"
    job.train(
        train=files["train"],
        test=files["test"],
        config=files["config"],
        vocab_size=60,
        epochs=1,
        batch_size=16,
        device="cpu",
        out=str(out),
        log=None,
    )
    assert capsys.readouterr().out == "" and (out / "model.pt").exists()
    with pytest.raises(TypeError, match="log must be a callable taking a line of text, or None, got str"):
        job.train(train=files["train"], out=str(tmp_path / "never"), log="quiet")
    for name, value in (("lr", Decimal("0.001")), ("weight_decay", "0.01"), ("warmup", Decimal("0.1"))):
        flag = "--" + name.replace("_", "-")
        with pytest.raises(
            ValueError, match=re.escape(f"{flag} must be a float, got {value!r} (a {type(value).__name__})")
        ):
            job.train(train=files["train"], out=str(tmp_path / "never"), **{name: value})
    assert not (tmp_path / "never").exists()


@pytest.mark.parametrize("name", [field.name for field in dataclasses.fields(TrainOptions)])
def test_every_option_refuses_a_value_of_no_kind_it_takes_naming_itself(name):
    """Each TrainOptions field declares its check with its flag: a value of no kind any option
    takes is refused in one line that starts with the option's flag (--backend for backend_name)."""
    flag = "--backend" if name == "backend_name" else "--" + name.replace("_", "-")
    with pytest.raises(ValueError, match=f"^{re.escape(flag)}[ :]") as refused:
        TrainOptions(**{name: object()}).checked()
    assert "\n" not in str(refused.value)
    assert TrainOptions(**{name: None}).checked() == TrainOptions(**{name: None})  # None: not given


def test_numbers_of_other_types_become_pythons_own():
    """TrainOptions.checked: a NumPy integer or float that passes its check becomes an int or a float
    (run.json and torch take those); Python's own values, bools, strings and None stay as they are."""
    import numpy as np

    given = TrainOptions(epochs=np.int64(3), lr=np.float32(0.5), warmup=0.25, bucket=False, train="t.tsv")
    options = given.checked()
    assert (type(options.epochs), options.epochs) == (int, 3)
    assert (type(options.lr), options.lr) == (float, 0.5)
    assert (options.warmup, options.bucket, options.train, options.seed) == (0.25, False, "t.tsv", None)


def test_predict_into_a_pipe_closed_early_ends_quietly(run_dir, capsys):
    """`fastformer predict ... | head -0`: the reader is gone before the first line; no error is
    printed and the status is SIGPIPE's (128 + 13), as for a command that SIGPIPE ended."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    capsys.readouterr()
    with open(write_end, "w", buffering=1) as pipe, contextlib.redirect_stdout(pipe):
        status = main(["predict", "--run", str(run_dir), "--device", "cpu", "the film was good"])
    assert status == 141
    assert capsys.readouterr().err == ""


def test_evaluate_and_predict_commands(run_dir, files, capsys):
    capsys.readouterr()
    assert main(["evaluate", "--run", str(run_dir), "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    accuracy = json.loads((run_dir / "metrics.json").read_text())["test_accuracy"]
    assert f"accuracy {accuracy:.4f}" in out and "on 60 reviews" in out
    assert out.rstrip().endswith("; eager") and "CUDA" not in out  # on a CPU, nothing to say of CUDA graphs
    assert main(["evaluate", "--run", str(run_dir), "--device", "cpu", "--cuda-graphs"]) == 2
    err = capsys.readouterr().err
    assert "--cuda-graphs cannot run here: CUDA graphs need a CUDA device" in err and err.count("\n") == 1, err
    assert (
        main(["predict", "--run", str(run_dir), "--device", "cpu", "the film was superb nice", "the film was poor"])
        == 0
    )
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].split()[0] == "positive" and lines[1].split()[0] == "negative"


def test_evaluate_on_the_runs_own_train_file_warns_that_it_is_no_test(run_dir, files, tmp_path, capsys):
    """The run's train file, or a copy of its bytes, given as --test: one warning line, naming it."""
    copy = tmp_path / "copy.txt"
    copy.write_bytes(Path(files["train"]).read_bytes())
    capsys.readouterr()
    for test in (files["train"], copy):
        assert main(["evaluate", "--run", str(run_dir), "--device", "cpu", "--test", str(test)]) == 0
        (line,) = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
        assert line.startswith("fastformer evaluate: warning: --test ") and "the file the run trained on" in line
    assert main(["evaluate", "--run", str(run_dir), "--device", "cpu", "--test", str(files["test"])]) == 0
    assert "warning" not in capsys.readouterr().err


def test_evaluate_reads_its_test_file_before_it_loads_the_model(run_dir, tmp_path, monkeypatch, capsys):
    from fastformer.train import job

    def not_yet(*args):
        raise AssertionError("the model loaded before --test was read")

    monkeypatch.setattr(job, "load_run", not_yet)
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    assert main(["evaluate", "--run", str(run_dir), "--device", "cpu", "--test", str(empty)]) == 2
    assert capsys.readouterr().err == f"fastformer evaluate: error: test file {empty} is empty\n"


def test_runs_latest_links_the_run_train_started_last_and_run_last_reads_it(
    run_dir, files, tmp_path, monkeypatch, capsys
):
    """`fastformer train` into runs/ links runs/latest to the run it starts or resumes (relative, so
    the folder may move); `--run last` and job's run="last" read that run and say which; with no
    runs/latest, one line and status 2; a run under another folder leaves the link alone, and a
    directory named `last` in the working directory is itself."""
    monkeypatch.chdir(tmp_path)
    assert main(["predict", "--run", "last", "--device", "cpu", "the film was good"]) == 2
    assert "no runs/latest" in capsys.readouterr().err
    first, second = os.path.join("runs", "first"), os.path.join("runs", "second")
    assert main(train_args(files, first, "--epochs", "1")) == 0
    assert os.readlink(os.path.join("runs", "latest")) == "first"
    assert main(train_args(files, second, "--epochs", "1")) == 0
    assert os.readlink(os.path.join("runs", "latest")) == "second"
    assert main(train_args(files, tmp_path / "elsewhere", "--epochs", "1")) == 0
    assert os.readlink(os.path.join("runs", "latest")) == "second"
    capsys.readouterr()
    assert main(["evaluate", "--run", "last", "--device", "cpu"]) == 0
    captured = capsys.readouterr()
    assert captured.err.splitlines()[0] == f"--run last: {second}" and "accuracy" in captured.out
    assert main(["train", "--resume", first, "--epochs", "2", "--device", "cpu"]) == 0
    assert os.readlink(os.path.join("runs", "latest")) == "first"
    capsys.readouterr()
    results = job.predict(run="last", texts="the film was superb nice", device="cpu")
    assert capsys.readouterr().out.splitlines()[0] == f"run {first} (runs/latest)"
    assert results[0][0] == "positive"
    assert sorted(os.listdir("runs")) == ["first", "latest", "second"]  # no temporary link left
    shutil.copytree(run_dir, tmp_path / "last")  # a run directory named `last` here is itself
    assert main(["predict", "--run", "last", "--device", "cpu", "the film was good"]) == 0
    assert "--run last:" not in capsys.readouterr().err


def test_resume_continues_to_more_epochs(run_dir, files, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    # options equal to the run's may be repeated
    same = ["--lr", "3e-3", "--config", files["config"]]
    assert main(["train", "--resume", str(copy), "--epochs", "4", *same, "--device", "cpu"]) == 0
    metrics = json.loads((copy / "metrics.json").read_text())
    assert [e["epoch"] for e in metrics["epochs"]] == [1, 2, 3, 4]
    assert metrics["epochs"][3]["steps"] == 4 * 240 // 16
    run = json.loads((copy / "run.json").read_text())
    assert (run["epochs"], run["lr"], run["resumed"][0]["from_epoch"], run["resumed"][0]["epochs"]) == (4, 3e-3, 3, 4)
    assert main(["train", "--resume", str(copy), "--epochs", "4", "--device", "cpu"]) == 2  # nothing left to do


def test_resume_refuses_options_that_differ_from_the_run(run_dir, files, tmp_path, capsys):
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    other_config = tmp_path / "other.json"
    other_config.write_text(json.dumps(dict(TINY, d_ff=128)))
    run_json = (copy / "run.json").read_bytes()
    args = [
        "train",
        "--resume",
        str(copy),
        "--epochs",
        "4",
        "--lr",
        "1e-3",
        "--seed",
        "3",
        "--config",
        str(other_config),
    ]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"fastformer train: error: --resume {copy}: --config {other_config}, --lr 0.001, --seed 3 differ from the "
        f"run's (config {files['config']}, lr 0.003, seed 0); leave them out to continue the run as it started, "
        "or start a new run"
    )
    assert (copy / "run.json").read_bytes() == run_json
    assert sorted(os.listdir(copy)) == sorted(os.listdir(run_dir))


def test_max_steps_and_held_out_split(files, tmp_path, capsys):
    out = tmp_path / "run"
    args = [
        "train",
        "--train",
        files["train"],
        "--config",
        files["config"],
        "--vocab-size",
        "60",
        "--epochs",
        "2",
        "--batch-size",
        "16",
        "--max-steps",
        "5",
        "--device",
        "cpu",
        "--out",
        str(out),
        "--no-bucket",
    ]
    assert main(args) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert [e["steps"] for e in metrics["epochs"]] == [5]
    stdout = capsys.readouterr().out
    assert "216 train / 24 test reviews" in stdout  # 10% of --train held out
    assert re.search(r"  device   cpu, \d+ CPU thread\(s\), reference kernels", stdout), stdout


def test_default_run_uses_the_embedded_demo_set(tmp_path, capsys):
    """`fastformer train` with no data arguments (cut to 3 steps here; the full default run is the
    README's Quick start)."""
    out = tmp_path / "demo"
    assert main(["train", "--max-steps", "3", "--vocab-size", "300", "--device", "cpu", "--out", str(out)]) == 0
    stdout = capsys.readouterr().out
    assert "4000 train / 1000 test reviews (the embedded demo set)" in stdout
    config = Config.load(out / "config.json")
    assert (config.n_layer, config.d_hidn, config.n_enc_vocab) == (
        3,
        128,
        load_vocab(str(out / "vocab.model")).get_piece_size(),
    )


@pytest.mark.parametrize(
    "call",
    [
        lambda: job.train(epochs=0),
        lambda: job.train(TrainOptions(epochs=0)),
        lambda: job.train(TrainOptions(epochs=3), epochs=0),  # keywords override the fields of the options
    ],
    ids=["keywords", "options", "options-and-keywords"],
)
def test_train_takes_train_options_or_their_fields_as_keywords(call):
    with pytest.raises(ValueError, match=r"^--epochs must be positive, got 0$"):
        call()
    with pytest.raises(TypeError, match="epoch"):
        job.train(TrainOptions(), epoch=3)


def bad_input_cases(files, root):
    """(arguments, message, whether the vocab is trained before the error) per case."""
    wrong_columns = root / "wrong_columns.txt"
    wrong_columns.write_text("id\ttext\tlabel\n1\tgood\t1\n")
    empty = root / "empty.txt"
    empty.write_text("id\tdocument\tlabel\n")
    latin1 = root / "latin1.txt"
    latin1.write_bytes("id\tdocument\tlabel\n1\tgood\t1\n2\tnot bad, café\t1\n".encode("latin-1"))
    three_labels = write_reviews(root / "three.txt", 30, seed=2, labels=(0, 1, 2))
    huge_label = write_reviews(root / "huge.txt", 30, seed=2, labels=(0, 1, 99999999))
    negative_label = write_reviews(root / "negative.txt", 30, seed=2, labels=(0, 1, -1))
    configs = {
        "small_vocab": dict(TINY, n_enc_vocab=20, n_dec_vocab=20),
        "fractional": dict(TINY, d_ff=64.5),
        "no_layers": {k: v for k, v in TINY.items() if k != "n_layer"},
    }
    for name, config in configs.items():
        (root / f"{name}.json").write_text(json.dumps(config))
    (root / "not_json.json").write_text("n_layer = 1\n")
    a_file = root / "a_file"
    a_file.write_text("")
    train = ["--train", files["train"]]
    return [
        (["--train", str(root / "missing.txt")], "train file not found", False),
        (["--train", str(wrong_columns)], "expected a TSV header with columns id, document, label", False),
        (["--train", str(empty)], "has no reviews", False),
        (["--train", str(latin1)], f"{latin1} line 3: not UTF-8 (byte 0xe9)", False),
        (["--train", three_labels, "--config", files["config"]], "has label 2, outside the 2 classes 0..1", False),
        (
            ["--train", three_labels],
            f"train file {three_labels} line 4: review 2 has label 2, outside the 2 classes 0..1; "
            "pass --n-output with the number of classes, or --n-output auto",
            False,
        ),
        (
            ["--train", huge_label, "--n-output", "auto"],
            f"train file {huge_label}: labels go up to 99999999 but no review has label 2, 3, 4 or 99999994 more",
            False,
        ),
        (["--train", negative_label, "--n-output", "auto"], "line 4: review 2 has label -1", False),
        ([*train, "--test", three_labels], f"test file {three_labels} line 4: review 2 has label 2", False),
        ([*train, "--config", str(root / "small_vocab.json")], "config.n_enc_vocab is 20", False),
        (
            [*train, "--config", str(root / "fractional.json")],
            "config.d_ff must be a positive integer, got 64.5",
            False,
        ),
        ([*train, "--config", str(root / "no_layers.json")], "no_layers.json: config is missing n_layer", False),
        ([*train, "--config", str(root / "not_json.json")], "not_json.json: not a JSON config (Expecting value", False),
        ([*train, "--config", str(root / "nope.json")], "config file not found", False),
        ([*train, "--vocab", str(root / "nope.model")], "vocab file not found", False),
        ([*train, "--out", str(a_file)], f"--out {a_file} is a file, not a directory", False),
        ([*train, "--out", str(a_file / "run")], f"cannot create it, {a_file} is not a writable directory", False),
        ([*train, "--epochs", "0"], "--epochs must be positive", False),
        ([*train, "--lr", "inf"], "--lr must be a finite number, got inf", False),
        ([*train, "--n-output", "0"], "argument --n-output: must be a positive integer or auto, got '0'", False),
        (
            [*train, "--vocab-size", "1"],
            "a vocab of 1 pieces is too small for this corpus: its characters alone need",
            True,
        ),
    ]


def test_bad_input_is_one_line_exit_2_and_no_run_directory(files, tmp_path, capsys):
    """Every input is checked before the vocab is trained (the long part), except the vocab size."""
    for args, message, trains_vocab in bad_input_cases(files, tmp_path):
        out = tmp_path / "run"
        try:
            code = main(["train", "--vocab-size", "60", "--device", "cpu", "--out", str(out), *args])
        except SystemExit as usage_error:
            code = usage_error.code
        stdout, err = capsys.readouterr()
        err = err.strip()
        assert code == 2, args
        assert message in err and err.startswith("fastformer train: error:") and "\n" not in err, (args, err)
        assert ("Training a BPE vocab" in stdout) == trains_vocab, args
        assert not out.exists(), args


@pytest.mark.parametrize("given_config", [True, False])
def test_a_model_too_large_for_the_device_is_one_line_and_no_run_directory(
    files, tmp_path, monkeypatch, capsys, given_config
):
    """The model's fit in the device's memory is checked once: a config given before any work, the
    default config once its vocab is trained (its size sets the embeddings'); either way one line,
    exit 2, nothing written."""
    monkeypatch.setattr(runtime, "device_memory", lambda device: 2**10)
    out = tmp_path / "run"
    args = ["train", "--train", files["train"], "--test", files["test"], "--vocab-size", "60", "--device", "cpu"]
    code = main([*args, *(["--config", files["config"]] if given_config else []), "--out", str(out)])
    stdout, err = capsys.readouterr()
    assert code == 2
    assert err.startswith("fastformer train: error:") and err.count("\n") == 1, err
    assert "more than this machine's memory (1.0 KiB)" in err, err
    assert ("Training a BPE vocab" in stdout) != given_config
    assert not out.exists()


def test_n_output_auto_infers_the_classes(files, tmp_path):
    out = tmp_path / "run"
    three_labels = write_reviews(tmp_path / "three.txt", 60, seed=2, labels=(0, 1, 2))
    args = [
        "train",
        "--train",
        three_labels,
        "--n-output",
        "auto",
        "--config",
        files["config"],
        "--vocab-size",
        "60",
        "--max-steps",
        "2",
        "--device",
        "cpu",
        "--out",
        str(out),
    ]
    assert main(args) == 0
    assert Config.load(out / "config.json").n_output == 3
    run = json.loads((out / "run.json").read_text())
    assert (run["n_output"], run["label_names"]) == (3, ["0", "1", "2"])


def test_an_unknown_config_key_is_a_one_line_warning(files, tmp_path, monkeypatch, capsys):
    import fastformer.config

    monkeypatch.setattr(fastformer.config, "_warned_keys", set())
    config = tmp_path / "typo.json"
    config.write_text(json.dumps(dict(TINY, n_heads=4)))
    args = [
        "train",
        "--train",
        files["train"],
        "--test",
        files["test"],
        "--config",
        str(config),
        "--vocab-size",
        "60",
        "--max-steps",
        "1",
        "--device",
        "cpu",
        "--out",
        str(tmp_path / "run"),
    ]
    assert main(args) == 0
    warnings = [line for line in capsys.readouterr().err.split("\n") if "warning" in line]
    assert warnings == [
        "fastformer train: warning: config key 'n_heads' is not one fastformer reads "
        "(did you mean 'n_head'?); it is ignored"
    ]


def test_a_loss_that_becomes_nan_stops_training_with_exit_1(files, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(train_args(files, out, "--lr", "1e10", "--warmup", "0")) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1].split("\r")[-1]
    assert re.fullmatch(
        r"fastformer train: error: the loss is (nan|inf) at step \d+ of epoch 1 \(step \d+ of the run\): training "
        r"stopped; no checkpoint yet \(the first epoch did not end\)",
        err,
    ), err
    # resumable, or replaced by a rerun
    assert sorted(os.listdir(out)) == [".lock", "config.json", "run.json", "vocab.model"]


class NanAtBatch:
    """A loader that sets the model's output weights to NaN before its n-th batch."""

    def __init__(self, loader, model, batch):
        self.loader, self.model, self.batch = loader, model, batch

    def __len__(self):
        return len(self.loader)

    def __iter__(self):
        for i, batch in enumerate(self.loader, start=1):
            if i == self.batch:
                with torch.no_grad():
                    self.model.projection.weight.fill_(float("nan"))
            yield batch


def test_a_nan_loss_keeps_the_last_good_checkpoint(files, tmp_path, monkeypatch, capsys):
    epochs = []

    def train_epoch(model, loader, *args, **kwargs):
        epochs.append(loader)
        if len(epochs) == 2:
            loader = NanAtBatch(loader, model, batch=4)
        return real_train_epoch(model, loader, *args, **kwargs)

    real_train_epoch = job.train_epoch
    monkeypatch.setattr(job, "train_epoch", train_epoch)
    out = tmp_path / "run"
    assert main(train_args(files, out)) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1].split("\r")[-1]
    assert err == (
        "fastformer train: error: the loss is nan at step 4 of epoch 2 (step 19 of the run): training stopped; "
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
    state = torch.load(out / "model.pt")
    assert all(torch.isfinite(v).all() for v in state.values())
    assert [e["epoch"] for e in json.loads((out / "metrics.json").read_text())["epochs"]] == [1]


def damage(path, how):
    if how == "empty":
        path.write_bytes(b"")
    else:  # truncated to half
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])


@pytest.mark.parametrize(
    "name, how, command, message",
    [
        ("model.pt", "empty", "evaluate", "model.pt is empty (0 bytes)"),
        ("model.pt", "truncated", "predict", "model.pt ({size} bytes) is not a readable PyTorch checkpoint: truncated"),
        ("checkpoint-3/trainer.pt", "empty", "resume", "trainer.pt is empty (0 bytes)"),
        (
            "checkpoint-3/trainer.pt",
            "truncated",
            "resume",
            "trainer.pt ({size} bytes) is not a readable PyTorch checkpoint",
        ),
        (
            "checkpoint-3/model.pt",
            "truncated",
            "resume",
            "checkpoint-3/model.pt ({size} bytes) is not a readable PyTorch",
        ),
        ("run.json", "truncated", "evaluate", "run.json: not a JSON run file ("),
        ("run.json", "empty", "resume", "run.json: not a JSON run file (the file is empty)"),
        ("config.json", "empty", "predict", "config.json: not a JSON config (the file is empty)"),
        ("config.json", "truncated", "resume", "config.json: not a JSON config"),
        ("vocab.model", "truncated", "predict", "vocab.model is not a SentencePiece model"),
    ],
)
def test_damaged_run_files_are_one_line_exit_2(run_dir, tmp_path, capsys, name, how, command, message):
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    damage(copy / name, how)
    args = {
        "evaluate": ["evaluate", "--run", str(copy), "--device", "cpu"],
        "predict": ["predict", "--run", str(copy), "--device", "cpu", "the film was good"],
        "resume": ["train", "--resume", str(copy), "--epochs", "4", "--device", "cpu"],
    }[command]
    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"fastformer {args[0]}: error: {copy}/") and err.count("\n") == 1, err
    assert message.format(size=(copy / name).stat().st_size) in err, err


def test_a_checkpoint_that_does_not_fit_the_config_is_one_line(run_dir, tmp_path, capsys):
    """A model.pt of another model (a wider FFN) in place of the run's (a changed config.json is
    refused before: run.json pins it)."""
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    config = Config(**json.loads((copy / "config.json").read_text()))
    config.d_ff = 128
    torch.save(MovieClassification(config).state_dict(), copy / "model.pt")
    capsys.readouterr()
    assert main(["evaluate", "--run", str(copy), "--device", "cpu"]) == 2
    assert capsys.readouterr().err == (
        f"fastformer evaluate: error: {copy}/model.pt does not fit config.json: "
        "transformer.encoder.layers.0.pos_ffn.conv1.weight has shape (128, 32, 1), the config needs (64, 32, 1)\n"
    )


def test_existing_output_directory_is_not_overwritten(run_dir, files, capsys):
    assert main(train_args(files, run_dir)) == 2
    assert "exists and is not empty" in capsys.readouterr().err
    assert main(["evaluate", "--run", str(files["root"] / "nowhere")]) == 2
    assert "run directory not found" in capsys.readouterr().err
    assert os.path.isfile(run_dir / "model.pt")


@pytest.mark.parametrize(
    "extra", [["--amp", "bf16"], ["--amp", "fp16"], ["--backend", "triton"]], ids=["bf16", "fp16", "triton"]
)
def test_train_runs_under_autocast_and_on_the_kernels(files, tmp_path, extra):
    """A few steps with autocast (fp16 through the GradScaler) and on the Triton kernels (the
    interpreter on CPU: one step of a batch of 4 and a test set of 4, since the interpreter's time
    grows with the batch)."""
    out = tmp_path / "run"
    if extra[0] == "--backend":
        small_test = write_reviews(tmp_path / "small_test.txt", 4, seed=3)
        extra = [*extra, "--max-steps", "1", "--batch-size", "4", "--test", small_test]
    assert main(train_args(files, out, "--max-steps", "3", *extra)) == 0
    run = json.loads((out / "run.json").read_text())
    metrics = json.loads((out / "metrics.json").read_text())
    assert all(torch.isfinite(torch.tensor(e["train_loss"])) for e in metrics["epochs"])
    if extra[0] == "--amp":
        assert run["amp"] == extra[1]
    else:
        assert run["kernels"] == "triton"


@pytest.mark.parametrize("load, expected", [(0.1, 8), (2.6, 5), (7.9, 1), (30.0, 1)])
def test_cpu_threads_take_the_cores_that_are_not_busy(monkeypatch, load, expected):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    monkeypatch.setattr(os, "getloadavg", lambda: (load, 0.0, 0.0), raising=False)
    assert runtime.cpu_threads() == expected


def test_compile_runs_the_model_through_torch_compile_fullgraph(files, tmp_path, monkeypatch):
    """--compile hands the model to torch.compile(model, fullgraph=True) for training and evaluation.
    On a CPU with the reference kernels Inductor takes about a minute to compile even this tiny
    model, so here Dynamo traces it (fullgraph: a graph break fails) and its "eager" backend runs
    the traced ops: the run must end with the weights and metrics of an eager run, bit for bit."""
    pin_thread_count(monkeypatch)  # the two runs' weights are compared bit for bit
    compiled = []
    real_compile = torch.compile

    def traced_only(model, **options):
        compiled.append(options)
        return real_compile(model, backend="eager", **options)

    monkeypatch.setattr(torch, "compile", traced_only)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    args = ("--epochs", "1")
    assert main(train_args(files, tmp_path / "compiled", "--compile", *args)) == 0
    assert compiled == [{"fullgraph": True}]
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 2  # train mode and eval mode at least
    assert main(train_args(files, tmp_path / "eager", *args)) == 0
    runs = {name: json.loads((tmp_path / name / "run.json").read_text()) for name in ("compiled", "eager")}
    assert (runs["compiled"]["compile"], runs["eager"]["compile"]) == (True, False)
    metrics = [json.loads((tmp_path / name / "metrics.json").read_text())["epochs"] for name in ("compiled", "eager")]
    keys = ("train_loss", "train_accuracy", "test_loss", "test_accuracy")
    assert [[e[k] for k in keys] for e in metrics[0]] == [[e[k] for k in keys] for e in metrics[1]]
    ours, theirs = torch.load(tmp_path / "compiled" / "model.pt"), torch.load(tmp_path / "eager" / "model.pt")
    for name in theirs:
        torch.testing.assert_close(ours[name], theirs[name], rtol=0, atol=0, msg=name)


def test_pad_to_buckets_is_recorded_and_may_change_on_resume(files, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(train_args(files, out, "--epochs", "1", "--pad-to-buckets")) == 0
    assert "amp off, eager steps, padded to multiples of 16\n" in capsys.readouterr().out
    assert main(["train", "--resume", str(out), "--epochs", "2", "--device", "cpu"]) == 0
    run = json.loads((out / "run.json").read_text())
    assert (run["pad_to_buckets"], run["cuda_graphs"], run["compile"]) == (True, False, False)
    assert [r["pad_to_buckets"] for r in run["resumed"]] == [False]


def test_pad_to_buckets_precompiles_the_shapes_of_the_data(files, tmp_path, monkeypatch, capsys):
    """--pad-to-buckets knows the batch shapes, so the job compiles their kernels before the first
    step (the compiling itself: tests/test_warmup.py); --no-precompile leaves it to the steps.
    --autotune holds for the job only, and the attention backward's two passes (bitwise repeatable,
    for --resume) for the whole job."""
    calls = []

    def warm_up(model, shapes, *, device, amp, progress):
        calls.append(
            {
                "shapes": shapes,
                "device": str(device),
                "amp": amp,
                "autotune": kernels.autotune_enabled(),
                "backward": kernels.attention_backward_choice(),
                "trained": any(p.grad is not None for p in model.parameters()),
            }
        )
        return {"shapes": len(shapes), "seconds": 0.0}

    monkeypatch.setattr(job, "warm_up", warm_up)
    out = tmp_path / "run"
    assert main(train_args(files, out, "--epochs", "1", "--pad-to-buckets", "--autotune", "--batch-size", "8")) == 0
    assert not kernels.autotune_enabled()
    assert len(calls) == 1 and calls[0]["device"] == "cpu" and calls[0]["amp"] == "off"
    assert calls[0]["autotune"] and not calls[0]["trained"]
    assert calls[0]["backward"] == "two-pass" and kernels.attention_backward_choice() == "auto"
    assert calls[0]["shapes"] == [
        (8, TINY["n_enc_seq"])
    ]  # every review's bucket is n_enc_seq's (which bucket_shapes' test covers)
    assert f"compiled the kernels of {len(calls[0]['shapes'])} batch shapes" in capsys.readouterr().out
    assert main(train_args(files, tmp_path / "eager", "--epochs", "1", "--pad-to-buckets", "--no-precompile")) == 0
    assert main(train_args(files, tmp_path / "unpadded", "--epochs", "1")) == 0
    assert len(calls) == 1


@pytest.mark.cuda
def test_compile_on_cuda_trains(files, tmp_path):
    """The real thing on a GPU: Inductor over the Triton kernels' registered ops, under bf16."""
    out = tmp_path / "run"
    torch._dynamo.reset()
    assert main(train_args(files, out, "--device", "cuda", "--compile")) == 0
    assert json.loads((out / "run.json").read_text())["compile"] is True
    assert json.loads((out / "metrics.json").read_text())["test_accuracy"] >= 0.9  # chance is 0.5


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("epochs", "2", """'epochs' must be an integer, got "2" (a string)"""),
        ("lr", True, "'lr' must be a number, got true (true or false)"),
        ("bucket", 1, "'bucket' must be true or false, got 1 (an integer)"),
    ],
)
def test_a_run_json_value_of_the_wrong_type_is_named(run_dir, tmp_path, key, value, message, capsys):
    """A run.json edited by hand: --resume, evaluate and predict name the key, the JSON type it has
    and the one it must have, in one line, exit 2."""
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    info = json.loads((copy / "run.json").read_text())
    info[key] = value
    (copy / "run.json").write_text(json.dumps(info))
    capsys.readouterr()
    for argv in (["train", "--resume", str(copy)], ["predict", "--run", str(copy), "--device", "cpu", "good"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"{copy / 'run.json'}: {message}" in err, err


def test_jsonl_pieces_of_another_vocab_are_refused_naming_the_share(run_dir, files, tmp_path, capsys):
    """The tutorial's JSONL holds pieces: made by another vocab than the one given, nearly all of
    them would be [UNK] and training would reach chance. Train and evaluate refuse them, saying
    how many are unknown; the run's own vocab's pieces are taken."""
    vocab = load_vocab(str(run_dir / "vocab.model"))
    rows = [(i, f"the film was {'good great' if i % 2 else 'bad awful'}", i % 2) for i in range(40)]

    def jsonl(path, pieces):
        lines = [json.dumps({"id": i, "doc": pieces(text), "label": label}) for i, text, label in rows]
        path.write_text("\n".join(lines) + "\n")
        return str(path)

    own = jsonl(tmp_path / "own.json", vocab.encode_as_pieces)
    foreign = jsonl(tmp_path / "foreign.json", lambda text: [f"\u2581W{word}X" for word in text.split()])
    out = tmp_path / "r"
    args = ["--vocab", str(run_dir / "vocab.model"), "--config", files["config"], "--device", "cpu", "--out", str(out)]
    capsys.readouterr()
    assert main(["train", "--train", foreign, "--test", files["test"], *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1].split("\r")[-1]
    assert err.startswith("fastformer train: error: the train reviews: 100% of the SentencePiece pieces (200 of 200: ")
    assert err.endswith("were they made with another vocab? Give the one they were tokenized with (--vocab)")
    assert not out.exists()
    assert main(["evaluate", "--run", str(run_dir), "--device", "cpu", "--test", foreign]) == 2
    assert f"test file {foreign}: 100% of the SentencePiece pieces" in capsys.readouterr().err
    assert main(["evaluate", "--run", str(run_dir), "--device", "cpu", "--test", own]) == 0


def test_predict_prints_each_text_on_one_line(run_dir, capsys):
    """A text with a line break or a control character in it is printed as Python writes the
    string, so that three texts are three lines (issue 69, round 6)."""
    capsys.readouterr()
    texts = ["the film was\ngreat", "lovely\r", "the film was good"]
    assert main(["predict", "--run", str(run_dir), "--device", "cpu", *texts]) == 0
    lines = capsys.readouterr().out.splitlines()
    predictions = [line for line in lines if line.lstrip().startswith(("positive", "negative"))]
    assert len(predictions) == 3, lines
    assert predictions[0].endswith(repr("the film was\ngreat")) and predictions[1].endswith(repr("lovely\r"))
    assert predictions[2].endswith("  the film was good")  # a printable text as it is


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_checkpoint_with_weights_that_are_not_finite_is_refused(run_dir, tmp_path, bad, capsys):
    """predict and evaluate would answer nan and exit 0: the model.pt is refused in one line naming
    the tensor (issue 69, round 6)."""
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy, ignore=shutil.ignore_patterns(".lock"))
    state = torch.load(copy / "model.pt", map_location="cpu")
    name = next(k for k, t in state.items() if t.is_floating_point())
    state[name].view(-1)[3] = bad
    torch.save(state, copy / "model.pt")
    capsys.readouterr()
    predict = ["predict", "--run", str(copy), "--device", "cpu", "the film was good"]
    for argv in (predict, ["evaluate", "--run", str(copy)]):
        assert main(argv) == 2
        out, err = capsys.readouterr()
        assert err.count("\n") == 1 and "holds weights that are not finite (NaN or inf) in " + name in err, err
        assert "nan" not in out


@pytest.mark.parametrize(
    "variable, value, message",
    [
        ("FASTFORMER_TMA", "2", "FASTFORMER_TMA must be 1 (load tiles through tensor descriptors) or 0"),
        ("FASTFORMER_FFN_GEMM", "bogus", "FASTFORMER_FFN_GEMM must be triton"),
        ("FASTFORMER_TUNED", "no-such-table.json", "FASTFORMER_TUNED must be the path of a tuned table or 0"),
        ("FASTFORMER_AUTOTUNE", "maybe", "FASTFORMER_AUTOTUNE must be 1"),
        ("FASTFORMER_PACKING", "off", "FASTFORMER_PACKING must be 1 (pack the real tokens, the default) or 0"),
    ],
)
def test_a_bad_kernel_variable_is_refused_before_anything_is_written(
    files, run_dir, tmp_path, monkeypatch, capsys, variable, value, message
):
    """Each variable the ops read on a call is checked by train, evaluate and predict before any
    work: before, FASTFORMER_TMA=2 and FASTFORMER_FFN_GEMM=bogus were refused at the first kernel
    launch, after config.json, run.json and vocab.model were written, and never where no kernel
    launched (issue 69, round 6)."""
    monkeypatch.setenv(variable, value)
    out = tmp_path / "run"
    capsys.readouterr()
    assert main(train_args(files, out)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
    assert not out.exists()
    for command in (["evaluate", "--run", str(run_dir)], ["predict", "--run", str(run_dir), "good"]):
        assert main(command) == 2 and message in capsys.readouterr().err


def test_a_model_pt_that_is_a_whole_module_says_so_and_how_to_save_a_state_dict(run_dir, tmp_path, capsys):
    """torch.save(model) in place of its state_dict was called 'truncated or damaged
    (UnpicklingError)' (issue 69, round 6): it is a pickled module, which torch's weights-only load
    refuses, and the line says what to save instead."""
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy, ignore=shutil.ignore_patterns(".lock"))
    model = MovieClassification(Config.load(copy / "config.json"))
    model.load_state_dict(torch.load(copy / "model.pt", map_location="cpu"))
    torch.save(model, copy / "model.pt")
    capsys.readouterr()
    assert main(["predict", "--run", str(copy), "--device", "cpu", "the film was good"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds pickled Python objects (a whole model saved with torch.save(model)?)" in err
    assert "torch.save(model.state_dict(), path)" in err and "damaged" not in err


def test_evaluate_says_how_many_test_reviews_the_run_trained_on(run_dir, files, tmp_path):
    """A --test made of rows of the run's own train file (not its bytes): the accuracy counts them
    as reviews the model learnt, and evaluate warns with how many (issue 69, round 6)."""
    rows = Path(files["train"]).read_text().splitlines()
    mixed = tmp_path / "mixed.txt"
    mixed.write_text("\n".join([rows[0], *rows[1:4], "900\tan unseen review of the film\t1"]) + "\n")
    with pytest.warns(UserWarning, match=r"^3 of the 4 reviews of --test .*mixed.txt are also in the file the run"):
        job.evaluate_run(run=run_dir, test=str(mixed), device="cpu", log=None)


def test_a_batch_whose_activations_do_not_fit_is_refused_before_the_run_directory(files, tmp_path, monkeypatch, capsys):
    """Weights that fit, a step's activations that do not (config.d_head 4096 beside a memory of the
    weights' training bytes and 10 MiB): one line naming --batch-size and the size out of scale,
    before the model is built or anything is written (issue 69, item 15)."""
    from fastformer.config import BYTES_TO_TRAIN, parameter_count

    config = {**TINY, "d_head": 4096}
    (tmp_path / "wide.json").write_text(json.dumps(config), encoding="utf-8")
    weights = parameter_count({**config, "n_output": 2}) * BYTES_TO_TRAIN
    monkeypatch.setattr(runtime, "device_memory", lambda device: weights + 10 * 2**20)
    out = tmp_path / "run"
    args = train_args(files, out)
    args[args.index("--config") + 1] = str(tmp_path / "wide.json")
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(
        "fastformer train: error: --batch-size 16 with config.d_head 4096: one train step would keep at least "
    ), err
    assert "of activations for the backward at the longest train review (16 pieces)" in err, err
    assert not out.exists()
