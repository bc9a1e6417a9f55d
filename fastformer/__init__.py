"""fastformer: the Transformer of paul-hyun's tutorial (https://paul-hyun.github.io/transformer-01/),
drop-in, with Triton kernels on CUDA.

    from fastformer import Config, MovieClassification   # instead of the tutorial's classes

The names below are imported on first use, so that `import fastformer.cli` (and with it
`fastformer --help`) does not load torch and Triton.
"""
import importlib
import importlib.abc
import importlib.util
import sys
from pathlib import Path

from fastformer.version import __version__


class _CheckoutKernels(importlib.abc.MetaPathFinder):
    """fastformer's ops live in the repository's top-level kernels/ folder and install as
    `fastformer.kernels` (setup.py's package_dir), so that they never take the top-level name
    `kernels`, which belongs to another project on PyPI. Run from a checkout, where fastformer/ has
    no kernels/ inside, this finds `fastformer.kernels` in the folder beside it. It only locates
    the package: nothing is imported until a module asks for it. It goes first on sys.meta_path,
    so that the checkout's fastformer never runs with another copy's kernels (an editable install
    of a second checkout has a finder of its own for the same name)."""

    def __init__(self, folder):
        self.folder = folder

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "fastformer.kernels":
            return None
        return importlib.util.spec_from_file_location(
            fullname, self.folder / "__init__.py", submodule_search_locations=[str(self.folder)]
        )


_here = Path(__file__).resolve().parent
if not (_here / "kernels").is_dir() and (_here.parent / "kernels" / "__init__.py").is_file():
    sys.meta_path.insert(0, _CheckoutKernels(_here.parent / "kernels"))

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
    "set_backend": "fastformer.backend",
    "use_backend": "fastformer.backend",
}
# Submodules that `import fastformer` used to load, still reachable as attributes.
_SUBMODULES = ("backend", "config", "masks", "model")

__all__ = sorted([*_EXPORTS, "__version__"])


def __getattr__(name):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"fastformer.{name}")
    else:
        raise AttributeError(f"module 'fastformer' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return sorted([*globals(), *_EXPORTS, *_SUBMODULES])
