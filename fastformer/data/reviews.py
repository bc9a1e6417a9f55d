"""Labelled reviews for torch: the Dataset, collate, a length-bucketing sampler and its split across
the processes of a torchrun job. The files are read by fastformer.data.files, without torch.
"""

import itertools
import math
import numbers
import os
from array import array

import torch

from fastformer.data.files import PROGRESS_DELAY, cut, read_reviews
from fastformer.data.vocab import BOS, UNK
from fastformer.progress import progress_bar

# The share of a JSONL file's pieces that may be missing from the vocab: its own text's pieces are
# all there (SentencePiece made them), so far more than none means another vocab made them
MAX_UNKNOWN = 0.2
OTHER_VOCAB = "Give the one they were tokenized with (--vocab)"  # MovieDataSet's advice for them, train's


class MovieDataSet(torch.utils.data.Dataset):
    """The tutorial's dataset: (label, encoder ids, decoder input [BOS]) per review.

    `source` is a file path (TSV or JSONL), Reviews, or a list of Review (`name`: what errors call
    them). Texts are encoded with the vocab, ENCODE_BATCH at a time, pieces looked up; sequences
    longer than `max_len` (the model's n_enc_seq) are truncated. The ids are kept end to end in one
    int32 array with the offset where each review's end (4 bytes a token, where a list of Python
    ints takes 8 to 36). Pieces of which more than MAX_UNKNOWN are not in the vocab raise
    ValueError: they were made with another vocab, and the model would read [UNK] for them; `advice`
    ends its message, saying what to do (the caller's options: `train`'s --vocab, `evaluate`'s --test).
    """

    def __init__(self, vocab, source, max_len=None, progress=True, name=None, advice=OTHER_VOCAB):
        self.vocab = vocab
        is_file = isinstance(source, (str, os.PathLike))
        reviews = read_reviews(source, progress=progress) if is_file else source
        name = name or (f"file {source}" if is_file else "the reviews")
        desc = f"Encoding {os.path.basename(source)}" if is_file else "Encoding"
        self.labels, self.ids, self.ends = array("q"), array("i"), array("q")
        n_pieces, unknown = 0, []  # pieces given (JSONL), and those the vocab does not hold
        bar = progress_bar(total=len(reviews), desc=desc, unit=" reviews", disable=not progress, delay=PROGRESS_DELAY)
        with bar:
            for batch in _batches(reviews, ENCODE_BATCH):
                texts = [review.doc for review in batch if isinstance(review.doc, str)]
                encoded = iter(vocab.encode(texts, out_type=int) if texts else ())
                for review in batch:
                    # a negative label is no class (and -100 would be cross_entropy's ignore_index, left
                    # out of the loss without a word); one past int64 does not fit the labels' array
                    if not _is_class_number(review.label):
                        raise ValueError(
                            f"review {review.id}: label must be an integer class number 0, 1, ..., got {review.label!r}"
                        )
                    if isinstance(review.doc, str):
                        ids = next(encoded)
                    else:
                        ids = [vocab.piece_to_id(piece) for piece in review.doc]
                        n_pieces += len(ids)
                        unknown += [p for p, i in zip(review.doc, ids) if i == vocab.unk_id() and p != UNK[1]]
                    self.labels.append(review.label)
                    # an empty review becomes one [PAD]: the batch keeps a column, the model sees no token
                    self.ids.extend((ids[:max_len] if max_len else ids) or [vocab.pad_id()])
                    self.ends.append(len(self.ids))
                bar.update(len(batch))
        self.bos = vocab.piece_to_id(BOS[1])
        if n_pieces and len(unknown) > MAX_UNKNOWN * n_pieces:
            examples = ", ".join(repr(piece) for piece in dict.fromkeys(unknown[:50]))
            raise ValueError(
                f"{name}: {len(unknown) / n_pieces:.0%} of the SentencePiece pieces ({len(unknown):,} of "
                f"{n_pieces:,}: {cut(examples, 60)}) are not in the vocab, and the model would read them as "
                f"[UNK]: were they made with another vocab? {advice}"
            )

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, item):
        start, end = self.ends[item - 1] if item else 0, self.ends[item]
        return (
            torch.tensor(self.labels[item]),
            torch.frombuffer(memoryview(self.ids)[start:end], dtype=torch.int32).long(),
            torch.tensor([self.bos]),
        )

    def lengths(self):
        return [end - start for start, end in zip((0, *self.ends[:-1]), self.ends)]


ENCODE_BATCH = 4096  # reviews encoded by one call of the vocab


def _is_class_number(label):
    """Whether a label is a class number 0, 1, ... that an int64 holds (not a bool)."""
    return isinstance(label, numbers.Integral) and not isinstance(label, bool) and 0 <= label < 2**63


def _batches(reviews, size):
    """Lists of `size` reviews (the last shorter), in order."""
    reviews = iter(reviews)
    while batch := list(itertools.islice(reviews, size)):
        yield batch


BUCKET_MULTIPLE = 16  # bucket_length rounds the padded encoder length up to a multiple of this


def bucket_length(length, max_len, multiple=BUCKET_MULTIPLE):
    """The length a batch whose longest review has `length` pieces is padded to when padding to
    buckets: `length` rounded up to a multiple of `multiple` (16), but no more than `max_len` (the
    model's n_enc_seq, itself a bucket). A run then sees at most ceil(max_len / multiple) lengths
    (8 for the CPU job's 128, 16 for the tutorial's 256), so a CUDA graph or a compiled step
    captured per length is captured a handful of times. A length above max_len is left as it is
    (the model refuses it, naming the limit)."""
    return max(length, min(max_len, -(-length // multiple) * multiple))


def pad_to_bucket(enc_inputs, config):
    """Encoder ids (bs, n_enc), as the tutorial's collate pads them (to the batch's longest
    review), padded further on the right with config.i_pad to their bucket length: n_enc rounded up
    to a multiple of 16, at most config.n_enc_seq (bucket_length). It is the padding `fastformer
    train` gives its batches, so that a step compiled or captured per shape sees a handful of them:

        compiled = torch.compile(model, mode="reduce-overhead")
        logits = compiled(fastformer.pad_to_bucket(enc_inputs, config), dec_inputs)[0]

    The extra columns are [PAD] keys, which the model masks: they change the logits by rounding
    only. Returns a new tensor (enc_inputs itself where it is at its bucket length already)."""
    if not isinstance(enc_inputs, torch.Tensor):
        raise TypeError(f"enc_inputs must be a torch.Tensor of token ids, got {type(enc_inputs).__name__}")
    if enc_inputs.dim() != 2 or enc_inputs.dtype.is_floating_point or enc_inputs.dtype.is_complex:
        raise ValueError(
            f"enc_inputs must be integer token ids of shape (batch, length), got {enc_inputs.dtype} "
            f"{tuple(enc_inputs.shape)}"
        )
    if enc_inputs.size(1) > config.n_enc_seq:
        raise ValueError(
            f"enc_inputs has {enc_inputs.size(1)} positions, more than config.n_enc_seq ({config.n_enc_seq}): "
            "the model has no position embedding for them"
        )
    return _padded(enc_inputs, config.i_pad, config.n_enc_seq)


def _padded(enc_inputs, i_pad, max_len):
    extra = bucket_length(enc_inputs.size(1), max_len) - enc_inputs.size(1)
    return torch.nn.functional.pad(enc_inputs, (0, extra), value=i_pad) if extra else enc_inputs


def movie_collate_fn(inputs, i_pad=0, bucket_max_len=None):
    """The tutorial's collate: (labels (bs,), enc_inputs (bs, n_enc), dec_inputs (bs, 1)), ids
    padded with i_pad to the longest sequence in the batch; with `bucket_max_len` (the model's
    n_enc_seq), the encoder ids are padded further, to bucket_length(longest, bucket_max_len), as
    pad_to_bucket pads them. The extra columns are i_pad, keys the model masks, so they change the
    logits only by rounding."""
    labels, enc_inputs, dec_inputs = zip(*inputs)
    enc_inputs = torch.nn.utils.rnn.pad_sequence(enc_inputs, batch_first=True, padding_value=i_pad)
    dec_inputs = torch.nn.utils.rnn.pad_sequence(dec_inputs, batch_first=True, padding_value=i_pad)
    if bucket_max_len is not None:
        enc_inputs = _padded(enc_inputs, i_pad, bucket_max_len)
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


class ShardedBatchSampler(torch.utils.data.Sampler):
    """One process's share of the batches of `batch_sampler`, in a job of `num_replicas` processes
    (torchrun): from each batch, the indices at positions rank, rank + num_replicas, ...

    Give `batch_sampler` batches of batch_size * num_replicas: the processes then train together on
    exactly the batches one process would draw at that size, each taking every num_replicas-th
    review, so a length-bucketed batch is shared evenly. A batch whose size is not a multiple of
    num_replicas (the last of a pool) is first filled up with its own first reviews, so that each
    process gets as many reviews as the others and DistributedDataParallel's mean of their mean
    gradients is the batch's (the repeated reviews count twice). Every process sees the same
    number of batches, and the order is the wrapped sampler's: deterministic for a seed and epoch.
    """

    def __init__(self, batch_sampler, num_replicas, rank):
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank must be in 0..{num_replicas - 1}, got {rank}")
        self.batch_sampler = batch_sampler
        self.num_replicas = num_replicas
        self.rank = rank

    def __len__(self):
        return len(self.batch_sampler)

    def __iter__(self):
        for batch in self.batch_sampler:
            batch = list(batch)
            batch += (batch * self.num_replicas)[: -len(batch) % self.num_replicas]
            yield batch[self.rank :: self.num_replicas]
