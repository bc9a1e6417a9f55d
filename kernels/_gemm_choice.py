"""Which GEMM runs the FFN's first product (linear_gelu's forward), and when the choice applies.

Two ways to compute y = act(x @ W.T + b) for training and inference:
- "triton": one Triton GEMM whose epilogue adds the bias and applies the activation to the fp32
  accumulator (`_linear_gelu_fwd_kernel`); it also writes the pre-activation when a backward
  needs it.
- "cublas": the product and its bias by cuBLAS (`torch.addmm`: cuBLASLt adds a bias vector in
  its own epilogue), written to memory as the pre-activation, then a Triton elementwise kernel
  that reads it back and writes act(pre) (`_activation_fwd_kernel`). Without a backward to feed,
  the activation is written over the pre-activation, in place.
Both round the pre-activation to the output's dtype before the activation, as eager PyTorch's
linear then gelu does, so the backward (which reads the pre-activation) is the same for both.
The FFN's backward makes the same choice for its dH product apart, by the same switch and its own
rule and table entry (linear_gelu._prefers_cublas_backward): the dH GEMM with the activation
gradient in its epilogue, or cuBLAS's dH and then the activation-gradient pass.

Which: the choice of `set_ffn_gemm` or FASTFORMER_FFN_GEMM (triton, cublas, or auto) when one is
made, else linear_gelu's rule (`PREFERS_CUBLAS`); and cuBLAS only in eager calls (CUDA-graph
captures included). Under torch.compile, fake tensors or another dispatch mode or transform the
Triton GEMM runs whatever the choice: a compiled graph keeps what its trace chose and guards
nothing this choice reads, so flipping the choice later would not recompile it, where an eager
call's plan is keyed on the choice (kernels._configs.switches) and is made again.
"""

from ._runtime import Choice, eager

ENV_VAR = "FASTFORMER_FFN_GEMM"
CHOICES = ("triton", "cublas", "auto")


def _parse(value):
    if value in (None, ""):
        return "auto"
    if value not in CHOICES:
        raise ValueError(
            f"{ENV_VAR} must be triton (the Triton GEMM with its fused epilogue), cublas (cuBLAS's GEMM, then "
            f"the activation kernel) or auto (the rule's pick), got {value!r}"
        )
    return value


def _check(gemm):
    if gemm not in CHOICES:
        raise ValueError(f"set_ffn_gemm's gemm must be 'triton', 'cublas', 'auto' or None, got {gemm!r}")


# set_ffn_gemm's choice, else FASTFORMER_FFN_GEMM's (unset or "": "auto"): "triton", "cublas" or "auto"
ffn_gemm_choice = Choice(ENV_VAR, _parse, _check)


def set_ffn_gemm(gemm):
    """Run the FFN's first product by the Triton GEMM ("triton"), by cuBLAS and the activation
    kernel ("cublas", where cuBLAS can serve: eager calls), by linear_gelu's rule ("auto"), or as
    FASTFORMER_FFN_GEMM says, else by the rule (None, the default). Takes effect at the next call
    (the ops' plans are kept per choice: kernels._configs.switches)."""
    ffn_gemm_choice.set(gemm)


def ffn_gemm(gemm="cublas"):
    """set_ffn_gemm(gemm) inside the block, and the choice in force before it after the block."""
    return ffn_gemm_choice.within(gemm)


def use_cublas(rule):
    """Whether a forward runs its product by cuBLAS: the choice (ffn_gemm_choice) or, with "auto",
    the kernel's `rule` (a bool), and then only in eager calls (see the module's docstring)."""
    choice = ffn_gemm_choice()
    if not (rule if choice == "auto" else choice == "cublas"):
        return False
    return eager()
