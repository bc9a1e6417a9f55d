"""Position encoding and attention masks: the tutorial's helpers and the compact mask of the fast path."""

from typing import NamedTuple

import numpy as np
import torch


def get_sinusoid_encoding_table(n_seq, d_hidn):
    """(n_seq, d_hidn) float64 array: sin at even hidden indices, cos at odd, as the tutorial builds it."""
    positions = np.arange(n_seq, dtype=np.float64)[:, None]  # (n_seq, 1)
    i_hidn = np.arange(d_hidn)[None, :]  # (1, d_hidn)
    table = positions / np.power(10000, 2 * (i_hidn // 2) / d_hidn)
    table[:, 0::2] = np.sin(table[:, 0::2])
    table[:, 1::2] = np.cos(table[:, 1::2])
    return table


def get_attn_pad_mask(seq_q, seq_k, i_pad):
    """(bs, len_q, len_k) bool, True where the key is padding (a broadcast view, not a copy)."""
    batch_size, len_q = seq_q.size()
    _, len_k = seq_k.size()
    return seq_k.eq(i_pad).unsqueeze(1).expand(batch_size, len_q, len_k)


def get_attn_decoder_mask(seq):
    """(bs, len, len) in seq's dtype, 1 where key j > query i (the future), as the tutorial returns it."""
    batch_size, length = seq.size()
    return torch.ones_like(seq).unsqueeze(-1).expand(batch_size, length, length).triu(diagonal=1)


class AttentionMask(NamedTuple):
    """What to mask, without building an (Lq, Lk) tensor: the fast path's form of the tutorial's mask.

    key_padding_mask: (bs, n_k_seq) bool, True = padding key; causal: mask key j > query i;
    dense: a tutorial-style (bs, [n_head,] n_q_seq, n_k_seq) bool mask. The three combine by OR.
    The attention modules take either this or a dense bool tensor as their `attn_mask`.
    """

    key_padding_mask: torch.Tensor | None = None
    causal: bool = False
    dense: torch.Tensor | None = None

    @classmethod
    def of(cls, attn_mask):
        """Wrap whatever a caller passed as `attn_mask` (AttentionMask, dense bool tensor, or None)."""
        if attn_mask is None:
            return cls()
        if isinstance(attn_mask, cls):
            return attn_mask
        if isinstance(attn_mask, torch.Tensor):
            return cls(dense=attn_mask)
        raise TypeError(
            f"attn_mask must be a bool tensor, a fastformer.AttentionMask or None, got {type(attn_mask).__name__}"
        )

    def as_kwargs(self):
        """The keyword arguments of kernels.attention that express this mask."""
        if not isinstance(self.causal, bool):
            raise TypeError(f"AttentionMask.causal must be a bool, got {self.causal!r}")
        return {"key_padding_mask": self.key_padding_mask, "causal": self.causal, "attn_mask": self.dense}

    def materialize(self, batch_size, n_q_seq, n_k_seq, device):
        """This mask as the tutorial's dense bool tensor, True = masked: (bs, n_q_seq, n_k_seq), or
        (bs, n_head, n_q_seq, n_k_seq) when `dense` has a head dim. A mask that is `dense` alone is
        returned as it is."""
        if self.key_padding_mask is None and not self.causal and self.dense is not None:
            return self.dense
        mask = torch.zeros(batch_size, n_q_seq, n_k_seq, dtype=torch.bool, device=device)
        if self.key_padding_mask is not None:
            mask = mask | self.key_padding_mask[:, None, :]
        if self.causal:
            mask = mask | torch.ones(n_q_seq, n_k_seq, dtype=torch.bool, device=device).triu(1)
        if self.dense is not None:
            mask = (mask.unsqueeze(1) if self.dense.dim() == 4 else mask) | self.dense
        return mask
