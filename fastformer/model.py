"""The tutorial's Transformer, module for module, with the math routed through `kernels`.

Names, constructor arguments, forward parameters (in order), return tuples and parameter names are
the tutorial's, so its checkpoints load with strict=True. Three things differ, all invisible to its code:

- Encoder and Decoder pass an `AttentionMask` (key-padding vector + causal flag) down to the layers
  instead of a dense (bs, n_q_seq, n_k_seq) mask; the layers still accept a dense bool mask.
- Attention probabilities are computed only when asked for: `config.output_attentions` True
  returns them, False returns None in their place, and unset (the default) returns them on the
  reference backend (as the tutorial does) and None on the Triton fast path, which never builds them.
- Encoder and Decoder make a `ForwardPlan` (fastformer.plan) for their layers, which shares across
  them what each would do for itself: weights cast once, dropout seeds drawn once, the decoder's
  cross-attention keys and values projected in one product. Each layer takes its part as a
  keyword-only `plan` and hands its children theirs (ScaledDotProductAttention a `seed`); called
  alone, a layer makes a ForwardPlan of its own, and an attention or a feed-forward its part of
  one (`own_plan`), so each module has one body. With a layer's plan, a sublayer's last bias and
  dropout are fused into the add + LayerNorm that follows it; alone, they stay its own. A
  self-attention without probabilities runs on its fused QKV projection as one op
  (kernels.self_attention: no head reshapes, one gradient back to the projection).

The fusions skip calling the modules inside them, so they run only while nothing can observe that
(fastformer.fusion: stock modules in their roles, no hooks); otherwise each module runs its
`unfused` forward, the tutorial's, calling its children as modules with the tutorial's dense masks.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from fastformer import backend
from fastformer.config import check_config
from fastformer.fusion import WatchedModule, fusable
from fastformer.kernels._checks import argument_check
from fastformer.kernels.attention import mask_scores
from fastformer.kernels.attention_varlen import attention_packed
from fastformer.masks import AttentionMask, get_attn_decoder_mask, get_attn_pad_mask, get_sinusoid_encoding_table
from fastformer.packing import (
    bucket_rows,
    can_pack_statically,
    can_read_counts,
    make_packing,
    make_static_packing,
    packing_enabled,
)
from fastformer.packing import lengths as packing_lengths
from fastformer.plan import AttentionPlan, FeedForwardPlan, ForwardPlan, Hidden, Pending, active_p, linear_groups

ACTIVATIONS = ("gelu", "relu")  # config.ffn_activation


def wants_probs(config, kernels):
    """Whether attention modules return probabilities (see the module docstring); `kernels`: whether
    the attention runs the Triton kernels."""
    flag = config.get("output_attentions")
    return not kernels if flag is None else bool(flag)


EMBEDDING_DTYPES = (torch.long, torch.int32)  # the index dtypes nn.Embedding takes


@argument_check
def check_token_ids(name, ids, max_len, vocab_size, limit="the config's maximum", counts=()):
    """Raise ValueError unless ids is a (bs, n_seq) integer tensor (check_ids_shape) whose ids lie
    in [0, vocab_size). Out-of-range ids would otherwise fail inside the embedding: an IndexError on
    a CPU, a device-side assert on CUDA that ends the process's CUDA context.

    The range check is one kernel (a min/max reduction into one two-number buffer) and, for CUDA
    ids, one host sync of the buffer per call. It is skipped while torch.compile traces and while a
    CUDA graph is captured, where a sync is not allowed: compiled and graphed steps trust their ids;
    and under a torch.func transform (vmap), whose batched ids it cannot read.

    counts: one-element integer tensors on ids' device read in the same copy (the packing's counts
    of real tokens, fastformer.packing); returned as ints, or None where the check is skipped."""
    check_ids_shape(name, ids, max_len, limit)
    if not can_read_counts(ids):
        return None  # tracing, capturing; or a torch.func transform (vmap has no batching rule for the min/max)
    bounds = torch.empty(2 + len(counts), dtype=ids.dtype, device=ids.device)
    torch.aminmax(ids, out=(bounds[0], bounds[1]))
    if counts:
        torch.stack(counts, out=bounds[2:])
    low, high, *values = bounds.tolist()
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise ValueError(f"{name} holds token id {bad}, outside [0, {vocab_size}) for a vocabulary of {vocab_size}")
    return values


@argument_check
def check_ids_shape(name, ids, max_len, limit="the config's maximum"):
    """Raise ValueError unless ids is a (bs, n_seq) integer tensor of at least one sequence
    (bs >= 1) of at least one token (1 <= n_seq <= max_len), checked on its shape and dtype alone
    (no kernel, no sync). An empty batch or sequence would otherwise fail inside the attention on
    either backend; the tutorial's own model cannot run one either."""
    if not isinstance(ids, torch.Tensor):
        raise ValueError(f"{name} must be a (bs, n_seq) tensor of token ids, got a {type(ids).__name__}")
    if ids.dim() != 2:
        raise ValueError(f"{name} must be a (bs, n_seq) tensor of token ids, got shape {tuple(ids.shape)}")
    if ids.dtype not in EMBEDDING_DTYPES:  # nn.Embedding takes these; the tutorial's model refuses the rest too
        raise ValueError(
            f"{name} must hold integer token ids (torch.long), got {ids.dtype}: the embedding takes torch.long "
            "and torch.int32 (convert them with .long())"
        )
    if ids.size(0) == 0:
        raise ValueError(f"{name} is an empty batch, shape {tuple(ids.shape)}: the model needs at least one sequence")
    if ids.size(1) == 0:
        raise ValueError(
            f"{name} holds sequences of no tokens, shape {tuple(ids.shape)}: each needs at least one (an empty "
            "one can be a single padding id)"
        )
    if ids.size(1) > max_len:
        raise ValueError(f"{name} has length {ids.size(1)}, longer than {limit} {max_len}")


@argument_check
def check_same_batch(enc_inputs, dec_inputs, enc_outputs=None):
    """Raise ValueError unless the decoder's inputs are of the encoder's reviews: enc_inputs and
    dec_inputs (checked by check_ids_shape) of one batch size, and enc_outputs, when given (the
    Decoder's own check), (bs, n_enc_seq, d_hidn) for enc_inputs (bs, n_enc_seq). Attention would
    otherwise name its own q, k and v."""
    if enc_inputs.size(0) != dec_inputs.size(0):
        raise ValueError(
            f"enc_inputs and dec_inputs must hold the same reviews, one per row: got enc_inputs "
            f"{tuple(enc_inputs.shape)} and dec_inputs {tuple(dec_inputs.shape)}"
        )
    if enc_outputs is None:
        return
    if not isinstance(enc_outputs, torch.Tensor) or enc_outputs.dim() != 3 or enc_outputs.shape[:2] != enc_inputs.shape:
        shape = tuple(enc_outputs.shape) if isinstance(enc_outputs, torch.Tensor) else type(enc_outputs).__name__
        raise ValueError(
            f"enc_outputs must be the Encoder's output for enc_inputs {tuple(enc_inputs.shape)}, "
            f"({enc_inputs.size(0)}, {enc_inputs.size(1)}, d_hidn): got {shape}"
        )


def position_ids(inputs, pad):
    """Positions 1..n_seq, with 0 (the table's unused row) at padding."""
    # (bs, n_seq)
    positions = torch.arange(1, inputs.size(1) + 1, device=inputs.device).expand_as(inputs)
    return positions.masked_fill(pad, 0)


def sinusoid_embedding(n_seq, d_hidn):
    """The frozen position embedding of n_seq + 1 rows (row 0 for padding)."""
    table = torch.tensor(get_sinusoid_encoding_table(n_seq + 1, d_hidn), dtype=torch.float32)
    return nn.Embedding.from_pretrained(table, freeze=True)


class ScaledDotProductAttention(WatchedModule):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.dropout = nn.Dropout(config.dropout)
        self.scale = 1 / (self.config.d_head**0.5)

    def forward(self, Q, K, V, attn_mask, *, seed=None):
        """Q: (bs, n_head, n_q_seq, d_head); K, V: (bs, n_head, n_k_seq, d_head); attn_mask: dense
        bool (bs, [n_head,] n_q_seq, n_k_seq) with True = masked, or an AttentionMask; seed: the
        kernel's dropout seed (see fastformer.plan), or None to draw one.
        Returns context (bs, n_head, n_q_seq, d_head) and probabilities or None."""
        return_probs = wants_probs(self.config, backend.uses_triton(Q))
        if not fusable(self.dropout, DROPOUT_ROLES):  # the kernel would drop out without calling it
            return self.unfused(Q, K, V, attn_mask, return_probs)
        out = backend.attention(
            Q,
            K,
            V,
            **AttentionMask.of(attn_mask).as_kwargs(),
            dropout_p=active_p(self.dropout),
            softmax_scale=self.scale,
            return_probs=return_probs,
            seed=seed,
        )
        # (bs, n_head, n_q_seq, d_head), (bs, n_head, n_q_seq, n_k_seq) or None
        return out if return_probs else (out, None)

    def unfused(self, Q, K, V, attn_mask, return_probs):
        """The tutorial's attention, its dropout module called on the probabilities."""
        # (bs, n_head, n_q_seq, n_k_seq)
        scores = torch.matmul(Q, K.transpose(-1, -2)) * self.scale
        mask = AttentionMask.of(attn_mask).materialize(Q.size(0), Q.size(-2), K.size(-2), Q.device)
        # the tutorial's masked_fill(mask, -1e9), but masked keys get no weight even where every
        # unmasked score is below -1e9, as the kernels
        scores = mask_scores(scores, mask if mask.dim() == 4 else mask.unsqueeze(1))
        attn_prob = self.dropout(torch.softmax(scores, dim=-1))
        context = torch.matmul(attn_prob, V)
        return context, attn_prob if return_probs else None


class MultiHeadAttention(WatchedModule):
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

    def forward(self, Q, K, V, attn_mask, *, plan=None):
        """Q: (bs, n_q_seq, d_hidn); K, V: (bs, n_k_seq, d_hidn). Returns (bs, n_q_seq, d_hidn) and
        the probabilities (bs, n_head, n_q_seq, n_k_seq) or None.

        plan: the layer's AttentionPlan (fastformer.plan), None when called alone (the attention
        makes its own: own_plan). With a layer's, Q is a Hidden, K and V are Q (self-attention) or
        are read as the plan's keys_values; the output linear's bias and the dropout are left to
        the layer's add + LayerNorm, which fuses them, and the output is Pending."""
        alone = plan is None  # called alone: a plan of its own, tensors in and out
        if alone:
            if not fusable(self, ATTENTION_ROLES):
                return self.unfused(Q, K, V, attn_mask)
            plan, Q = self.own_plan(Q, K, V), Hidden.of(Q.reshape(-1, Q.size(-1)))
        if plan.packed is not None:  # rows of the real tokens (fastformer.packing): no probabilities
            output, attn_prob = self.attend_packed(Q.low, plan), None
        elif plan.keys_values is None and not wants_probs(self.config, plan.ops.kernels):
            # self-attention without probabilities: one product, one op on it, no head reshapes
            # (bs * n_seq, 3 * n_head * d_head) -> (bs * n_seq, n_head * d_head)
            qkv = F.linear(Q.low, plan.in_weight, plan.in_bias)
            context = plan.ops.self_attention(
                qkv,
                self.config.n_head,
                seq_len=plan.seq_len,
                **AttentionMask.of(attn_mask).as_kwargs(),
                dropout_p=active_p(self.scaled_dot_attn.dropout),
                softmax_scale=self.scaled_dot_attn.scale,
                seed=plan.attn_seed,
            )
            output, attn_prob = F.linear(context, plan.out_weight, plan.out_bias), None
        else:
            if plan.keys_values is None:  # self-attention, its probabilities asked for
                q_s, k_s, v_s = self.heads_of(Q.low, plan.in_weight, plan.in_bias, 3, plan.seq_len)
            else:
                (q_s,) = self.heads_of(Q.low, plan.in_weight, plan.in_bias, 1, plan.seq_len)
                k_s, v_s = plan.keys_values
            output, attn_prob = self.attend(q_s, k_s, v_s, attn_mask, plan.out_weight, plan.out_bias, plan.attn_seed)
        if alone:  # (bs, n_q_seq, d_hidn)
            return self.dropout(output.view(-1, plan.seq_len, output.size(-1))), attn_prob
        return Pending(output, self.linear.bias, active_p(self.dropout), plan.out_seed), attn_prob

    def own_plan(self, Q, K, V):
        """The AttentionPlan of this attention called alone: its parameters as they are (autocast
        casts them), W_Q, W_K and W_V as one product for self-attention and K and V projected here
        otherwise (in one product when they are one tensor), the output linear's bias in its
        product, and no seeds (the ops draw their own)."""
        ops = backend.ops(Q)
        if Q is K and K is V:
            weight, bias = self.concat(self.W_Q, self.W_K, self.W_V)
            return AttentionPlan(ops, weight, bias, self.linear.weight, out_bias=self.linear.bias, seq_len=Q.size(1))
        if K is V:
            k_s, v_s = self.heads_of(K, *self.concat(self.W_K, self.W_V), 2)
        else:
            (k_s,) = self.heads_of(K, self.W_K.weight, self.W_K.bias, 1)
            (v_s,) = self.heads_of(V, self.W_V.weight, self.W_V.bias, 1)
        return AttentionPlan(
            ops,
            self.W_Q.weight,
            self.W_Q.bias,
            self.linear.weight,
            keys_values=(k_s, v_s),
            seq_len=Q.size(1),
            out_bias=self.linear.bias,
        )

    def unfused(self, Q, K, V, attn_mask):
        """The tutorial's forward, module by module, with its masks: (bs, n_q_seq, n_k_seq) for the
        layers, repeated over the heads for scaled_dot_attn."""
        batch_size, n_head, d_head = Q.size(0), self.config.n_head, self.config.d_head
        # (bs, n_head, n_seq, d_head)
        q_s = self.W_Q(Q).view(batch_size, -1, n_head, d_head).transpose(1, 2)
        k_s = self.W_K(K).view(batch_size, -1, n_head, d_head).transpose(1, 2)
        v_s = self.W_V(V).view(batch_size, -1, n_head, d_head).transpose(1, 2)
        mask = AttentionMask.of(attn_mask).materialize(batch_size, Q.size(1), K.size(1), Q.device)
        if mask.dim() == 3:
            mask = mask.unsqueeze(1).repeat(1, n_head, 1, 1)
        context, attn_prob = self.scaled_dot_attn(q_s, k_s, v_s, mask)
        # (bs, n_q_seq, n_head * d_head)
        context = context.transpose(1, 2).reshape(batch_size, -1, n_head * d_head)
        return self.dropout(self.linear(context)), attn_prob

    @staticmethod
    def concat(*linears):
        """(weight, bias) of nn.Linears as one."""
        return torch.cat([lin.weight for lin in linears]), torch.cat([lin.bias for lin in linears])

    def weight_groups(self, cross=False):
        """What a ForwardPlan gathers of this attention for its AttentionPlan, in the plan's field
        order (fastformer.plan.gather_weights' groups): the input projections as one product (W_Q,
        W_K and W_V; W_Q alone for a cross-attention, whose keys and values the Decoder's plan
        projects for all its layers: key_value_projections), then the output linear's weight."""
        projections = [self.W_Q] if cross else [self.W_Q, self.W_K, self.W_V]
        return [*linear_groups(projections), ([self.linear.weight], self.linear.weight.shape)]

    def dropouts(self):
        """The nn.Dropouts a ForwardPlan draws seeds for, in its order: the probabilities', the output's."""
        return [self.scaled_dot_attn.dropout, self.dropout]

    def key_value_projections(self):
        """W_K and W_V, which a cross-attention applies to the encoder output."""
        return [self.W_K, self.W_V]

    def heads_of(self, x, weight, bias, n, seq_len=None, rows=False):
        """The n (bs, n_head, n_seq, d_head) heads of the projection F.linear(x, weight, bias), whose
        rows are n projections (W_Q; W_K; W_V, say): views, no transpose copies. x: (bs, n_seq,
        d_hidn), or its rows (bs * n_seq, d_hidn) with seq_len n_seq. rows: x is packed rows
        (rows, d_hidn) of sequences back to back (fastformer.packing), and each head (rows, n_head,
        d_head), as kernels.attention_varlen takes them."""
        if rows:
            # (rows, n, n_head, d_head)
            y = F.linear(x, weight, bias).view(x.size(0), n, self.config.n_head, self.config.d_head)
            return y.unbind(1) if n > 1 else [y.squeeze(1)]
        # (bs, n_seq, n, n_head, d_head)
        n_seq = x.size(1) if seq_len is None else seq_len
        y = F.linear(x, weight, bias).view(-1, n_seq, n, self.config.n_head, self.config.d_head)
        # the backward of unbind stacks the gradients: a copy, which one projection does not need
        heads = y.unbind(2) if n > 1 else [y.squeeze(2)]
        return [h.transpose(1, 2) for h in heads]

    def attend_packed(self, x, plan):
        """The attention sublayer on packed rows x (rows, d_hidn), without the output's bias and
        dropout (left to add + LayerNorm): self-attention over each sequence's own rows, or
        cross-attention of them over the plan's packed keys and values; one product for the
        projections, kernels.attention_varlen's kernels (attention_packed: the offsets are the
        model's own, not read back), the output product. (rows, d_hidn)."""
        if plan.keys_values is None:
            q_s, k_s, v_s = self.heads_of(x, plan.in_weight, plan.in_bias, 3, rows=True)
        else:
            (q_s,) = self.heads_of(x, plan.in_weight, plan.in_bias, 1, rows=True)
            k_s, v_s = plan.keys_values
        attention = self.scaled_dot_attn
        # (rows, n_head, d_head)
        context = attention_packed(
            q_s, k_s, v_s, *plan.packed, active_p(attention.dropout), attention.scale, False, plan.attn_seed
        )
        return F.linear(context.view(x.size(0), -1), plan.out_weight, plan.out_bias)

    def attend(self, q_s, k_s, v_s, attn_mask, weight, bias, seed):
        """The attention of the heads, then the output linear with `weight` and `bias` (None: left
        to add + LayerNorm), without the output dropout. seed: the attention dropout's, or None.
        The output is (bs * n_q_seq, d_hidn) rows."""
        context, attn_prob = self.scaled_dot_attn(q_s, k_s, v_s, attn_mask, seed=seed)
        # (bs * n_q_seq, n_head * d_head): free when the kernel wrote context head-interleaved
        context = context.transpose(1, 2).reshape(-1, self.config.n_head * self.config.d_head)
        return F.linear(context, weight, bias), attn_prob


def tutorial_strides(output):
    """The feed-forward's output (bs, n_seq, d_hidn) with the strides of the tutorial's, conv2's
    (bs, d_hidn, n_seq) output transposed: the same values, copied. torch's dropout draws a mask in
    an order that depends on its input's layout (its memory order on a CPU; on CUDA its fused kernel
    takes another path for a strided tensor than for a contiguous one), so a dropout of this draws
    the tutorial's mask from the same generator state."""
    return output.transpose(1, 2).contiguous().transpose(1, 2)


class PoswiseFeedForwardNet(WatchedModule):
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

    def forward(self, inputs, *, plan=None):
        """inputs: (bs, n_seq, d_hidn) -> (bs, n_seq, d_hidn).

        plan: the layer's FeedForwardPlan (fastformer.plan), None when called alone (the
        feed-forward makes its own: own_plan). With a layer's, inputs is a Hidden; conv2's bias and
        the dropout are left to the layer's add + LayerNorm, which fuses them, and the output is
        Pending."""
        alone = plan is None  # called alone: a plan of its own, tensors in and out
        if alone:
            if not fusable(self, FEED_FORWARD_ROLES):
                return self.unfused(inputs)
            plan, inputs = self.own_plan(inputs), Hidden.of(inputs)
        # the ops take one dtype: the cast autocast gives a product's input, when the weights are cast
        low = inputs.low.to(plan.w1.dtype)
        output = plan.ops.feed_forward(low, plan.w1, plan.b1, plan.w2, plan.b2, activation=self.activation)
        if alone:
            return self.dropout(tutorial_strides(output) if active_p(self.dropout) else output)
        p = active_p(self.dropout)
        if p and plan.ops.add_layer_norm is not backend.kernels.add_layer_norm:
            # the reference's add + LayerNorm would drop out the rows; here torch's dropout sees the
            # tutorial's tensor, so a seeded run draws the tutorial's mask: (bs * n_seq, d_hidn) ->
            # (bs, n_seq, d_hidn) in the tutorial's strides, which add + LayerNorm takes as it is
            rows = output + self.conv2.bias
            dropped = F.dropout(tutorial_strides(rows.view(-1, plan.seq_len, rows.size(-1))), p, training=True)
            return Pending(dropped, None, 0.0, None)
        return Pending(output, self.conv2.bias, p, plan.out_seed)

    def own_plan(self, inputs):
        """The FeedForwardPlan of this feed-forward called alone: its parameters as they are
        (autocast casts them), the Conv1d weights (out, in, 1) read as nn.Linear weights (out, in),
        views, not copies; conv2's bias in its product; no seed (the op draws its own)."""
        w1, w2 = self.conv1.weight.squeeze(-1), self.conv2.weight.squeeze(-1)
        return FeedForwardPlan(backend.ops(inputs), w1, self.conv1.bias, w2, b2=self.conv2.bias)

    def weight_groups(self):
        """What a ForwardPlan gathers of this feed-forward for its FeedForwardPlan, in the plan's
        field order: conv1's weight and bias and conv2's weight, the Conv1d weights as nn.Linear's
        (conv2's bias goes to the layer's add + LayerNorm)."""
        return [
            ([self.conv1.weight], self.conv1.weight.shape[:2]),
            ([self.conv1.bias], self.conv1.bias.shape),
            ([self.conv2.weight], self.conv2.weight.shape[:2]),
        ]

    def dropouts(self):
        """The nn.Dropouts a ForwardPlan draws seeds for: the output's."""
        return [self.dropout]

    def unfused(self, inputs):
        """The tutorial's forward, module by module."""
        # (bs, d_ff, n_seq)
        output = self.conv1(inputs.transpose(1, 2))
        output = F.gelu(output) if self.activation == "gelu" else F.relu(output)
        # (bs, n_seq, d_hidn)
        output = self.conv2(output).transpose(1, 2)
        return self.dropout(output)


class EncoderLayer(WatchedModule):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.self_attn = MultiHeadAttention(config)
        self.layer_norm1 = nn.LayerNorm(config.d_hidn, eps=config.layer_norm_epsilon)
        self.pos_ffn = PoswiseFeedForwardNet(config)
        self.layer_norm2 = nn.LayerNorm(config.d_hidn, eps=config.layer_norm_epsilon)

    def forward(self, inputs, attn_mask, *, plan=None):
        """inputs: (bs, n_enc_seq, d_hidn). Returns (bs, n_enc_seq, d_hidn) and the self-attention
        probabilities (bs, n_head, n_enc_seq, n_enc_seq) or None.

        plan: this layer's LayerPlan of its Encoder's ForwardPlan, None when called alone (the layer
        makes its own). With one, inputs and outputs are Hidden pairs."""
        alone = plan is None  # called alone: a plan of its own, tensors in and out
        if alone:
            if not fusable(self, ENCODER_LAYER_ROLES):
                return self.unfused(inputs, attn_mask)
            own = ForwardPlan([self], inputs)
            plan, inputs = own.layers[0], own.hidden(inputs)
        att_outputs, attn_prob = self.self_attn(inputs, inputs, inputs, attn_mask, plan=plan.self_attn)
        att_outputs = plan.add_norm(self.layer_norm1, att_outputs, inputs)
        ffn_outputs = self.pos_ffn(att_outputs, plan=plan.pos_ffn)
        ffn_outputs = plan.add_norm(self.layer_norm2, ffn_outputs, att_outputs)
        return (own.output(ffn_outputs) if alone else ffn_outputs), attn_prob

    def weight_groups(self):
        """What a ForwardPlan gathers of this layer (its LayerPlan's weights, in order)."""
        return [*self.self_attn.weight_groups(), *self.pos_ffn.weight_groups()]

    def dropouts(self):
        """The nn.Dropouts a ForwardPlan draws this layer's seeds for, in the LayerPlan's order."""
        return [*self.self_attn.dropouts(), *self.pos_ffn.dropouts()]

    def unfused(self, inputs, attn_mask):
        """The tutorial's forward, module by module."""
        att_outputs, attn_prob = self.self_attn(inputs, inputs, inputs, attn_mask)
        att_outputs = self.layer_norm1(inputs + att_outputs)
        ffn_outputs = self.pos_ffn(att_outputs)
        ffn_outputs = self.layer_norm2(ffn_outputs + att_outputs)
        return ffn_outputs, attn_prob


class Encoder(WatchedModule):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.enc_emb = nn.Embedding(config.n_enc_vocab, config.d_hidn)
        self.pos_emb = sinusoid_embedding(config.n_enc_seq, config.d_hidn)
        self.layers = nn.ModuleList([EncoderLayer(config) for _ in range(config.n_layer)])

    def forward(self, inputs, *, ids_name=None):
        """inputs: (bs, n_enc_seq) token ids. Returns (bs, n_enc_seq, d_hidn) and a list of each
        layer's probabilities (or None). `ids_name` is what errors call the ids (default "inputs"):
        the caller's name for them (Transformer's `enc_inputs`)."""
        check_token_ids(ids_name or "inputs", inputs, self.config.n_enc_seq, self.config.n_enc_vocab)
        return self.body(inputs, inputs.eq(self.config.i_pad))

    def body(self, inputs, pad):
        """forward on ids already checked, whose padding flags are `pad` (bs, n_enc_seq)."""
        outputs = self.enc_emb(inputs) + self.pos_emb(position_ids(inputs, pad))
        attn_probs = []
        if not fusable(self.layers, ENCODER_LAYERS_ROLES):  # the tutorial's loop and mask
            attn_mask = get_attn_pad_mask(inputs, inputs, self.config.i_pad)
            for layer in self.layers:
                outputs, attn_prob = layer(outputs, attn_mask)
                attn_probs.append(attn_prob)
            return outputs, attn_probs
        attn_mask = AttentionMask(key_padding_mask=pad)
        plan = ForwardPlan(self.layers, outputs)
        hidden = plan.hidden(outputs)
        for layer, layer_plan in zip(self.layers, plan.layers):
            hidden, attn_prob = layer(hidden, attn_mask, plan=layer_plan)
            attn_probs.append(attn_prob)
        return plan.output(hidden), attn_probs

    def packed(self, inputs, pad, packing):
        """The fused layers on the real tokens alone (fastformer.packing): the embeddings of the
        packing's tokens at their own positions, every layer on their rows, each review's
        self-attention over its own. Returns the last layer's rows (the count of real tokens, d_hidn)."""
        # (rows,): the real tokens' ids and positions, in order
        ids, positions = packing.gather(inputs), packing.gather(position_ids(inputs, pad))
        rows = self.enc_emb(ids) + self.pos_emb(positions)
        plan = ForwardPlan(self.layers, rows, packed=packing.self_attention())
        hidden = Hidden.of(rows)
        for layer, layer_plan in zip(self.layers, plan.layers):
            hidden, _ = layer(hidden, None, plan=layer_plan)
        return hidden.x


class DecoderLayer(WatchedModule):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.self_attn = MultiHeadAttention(config)
        self.layer_norm1 = nn.LayerNorm(config.d_hidn, eps=config.layer_norm_epsilon)
        self.dec_enc_attn = MultiHeadAttention(config)
        self.layer_norm2 = nn.LayerNorm(config.d_hidn, eps=config.layer_norm_epsilon)
        self.pos_ffn = PoswiseFeedForwardNet(config)
        self.layer_norm3 = nn.LayerNorm(config.d_hidn, eps=config.layer_norm_epsilon)

    def forward(self, dec_inputs, enc_outputs, self_attn_mask, dec_enc_attn_mask, *, plan=None):
        """dec_inputs: (bs, n_dec_seq, d_hidn); enc_outputs: (bs, n_enc_seq, d_hidn). Returns
        (bs, n_dec_seq, d_hidn) and the self- and cross-attention probabilities (or None).

        plan: this layer's LayerPlan of its Decoder's ForwardPlan, None when called alone (the layer
        makes its own). With one, dec_inputs and the outputs are Hidden pairs, and the cross-attention
        reads enc_outputs through the plan's keys and values."""
        alone = plan is None  # called alone: a plan of its own, tensors in and out
        if alone:
            if not fusable(self, DECODER_LAYER_ROLES):
                return self.unfused(dec_inputs, enc_outputs, self_attn_mask, dec_enc_attn_mask)
            own = ForwardPlan([self], dec_inputs, enc_outputs)
            plan, dec_inputs = own.layers[0], own.hidden(dec_inputs)
        self_att_outputs, self_attn_prob = self.self_attn(
            dec_inputs, dec_inputs, dec_inputs, self_attn_mask, plan=plan.self_attn
        )
        self_att_outputs = plan.add_norm(self.layer_norm1, self_att_outputs, dec_inputs)
        dec_enc_att_outputs, dec_enc_attn_prob = self.dec_enc_attn(
            self_att_outputs, enc_outputs, enc_outputs, dec_enc_attn_mask, plan=plan.dec_enc_attn
        )
        dec_enc_att_outputs = plan.add_norm(self.layer_norm2, dec_enc_att_outputs, self_att_outputs)
        ffn_outputs = self.pos_ffn(dec_enc_att_outputs, plan=plan.pos_ffn)
        ffn_outputs = plan.add_norm(self.layer_norm3, ffn_outputs, dec_enc_att_outputs)
        return (own.output(ffn_outputs) if alone else ffn_outputs), self_attn_prob, dec_enc_attn_prob

    def weight_groups(self):
        """What a ForwardPlan gathers of this layer (its LayerPlan's weights, in order), but the
        cross-attention's keys and values (key_value_projections)."""
        return [
            *self.self_attn.weight_groups(),
            *self.dec_enc_attn.weight_groups(cross=True),
            *self.pos_ffn.weight_groups(),
        ]

    def dropouts(self):
        """The nn.Dropouts a ForwardPlan draws this layer's seeds for, in the LayerPlan's order."""
        return [*self.self_attn.dropouts(), *self.dec_enc_attn.dropouts(), *self.pos_ffn.dropouts()]

    def key_value_projections(self):
        """The cross-attention's W_K and W_V, which the Decoder's plan makes one product for all its layers."""
        return self.dec_enc_attn.key_value_projections()

    def key_value_heads(self, enc_outputs, weight, bias, n, rows=False):
        """The n (bs, n_head, n_enc_seq, d_head) heads of the encoder output's projection by
        `weight` and `bias` (n key and value projections side by side); rows: enc_outputs is the
        packed encoder's rows, and so are the heads (rows, n_head, d_head)."""
        return self.dec_enc_attn.heads_of(enc_outputs, weight, bias, n, rows=rows)

    def unfused(self, dec_inputs, enc_outputs, self_attn_mask, dec_enc_attn_mask):
        """The tutorial's forward, module by module."""
        self_att_outputs, self_attn_prob = self.self_attn(dec_inputs, dec_inputs, dec_inputs, self_attn_mask)
        self_att_outputs = self.layer_norm1(dec_inputs + self_att_outputs)
        dec_enc_att_outputs, dec_enc_attn_prob = self.dec_enc_attn(
            self_att_outputs, enc_outputs, enc_outputs, dec_enc_attn_mask
        )
        dec_enc_att_outputs = self.layer_norm2(self_att_outputs + dec_enc_att_outputs)
        ffn_outputs = self.pos_ffn(dec_enc_att_outputs)
        ffn_outputs = self.layer_norm3(dec_enc_att_outputs + ffn_outputs)
        return ffn_outputs, self_attn_prob, dec_enc_attn_prob


class Decoder(WatchedModule):
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
        check_ids_shape("enc_inputs", enc_inputs, self.config.n_enc_seq)  # read for its padding alone
        check_same_batch(enc_inputs, dec_inputs, enc_outputs)
        return self.body(dec_inputs, enc_inputs, enc_outputs)

    def body(self, dec_inputs, enc_inputs, enc_outputs, packing=None):
        """forward on ids already checked. packing: enc_outputs are the packed encoder's rows of
        the packing's real tokens (Encoder.packed), which the fused layers' cross-attention reads,
        each review's queries over its own keys."""
        # (bs, n_dec_seq)
        dec_pad = dec_inputs.eq(self.config.i_pad)
        dec_outputs = self.dec_emb(dec_inputs) + self.pos_emb(position_ids(dec_inputs, dec_pad))
        self_attn_probs, dec_enc_attn_probs = [], []
        if not fusable(self.layers, DECODER_LAYERS_ROLES):  # the tutorial's loop and masks
            pad_mask = get_attn_pad_mask(dec_inputs, dec_inputs, self.config.i_pad)
            self_attn_mask = torch.gt(pad_mask + get_attn_decoder_mask(dec_inputs), 0)
            dec_enc_attn_mask = get_attn_pad_mask(dec_inputs, enc_inputs, self.config.i_pad)
            for layer in self.layers:
                dec_outputs, self_attn_prob, dec_enc_attn_prob = layer(
                    dec_outputs, enc_outputs, self_attn_mask, dec_enc_attn_mask
                )
                self_attn_probs.append(self_attn_prob)
                dec_enc_attn_probs.append(dec_enc_attn_prob)
            return dec_outputs, self_attn_probs, dec_enc_attn_probs
        self_attn_mask = AttentionMask(key_padding_mask=dec_pad, causal=True)
        lengths = dec_enc_attn_mask = None
        if packing is None:
            dec_enc_attn_mask = AttentionMask(key_padding_mask=enc_inputs.eq(self.config.i_pad))
        else:  # each review's decoder positions over its own real tokens
            lengths = packing.cross_attention(dec_inputs.size(1))
        plan = ForwardPlan(self.layers, dec_outputs, enc_outputs, packed=lengths)
        hidden = plan.hidden(dec_outputs)
        for layer, layer_plan in zip(self.layers, plan.layers):
            hidden, self_attn_prob, dec_enc_attn_prob = layer(
                hidden, enc_outputs, self_attn_mask, dec_enc_attn_mask, plan=layer_plan
            )
            self_attn_probs.append(self_attn_prob)
            dec_enc_attn_probs.append(dec_enc_attn_prob)
        return plan.output(hidden), self_attn_probs, dec_enc_attn_probs


class Transformer(WatchedModule):
    def __init__(self, config):
        super().__init__()
        check_config(config)
        self.config = config
        self.encoder = Encoder(config)
        self.decoder = Decoder(config)

    def forward(self, enc_inputs, dec_inputs):
        """Returns dec_outputs (bs, n_dec_seq, d_hidn) and the encoder self-, decoder self- and
        decoder-encoder attention probabilities, one list entry per layer (or None)."""
        check_ids_shape("enc_inputs", enc_inputs, self.config.n_enc_seq)
        check_ids_shape("dec_inputs", dec_inputs, self.config.n_dec_seq)
        check_same_batch(enc_inputs, dec_inputs)
        if self.packs(enc_inputs):  # the encoder on its real tokens alone (fastformer.packing)
            return self.packed(enc_inputs, dec_inputs)
        enc_outputs, enc_self_attn_probs = self.encoder(enc_inputs, ids_name="enc_inputs")
        dec_outputs, dec_self_attn_probs, dec_enc_attn_probs = self.decoder(dec_inputs, enc_inputs, enc_outputs)
        return dec_outputs, enc_self_attn_probs, dec_self_attn_probs, dec_enc_attn_probs

    def packs(self, enc_inputs):
        """Whether forward may run the encoder on the real tokens alone (fastformer.packing): packing
        is on, the count can be read (eager, no capture) or a token bucket gives the rows (eager or
        in a CUDA graph's capture: fastformer.packing.token_bucket), attention and add + LayerNorm
        run the Triton kernels, no probabilities are asked for, and nothing sees the encoder's and
        decoder's tensors (fastformer.fusion: every module stock, no hooks)."""
        if not packing_enabled():
            return False
        if not can_read_counts(enc_inputs) and (bucket_rows() is None or not can_pack_statically()):
            return False
        ops = backend.ops(self.encoder.enc_emb.weight)  # the embeddings' dtype: the hidden states'
        if not ops.kernels or ops.add_layer_norm is not backend.kernels.add_layer_norm:
            return False
        if wants_probs(self.config, True):
            return False
        return fusable(self.encoder, ENCODER_ROLES) and fusable(self.decoder, DECODER_ROLES)

    def packed(self, enc_inputs, dec_inputs):
        """forward with the encoder on the packing's real tokens, the decoder's cross-attention over
        them; padded as forward is where the batch has no padding or a review has no real token."""
        pad = enc_inputs.eq(self.config.i_pad)
        counts, offsets = packing_lengths(pad)
        limits = self.config.n_enc_seq, self.config.n_enc_vocab
        static = bucket_rows()
        if static is not None:  # a token bucket's rows, whatever the count (fastformer.packing)
            check_token_ids("enc_inputs", enc_inputs, *limits)  # skipped under a capture
            # a review of padding alone could not be run as the tutorial runs it (below)
            torch._assert_async(counts.min() > 0, "a review of padding alone in a token bucket's batch")
            packing = make_static_packing(pad, offsets, static)
        else:
            # the ids' range and the counts in one copy: (on CUDA) the one sync the check makes anyway
            rows, longest, shortest = check_token_ids(
                "enc_inputs", enc_inputs, *limits, counts=(offsets[-1], counts.max(), counts.min())
            )
            # nothing to leave out; or a review of padding alone, whose decoder positions have no
            # key to attend to: the tutorial's weights are then uniform over its padding
            # (mask_scores), whose encoder outputs the padded model computes
            if rows == pad.numel() or shortest == 0:
                enc_outputs, enc_self_attn_probs = self.encoder.body(enc_inputs, pad)
                dec_outputs, dec_self_attn_probs, dec_enc_attn_probs = self.decoder(dec_inputs, enc_inputs, enc_outputs)
                return dec_outputs, enc_self_attn_probs, dec_self_attn_probs, dec_enc_attn_probs
            packing = make_packing(pad, offsets, rows, longest)
        enc_rows = self.encoder.packed(enc_inputs, pad, packing)
        check_token_ids("dec_inputs", dec_inputs, self.config.n_dec_seq, self.config.n_dec_vocab)
        dec_outputs, dec_self_attn_probs, dec_enc_attn_probs = self.decoder.body(
            dec_inputs, enc_inputs, enc_rows, packing
        )
        enc_self_attn_probs = [None] * len(self.encoder.layers)
        return dec_outputs, enc_self_attn_probs, dec_self_attn_probs, dec_enc_attn_probs


class MovieClassification(WatchedModule):
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
        # (bs, d_hidn): max over the decoder sequence. Over the one [BOS] position the tutorial and
        # the job feed, that is the position itself, bit for bit, gradient too: a view, where max
        # and its backward's zeros and scatter launch three kernels (docs/launches.md). A trace
        # keeps torch.max, so that it holds for other lengths.
        if not torch.jit.is_tracing() and dec_outputs.shape[1] == 1:
            dec_outputs = dec_outputs.squeeze(1)
        else:
            dec_outputs, _ = torch.max(dec_outputs, dim=1)
        logits = self.projection(dec_outputs)
        return logits, enc_self_attn_probs, dec_self_attn_probs, dec_enc_attn_probs


# The stock type of each role in the model (fastformer.fusion): a submodule's role is the last
# part of its name; "" is the module a check starts from, "[i]" an item of a ModuleList.
SUBMODULE_ROLES = {
    "self_attn": MultiHeadAttention,
    "dec_enc_attn": MultiHeadAttention,
    "W_Q": nn.Linear,
    "W_K": nn.Linear,
    "W_V": nn.Linear,
    "scaled_dot_attn": ScaledDotProductAttention,
    "linear": nn.Linear,
    "dropout": nn.Dropout,
    "pos_ffn": PoswiseFeedForwardNet,
    "conv1": nn.Conv1d,
    "conv2": nn.Conv1d,
    "layer_norm1": nn.LayerNorm,
    "layer_norm2": nn.LayerNorm,
    "layer_norm3": nn.LayerNorm,
}
DROPOUT_ROLES = {"": nn.Dropout}
ATTENTION_ROLES = {**SUBMODULE_ROLES, "": MultiHeadAttention}
FEED_FORWARD_ROLES = {**SUBMODULE_ROLES, "": PoswiseFeedForwardNet}
ENCODER_LAYER_ROLES = {**SUBMODULE_ROLES, "": EncoderLayer}
DECODER_LAYER_ROLES = {**SUBMODULE_ROLES, "": DecoderLayer}
ENCODER_LAYERS_ROLES = {**SUBMODULE_ROLES, "": nn.ModuleList, "[i]": EncoderLayer}
DECODER_LAYERS_ROLES = {**SUBMODULE_ROLES, "": nn.ModuleList, "[i]": DecoderLayer}
# the packed Transformer's encoder and decoder (Transformer.packs), their embeddings included
EMBEDDING_ROLES = {"enc_emb": nn.Embedding, "dec_emb": nn.Embedding, "pos_emb": nn.Embedding, "layers": nn.ModuleList}
ENCODER_ROLES = {**ENCODER_LAYERS_ROLES, **EMBEDDING_ROLES, "": Encoder}
DECODER_ROLES = {**DECODER_LAYERS_ROLES, **EMBEDDING_ROLES, "": Decoder}
