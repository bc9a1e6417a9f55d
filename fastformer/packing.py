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
read it (torch.compile, CUDA graphs, a torch.func transform), so those run padded, as before: a
static token bucket for them is the next step (docs/drop-in.md). FASTFORMER_PACKING=0 or
`set_packing(False)` runs padded everywhere, for comparison.
"""

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


class Packing(NamedTuple):
    """The real tokens of a padded batch of ids as rows back to back."""

    index: torch.Tensor  # (rows,) int64: each real token's position among the bs * n_seq
    cu_seqlens: torch.Tensor  # (bs + 1,) int32: review b's rows are cu_seqlens[b] to cu_seqlens[b + 1]
    max_seqlen: int  # the longest review's count of real tokens

    def gather(self, padded):
        """The real tokens' entries of `padded`, a (bs, n_seq, ...) tensor: (rows, ...)."""
        return padded.reshape(-1, *padded.shape[2:]).index_select(0, self.index)


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
    return Packing(index, offsets, longest)


class PackedLengths(NamedTuple):
    """What attention over packed rows reads of them (kernels.attention_varlen's offsets and
    longest lengths): the queries' and the keys' rows of each review."""

    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
