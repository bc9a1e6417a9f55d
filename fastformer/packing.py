"""The drop-in model on real tokens only: the tutorial's padded ids in, no work on `[PAD]`.

The tutorial pads every review of a batch to one length and masks the padding in attention, so the
products, the adds + LayerNorms and the dropouts of its encoder also run on the padded positions,
whose outputs nothing reads: the decoder's cross-attention masks them as keys. Under the job's
batching a quarter to a half of the encoder's positions are padding (issue 67). A `Packing` takes
the real tokens of the batch, in order, as rows back to back (FlashAttention-2's variable-length
layout): `index` says where each sits among the (bs * n_seq) positions, `cu_seqlens` where each
review's rows begin. `Transformer` (and so `MovieClassification`) runs its encoder on those rows:
the embeddings of the real tokens only, every layer's products, adds + LayerNorms and dropouts on
the rows, attention by `kernels.attention_varlen`'s kernels; the decoder's cross-attention reads
the packed keys and values, each review's queries over its own keys.

What a caller can observe stays the tutorial's: the logits and the decoder's outputs (at real
positions the same attention over the same keys, summed in other orders, so equal within rounding;
with dropout, masks drawn for the rows, not the padded positions), the gradients of every parameter
(padding's rows gave them nothing: exact zeros), the returned lists (None in place of
probabilities, as the fast path gives). It packs only where nothing sees the encoder's padded
tensors (`packs`): the Triton path, the fused modules (fastformer.fusion: no hook, no swapped module
in the encoder and decoder), no probabilities asked for, and padding in the batch. An Encoder
called alone returns its output at every position, pads included, and runs padded.

The packed row count is the batch's count of real tokens, read on the host with the ids' range
check in one copy (on CUDA the sync that check makes anyway). A traced or captured step cannot
read it (torch.compile, CUDA graphs, a torch.func transform), so those run padded;
inside `token_bucket(rows)` the model reads no count: it packs every batch into `rows` rows (a
static packing, `make_static_packing`: the real tokens, then filler rows in sequences of their
own), so a CUDA graph captured there replays on real tokens too, whoever knows a bound on the
batches' counts (the host that made them) choosing `rows`. FASTFORMER_PACKING=0 or
`set_packing(False)` runs padded everywhere, for comparison.
"""

import contextlib
from typing import NamedTuple

import torch

from fastformer.kernels._runtime import Choice

ENV_VAR = "FASTFORMER_PACKING"
# set_packing's choice, else FASTFORMER_PACKING's ("0": run padded; unset, "" or "1": pack)
_choice = Choice.switch(ENV_VAR, "set_packing", "pack the real tokens, the default", "run padded", True)


def set_packing(flag):
    """Pack the real tokens where the model can (True), run padded everywhere (False), or as
    FASTFORMER_PACKING says, else pack (None, the default)."""
    _choice.set(flag)


def use_packing(flag):
    """set_packing(flag) inside the block, and the choice made before it after the block."""
    return _choice.within(flag)


def check_environment():
    """The ops' variables (kernels.check_environment) and FASTFORMER_PACKING read now: a value none
    takes raises its ValueError before a job's first piece of work."""
    from fastformer import kernels

    kernels.check_environment()
    _choice()


def packing_enabled():
    """Whether packing is chosen (the switch; Transformer.packs says where it applies)."""
    return _choice()


def can_read_counts(ids):
    """Whether the host may read the ids' counts: not while torch.compile traces, a CUDA graph is
    captured or a torch.func transform runs (it would be a graph break, an error, a batched read)."""
    if torch.compiler.is_compiling() or torch._C._functorch.peek_interpreter_stack() is not None:
        return False
    return not (ids.is_cuda and torch.cuda.is_current_stream_capturing())


def can_pack_statically():
    """Whether a static packing (token_bucket) may run: eagerly or while a CUDA graph is captured;
    not while torch.compile traces or a torch.func transform runs, which run padded."""
    return not torch.compiler.is_compiling() and torch._C._functorch.peek_interpreter_stack() is None


class Packing(NamedTuple):
    """The real tokens of a padded batch of ids as rows back to back; in a static packing
    (`make_static_packing`) then filler rows up to a fixed count, in sequences of their own."""

    index: torch.Tensor  # (rows,) int64: each row's position among the bs * n_seq
    # (sequences + 1,) int32: sequence s's rows are cu_seqlens[s] to cu_seqlens[s + 1]; the first bs
    # sequences are the reviews, any after them filler
    cu_seqlens: torch.Tensor
    max_seqlen: int  # the longest sequence's count of rows (a static packing's: at most n_seq)
    reviews: int  # bs

    def gather(self, padded):
        """The rows' entries of `padded`, a (bs, n_seq, ...) tensor: (rows, ...)."""
        return padded.reshape(-1, *padded.shape[2:]).index_select(0, self.index)

    def self_attention(self):
        """The PackedLengths of the rows' self-attention: each sequence over its own rows."""
        return PackedLengths(self.cu_seqlens, self.cu_seqlens, self.max_seqlen, self.max_seqlen)

    def cross_attention(self, n_q):
        """The PackedLengths of n_q query rows a review (bs * n_q rows back to back) attending over
        the review's rows: a filler sequence has no query, so its rows' gradients are zeros."""
        starts = torch.arange(0, (self.reviews + 1) * n_q, n_q, dtype=torch.int32, device=self.index.device)
        fillers = self.cu_seqlens.shape[0] - 1 - self.reviews
        if fillers:
            starts = torch.cat([starts, starts[-1:].expand(fillers)])
        return PackedLengths(starts, self.cu_seqlens, n_q, self.max_seqlen)


def lengths(pad):
    """Per review, its count of real tokens, and their offsets: (bs,) and (bs + 1,) int32."""
    counts = (~pad).sum(1, dtype=torch.int32)
    offsets = torch.zeros(pad.size(0) + 1, dtype=torch.int32, device=pad.device)
    torch.cumsum(counts, 0, out=offsets[1:])
    return counts, offsets


def make_packing(pad, offsets, rows, longest):
    """The Packing of a batch whose padding flags are `pad` (bs, n_seq), its offsets from `lengths`
    and its counts as read on the host (rows: all real tokens; longest: the longest review's)."""
    # their positions in order, found without a sync: the count is known
    index = torch.nonzero_static(~pad.reshape(-1), size=rows).squeeze(1)
    return Packing(index, offsets, longest, pad.size(0))


FILLER_ROWS = 32  # the rows of a static packing's filler sequence, at most


def make_static_packing(pad, offsets, rows):
    """The Packing of a batch whose padding flags are `pad` (bs, n_seq) and offsets `lengths`'
    as `rows` rows whatever its count of real tokens, which nothing reads on the host: a captured
    step sees one shape. The real tokens first, in order, then filler rows (copies of
    position 0's token, so finite) up to `rows`, in sequences of at most FILLER_ROWS rows that
    attend over their own rows: every row lies in a sequence, so attention writes every output and
    gradient row, and the fillers' are exact zeros in every gradient (nothing reads their outputs).
    The sequences' lengths are bounded by n_seq (max_seqlen). More real tokens than `rows` fails a
    device-side assert (on CUDA an error at the next sync; on a CPU at once): never a token left out."""
    bs, n_seq = pad.shape
    count = offsets[-1]
    torch._assert_async(count <= rows, f"the batch has more real tokens than the token bucket's {rows} rows")
    index = torch.nonzero_static(~pad.reshape(-1), size=rows, fill_value=0).squeeze(1)
    # enough filler sequences for `rows` fillers, the most a batch can have; those past the
    # batch's fillers are empty
    size = min(FILLER_ROWS, n_seq)
    step = torch.arange(size, (-(-rows // size) + 1) * size, size, dtype=offsets.dtype, device=offsets.device)
    filler_ends = torch.clamp_max(count + step, rows)
    return Packing(index, torch.cat([offsets, filler_ends]), n_seq, bs)


_bucket = None  # token_bucket's rows, or None


@contextlib.contextmanager
def token_bucket(rows):
    """Inside the block the model packs every batch into `rows` rows (a static packing: its real
    tokens, then fillers), reading no count on the host: what a CUDA graph captured in the block
    needs, whose replays then run on real tokens too. `rows` must be at least every batch's count
    of real tokens, and no review may be padding alone (device-side asserts say so). None: the
    counts read on the host where they can be, as outside any block."""
    global _bucket
    if rows is not None:
        if isinstance(rows, bool) or not isinstance(rows, int):
            raise TypeError(f"rows must be an int (a count of rows) or None, got {type(rows).__name__}")
        if rows < 1:
            raise ValueError(f"rows must be at least 1, got {rows}")
    before, _bucket = _bucket, rows
    try:
        yield
    finally:
        _bucket = before


def bucket_rows():
    """The rows of the token_bucket block the caller is in, or None."""
    return _bucket


class PackedLengths(NamedTuple):
    """What attention over packed rows reads of them (kernels.attention_varlen's offsets and
    longest lengths): the queries' and the keys' rows of each review."""

    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int


ROW_STEPS = 8  # a replayed batch's rows: its count of real tokens rounded up to an eighth of its positions


def replay_rows(enc_inputs, i_pad, steps=ROW_STEPS):
    """The token bucket's rows a batch of encoder ids is replayed in (the job's CUDA graphs,
    fastformer.train.graphs.GraphedSteps): its count of real tokens rounded up to a multiple of
    1/steps of its positions, so that a shape's batches take a few graphs; None where it runs
    padded: packing off, the ids on a device (read there, the count would be a host sync), no
    padding to leave out once rounded, or a review of padding alone (whose decoder attends over its
    padding). Reads the ids on the host."""
    if enc_inputs.device.type != "cpu" or not packing_enabled():
        return None
    counts = enc_inputs.ne(i_pad).sum(1)
    positions = enc_inputs.numel()
    step = max(1, -(-positions // steps))
    rows = min(positions, -(-int(counts.sum()) // step) * step)
    if rows == positions or int(counts.min()) == 0:
        return None
    return rows
