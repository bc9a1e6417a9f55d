"""Inputs that ran and gave a wrong result, or failed with a message that did not say what was
wrong: an option dropped in some combination, a test file that is the train file by another name,
a label too large for its array, an empty file, a symlink loop, text that is not UTF-8, training
data missing a class, and options that act on kernels the run does not use.

The command's cases run as tests/test_inputs.py runs its own: in one subprocess, each one line on
stderr, exit status 2, before torch is imported, with nothing written.
"""

import dataclasses
import json
import os
import random
import shlex
import warnings

import pytest

from fastformer import kernels
from fastformer.data import N_SPECIAL, read_nsmc, read_reviews, train_vocab
from fastformer.data.files import check_file, parse_label
from fastformer.train.run import TrainOptions, check_inputs, check_texts
from tests.helpers import TINY, run_commands, write_reviews

TRAIN = "train --device cpu --vocab-size 60 --train {train} --test {test} --config {config} --out {out}"
VOCAB = "train --device cpu --vocab {vocab} --test {test} --config {config} --out {out} --train"
PIECE = '{"id": 1, "doc": ["\\u2581good"], "label": '  # a JSONL line up to its label

# (id, argv, the message's part that says what is wrong); {name} is a path of the `paths` fixture.
CASES = [
    # an option that another one used to drop (--test without --train: below, as without the check the
    # command would train on the demo set)
    (
        "vocab-size-beside-a-vocab",
        f"{VOCAB} {{train}} --vocab-size 5",
        "--vocab-size 5 and --vocab {vocab}: --vocab-size is the size of a vocab to train",
    ),
    # the test file is the train file
    ("test-same-path", f"{TRAIN} --test {{train}}", "--test {train} is the same file as --train {train}: its accuracy"),
    ("test-symlink", f"{TRAIN} --test {{symlink}}", "--test {symlink} is the same file as --train {train} by another"),
    ("test-hard-link", f"{TRAIN} --test {{hard_link}}", "--test {hard_link} is the same file as --train {train} by"),
    ("test-a-copy", f"{TRAIN} --test {{copy}}", "--test {copy} holds the same bytes as --train {train} (sha256 "),
    # the train file saved again with CRLF line endings and a byte-order mark: other bytes, the same reviews
    (
        "test-a-crlf-copy",
        f"{TRAIN} --test {{crlf_copy}}",
        "is also in --train {train} (the same text, up to case and white space): its accuracy would be",
    ),
    # labels too large for a class number, in either format
    ("jsonl-2**63", f"{VOCAB} {{jsonl_2_63}}", "{jsonl_2_63} line 1: label 9223372036854775808 is no class number"),
    ("jsonl-below-int64", f"{VOCAB} {{jsonl_neg}}", "{jsonl_neg} line 1: label -9223372036854775809 is no class"),
    ("jsonl-1e30", f"{VOCAB} {{jsonl_1e30}}", "{jsonl_1e30} line 1: label 1e+30 is no class number"),
    ("tsv-18-digits", f"{TRAIN} --train {{tsv_18}}", "{tsv_18} line 2: label '100000000000000000' is no class number"),
    ("jsonl-lone-surrogate", f"{VOCAB} {{jsonl_surrogate}}", "line 1: piece '\\ud800' holds a lone surrogate (U+D800)"),
    # empty files
    ("train-empty-tsv", f"{TRAIN} --train {{empty}}", "train file {empty} is empty"),
    ("train-empty-jsonl", f"{TRAIN} --train {{empty_jsonl}}", "train file {empty_jsonl} is empty"),
    ("train-blank", f"{TRAIN} --train {{blank}}", "train file {blank} is empty (only white space)"),
    ("test-empty", f"{TRAIN} --test {{empty}}", "test file {empty} is empty"),
    # links that lead nowhere
    ("train-symlink-loop", f"{TRAIN} --train {{loop}}", "train file {loop} is a symlink loop"),
    ("test-symlink-loop", f"{TRAIN} --test {{loop}}", "test file {loop} is a symlink loop"),
    ("config-symlink-loop", f"{TRAIN} --config {{loop}}", "config file {loop} is a symlink loop"),
    ("vocab-symlink-loop", f"{TRAIN} --vocab {{loop}}", "vocab file {loop} is a symlink loop"),
    ("train-dangling", f"{TRAIN} --train {{dangling}}", "train file {dangling} is a symlink to nowhere.txt, which is"),
    # the classes the training data holds
    ("one-class", f"{TRAIN} --train {{one_class}}", "has no review of label 1, of the 2 classes 0..1 (config.n_output"),
    ("one-class-auto", f"{TRAIN} --train {{one_class}} --n-output auto", "--n-output auto, from its labels, gives 1"),
    ("n-output-1", f"{TRAIN} --train {{one_class}} --n-output 1", "--n-output 1 gives 1 class; a classifier needs 2"),
    ("n-output-3", f"{TRAIN} --n-output 3", "{train} has no review of label 2, of the 3 classes 0..2 (--n-output 3)"),
    (
        "one-class-default-n-output",
        "train --device cpu --vocab-size 60 --train {one_class} --test {test} --out {out}",
        "{one_class} has no review of label 1, of the 2 classes 0..1 (the default n_output, 2)",
    ),
    (
        "held-out-split-drops-a-class",
        "train --device cpu --vocab-size 60 --train {split} --config {config} --out {out}",
        "holding out 10% of train file {split} as the test split left no review of label 1 to train on",
    ),
    # bytes that are not UTF-8
    ("jsonl-not-utf8", f"{VOCAB} {{jsonl_latin1}}", "{jsonl_latin1} line 2: not UTF-8 (byte 0xe9)"),
    ("tsv-utf16", f"{TRAIN} --train {{utf16}}", "{utf16} line 1: not UTF-8 (byte 0xff)"),
]
# a command line as the shell gives one, with a byte that is not UTF-8 (Python's surrogateescape)
PREDICT = ("predict-not-utf8", ["predict", "--run", "{root}", "good", "caf\udce9"], "text 2 of 2 ('caf\\udce9') is")


def _split_file(path, n=20, seed=0):
    """A train file whose only review of label 1 is the one that `fastformer train` without --test
    holds out (run._split's order for `seed`)."""
    order = list(range(n))
    random.Random(seed).shuffle(order)
    lines = ["id\tdocument\tlabel"] + [f"{i}\tthe film was {'good' if i == order[0] else 'bad'}\t0" for i in range(n)]
    lines[order[0] + 1] = lines[order[0] + 1][:-1] + "1"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("round5")
    data = root / "data"
    data.mkdir()
    paths = {
        "root": str(root),
        "out": str(root / "out"),
        "train": write_reviews(data / "train.txt", 40, seed=0),
        "test": write_reviews(data / "test.txt", 10, seed=1),
        "one_class": write_reviews(data / "one_class.txt", 10, seed=2, labels=(0,)),
        "split": _split_file(data / "split.txt"),
    }
    texts = {
        "jsonl_2_63": f"{PIECE}{2**63}}}\n".encode(),
        "jsonl_neg": f"{PIECE}{-(2**63) - 1}}}\n".encode(),
        "jsonl_1e30": f"{PIECE}1e30}}\n".encode(),
        "tsv_18": b"id\tdocument\tlabel\n1\tgood\t100000000000000000\n",
        "jsonl_surrogate": b'{"id": 1, "doc": ["\\u2581good", "\\ud800"], "label": 1}\n',
        "empty": b"",
        "empty_jsonl": b"",
        "blank": b"\n  \n\t\n",
        "jsonl_latin1": f"{PIECE}1}}\n".encode() + '{"id": 2, "doc": ["café"], "label": 0}\n'.encode("latin-1"),
        "utf16": "id\tdocument\tlabel\n1\tgood\t1\n".encode("utf-16"),
        "config.json": json.dumps(TINY).encode(),
    }
    for name, content in texts.items():
        (data / name).write_bytes(content)
        paths[name.removesuffix(".json")] = str(data / name)
    for name, make in (("symlink", os.symlink), ("hard_link", os.link)):
        paths[name] = str(data / f"{name}.txt")
        make(paths["train"], paths[name])
    paths["copy"] = str(data / "copy.txt")
    (data / "copy.txt").write_bytes((data / "train.txt").read_bytes())
    paths["crlf_copy"] = str(data / "crlf_copy.txt")
    (data / "crlf_copy.txt").write_bytes(b"\xef\xbb\xbf" + (data / "train.txt").read_bytes().replace(b"\n", b"\r\n"))
    paths["loop"], other = str(data / "loop"), str(data / "loop2")
    os.symlink(other, paths["loop"])
    os.symlink(paths["loop"], other)
    paths["dangling"] = str(data / "dangling.txt")
    os.symlink("nowhere.txt", paths["dangling"])
    paths["vocab"] = str(data / "vocab.model")
    train_vocab([r.doc for r in read_reviews(paths["train"])], paths["vocab"], n_pieces=60)
    return paths


@pytest.fixture(scope="module")
def outcomes(paths, tmp_path_factory):
    """{case: {"code", "err", "torch"}}, with what the cases left in their working and temporary
    directories."""
    # each case its own --out: one that ran on would leave its run there, and the others' checks whole
    cases = [(case, shlex.split(argv.format(**dict(paths, out=_out(paths, case))))) for case, argv, _ in CASES]
    cases.append((PREDICT[0], [arg.format(**paths) for arg in PREDICT[1]]))
    return run_commands(cases, tmp_path_factory)


@pytest.mark.parametrize(
    "case, command, message",
    [(case, argv.split()[0], message) for case, argv, message in CASES] + [(PREDICT[0], "predict", PREDICT[2])],
    ids=[case for case, _, _ in CASES] + [PREDICT[0]],
)
def test_each_is_one_line_exit_2_before_torch_and_leaves_nothing(outcomes, paths, case, command, message):
    results, _, _ = outcomes
    result = results[case]
    assert result["code"] == 2, result
    assert result["err"].startswith(f"fastformer {command}: error: ") and result["err"].count("\n") == 1, result["err"]
    assert message.format(**dict(paths, out=_out(paths, case))) in result["err"], result["err"]
    assert not result["torch"], "torch was imported before the error"
    assert not os.path.exists(_out(paths, case))


def test_the_cases_leave_nothing_in_the_working_or_temporary_directory(outcomes):
    _, cwd, tmp = outcomes
    assert cwd == [] and tmp == []  # no runs/ made, no vocab left in the temporary directory


def _out(paths, case):
    return os.path.join(paths["root"], f"out-{case}")


# What the cases above cannot show from the command line


def test_a_test_file_that_shares_some_reviews_with_the_train_file_is_said_with_the_count(tmp_path):
    """Rows copied from the train file into the test file, one in another case and spacing: the
    accuracy counts them as learnt, and a warning says how many (issue 69, round 6)."""
    from fastformer.train.run import _check_test_is_not_train

    train = tmp_path / "train.txt"
    train.write_text("id\tdocument\tlabel\n1\tA fine film\t1\n2\tdull\t0\n3\tgreat  acting\t1\n")
    test = tmp_path / "test.txt"
    test.write_text("id\tdocument\tlabel\n7\ta FINE film \t1\n8\tgreat acting\t1\n9\tnew review\t0\n")
    with pytest.warns(
        UserWarning, match=r"^2 of the 3 reviews of --test .*test.txt are also in --train .*train.txt \(the"
    ):
        _check_test_is_not_train(str(train), str(test), read_reviews(str(train)), read_reviews(str(test)))


def test_test_without_train_is_refused_before_the_demo_set_is_read(paths):
    """Through the API too (fastformer.train.job.train checks its options with check_inputs); a
    check_inputs that let it through would go on to train on the demo set, which it is not asked to."""
    with pytest.raises(ValueError, match=r"^--test \S+test.txt needs --train: without --train the run trains and"):
        check_inputs(TrainOptions(test=paths["test"], device="cpu", out=paths["out"]))


def test_a_vocab_size_that_is_the_vocabs_own_is_taken(paths):
    """--vocab-size beside --vocab is refused only where it would be dropped: the vocab's own size
    is what the run has anyway."""
    from fastformer.data import load_vocab

    own = load_vocab(paths["vocab"]).get_piece_size() - N_SPECIAL
    options = TrainOptions(
        train=paths["train"], test=paths["test"], vocab=paths["vocab"], vocab_size=own, config=paths["config"]
    )
    inputs = check_inputs(dataclasses.replace(options, device="cpu", out=paths["out"]))
    assert inputs.run_options.vocab_size is None and inputs.vocab.get_piece_size() == own + N_SPECIAL
    with pytest.raises(ValueError, match=f"^--vocab-size {own + 1} and --vocab "):
        check_inputs(dataclasses.replace(options, vocab_size=own + 1, device="cpu", out=paths["out"]))
    assert not os.path.exists(paths["out"])


@pytest.mark.parametrize(
    "value, label",
    [
        (10**17 - 1, 10**17 - 1),  # 17 digits: read, and check_labels says it is no class of the run's
        (10**17, None),  # 18 digits
        (float(10**17), None),
        (2**63, None),  # past int64, where the labels are kept
        (-(2**63) - 1, None),
        (1e30, None),
        (-1e30, None),
        ("1e30", None),
        (str(10**17), None),
        (str(10**17 - 1), 10**17 - 1),
    ],
)
def test_a_label_of_18_digits_or_more_is_no_class_number_in_any_form(value, label):
    from fastformer.data.files import _HugeLabel

    if label is not None:
        assert parse_label(value) == label
    else:
        with pytest.raises(_HugeLabel):
            parse_label(value)


def test_the_readers_name_an_empty_file_as_such(paths):
    with pytest.raises(ValueError, match=r"^data file .*empty is empty$"):
        read_nsmc(paths["empty"])
    with pytest.raises(ValueError, match=r"^test file .*blank is empty \(only white space\)$"):
        read_reviews(paths["blank"], "test")  # as `fastformer evaluate --test` reads it


def test_check_file_tells_a_symlink_loop_and_a_dangling_link_from_a_missing_file(paths):
    with pytest.raises(OSError, match=r"^test file .*loop is a symlink loop") as loop:
        check_file(paths["loop"], "test file")
    assert not isinstance(loop.value, FileNotFoundError)
    with pytest.raises(FileNotFoundError, match=r"^vocab file .*dangling.txt is a symlink to nowhere.txt, which is"):
        check_file(paths["dangling"], "vocab file")
    with pytest.raises(FileNotFoundError, match=r"^config file not found: .*train.txt/x$"):
        check_file(os.path.join(paths["train"], "x"), "config file")  # a file is no directory: still not found


@pytest.mark.parametrize(
    "texts, message",
    [
        (["good", "caf\udce9"], r"^text 2 of 2 \('caf\\udce9'\) is not UTF-8: byte 0xe9 at character 4; give"),
        ("a\ud800", r"^text 1 of 1 \('a\\ud800'\) is not UTF-8: a lone surrogate U\+D800 at character 2; give"),
    ],
)
def test_predict_refuses_text_that_is_not_utf8(texts, message):
    """A command line's bytes that are not UTF-8 reach Python as surrogates, and SentencePiece
    cannot take them (a pybind11 cast error): the text and the character are named instead."""
    with pytest.raises(ValueError, match=message):
        check_texts(texts)


@pytest.mark.parametrize("label", [-1, -100, 2**63, True])
def test_the_dataset_refuses_a_label_that_is_no_class_number(paths, label):
    """-100 is cross_entropy's ignore_index (the review would leave the loss without a word); -1 an
    index error at the first step; 2**63 an OverflowError."""
    from fastformer.data import MovieDataSet, Review, load_vocab

    vocab = load_vocab(paths["vocab"])
    with pytest.raises(ValueError, match=f"^review 7: label must be an integer class number 0, 1, ..., got {label}$"):
        MovieDataSet(vocab, [Review("6", "good", 1), Review("7", "bad", label)], progress=False)


@pytest.mark.parametrize(
    "options, warned",
    [
        (dict(autotune=True, backend_name="reference"), "--autotune does nothing here"),
        (dict(precompile=True, pad_to_buckets=True, backend_name="reference"), "--precompile does nothing here"),
        (dict(autotune=True, precompile=True, pad_to_buckets=True), "--autotune and --precompile do nothing here"),
        pytest.param(
            dict(autotune=True, backend_name="triton"),
            "--autotune does nothing here",
            marks=pytest.mark.skipif(not kernels.INTERPRET, reason="the kernels run on a GPU"),
            id="interpreter",
        ),
        (dict(autotune=False), None),
    ],
)
def test_options_of_the_triton_kernels_warn_where_they_do_nothing(paths, options, warned):
    """--autotune and --precompile act on the Triton kernels compiled for a GPU; on a CPU the model
    runs the PyTorch reference ("auto" and "reference"), or with --backend triton the kernels in
    Triton's interpreter, which compiles nothing ahead and tries one config: the job says they do
    nothing rather than take them silently."""
    from fastformer import backend
    from fastformer.train.run import settle

    given = TrainOptions(
        train=paths["train"], test=paths["test"], config=paths["config"], vocab_size=60, device="cpu", **options
    )
    inputs = check_inputs(dataclasses.replace(given, out=paths["out"]))
    with backend.use_backend(inputs.options.backend_name), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        settle(inputs, print)
    messages = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    if warned is None:
        assert messages == []
    else:
        assert len(messages) == 1 and messages[0].startswith(warned), messages
        assert f"on cpu with --backend {inputs.options.backend_name} and amp off" in messages[0], messages
    assert not os.path.exists(paths["out"])
