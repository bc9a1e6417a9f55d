"""Labelled review files, read and checked without torch: NSMC TSV and the tutorial's JSONL.

Two file formats are read, as UTF-8 (a byte-order mark is skipped), lines of any length:
- NSMC TSV (ratings_train.txt): a header `id<TAB>document<TAB>label`, one review per line. Rows with
  an empty document are skipped, as the tutorial skips them.
- The tutorial's JSONL (ratings_train.json): one `{"id", "doc": [pieces...], "label"}` per line. A
  review whose doc holds no piece (`[]`, or pieces of white space only) is skipped, as an empty TSV
  document is: the model would read padding alone.
read_reviews says how many reviews it skipped (a warning), and a file of no review left is an error.

A label is a class number 0, 1, ...: an integer, which may be written with a zero fraction (`1.0`,
as spreadsheets and pandas write integers); `0.9`, `1.5`, `yes`, `true` and an empty label are
refused, never rounded, and so is an integer of MAX_LABEL_DIGITS digits or more (`2**63`, `1e30`),
in either format. Every error is a ValueError or OSError of one line naming the file and, where
there is one, the line and the value; an empty file is said to be one.

A file is read as a stream, CHUNK bytes at a time, in one pass that also hashes it (its sha256,
which a run pins), with a progress bar in bytes where the reading takes more than a few seconds.
What it holds is kept compactly (`Reviews`): each text's UTF-8 bytes in one buffer and the labels
and offsets in integer arrays, about the file's size in all, where Python objects per review would
take ten times that; a `Review` is made when one is asked for.
"""

import collections.abc
import decimal
import errno
import hashlib
import itertools
import json
import math
import os
import stat
import unicodedata
import warnings
from array import array
from typing import NamedTuple

from fastformer.progress import progress_bar

TSV_COLUMNS = ("id", "document", "label")
JSON_LINES = 'JSON Lines: one {"id", "doc", "label"} object per line'
MAX_LABEL_DIGITS = 18  # a class number has fewer; a longer one is refused before it becomes a huge int
LABEL_LIMIT = 10 ** (MAX_LABEL_DIGITS - 1)  # the least integer of MAX_LABEL_DIGITS digits (an int64 holds it)
CHUNK = 1 << 20  # bytes read at a time
PROGRESS_DELAY = 2.0  # seconds a step runs before its progress bar shows


class Review(NamedTuple):
    id: str
    doc: str | list[str]  # raw text (TSV) or SentencePiece pieces (JSONL)
    label: int
    line: int | None = None  # where the review is in its file, for error messages


def check_file(path, what):
    """Raise FileNotFoundError, OSError or ValueError unless `path` is a regular file; `what` names
    it in the message ("train file", "config file"). A symlink that leads nowhere is said to be one
    (a loop, or a link to a missing file), not "not found"."""
    try:
        mode = os.stat(path).st_mode
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise OSError(f"{what} {path} is a symlink loop: following its links comes back to a link") from None
        if error.errno == errno.ENOENT and os.path.islink(path):
            raise FileNotFoundError(f"{what} {path} is a symlink to {os.readlink(path)}, which is not there") from None
        if error.errno in (errno.ENOENT, errno.ENOTDIR):
            raise FileNotFoundError(f"{what} not found: {path}") from None
        raise OSError(f"{what} {path}: {error.strerror or error}") from None
    if stat.S_ISDIR(mode):
        raise ValueError(f"{what} {path} is a directory, not a file")
    if not stat.S_ISREG(mode):
        raise ValueError(f"{what} {path} is not a regular file")


def read_bytes(path, what):
    """The bytes of the regular file `path`, or a one-line error naming it."""
    check_file(path, what)
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as error:
        raise OSError(f"could not read {path}: {error.strerror or error}") from None


def _chunks(path, what, progress=False):
    """The bytes of the regular file `path`, CHUNK at a time, with a progress bar in bytes (shown
    after PROGRESS_DELAY seconds) when `progress`; a one-line error naming the file."""
    check_file(path, what)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            desc = f"Reading {os.path.basename(path)}"
            with progress_bar(
                size, unit="B", unit_scale=True, desc=desc, disable=not progress, delay=PROGRESS_DELAY
            ) as bar:
                while chunk := f.read(CHUNK):
                    bar.update(len(chunk))
                    yield chunk
    except OSError as error:
        raise OSError(f"could not read {path}: {error.strerror or error}") from None


def file_sha256(path, what):
    """The sha256 of the bytes of the regular file `path`, as hex, read CHUNK at a time."""
    digest = hashlib.sha256()
    for chunk in _chunks(path, what):
        digest.update(chunk)
    return digest.hexdigest()


def cut(text, limit=40):
    """`text` cut to about `limit` characters, for messages."""
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


def shown(value, limit=40):
    """repr(value), cut to about `limit` characters, for messages."""
    return cut(repr(value), limit)


def parse_label(value):
    """The class number a label holds, or None when it is not an integer: an int (not a bool), a
    float with no fraction, or text that reads as one (`1`, `-1`, `1.0`; exactly, so that
    `1.0000000000000001` is not 1). An integer of MAX_LABEL_DIGITS digits or more, in any of these
    forms (`2**63`, `1e30`, "1e30"), raises _HugeLabel: a text one before it becomes a huge int,
    and none reaches the int64 array the labels are kept in."""
    if isinstance(value, bool):
        return None
    if isinstance(value, float):
        if not math.isfinite(value) or not value.is_integer():
            return None
        value = int(value)
    if isinstance(value, int):
        if abs(value) >= LABEL_LIMIT:
            raise _HugeLabel
        return value
    if not isinstance(value, str) or "_" in value:
        return None
    try:
        number = decimal.Decimal(value.strip())
    except decimal.InvalidOperation:
        return None
    if not number.is_finite() or number != number.to_integral_value():
        return None
    if number.adjusted() >= MAX_LABEL_DIGITS - 1:
        raise _HugeLabel
    return int(number)


class _HugeLabel(Exception):
    """parse_label's text is an integer of MAX_LABEL_DIGITS digits or more: no class number."""


def _label(value, path, line_no):
    try:
        label = parse_label(value)
    except _HugeLabel:
        raise ValueError(
            f"{path} line {line_no}: label {shown(value)} is no class number (an integer of {MAX_LABEL_DIGITS} "
            "digits or more); labels are the classes 0, 1, ..."
        ) from None
    if label is None:
        raise ValueError(
            f"{path} line {line_no}: label must be an integer, got {shown(value)}; labels are the classes 0, 1, ..."
        )
    return label


BOM = b"\xef\xbb\xbf"  # UTF-8's byte-order mark, skipped at a file's start (utf-8-sig)
# how a JSON id is kept as UTF-8 bytes: a lone surrogate ("\ud800" is JSON) goes and comes back as it
# was (a piece holding one is refused: no vocab holds it)
SURROGATES = "surrogatepass"


def _decode(data, path, line_no):
    """The text of line `line_no`'s bytes: UTF-8; a byte that is not raises ValueError naming the
    file, the line and the byte."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(
            f"{path} line {line_no}: not UTF-8 (byte 0x{data[error.start]:02x}); save the file as UTF-8"
        ) from None


class _Lines:
    """The lines of a file as it is read (_chunks), each (its number from 1, its bytes without the
    break, the break): for a TSV a line ends at \r\n, \r or \n (as bytes.splitlines splits, and
    as the csv module's rules end one), for JSONL at \n alone; a byte-order mark at the start is
    skipped. Once every line is read, `sha256` is the hex digest of the file's bytes and `size`
    their number."""

    def __init__(self, path, what, jsonl, progress):
        self.path, self.what, self.jsonl, self.progress = path, what, jsonl, progress
        self.sha256, self.size = None, 0

    def __iter__(self):
        digest, line_no, start = hashlib.sha256(), 0, True
        pending = []  # the bytes read of a line not ended yet, kept in pieces: a long line is joined once
        for chunk in _chunks(self.path, self.what, self.progress):
            digest.update(chunk)
            self.size += len(chunk)
            if start and sum(map(len, pending)) + len(chunk) < len(BOM):
                pending.append(chunk)  # too short yet to tell a byte-order mark
                continue
            if not start and not (b"\n" in chunk or (not self.jsonl and b"\r" in chunk)):
                pending.append(chunk)  # no line ends in it
                continue
            data = b"".join((*pending, chunk))
            pending.clear()
            if start:
                data, start = data.removeprefix(BOM), False
            lines = data.split(b"\n") if self.jsonl else data.splitlines(keepends=True)
            # the last piece may go on in the next chunk (a \r may be the first half of \r\n)
            tail = lines.pop() if lines else b""
            if not self.jsonl and tail.endswith(b"\n"):
                lines.append(tail)
                tail = b""
            if tail:
                pending.append(tail)
            for line in lines:
                line_no += 1
                yield (line_no, line, b"\n") if self.jsonl else (line_no, *_cut_break(line))
        last = b"".join(pending)  # the file's end: what is left, which may still hold a lone \r
        if start:
            last = last.removeprefix(BOM)
        for line in last.split(b"\n") if self.jsonl else last.splitlines(keepends=True):
            line_no += 1
            yield (line_no, line, b"") if self.jsonl else (line_no, *_cut_break(line))
        self.sha256 = digest.hexdigest()


def _cut_break(line):
    """(a line's bytes without its break, the break)."""
    if line.endswith(b"\r\n"):
        return line[:-2], b"\r\n"
    if line.endswith((b"\r", b"\n")):
        return line[:-1], line[-1:]
    return line, b""


class _Store:
    """What a file's reviews hold, in a few buffers (see Reviews): the ids' and documents' UTF-8
    bytes end to end with the offset where each ends, the labels and line numbers as arrays. A
    JSONL document is its pieces, each ending at an offset of `piece_ends`; `doc_ends` then counts
    pieces."""

    def __init__(self, path, pieces):
        self.path, self.pieces = path, pieces
        self.skipped = 0  # reviews with an empty document, left out
        self.ids, self.id_ends = bytearray(), array("q")
        self.docs, self.doc_ends, self.piece_ends = bytearray(), array("q"), array("q")
        self.labels, self.lines = array("q"), array("q")

    def add(self, id_, doc, label, line_no):
        """Keep one review: id_ as UTF-8 bytes; doc as UTF-8 bytes (TSV) or a list of str pieces."""
        self.ids += id_
        self.id_ends.append(len(self.ids))
        if self.pieces:
            for piece in doc:
                try:
                    self.docs += piece.encode("utf-8")
                except UnicodeEncodeError as error:  # JSON's "\ud800": SentencePiece cannot take it
                    raise ValueError(
                        f"{self.path} line {line_no}: piece {shown(piece)} holds a lone surrogate "
                        f"(U+{ord(piece[error.start]):04X}), which is not text a vocab holds"
                    ) from None
                self.piece_ends.append(len(self.docs))
            self.doc_ends.append(len(self.piece_ends))
        else:
            self.docs += doc
            self.doc_ends.append(len(self.docs))
        self.labels.append(label)
        self.lines.append(line_no)

    def doc(self, k):
        """Review k's document: its text, or its pieces."""
        start, end = self.doc_ends[k - 1] if k else 0, self.doc_ends[k]
        if not self.pieces:
            return self.docs[start:end].decode("utf-8")
        bounds = [self.piece_ends[start - 1] if start else 0, *self.piece_ends[start:end]]
        return [self.docs[a:b].decode("utf-8") for a, b in itertools.pairwise(bounds)]

    def review(self, k):
        id_ = self.ids[self.id_ends[k - 1] if k else 0 : self.id_ends[k]].decode("utf-8", SURROGATES)
        return Review(id_, self.doc(k), self.labels[k], self.lines[k])


class Reviews(collections.abc.Sequence):
    """A file's reviews, kept compactly (_Store: about the file's size, where a list of Review
    would take ten times it): reviews[i] is a Review made when asked for, equal to the one a list
    would hold; `labels` is an array of every label, `texts()` the documents, `take(indices)` a view
    of some of them (no copy). `sha256`: the digest of the file's bytes. Equal to a list of the
    same Reviews."""

    def __init__(self, store, sha256=None, index=None):
        self._store, self.sha256, self._index = store, sha256, index

    @property
    def pieces(self):
        """Whether the documents are SentencePiece pieces (JSONL), not texts."""
        return self._store.pieces

    @property
    def skipped(self):
        """The file's reviews left out for an empty document (of the whole file, also in a view)."""
        return self._store.skipped

    def __len__(self):
        return len(self._store.labels) if self._index is None else len(self._index)

    def _positions(self):
        return range(len(self._store.labels)) if self._index is None else self._index

    def __getitem__(self, i):
        if isinstance(i, slice):
            return self.take(range(len(self))[i])
        return self._store.review(self._positions()[i])

    def __iter__(self):
        return map(self._store.review, self._positions())

    def __eq__(self, other):
        return (
            isinstance(other, collections.abc.Sequence)
            and len(self) == len(other)
            and all(a == b for a, b in zip(self, other))
        )

    __hash__ = None

    def __repr__(self):
        return f"Reviews({len(self)} from {self._store.path})"

    @property
    def labels(self):
        labels = self._store.labels
        return labels if self._index is None else array("q", map(labels.__getitem__, self._index))

    def texts(self):
        """The documents, in order: texts (TSV), or lists of pieces (JSONL)."""
        return map(self._store.doc, self._positions())

    def take(self, indices):
        """The reviews at `indices`, in their order, as a view of these."""
        positions = self._positions()
        return Reviews(self._store, self.sha256, array("q", (positions[i] for i in indices)))


def read_nsmc(path, what="data", progress=False):
    """Reviews from an NSMC-format TSV file; rows whose document is empty are skipped."""
    return _read(path, what, False, progress)


def read_jsonl(path, what="data", progress=False):
    """Reviews from the tutorial's JSONL: {"id", "doc": [pieces], "label"} per line."""
    return _read(path, what, True, progress)


def _read(path, what, jsonl, progress):
    lines = _Lines(path, f"{what} file", jsonl, progress)
    store = _Store(path, jsonl)
    (_add_jsonl if jsonl else _add_nsmc)(lines, store, path)
    return Reviews(store, lines.sha256)


def _add_nsmc(lines, store, path):
    """Parse an NSMC TSV's lines into `store`."""
    rows = iter(lines)
    header = None
    for line_no, raw, _ in rows:
        text = _decode(raw, path, line_no)
        if text.strip():
            header = text
            break
    if header is None:
        raise ValueError(f"{lines.what} {path} is empty{' (only white space)' if lines.size else ''}")
    if tuple(h.strip() for h in header.split("\t")) != TSV_COLUMNS:
        got = cut(", ".join(header.split("\t")), 80)
        raise ValueError(f"{path}: expected a TSV header with columns {', '.join(TSV_COLUMNS)}, got {got}")
    before = b"\n"  # the break before the line
    for line_no, raw, end in rows:
        text = _decode(raw, path, line_no)
        if text.strip():
            if "\0" in text:
                raise ValueError(f"{path} line {line_no}: holds a NUL byte; a review file is text")
            row = text.split("\t")
            if len(row) != 3:
                lone_cr = b"\r" in (before, end)
                raise ValueError(
                    f"{path} line {line_no}: expected 3 tab-separated fields, got {len(row)}"
                    + (_LONE_CR if lone_cr else "")
                )
            if row[1].strip():
                id_, document, _ = raw.split(b"\t")  # a tab is one byte in UTF-8: the fields' own bytes
                store.add(id_, document, _label(row[2], path, line_no), line_no)
            else:
                store.skipped += 1
        before = end


_LONE_CR = (
    "; a carriage return (\\r) alone ends a line, as a line break does: one inside a document splits its "
    "row (remove it, or end the file's lines with \\n)"
)


def _add_jsonl(lines, store, path):
    """Parse a JSONL file's lines into `store`."""
    for line_no, raw, _ in lines:
        line = _decode(raw, path, line_no)
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            if _is_json_file(path):
                raise ValueError(f"{path}: one JSON value over several lines; fastformer reads {JSON_LINES}") from None
            raise ValueError(f"{path} line {line_no}: not JSON ({error.msg})") from None
        except (ValueError, RecursionError) as error:  # an integer of over 4300 digits; nesting too deep
            reason = "nested too deeply" if isinstance(error, RecursionError) else str(error).split(";")[0]
            raise ValueError(f"{path} line {line_no}: not JSON that fastformer reads ({reason})") from None
        missing = [key for key in ("id", "doc", "label") if not isinstance(record, dict) or key not in record]
        if missing:
            raise ValueError(f"{path} line {line_no}: expected keys id, doc, label; missing {', '.join(missing)}")
        doc = record["doc"]
        if not isinstance(doc, list) or not all(isinstance(p, str) for p in doc):
            raise ValueError(f"{path} line {line_no}: doc must be a list of SentencePiece pieces")
        label = _label(record["label"], path, line_no)  # checked on a skipped review too
        if not any(p.strip() for p in doc):
            store.skipped += 1
            continue
        store.add(str(record["id"]).encode("utf-8", SURROGATES), doc, label, line_no)


def read_reviews(path, what="data", n_classes=None, progress=False):
    """Read a TSV or JSONL file (told apart by the first character that is not white space) as
    Reviews, in one pass that also hashes it (Reviews.sha256), and check it is usable: not empty,
    and every label in 0..n_classes-1 when n_classes is given. `progress`: a bar in bytes when the
    reading takes more than a few seconds."""
    first = _first_character(path, f"{what} file")
    if first == "[" and _is_json_file(path):
        raise ValueError(f"{path}: a JSON array; fastformer reads {JSON_LINES}")
    reviews = _read(path, what, first == "{", progress)
    if not reviews:
        empty = f" but {reviews.skipped} with an empty document" if reviews.skipped else ""
        raise ValueError(f"{what} file {path} has no reviews{empty}")
    if reviews.skipped:
        warnings.warn(
            f"{what} file {path}: {reviews.skipped} review{'s' if reviews.skipped > 1 else ''} with an empty "
            f"document skipped ({len(reviews)} read)",
            stacklevel=2,
        )
    if n_classes is not None:
        check_labels(reviews, n_classes, f"{what} file {path}")
    return reviews


def _first_character(path, what):
    """The first character of a file that is not white space, after a byte-order mark ("" if none):
    what tells a JSONL file from a TSV one."""
    start = True
    for chunk in _chunks(path, what):
        if start:
            chunk, start = chunk.removeprefix(BOM), False
        stripped = chunk.lstrip()
        if stripped:
            return stripped[:1].decode("latin-1")
    return ""


def _is_json_file(path):
    """Whether a file is one JSON value (for errors only: it reads and parses the whole file)."""
    try:
        json.loads(read_bytes(path, "data file").decode("utf-8-sig"))
    except (ValueError, RecursionError):
        return False
    return True


def _where(review, source):
    return source if review.line is None else f"{source} line {review.line}"


def _labels(reviews):
    """Every review's label, in order: a Reviews' array, or each Review's."""
    return reviews.labels if isinstance(reviews, Reviews) else [review.label for review in reviews]


def review_key(doc):
    """What two reviews share when they are the same review saved another way: the text (a JSONL
    doc's pieces joined, the word-boundary mark a space), in Unicode's NFKC form, case-folded, its
    runs of white space one space, stripped; hashed (16 bytes), so a large train file's keys are few
    bytes each. Line endings (CRLF), a byte-order mark, quoting's spacing and case do not tell two
    copies apart."""
    text = doc if isinstance(doc, str) else "".join(doc).replace("\u2581", " ")
    text = " ".join(unicodedata.normalize("NFKC", text).casefold().split())
    return hashlib.blake2b(text.encode("utf-8", SURROGATES), digest_size=16).digest()


def shared_reviews(train, test):
    """How many of `test`'s reviews are also `train`'s (by review_key): a test accuracy counts
    those as reviews the model has learnt."""
    seen = set(map(review_key, train.texts()))
    return sum(review_key(doc) in seen for doc in test.texts())


def check_labels(reviews, n_classes, source):
    """Raise ValueError naming the line (when known) and review of the first label outside
    0..n_classes-1."""
    bad = next((i for i, label in enumerate(_labels(reviews)) if not 0 <= label < n_classes), None)
    if bad is not None:
        review = reviews[bad]
        raise ValueError(
            f"{_where(review, source)}: review {cut(review.id)} has label {review.label}, "
            f"outside the {n_classes} classes 0..{n_classes - 1}"
        )


def infer_classes(reviews, source):
    """The number of classes K when the labels are 0..K-1 with every class present; otherwise
    ValueError naming a negative label's line, or the classes no review has."""
    labels = _labels(reviews)
    negative = next((i for i, label in enumerate(labels) if label < 0), None)
    if negative is not None:
        review = reviews[negative]
        raise ValueError(
            f"{_where(review, source)}: review {cut(review.id)} has label {review.label}; classes are 0, 1, ..."
        )
    n_classes = max(labels) + 1
    absent = absent_classes(labels, n_classes)
    if absent:
        raise ValueError(
            f"{source}: labels go up to {n_classes - 1} but no review has label {absent}; to infer the classes, "
            "the labels must be 0..K-1 with every class present"
        )
    return n_classes


def absent_classes(labels, n_classes, shown=3):
    """The classes 0..n_classes-1 that none of `labels` (an iterable of int) is, for a message ("1",
    "1, 2, 4 or 5 more"), or "" when each is one. It looks at no more classes than there are labels
    and `shown`."""
    present = {label for label in set(labels) if 0 <= label < n_classes}
    first = list(itertools.islice((c for c in range(n_classes) if c not in present), shown))
    more = n_classes - len(present) - len(first)
    return ", ".join(map(str, first)) + (f" or {more} more" if more else "")
