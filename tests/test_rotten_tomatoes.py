"""`fastformer data rotten-tomatoes` on archives built here with the real one's layout (no network):
the conversion and its split, the digest pin, the pip step, one-line errors that leave no files,
and `fastformer train --dataset rotten-tomatoes`. One test, marked `network`, downloads the real
sdist (`pytest -m network`)."""

import hashlib
import io
import json
import os
import subprocess
import tarfile

import pytest

from fastformer.cli import main
from fastformer.data import read_reviews, rotten_tomatoes
from tests.helpers import TINY

# (id, rating, sentence): ids 20, 21, 22 and 40 go to test (id mod 20 is 0, 1 or 2); 5 is rated 0 and dropped
SNIPPETS = [
    (3, -0.6, "Effective but too tepid biopic"),
    (4, 1.46666666667, "If you sometimes like to go to the movies to have fun, Wasabi is a good place to start."),
    (5, 0.0, "A film about a man."),
    (6, -3.875, 'Could turn an Imax theater into a 9" black and white portable TV.'),
    (7, 1.36, "Münch's genuine insight makes the film's occasional overindulgence forgivable."),
    (8, 2.26666666667, "The Rock is destined to be the 21st Century's new ''Conan''."),
    (9, 3.5, "The gorgeously elaborate continuation of ''The Lord of the Rings'' trilogy is so huge."),
    (20, -1.8125, "Her fans walked out muttering words like ''horrible'' and ''terrible.''"),
    (21, 2.9375, "Jirí Hubac's script is a gem."),
    (22, -2.1, "A waste of two hours."),
    (40, 0.4, "Not bad at all."),
]


def snippets_text(rows=SNIPPETS):
    """The ground-truth file as the archive has it: tab-separated, CRLF, no newline at the end."""
    return "\r\n".join(f"{i}\t{r}\t{s}" for i, r, s in rows).encode("utf-8")


def tar_gz(members):
    """A tar.gz in memory of {name: bytes, or a TarInfo for members that are not regular files}."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for name, content in members.items():
            if isinstance(content, tarfile.TarInfo):
                archive.addfile(content)
            else:
                info = tarfile.TarInfo(name)
                info.size = len(content)
                archive.addfile(info, io.BytesIO(content))
    return buffer.getvalue()


def data_archive(snippets=None, extra=None):
    """hutto_ICWSM_2014.tar.gz's layout: a folder holding the ground-truth file (and others)."""
    return tar_gz(
        {
            "hutto_ICWSM_2014/_README_.txt": b"readme",
            rotten_tomatoes.SNIPPETS: snippets_text() if snippets is None else snippets,
            **(extra or {}),
        }
    )


def sdist(inner=None, extra=None):
    """vaderSentiment-3.3.2.tar.gz's layout, with `inner` as its hutto_ICWSM_2014.tar.gz."""
    return tar_gz(
        {
            "vaderSentiment-3.3.2/setup.py": b"raise SystemExit('never run')\n",
            rotten_tomatoes.DATA_MEMBER: data_archive() if inner is None else inner,
            **(extra or {}),
        }
    )


@pytest.fixture
def pinned(tmp_path, monkeypatch):
    """write(data, name) saves an archive and pins its digest as the sdist's; returns its path."""

    def write(data, name=rotten_tomatoes.SDIST, pin="SDIST_SHA256"):
        path = tmp_path / "archives" / name
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(data)
        monkeypatch.setattr(rotten_tomatoes, pin, hashlib.sha256(data).hexdigest())
        return str(path)

    return write


def convert(source, cache, capsys):
    """`fastformer data rotten-tomatoes --from source --cache cache`: (exit status, stdout, stderr)."""
    code = main(["data", "rotten-tomatoes", "--cache", str(cache), "--from", str(source)])
    out, err = capsys.readouterr()
    return code, out, err


def test_converts_to_nsmc_files_with_the_fixed_split(pinned, tmp_path, capsys):
    cache = tmp_path / "cache"
    code, out, err = convert(pinned(sdist()), cache, capsys)
    assert code == 0, err
    assert sorted(os.listdir(cache)) == ["test.tsv", "train.tsv"]
    train = (cache / "train.tsv").read_text(encoding="utf-8")
    assert train.splitlines()[:2] == ["id\tdocument\tlabel", "3\tEffective but too tepid biopic\t0"]
    assert [(r.id, r.label) for r in read_reviews(str(cache / "train.tsv"))] == [
        ("3", 0),
        ("4", 1),
        ("6", 0),
        ("7", 1),
        ("8", 1),
        ("9", 1),
    ]
    assert [(r.id, r.label) for r in read_reviews(str(cache / "test.tsv"))] == [
        ("20", 0),
        ("21", 1),
        ("22", 0),
        ("40", 1),
    ]
    assert read_reviews(str(cache / "train.tsv"))[2].doc == SNIPPETS[3][2]  # quotes kept as they are
    assert out.splitlines()[0] == (
        "Rotten Tomatoes snippets (vaderSentiment 3.3.2, MIT licence): 11 sentences, "
        "6 positive, 4 negative, 1 rated 0 (dropped)"
    )
    assert out.splitlines()[1:3] == [
        f"  train.tsv     6 reviews (4 positive, 2 negative)  {cache}/train.tsv",
        f"  test.tsv      4 reviews (2 positive, 2 negative)  {cache}/test.tsv",
    ]
    assert out.splitlines()[-1].startswith(f"Train on it: fastformer train --train {cache}/train.tsv --test ")
    before = {name: (cache / name).read_bytes() for name in ("train.tsv", "test.tsv")}
    assert convert(pinned(sdist()), cache, capsys)[0] == 0
    assert before == {name: (cache / name).read_bytes() for name in ("train.tsv", "test.tsv")}  # deterministic


def test_the_command_to_train_on_a_cache_with_a_space_pastes_back(pinned, tmp_path, capsys):
    import shlex

    cache = tmp_path / "my cache"
    code, out, err = convert(pinned(sdist()), cache, capsys)
    assert code == 0, err
    words = shlex.split(out.splitlines()[-1].removeprefix("Train on it: "))
    assert words == ["fastformer", "train", "--train", f"{cache}/train.tsv", "--test", f"{cache}/test.tsv"]


def test_the_inner_archive_converts_too(pinned, tmp_path, capsys):
    source = pinned(data_archive(), name=rotten_tomatoes.DATA_ARCHIVE, pin="DATA_SHA256")
    code, _, err = convert(source, tmp_path / "cache", capsys)
    assert code == 0, err
    assert len(read_reviews(str(tmp_path / "cache" / "train.tsv"))) == 6


def test_the_default_cache_follows_xdg_and_the_command_says_how_to_train(pinned, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert main(["data", "rotten-tomatoes", "--from", pinned(sdist())]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "Train on it: fastformer train --dataset rotten-tomatoes"
    assert os.path.isfile(tmp_path / "xdg" / "fastformer" / "rotten-tomatoes" / "test.tsv")


class FakePip:
    """subprocess.run for `pip download`: copies `archive` to the -d folder, or fails with `output`."""

    def __init__(self, archive=None, output="", returncode=0):
        self.archive, self.output, self.returncode, self.commands = archive, output, returncode, []

    def __call__(self, command, **kwargs):
        self.commands.append(command)
        if self.archive is not None:
            folder = command[command.index("-d") + 1]
            with open(os.path.join(folder, rotten_tomatoes.SDIST), "wb") as f:
                f.write(self.archive)
        return subprocess.CompletedProcess(command, self.returncode, stdout="", stderr=self.output)


def test_download_runs_pip_with_the_pinned_hash_once(pinned, tmp_path, monkeypatch, capsys):
    archive = sdist()
    pinned(archive)
    pip = FakePip(archive)
    monkeypatch.setattr(rotten_tomatoes.subprocess, "run", pip)
    cache = tmp_path / "cache"
    assert main(["data", "rotten-tomatoes", "--cache", str(cache)]) == 0
    (command,) = pip.commands
    assert command[1:6] == ["-m", "pip", "download", "--no-deps", "--no-binary"]
    assert "--require-hashes" in command and command[command.index("-d") + 1] == str(cache)
    assert set(os.listdir(cache)) == {rotten_tomatoes.SDIST, "test.tsv", "train.tsv"}
    assert main(["data", "rotten-tomatoes", "--cache", str(cache)]) == 0
    assert len(pip.commands) == 1  # the cached sdist, its digest checked, is used again
    assert "Downloading" in capsys.readouterr().out


@pytest.mark.parametrize(
    "output, message",
    [
        (
            "ERROR: Could not find a version that satisfies the requirement vaderSentiment==3.3.2 "
            "(from versions: none)\n"
            "ERROR: No matching distribution found for vaderSentiment==3.3.2\n",
            "No matching distribution found for vaderSentiment==3.3.2; with the file at hand, pass --from",
        ),
        (
            "ERROR: THESE PACKAGES DO NOT MATCH THE HASHES FROM THE REQUIREMENTS FILE.\n"
            "    vaderSentiment==3.3.2 from x:\n"
            "        Expected sha256 5d7c\n             Got        0123abcd\n",
            "the archive the index served has sha256 0123abcd, not the pinned",
        ),
    ],
)
def test_a_failed_download_is_one_line_exit_2_and_leaves_nothing(tmp_path, monkeypatch, capsys, output, message):
    monkeypatch.setattr(rotten_tomatoes.subprocess, "run", FakePip(output=output, returncode=1))
    cache = tmp_path / "cache"
    assert main(["data", "rotten-tomatoes", "--cache", str(cache)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fastformer data: error: pip download vaderSentiment==3.3.2 failed: ")
    assert err.count("\n") == 1
    assert message in err, err
    assert os.listdir(cache) == []


def symlink(name):
    info = tarfile.TarInfo(name)
    info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
    return info


def bad_archives():
    """(archive bytes, message) per damaged or malformed archive; each is pinned before it is converted."""
    rows = SNIPPETS[:2]
    where = f"{rotten_tomatoes.DATA_MEMBER}: {rotten_tomatoes.SNIPPETS}"
    malformed = [
        (
            snippets_text(rows) + b"\r\n5\tno rating",
            "line 3: expected id, rating and sentence separated by tabs, got 2 field(s)",
        ),
        (snippets_text([*rows, (5, "4.5", "too good")]), "line 3: rating '4.5' is not a number from -4 to 4"),
        (snippets_text([*rows, (5, "high", "too good")]), "line 3: rating 'high' is not a number from -4 to 4"),
        (snippets_text([*rows, (4, 1.0, "again")]), "line 3: id '4' repeats an earlier id"),
        (snippets_text([*rows, (5, 1.0, "  ")]), "line 3: the sentence is empty"),
        (snippets_text(rows) + "\r\n5\t1.0\tcaf\xe9".encode("latin-1"), "line 3: not UTF-8 (byte 0xe9)"),
        (b"\r\n", "holds no sentences"),
    ]
    return [(sdist(data_archive(text)), f"{where} {message}") for text, message in malformed] + [
        (b"not gzip at all", "not a readable tar.gz archive"),
        (sdist()[:-300], "damaged archive"),  # truncated
        (tar_gz({"vaderSentiment-3.3.2/setup.py": b""}), f"has no {rotten_tomatoes.DATA_MEMBER}"),
        (
            sdist(extra={"vaderSentiment-3.3.2/../../evil.py": b""}),
            "refusing an archive with the member path 'vaderSentiment-3.3.2/../../evil.py'",
        ),
        (sdist(extra={"/etc/cron.d/evil": b""}), "refusing an archive with the member path '/etc/cron.d/evil'"),
        (sdist(data_archive(extra={"hutto_ICWSM_2014\\..\\evil": b""})), "refusing an archive with the member path"),
        (
            sdist(tar_gz({rotten_tomatoes.SNIPPETS: symlink(rotten_tomatoes.SNIPPETS)})),
            f"{rotten_tomatoes.SNIPPETS} is not a regular file",
        ),
    ]


def test_bad_archives_are_one_line_exit_2_and_leave_the_old_files(pinned, tmp_path, capsys):
    cache = tmp_path / "cache"
    assert convert(pinned(sdist()), cache, capsys)[0] == 0
    before = {name: (cache / name).read_bytes() for name in os.listdir(cache)}
    unpinned = tmp_path / "other.tar.gz"
    unpinned.write_bytes(sdist(extra={"x": b"another archive"}))
    digest = hashlib.sha256(unpinned.read_bytes()).hexdigest()
    cases = [
        *bad_archives(),
        (unpinned, f"{unpinned}: sha256 {digest} is neither {rotten_tomatoes.SDIST}'s"),
        (tmp_path / "missing.tar.gz", f"--from {tmp_path / 'missing.tar.gz'}: no such file"),
    ]
    for source, message in cases:
        code, out, err = convert(pinned(source) if isinstance(source, bytes) else source, cache, capsys)
        assert code == 2, (message, out)
        assert err.startswith("fastformer data: error: ") and err.count("\n") == 1, err
        assert message in err, (message, err)
        assert {name: (cache / name).read_bytes() for name in os.listdir(cache)} == before, message


def test_a_failed_write_leaves_no_partial_file(pinned, tmp_path, monkeypatch, capsys):
    cache = tmp_path / "cache"
    real_replace = os.replace

    def replace(src, dst):
        if dst.endswith("test.tsv"):
            raise OSError(28, "No space left on device")
        real_replace(src, dst)

    monkeypatch.setattr(rotten_tomatoes.os, "replace", replace)
    code, _, err = convert(pinned(sdist()), cache, capsys)
    assert code == 2 and err == f"fastformer data: error: could not write {cache}/test.tsv: No space left on device\n"
    assert not any(name.endswith(".tmp") for name in os.listdir(cache))


def test_train_on_the_dataset(pinned, tmp_path, monkeypatch, capsys):
    """`fastformer train --dataset rotten-tomatoes` reads the converted files from the default cache."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps(TINY))
    args = [
        "train",
        "--dataset",
        "rotten-tomatoes",
        "--config",
        str(config),
        "--vocab-size",
        "60",
        "--max-steps",
        "1",
        "--batch-size",
        "4",
        "--device",
        "cpu",
        "--out",
        str(tmp_path / "run"),
    ]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("fastformer train: error: --dataset rotten-tomatoes: ") and err.count("\n") == 1
    assert "train.tsv not found; run `fastformer data rotten-tomatoes` first" in err
    assert main(["data", "rotten-tomatoes", "--from", pinned(sdist())]) == 0
    assert main([*args, "--train", str(tmp_path / "xdg" / "fastformer" / "rotten-tomatoes" / "train.tsv")]) == 2
    assert "--dataset rotten-tomatoes and --train/--test are alternatives" in capsys.readouterr().err
    assert main(args) == 0
    assert "6 train / 4 test reviews (Rotten Tomatoes snippets)" in capsys.readouterr().out
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    files = rotten_tomatoes.split_files()
    assert (run["dataset"], run["train"], run["test"]) == ("rotten-tomatoes", files["train"], files["test"])


@pytest.mark.network
def test_the_real_download(tmp_path, capsys):
    """pip downloads vaderSentiment 3.3.2 from the package index; its digest is the pinned one and
    the conversion gives the counts the module documents."""
    counts = rotten_tomatoes.prepare(cache=str(tmp_path))
    assert rotten_tomatoes.sha256(str(tmp_path / rotten_tomatoes.SDIST)) == rotten_tomatoes.SDIST_SHA256
    assert counts == {
        "sentences": 10605,
        "zero": 37,
        "train": 8985,
        "train_positive": 4449,
        "test": 1583,
        "test_positive": 793,
    }
