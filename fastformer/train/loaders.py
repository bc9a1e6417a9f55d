"""The data of `fastformer train` once its inputs are checked (fastformer.train.inputs reads the
reviews): the vocab trained on them, and the loaders."""

import itertools

import torch

from fastformer.data.reviews import LengthBucketSampler, MovieDataSet, ShardedBatchSampler, movie_collate_fn
from fastformer.data.vocab import N_SPECIAL, load_vocab, train_vocab
from fastformer.train.rundir import write_file


def train_run_vocab(n_pieces, reviews, launch, model_file, log):
    """The run's BPE vocab of n_pieces pieces (besides the special ones), trained on the train
    reviews into `model_file` (fastformer.train.inputs checked that it fits the config). Returns it
    loaded."""
    log(f"Training a BPE vocab of up to {n_pieces} + {N_SPECIAL} pieces on {len(reviews)} reviews")
    return _shared_vocab(launch, reviews, model_file, n_pieces)


def _shared_vocab(launch, reviews, model_file, n_pieces):
    """train_vocab on the reviews' texts into `model_file`; in a torchrun job rank 0 trains it and
    sends the file to the other processes. Returns the loaded vocab."""
    if launch.rank == 0:
        train_vocab(reviews.texts(), model_file, n_pieces=n_pieces, progress=True)
    if launch.distributed:
        model = [None]
        if launch.rank == 0:
            with open(model_file, "rb") as f:
                model = [f.read()]
        torch.distributed.broadcast_object_list(model, src=0)
        if launch.rank != 0:
            write_file(model_file, lambda f: f.write(model[0]))
    return load_vocab(model_file)


class _FromStep(torch.utils.data.Sampler):
    """The batches of a batch sampler from its `skip`-th on (skip is set by the loaders' set_epoch):
    the epoch's batches are drawn in full, as an uninterrupted epoch draws them, and the first
    `skip` left out, so a run resumed inside an epoch trains on the batches it had not."""

    def __init__(self, batches):
        self.batches = batches
        self.skip = 0

    def __len__(self):
        return len(self.batches) - self.skip

    def __iter__(self):
        return itertools.islice(iter(self.batches), self.skip, None)


def loaders(config, vocab, train_reviews, test_reviews, batch_size, bucket, seed, launch, pad_to_buckets=False):
    """The train and test loaders, and set_epoch(epoch, skip=0), which fixes the train order of an
    epoch from (seed, epoch) alone and leaves out its first `skip` batches, so a resumed run sees
    the batches an uninterrupted one would. Drawing them touches no global RNG: the loaders have
    generators of their own, so the dropout masks a run draws do not depend on where it resumed.
    In a torchrun job the batches are drawn at batch_size * world_size and shared out among the
    processes (ShardedBatchSampler), and each process evaluates every world_size-th test review.
    With pad_to_buckets, batches are padded to bucket_length of their longest review."""
    progress = launch.rank == 0
    train_set = MovieDataSet(
        vocab, train_reviews, max_len=config.n_enc_seq, progress=progress, name="the train reviews"
    )
    test_set = MovieDataSet(vocab, test_reviews, max_len=config.n_enc_seq, progress=progress, name="the test reviews")
    bucket_max_len = config.n_enc_seq if pad_to_buckets else None

    def collate(batch):
        return movie_collate_fn(batch, i_pad=config.i_pad, bucket_max_len=bucket_max_len)

    drawn = batch_size * launch.world_size
    # A DataLoader draws a seed for its workers from its generator each epoch (from the global RNG
    # without one); with no workers it is unused.
    generator = torch.Generator()
    if bucket:
        batches = LengthBucketSampler(train_set.lengths(), drawn, shuffle=True, seed=seed)
        order_epoch = batches.set_epoch
    else:
        # what DataLoader(shuffle=True, generator=generator) builds, the generator also seeding its iterators
        shuffled = torch.utils.data.RandomSampler(train_set, generator=generator)
        batches = torch.utils.data.BatchSampler(shuffled, drawn, drop_last=False)

        def order_epoch(epoch):
            generator.manual_seed(seed + epoch)

    if launch.distributed:
        batches = ShardedBatchSampler(batches, launch.world_size, launch.rank)
        test_set = torch.utils.data.Subset(test_set, range(launch.rank, len(test_set), launch.world_size))
    batches = _FromStep(batches)

    def set_epoch(epoch, skip=0):
        order_epoch(epoch)
        batches.skip = skip

    train_loader = torch.utils.data.DataLoader(
        train_set, batch_sampler=batches, collate_fn=collate, generator=generator
    )
    test_loader = torch.utils.data.DataLoader(
        test_set, batch_size=batch_size, shuffle=False, collate_fn=collate, generator=torch.Generator()
    )
    return train_loader, test_loader, set_epoch
