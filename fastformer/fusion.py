"""When the model may fuse across its modules: while nothing can observe the difference.

The fast path reads weights straight from the modules and runs several of them as one kernel (the
QKV projection, bias + dropout + residual + LayerNorm, the feed-forward), so the modules inside a
fusion are never called. That is invisible only while every module in the span is the stock one for
its role and nothing watches it. `fusable(module, roles)` is True when, in module's subtree (module
included):

- every module is of the exact type its role (the last part of its name) takes in `roles`, and fits
  the fused code (a Conv1d of kernel size 1, stride 1, no padding, dilation 1, one group): a module
  swapped in (an adapter, a LoRA wrapper, a quantized or a parametrized Linear, whose class
  parametrize replaces) or added (a quantization observer) makes it False;
- no module has a forward pre-hook, a forward hook or a backward hook (torch.nn.utils.prune works
  by a forward pre-hook, quantization observers by hooks), nor a forward of its own set on the
  instance (`layer.forward = partial(checkpoint, layer.forward)`, activation checkpointing's way,
  which must be called with the tutorial's arguments: reentrant checkpointing passes no keywords);
- no global module hook is set (torch.nn.modules.module.register_module_forward_hook and its kin);
- every parameter and buffer is a plain tensor: a tensor subclass (torchao's quantized weights, a
  DTensor, any `__torch_dispatch__` subclass) has kernels of its own for the products, which the
  fused code, reading the weights' storage, would skip; the model says so once. The fake and
  functional tensors that tracing puts in the parameters' place (torch.export, torch.compile,
  FakeTensorMode) are plain here.

Where it is False the model runs that piece module by module, as the tutorial does. FSDP's
fully_shard of a layer is such a swap (the layer's class becomes FSDP's, with hooks): the model says
so once, and that fully_shard of the whole model, one group, keeps every fusion (the weights it
gathers before the forward are plain tensors; tests/test_module_semantics.py trains both ways).

The walk over the subtree runs once per state of the process: the answer is kept on the module and
reused while no hook handle has been made since (every hook registration makes a RemovableHandle,
which counts them), no module has registered a submodule or a parameter (a global registration hook
counts those: a swap, prune's `weight_orig`, parametrize's `parametrizations`) and the global hook
dicts keep their sizes; a forward set on or deleted from an instance of one of fastformer's own
modules (WatchedModule) counts as a registration too. Removing a hook changes none of these: the
model then keeps running module by module, which is correct, until the next registration. What it
cannot see: a hook written into a module's hook dict by hand, a module's class assigned by hand,
and a forward set on a stock torch module (a Linear) after the last walk.
"""

import sys

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor
from torch.nn.modules import module as _module
from torch.utils.hooks import RemovableHandle

from fastformer.kernels._runtime import warn_once

_registrations = 0  # submodules and parameters registered by any module since import


def _count_registration(*_):
    global _registrations
    _registrations += 1


_module.register_module_module_registration_hook(_count_registration)
_module.register_module_parameter_registration_hook(_count_registration)

_GLOBAL_HOOKS = (
    _module._global_forward_pre_hooks,
    _module._global_forward_hooks,
    _module._global_backward_pre_hooks,
    _module._global_backward_hooks,
)
_KEPT = "_fastformer_fusable"  # the kept answer, in the module's __dict__ (not its state_dict)
# the tensor types the fused code reads as they are (see the module docstring)
PLAIN_TENSORS = (torch.Tensor, nn.Parameter, FakeTensor, FunctionalTensor)


def fusable(module, roles):
    """Whether the model may fuse across `module`'s subtree (see the module docstring). roles:
    {the last part of a submodule's name: its stock type}; module itself is checked against
    roles[""], and the items of a container (named by their index) against roles["name[i]"] where
    it has that key (name: the container's, i: the index), else roles["[i]"]."""
    if any(_GLOBAL_HOOKS):
        return False
    if torch.compiler.is_compiling():  # traced once per graph: no state kept in the module
        return _walk(module, roles)
    kept = module.__dict__.get(_KEPT)
    now = state()
    if kept is not None and kept[0] == now:
        return kept[1]
    answer = _walk(module, roles)
    module.__dict__[_KEPT] = (now, answer)
    return answer


class WatchedModule(nn.Module):
    """The base of fastformer's own modules: a forward set on an instance or deleted from it
    (`layer.forward = partial(checkpoint, layer.forward)`, activation checkpointing's way, whose
    reentrant form passes no keyword arguments) counts as a registration, so that the answers kept
    by fusable are asked again, and the layer is then called as the tutorial calls it."""

    def __setattr__(self, name, value):
        if name == "forward":
            _count_registration()
        super().__setattr__(name, value)

    def __delattr__(self, name):
        if name == "forward":
            _count_registration()
        super().__delattr__(name)


def state():
    """What an answer kept on a module stays valid for (here and in fastformer.plan's layouts): the
    hook handles made and the submodules and parameters registered so far."""
    return RemovableHandle.next_id, _registrations


def _walk(module, roles):
    for name, sub in module.named_modules():
        parent, _, role = name.rpartition(".")
        if role.isdigit():
            # an item of a container: its own role where roles names it ("feed_forward[1]", an
            # nn.Sequential's second module), else any item's, "[i]" (a ModuleList of layers)
            own = f"{parent.rpartition('.')[2]}[{role}]"
            role = own if own in roles else "[i]"
        if type(sub) is not roles.get(role) or has_hooks(sub) or "forward" in sub.__dict__ or not _fits(sub):
            _say_if_sharded(sub)
            return False
        if _holds_subclass(module, name, sub):
            return False
    return True


def _say_if_sharded(module):
    """Say once that FSDP has wrapped one of the model's modules (fully_shard per layer: the layer's
    class FSDP's, its hooks FSDP's), which turns off the fusions across that module's children,
    and how to keep them. Not while compiling; FSDP not imported, nothing can be wrapped by it."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is None or torch.compiler.is_compiling():
        return
    wrappers = tuple(getattr(fsdp, name) for name in ("FSDPModule", "FullyShardedDataParallel") if hasattr(fsdp, name))
    if not isinstance(module, wrappers):
        return
    warn_once(
        ("fusion", "fsdp"),
        f"fastformer: FSDP has wrapped the model's layers ({type(module).__name__}), so they run module by module "
        "without the fused add + LayerNorm, QKV projection and weight casts (each attention and feed-forward still "
        "runs fused): shard the model as one group, fully_shard(model) alone, to keep every fusion",
    )


def _holds_subclass(root, name, module):
    """Whether one of module's own parameters or buffers is a tensor subclass (not PLAIN_TENSORS),
    saying once per subclass that such weights run module by module (not while compiling, where a
    warning would break the graph)."""
    for kind, tensors in (("parameter", module._parameters), ("buffer", module._buffers)):
        for tensor_name, tensor in tensors.items():
            if tensor is None or type(tensor) in PLAIN_TENSORS:
                continue
            if not torch.compiler.is_compiling():
                where = ".".join(filter(None, [name, tensor_name]))
                subclass = type(tensor).__name__
                warn_once(
                    ("fusion", "subclass", type(tensor)),
                    f"fastformer: the {kind} {where} of the {type(root).__name__} is of type {subclass}, a tensor "
                    "subclass with kernels of its own, so these modules run module by module, as the tutorial's do, "
                    f"their products by {subclass}'s kernels (the fused kernels read plain tensors)",
                )
            return True
    return False


def has_hooks(module):
    """Whether a forward pre-hook, forward hook or backward hook is registered on module."""
    return bool(
        module._forward_pre_hooks or module._forward_hooks or module._backward_pre_hooks or module._backward_hooks
    )


def _fits(module):
    """Whether a stock module is one the fused code reads right: a Conv1d as a Linear."""
    if type(module) is nn.Conv1d:
        return (
            module.kernel_size == (1,)
            and module.stride == (1,)
            and module.padding in ((0,), "valid")
            and module.dilation == (1,)
            and module.groups == 1
        )
    return True
