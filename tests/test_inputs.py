"""Bad and unusual inputs, as a new user gives them: to the commands, the data readers, run
directories and the Python API.

Every class of mistake the command can see without torch (an option out of range, a file that is
missing, a directory, not UTF-8, malformed or with a label that is no class, a config or a model too
large, a run directory in the wrong place, a resumed run whose data changed) is one line on stderr,
exit status 2, before torch is imported, with nothing written: no run directory, no vocab file, no
`runs/`. They run in one subprocess (about a second for all of them), which reports after each
case whether torch was imported.
"""

import json
import os
import shlex
import shutil

import pytest
import torch

import fastformer
from fastformer import backend, kernels
from fastformer.cli import main
from fastformer.data import read_reviews, train_vocab
from fastformer.data.files import file_sha256
from fastformer.masks import AttentionMask
from tests.helpers import TINY, run_commands, small_config, token_batch, write_reviews

TRAIN = "train --device cpu --vocab-size 60 --train {train} --test {test} --config {config} --out {out}"
RESUME = "train --device cpu --resume"
JSONL = f"{TRAIN} --vocab {{vocab}} --train"  # the tutorial's tokenized reviews, with their vocab

# (id, argv, the message's part that says what is wrong); {name} is a path of the `paths` fixture.
CASES = [
    # options, alone or together
    ("epochs-0", f"{TRAIN} --epochs 0", "--epochs must be positive, got 0"),
    ("epochs-negative", f"{TRAIN} --epochs -3", "--epochs must be positive, got -3"),
    ("epochs-word", f"{TRAIN} --epochs many", "argument --epochs: invalid int value: 'many'"),
    ("lr-negative-exponent", f"{TRAIN} --lr -1e-3", "--lr must be positive, got -0.001"),
    ("lr-nan", f"{TRAIN} --lr nan", "--lr must be a finite number, got nan"),
    ("lr-inf", f"{TRAIN} --lr inf", "--lr must be a finite number, got inf"),
    ("warmup-1", f"{TRAIN} --warmup 1", "--warmup is a fraction of the steps in [0, 1), got 1.0"),
    ("weight-decay-negative", f"{TRAIN} --weight-decay -.5", "--weight-decay must be a finite number >= 0, got -0.5"),
    ("batch-size-0", f"{TRAIN} --batch-size 0", "--batch-size must be positive, got 0"),
    ("max-steps-0", f"{TRAIN} --max-steps 0", "--max-steps must be positive, got 0"),
    ("vocab-size-32-bit", f"{TRAIN} --vocab-size 3000000000", "--vocab-size must be at most 2,147,483,640"),
    ("seed-negative", f"{TRAIN} --seed -1", "--seed must be an integer from 0 to 4,294,967,295, got -1"),
    ("n-output-fraction", f"{TRAIN} --n-output 1.5", "argument --n-output: must be a positive integer or auto"),
    ("device-meta", f"{TRAIN} --device meta", "--device meta: fastformer runs on cpu, cuda or cuda:N"),
    ("device-index", f"{TRAIN} --device cuda:x", "--device cuda:x: fastformer runs on cpu, cuda or cuda:N"),
    ("triton-on-cpu", f"{TRAIN} --backend triton", "--backend triton on cpu needs a CUDA GPU, or Triton's interpreter"),
    ("graphs-on-cpu", f"{TRAIN} --cuda-graphs", "--cuda-graphs needs a CUDA device; the device is cpu"),
    ("graphs-and-compile", f"{TRAIN} --device cuda --cuda-graphs --compile", "--cuda-graphs and --compile are"),
    ("graphs-fp16", f"{TRAIN} --device cuda --cuda-graphs --amp fp16", "--cuda-graphs does not take --amp fp16"),
    ("dataset-and-train", "train --dataset demo --train {train}", "--dataset demo and --train/--test are alternatives"),
    # files
    ("train-missing", f"{TRAIN} --train {{root}}/nope.txt", "train file not found: {root}/nope.txt"),
    ("train-directory", f"{TRAIN} --train {{root}}", "train file {root} is a directory, not a file"),
    ("test-directory", f"{TRAIN} --test {{root}}", "test file {root} is a directory, not a file"),
    ("not-utf8", f"{TRAIN} --train {{latin1}}", "{latin1} line 3: not UTF-8 (byte 0xe9)"),
    ("no-header", f"{TRAIN} --train {{no_header}}", "a TSV header with columns id, document, label, got 1, good"),
    ("empty", f"{TRAIN} --train {{empty}}", "train file {empty} has no reviews"),
    ("nul-byte", f"{TRAIN} --train {{nul}}", "{nul} line 3: holds a NUL byte"),
    ("label-0.9", f"{TRAIN} --train {{label_09}}", "{label_09} line 3: label must be an integer, got '0.9'"),
    ("label-yes", f"{TRAIN} --train {{label_yes}}", "{label_yes} line 2: label must be an integer, got 'yes'"),
    ("label-empty", f"{TRAIN} --train {{label_empty}}", "{label_empty} line 2: label must be an integer, got ''"),
    ("label-nan", f"{TRAIN} --train {{label_nan}}", "{label_nan} line 2: label must be an integer, got 'nan'"),
    (
        "label-huge",
        f"{TRAIN} --train {{label_huge}}",
        "{label_huge} line 2: label '1000000000000000000000' is no class number (an integer of 18 digits or more)",
    ),
    ("label-out-of-range", f"{TRAIN} --train {{three}}", "line 4: review 2 has label 2, outside the 2 classes 0..1"),
    ("test-label-out-of-range", f"{TRAIN} --test {{three}}", "test file {three} line 4: review 2 has label 2"),
    ("classes-with-a-gap", f"{TRAIN} --train {{gap}} --n-output auto", "labels go up to 3 but no review has label 2"),
    ("jsonl-0.9", f"{JSONL} {{jsonl_09}}", "{jsonl_09} line 2: label must be an integer, got 0.9;"),
    ("jsonl-true", f"{JSONL} {{jsonl_true}}", "line 1: label must be an integer, got True"),
    ("jsonl-1e400", f"{JSONL} {{jsonl_inf}}", "line 1: label must be an integer, got inf"),
    ("jsonl-digits", f"{JSONL} {{jsonl_digits}}", "line 1: not JSON that fastformer reads"),
    ("jsonl-nested", f"{JSONL} {{jsonl_nested}}", "line 1: not JSON that fastformer reads (nested too deeply)"),
    ("jsonl-without-vocab", f"{TRAIN} --train {{jsonl_good}}", "holds pieces of an existing vocab (JSONL); pass that"),
    ("config-missing", f"{TRAIN} --config {{root}}/nope.json", "config file not found: {root}/nope.json"),
    ("config-directory", f"{TRAIN} --config {{root}}", "config file {root} is a directory, not a file"),
    ("config-not-json", f"{TRAIN} --config {{not_json}}", "not_json.json: not a JSON config (Expecting value"),
    ("config-nested", f"{TRAIN} --config {{nested}}", "nested.json: not a JSON config that fastformer reads"),
    ("config-fraction", f"{TRAIN} --config {{fraction}}", "config.d_ff must be a positive integer, got 64.5"),
    ("config-too-large", f"{TRAIN} --config {{huge}}", "config.d_hidn 1000000000: the model would have"),
    ("n-output-too-large", f"{TRAIN} --n-output 100000000000", "--n-output 100000000000: the model would have"),
    ("vocab-directory", f"{TRAIN} --vocab {{root}}", "vocab file {root} is a directory, not a file"),
    ("vocab-not-a-model", f"{TRAIN} --vocab {{not_json}}", "is not a SentencePiece model"),
    ("vocab-size-over-config", f"{TRAIN} --vocab-size 500", "--vocab-size 500 gives up to 507 pieces but config.n_enc"),
    # run directories
    ("out-a-file", f"{TRAIN} --out {{not_json}}", "--out {not_json} is a file, not a directory"),
    ("out-not-empty", f"{TRAIN} --out {{root}}/data", "--out {root}/data exists and is not empty"),
    ("out-in-a-checkpoint", f"{TRAIN} --out {{run}}/checkpoint-1", "{run}/checkpoint-1 is inside the run directory"),
    ("out-deep-in-a-run", f"{TRAIN} --out {{run}}/a/b", "--out {run}/a/b is inside the run directory {run}"),
    ("resume-missing", f"{RESUME} {{root}}/nope", "run directory not found: {root}/nope"),
    ("resume-not-a-run", f"{RESUME} {{root}}/data", "{root}/data is not a fastformer run directory"),
    ("resume-other-lr", f"{RESUME} {{run}} --lr 1e-3", "--resume {run}: --lr 0.001 differs from the run's (lr 0.003)"),
    ("resume-changed-data", f"{RESUME} {{changed}}", "--resume {changed}: the train file {train} is not the one"),
    ("resume-nested-run", f"{RESUME} {{nesting}}", "{nesting}/checkpoint-2 is a run directory made inside the run"),
    # the other commands
    ("demo-seq-len", "demo --seq-len 300", "--seq-len 300 is longer than the tutorial config's n_enc_seq, 256"),
    ("demo-too-large", "demo --batch-size 1000000000", "--batch-size 1000000000 with --seq-len 64: the forward would"),
    ("demo-device", "demo --device meta", "--device meta: fastformer runs on cpu, cuda or cuda:N"),
    ("evaluate-batch-size", "evaluate --run {run} --batch-size 0", "--batch-size must be positive, got 0"),
    ("evaluate-no-model", "evaluate --run {unstarted}", "{unstarted} has no model.pt"),
    ("evaluate-test-directory", "evaluate --run {run} --test {root}", "test file {root} is a directory, not a file"),
    ("predict-blank", "predict --run {run} good ' '", "text 2 of 2 (' ') is empty or only whitespace"),
    ("predict-not-a-run", "predict --run {not_json} good", "{not_json} is a file, not a run directory"),
    ("data-from-directory", "data rotten-tomatoes --cache {root}/cache --from {root}", "--from {root} is a directory"),
]


def _run_dir(path, paths, **run):
    """A run directory as `fastformer train` leaves it after epoch 1, made without torch (its .pt
    files are never read: every case fails before)."""
    (path / "checkpoint-1").mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(TINY))
    shutil.copyfile(paths["vocab"], path / "vocab.model")
    info = {
        "epochs": 2,
        "demo_data": False,
        "train": paths["train"],
        "test": paths["test"],
        "vocab": None,
        "vocab_size": 60,
        "config": paths["config"],
        "n_output": 2,
        "batch_size": 16,
        "lr": 3e-3,
        "warmup": 0.1,
        "weight_decay": 0.01,
        "seed": 0,
        "bucket": True,
        "data_sha256": {"train": file_sha256(paths["train"], "train"), "test": file_sha256(paths["test"], "test")},
        **run,
    }
    (path / "run.json").write_text(json.dumps(info))
    for name in ("model.pt", "checkpoint-1/model.pt", "checkpoint-1/trainer.pt"):
        (path / name).write_bytes(b"not read")
    return str(path)


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("inputs")
    data = root / "data"
    data.mkdir()
    paths = {
        "root": str(root),
        "out": str(root / "out"),
        "train": write_reviews(data / "train.txt", 40, seed=0),
        "test": write_reviews(data / "test.txt", 10, seed=1),
        "three": write_reviews(data / "three.txt", 9, 2, (0, 1, 2)),
        "gap": write_reviews(data / "gap.txt", 9, 2, (0, 1, 3)),
    }
    good, bad = '{"id": 1, "doc": ["\u2581good"], "label": ', '{"id": 2, "doc": ["\u2581bad"], "label": '
    texts = {
        "latin1": "id\tdocument\tlabel\n1\tgood\t1\n2\tnot bad, café\t1\n".encode("latin-1"),
        "no_header": b"1\tgood\t1\n",
        "empty": b"id\tdocument\tlabel\n\n",
        "nul": b"id\tdocument\tlabel\n1\tgood\t1\n2\tba\0d\t0\n",
        "label_09": b"id\tdocument\tlabel\n1\tgood\t1.0\n2\tbad\t0.9\n",
        "label_yes": b"id\tdocument\tlabel\n1\tgood\tyes\n",
        "label_empty": b"id\tdocument\tlabel\n1\tgood\t\n",
        "label_nan": b"id\tdocument\tlabel\n1\tgood\tnan\n",
        "label_huge": b"id\tdocument\tlabel\n1\tgood\t1000000000000000000000\n",
        "jsonl_09": f"{good}1.0}}\n{bad}0.9}}\n".encode(),
        "jsonl_true": f"{good}true}}\n".encode(),
        "jsonl_inf": f"{good}1e400}}\n".encode(),
        "jsonl_digits": f"{good}{'1' * 5000}}}\n".encode(),  # more digits than Python reads as an int
        "jsonl_nested": b'{"id": 1, "doc": ' + b"[" * 100000 + b"]" * 100000 + b', "label": 1}\n',
        "jsonl_good": f"{good}1}}\n".encode(),
        "not_json.json": b"n_layer = 1\n",
        "nested.json": b"[" * 100000 + b"]" * 100000,
        "fraction.json": json.dumps(dict(TINY, d_ff=64.5)).encode(),
        "huge.json": json.dumps(dict(TINY, d_hidn=10**9)).encode(),
        "config.json": json.dumps(TINY).encode(),
    }
    for name, content in texts.items():
        (data / name).write_bytes(content)
        paths[name.removesuffix(".json")] = str(data / name)
    paths["vocab"] = str(data / "vocab.model")
    train_vocab([r.doc for r in read_reviews(paths["train"])], paths["vocab"], n_pieces=60)
    paths["run"] = _run_dir(root / "run", paths)
    paths["changed"] = _run_dir(root / "changed", paths, data_sha256={"train": "0" * 64})
    paths["nesting"] = _run_dir(root / "nesting", paths)
    _run_dir(root / "nesting" / "checkpoint-2", paths)  # a run inside another, named like a checkpoint: refused
    paths["unstarted"] = _run_dir(root / "unstarted", paths)
    os.remove(root / "unstarted" / "model.pt")
    return paths


@pytest.fixture(scope="module")
def outcomes(paths, tmp_path_factory):
    """{case: {"code", "err", "torch"}}, with the temporary and working directories they left."""
    return run_commands([(case, shlex.split(argv.format(**paths))) for case, argv, _ in CASES], tmp_path_factory)


@pytest.mark.parametrize("case, argv, message", CASES, ids=[case for case, _, _ in CASES])
def test_a_bad_input_is_one_line_exit_2_before_torch_and_leaves_nothing(outcomes, paths, case, argv, message):
    results, cwd, tmp = outcomes
    result = results[case]
    command = argv.split()[0]
    assert result["code"] == 2, result
    assert result["err"].startswith(f"fastformer {command}: error: ") and result["err"].count("\n") == 1, result["err"]
    assert message.format(**paths) in result["err"], result["err"]
    assert not result["torch"], "torch was imported before the error"
    assert not any(os.path.exists(os.path.join(paths["root"], name)) for name in ("out", "cache"))
    assert cwd == [] and tmp == []  # no runs/ made, no vocab left in the temporary directory


def test_devices_and_backends_that_are_not_there_are_refused_before_any_work(paths, tmp_path, capsys, monkeypatch):
    """What only torch can tell: checked right after it is imported, before the vocab is trained."""
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    out = tmp_path / "out"
    base = TRAIN.format(**dict(paths, out=out)).split()
    cases = [(["--device", "cuda"], "--device cuda: CUDA is not available on this machine")]
    if not kernels.INTERPRET:
        cases.append((["--backend", "triton", "--device", "cpu"], "--backend triton on cpu needs a CUDA GPU"))
    for extra, message in cases:
        capsys.readouterr()
        assert main([*base, *extra]) == 2
        stdout, err = capsys.readouterr()
        assert err.startswith(f"fastformer train: error: {message}") and err.count("\n") == 1, err
        assert stdout == "" and not out.exists()


# The Python API: the user's arguments, in the user's terms


def test_token_ids_that_are_not_integers_name_their_dtype():
    model = fastformer.MovieClassification(small_config())
    enc, dec = token_batch(small_config())
    not_int = r"^enc_inputs must hold integer token ids \(torch.long\), got torch.float32: the embedding takes "
    with pytest.raises(ValueError, match=not_int):
        model(enc.float(), dec)
    with pytest.raises(ValueError, match=r"^dec_inputs must be a \(bs, n_seq\) tensor of token ids, got shape \(5,\)$"):
        model(enc, dec[:, 0])


def test_encoder_and_decoder_batches_that_differ_name_enc_inputs_and_dec_inputs():
    config = small_config()
    model = fastformer.MovieClassification(config)
    enc, dec = token_batch(config)
    message = r"enc_inputs and dec_inputs must hold the same reviews, one per row: got enc_inputs \(5, 13\) and "
    with pytest.raises(ValueError, match=message + r"dec_inputs \(3, 7\)"):
        model(enc, dec[:3])
    decoder = fastformer.Decoder(config)
    enc_outputs = torch.randn(5, 13, config.d_hidn)
    with pytest.raises(ValueError, match=message + r"dec_inputs \(4, 7\)"):
        decoder(dec[:4], enc, enc_outputs)
    with pytest.raises(ValueError, match=r"enc_outputs must be the Encoder's output for enc_inputs \(5, 13\)"):
        decoder(dec, enc, enc_outputs[:, :9])


@pytest.mark.parametrize("causal", ["no", 0, None])
def test_causal_must_be_a_bool(causal):
    q = torch.randn(1, 2, 3, 8)
    with pytest.raises(TypeError, match=f"^causal must be a bool, got {causal!r}$"):
        backend.attention(q, q, q, causal=causal)
    with pytest.raises(TypeError, match=f"^AttentionMask.causal must be a bool, got {causal!r}$"):
        AttentionMask(causal=causal).as_kwargs()
