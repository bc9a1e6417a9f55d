"""Labelled reviews: NSMC TSV and the tutorial's JSONL readers, the Dataset, collate and a sampler.

Two file formats are read:
- NSMC TSV (ratings_train.txt): a header `id<TAB>document<TAB>label`, one review per line, label 0
  (negative) or 1 (positive). Rows with an empty document are skipped, as the tutorial skips them.
- The tutorial's JSONL (ratings_train.json): one `{"id", "doc": [pieces...], "label"}` per line.
"""
import csv
import json
import math
import os
from typing import List, NamedTuple, Union

import torch
from tqdm.auto import tqdm

from fastformer.data.vocab import BOS

TSV_COLUMNS = ("id", "document", "label")


class Review(NamedTuple):
    id: str
    doc: Union[str, List[str]]  # raw text (TSV) or SentencePiece pieces (JSONL)
    label: int


def _parse_label(value, path, line_no):
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{path} line {line_no}: label must be an integer, got {value!r}") from None


def _open_text(path, what):
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{what} file not found: {path}")
    return open(path, "r", encoding="utf-8", newline="")


def read_nsmc(path, what="data"):
    """Reviews from an NSMC-format TSV file; rows whose document is empty are skipped."""
    with _open_text(path, what) as f:
        reader = csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
        header = next(reader, None)
        if header is None or tuple(h.strip() for h in header) != TSV_COLUMNS:
            raise ValueError(
                f"{path}: expected a TSV header with columns {', '.join(TSV_COLUMNS)}, "
                f"got {header if header is None else ', '.join(header)!s}"
            )
        reviews = []
        for line_no, row in enumerate(reader, start=2):
            if not row:
                continue
            if len(row) != 3:
                raise ValueError(f"{path} line {line_no}: expected 3 tab-separated fields, got {len(row)}")
            id_, document, label = row
            if not document.strip():
                continue
            reviews.append(Review(id_, document, _parse_label(label, path, line_no)))
    return reviews


def read_jsonl(path, what="data"):
    """Reviews from the tutorial's JSONL: {"id", "doc": [pieces], "label"} per line."""
    reviews = []
    with _open_text(path, what) as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path} line {line_no}: not JSON ({error.msg})") from None
            missing = [key for key in ("id", "doc", "label") if not isinstance(record, dict) or key not in record]
            if missing:
                raise ValueError(f"{path} line {line_no}: expected keys id, doc, label; missing {', '.join(missing)}")
            doc = record["doc"]
            if not isinstance(doc, list) or not all(isinstance(p, str) for p in doc):
                raise ValueError(f"{path} line {line_no}: doc must be a list of SentencePiece pieces")
            reviews.append(Review(str(record["id"]), doc, _parse_label(record["label"], path, line_no)))
    return reviews


def read_reviews(path, what="data", n_classes=None):
    """Read a TSV or JSONL file (told apart by the first character) and check it is usable:
    not empty, and every label in 0..n_classes-1 when n_classes is given."""
    with _open_text(path, what) as f:
        first = f.read(1)
    reviews = read_jsonl(path, what) if first == "{" else read_nsmc(path, what)
    if not reviews:
        raise ValueError(f"{what} file {path} has no reviews")
    if n_classes is not None:
        check_labels(reviews, n_classes, f"{what} file {path}")
    return reviews


def check_labels(reviews, n_classes, source):
    """Raise ValueError naming the first review whose label is outside 0..n_classes-1."""
    bad = next((r for r in reviews if not 0 <= r.label < n_classes), None)
    if bad is not None:
        raise ValueError(
            f"{source}: review {bad.id} has label {bad.label}, outside the {n_classes} classes 0..{n_classes - 1}"
        )


class MovieDataSet(torch.utils.data.Dataset):
    """The tutorial's dataset: (label, encoder ids, decoder input [BOS]) per review.

    `source` is a file path (TSV or JSONL) or a list of Review. Texts are encoded with the vocab,
    pieces looked up; sequences longer than `max_len` (the model's n_enc_seq) are truncated.
    """

    def __init__(self, vocab, source, max_len=None, progress=True):
        self.vocab = vocab
        reviews = read_reviews(source) if isinstance(source, (str, os.PathLike)) else list(source)
        desc = f"Encoding {os.path.basename(source)}" if isinstance(source, (str, os.PathLike)) else "Encoding"
        self.labels, self.sentences = [], []
        for review in tqdm(reviews, desc=desc, unit=" reviews", disable=not progress, leave=False):
            if isinstance(review.doc, str):
                ids = vocab.encode_as_ids(review.doc)
            else:
                ids = [vocab.piece_to_id(piece) for piece in review.doc]
            self.labels.append(review.label)
            # an empty review becomes one [PAD]: the batch keeps a column, the model sees no token
            self.sentences.append((ids[:max_len] if max_len else ids) or [vocab.pad_id()])
        self.bos = vocab.piece_to_id(BOS[1])

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, item):
        return (
            torch.tensor(self.labels[item]),
            torch.tensor(self.sentences[item], dtype=torch.long),
            torch.tensor([self.bos]),
        )

    def lengths(self):
        return [len(s) for s in self.sentences]


def movie_collate_fn(inputs, i_pad=0):
    """The tutorial's collate: (labels (bs,), enc_inputs (bs, max_len), dec_inputs (bs, 1)), ids
    padded with i_pad to the longest sequence in the batch."""
    labels, enc_inputs, dec_inputs = zip(*inputs)
    enc_inputs = torch.nn.utils.rnn.pad_sequence(enc_inputs, batch_first=True, padding_value=i_pad)
    dec_inputs = torch.nn.utils.rnn.pad_sequence(dec_inputs, batch_first=True, padding_value=i_pad)
    return [torch.stack(labels, dim=0), enc_inputs, dec_inputs]


class LengthBucketSampler(torch.utils.data.Sampler):
    """A batch sampler that groups reviews of similar length, so batches carry little padding.

    Indices are shuffled, cut into pools of `pool_batches` batches, each pool sorted by length and
    cut into batches; then the batches are shuffled. Pass as `batch_sampler=` to a DataLoader and
    call `set_epoch(epoch)` before each epoch for a fresh, reproducible order.
    """

    def __init__(self, lengths, batch_size, shuffle=True, seed=0, pool_batches=50):
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        self.lengths = list(lengths)
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.pool = batch_size * pool_batches
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __len__(self):
        return math.ceil(len(self.lengths) / self.batch_size)

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        n = len(self.lengths)
        order = torch.randperm(n, generator=g).tolist() if self.shuffle else list(range(n))
        batches = []
        for start in range(0, n, self.pool):
            pool = sorted(order[start : start + self.pool], key=self.lengths.__getitem__)
            batches.extend(pool[i : i + self.batch_size] for i in range(0, len(pool), self.batch_size))
        if self.shuffle:
            batches = [batches[i] for i in torch.randperm(len(batches), generator=g).tolist()]
        return iter(batches)
