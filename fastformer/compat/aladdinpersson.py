"""The einsum seq2seq Transformer of Aladdin Persson's tutorial, drop-in, on fastformer's kernels.

    # from transformer import Transformer
    from fastformer.compat.aladdinpersson import Transformer

Constructors, forward signatures, parameter names and numerics are that code's
(`transformer_from_scratch.py`), so its checkpoints load with strict=True and give the same outputs:

- SelfAttention projects each head with one Linear(head_dim, head_dim, bias=False) shared by the
  heads (`values`, `keys`, `queries`), then `fc_out`; scores are scaled by 1/sqrt(embed_size)
  (not head_dim), as that code does.
- Masks are that code's: nonzero = keep, broadcast against (N, heads, query_len, key_len); the source
  mask is (N, 1, 1, src_len) and the target mask (N, 1, trg_len, trg_len) lower-triangular.
- TransformerBlock: dropout(norm1(attention + query)), then a ReLU feed-forward
  nn.Sequential(Linear, ReLU, Linear) and dropout(norm2(ff + x)): dropout after LayerNorm.
- Learned position embeddings of max_length rows, positions 0..len-1.

On the fast path, attention runs on `kernels.attention` with the masks as a key-padding vector
and a causal flag: Transformer.forward builds them that way, and a mask passed to the modules in
the (N, 1, 1, len) form becomes a key-padding vector without being expanded. Other masks take the
kernel's dense path. The feed-forward runs on the fused linear + ReLU kernel, and residual +
LayerNorm on the fused add + LayerNorm kernel.

On real tokens only (fastformer.packing, as the tutorial's model does): Transformer.forward given
padded sources runs its encoder on the real tokens' rows back to back, each sentence's
self-attention over its own by kernels.attention_varlen's kernels, and the decoder's
cross-attention over those rows; the logits and every gradient are the padded model's within
rounding. It packs where nothing can tell: the Triton path, every module of encoder and decoder
stock without hooks, padding in the batch and a real token in every source (a source of padding
alone attends uniformly over its padding, whose encoder outputs the padded model computes), and
the count readable (eager, not under torch.compile, a CUDA graph capture or a torch.func
transform). An Encoder called alone and `generate` run padded; FASTFORMER_PACKING=0 everywhere.

`Transformer.generate` adds batched greedy decoding with a key/value cache.
"""

from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from fastformer import backend
from fastformer.fusion import fusable
from fastformer.kernels.attention_varlen import attention_packed
from fastformer.masks import AttentionMask
from fastformer.model import check_ids_shape, check_token_ids
from fastformer.packing import can_read_counts, make_packing, packing_enabled
from fastformer.packing import lengths as packing_lengths


def attention_mask(mask, n, heads, q_len, k_len, name="mask"):
    """The original's mask (nonzero = keep, broadcastable to (n, heads, q_len, k_len)) as an AttentionMask:
    a key-padding vector when it has the (n or 1, 1, 1, k_len) form, else a dense view."""
    if mask is None or isinstance(mask, AttentionMask):
        return AttentionMask.of(mask)
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, an AttentionMask or None, got {type(mask).__name__}")
    full = (n, heads, q_len, k_len)
    try:
        broadcast = torch.broadcast_shapes(mask.shape, full)
    except RuntimeError:
        broadcast = None
    if broadcast != full:
        raise ValueError(
            f"{name} of shape {tuple(mask.shape)} does not broadcast to (N, heads, query_len, key_len) = {full}"
        )
    masked = mask.eq(0).reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
    if masked.shape[1] == 1 and masked.shape[2] == 1:
        # (n or 1, 1, 1, k_len or 1): a key-padding vector, never expanded to (q_len, k_len)
        return AttentionMask(key_padding_mask=masked[:, 0, 0, :].expand(n, k_len))
    return AttentionMask(dense=masked.expand(full))


def add_norm(norm, x, residual):
    """norm(x + residual) through the fused add + LayerNorm op (the original applies dropout after it)."""
    return backend.add_layer_norm(x, residual, norm.weight, norm.bias, norm.eps, 0.0)


class SelfAttention(nn.Module):
    def __init__(self, embed_size, heads):
        super().__init__()
        self.embed_size = embed_size
        self.heads = heads
        self.head_dim = embed_size // heads
        if self.head_dim * heads != embed_size:
            raise ValueError(f"Embedding size needs to be divisible by heads: embed_size={embed_size}, heads={heads}")
        self.values = nn.Linear(self.head_dim, self.head_dim, bias=False)
        self.keys = nn.Linear(self.head_dim, self.head_dim, bias=False)
        self.queries = nn.Linear(self.head_dim, self.head_dim, bias=False)
        self.fc_out = nn.Linear(heads * self.head_dim, embed_size)

    def extra_repr(self):
        return f"embed_size={self.embed_size}, heads={self.heads}"

    def forward(self, values, keys, query, mask):
        """values, keys: (N, key_len, embed_size); query: (N, query_len, embed_size); mask: nonzero
        = keep, broadcastable to (N, heads, query_len, key_len), or None. Returns (N, query_len, embed_size)."""
        v, k, q = self.project(values, keys, query)
        mask = attention_mask(mask, q.shape[0], self.heads, q.shape[1], k.shape[1])
        return self.attend(q, k, v, mask)

    def project(self, values, keys, query):
        """v, k, q as (N, len, heads, head_dim): one GEMM for self-attention, one for keys and values."""
        if values is keys and keys is query:
            weight = torch.cat([self.values.weight, self.keys.weight, self.queries.weight])
            return F.linear(self._split(query), weight).split(self.head_dim, dim=-1)
        return (*self.project_kv(values, keys), self.project_query(query))

    def project_kv(self, values, keys):
        if values is keys:
            weight = torch.cat([self.values.weight, self.keys.weight])
            return F.linear(self._split(keys), weight).split(self.head_dim, dim=-1)
        return self.values(self._split(values)), self.keys(self._split(keys))

    def project_query(self, query):
        return self.queries(self._split(query))

    def _split(self, x):
        # (N, len, embed_size) -> (N, len, heads, head_dim), a view
        return x.reshape(x.shape[0], x.shape[1], self.heads, self.head_dim)

    def attend(self, q, k, v, mask):
        """Attention of projected q (N, query_len, heads, head_dim) over k, v, then fc_out."""
        n, query_len = q.shape[:2]
        out = backend.attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            **mask.as_kwargs(),
            softmax_scale=self.embed_size**-0.5,
        )
        # (N, heads, query_len, head_dim) -> (N, query_len, embed_size)
        return self.fc_out(out.transpose(1, 2).reshape(n, query_len, self.embed_size))

    def attend_packed(self, x, lengths, memory=None):
        """forward on packed rows (fastformer.packing): x (rows, embed_size) the queries' rows of
        every sentence back to back, memory the keys' and values' rows (None: x's, self-attention),
        lengths their PackedLengths. Each sentence's queries attend over its own keys
        (kernels.attention_varlen's kernels). Returns (rows, embed_size)."""
        if memory is None:
            weight = torch.cat([self.values.weight, self.keys.weight, self.queries.weight])
            v, k, q = F.linear(self._heads(x), weight).split(self.head_dim, dim=-1)
        else:
            weight = torch.cat([self.values.weight, self.keys.weight])
            v, k = F.linear(self._heads(memory), weight).split(self.head_dim, dim=-1)
            q = F.linear(self._heads(x), self.queries.weight)
        # (rows, heads, head_dim), no dropout (the original has none in attention)
        out = attention_packed(q, k, v, *lengths, 0.0, self.embed_size**-0.5, False, None)
        return self.fc_out(out.reshape(x.shape[0], self.embed_size))

    def _heads(self, rows):
        # (rows, embed_size) -> (rows, heads, head_dim), a view
        return rows.view(rows.shape[0], self.heads, self.head_dim)


class TransformerBlock(nn.Module):
    def __init__(self, embed_size, heads, dropout, forward_expansion):
        super().__init__()
        self.attention = SelfAttention(embed_size, heads)
        self.norm1 = nn.LayerNorm(embed_size)
        self.norm2 = nn.LayerNorm(embed_size)
        self.feed_forward = nn.Sequential(
            nn.Linear(embed_size, forward_expansion * embed_size),
            nn.ReLU(),
            nn.Linear(forward_expansion * embed_size, embed_size),
        )
        self.dropout = nn.Dropout(dropout)

    def forward(self, value, key, query, mask):
        """value, key: (N, key_len, embed_size); query: (N, query_len, embed_size) -> (N, query_len, embed_size)."""
        return self.finish(self.attention(value, key, query, mask), query)

    def finish(self, attention, query):
        """Everything after the attention: add + norm, feed-forward, add + norm, with the original's dropouts."""
        x = self.dropout(add_norm(self.norm1, attention, query))
        first, second = self.feed_forward[0], self.feed_forward[2]
        forward = backend.feed_forward(x, first.weight, first.bias, second.weight, second.bias, "relu")
        return self.dropout(add_norm(self.norm2, forward, x))


def _check_ids(name, ids, stack):
    """ids must index both of the Encoder's or Decoder's `stack` embedding tables."""
    check_token_ids(
        name, ids, stack.position_embedding.num_embeddings, stack.word_embedding.num_embeddings, limit="max_length"
    )


def _embed(stack, x):
    """How the original's Encoder and Decoder begin: the ids x (N, L) checked, then dropout(word + position
    embeddings); with the mask's head count (the layers' attention heads)."""
    _check_ids("x", x, stack)
    n, seq_length = x.shape
    positions = torch.arange(seq_length, device=x.device).expand(n, seq_length)
    heads = stack.layers[0].attention.heads if len(stack.layers) else 1
    return stack.dropout(stack.word_embedding(x) + stack.position_embedding(positions)), heads


class Encoder(nn.Module):
    def __init__(self, src_vocab_size, embed_size, num_layers, heads, device, forward_expansion, dropout, max_length):
        super().__init__()
        self.embed_size = embed_size
        self.device = device  # kept for the original's signature; positions follow the inputs' device
        self.word_embedding = nn.Embedding(src_vocab_size, embed_size)
        self.position_embedding = nn.Embedding(max_length, embed_size)
        self.layers = nn.ModuleList(
            [
                TransformerBlock(embed_size, heads, dropout=dropout, forward_expansion=forward_expansion)
                for _ in range(num_layers)
            ]
        )
        self.dropout = nn.Dropout(dropout)

    def forward(self, x, mask):
        """x: (N, src_len) ids; mask: (N, 1, 1, src_len), nonzero = keep. Returns (N, src_len, embed_size)."""
        out, heads = _embed(self, x)
        n, seq_length = x.shape
        mask = attention_mask(mask, n, heads, seq_length, seq_length)
        for layer in self.layers:
            out = layer(out, out, out, mask)
        return out

    def packed(self, x, packing):
        """forward on the real tokens of x (N, src_len) alone, the Packing of its padding: the
        word and position embeddings of those tokens (each at its own position), every layer on
        their rows, each sentence's self-attention over its own. Returns (rows, embed_size)."""
        positions = torch.arange(x.shape[1], device=x.device).expand(x.shape)
        out = self.dropout(self.word_embedding(packing.gather(x)) + self.position_embedding(packing.gather(positions)))
        lengths = packing.self_attention()
        for layer in self.layers:
            out = layer.finish(layer.attention.attend_packed(out, lengths), out)
        return out


class DecoderBlock(nn.Module):
    def __init__(self, embed_size, heads, forward_expansion, dropout, device):
        super().__init__()
        self.norm = nn.LayerNorm(embed_size)
        self.attention = SelfAttention(embed_size, heads=heads)
        self.transformer_block = TransformerBlock(embed_size, heads, dropout, forward_expansion)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x, value, key, src_mask, trg_mask):
        """x: (N, trg_len, embed_size); value, key: the encoder output (N, src_len, embed_size)."""
        attention = self.attention(x, x, x, trg_mask)
        query = self.dropout(add_norm(self.norm, attention, x))
        return self.transformer_block(value, key, query, src_mask)

    def packed(self, x, enc_rows, lengths):
        """forward with the encoder's output as packed rows, enc_rows (rows, embed_size): the
        cross-attention of each sentence's positions over its own rows (lengths: PackedLengths,
        the queries' then the keys')."""
        attention = self.attention(x, x, x, AttentionMask(causal=True))
        query = self.dropout(add_norm(self.norm, attention, x))
        block = self.transformer_block
        cross = block.attention.attend_packed(query.reshape(-1, query.shape[-1]), lengths, memory=enc_rows)
        return block.finish(cross.view(query.shape), query)

    def step(self, x, t, cache, src_mask):
        """One decoding step for x (N, 1, embed_size) at position t, reading and extending `cache`."""
        v, k, q = self.attention.project(x, x, x)
        cache.self_k[:, t] = k[:, 0]
        cache.self_v[:, t] = v[:, 0]
        # the query is the newest position, so attending to every cached key is causal
        attention = self.attention.attend(q, cache.self_k[:, : t + 1], cache.self_v[:, : t + 1], AttentionMask())
        query = self.dropout(add_norm(self.norm, attention, x))
        cross = self.transformer_block.attention
        attention = cross.attend(cross.project_query(query), cache.cross_k, cache.cross_v, src_mask)
        return self.transformer_block.finish(attention, query)


class LayerCache(NamedTuple):
    self_k: torch.Tensor  # (N, max_len, heads, head_dim), filled up to the current step
    self_v: torch.Tensor
    cross_k: torch.Tensor  # (N, src_len, heads, head_dim), computed once
    cross_v: torch.Tensor


class Decoder(nn.Module):
    def __init__(self, trg_vocab_size, embed_size, num_layers, heads, forward_expansion, dropout, device, max_length):
        super().__init__()
        self.device = device  # kept for the original's signature; positions follow the inputs' device
        self.word_embedding = nn.Embedding(trg_vocab_size, embed_size)
        self.position_embedding = nn.Embedding(max_length, embed_size)
        self.layers = nn.ModuleList(
            [DecoderBlock(embed_size, heads, forward_expansion, dropout, device) for _ in range(num_layers)]
        )
        self.fc_out = nn.Linear(embed_size, trg_vocab_size)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x, enc_out, src_mask, trg_mask):
        """x: (N, trg_len) ids; enc_out: (N, src_len, embed_size); src_mask (N, 1, 1, src_len) and
        trg_mask (N, 1, trg_len, trg_len), nonzero = keep. Returns logits (N, trg_len, trg_vocab_size)."""
        x, heads = _embed(self, x)
        n, seq_length = x.shape[:2]  # (N, trg_len, embed_size)
        src_mask = attention_mask(src_mask, n, heads, seq_length, enc_out.shape[1], "src_mask")
        trg_mask = attention_mask(trg_mask, n, heads, seq_length, seq_length, "trg_mask")
        for layer in self.layers:
            x = layer(x, enc_out, enc_out, src_mask, trg_mask)
        return self.fc_out(x)

    def packed(self, x, enc_rows, packing):
        """forward with the encoder's output as the Packing's rows, enc_rows (rows, embed_size):
        the target's positions (no padding: they are its own) cross-attend over their sentence's rows."""
        x, _ = _embed(self, x)
        lengths = packing.cross_attention(x.shape[1])
        for layer in self.layers:
            x = layer.packed(x, enc_rows, lengths)
        return self.fc_out(x)

    def start_cache(self, enc_out, max_len) -> list[LayerCache]:
        """Per layer: empty self-attention key/value buffers and the encoder's projected keys/values."""
        caches = []
        for layer in self.layers:
            attn = layer.attention
            shape = (enc_out.shape[0], max_len, attn.heads, attn.head_dim)
            cross_v, cross_k = layer.transformer_block.attention.project_kv(enc_out, enc_out)
            # the projections' dtype (the autocast dtype under autocast), like the keys the cache will hold
            caches.append(LayerCache(cross_k.new_empty(shape), cross_k.new_empty(shape), cross_k, cross_v))
        return caches

    def step(self, tokens, t, caches, src_mask):
        """Logits (N, trg_vocab_size) for the next token after `tokens` (N,) at position t."""
        x = self.word_embedding(tokens)[:, None] + self.position_embedding.weight[t]
        x = self.dropout(x)
        for layer, cache in zip(self.layers, caches):
            x = layer.step(x, t, cache, src_mask)
        return self.fc_out(x[:, 0])


class Transformer(nn.Module):
    def __init__(
        self,
        src_vocab_size,
        trg_vocab_size,
        src_pad_idx,
        trg_pad_idx,
        embed_size=512,
        num_layers=6,
        forward_expansion=4,
        heads=8,
        dropout=0,
        device="cpu",
        max_length=100,
    ):
        super().__init__()
        self.encoder = Encoder(
            src_vocab_size, embed_size, num_layers, heads, device, forward_expansion, dropout, max_length
        )
        self.decoder = Decoder(
            trg_vocab_size, embed_size, num_layers, heads, forward_expansion, dropout, device, max_length
        )
        self.src_pad_idx = src_pad_idx
        self.trg_pad_idx = trg_pad_idx
        self.device = device

    def make_src_mask(self, src):
        """(N, 1, 1, src_len), True where src is not padding."""
        return (src != self.src_pad_idx).unsqueeze(1).unsqueeze(2)

    def make_trg_mask(self, trg):
        """(N, 1, trg_len, trg_len) lower-triangular ones."""
        n, trg_len = trg.shape
        return torch.tril(torch.ones((trg_len, trg_len), device=trg.device)).expand(n, 1, trg_len, trg_len)

    def forward(self, src, trg):
        """src: (N, src_len) ids; trg: (N, trg_len) ids. Returns logits (N, trg_len, trg_vocab_size).

        The masks are make_src_mask's and make_trg_mask's, handed to the layers in their compact
        form (a key-padding vector; a causal flag). Where `packs`, the encoder runs on the real
        tokens alone (the module docstring)."""
        limits = self.encoder.position_embedding.num_embeddings, self.encoder.word_embedding.num_embeddings
        check_ids_shape("src", src, limits[0], limit="max_length")
        packs = self.packs(src)
        pad = src.eq(self.src_pad_idx)
        if packs:
            # the ids' range and the packing's counts in one copy (on CUDA the check's one sync)
            counts, offsets = packing_lengths(pad)
            rows, longest, shortest = check_token_ids(
                "src", src, *limits, limit="max_length", counts=(offsets[-1], counts.max(), counts.min())
            )
        else:
            _check_ids("src", src, self.encoder)
        check_ids_shape("trg", trg, self.decoder.position_embedding.num_embeddings, limit="max_length")
        if src.shape[0] != trg.shape[0]:
            raise ValueError(
                f"src and trg must hold the same sentences, one per row: got src {tuple(src.shape)} and trg "
                f"{tuple(trg.shape)}"
            )
        # packed where there is padding to leave out and no source of padding alone (whose
        # positions attend uniformly over its padding: the padded encoder's outputs there count)
        if packs and rows < pad.numel() and shortest > 0:
            packing = make_packing(pad, offsets, rows, longest)
            return self.decoder.packed(trg, self.encoder.packed(src, packing), packing)
        src_mask = AttentionMask(key_padding_mask=pad)
        enc_src = self.encoder(src, src_mask)
        return self.decoder(trg, enc_src, src_mask, AttentionMask(causal=True))

    def packs(self, src):
        """Whether forward may run the encoder on the real tokens alone: packing on
        (fastformer.packing), the count readable (eager, no capture), attention and add +
        LayerNorm on the Triton kernels, and every module of encoder and decoder stock, without
        hooks (fastformer.fusion), so that nothing sees the packed rows in the padded tensors' place."""
        if not packing_enabled() or not can_read_counts(src):
            return False
        ops = backend.ops(self.encoder.word_embedding.weight)
        if not ops.kernels or ops.add_layer_norm is not backend.kernels.add_layer_norm:
            return False
        return fusable(self.encoder, ENCODER_ROLES) and fusable(self.decoder, DECODER_ROLES)

    @torch.no_grad()
    def generate(self, src, max_len, bos_idx, eos_idx=None, use_cache=True):
        """Batched greedy decoding, in eval mode.

        Args:
            src: (N, src_len) source ids.
            max_len: length of the returned sequences, [BOS] included (at most max_length).
            bos_idx: the first target token of every sequence.
            eos_idx: a sequence stops after producing it (later positions hold trg_pad_idx); all
                stop once every sequence has. None: always decode max_len tokens.
            use_cache: True runs the incremental decoder (encoder keys/values projected once, a
                key/value cache for decoder self-attention); False re-decodes the whole prefix at
                every step, the plain way, for comparison. Both return the same tokens.

        Returns:
            (N, L) token ids with L <= max_len, starting with bos_idx.
        """
        _check_ids("src", src, self.encoder)
        limit = self.decoder.position_embedding.num_embeddings
        if not 1 <= max_len <= limit:
            raise ValueError(f"max_len must be in 1..{limit} (the decoder's max_length), got {max_len}")
        was_training = self.training
        self.eval()
        try:
            return self._greedy(src, max_len, bos_idx, eos_idx, use_cache)
        finally:
            self.train(was_training)

    def _greedy(self, src, max_len, bos_idx, eos_idx: int | None, use_cache):
        n = src.shape[0]
        src_mask = AttentionMask(key_padding_mask=src.eq(self.src_pad_idx))
        enc_src = self.encoder(src, src_mask)
        tokens = torch.full((n, max_len), self.trg_pad_idx, dtype=torch.long, device=src.device)
        tokens[:, 0] = bos_idx
        finished = torch.zeros(n, dtype=torch.bool, device=src.device)
        caches = self.decoder.start_cache(enc_src, max_len) if use_cache else None
        for t in range(1, max_len):
            if use_cache:
                logits = self.decoder.step(tokens[:, t - 1], t - 1, caches, src_mask)
            else:
                logits = self.decoder(tokens[:, :t], enc_src, src_mask, AttentionMask(causal=True))[:, -1]
            next_token = logits.argmax(-1)
            if eos_idx is not None:
                next_token = next_token.masked_fill(finished, self.trg_pad_idx)
                finished |= next_token.eq(eos_idx)
            tokens[:, t] = next_token
            if eos_idx is not None and bool(finished.all()):
                return tokens[:, : t + 1]
        return tokens


# The stock type of each module of the Encoder's and the Decoder's subtrees, by role (the last part
# of its name; fastformer.fusion): the packed forward reads their weights and runs them on rows
_BLOCK_ROLES = {
    "attention": SelfAttention,
    "values": nn.Linear,
    "keys": nn.Linear,
    "queries": nn.Linear,
    "fc_out": nn.Linear,
    "norm": nn.LayerNorm,
    "norm1": nn.LayerNorm,
    "norm2": nn.LayerNorm,
    "feed_forward": nn.Sequential,
    "feed_forward[0]": nn.Linear,
    "feed_forward[1]": nn.ReLU,
    "feed_forward[2]": nn.Linear,
    "dropout": nn.Dropout,
    "word_embedding": nn.Embedding,
    "position_embedding": nn.Embedding,
    "layers": nn.ModuleList,
}
ENCODER_ROLES = {**_BLOCK_ROLES, "": Encoder, "[i]": TransformerBlock}
DECODER_ROLES = {**_BLOCK_ROLES, "": Decoder, "[i]": DecoderBlock, "transformer_block": TransformerBlock}
