"""A large corpus without silence: review files read as a stream in one pass that also hashes them,
kept compactly (Reviews, MovieDataSet's flat ids), with progress bars; tools.corpus_memory."""

import hashlib
import json
import re
import subprocess
import sys
from array import array
from pathlib import Path

import pytest
import torch

from fastformer.data import MovieDataSet, Review, read_reviews, train_vocab
from fastformer.data import files as data_files
from fastformer.data import reviews as data_reviews
from fastformer.data import vocab as data_vocab
from fastformer.data.files import TSV_COLUMNS, Reviews, file_sha256

ROOT = Path(__file__).resolve().parent.parent
LINE_BREAK = re.compile(r"\r\n|\r|\n")  # the csv module's line ends, which a TSV's rows end at
TEXTS = ["the movie was great fun", "a boring plot and awful acting", "i loved the ending"] * 30


@pytest.fixture(scope="module")
def vocab(tmp_path_factory):
    return train_vocab(TEXTS, str(tmp_path_factory.mktemp("vocab") / "vocab.model"), n_pieces=200)


def whole_text_tsv(data):
    """What a TSV's bytes hold, parsed as text at once, the way the files were read before they
    were streamed (the oracle): [Review] of its non-blank rows with a non-blank document."""
    text = data.decode("utf-8-sig")
    lines = LINE_BREAK.split(text)
    header = next(i for i, line in enumerate(lines) if line.strip())
    assert tuple(h.strip() for h in lines[header].split("\t")) == TSV_COLUMNS
    found = []
    for line_no, line in enumerate(lines[header + 1 :], start=header + 2):
        if line.strip():
            id_, doc, label = line.split("\t")
            if doc.strip():
                found.append(Review(id_, doc, int(label), line_no))
    return found


# line ends of every kind, a \r\n and a multi-byte character for the chunk edges to cut, a BOM
TSV = (
    "\ufeffid\tdocument\tlabel\r\n"
    "1\tplain ascii\t1\n"
    "2\t정말 재밌어요 \u2014 강추\t0\r"
    "\n"
    "3\t\t1\n"
    "4\tafter a blank line\t0\r\n"
    "\r\n"
    "5\t\u00e9t\u00e9 \U0001f600 emoji\t1\r"
    "6\tthe last line has no break\t0"
).encode("utf-8")


@pytest.mark.parametrize("chunk", [1, 2, 3, 5, 7, 64, 1 << 20])
def test_a_tsv_read_in_chunks_of_any_size_is_the_whole_text_parsed(tmp_path, monkeypatch, chunk):
    """Every chunk size cuts the file somewhere else (inside \\r\\n, a UTF-8 character, the BOM):
    the reviews, their line numbers and the sha256 are those of the file read whole."""
    monkeypatch.setattr(data_files, "CHUNK", chunk)
    path = tmp_path / "reviews.tsv"
    path.write_bytes(TSV)
    reviews = read_reviews(str(path))
    assert isinstance(reviews, Reviews)
    assert reviews == whole_text_tsv(TSV) and len(reviews) == 5  # review 3 has an empty document
    assert reviews.sha256 == hashlib.sha256(TSV).hexdigest() == file_sha256(str(path), "file")


@pytest.mark.parametrize("chunk", [1, 3, 1 << 20])
def test_a_jsonl_read_in_chunks_is_the_whole_text_parsed(tmp_path, monkeypatch, chunk):
    monkeypatch.setattr(data_files, "CHUNK", chunk)
    records = [{"id": 1, "doc": ["\u2581정말", "\u2581good"], "label": 1}, {"id": "x\ud800", "doc": ["a"], "label": 0}]
    lines = [json.dumps(records[0], ensure_ascii=False), json.dumps(records[1])]  # "\ud800" escaped
    data = ("\n" + "\n".join(lines) + "\r\n").encode("utf-8")
    path = tmp_path / "reviews.jsonl"
    path.write_bytes(data)
    reviews = read_reviews(str(path))
    assert reviews.pieces and reviews.sha256 == hashlib.sha256(data).hexdigest()
    assert reviews == [
        Review("1", ["\u2581정말", "\u2581good"], 1, 2),
        Review("x\ud800", ["a"], 0, 3),
    ]  # JSON's lone surrogate too


def test_reviews_behave_as_the_list_they_stand_for(tmp_path):
    path = tmp_path / "reviews.tsv"
    path.write_bytes(TSV)
    reviews, listed = read_reviews(str(path)), whole_text_tsv(TSV)
    assert list(reviews) == listed and reviews == listed and listed == list(reviews)
    assert reviews[-1] == listed[-1] and reviews[1:4] == listed[1:4] and reviews[::-2] == listed[::-2]
    with pytest.raises(IndexError):
        reviews[len(listed)]
    assert list(reviews.labels) == [r.label for r in listed] and list(reviews.texts()) == [r.doc for r in listed]
    some = reviews.take([4, 0, 2])
    assert some == [listed[4], listed[0], listed[2]] and list(some.labels) == [listed[i].label for i in (4, 0, 2)]
    assert some.take([1]) == [listed[0]] and list(some.texts()) == [listed[i].doc for i in (4, 0, 2)]
    assert reviews != listed[:-1] and reviews != [*listed[:-1], listed[0]] and not reviews.pieces


def test_the_dataset_keeps_every_reviews_ids_end_to_end(vocab):
    """MovieDataSet's flat int32 ids give each review what encoding it alone gives, truncated to
    max_len, an empty review one [PAD]; lengths and items follow."""
    docs = [TEXTS[i % 3] * (i % 4) for i in range(10_000)]  # more than one encoding batch, some empty
    reviews = [Review(str(i), doc, i % 2) for i, doc in enumerate(docs)]
    dataset = MovieDataSet(vocab, reviews, max_len=12, progress=False)
    expected = [vocab.encode_as_ids(doc)[:12] or [vocab.pad_id()] for doc in docs]
    assert isinstance(dataset.ids, array) and dataset.ids.itemsize == 4
    assert len(dataset) == len(docs) and dataset.lengths() == [len(ids) for ids in expected]
    for i in (0, 1, 2, 3, 4097, len(docs) - 1):
        label, ids, bos = dataset[i]
        assert label.item() == i % 2 and ids.dtype == torch.long and ids.tolist() == expected[i]
        assert bos.tolist() == [vocab.piece_to_id("[BOS]")]


def test_each_long_step_shows_a_bar_of_what_it_does(tmp_path, monkeypatch, capsys):
    """Reading (bytes), encoding (reviews) and the vocab's training (texts read, then the time it
    trains) each show a bar on stderr once PROGRESS_DELAY has passed (0 here)."""
    for module in (data_files, data_reviews, data_vocab):
        monkeypatch.setattr(module, "PROGRESS_DELAY", 0.0)
    path = tmp_path / "reviews.tsv"
    path.write_text("id\tdocument\tlabel\n" + "".join(f"{i}\t{TEXTS[i % 3]}\t{i % 2}\n" for i in range(90)))
    reviews = read_reviews(str(path), progress=True)
    vocab = train_vocab(reviews.texts(), str(tmp_path / "v.model"), n_pieces=100, progress=True)
    MovieDataSet(vocab, reviews, progress=True)
    err = capsys.readouterr().err
    for shown in ("Reading reviews.tsv", "Vocab: reading", "Vocab: training BPE on 90 texts", "Encoding"):
        assert shown in err, err


def test_the_vocab_reads_its_texts_once_as_a_stream(tmp_path):
    """train_vocab takes a generator (read once, not kept as a list) and trains what a list gives."""
    from_list = train_vocab(TEXTS, str(tmp_path / "a.model"), n_pieces=100)
    from_stream = train_vocab((t for t in TEXTS), str(tmp_path / "b.model"), n_pieces=100)
    pieces = [[(v.id_to_piece(i), v.get_score(i)) for i in range(v.get_piece_size())] for v in (from_list, from_stream)]
    assert pieces[0] == pieces[1]


def test_a_corpus_larger_than_the_sample_trains_on_the_same_sample_each_time(tmp_path, monkeypatch):
    """Over MAX_SENTENCES texts the vocab trains on a sample of that many, the same one each time
    (a run is reproducible)."""
    monkeypatch.setattr(data_vocab, "MAX_SENTENCES", 150)  # SentencePiece takes no fewer than 101
    texts = [f"{TEXTS[i % 3]} {'xyz' * (i % 7)} {i}" for i in range(400)]
    vocabs = [train_vocab(texts, str(tmp_path / f"{i}.model"), n_pieces=100) for i in range(2)]
    pieces = [[(v.id_to_piece(i), v.get_score(i)) for i in range(v.get_piece_size())] for v in vocabs]
    assert pieces[0] == pieces[1]


def test_corpus_memory_instrument_runs(tmp_path):
    """tools.corpus_memory on a small generated file: a report with every stage (not its figures)."""
    out = tmp_path / "corpus_memory.json"
    subprocess.run(
        [sys.executable, "-m", "tools.corpus_memory", "--mb", "0.2", "--json", str(out)],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
        timeout=600,
    )
    report = json.loads(out.read_text())
    assert report["schema"] == "fastformer.corpus_memory/1" and report["file_bytes"] > 150_000
    assert report["reviews"] > 1000 and report["tokens"] > report["reviews"]
    assert set(report["peak_bytes_per_file_byte"]) == {"read", "encode"}
    assert report["stages"]["encode"]["encode_peak_bytes"] >= report["stages"]["encode"]["read_peak_bytes"] >= 0
