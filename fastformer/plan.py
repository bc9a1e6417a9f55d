"""What the layers of one Encoder or Decoder forward share, made once for all of them.

The tutorial's train step is launch-bound (docs/launches.md): at batch 128 of short reviews a kernel does
microseconds of work, so a step costs about what it launches. `ForwardPlan` does once per forward
what each layer would otherwise do for itself:

- weights: under torch.autocast (fp16/bf16, fp32 parameters), every matrix and bias the layers'
  products read, in the autocast dtype, from one concatenation and one cast (and in the backward one
  of each for their gradients), where autocast casts every tensor at every use. The values are
  autocast's, bit for bit. Outside autocast the parameters serve as they are, W_Q, W_K and W_V
  concatenated for one product.
- cross-attention keys and values: every decoder layer projects the same encoder output, so their
  K and V projections are one product, n_layer * 2 * n_head * d_head wide.
- dropout seeds: one draw for all the dropout sites of the forward, a seed each for the kernels
  (the reference ops use torch's dropout and ignore them).
- copies in the autocast dtype: under autocast, add + LayerNorm also writes its fp32 output in the
  autocast dtype, for the next product to read (no cast kernel), and adds the two outputs'
  gradients inside its backward (no cast back, no add). The pair travels as a `Hidden`.

Attention's output projection and the feed-forward's second product leave out their biases, which
add + LayerNorm adds (x + bias, before the dropout, as the tutorial's order has it) and whose
gradients it sums beside its own (no aten.sum): a planned sublayer returns a `Pending` output.
"""

import itertools
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn as nn

from fastformer import backend, fusion, kernels
from fastformer.kernels._dropout import draw_seeds
from fastformer.packing import PackedLengths


def active_p(dropout):
    """An nn.Dropout's probability when it is active (training), else 0."""
    return dropout.p if dropout.training else 0.0


class Hidden(NamedTuple):
    """A hidden state between the sublayers: x for the residual and LayerNorm, low the same values
    in autocast's dtype for the next product (x itself when there is no copy: autocast casts it).
    Inside a ForwardPlan both are (bs * n_seq, d_hidn) rows (ForwardPlan.hidden), so that the
    products take them as they are, with no reshape on either side."""

    x: torch.Tensor  # (bs * n_seq, d_hidn)
    low: torch.Tensor

    @classmethod
    def of(cls, x):
        """x with no copy: what the first layer gets, or a layer called alone."""
        return cls(x, x)


class Pending(NamedTuple):
    """A sublayer's output before its last bias and its dropout, which add + LayerNorm applies."""

    # (bs * n_seq, d_hidn); or (bs, n_seq, d_hidn) in the tutorial's strides, dropped out already
    # (PoswiseFeedForwardNet on the reference)
    x: torch.Tensor
    bias: torch.Tensor | None  # (d_hidn,)
    dropout_p: float
    seed: torch.Tensor | None  # the dropout kernel's, or None


@dataclass
class AttentionPlan:
    """What a MultiHeadAttention runs with: its input projections as one product (W_Q, W_K and W_V
    for self-attention; W_Q alone for cross-attention, whose keys and values come projected for
    all the decoder's layers at once), the output linear's weight (its bias goes to add +
    LayerNorm), and the seeds of the attention's dropout and of the output's. An attention called
    alone makes its own (MultiHeadAttention.own_plan), with its output bias and no seeds."""

    ops: backend.Ops
    in_weight: torch.Tensor  # (n * n_head * d_head, d_hidn)
    in_bias: torch.Tensor  # (n * n_head * d_head,)
    out_weight: torch.Tensor  # (d_hidn, n_head * d_head)
    attn_seed: torch.Tensor | None = None
    out_seed: torch.Tensor | None = None
    keys_values: tuple | None = None  # cross-attention: (k_s, v_s), each (bs, n_head, n_enc_seq, d_head)
    seq_len: int | None = None  # the queries' length: the hidden states come as (bs * n_seq, d_hidn) rows
    out_bias: torch.Tensor | None = None  # the output linear's bias in its product: an attention alone
    # attention over packed rows (fastformer.packing): the encoder's self-attention, the decoder's
    # cross-attention of a packed encoder; the queries come as rows of every sequence back to back
    packed: PackedLengths | None = None


@dataclass
class FeedForwardPlan:
    """What a PoswiseFeedForwardNet runs with: conv1's weight and bias and conv2's weight as
    nn.Linear's (conv2's bias goes to add + LayerNorm), and the output dropout's seed. A
    feed-forward called alone makes its own (PoswiseFeedForwardNet.own_plan), with conv2's bias."""

    ops: backend.Ops
    w1: torch.Tensor  # (d_ff, d_hidn)
    b1: torch.Tensor  # (d_ff,)
    w2: torch.Tensor  # (d_hidn, d_ff)
    out_seed: torch.Tensor | None = None
    b2: torch.Tensor | None = None  # conv2's bias in its product: a feed-forward alone
    seq_len: int | None = None  # n_seq of the rows (bs * n_seq, d_hidn) a layer's plan hands it


@dataclass
class LayerPlan:
    """One EncoderLayer's or DecoderLayer's part of a ForwardPlan, a field per sublayer (named as
    the layer's children), and the autocast dtype add + LayerNorm writes its copy in (or None)."""

    ops: backend.Ops
    dtype: torch.dtype | None
    self_attn: AttentionPlan
    pos_ffn: FeedForwardPlan
    dec_enc_attn: AttentionPlan | None = None

    def add_norm(self, layer_norm, sublayer, residual):
        """layer_norm(residual + dropout(sublayer + its bias)) through the fused op, with its copy
        in the autocast dtype. sublayer: Pending; residual: Hidden. Returns a Hidden."""
        x, bias, dropout_p, seed = sublayer
        # x (bs, n_seq, d_hidn) in the tutorial's strides (PoswiseFeedForwardNet on the reference):
        # the residual viewed so too, which the reference adds first, so its output is rows again.
        # Otherwise rows as they are: no views on the kernels' path.
        tutorial_layout = x.dim() != residual.x.dim()
        out = self.ops.add_layer_norm(
            x,
            residual.x.view(x.shape) if tutorial_layout else residual.x,
            layer_norm.weight,
            layer_norm.bias,
            layer_norm.eps,
            dropout_p,
            x_bias=bias,
            seed=seed,
            lowp_dtype=self.dtype,
        )
        if tutorial_layout:
            rows = residual.x.shape
            out = out.view(rows) if self.dtype is None else tuple(t.view(rows) for t in out)
        return Hidden.of(out) if self.dtype is None else Hidden(*out)


def autocast_dtype(groups, like):
    """autocast's fp16/bf16 when it is on for `like`'s device and casts the products' weights and
    biases (`groups`, as gather_weights takes them: all fp32), else None."""
    device_type = like.device.type
    if not torch.is_autocast_enabled(device_type):
        return None
    dtype = torch.get_autocast_dtype(device_type)
    if dtype not in (torch.float16, torch.bfloat16):
        return None
    if any(t.dtype != torch.float32 for tensors, _ in groups for t in tensors):
        return None
    return dtype


def gather_weights(groups, dtype):
    """For groups [(tensors, shape)], each group's tensors concatenated and viewed as its shape, in
    order. In `dtype`, one concatenation and one cast for all groups, split into views (the backward
    of one split is one concatenation of the gradients); with dtype None, the tensors as they are,
    concatenated only for groups of several."""
    if dtype is None:
        return [(tensors[0] if len(tensors) == 1 else torch.cat(tensors)).view(shape) for tensors, shape in groups]
    flat = torch.cat([t.reshape(-1) for tensors, _ in groups for t in tensors]).to(dtype)
    pieces = flat.split([sum(t.numel() for t in tensors) for tensors, _ in groups])
    return [piece.view(shape) for (_, shape), piece in zip(groups, pieces)]


def linear_groups(linears):
    """The weight groups of nn.Linears as one product: their weights, their biases."""
    rows = sum(lin.out_features for lin in linears)
    return [([lin.weight for lin in linears], (rows, linears[0].in_features)), ([lin.bias for lin in linears], (rows,))]


def dropout_seeds(dropouts, n_layer, ops, device):
    """Per layer, the int64 seeds of its nn.Dropouts (`dropouts`: every layer's, layer by layer) as
    one-element views, all from one draw on `device`; None when no dropout is active or `ops`
    (backend.Ops) add + LayerNorm by the reference, which draws its own (so do the attention and
    feed-forward references)."""
    if not any(active_p(m) > 0.0 for m in dropouts) or ops.add_layer_norm is not kernels.add_layer_norm:
        return None
    seeds = draw_seeds(len(dropouts), device).split(1)  # every view in one call, not one index each
    per_layer = len(seeds) // n_layer
    return [seeds[i * per_layer : (i + 1) * per_layer] for i in range(n_layer)]


def layer_seeds(seeds, i):
    """An iterator over layer i's dropout seeds (one-element views), in the order of the layer's
    `dropouts`: an attention's probabilities, then its output; the feed-forward's output."""
    if seeds is None:
        return itertools.repeat(None)
    return iter(seeds[i])


def take(items, n):
    """The next n items of an iterator."""
    return [next(items) for _ in range(n)]


class CastWeights(torch.autograd.Function):
    """gather_weights in `dtype` as one autograd node: forward one concatenation of the fp32
    parameters and one cast, split into the groups' views; backward one concatenation of the
    groups' gradients, one cast back and a view per parameter (torch's dense-tensor flattening,
    in C++). Autocast's values bit for bit, as gather_weights; in place of a view node per
    parameter and per group, a few hundred per forward at the tutorial's depth."""

    @staticmethod
    def forward(ctx, groups, dtype, *tensors):
        ctx.tensors = tensors  # their shapes only, for the backward's views (no values kept)
        flat = torch._C._nn.flatten_dense_tensors(tensors).to(dtype)
        return tuple(torch._C._nn.unflatten_dense_tensors(flat, groups))

    @staticmethod
    def backward(ctx, *grads):
        flat = torch._C._nn.flatten_dense_tensors(grads).float()
        return None, None, *torch._C._nn.unflatten_dense_tensors(flat, ctx.tensors)


class Layout:
    """What a ForwardPlan takes of its layers: the weight groups each layer declares
    (`weight_groups`, and a Decoder's cross-attention `key_value_projections`), kept as where each
    tensor lives (a module's parameter dict and a name) and each group's shape, and the nn.Dropouts
    each layer declares (`dropouts`, in its LayerPlan's order); found once per state of the modules
    (see `layout`), the tensors themselves read on every use."""

    def __init__(self, layers, decoder):
        groups = []
        if decoder:  # every layer's cross-attention keys and values, as one product
            groups += linear_groups([lin for layer in layers for lin in layer.key_value_projections()])
        for layer in layers:  # each layer says what it is made of (its weight_groups)
            groups += layer.weight_groups()
        where = {
            id(p): (module._parameters, name)
            for layer in layers
            for module in layer.modules()
            for name, p in module._parameters.items()
            if p is not None
        }
        self.sources = [where[id(t)] for tensors, _ in groups for t in tensors]
        self.counts = [len(tensors) for tensors, _ in groups]
        self.shapes = [torch.Size(shape) for _, shape in groups]
        # the groups' shapes as tensors without data, for CastWeights' views
        self.templates = [torch.empty(shape, device="meta") for shape in self.shapes]
        self.dropouts = [m for layer in layers for m in layer.dropouts()]

    def groups(self):
        """[(tensors, shape)] as gather_weights takes them, the parameters as they are now."""
        tensors = iter([params[name] for params, name in self.sources])
        return [(take(tensors, n), shape) for n, shape in zip(self.counts, self.shapes)]

    def weights(self, like):
        """The groups' tensors (gather_weights) and the autocast dtype they come in (or None)."""
        tensors = [params[name] for params, name in self.sources]
        dtype = autocast_dtype([(tensors, None)], like)
        if dtype is None or not _eager():
            return gather_weights(self.groups(), dtype), dtype
        return CastWeights.apply(self.templates, dtype, *tensors), dtype


def _eager():
    """Not under torch.compile nor a functorch transform (which a Function without setup_context
    does not support); dispatch modes are fine."""
    return not torch.compiler.is_compiling() and torch._C._functorch.peek_interpreter_stack() is None


_KEPT = "_fastformer_layout"  # the kept Layout, in a module's __dict__ (not its state_dict)


def layout(layers, decoder):
    """The Layout of `layers` (a ModuleList, or a list of one layer called alone), made once and
    kept on the ModuleList (or the layer) while the module tree keeps its state (fusion.state():
    no module or parameter registered, no hook made since) and its layers. Under torch.compile
    made on every trace, nothing kept."""
    if torch.compiler.is_compiling():
        return Layout(layers, decoder)
    holder = layers if isinstance(layers, nn.Module) else layers[0]
    # the layers by id, not by reference: a layer keeping its own layout would be a reference
    # cycle (a new module at a freed one's address has registered its parameters: a new state)
    key = (fusion.state(), tuple(map(id, layers)), decoder)
    kept = holder.__dict__.get(_KEPT)
    if kept is None or kept[0] != key:
        kept = holder.__dict__[_KEPT] = (key, Layout(layers, decoder))
    return kept[1]


class ForwardPlan:
    """The shared part of one Encoder or Decoder forward (see the module docstring): `layers[i]` is
    the LayerPlan layer i runs with.

    layers: EncoderLayers or DecoderLayers (one kind); inputs: what the first layer gets;
    enc_outputs: for DecoderLayers, the encoder output their cross-attention reads. packed: the
    lengths of packed rows (fastformer.packing): for EncoderLayers, inputs are the real tokens'
    rows (rows, d_hidn) and the self-attention runs over each review's own; for DecoderLayers,
    enc_outputs are, and the cross-attention reads each review's own keys."""

    def __init__(self, layers, inputs, enc_outputs=None, packed=None):
        decoder = enc_outputs is not None
        self.shape = inputs.shape
        seq_len = None if packed is not None and not decoder else inputs.size(1)
        found = layout(layers, decoder)
        weights, dtype = found.weights(inputs)
        weights = iter(weights)
        ops = backend.ops(inputs)  # every layer's products run in inputs' precision (or autocast's)
        seeds = dropout_seeds(found.dropouts, len(layers), ops, inputs.device)
        keys_values = [None] * len(layers)
        if decoder:
            n = 2 * len(layers)
            heads = layers[0].key_value_heads(enc_outputs, *take(weights, 2), n, rows=packed is not None)
            keys_values = [tuple(heads[2 * i : 2 * i + 2]) for i in range(len(layers))]
        self_packed, cross_packed = (None, packed) if decoder else (packed, None)
        self.layers = []
        for i in range(len(layers)):
            seed = layer_seeds(seeds, i)
            self_attn = AttentionPlan(ops, *take(weights, 3), *take(seed, 2), seq_len=seq_len, packed=self_packed)
            cross = None
            if decoder:
                kv = keys_values[i]
                cross = AttentionPlan(ops, *take(weights, 3), *take(seed, 2), kv, seq_len, packed=cross_packed)
            pos_ffn = FeedForwardPlan(ops, *take(weights, 3), next(seed), seq_len=seq_len)
            self.layers.append(LayerPlan(ops, dtype, self_attn, pos_ffn, cross))

    def hidden(self, inputs):
        """The first layer's Hidden: inputs (bs, n_seq, d_hidn) as rows."""
        return Hidden.of(inputs.reshape(-1, inputs.size(-1)))

    def output(self, hidden):
        """The last layer's Hidden as the (bs, n_seq, d_hidn) tensor the layers' caller gets."""
        return hidden.x.view(self.shape)
