"""Peak memory of reading a large review file, on a CPU: `python -m tools.corpus_memory`.

    python -m tools.corpus_memory                             # a generated 200 MB TSV: tools/results/corpus_memory.json
    python -m tools.corpus_memory --mb 2 --json /tmp/c.json   # a small one (the CI test)
    python -m tools.corpus_memory --file ratings_train.txt    # a file of your own

The file (generated with the demo set's grammar, `fastformer.data.demo`, unless --file names one)
goes through what `fastformer train` does with it, each stage in one fresh process, and each
stage's peak resident memory (ru_maxrss) is given over the process's memory once torch, fastformer
and a vocab are loaded, in bytes per byte of the file:

  read     read_reviews: the file streamed, parsed and hashed in one pass, kept as Reviews, its
           labels checked
  encode   then MovieDataSet over those reviews, with a vocab trained on the demo set beforehand
  vocab    (in a process of its own) train_vocab on the file's texts, which SentencePiece holds
           itself; with --vocab only, it takes minutes on a large file

The stages run with their progress bars on, as the job shows them. A benchmark, not a timed test:
tests/test_corpus_memory.py runs it on a small file and checks the report, not the figures.
"""

import argparse
import json
import os
import platform
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tools import write_report

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "tools" / "results" / "corpus_memory.json"


def generate(path, megabytes, seed=0):
    """A TSV of about `megabytes` MB in NSMC's format, its reviews from the demo set's grammar."""
    from fastformer.data import demo

    rng = random.Random(seed)
    target, written, next_id = megabytes * 1_000_000, 0, 1
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        written += f.write("id\tdocument\tlabel\n")
        while written < target:
            label = next_id % 2
            written += f.write(f"{next_id}\t{demo.review(rng, label)}\t{label}\n")
            next_id += 1
    return next_id - 1


def _peak():
    """The process's peak resident memory so far, in bytes (ru_maxrss is KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _stage(stage, path, vocab_file):
    """Run in a fresh process: the stage's measurements, as JSON on stdout."""
    import torch  # noqa: F401  (loaded before the baseline, as in the job)

    from fastformer.data.files import check_labels, read_reviews
    from fastformer.data.reviews import MovieDataSet
    from fastformer.data.vocab import load_vocab, train_vocab

    vocab = load_vocab(vocab_file)
    baseline = _peak()
    found = {"baseline_bytes": baseline}
    start = time.perf_counter()
    if stage == "vocab":
        reviews = read_reviews(path, "train", progress=True)
        found["read_peak_bytes"] = _peak() - baseline
        train_vocab(reviews.texts(), os.path.join(os.path.dirname(vocab_file), "corpus.model"), progress=True)
        found["vocab_peak_bytes"] = _peak() - baseline
    else:
        reviews = read_reviews(path, "train", progress=True)
        check_labels(reviews, 2, f"train file {path}")
        found["read_peak_bytes"] = _peak() - baseline
        found["reviews"] = len(reviews)
        found["read_seconds"] = time.perf_counter() - start
        if stage == "encode":
            dataset = MovieDataSet(vocab, reviews, max_len=128, progress=True)
            found["encode_peak_bytes"] = _peak() - baseline
            found["tokens"] = len(dataset.ids)
    found["seconds"] = time.perf_counter() - start
    print(json.dumps(found))


def _run_stage(stage, path, vocab_file):
    result = subprocess.run(
        [sys.executable, "-m", "tools.corpus_memory", "--stage", stage, str(path), str(vocab_file)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
        check=True,
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


def measure(path, with_vocab=False):
    """Every stage on the file at `path`; the JSON-ready report."""
    import sentencepiece
    import torch

    from fastformer.data import demo
    from fastformer.data.files import read_reviews
    from fastformer.data.vocab import train_vocab

    size = os.path.getsize(path)
    with tempfile.TemporaryDirectory() as scratch:
        vocab_file = os.path.join(scratch, "demo.model")
        train_vocab(read_reviews(demo.TRAIN_FILE).texts(), vocab_file)
        stages = {"read": _run_stage("read", path, vocab_file), "encode": _run_stage("encode", path, vocab_file)}
        if with_vocab:
            stages["vocab"] = _run_stage("vocab", path, vocab_file)
    per_byte = {
        "read": stages["read"]["read_peak_bytes"] / size,
        "encode": stages["encode"]["encode_peak_bytes"] / size,
    }
    if with_vocab:
        per_byte["vocab"] = stages["vocab"]["vocab_peak_bytes"] / size
    return {
        "schema": "fastformer.corpus_memory/1",
        "date": time.strftime("%Y-%m-%d"),
        "machine": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "sentencepiece": sentencepiece.__version__,
        "file_bytes": size,
        "reviews": stages["read"]["reviews"],
        "tokens": stages["encode"]["tokens"],
        "unit": "peak resident memory over the baseline of a process with torch, fastformer and a vocab loaded",
        "stages": stages,
        "peak_bytes_per_file_byte": per_byte,
    }


def table(report):
    mb = report["file_bytes"] / 1e6
    lines = [
        f"peak memory per byte of a {mb:,.1f} MB review file ({report['reviews']:,} reviews, {report['tokens']:,} "
        f"tokens), {report['date']}, torch {report['torch']}",
        "",
        "| stage | peak over baseline, MB | bytes per file byte | seconds |",
        "|---|---|---|---|",
    ]
    for stage, key in (("read", "read_peak_bytes"), ("encode", "encode_peak_bytes"), ("vocab", "vocab_peak_bytes")):
        if stage in report["stages"]:
            found = report["stages"][stage]
            lines.append(
                f"| {stage} | {found[key] / 1e6:,.1f} | {report['peak_bytes_per_file_byte'][stage]:.2f} | "
                f"{found['seconds']:.1f} |"
            )
    return "\n".join(lines)


def main(argv=None):
    if argv is None and sys.argv[1:2] == ["--stage"]:  # a stage's own process (_run_stage)
        _stage(*sys.argv[2:5])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=200, help="size of the generated file (default 200)")
    parser.add_argument("--file", type=Path, help="a review file of your own instead of a generated one")
    parser.add_argument("--vocab", action="store_true", help="also train a vocab on the file (minutes when large)")
    parser.add_argument("--json", type=Path, default=RESULTS, help=f"where the report goes (default {RESULTS})")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        path = args.file
        if path is None:
            path = Path(scratch) / "reviews.tsv"
            n = generate(path, args.mb)
            print(f"generated {n:,} reviews, {os.path.getsize(path) / 1e6:,.1f} MB: {path}", file=sys.stderr)
        report = measure(path, with_vocab=args.vocab)
    write_report(args.json, report, table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
