"""Data for the tutorial's sentiment job: the SentencePiece vocab, review files, the Dataset.

    vocab = train_vocab(texts, "vocab.model", n_pieces=8000)        # the tutorial's vocab
    train = MovieDataSet(vocab, "ratings_train.txt", max_len=256)    # NSMC TSV or the tutorial's JSONL
    loader = DataLoader(train, batch_size=128, collate_fn=movie_collate_fn)

The embedded demo set (`fastformer.data.demo.TRAIN_FILE`, `.TEST_FILE`) is generated, not real
data; see demo.py. Real English reviews: `fastformer.data.rotten_tomatoes.prepare()` (the command
`fastformer data rotten-tomatoes`) writes Rotten Tomatoes snippets as train.tsv and test.tsv.

The readers (fastformer.data.files) and the vocab need no torch, so that `fastformer train` checks
its files before torch is imported; the Dataset, collate and the samplers (fastformer.data.reviews)
are imported on first use.
"""

import importlib

from fastformer.data.files import Review, check_labels, infer_classes, read_jsonl, read_nsmc, read_reviews
from fastformer.data.vocab import N_SPECIAL, check_vocab_matches, load_vocab, train_vocab

_TORCH_EXPORTS = ("LengthBucketSampler", "MovieDataSet", "ShardedBatchSampler", "movie_collate_fn")

__all__ = [
    "N_SPECIAL",
    "LengthBucketSampler",
    "MovieDataSet",
    "Review",
    "ShardedBatchSampler",
    "check_labels",
    "check_vocab_matches",
    "infer_classes",
    "load_vocab",
    "movie_collate_fn",
    "read_jsonl",
    "read_nsmc",
    "read_reviews",
    "train_vocab",
]


def __getattr__(name):
    if name not in _TORCH_EXPORTS:
        raise AttributeError(f"module 'fastformer.data' has no attribute {name!r}")
    value = getattr(importlib.import_module("fastformer.data.reviews"), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted([*globals(), *_TORCH_EXPORTS])
