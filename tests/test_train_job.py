"""`fastformer train`, `evaluate` and `predict` end to end on a tiny separable set, on CPU."""
import json
import os
import random

import pytest
import torch

from fastformer import Config, MovieClassification
from fastformer.cli import main
from fastformer.data import load_vocab
from fastformer.training import predict_proba
from tests import tutorial

POSITIVE = ["good", "great", "lovely", "fine", "superb", "nice"]
NEGATIVE = ["bad", "awful", "dull", "poor", "boring", "ugly"]
TINY = {
    "n_enc_vocab": 120, "n_dec_vocab": 120, "n_enc_seq": 16, "n_dec_seq": 4, "n_layer": 1, "d_hidn": 32,
    "i_pad": 0, "d_ff": 64, "n_head": 2, "d_head": 16, "dropout": 0.0, "layer_norm_epsilon": 1e-12, "n_output": 2,
}


def write_reviews(path, n, seed, labels=(0, 1)):
    """Reviews of 2..6 words, all positive or all negative: a set any working model separates."""
    rng = random.Random(seed)
    lines = ["id\tdocument\tlabel"]
    for i in range(n):
        label = labels[i % len(labels)]
        words = rng.choices(POSITIVE if label % 2 else NEGATIVE, k=rng.randint(2, 6))
        lines.append(f"{i}\tthe film was {' '.join(words)}\t{label}")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    config = root / "tiny.json"
    config.write_text(json.dumps(TINY), encoding="utf-8")
    return {
        "train": write_reviews(root / "train.txt", 240, seed=0),
        "test": write_reviews(root / "test.txt", 60, seed=1),
        "config": str(config),
        "root": root,
    }


def train_args(files, out, *extra):
    return [
        "train", "--train", files["train"], "--test", files["test"], "--config", files["config"],
        "--vocab-size", "60", "--epochs", "3", "--batch-size", "16", "--lr", "3e-3", "--device", "cpu",
        "--out", str(out), *extra,
    ]


@pytest.fixture(scope="module")
def run_dir(files):
    out = files["root"] / "run"
    assert main(train_args(files, out)) == 0
    return out


def test_train_learns_and_writes_a_complete_run_directory(run_dir):
    for name in ("config.json", "vocab.model", "model.pt", "trainer.pt", "metrics.json", "curves.png", "run.json"):
        assert (run_dir / name).is_file(), name
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert [e["epoch"] for e in metrics["epochs"]] == [1, 2, 3]
    assert metrics["test_accuracy"] == metrics["epochs"][-1]["test_accuracy"] >= 0.9  # chance is 0.5
    assert all(e["tokens_per_s"] > 0 for e in metrics["epochs"])
    assert (run_dir / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert Config.load(run_dir / "config.json") == Config(TINY)


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


def test_evaluate_and_predict_commands(run_dir, files, capsys):
    capsys.readouterr()
    assert main(["evaluate", "--run", str(run_dir), "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    accuracy = json.loads((run_dir / "metrics.json").read_text())["test_accuracy"]
    assert f"accuracy {accuracy:.4f}" in out and "on 60 reviews" in out
    assert main(["predict", "--run", str(run_dir), "--device", "cpu", "the film was superb nice", "the film was poor"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].split()[0] == "positive" and lines[1].split()[0] == "negative"


def test_resume_continues_to_more_epochs(run_dir, files, tmp_path):
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    assert main(["train", "--resume", str(copy), "--epochs", "4", "--device", "cpu"]) == 0
    metrics = json.loads((copy / "metrics.json").read_text())
    assert [e["epoch"] for e in metrics["epochs"]] == [1, 2, 3, 4]
    assert metrics["epochs"][3]["steps"] == 4 * 240 // 16
    assert main(["train", "--resume", str(copy), "--epochs", "4", "--device", "cpu"]) == 2  # nothing left to do


def test_max_steps_and_held_out_split(files, tmp_path, capsys):
    out = tmp_path / "run"
    args = ["train", "--train", files["train"], "--config", files["config"], "--vocab-size", "60", "--epochs", "2",
            "--batch-size", "16", "--max-steps", "5", "--device", "cpu", "--out", str(out), "--no-bucket"]
    assert main(args) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert [e["steps"] for e in metrics["epochs"]] == [5]
    assert "216 train / 24 test reviews" in capsys.readouterr().out  # 10% of --train held out


def test_default_run_uses_the_embedded_demo_set(tmp_path, capsys):
    """`fastformer train` with no data arguments (cut to 3 steps here; the full default run is the
    README's Quick start)."""
    out = tmp_path / "demo"
    assert main(["train", "--max-steps", "3", "--vocab-size", "300", "--device", "cpu", "--out", str(out)]) == 0
    stdout = capsys.readouterr().out
    assert "4000 train / 1000 test reviews (the embedded demo set)" in stdout
    config = Config.load(out / "config.json")
    assert (config.n_layer, config.d_hidn, config.n_enc_vocab) == (3, 128, load_vocab(str(out / "vocab.model")).get_piece_size())


def bad_input_cases(files, root):
    wrong_columns = root / "wrong_columns.txt"
    wrong_columns.write_text("id\ttext\tlabel\n1\tgood\t1\n")
    empty = root / "empty.txt"
    empty.write_text("id\tdocument\tlabel\n")
    three_labels = write_reviews(root / "three.txt", 30, seed=2, labels=(0, 1, 2))
    small_vocab = dict(TINY, n_enc_vocab=20, n_dec_vocab=20)
    small_vocab_config = root / "small_vocab.json"
    small_vocab_config.write_text(json.dumps(small_vocab))
    return [
        (["--train", str(root / "missing.txt")], "train file not found"),
        (["--train", str(wrong_columns)], "expected a TSV header with columns id, document, label"),
        (["--train", str(empty)], "has no reviews"),
        (["--train", three_labels, "--config", files["config"]], "has label 2, outside the 2 classes 0..1"),
        (["--train", files["train"], "--config", str(small_vocab_config)], "config.n_enc_vocab is 20"),
        (["--train", files["train"], "--config", str(root / "nope.json")], "config file not found"),
        (["--train", files["train"], "--vocab", str(root / "nope.model")], "vocab file not found"),
        (["--train", files["train"], "--epochs", "0"], "--epochs must be positive"),
    ]


def test_bad_input_is_one_line_exit_2_and_no_run_directory(files, tmp_path, capsys):
    for args, message in bad_input_cases(files, tmp_path):
        out = tmp_path / "run"
        code = main(["train", *args, "--vocab-size", "60", "--device", "cpu", "--out", str(out)])
        err = capsys.readouterr().err.strip()
        assert code == 2, args
        assert message in err and err.startswith("fastformer train: error:") and "\n" not in err, (args, err)
        assert not out.exists(), args


def test_existing_output_directory_is_not_overwritten(run_dir, files, capsys):
    assert main(train_args(files, run_dir)) == 2
    assert "exists and is not empty" in capsys.readouterr().err
    assert main(["evaluate", "--run", str(files["root"] / "nowhere")]) == 2
    assert "run directory not found" in capsys.readouterr().err
    assert os.path.isfile(run_dir / "model.pt")


@pytest.mark.parametrize("extra", [["--amp", "bf16"], ["--amp", "fp16"], ["--backend", "triton"]], ids=["bf16", "fp16", "triton"])
def test_train_runs_under_autocast_and_on_the_kernels(files, tmp_path, extra):
    """A few steps with autocast (fp16 through the GradScaler) and on the Triton kernels (the
    interpreter on CPU: one step and a small test set, to keep it to seconds)."""
    out = tmp_path / "run"
    if extra[0] == "--backend":
        extra = [*extra, "--max-steps", "1", "--test", write_reviews(tmp_path / "small_test.txt", 8, seed=3)]
    assert main(train_args(files, out, "--max-steps", "3", *extra)) == 0
    run = json.loads((out / "run.json").read_text())
    metrics = json.loads((out / "metrics.json").read_text())
    assert all(torch.isfinite(torch.tensor(e["train_loss"])) for e in metrics["epochs"])
    if extra[0] == "--amp":
        assert run["amp"] == extra[1]
    else:
        assert run["kernels"] == "triton"
