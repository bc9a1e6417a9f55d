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
  gradients inside its backward (no cast back, no add).

Attention's output projection and the feed-forward's second product leave out their biases, which
add + LayerNorm adds (x + bias, before the dropout, as the tutorial's order has it) and whose
gradients it sums beside its own (no aten.sum).
"""
import torch
import torch.nn as nn

from fastformer import backend
from fastformer.kernels._common import draw_seeds


def active_p(dropout):
    """An nn.Dropout's probability when it is active (training), else 0."""
    return dropout.p if dropout.training else 0.0


def autocast_dtype(layers, like):
    """autocast's fp16/bf16 when it is on for `like`'s device and casts the layers' parameters
    (fp32), else None."""
    device_type = like.device.type
    if not torch.is_autocast_enabled(device_type):
        return None
    dtype = torch.get_autocast_dtype(device_type)
    if dtype not in (torch.float16, torch.bfloat16):
        return None
    if any(p.dtype != torch.float32 for layer in layers for p in layer.parameters()):
        return None
    return dtype


def gather_weights(groups, dtype):
    """{key: tensor} for groups {key: (tensors, shape)}: each group's tensors concatenated and
    viewed as its shape. In `dtype`, one concatenation and one cast for all groups, split into views
    (the backward of one split is one concatenation of the gradients); with dtype None, the tensors
    as they are, concatenated only for groups of several."""
    if dtype is None:
        return {
            key: (tensors[0] if len(tensors) == 1 else torch.cat(tensors)).view(shape)
            for key, (tensors, shape) in groups.items()
        }
    flat = torch.cat([t.reshape(-1) for tensors, _ in groups.values() for t in tensors]).to(dtype)
    pieces = flat.split([sum(t.numel() for t in tensors) for tensors, _ in groups.values()])
    return {key: piece.view(shape) for (key, (_, shape)), piece in zip(groups.items(), pieces)}


def dropout_seeds(layers, like):
    """(n_layer, dropout_sites) int64 seeds, one per dropout site of each layer, in one draw; None
    when no dropout is active or the kernels do not run on `like` (the reference draws its own)."""
    dropouts = [m for layer in layers for m in layer.modules() if isinstance(m, nn.Dropout)]
    if not any(active_p(m) > 0.0 for m in dropouts) or not backend.uses_triton(like, matmul=False):
        return None
    return draw_seeds(len(layers) * layers[0].dropout_sites, like.device).view(len(layers), -1)


class ForwardPlan:
    """The shared part of one Encoder or Decoder forward (see the module docstring); `layers[i]`
    is the LayerPlan layer i runs with.

    layers: EncoderLayers or DecoderLayers (one kind); inputs: what the first layer gets;
    enc_outputs: for DecoderLayers, the encoder output their cross-attention reads."""

    def __init__(self, layers, inputs, enc_outputs=None):
        self.dtype = autocast_dtype(layers, inputs)
        self._copies = []  # (tensor, its copy in self.dtype), made by add_norm
        groups = {f"{i}.{key}": group for i, layer in enumerate(layers) for key, group in layer.weight_groups().items()}
        if enc_outputs is not None:
            groups.update(cross_kv_groups(layers))
        weights = gather_weights(groups, self.dtype)
        seeds = dropout_seeds(layers, inputs)
        keys_values = [None] * len(layers)
        if enc_outputs is not None:
            heads = layers[0].dec_enc_attn.heads_of(
                self.low(enc_outputs), weights["cross.KV.weight"], weights["cross.KV.bias"], 2 * len(layers)
            )
            keys_values = [tuple(heads[2 * i : 2 * i + 2]) for i in range(len(layers))]
        self.layers = [
            LayerPlan(
                self,
                {key.split(".", 1)[1]: w for key, w in weights.items() if key.startswith(f"{i}.")},
                None if seeds is None else seeds[i],
                keys_values[i],
            )
            for i in range(len(layers))
        ]

    def low(self, x):
        """x's copy in the autocast dtype when add_norm made one, else x (autocast casts it at use)."""
        for tensor, copy in self._copies:
            if tensor is x:
                return copy
        return x

    def add_norm(self, layer_norm, x, residual, dropout, x_bias, seed):
        """layer_norm(residual + dropout(x + x_bias)) through the fused op, keeping its copy in the
        autocast dtype for `low`."""
        out = backend.add_layer_norm(
            x, residual, layer_norm.weight, layer_norm.bias, layer_norm.eps, active_p(dropout),
            x_bias=x_bias, seed=seed, lowp_dtype=self.dtype,
        )
        if self.dtype is None:
            return out
        y, copy = out
        self._copies.append((y, copy))
        return y


def cross_kv_groups(layers):
    """The weight groups of every decoder layer's W_K and W_V, as one projection."""
    attns = [layer.dec_enc_attn for layer in layers]
    d_hidn = attns[0].W_K.in_features
    rows = sum(a.W_K.out_features + a.W_V.out_features for a in attns)
    return {
        "cross.KV.weight": ([w for a in attns for w in (a.W_K.weight, a.W_V.weight)], (rows, d_hidn)),
        "cross.KV.bias": ([b for a in attns for b in (a.W_K.bias, a.W_V.bias)], (rows,)),
    }


class LayerPlan:
    """One layer's part of a ForwardPlan: its weights by key (see the layers' `weight_groups`), its
    dropout seeds, and for a decoder layer the cross-attention's (k_s, v_s) heads."""

    def __init__(self, forward_plan, weights, seeds, keys_values):
        self.forward_plan = forward_plan
        self.weights = weights
        self.seeds = seeds
        self.keys_values = keys_values

    def projection(self, name):
        """(weight, bias) of the projection `name`, e.g. "self_attn.QKV"."""
        return self.weights[f"{name}.weight"], self.weights[f"{name}.bias"]

    def seed(self, site):
        """The seed of dropout site `site` (a one-element view), or None."""
        return None if self.seeds is None else self.seeds[site : site + 1]

    def low(self, x):
        return self.forward_plan.low(x)

    def add_norm(self, layer_norm, x, residual, dropout, x_bias, site):
        return self.forward_plan.add_norm(layer_norm, x, residual, dropout, x_bias, self.seed(site))
