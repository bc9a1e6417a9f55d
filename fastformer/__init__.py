"""fastformer: the Transformer of paul-hyun's tutorial (https://paul-hyun.github.io/transformer-01/),
drop-in, with Triton kernels on CUDA.

    from fastformer import Config, MovieClassification   # instead of the tutorial's classes

The names below are imported on first use, so that `import fastformer.cli` (and with it
`fastformer --help`) does not load torch and Triton.
"""

import importlib

from fastformer.version import __version__  # noqa: F401 (in __all__, built below)

_EXPORTS = {
    "AttentionMask": "fastformer.masks",
    "Config": "fastformer.config",
    "Decoder": "fastformer.model",
    "DecoderLayer": "fastformer.model",
    "Encoder": "fastformer.model",
    "EncoderLayer": "fastformer.model",
    "MovieClassification": "fastformer.model",
    "MultiHeadAttention": "fastformer.model",
    "PoswiseFeedForwardNet": "fastformer.model",
    "ScaledDotProductAttention": "fastformer.model",
    "Transformer": "fastformer.model",
    "get_attn_decoder_mask": "fastformer.masks",
    "get_attn_pad_mask": "fastformer.masks",
    "get_backend": "fastformer.backend",
    "get_sinusoid_encoding_table": "fastformer.masks",
    "pad_to_bucket": "fastformer.data.reviews",
    "set_backend": "fastformer.backend",
    "use_backend": "fastformer.backend",
}
# Submodules reachable as attributes of the package (`fastformer.model`), imported on first use.
_SUBMODULES = ("backend", "config", "masks", "model")

__all__ = sorted([*_EXPORTS, "__version__"])


def __getattr__(name):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"fastformer.{name}")
    elif name == "kernels":
        value = _import_kernels()
    else:
        raise AttributeError(f"module 'fastformer' has no attribute {name!r}")
    globals()[name] = value
    return value


def _import_kernels():
    """`from fastformer import kernels`, with a way out where the ops are not installed: they live in
    the repository's top-level kernels/ folder, which setup.py installs as `fastformer.kernels`, so a
    checkout imports them only once installed (`pip install -e .`)."""
    try:
        return importlib.import_module("fastformer.kernels")
    except ModuleNotFoundError as error:
        if error.name != "fastformer.kernels":
            raise
        raise ModuleNotFoundError(
            "fastformer's ops (fastformer.kernels) are not installed: setup.py installs the "
            "repository's kernels/ folder under that name; from a checkout, run `pip install -e .` first",
            name="fastformer.kernels",
        ) from None


def __dir__():
    return sorted([*globals(), *_EXPORTS, *_SUBMODULES])
