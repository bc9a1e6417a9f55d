"""Tile loads through tensor descriptors (Hopper's TMA), and when a launch uses them.

A kernel launched with TMA=True makes, in each program, a tensor descriptor of the rows it streams
(`tl.make_tensor_descriptor` over one (batch, head)'s (L, D) rows, or a GEMM operand) and loads
its tiles through it: on sm_90 a tile is one bulk copy into shared memory, issued by one thread,
with rows and columns past the end read as zeros by the hardware, where pointer loads have every
thread compute addresses and masks. Without it (TMA=False) the same kernel takes pointer loads;
a constexpr picks the code, so each variant compiles to its own. Triton 3.6 to 3.9 take this API
alike, and the interpreter runs it, so the CPU tests cover both paths.

Descriptors made in the kernel, not on the host (triton.tools.tensor_descriptor.TensorDescriptor):
a host descriptor's block shape is the config's, so it would be made per call after the config is
picked, and Triton encodes it again on every launch; and torch.compile's Inductor drops a user
kernel whose tensors reach it only inside host descriptors (torch 2.11 and 2.13). The cost is on
the device: each program writes its descriptors (128 bytes each) to a scratch buffer that Triton
asks its allocator for at every launch (kernels._runtime.ensure_allocator, which the launches call).

Whether a launch uses them (`use_tma`): the choice of `set_tma` or FASTFORMER_TMA when one is made,
else the kernel's rule; and only where TMA can serve: eager calls (not under torch.compile, whose
launches of these kernels have not been run with the scratch buffer), an sm_90 or newer target
(or the interpreter), and every stride but the unit last one a multiple of 16 bytes, as the
hardware requires. All of that is fixed by what an op's plan is keyed on (its arguments' strides
and dtypes, the switches), so a plan keeps the flag. The last requirement, a base 16-byte aligned,
is a fact of each call's addresses: the launch checks it (kernels._configs.Configs' `tma_bases`,
kernels._runtime.PreparedLaunch) and loads through pointers for a call whose bases are not.
"""
from ._runtime import INTERPRET, Choice, eager

ENV_VAR = "FASTFORMER_TMA"


def _parse(value):
    if value not in (None, "", "0", "1"):
        raise ValueError(
            f"{ENV_VAR} must be 1 (load tiles through tensor descriptors) or 0 (pointer loads), got {value!r}"
        )
    return None if value in (None, "") else value == "1"


def _check(enabled):
    if not isinstance(enabled, bool):
        raise TypeError(f"set_tma takes True, False or None, got {enabled!r}")


# set_tma's choice, else FASTFORMER_TMA's ("1": True, "0": False), else None (the rules')
tma_choice = Choice(ENV_VAR, _parse, _check)


def set_tma(enabled):
    """Load tiles through tensor descriptors where TMA can serve (True), never (False), or as
    FASTFORMER_TMA says, else as each kernel's rule picks (None, the default). Takes effect at the
    next call (the ops' plans are kept per choice: kernels._configs.switches)."""
    tma_choice.set(enabled)


def tma_loads(enabled=True):
    """set_tma(enabled) inside the block, and the choice in force before it after the block."""
    return tma_choice.within(enabled)


def use_tma(rule, *tensors):
    """TMA for a launch streaming the rows of `tensors`: the choice (tma_choice) or, with none
    made, the kernel's `rule` (a bool), and then only where TMA can serve (tma_can_serve). Reads
    no address (see the module's docstring)."""
    choice = tma_choice()
    if not (rule if choice is None else choice):
        return False
    return tma_can_serve(*tensors)


def tma_can_serve(*tensors):
    """Whether descriptors can load from every tensor (None: skipped), its base aligned: in eager
    calls, on an sm_90 or newer target or the interpreter, with a unit last stride and the other
    strides multiples of 16 bytes."""
    if not eager():
        return False
    for t in tensors:
        if t is None:
            continue
        if not (INTERPRET or _arch(t) >= 90):
            return False
        size = t.element_size()
        strides = t.stride()
        if strides[-1] != 1 or any(s * size & 15 for s in strides[:-1]):
            return False
    return True


_arches = {}  # (driver, device index) -> the target's compute capability (90 for sm_90)


def _arch(t):
    """The compute capability (major * 10 + minor) of the target a launch on t compiles for: the
    active Triton driver's, which on a CPU tensor is tools.sm90's dry-run sm_90a."""
    from triton.runtime.driver import driver

    active = driver.active
    key = (id(active), active.get_current_device())
    try:
        return _arches[key]
    except KeyError:
        target = active.get_current_target()
        arch = target.arch if target.backend == "cuda" and isinstance(target.arch, int) else 0
        return _arches.setdefault(key, arch)
