"""Helpers shared by the tests: comparisons that print the worst element, a small config and a
batch of padded token ids for the modules, the tiny separable review set of the training jobs, and
the runner of many bad command lines in one process."""

import json
import os
import random
import subprocess
import sys

import torch

from fastformer import Config


def worst(actual, expected):
    """Largest absolute difference and where it is, for failure messages."""
    diff = (actual.double() - expected.double()).abs()
    index = tuple(int(i) for i in torch.unravel_index(diff.argmax(), diff.shape)) if diff.numel() else ()
    value = diff.max().item() if diff.numel() else 0.0
    return value, index


def assert_within_torch_error(name, actual, reference, torch_same_dtype, atol):
    """flash-attention's rule: max|actual - ref| <= 2 * max|torch_same_dtype - ref| + atol.

    `reference` is computed in fp32/fp64; `torch_same_dtype` is the PyTorch path in the test's dtype.
    """
    assert actual.shape == reference.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(reference.shape)}"
    assert torch.isfinite(actual).all(), f"{name}: non-finite values"
    err, where = worst(actual, reference)
    torch_err, _ = worst(torch_same_dtype, reference)
    bound = 2 * torch_err + atol
    assert err <= bound, (
        f"{name}: max error {err:.3e} at {where} exceeds 2 x torch's {torch_err:.3e} + atol {atol:.1e} = {bound:.3e} "
        f"(actual {actual[where].item():.6f}, reference {reference[where].item():.6f})"
    )


def assert_max_diff(name, actual, expected, tol):
    err, where = worst(actual, expected)
    assert err <= tol, f"{name}: max abs difference {err:.3e} at {where} exceeds {tol:.1e}"


# Modules


def small_config(**overrides):
    """The tutorial's shape of config, sized for a CPU test."""
    return Config(
        {
            "n_enc_vocab": 50,
            "n_dec_vocab": 40,
            "n_enc_seq": 24,
            "n_dec_seq": 16,
            "n_layer": 2,
            "d_hidn": 32,
            "i_pad": 0,
            "d_ff": 64,
            "n_head": 4,
            "d_head": 8,
            "dropout": 0.1,
            "layer_norm_epsilon": 1e-12,
            "n_output": 3,
            **overrides,
        }
    )


def token_batch(config, bs=5, enc_len=13, dec_len=7, seed=0):
    """Token ids with trailing padding of varied lengths, one review entirely padding-free."""
    g = torch.Generator().manual_seed(seed)
    enc = torch.randint(1, config.n_enc_vocab, (bs, enc_len), generator=g)
    dec = torch.randint(1, config.n_dec_vocab, (bs, dec_len), generator=g)
    enc_lens = torch.tensor([enc_len, 1, 5, 9, 12][:bs])
    dec_lens = torch.tensor([dec_len, 3, 1, 6, 2][:bs])
    enc = enc.masked_fill(torch.arange(enc_len) >= enc_lens[:, None], config.i_pad)
    dec = dec.masked_fill(torch.arange(dec_len) >= dec_lens[:, None], config.i_pad)
    return enc, dec


# Training jobs


POSITIVE = ["good", "great", "lovely", "fine", "superb", "nice"]
NEGATIVE = ["bad", "awful", "dull", "poor", "boring", "ugly"]
TINY = {
    "n_enc_vocab": 120,
    "n_dec_vocab": 120,
    "n_enc_seq": 16,
    "n_dec_seq": 4,
    "n_layer": 1,
    "d_hidn": 32,
    "i_pad": 0,
    "d_ff": 64,
    "n_head": 2,
    "d_head": 16,
    "dropout": 0.0,
    "layer_norm_epsilon": 1e-12,
    "n_output": 2,
}


def write_reviews(path, n, seed, labels=(0, 1)):
    """Reviews of 2..6 words, all positive or all negative: a set any working model separates. The
    train files' (seed 0) have an even number of sentiment words and the others' an odd one, so that
    a test file never holds a train file's review (the job warns of those: run.read_data)."""
    rng = random.Random(seed)
    lines = ["id\tdocument\tlabel"]
    for i in range(n):
        label = labels[i % len(labels)]
        k = rng.choice((2, 4, 6) if seed == 0 else (3, 5))
        words = rng.choices(POSITIVE if label % 2 else NEGATIVE, k=k)
        lines.append(f"{i}\tthe film was {' '.join(words)}\t{label}")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)


def tiny_job_files(root, n_train=240, n_test=60):
    """The files of a tiny train job under `root`: a separable train and test set (write_reviews)
    and TINY as a config file; the dict train_args takes, with `root`."""
    config = root / "tiny.json"
    config.write_text(json.dumps(TINY), encoding="utf-8")
    return {
        "train": write_reviews(root / "train.txt", n_train, seed=0),
        "test": write_reviews(root / "test.txt", n_test, seed=1),
        "config": str(config),
        "root": root,
    }


def pin_thread_count(patch):
    """Make every job started after this, in this process or in a subprocess, take the thread
    count this process has (monkeypatch `patch` sets OMP_NUM_THREADS). Unpinned, a job takes the
    cores the load average leaves free (fastformer.train.runtime.cpu_threads), and a CPU run's
    weights differ in their last bits between 1 and 2 threads: runs compared bit for bit must take
    one count."""
    patch.setenv("OMP_NUM_THREADS", str(torch.get_num_threads()))


def train_args(files, out, *extra):
    """`fastformer train` on the files of test_train_job's `files` fixture: 3 epochs at batch 16 on
    the CPU into `out`, then `extra`."""
    return [
        "train",
        "--train",
        files["train"],
        "--test",
        files["test"],
        "--config",
        files["config"],
        "--vocab-size",
        "60",
        "--epochs",
        "3",
        "--batch-size",
        "16",
        "--lr",
        "3e-3",
        "--device",
        "cpu",
        "--out",
        str(out),
        *extra,
    ]


# Runs [(case, argv), ...] read from stdin through fastformer.cli.main in one process, each case's
# stdout and stderr captured, and prints {case: {"code", "err", "torch"}} as JSON
_COMMANDS_HARNESS = """
import contextlib, io, json, sys
from fastformer.cli import main
results = {}
for case, argv in json.load(sys.stdin):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(argv)
        except SystemExit as exit:
            code = exit.code
        except Exception as error:  # escaped the command's handling: the case's own failure, not the run's
            code = f"raised {type(error).__name__}: {error}"
    results[case] = {"code": code, "err": err.getvalue(), "torch": "torch" in sys.modules}
print(json.dumps(results))
"""


def run_commands(cases, tmp_path_factory, timeout=600):
    """Run the command lines `cases`, [(case, argv), ...], in one fresh process with no
    TRITON_INTERPRET or OMP_NUM_THREADS, in an empty working directory and TMPDIR of their own:
    ({case: {"code": exit status, or "raised ..." for an exception the command let out, "err":
    stderr, "torch": whether torch was imported by then}}, what the cases left in the working
    directory, what they left in TMPDIR). Cheaper than a process a case: the import is paid once."""
    cwd, tmp = tmp_path_factory.mktemp("cwd"), tmp_path_factory.mktemp("tmp")
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "OMP_NUM_THREADS")}
    env.update(TMPDIR=str(tmp), PYTHONPATH=os.pathsep.join(sys.path))
    result = subprocess.run(
        [sys.executable, "-c", _COMMANDS_HARNESS],
        input=json.dumps(cases),
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=timeout,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout), os.listdir(cwd), os.listdir(tmp)
