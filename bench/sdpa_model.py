"""The tutorial's MovieClassification as a PyTorch user writes it today: the benchmarks' SDPA peer.

Plain modules (nn.Embedding, nn.Linear, nn.Conv1d, nn.LayerNorm, nn.Dropout), F.gelu, and
`F.scaled_dot_product_attention` (SDPA) for attention, so the fused kernel PyTorch picks stands in
for the tutorial's materialized scores. The parameters are fastformer's, name for name and shape
for shape, so one state_dict loads into both with strict=True:

    model = SdpaMovieClassification(config)
    model.load_state_dict(fastformer.MovieClassification(config).state_dict())
    logits, _, _, _ = model(enc_inputs, dec_inputs)

Only the benchmarks use it; fastformer and kernels never import it.
"""

from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F


class Mask(NamedTuple):
    """One attention call's mask in SDPA's terms, made once per forward for all the layers.

    keep: bool (bs, 1, n_q_seq or 1, n_k_seq), True = attend (SDPA's sense; the tutorial's masks
    say True = masked). empty: bool (bs, 1, n_q_seq or 1, 1), True = a query whose keys the tutorial
    masks all of.

    The tutorial fills masked scores with -1e9, so such a query has equal scores, a uniform softmax
    over all n_k_seq keys, and the mean of V for output. SDPA given a row of False gives zeros or
    NaN instead, depending on the backend. Here the row keeps every key and the attention zeroes
    its query: every score is exactly 0, so the softmax is exactly uniform; as in the tutorial, the
    row's probabilities are dropped out like any other row's, and no gradient reaches Q or K through it.
    The cost is one masked_fill of Q per call.
    """

    keep: torch.Tensor
    empty: torch.Tensor

    @classmethod
    def of(cls, masked):
        """masked: bool (bs, 1, n_q_seq or 1, n_k_seq), True = masked, as the tutorial's masks."""
        empty = masked.all(-1, keepdim=True)
        return cls(~masked | empty, empty)


def sinusoid_table(n_seq, d_hidn):
    """(n_seq, d_hidn) fp32: sin at even hidden indices, cos at odd, as the tutorial builds it."""
    positions = torch.arange(n_seq, dtype=torch.float64)[:, None]  # (n_seq, 1)
    i_hidn = torch.arange(d_hidn)[None, :]  # (1, d_hidn)
    table = positions / torch.pow(10000, 2 * torch.div(i_hidn, 2, rounding_mode="floor") / d_hidn)
    table[:, 0::2] = table[:, 0::2].sin()
    table[:, 1::2] = table[:, 1::2].cos()
    return table.float()


def embed(token_embs, pad, pos_emb):
    """token_embs (bs, n_seq, d_hidn) plus pos_emb of positions 1..n_seq, 0 (the table's unused
    row) at padding; pad: (bs, n_seq) bool. Returns (bs, n_seq, d_hidn)."""
    positions = torch.arange(1, pad.size(1) + 1, device=pad.device).expand_as(pad).masked_fill(pad, 0)
    return token_embs + pos_emb(positions)


class MultiHeadAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.n_head, self.d_head, self.dropout_p = config.n_head, config.d_head, config.dropout
        d_attn = config.n_head * config.d_head
        self.W_Q = nn.Linear(config.d_hidn, d_attn)
        self.W_K = nn.Linear(config.d_hidn, d_attn)
        self.W_V = nn.Linear(config.d_hidn, d_attn)
        self.linear = nn.Linear(d_attn, config.d_hidn)
        self.dropout = nn.Dropout(config.dropout)

    def heads(self, x):
        # (bs, n_seq, n_head * d_head) -> (bs, n_head, n_seq, d_head)
        return x.view(x.size(0), -1, self.n_head, self.d_head).transpose(1, 2)

    def forward(self, x, memory, mask):
        """x: (bs, n_q_seq, d_hidn); memory: (bs, n_k_seq, d_hidn), x itself for self-attention;
        mask: the call's Mask. Returns (bs, n_q_seq, d_hidn)."""
        q = self.heads(self.W_Q(x)).masked_fill(mask.empty, 0.0)  # see Mask: all-masked rows
        k, v = self.heads(self.W_K(memory)), self.heads(self.W_V(memory))
        # (bs, n_head, n_q_seq, d_head); SDPA's default scale is the tutorial's, 1 / sqrt(d_head);
        # its dropout falls on the probabilities, where the tutorial's ScaledDotProductAttention puts it
        context = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask.keep, dropout_p=self.dropout_p if self.training else 0.0
        )
        # (bs, n_q_seq, n_head * d_head)
        context = context.transpose(1, 2).reshape(x.size(0), x.size(1), -1)
        return self.dropout(self.linear(context))


class PoswiseFeedForwardNet(nn.Module):
    """The tutorial's Conv1d parameters, computed as the nn.Linear a user writes today: a
    kernel-size-1 convolution over (bs, d_hidn, n_seq) is the same product as a linear over
    (bs, n_seq, d_hidn), and F.linear on the weight's (out, in) view runs as one GEMM, without the
    tutorial's two transposes."""

    def __init__(self, config):
        super().__init__()
        self.conv1 = nn.Conv1d(config.d_hidn, config.d_ff, kernel_size=1)
        self.conv2 = nn.Conv1d(config.d_ff, config.d_hidn, kernel_size=1)
        self.activation = F.relu if config.get("ffn_activation", "gelu") == "relu" else F.gelu
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        # (bs, n_seq, d_ff)
        h = self.activation(F.linear(x, self.conv1.weight.squeeze(-1), self.conv1.bias))
        # (bs, n_seq, d_hidn)
        return self.dropout(F.linear(h, self.conv2.weight.squeeze(-1), self.conv2.bias))


class EncoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self_attn = MultiHeadAttention(config)
        self.layer_norm1 = nn.LayerNorm(config.d_hidn, eps=config.layer_norm_epsilon)
        self.pos_ffn = PoswiseFeedForwardNet(config)
        self.layer_norm2 = nn.LayerNorm(config.d_hidn, eps=config.layer_norm_epsilon)

    def forward(self, x, mask):
        x = self.layer_norm1(x + self.self_attn(x, x, mask))
        return self.layer_norm2(x + self.pos_ffn(x))


class DecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self_attn = MultiHeadAttention(config)
        self.layer_norm1 = nn.LayerNorm(config.d_hidn, eps=config.layer_norm_epsilon)
        self.dec_enc_attn = MultiHeadAttention(config)
        self.layer_norm2 = nn.LayerNorm(config.d_hidn, eps=config.layer_norm_epsilon)
        self.pos_ffn = PoswiseFeedForwardNet(config)
        self.layer_norm3 = nn.LayerNorm(config.d_hidn, eps=config.layer_norm_epsilon)

    def forward(self, x, enc_outputs, self_mask, enc_mask):
        x = self.layer_norm1(x + self.self_attn(x, x, self_mask))
        x = self.layer_norm2(x + self.dec_enc_attn(x, enc_outputs, enc_mask))
        return self.layer_norm3(x + self.pos_ffn(x))


class Encoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.enc_emb = nn.Embedding(config.n_enc_vocab, config.d_hidn)
        self.pos_emb = nn.Embedding.from_pretrained(sinusoid_table(config.n_enc_seq + 1, config.d_hidn), freeze=True)
        self.layers = nn.ModuleList([EncoderLayer(config) for _ in range(config.n_layer)])

    def forward(self, inputs, pad, mask):
        """inputs, pad: (bs, n_enc_seq) ids and their padding; mask: the key-padding Mask. Returns
        (bs, n_enc_seq, d_hidn)."""
        x = embed(self.enc_emb(inputs), pad, self.pos_emb)
        for layer in self.layers:
            x = layer(x, mask)
        return x


class Decoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dec_emb = nn.Embedding(config.n_dec_vocab, config.d_hidn)
        self.pos_emb = nn.Embedding.from_pretrained(sinusoid_table(config.n_dec_seq + 1, config.d_hidn), freeze=True)
        self.layers = nn.ModuleList([DecoderLayer(config) for _ in range(config.n_layer)])

    def forward(self, dec_inputs, pad, enc_outputs, enc_mask):
        """dec_inputs, pad: (bs, n_dec_seq) ids and their padding; enc_outputs: (bs, n_enc_seq,
        d_hidn); enc_mask: the encoder's key-padding Mask. Returns (bs, n_dec_seq, d_hidn).

        The self-attention gets padding and causality as one (bs, 1, n_dec_seq, n_dec_seq) mask
        (for one token, (bs, 1, 1, 1): padding alone), never is_causal=True: SDPA refuses both at
        once, and only reading the ids (a host sync per forward) would tell a batch without padding."""
        n_seq = dec_inputs.size(1)
        future = torch.ones(n_seq, n_seq, dtype=torch.bool, device=pad.device).triu(1)  # (n_dec_seq, n_dec_seq)
        self_mask = Mask.of(pad[:, None, None, :] | future)
        x = embed(self.dec_emb(dec_inputs), pad, self.pos_emb)
        for layer in self.layers:
            x = layer(x, enc_outputs, self_mask, enc_mask)
        return x


class Transformer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.encoder = Encoder(config)
        self.decoder = Decoder(config)

    def forward(self, enc_inputs, dec_inputs):
        """(bs, n_enc_seq) and (bs, n_dec_seq) ids -> (bs, n_dec_seq, d_hidn)."""
        enc_pad, dec_pad = enc_inputs.eq(self.config.i_pad), dec_inputs.eq(self.config.i_pad)
        # key padding, (bs, 1, 1, n_enc_seq): the encoder's self-attention and the cross-attention share it
        enc_mask = Mask.of(enc_pad[:, None, None, :])
        enc_outputs = self.encoder(enc_inputs, enc_pad, enc_mask)
        return self.decoder(dec_inputs, dec_pad, enc_outputs, enc_mask)


class SdpaMovieClassification(nn.Module):
    """fastformer.MovieClassification's architecture and parameters, attention by SDPA.

    forward(enc_inputs, dec_inputs) returns (logits (bs, n_output), None, None, None): the drop-in's
    tuple, with None for the three lists of attention probabilities, which SDPA does not return.
    Inputs are not checked (fastformer's model checks them).
    """

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = Transformer(config)
        self.projection = nn.Linear(config.d_hidn, config.n_output, bias=False)

    def extra_repr(self):
        return f"n_layer={self.config.n_layer}, n_head={self.config.n_head}, d_head={self.config.d_head}"

    def forward(self, enc_inputs, dec_inputs):
        # (bs, d_hidn): max over the decoder sequence (torch.max's gradient, to one position per tie)
        dec_outputs = torch.max(self.transformer(enc_inputs, dec_inputs), dim=1).values
        return self.projection(dec_outputs), None, None, None
