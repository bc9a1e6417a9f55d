"""Labelled review files, read and checked without torch: NSMC TSV and the tutorial's JSONL.

Two file formats are read, as UTF-8 (a byte-order mark is skipped), lines of any length:
- NSMC TSV (ratings_train.txt): a header `id<TAB>document<TAB>label`, one review per line. Rows with
  an empty document are skipped, as the tutorial skips them.
- The tutorial's JSONL (ratings_train.json): one `{"id", "doc": [pieces...], "label"}` per line.

A label is a class number 0, 1, ...: an integer, which may be written with a zero fraction (`1.0`,
as spreadsheets and pandas write integers); `0.9`, `1.5`, `yes`, `true` and an empty label are
refused, never rounded. Every error is a ValueError or OSError of one line naming the file and,
where there is one, the line and the value.
"""

import decimal
import hashlib
import itertools
import json
import math
import os
import re
from typing import NamedTuple

TSV_COLUMNS = ("id", "document", "label")
LINE_BREAK = re.compile(r"\r\n|\r|\n")  # what the csv module, which read the TSV before, takes for a line end
JSON_LINES = 'JSON Lines: one {"id", "doc", "label"} object per line'
MAX_LABEL_DIGITS = 18  # a class number has fewer; a longer one is refused before it becomes a huge int


class Review(NamedTuple):
    id: str
    doc: str | list[str]  # raw text (TSV) or SentencePiece pieces (JSONL)
    label: int
    line: int | None = None  # where the review is in its file, for error messages


def check_file(path, what):
    """Raise FileNotFoundError or ValueError unless `path` is a regular file; `what` names it in the
    message ("train file", "config file")."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"{what} not found: {path}")
    if os.path.isdir(path):
        raise ValueError(f"{what} {path} is a directory, not a file")
    if not os.path.isfile(path):
        raise ValueError(f"{what} {path} is not a regular file")


def read_bytes(path, what):
    """The bytes of the regular file `path`, or a one-line error naming it."""
    check_file(path, what)
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as error:
        raise OSError(f"could not read {path}: {error.strerror or error}") from None


def file_sha256(path, what):
    """The sha256 of the bytes of the regular file `path`, as hex."""
    return hashlib.sha256(read_bytes(path, what)).hexdigest()


def cut(text, limit=40):
    """`text` cut to about `limit` characters, for messages."""
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


def shown(value, limit=40):
    """repr(value), cut to about `limit` characters, for messages."""
    return cut(repr(value), limit)


def parse_label(value):
    """The class number a label holds, or None when it is not an integer: an int (not a bool), a
    float with no fraction, or text that reads as one (`1`, `-1`, `1.0`; exactly, so that
    `1.0000000000000001` is not 1). Text of an integer with MAX_LABEL_DIGITS digits or more raises
    _HugeLabel before it becomes a huge int."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return int(value) if math.isfinite(value) and value.is_integer() else None
    if not isinstance(value, str) or "_" in value:
        return None
    try:
        number = decimal.Decimal(value.strip())
    except decimal.InvalidOperation:
        return None
    if not number.is_finite() or number != number.to_integral_value():
        return None
    if number.adjusted() >= MAX_LABEL_DIGITS:
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


def _decode(data, path):
    """The text of a file's bytes: UTF-8, without a byte-order mark; a byte that is not UTF-8 raises
    ValueError naming the file and line."""
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1
        raise ValueError(
            f"{path} line {line}: not UTF-8 (byte 0x{data[error.start]:02x}); save the file as UTF-8"
        ) from None


def read_nsmc(path, what="data"):
    """Reviews from an NSMC-format TSV file; rows whose document is empty are skipped."""
    return _parse_nsmc(_decode(read_bytes(path, f"{what} file"), path), path)


def _parse_nsmc(text, path):
    lines = enumerate(LINE_BREAK.split(text), start=1)
    header = next((line for _, line in lines if line.strip()), None)
    if header is None or tuple(h.strip() for h in header.split("\t")) != TSV_COLUMNS:
        got = None if header is None else ", ".join(header.split("\t"))
        got = got if got is None else cut(got, 80)
        raise ValueError(f"{path}: expected a TSV header with columns {', '.join(TSV_COLUMNS)}, got {got}")
    reviews = []
    for line_no, line in lines:
        if not line.strip():
            continue
        if "\0" in line:
            raise ValueError(f"{path} line {line_no}: holds a NUL byte; a review file is text")
        row = line.split("\t")
        if len(row) != 3:
            raise ValueError(
                f"{path} line {line_no}: expected 3 tab-separated fields, got {len(row)}"
                + (_LONE_CR if _lone_cr_beside(text, line_no) else "")
            )
        id_, document, label = row
        if not document.strip():
            continue
        reviews.append(Review(id_, document, _label(label, path, line_no), line_no))
    return reviews


_LONE_CR = (
    "; a carriage return (\\r) alone ends a line, as a line break does: one inside a document splits its "
    "row (remove it, or end the file's lines with \\n)"
)


def _lone_cr_beside(text, line_no):
    """Whether line `line_no` (from 1, as LINE_BREAK splits text) begins or ends at a carriage
    return alone (for errors only: it splits the whole text again, keeping the breaks)."""
    breaks = [*re.split(f"({LINE_BREAK.pattern})", text)[1::2], ""]
    return "\r" in (breaks[line_no - 1], breaks[line_no - 2] if line_no > 1 else "")


def read_jsonl(path, what="data"):
    """Reviews from the tutorial's JSONL: {"id", "doc": [pieces], "label"} per line."""
    return _parse_jsonl(_decode(read_bytes(path, f"{what} file"), path), path)


def _parse_jsonl(text, path):
    reviews = []
    for line_no, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            if _is_json(text):
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
        reviews.append(Review(str(record["id"]), doc, _label(record["label"], path, line_no), line_no))
    return reviews


def read_reviews(path, what="data", n_classes=None):
    """Read a TSV or JSONL file (told apart by the first character that is not white space) and
    check it is usable:
    not empty, and every label in 0..n_classes-1 when n_classes is given."""
    text = _decode(read_bytes(path, f"{what} file"), path)
    first = text[_LEADING_SPACE.match(text).end() :][:1]  # blank lines and spaces before it skipped
    if first == "[" and _is_json(text):
        raise ValueError(f"{path}: a JSON array; fastformer reads {JSON_LINES}")
    reviews = _parse_jsonl(text, path) if first == "{" else _parse_nsmc(text, path)
    if not reviews:
        raise ValueError(f"{what} file {path} has no reviews")
    if n_classes is not None:
        check_labels(reviews, n_classes, f"{what} file {path}")
    return reviews


_LEADING_SPACE = re.compile(r"\s*")


def _is_json(text):
    """Whether text is one JSON value (for errors only: it parses the whole text)."""
    try:
        json.loads(text)
    except (ValueError, RecursionError):
        return False
    return True


def _where(review, source):
    return source if review.line is None else f"{source} line {review.line}"


def check_labels(reviews, n_classes, source):
    """Raise ValueError naming the line (when known) and review of the first label outside
    0..n_classes-1."""
    bad = next((r for r in reviews if not 0 <= r.label < n_classes), None)
    if bad is not None:
        raise ValueError(
            f"{_where(bad, source)}: review {cut(bad.id)} has label {bad.label}, "
            f"outside the {n_classes} classes 0..{n_classes - 1}"
        )


def infer_classes(reviews, source):
    """The number of classes K when the labels are 0..K-1 with every class present; otherwise
    ValueError naming a negative label's line, or the classes no review has."""
    negative = next((r for r in reviews if r.label < 0), None)
    if negative is not None:
        raise ValueError(
            f"{_where(negative, source)}: review {cut(negative.id)} has label {negative.label}; classes are 0, 1, ..."
        )
    present = {r.label for r in reviews}
    n_classes = max(present) + 1
    if len(present) < n_classes:
        absent = list(itertools.islice((c for c in range(n_classes) if c not in present), 3))
        more = n_classes - len(present) - len(absent)
        raise ValueError(
            f"{source}: labels go up to {n_classes - 1} but no review has label {', '.join(map(str, absent))}"
            f"{f' or {more} more' if more else ''}; to infer the classes, the labels must be 0..K-1 with "
            "every class present"
        )
    return n_classes
