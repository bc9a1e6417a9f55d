"""How the attention backward runs: in two passes (bitwise repeatable) or in one (fewer products).

- "two-pass": a dQ pass (one program per query block, which also writes delta = rowsum(dO * O)),
  then a dK/dV pass (one per key block): each tile's scores and dP are computed in both, 7 matrix
  products a tile, and every sum is taken in a fixed order, so a call gives the same bits each time.
- "one-pass": FlashAttention-2's way: delta and zeroed fp32 sums for dQ, then the dK/dV pass adding
  each tile's dS K to the sums by atomics, then dQ from the sums: 5 products a tile, one launch more
  (3 where there are 2), and dQ's sums taken in the order the hardware runs the programs, so its
  last bits may differ from call to call (dK and dV do not).

Which: "two-pass" whenever `torch.use_deterministic_algorithms(True)` is in force (PyTorch's own
switch) and in traced calls (torch.compile, fake or functional tensors, make_fx: a traced graph
keeps the two passes, as no GPU has run the one pass under Inductor yet); else the choice of
`set_attention_backward` or FASTFORMER_ATTENTION_BACKWARD (two-pass, one-pass or auto), and with
"auto", attention's rule (`attention.ONE_PASS_FROM`). `fastformer train` runs its job within
attention_backward("two-pass"), for its --resume promise (bit for bit the weights of an
uninterrupted run): docs/kernels.md.
"""

from ._runtime import Choice

ENV_VAR = "FASTFORMER_ATTENTION_BACKWARD"
CHOICES = ("two-pass", "one-pass", "auto")


def _parse(value):
    if value in (None, ""):
        return "auto"
    if value not in CHOICES:
        raise ValueError(
            f"{ENV_VAR} must be two-pass (bitwise repeatable), one-pass (dQ by atomics, fewer products) or auto "
            f"(attention's rule), got {value!r}"
        )
    return value


def _check(way):
    if way not in CHOICES:
        raise ValueError(f"set_attention_backward's way must be 'two-pass', 'one-pass', 'auto' or None, got {way!r}")


# set_attention_backward's choice, else FASTFORMER_ATTENTION_BACKWARD's (unset or "": "auto")
attention_backward_choice = Choice(ENV_VAR, _parse, _check)


def set_attention_backward(way):
    """Run the attention backward in two passes ("two-pass"), in one ("one-pass"), by attention's
    rule ("auto"), or as FASTFORMER_ATTENTION_BACKWARD says, else by the rule (None, the default).
    torch.use_deterministic_algorithms(True) runs two passes whatever the choice. Takes effect at
    the next backward."""
    attention_backward_choice.set(way)


def attention_backward(way="one-pass"):
    """set_attention_backward(way) inside the block, and the choice in force before it after the block."""
    return attention_backward_choice.within(way)
