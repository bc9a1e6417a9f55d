"""`torchrun --nproc_per_node 2 -m fastformer train` on a CPU (gloo): two processes at batch b train
like one at batch 2b, before and after --resume; only rank 0 writes and prints; the batch split
across ranks; and what a plain run keeps."""

import json
import os
import subprocess
import sys

import pytest
import torch

from fastformer.cli import main
from fastformer.data import LengthBucketSampler, ShardedBatchSampler, read_reviews, train_vocab
from fastformer.train import runtime
from tests.helpers import TINY, write_reviews

BATCH, LR = 8, 3e-3
# The weights of the two runs agree to this after 6 and 12 AdamW steps (measured: 1.2e-6 both
# times). They differ only in fp32 rounding (the mean over 16 reviews against the mean of two means
# over 8), which AdamW's division by the root of the second moment magnifies where a gradient is
# near zero.
WEIGHT_ATOL = 1e-5
# A key bias has no gradient at all (softmax does not change when all of a query's scores move by
# q . b_K): it gets rounding only, which AdamW turns into steps of a fraction of the lr, different
# in the two runs (measured: 9e-5 and 1.2e-4 apart); they are held to one lr step.
ZERO_GRADIENT = ".W_K.bias"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("ddp")
    config = root / "tiny.json"
    config.write_text(json.dumps(TINY), encoding="utf-8")  # dropout 0
    train = write_reviews(root / "train.txt", 96, seed=0)  # 6 batches of 2 x 8
    vocab = root / "vocab.model"
    train_vocab([review.doc for review in read_reviews(train)], str(vocab), n_pieces=60)
    return {
        "train": train,
        "test": write_reviews(root / "test.txt", 24, seed=1),
        "config": str(config),
        "vocab": str(vocab),
        "root": root,
    }


def train_args(files, out, batch_size, epochs=1):
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
        str(batch_size),
        "--lr",
        str(LR),
        "--device",
        "cpu",
        "--out",
        str(out),
    ]


def torchrun(args):
    """`torchrun --standalone --nproc_per_node 2 -m fastformer ARGS` (a free port, one thread each)."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "-m",
        "fastformer",
        *args,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)


def assert_same_weights(run_a, run_b):
    a, b = torch.load(run_a / "model.pt"), torch.load(run_b / "model.pt")
    assert a.keys() == b.keys()
    for name in a:
        atol = LR if name.endswith(ZERO_GRADIENT) else WEIGHT_ATOL
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=atol, msg=lambda m, name=name: f"{name}: {m}")


def assert_same_metrics(run_a, run_b):
    a, b = (json.loads((run / "metrics.json").read_text())["epochs"] for run in (run_a, run_b))
    assert [e["steps"] for e in a] == [e["steps"] for e in b]
    for key in ("train_loss", "train_accuracy", "test_loss", "test_accuracy"):
        assert [e[key] for e in a] == pytest.approx([e[key] for e in b], rel=1e-5, abs=1e-6), key


def test_two_processes_at_batch_b_train_like_one_at_batch_2b(files, tmp_path):
    """With dropout 0, 6 steps of 2 ranks at batch 8 give the weights and metrics of 6 steps of one
    process at batch 16, and so do 6 more after `--resume` under torchrun."""
    two, one = tmp_path / "two", tmp_path / "one"
    result = torchrun(train_args(files, two, BATCH))
    assert result.returncode == 0, result.stderr[-3000:]
    assert main(train_args(files, one, 2 * BATCH)) == 0
    assert_same_weights(two, one)
    assert_same_metrics(two, one)
    assert result.stdout.count("fastformer train: 96 train / 24 test reviews") == 1  # rank 0 alone prints
    assert "2 processes under torchrun" in result.stdout
    assert sorted(os.listdir(two)) == sorted(os.listdir(one))
    assert json.loads((two / "run.json").read_text())["world_size"] == 2

    resumed = torchrun(["train", "--resume", str(two), "--epochs", "2"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert main(["train", "--resume", str(one), "--epochs", "2"]) == 0
    assert_same_weights(two, one)
    assert_same_metrics(two, one)
    assert json.loads((two / "metrics.json").read_text())["epochs"][-1]["steps"] == 12
    assert json.loads((two / "run.json").read_text())["resumed"][0]["world_size"] == 2


def test_resume_needs_the_number_of_processes_the_run_had(files, tmp_path, capsys):
    out = tmp_path / "run"
    assert main([*train_args(files, out, 16), "--max-steps", "1"]) == 0
    run = json.loads((out / "run.json").read_text())
    # --max-steps 1 stops the run inside its first epoch (of 6 steps)
    assert run["world_size"] == 1 and "ranks" not in torch.load(out / "checkpoint-1-step-1" / "trainer.pt")["rng"]
    (out / "run.json").write_text(json.dumps(dict(run, world_size=2)))
    capsys.readouterr()
    assert main(["train", "--resume", str(out), "--epochs", "2", "--max-steps", "2"]) == 2
    assert capsys.readouterr().err == (
        f"fastformer train: error: --resume {out}: the run trained on 2 process(es), this job has 1; continue it "
        f"with `torchrun --nproc_per_node 2 -m fastformer train --resume {out}`\n"
    )


def test_sharded_batches_split_every_batch_evenly_in_order():
    lengths = [(7 * i) % 23 for i in range(37)]  # 37 reviews: batches of 6 and a last one of 1

    def batches():
        return LengthBucketSampler(lengths, batch_size=6, seed=3)

    shares = [list(ShardedBatchSampler(batches(), 3, rank)) for rank in range(3)]
    assert all(len(share) == len(batches()) for share in shares)
    for batch, parts in zip(batches(), zip(*shares)):
        assert len({len(part) for part in parts}) == 1  # every rank gets as many reviews
        together = [i for position in zip(*parts) for i in position]
        assert together[: len(batch)] == batch  # rank r takes positions r, r + 3, ...
        assert together[len(batch) :] == (batch * 3)[: len(together) - len(batch)]  # refilled from its start
    assert [len(parts[0]) for parts in zip(*shares)].count(1) == 1  # [i] becomes [i], [i], [i]
    with pytest.raises(ValueError, match=r"rank must be in 0\.\.1"):
        ShardedBatchSampler(batches(), 2, 2)


def test_a_plain_run_starts_no_process_group(monkeypatch):
    for name in runtime.TORCHRUN_ENV:
        monkeypatch.delenv(name, raising=False)
    assert runtime.torchrun_launch() == runtime.Launch(0, 1, None, False)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert runtime.torchrun_launch() == runtime.Launch(1, 2, 1, True)
    assert runtime.resolve_device("cpu", local_rank=1) == torch.device("cpu")
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ValueError, match=r"RANK 1 is outside 0\.\.WORLD_SIZE-1"):
        runtime.torchrun_launch()
