"""fastformer.data: the vocab, the review readers on good and malformed files, Dataset, collate,
the length-bucketing sampler, and the embedded demo set."""

import json

import pytest
import torch

from fastformer import Config
from fastformer.data import (
    LengthBucketSampler,
    MovieDataSet,
    Review,
    check_vocab_matches,
    demo,
    infer_classes,
    load_vocab,
    movie_collate_fn,
    read_jsonl,
    read_nsmc,
    read_reviews,
    train_vocab,
)

TEXTS = ["the movie was great fun", "a boring plot and awful acting", "i loved the ending"] * 30


@pytest.fixture(scope="module")
def vocab(tmp_path_factory):
    return train_vocab(TEXTS, str(tmp_path_factory.mktemp("vocab") / "vocab.model"), n_pieces=200)


def write(path, text):
    path.write_text(text, encoding="utf-8")
    return str(path)


def test_vocab_has_the_tutorials_special_symbols(vocab):
    assert [vocab.piece_to_id(p) for p in ("[PAD]", "[UNK]", "[BOS]", "[EOS]")] == [0, 1, 2, 3]
    assert [vocab.piece_to_id(p) for p in ("[SEP]", "[CLS]", "[MASK]")] == [4, 5, 6]
    assert vocab.encode_as_pieces("the movie") == ["▁the", "▁movie"]
    assert vocab.get_piece_size() <= 200 + 7  # a small corpus gives fewer pieces, not an error


def test_vocab_errors(tmp_path, vocab):
    with pytest.raises(ValueError, match="empty corpus"):
        train_vocab(["", ""], str(tmp_path / "v.model"))
    with pytest.raises(FileNotFoundError, match="vocab file not found"):
        load_vocab(str(tmp_path / "missing.model"))
    with pytest.raises(ValueError, match="not a SentencePiece model"):
        load_vocab(write(tmp_path / "junk.model", "not a model"))
    size = vocab.get_piece_size()
    check_vocab_matches(vocab, Config(n_enc_vocab=size, i_pad=0))
    with pytest.raises(ValueError, match=f"has {size} pieces but config.n_enc_vocab is {size - 1}"):
        check_vocab_matches(vocab, Config(n_enc_vocab=size - 1, i_pad=0))
    with pytest.raises(ValueError, match=r"config\.i_pad is 1"):
        check_vocab_matches(vocab, Config(n_enc_vocab=size, i_pad=1))


def test_vocab_without_the_special_ids_is_refused(tmp_path):
    import sentencepiece as spm

    prefix = str(tmp_path / "plain")
    spm.SentencePieceTrainer.train(  # SentencePiece's defaults: <unk> 0, <s> 1, </s> 2, no [PAD]
        input=write(tmp_path / "corpus.txt", "\n".join(TEXTS)),
        model_prefix=prefix,
        vocab_size=40,
        model_type="bpe",
        minloglevel=2,
    )
    with pytest.raises(ValueError, match=r"does not have \[PAD\] at id 0"):
        load_vocab(prefix + ".model")


def test_read_nsmc_skips_empty_documents_and_keeps_quotes(tmp_path):
    path = write(
        tmp_path / "ratings.txt",
        'id\tdocument\tlabel\n1\t"quoted" text, kept as is\t1\n2\t\t0\n3\t   \t1\n\n4\tplain\t0\n',
    )
    assert read_nsmc(path) == [Review("1", '"quoted" text, kept as is', 1, line=2), Review("4", "plain", 0, line=6)]


def test_empty_documents_are_skipped_in_either_format_and_counted(tmp_path):
    """A JSONL review whose doc holds no piece was kept, so a file of them trained on padding alone
    (issue 69, round 6): it is skipped as an empty TSV document is, read_reviews says how many it
    skipped, and a file of nothing else is an error that says so."""
    jsonl = write(
        tmp_path / "r.jsonl",
        '{"id": 1, "doc": ["\u2581good"], "label": 1}\n{"id": 2, "doc": [], "label": 0}\n'
        '{"id": 3, "doc": [" ", ""], "label": 0}\n',
    )
    with pytest.warns(
        UserWarning, match=r"^train file .*r\.jsonl: 2 reviews with an empty document skipped \(1 read\)$"
    ):
        reviews = read_reviews(jsonl, "train")
    assert reviews == [Review("1", ["\u2581good"], 1, line=1)] and reviews.skipped == 2
    tsv = write(tmp_path / "r.txt", "id\tdocument\tlabel\n1\tgood\t1\n2\t \t0\n")
    with pytest.warns(UserWarning, match=r"1 review with an empty document skipped \(1 read\)$"):
        assert len(read_reviews(tsv, "test")) == 1
    only_empty = write(tmp_path / "e.jsonl", '{"id": 1, "doc": [], "label": 0}\n')
    with pytest.raises(ValueError, match=r"^train file .*e\.jsonl has no reviews but 1 with an empty document$"):
        read_reviews(only_empty, "train")
    bad_label = write(tmp_path / "l.jsonl", '{"id": 1, "doc": [], "label": "yes"}\n')
    with pytest.raises(ValueError, match="line 1: label must be an integer"):  # a skipped review's label is checked
        read_reviews(bad_label, "train")


@pytest.mark.parametrize(
    "content, message",
    [
        (
            "id\ttext\tlabel\n1\tgood\t1\n",
            "expected a TSV header with columns id, document, label, got id, text, label",
        ),
        ("", "is empty"),
        ("id\tdocument\tlabel\n1\tgood\n", "line 2: expected 3 tab-separated fields, got 2"),
        ("id\tdocument\tlabel\n1\tgood\tyes\n", "line 2: label must be an integer, got 'yes'"),
        ("id\tdocument\tlabel\n1\t\t1\n", "has no reviews but 1 with an empty document"),  # an empty corpus
    ],
)
def test_read_reviews_rejects_malformed_tsv(tmp_path, content, message):
    with pytest.raises(ValueError, match=message):
        read_reviews(write(tmp_path / "bad.txt", content), "train")


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json", "line 1: not JSON"),
        ('{"id": 1, "label": 0}', "line 1: expected keys id, doc, label; missing doc"),
        ('["a list"]', "missing id, doc, label"),
        ('{"id": 1, "doc": "a string", "label": 0}', "doc must be a list of SentencePiece pieces"),
    ],
)
def test_read_jsonl_rejects_malformed_lines(tmp_path, line, message):
    with pytest.raises(ValueError, match=message):
        read_jsonl(write(tmp_path / "bad.json", line + "\n"))


def test_read_reviews_checks_files_and_labels(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"test file not found: .*nope\.txt"):
        read_reviews(str(tmp_path / "nope.txt"), "test")
    with pytest.raises(ValueError, match=r"train file .*empty\.txt has no reviews"):
        read_reviews(write(tmp_path / "empty.txt", "id\tdocument\tlabel\n"), "train")
    path = write(tmp_path / "three.txt", "id\tdocument\tlabel\n1\tfine\t1\n2\tmeh\t2\n")
    with pytest.raises(ValueError, match=r"review 2 has label 2, outside the 2 classes 0\.\.1"):
        read_reviews(path, "train", n_classes=2)
    assert len(read_reviews(path, "train", n_classes=3)) == 2


def test_files_with_a_byte_order_mark_read_like_plain_utf8(tmp_path):
    tsv = tmp_path / "bom.txt"
    tsv.write_text("id\tdocument\tlabel\n1\tgood\t1\n", encoding="utf-8-sig")
    assert read_reviews(str(tsv)) == [Review("1", "good", 1, line=2)]
    jsonl = tmp_path / "bom.json"
    jsonl.write_text('{"id": 1, "doc": ["\u2581good"], "label": 1}\n', encoding="utf-8-sig")
    assert read_reviews(str(jsonl)) == [Review("1", ["\u2581good"], 1, line=1)]


def test_a_byte_that_is_not_utf8_is_named_with_its_line(tmp_path):
    path = tmp_path / "cp949.txt"
    path.write_bytes("id\tdocument\tlabel\n1\tgood\t1\n2\t재밌다\t1\n".encode("cp949"))
    with pytest.raises(ValueError, match=f"^{path} line 3: not UTF-8 \\(byte 0xc0\\); save the file as UTF-8$"):
        read_reviews(str(path), "train")


def test_infer_classes_needs_every_class_from_zero():
    def reviews(*labels):
        return [Review(str(i), "text", label, line=i + 2) for i, label in enumerate(labels)]

    assert infer_classes(reviews(0, 2, 1, 2), "f") == 3
    with pytest.raises(ValueError, match=r"^f line 3: review 1 has label -1; classes are 0, 1, \.\.\.$"):
        infer_classes(reviews(0, -1), "f")
    with pytest.raises(
        ValueError, match=r"^f: labels go up to 99999999 but no review has label 2, 3, 4 or 99999994 more"
    ):
        infer_classes(reviews(0, 1, 99999999), "f")


def test_tsv_and_jsonl_give_the_same_dataset(tmp_path, vocab):
    texts = ["the movie was great fun", "awful acting"]
    tsv = write(
        tmp_path / "r.txt", "id\tdocument\tlabel\n" + "".join(f"{i}\t{t}\t{i % 2}\n" for i, t in enumerate(texts))
    )
    jsonl = write(
        tmp_path / "r.json",
        "".join(
            json.dumps({"id": i, "doc": vocab.encode_as_pieces(t), "label": i % 2}) + "\n" for i, t in enumerate(texts)
        ),
    )
    a, b = MovieDataSet(vocab, tsv, progress=False), MovieDataSet(vocab, jsonl, progress=False)
    assert len(a) == len(b) == 2
    for i in range(2):
        for x, y in zip(a[i], b[i]):
            assert torch.equal(x, y)
    label, enc, dec = a[0]
    assert label.item() == 0 and enc.tolist() == vocab.encode_as_ids(texts[0]) and dec.tolist() == [2]


def test_dataset_truncates_and_collate_pads_to_the_batch_maximum(vocab):
    reviews = [Review("1", "the movie was great fun", 1), Review("2", "fun", 0), Review("3", "", 1)]
    dataset = MovieDataSet(vocab, reviews, max_len=3, progress=False)
    assert dataset.lengths() == [3, 1, 1]  # truncated to max_len; the empty review is one [PAD]
    labels, enc, dec = movie_collate_fn([dataset[0], dataset[1], dataset[2]], i_pad=0)
    assert labels.tolist() == [1, 0, 1]
    assert enc.shape == (3, 3) and enc[1, 1:].eq(0).all() and enc[2].eq(0).all()
    assert dec.tolist() == [[2], [2], [2]]


def test_length_bucket_sampler_covers_everything_once_and_cuts_padding():
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 200, (1000,), generator=g).tolist()
    sampler = LengthBucketSampler(lengths, batch_size=32, seed=3, pool_batches=10)
    batches = list(sampler)
    assert len(batches) == len(sampler) == 32  # ceil(1000 / 32)
    assert sorted(i for b in batches for i in b) == list(range(1000))

    def padding(batches):
        return sum(max(lengths[i] for i in b) * len(b) - sum(lengths[i] for i in b) for b in batches)

    random_batches = [list(range(i, min(i + 32, 1000))) for i in range(0, 1000, 32)]
    assert padding(batches) < 0.2 * padding(random_batches)
    assert list(sampler) == batches  # same epoch, same order
    sampler.set_epoch(1)
    assert list(sampler) != batches
    with pytest.raises(ValueError, match="batch_size must be positive"):
        LengthBucketSampler(lengths, batch_size=0)


def test_demo_set_is_what_the_generator_writes(tmp_path):
    """The shipped files are exactly the generator's output, balanced, with no test text in train."""
    train, test = demo.generate()
    demo.write_tsv(train, tmp_path / "train.tsv")
    demo.write_tsv(test, tmp_path / "test.tsv")
    with open(demo.TRAIN_FILE, encoding="utf-8") as f:
        assert (tmp_path / "train.tsv").read_text(encoding="utf-8") == f.read()
    with open(demo.TEST_FILE, encoding="utf-8") as f:
        assert (tmp_path / "test.tsv").read_text(encoding="utf-8") == f.read()
    train_reviews, test_reviews = read_reviews(demo.TRAIN_FILE), read_reviews(demo.TEST_FILE)
    assert (len(train_reviews), len(test_reviews)) == (demo.N_TRAIN, demo.N_TEST)
    assert sum(r.label for r in train_reviews) == demo.N_TRAIN // 2
    assert not {r.doc for r in test_reviews} & {r.doc for r in train_reviews}


@pytest.mark.parametrize("text, label", [("1", 1), ("0", 0), ("1.0", 1), (" 2 ", 2), ("1.000", 1), ("-1", -1)])
def test_a_label_is_an_integer_however_written_in_tsv_and_jsonl(tmp_path, text, label):
    """One rule for both readers: an integer, which may carry a zero fraction (as pandas writes 1.0)."""
    tsv = write(tmp_path / "r.txt", f"id\tdocument\tlabel\n1\tgood\t{text}\n")
    jsonl = write(tmp_path / "r.json", f'{{"id": 1, "doc": ["\u2581good"], "label": {text.strip()}}}\n')
    assert read_reviews(tsv)[0].label == read_reviews(jsonl)[0].label == label
    assert isinstance(read_reviews(jsonl)[0].label, int)


@pytest.mark.parametrize("text", ["0.9", "1.5", "1.0000000000000001", "yes", "", "nan", "inf", "1_0", "0x1"])
def test_a_label_that_is_not_an_integer_is_refused_never_rounded(tmp_path, text):
    path = write(tmp_path / "r.txt", f"id\tdocument\tlabel\n1\tgood\t1\n2\tbad\t{text}\n")
    with pytest.raises(ValueError, match=f"^{path} line 3: label must be an integer, got {text!r}"):
        read_reviews(path)


@pytest.mark.parametrize("text", ["1e999999999", "1000000000000000000000", "-100000000000000000000"])
def test_a_huge_integer_label_is_no_class_and_never_becomes_a_huge_int(tmp_path, text):
    path = write(tmp_path / "r.txt", f"id\tdocument\tlabel\n1\tgood\t1\n2\tbad\t{text}\n")
    with pytest.raises(ValueError, match=f"^{path} line 3: label {text!r} is no class number"):
        read_reviews(path)


@pytest.mark.parametrize("value", ["0.9", "true", "1e400", '"one"', "[1]", "null"])
def test_a_jsonl_label_that_is_not_an_integer_is_refused(tmp_path, value):
    path = write(tmp_path / "r.json", f'{{"id": 1, "doc": ["\u2581good"], "label": {value}}}\n')
    with pytest.raises(ValueError, match=f"^{path} line 1: label must be an integer, got "):
        read_reviews(path)


def test_lines_of_any_length_and_line_ends_are_read(tmp_path):
    long = "good " * 60_000  # 300,000 characters: more than the csv module's field limit of 131,072
    path = write(tmp_path / "long.txt", f"id\tdocument\tlabel\r\n1\t{long}\t1\r\n2\tbad\t0\r3\tfine\t1\n")
    assert read_reviews(path) == [
        Review("1", long, 1, line=2),
        Review("2", "bad", 0, line=3),
        Review("3", "fine", 1, line=4),
    ]


def test_a_directory_or_a_nul_byte_is_named(tmp_path):
    with pytest.raises(ValueError, match=f"^train file {tmp_path} is a directory, not a file$"):
        read_reviews(str(tmp_path), "train")
    path = write(tmp_path / "nul.txt", "id\tdocument\tlabel\n1\tgo\0od\t1\n")
    with pytest.raises(ValueError, match=f"^{path} line 2: holds a NUL byte"):
        read_reviews(path)


def test_the_dataset_refuses_labels_that_are_not_integers(vocab):
    with pytest.raises(ValueError, match=r"^review 7: label must be an integer class number 0, 1, ..., got 0.9$"):
        MovieDataSet(vocab, [Review("7", "good", 0.9)], progress=False)


@pytest.mark.parametrize(
    "content, message",
    [
        (  # a lone carriage return inside a document: csv's rules end the row there
            "id\tdocument\tlabel\n1\tgood\rfilm\t1\n",
            r"line 2: expected 3 tab-separated fields, got 2; a carriage return \(\\r\) alone ends a line",
        ),
        ('[{"id": 1, "doc": ["a"], "label": 1}]', r"a JSON array; fastformer reads JSON Lines: one \{"),
        (
            '{\n  "id": 1,\n  "doc": ["a"],\n  "label": 1\n}\n',
            r"one JSON value over several lines; fastformer reads JSON Lines: one \{",
        ),
    ],
)
def test_read_reviews_names_what_is_wrong_with_the_format(tmp_path, content, message):
    with pytest.raises(ValueError, match=message):
        read_reviews(write(tmp_path / "bad.txt", content), "train")


def test_a_jsonl_file_may_begin_with_blank_lines_and_spaces(tmp_path):
    path = write(tmp_path / "spaced.json", '\n\n  {"id": 1, "doc": ["\u2581good"], "label": 1}\n')
    assert read_reviews(path, "train") == [Review("1", ["\u2581good"], 1, line=3)]
