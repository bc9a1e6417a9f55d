"""fastformer's ops: Triton kernels, their launchers and autograd, and a PyTorch reference of each.

Every op `name` has its oracle `name_reference` with the same signature. This package knows
nothing of nn.Module or Config; `fastformer` chooses which of the pair to call.
"""
from kernels._common import HAS_TRITON, INTERPRET
from kernels.add_layer_norm import (
    add_layer_norm,
    add_layer_norm_dropout_mask,
    add_layer_norm_reference,
)
from kernels.attention import attention, attention_dropout_mask, attention_reference
from kernels.feed_forward import feed_forward, feed_forward_fused, feed_forward_reference
from kernels.linear_gelu import linear_act, linear_act_reference, linear_gelu, linear_gelu_reference

__all__ = [
    "HAS_TRITON",
    "INTERPRET",
    "add_layer_norm",
    "add_layer_norm_dropout_mask",
    "add_layer_norm_reference",
    "attention",
    "attention_dropout_mask",
    "attention_reference",
    "feed_forward",
    "feed_forward_fused",
    "feed_forward_reference",
    "linear_act",
    "linear_act_reference",
    "linear_gelu",
    "linear_gelu_reference",
]
