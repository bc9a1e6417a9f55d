"""fastformer: the classic tutorial Transformer, drop-in, with Triton kernels on CUDA.

    from fastformer import Config, MovieClassification   # instead of the tutorial's classes
"""
from fastformer.backend import get_backend, set_backend, use_backend
from fastformer.config import Config
from fastformer.masks import (
    AttentionMask,
    get_attn_decoder_mask,
    get_attn_pad_mask,
    get_sinusoid_encoding_table,
)
from fastformer.model import (
    Decoder,
    DecoderLayer,
    Encoder,
    EncoderLayer,
    MovieClassification,
    MultiHeadAttention,
    PoswiseFeedForwardNet,
    ScaledDotProductAttention,
    Transformer,
)
from fastformer.version import __version__

__all__ = [
    "AttentionMask",
    "Config",
    "Decoder",
    "DecoderLayer",
    "Encoder",
    "EncoderLayer",
    "MovieClassification",
    "MultiHeadAttention",
    "PoswiseFeedForwardNet",
    "ScaledDotProductAttention",
    "Transformer",
    "__version__",
    "get_attn_decoder_mask",
    "get_attn_pad_mask",
    "get_backend",
    "get_sinusoid_encoding_table",
    "set_backend",
    "use_backend",
]
