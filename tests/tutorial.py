"""The tutorial's Transformer transcribed in plain PyTorch, as its users run it: the drop-in oracle.

Written for these tests from the tutorial's description (paul-hyun's "Transformer 구현하기" posts and
the NSMC sentiment notebook): dense boolean masks, masked_fill(-1e9), fp32 softmax, Conv1d FFN with
erf GELU, post-LayerNorm. fastformer must load this model's state_dict with strict=True and match
its outputs.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


def sinusoid_table(n_seq, d_hidn):
    """Written as a double loop, like the tutorial, to check fastformer's vectorized version."""
    rows = []
    for pos in range(n_seq):
        row = []
        for i in range(d_hidn):
            angle = pos / math.pow(10000, 2 * (i // 2) / d_hidn)
            row.append(math.sin(angle) if i % 2 == 0 else math.cos(angle))
        rows.append(row)
    return torch.tensor(rows, dtype=torch.float64)


def pad_mask(seq_q, seq_k, i_pad):
    bs, len_q = seq_q.shape
    return seq_k.eq(i_pad).unsqueeze(1).expand(bs, len_q, seq_k.size(1))


def decoder_mask(seq):
    ones = torch.ones_like(seq).unsqueeze(-1).expand(seq.size(0), seq.size(1), seq.size(1))
    return ones.triu(diagonal=1)


class ScaledDotProductAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dropout = nn.Dropout(config.dropout)
        self.scale = 1 / (config.d_head**0.5)

    def forward(self, Q, K, V, attn_mask):
        scores = torch.matmul(Q, K.transpose(-1, -2)) * self.scale
        scores = scores.masked_fill(attn_mask, -1e9)
        attn_prob = self.dropout(torch.softmax(scores, dim=-1))
        return torch.matmul(attn_prob, V), attn_prob


class MultiHeadAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        width = config.n_head * config.d_head
        self.W_Q = nn.Linear(config.d_hidn, width)
        self.W_K = nn.Linear(config.d_hidn, width)
        self.W_V = nn.Linear(config.d_hidn, width)
        self.scaled_dot_attn = ScaledDotProductAttention(config)
        self.linear = nn.Linear(width, config.d_hidn)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, Q, K, V, attn_mask):
        bs, H, D = Q.size(0), self.config.n_head, self.config.d_head
        q_s = self.W_Q(Q).view(bs, -1, H, D).transpose(1, 2)
        k_s = self.W_K(K).view(bs, -1, H, D).transpose(1, 2)
        v_s = self.W_V(V).view(bs, -1, H, D).transpose(1, 2)
        attn_mask = attn_mask.unsqueeze(1).repeat(1, H, 1, 1)
        context, attn_prob = self.scaled_dot_attn(q_s, k_s, v_s, attn_mask)
        context = context.transpose(1, 2).contiguous().view(bs, -1, H * D)
        return self.dropout(self.linear(context)), attn_prob


class PoswiseFeedForwardNet(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.conv1 = nn.Conv1d(config.d_hidn, config.d_ff, kernel_size=1)
        self.conv2 = nn.Conv1d(config.d_ff, config.d_hidn, kernel_size=1)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, inputs):
        hidden = F.gelu(self.conv1(inputs.transpose(1, 2)))
        return self.dropout(self.conv2(hidden).transpose(1, 2))


class EncoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self_attn = MultiHeadAttention(config)
        self.layer_norm1 = nn.LayerNorm(config.d_hidn, eps=config.layer_norm_epsilon)
        self.pos_ffn = PoswiseFeedForwardNet(config)
        self.layer_norm2 = nn.LayerNorm(config.d_hidn, eps=config.layer_norm_epsilon)

    def forward(self, inputs, attn_mask):
        att, prob = self.self_attn(inputs, inputs, inputs, attn_mask)
        att = self.layer_norm1(inputs + att)
        return self.layer_norm2(self.pos_ffn(att) + att), prob


class DecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self_attn = MultiHeadAttention(config)
        self.layer_norm1 = nn.LayerNorm(config.d_hidn, eps=config.layer_norm_epsilon)
        self.dec_enc_attn = MultiHeadAttention(config)
        self.layer_norm2 = nn.LayerNorm(config.d_hidn, eps=config.layer_norm_epsilon)
        self.pos_ffn = PoswiseFeedForwardNet(config)
        self.layer_norm3 = nn.LayerNorm(config.d_hidn, eps=config.layer_norm_epsilon)

    def forward(self, dec_inputs, enc_outputs, self_attn_mask, dec_enc_attn_mask):
        x, self_prob = self.self_attn(dec_inputs, dec_inputs, dec_inputs, self_attn_mask)
        x = self.layer_norm1(dec_inputs + x)
        y, cross_prob = self.dec_enc_attn(x, enc_outputs, enc_outputs, dec_enc_attn_mask)
        y = self.layer_norm2(x + y)
        return self.layer_norm3(y + self.pos_ffn(y)), self_prob, cross_prob


def _positions(inputs, i_pad):
    positions = torch.arange(inputs.size(1), device=inputs.device, dtype=inputs.dtype).expand_as(inputs) + 1
    return positions.masked_fill(inputs.eq(i_pad), 0)


class Encoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.enc_emb = nn.Embedding(config.n_enc_vocab, config.d_hidn)
        table = sinusoid_table(config.n_enc_seq + 1, config.d_hidn).float()
        self.pos_emb = nn.Embedding.from_pretrained(table, freeze=True)
        self.layers = nn.ModuleList([EncoderLayer(config) for _ in range(config.n_layer)])

    def forward(self, inputs):
        outputs = self.enc_emb(inputs) + self.pos_emb(_positions(inputs, self.config.i_pad))
        attn_mask = pad_mask(inputs, inputs, self.config.i_pad)
        probs = []
        for layer in self.layers:
            outputs, prob = layer(outputs, attn_mask)
            probs.append(prob)
        return outputs, probs


class Decoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.dec_emb = nn.Embedding(config.n_dec_vocab, config.d_hidn)
        table = sinusoid_table(config.n_dec_seq + 1, config.d_hidn).float()
        self.pos_emb = nn.Embedding.from_pretrained(table, freeze=True)
        self.layers = nn.ModuleList([DecoderLayer(config) for _ in range(config.n_layer)])

    def forward(self, dec_inputs, enc_inputs, enc_outputs):
        i_pad = self.config.i_pad
        outputs = self.dec_emb(dec_inputs) + self.pos_emb(_positions(dec_inputs, i_pad))
        self_mask = torch.gt(pad_mask(dec_inputs, dec_inputs, i_pad) + decoder_mask(dec_inputs), 0)
        cross_mask = pad_mask(dec_inputs, enc_inputs, i_pad)
        self_probs, cross_probs = [], []
        for layer in self.layers:
            outputs, self_prob, cross_prob = layer(outputs, enc_outputs, self_mask, cross_mask)
            self_probs.append(self_prob)
            cross_probs.append(cross_prob)
        return outputs, self_probs, cross_probs


class Transformer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.encoder = Encoder(config)
        self.decoder = Decoder(config)

    def forward(self, enc_inputs, dec_inputs):
        enc_outputs, enc_probs = self.encoder(enc_inputs)
        dec_outputs, dec_self_probs, dec_enc_probs = self.decoder(dec_inputs, enc_inputs, enc_outputs)
        return dec_outputs, enc_probs, dec_self_probs, dec_enc_probs


class MovieClassification(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.transformer = Transformer(config)
        self.projection = nn.Linear(config.d_hidn, config.n_output, bias=False)

    def forward(self, enc_inputs, dec_inputs):
        dec_outputs, *probs = self.transformer(enc_inputs, dec_inputs)
        logits = self.projection(torch.max(dec_outputs, dim=1)[0])
        return (logits, *probs)
