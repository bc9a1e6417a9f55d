"""The tutorial's Transformer, module for module, with the math routed through `kernels`.

Names, constructor arguments, forward signatures, return tuples and parameter names are the
tutorial's, so its checkpoints load with strict=True. Two things differ, both invisible to its code:

- Encoder and Decoder pass an `AttentionMask` (key-padding vector + causal flag) down to the layers
  instead of a dense (bs, n_q_seq, n_k_seq) mask; the layers still accept a dense bool mask.
- Attention probabilities are computed only when asked for: `config.output_attentions` True
  returns them, False returns None in their place, and unset (the default) returns them on the
  reference backend (as the tutorial does) and None on the Triton fast path, which never builds them.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from fastformer import backend
from fastformer.config import check_config
from fastformer.masks import AttentionMask, get_sinusoid_encoding_table

ACTIVATIONS = ("gelu", "relu")  # config.ffn_activation


def wants_probs(config, tensor):
    """Whether attention modules return probabilities (see the module docstring)."""
    flag = config.get("output_attentions")
    if flag is None:
        return not backend.uses_triton(tensor)
    return bool(flag)


def active_p(dropout):
    """An nn.Dropout's probability when it is active (training), else 0."""
    return dropout.p if dropout.training else 0.0


def add_norm(layer_norm, x, residual, dropout):
    """layer_norm(residual + dropout(x)) through the fused op."""
    return backend.add_layer_norm(x, residual, layer_norm.weight, layer_norm.bias, layer_norm.eps, active_p(dropout))


def layer_weights(*modules):
    """Under torch.autocast, the matrices and biases of a layer's attention and feed-forward modules
    in the autocast dtype, for all of them one concatenation and one cast (and in the backward one
    of each for their gradients), where autocast casts every tensor at every use and the attention
    concatenates W_Q, W_K and W_V: a list of each module's weights, in the order of its
    `weight_groups`. The values are autocast's, bit for bit. Outside autocast, or for parameters
    autocast does not cast (not fp32), None for each module: the modules use their parameters."""
    module_groups = [module.weight_groups() for module in modules]
    groups = [group for module_group in module_groups for group in module_group]
    tensors = [t for group, _ in groups for t in group]
    device_type = tensors[0].device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None
    if dtype not in (torch.float16, torch.bfloat16) or any(t.dtype != torch.float32 for t in tensors):
        return [None] * len(modules)
    # split, not slices: the backward of one split is one concatenation of the gradients
    flat = torch.cat([t.reshape(-1) for t in tensors]).to(dtype)
    pieces = iter(flat.split([sum(t.numel() for t in group) for group, _ in groups]))
    return [[next(pieces).view(shape) for _, shape in module_group] for module_group in module_groups]


def check_token_ids(name, ids, max_len, vocab_size, limit="the config's maximum"):
    """Raise ValueError unless ids is a (bs, n_seq) integer tensor no longer than max_len whose ids
    lie in [0, vocab_size). Out-of-range ids would otherwise fail inside the embedding: an
    IndexError on a CPU, a device-side assert on CUDA that ends the process's CUDA context.

    The range check is one kernel (a min/max reduction into one two-number buffer) and, for CUDA
    ids, one host sync of the buffer per call. It is skipped while torch.compile traces and while a
    CUDA graph is captured, where a sync is not allowed: compiled and graphed steps trust their ids."""
    if (
        not isinstance(ids, torch.Tensor)
        or ids.dim() != 2
        or ids.is_floating_point()
        or ids.is_complex()
        or ids.dtype == torch.bool
    ):
        shape = tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise ValueError(f"{name} must be a (bs, n_seq) tensor of token ids, got {shape}")
    if ids.size(1) > max_len:
        raise ValueError(f"{name} has length {ids.size(1)}, longer than {limit} {max_len}")
    if ids.numel() == 0 or torch.compiler.is_compiling():
        return
    if ids.is_cuda and torch.cuda.is_current_stream_capturing():
        return
    bounds = torch.empty(2, dtype=ids.dtype, device=ids.device)
    torch.aminmax(ids, out=(bounds[0], bounds[1]))
    low, high = bounds.tolist()
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise ValueError(f"{name} holds token id {bad}, outside [0, {vocab_size}) for a vocabulary of {vocab_size}")


def position_ids(inputs, pad):
    """Positions 1..n_seq, with 0 (the table's unused row) at padding."""
    # (bs, n_seq)
    positions = torch.arange(1, inputs.size(1) + 1, device=inputs.device).expand_as(inputs)
    return positions.masked_fill(pad, 0)


def sinusoid_embedding(n_seq, d_hidn):
    """The frozen position embedding of n_seq + 1 rows (row 0 for padding)."""
    table = torch.tensor(get_sinusoid_encoding_table(n_seq + 1, d_hidn), dtype=torch.float32)
    return nn.Embedding.from_pretrained(table, freeze=True)


class ScaledDotProductAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.dropout = nn.Dropout(config.dropout)
        self.scale = 1 / (self.config.d_head**0.5)

    def forward(self, Q, K, V, attn_mask):
        """Q: (bs, n_head, n_q_seq, d_head); K, V: (bs, n_head, n_k_seq, d_head); attn_mask: dense
        bool (bs, [n_head,] n_q_seq, n_k_seq) with True = masked, or an AttentionMask.
        Returns context (bs, n_head, n_q_seq, d_head) and probabilities or None."""
        return_probs = wants_probs(self.config, Q)
        out = backend.attention(
            Q,
            K,
            V,
            **AttentionMask.of(attn_mask).as_kwargs(),
            dropout_p=active_p(self.dropout),
            softmax_scale=self.scale,
            return_probs=return_probs,
        )
        # (bs, n_head, n_q_seq, d_head), (bs, n_head, n_q_seq, n_k_seq) or None
        return out if return_probs else (out, None)


class MultiHeadAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        d_attn = config.n_head * config.d_head
        self.W_Q = nn.Linear(config.d_hidn, d_attn)
        self.W_K = nn.Linear(config.d_hidn, d_attn)
        self.W_V = nn.Linear(config.d_hidn, d_attn)
        self.scaled_dot_attn = ScaledDotProductAttention(config)
        self.linear = nn.Linear(d_attn, config.d_hidn)
        self.dropout = nn.Dropout(config.dropout)

    def extra_repr(self):
        return f"n_head={self.config.n_head}, d_head={self.config.d_head}"

    def forward(self, Q, K, V, attn_mask):
        """Q: (bs, n_q_seq, d_hidn); K, V: (bs, n_k_seq, d_hidn). Returns (bs, n_q_seq, d_hidn) and
        the probabilities (bs, n_head, n_q_seq, n_k_seq) or None."""
        output, attn_prob = self.attend(Q, K, V, attn_mask)
        return self.dropout(output), attn_prob

    def weight_groups(self):
        """(tensors, shape) of what `layer_weights` casts: the W_Q; W_K; W_V weight and bias, as one
        projection, then the output linear's weight and bias."""
        d_attn = self.config.n_head * self.config.d_head
        linears = [self.W_Q, self.W_K, self.W_V]
        return [
            ([lin.weight for lin in linears], (3 * d_attn, self.config.d_hidn)),
            ([lin.bias for lin in linears], (3 * d_attn,)),
            ([self.linear.weight], self.linear.weight.shape),
            ([self.linear.bias], self.linear.bias.shape),
        ]

    def attend(self, Q, K, V, attn_mask, weights=None):
        """forward without the output dropout, which the layers fuse into add + LayerNorm.
        weights: the module's weights from `layer_weights`, or None to use its parameters."""
        batch_size = Q.size(0)
        q_s, k_s, v_s = self.project(Q, K, V, None if weights is None else weights[:2])
        context, attn_prob = self.scaled_dot_attn(q_s, k_s, v_s, attn_mask)
        # (bs, n_q_seq, n_head * d_head): free when the kernel wrote context head-interleaved
        context = context.transpose(1, 2).reshape(batch_size, -1, self.config.n_head * self.config.d_head)
        output = self.linear(context) if weights is None else F.linear(context, *weights[2:])
        return output, attn_prob

    def project(self, Q, K, V, weights=None):
        """q_s, k_s, v_s as (bs, n_head, n_seq, d_head) views of the projections: one GEMM for
        self-attention (Q is K is V), one for K and V in cross-attention, no transpose copies.
        weights: the (W_Q; W_K; W_V) weight and bias from `layer_weights`, or None for the parameters."""
        if Q is K and K is V:
            inputs, sizes = [Q], [3]
        elif K is V:
            inputs, sizes = [Q, K], [1, 2]
        else:
            inputs, sizes = [Q, K, V], [1, 1, 1]
        if weights is None:
            linears = iter([self.W_Q, self.W_K, self.W_V])
            groups = [[next(linears) for _ in range(size)] for size in sizes]
            pairs = [
                (group[0].weight, group[0].bias)
                if len(group) == 1
                else (torch.cat([lin.weight for lin in group]), torch.cat([lin.bias for lin in group]))
                for group in groups
            ]
        elif len(sizes) == 1:
            pairs = [weights]
        else:
            rows = [size * self.config.n_head * self.config.d_head for size in sizes]
            pairs = list(zip(weights[0].split(rows), weights[1].split(rows)))
        heads = []
        for x, size, (weight, bias) in zip(inputs, sizes, pairs):
            # (bs, n_seq, size, n_head, d_head)
            y = F.linear(x, weight, bias).view(x.size(0), x.size(1), size, self.config.n_head, self.config.d_head)
            # the backward of unbind stacks the gradients: a copy, which one projection does not need
            heads.extend(y.unbind(2) if size > 1 else [y.squeeze(2)])
        # each (bs, n_head, n_seq, d_head)
        return [h.transpose(1, 2) for h in heads]


class PoswiseFeedForwardNet(nn.Module):
    """conv2(act(conv1(x))): act is the tutorial's exact GELU, or ReLU with config.ffn_activation = "relu"."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.activation = config.get("ffn_activation", "gelu")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"config.ffn_activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        # Conv1d with kernel_size 1, as the tutorial has them, so its checkpoints load.
        self.conv1 = nn.Conv1d(in_channels=config.d_hidn, out_channels=config.d_ff, kernel_size=1)
        self.conv2 = nn.Conv1d(in_channels=config.d_ff, out_channels=config.d_hidn, kernel_size=1)
        self.dropout = nn.Dropout(config.dropout)

    def extra_repr(self):
        return f"activation={self.activation!r}"

    def forward(self, inputs):
        """inputs: (bs, n_seq, d_hidn) -> (bs, n_seq, d_hidn)."""
        return self.dropout(self.transform(inputs))

    def weight_groups(self):
        """(tensors, shape) of what `layer_weights` casts: conv1's and conv2's weights, as nn.Linear
        weights, and biases."""
        d_hidn, d_ff = self.config.d_hidn, self.config.d_ff
        return [
            ([self.conv1.weight], (d_ff, d_hidn)),
            ([self.conv1.bias], (d_ff,)),
            ([self.conv2.weight], (d_hidn, d_ff)),
            ([self.conv2.bias], (d_hidn,)),
        ]

    def transform(self, inputs, weights=None):
        """forward without the output dropout, which the layers fuse into add + LayerNorm.
        weights: the module's weights from `layer_weights`, or None to use its parameters."""
        if weights is None:
            # the Conv1d weights (out, in, 1) read as nn.Linear weights (out, in): views, not copies
            weights = [self.conv1.weight.squeeze(-1), self.conv1.bias, self.conv2.weight.squeeze(-1), self.conv2.bias]
        else:
            # the cast autocast gives the first product's input (the ops take one dtype)
            inputs = inputs.to(weights[0].dtype)
        return backend.feed_forward(inputs, *weights, self.activation)


class EncoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.self_attn = MultiHeadAttention(config)
        self.layer_norm1 = nn.LayerNorm(config.d_hidn, eps=config.layer_norm_epsilon)
        self.pos_ffn = PoswiseFeedForwardNet(config)
        self.layer_norm2 = nn.LayerNorm(config.d_hidn, eps=config.layer_norm_epsilon)

    def forward(self, inputs, attn_mask):
        """inputs: (bs, n_enc_seq, d_hidn). Returns (bs, n_enc_seq, d_hidn) and the self-attention
        probabilities (bs, n_head, n_enc_seq, n_enc_seq) or None."""
        attn_weights, ffn_weights = layer_weights(self.self_attn, self.pos_ffn)
        att_outputs, attn_prob = self.self_attn.attend(inputs, inputs, inputs, attn_mask, attn_weights)
        att_outputs = add_norm(self.layer_norm1, att_outputs, inputs, self.self_attn.dropout)
        ffn_outputs = self.pos_ffn.transform(att_outputs, ffn_weights)
        ffn_outputs = add_norm(self.layer_norm2, ffn_outputs, att_outputs, self.pos_ffn.dropout)
        return ffn_outputs, attn_prob


class Encoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.enc_emb = nn.Embedding(config.n_enc_vocab, config.d_hidn)
        self.pos_emb = sinusoid_embedding(config.n_enc_seq, config.d_hidn)
        self.layers = nn.ModuleList([EncoderLayer(config) for _ in range(config.n_layer)])

    def forward(self, inputs):
        """inputs: (bs, n_enc_seq) token ids. Returns (bs, n_enc_seq, d_hidn) and a list of each
        layer's probabilities (or None)."""
        check_token_ids("inputs", inputs, self.config.n_enc_seq, self.config.n_enc_vocab)
        # (bs, n_enc_seq)
        pad = inputs.eq(self.config.i_pad)
        outputs = self.enc_emb(inputs) + self.pos_emb(position_ids(inputs, pad))
        attn_mask = AttentionMask(key_padding_mask=pad)
        attn_probs = []
        for layer in self.layers:
            outputs, attn_prob = layer(outputs, attn_mask)
            attn_probs.append(attn_prob)
        return outputs, attn_probs


class DecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.self_attn = MultiHeadAttention(config)
        self.layer_norm1 = nn.LayerNorm(config.d_hidn, eps=config.layer_norm_epsilon)
        self.dec_enc_attn = MultiHeadAttention(config)
        self.layer_norm2 = nn.LayerNorm(config.d_hidn, eps=config.layer_norm_epsilon)
        self.pos_ffn = PoswiseFeedForwardNet(config)
        self.layer_norm3 = nn.LayerNorm(config.d_hidn, eps=config.layer_norm_epsilon)

    def forward(self, dec_inputs, enc_outputs, self_attn_mask, dec_enc_attn_mask):
        """dec_inputs: (bs, n_dec_seq, d_hidn); enc_outputs: (bs, n_enc_seq, d_hidn). Returns
        (bs, n_dec_seq, d_hidn) and the self- and cross-attention probabilities (or None)."""
        self_weights, cross_weights, ffn_weights = layer_weights(self.self_attn, self.dec_enc_attn, self.pos_ffn)
        self_att_outputs, self_attn_prob = self.self_attn.attend(
            dec_inputs, dec_inputs, dec_inputs, self_attn_mask, self_weights
        )
        self_att_outputs = add_norm(self.layer_norm1, self_att_outputs, dec_inputs, self.self_attn.dropout)
        dec_enc_att_outputs, dec_enc_attn_prob = self.dec_enc_attn.attend(
            self_att_outputs, enc_outputs, enc_outputs, dec_enc_attn_mask, cross_weights
        )
        dec_enc_att_outputs = add_norm(
            self.layer_norm2, dec_enc_att_outputs, self_att_outputs, self.dec_enc_attn.dropout
        )
        ffn_outputs = self.pos_ffn.transform(dec_enc_att_outputs, ffn_weights)
        ffn_outputs = add_norm(self.layer_norm3, ffn_outputs, dec_enc_att_outputs, self.pos_ffn.dropout)
        return ffn_outputs, self_attn_prob, dec_enc_attn_prob


class Decoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.dec_emb = nn.Embedding(config.n_dec_vocab, config.d_hidn)
        self.pos_emb = sinusoid_embedding(config.n_dec_seq, config.d_hidn)
        self.layers = nn.ModuleList([DecoderLayer(config) for _ in range(config.n_layer)])

    def forward(self, dec_inputs, enc_inputs, enc_outputs):
        """dec_inputs: (bs, n_dec_seq) ids; enc_inputs: (bs, n_enc_seq) ids; enc_outputs:
        (bs, n_enc_seq, d_hidn). Returns (bs, n_dec_seq, d_hidn) and lists of each layer's self- and
        cross-attention probabilities (or None)."""
        check_token_ids("dec_inputs", dec_inputs, self.config.n_dec_seq, self.config.n_dec_vocab)
        # (bs, n_dec_seq)
        dec_pad = dec_inputs.eq(self.config.i_pad)
        dec_outputs = self.dec_emb(dec_inputs) + self.pos_emb(position_ids(dec_inputs, dec_pad))
        self_attn_mask = AttentionMask(key_padding_mask=dec_pad, causal=True)
        dec_enc_attn_mask = AttentionMask(key_padding_mask=enc_inputs.eq(self.config.i_pad))
        self_attn_probs, dec_enc_attn_probs = [], []
        for layer in self.layers:
            dec_outputs, self_attn_prob, dec_enc_attn_prob = layer(
                dec_outputs, enc_outputs, self_attn_mask, dec_enc_attn_mask
            )
            self_attn_probs.append(self_attn_prob)
            dec_enc_attn_probs.append(dec_enc_attn_prob)
        return dec_outputs, self_attn_probs, dec_enc_attn_probs


class Transformer(nn.Module):
    def __init__(self, config):
        super().__init__()
        check_config(config)
        self.config = config
        self.encoder = Encoder(config)
        self.decoder = Decoder(config)

    def forward(self, enc_inputs, dec_inputs):
        """Returns dec_outputs (bs, n_dec_seq, d_hidn) and the encoder self-, decoder self- and
        decoder-encoder attention probabilities, one list entry per layer (or None)."""
        enc_outputs, enc_self_attn_probs = self.encoder(enc_inputs)
        dec_outputs, dec_self_attn_probs, dec_enc_attn_probs = self.decoder(dec_inputs, enc_inputs, enc_outputs)
        return dec_outputs, enc_self_attn_probs, dec_self_attn_probs, dec_enc_attn_probs


class MovieClassification(nn.Module):
    def __init__(self, config):
        super().__init__()
        check_config(config, classifier=True)
        self.config = config
        self.transformer = Transformer(config)
        self.projection = nn.Linear(config.d_hidn, config.n_output, bias=False)

    def forward(self, enc_inputs, dec_inputs):
        """Returns logits (bs, n_output) and the three lists of attention probabilities."""
        dec_outputs, enc_self_attn_probs, dec_self_attn_probs, dec_enc_attn_probs = self.transformer(
            enc_inputs, dec_inputs
        )
        # (bs, d_hidn): max over the decoder sequence
        dec_outputs, _ = torch.max(dec_outputs, dim=1)
        logits = self.projection(dec_outputs)
        return logits, enc_self_attn_probs, dec_self_attn_probs, dec_enc_attn_probs
