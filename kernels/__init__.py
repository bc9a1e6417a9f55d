"""fastformer's ops: Triton kernels, their launchers and autograd, and a PyTorch reference of each.

Every op `name` has its oracle `name_reference` with the same signature. This package knows
nothing of nn.Module or Config; `fastformer` chooses which of the pair to call.

A kernel with several configs runs the one its rule picks; `set_autotune(True)` or
FASTFORMER_AUTOTUNE=1 autotunes them instead, the results kept on disk per GPU (kernels._configs).
The attention passes load their tiles through pointers or, on Hopper, through tensor descriptors
(TMA) as each kernel's rule says; `set_tma(True)` / FASTFORMER_TMA=1 choose TMA wherever it can
serve, `set_tma(False)` / FASTFORMER_TMA=0 never (kernels._tma). The FFN's first product runs
by the Triton GEMM with its fused epilogue or by cuBLAS and an activation kernel, as linear_gelu's
rule says; `set_ffn_gemm("cublas")` / FASTFORMER_FFN_GEMM=cublas or "triton" choose
(kernels._gemm_choice). The attention backward runs in two passes, bitwise repeatable, or in one
with dQ summed by atomics (fewer products) as attention's rule says, two under
torch.use_deterministic_algorithms(True); `set_attention_backward("one-pass")` /
FASTFORMER_ATTENTION_BACKWARD=one-pass or "two-pass" choose (kernels._backward_choice). Where a
GPU's sweep (python -m tools.sweep) found a variant and config faster than the rule's, its tuned
table, installed for that GPU model, says what runs instead;
`set_tuned(path)` / FASTFORMER_TUNED=path choose another table, `set_tuned(False)` /
FASTFORMER_TUNED=0 the written rules alone (kernels._tuned).

This folder is the package `fastformer.kernels`: setup.py installs it under that name (a checkout
needs `pip install -e .`), so that fastformer never takes the top-level name `kernels`, which belongs
to another project on PyPI. Import it as `from fastformer import kernels`.
"""
import sys
from pathlib import Path

if __name__ != "fastformer.kernels":
    # Imported under another name: `import kernels` where this folder is on the path (a checkout's
    # root, where the README's commands run). That name belongs to another project on PyPI, which
    # libraries probe for (transformers imports it to look for a version), so this folder stands
    # aside: the other project when it is installed, else an empty package that names the right
    # import on any use. A second copy of the ops would register the torch.library ops twice.
    from ._stand_aside import stand_aside  # nothing else of this folder loads

    stand_aside(__name__, Path(__file__).resolve().parent)
else:  # fastformer.kernels: the ops

    def _check_same_copy():
        """The ops must come from the copy of the repository whose `fastformer` is running: installed,
        kernels/ sits inside fastformer/; in a checkout, beside it. Two checkouts mix when one is
        installed in editable mode and Python runs from the other: its fastformer/ is found on the path
        and, having no kernels/ inside, takes the installed copy's. (Importing this package imported its
        parent first, so `fastformer` is in sys.modules; nothing of it is loaded here.)"""
        here = Path(__file__).resolve().parent
        running = Path(sys.modules["fastformer"].__file__).resolve().parent
        if running not in (here.parent, here.parent / "fastformer"):
            raise ImportError(
                f"fastformer is imported from {running} but its ops from another copy, {here}: "
                f"install the copy you run (`pip install -e .` in {running.parent}) or run the installed one"
            )

    _check_same_copy()

    from ._backward_choice import attention_backward, attention_backward_choice, set_attention_backward
    from ._configs import autotune_enabled, autotuning, check_environment, set_autotune
    from ._gemm_choice import ffn_gemm, ffn_gemm_choice, set_ffn_gemm
    from ._runtime import HAS_TRITON, INTERPRET, compile_only
    from ._tma import set_tma, tma_choice, tma_loads
    from ._tuned import set_tuned, tuned, tuned_choice
    from .add_layer_norm import (
        add_layer_norm,
        add_layer_norm_dropout_mask,
        add_layer_norm_reference,
    )
    from .attention import (
        attention,
        attention_dropout_mask,
        attention_reference,
        self_attention,
        self_attention_reference,
    )
    from .attention_varlen import attention_varlen, attention_varlen_reference
    from .feed_forward import feed_forward, feed_forward_fused, feed_forward_reference
    from .linear_gelu import linear_gelu, linear_gelu_reference

    __all__ = [
        "HAS_TRITON",
        "INTERPRET",
        "add_layer_norm",
        "add_layer_norm_dropout_mask",
        "add_layer_norm_reference",
        "attention",
        "attention_backward",
        "attention_backward_choice",
        "attention_dropout_mask",
        "attention_reference",
        "attention_varlen",
        "attention_varlen_reference",
        "autotune_enabled",
        "autotuning",
        "check_environment",
        "compile_only",
        "feed_forward",
        "feed_forward_fused",
        "feed_forward_reference",
        "ffn_gemm",
        "ffn_gemm_choice",
        "linear_gelu",
        "linear_gelu_reference",
        "self_attention",
        "self_attention_reference",
        "set_attention_backward",
        "set_autotune",
        "set_ffn_gemm",
        "set_tma",
        "set_tuned",
        "tma_choice",
        "tma_loads",
        "tuned",
        "tuned_choice",
    ]
