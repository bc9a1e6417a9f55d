"""How the ops run: Triton (or a stand-in where it is not installed), the interpreter, launching a
kernel, the launch checks, autocast and tl.dot's precision, and one-time warnings.

Rules for jit code in `kernels/` (the sm_90a compile check, tests/test_sm90_compile.py, enforces
what a compiler can see):
- No plain globals inside jit code: use tl.constexpr. A module constant read by a kernel must be
  `NAME = tl.constexpr(value)`; the interpreter accepts a plain float, the compiler rejects it.
- `tl.dot(a, b, acc, input_precision=..., out_dtype=tl.float32)`: accumulate in place (wgmma keeps
  the accumulator in registers) and say the fp32 result (tl.dot's default differs between the
  supported Triton versions: 3.8 changed it).
- Triton 3.6 to 3.9: no block pointers (`tl.make_block_ptr` raises in 3.9), no API added after 3.6.
"""

import contextlib
import contextvars
import functools
import os
import warnings
from typing import ClassVar

import torch
from torch import Tensor
from torch.utils._python_dispatch import _disable_current_modes


def _identity_decorator(*args, **kwargs):
    """`@x` and `@x(...)` both leave the function as it is."""
    if len(args) == 1 and callable(args[0]) and not kwargs:
        return args[0]
    return lambda fn: fn


class _TritonMissing:
    """Stands in for `triton` and `tl` where Triton is not installed (it ships for Linux only), so
    the op files still import and the reference path works; launching a kernel is refused first."""

    def __getattr__(self, name):
        return _identity_decorator


try:
    import triton
    import triton.language as tl
    from triton import knobs
    from triton.runtime import _allocation
    from triton.runtime.driver import driver

    HAS_TRITON = True
except ImportError:
    triton = tl = _TritonMissing()
    HAS_TRITON = False

# Triton reads TRITON_INTERPRET when a kernel is decorated, so this is fixed at import time, and
# read as Triton reads it (1, true, on, yes or y in any case; fastformer.environment before import)
INTERPRET = HAS_TRITON and bool(knobs.runtime.interpret)

_warned = set()


def cdiv(x, y):
    """ceil(x / y) of host integers (SymInts too): triton.cdiv's formula, without the cost of calling
    a Triton constexpr function (a few microseconds each, several per launch)."""
    return (x + (y - 1)) // y


def next_power_of_2(n):
    """The smallest power of 2 >= n (n >= 1), as triton.next_power_of_2 computes it, on the host."""
    n -= 1
    n |= n >> 1
    n |= n >> 2
    n |= n >> 4
    n |= n >> 8
    n |= n >> 16
    n |= n >> 32
    return n + 1


class EnvSetting:
    """An environment variable an op reads on every call, parsed once per value it takes:
    `EnvSetting(name, parse)()` is parse(os.environ.get(name)), read live (a value set through
    os.environ, as pytest's monkeypatch sets it, counts from the next call). os.environ decodes
    the value on every get (half a microsecond); here a call is a lookup in the encoded mapping
    os.environ keeps, and parse runs again only when that mapping holds another object for the
    name. A value parse rejects (raises) is parsed, and rejected, on every call."""

    _encoded = getattr(os.environ, "_data", None)  # CPython's os._Environ: encoded name -> encoded value

    def __init__(self, name, parse):
        self.name, self.parse = name, parse
        self.key = os.environ.encodekey(name) if self._encoded is not None else None
        self.raw = object()  # not yet read (None is a reading: the name unset)
        self.value = None

    def __call__(self):
        if self._encoded is None:  # another os.environ than CPython's: read it each time
            return self.parse(os.environ.get(self.name))
        raw = self._encoded.get(self.key)
        if raw is not self.raw:  # the object kept alive in self.raw cannot share an id with another
            self.value = self.parse(os.environ.get(self.name))
            self.raw = raw
        return self.value


class Choice:
    """A choice the ops read on every call: made in Python (`set`, or `within` for a block), else
    read from an environment variable (an EnvSetting of `env_var`, `parse` turning its text into
    the choice), else None, which each reader takes for its default. `check(value)` vets a value
    given to `set` and raises naming the public setter. Calling it gives the choice in force."""

    def __init__(self, env_var, parse, check):
        self.env, self.check, self.made = EnvSetting(env_var, parse), check, None

    def set(self, value):
        if value is not None:
            self.check(value)
        self.made = value

    @contextlib.contextmanager
    def within(self, value):
        """set(value) inside the block, and the choice made before it after the block."""
        previous = self.made
        self.set(value)
        try:
            yield
        finally:
            self.made = previous

    def __call__(self):
        return self.env() if self.made is None else self.made

    @classmethod
    def switch(cls, env_var, setter, on, off, default):
        """A Choice of True or False: made by `setter` (the public function's name, which its
        TypeError names), else env_var's "1" or "0" (`on` and `off` say what each does, for the
        variable's ValueError), else `default` (unset or empty)."""

        def parse(value):
            if value in (None, ""):
                return default
            if value not in ("0", "1"):
                raise ValueError(f"{env_var} must be 1 ({on}) or 0 ({off}), got {value!r}")
            return value == "1"

        def check(flag):
            if not isinstance(flag, bool):
                raise TypeError(f"{setter} takes True, False or None, got {flag!r}")

        return cls(env_var, parse, check)


def warn_once(key, message):
    """Warn about `key` once per process (fallbacks must be loud but not spam every layer)."""
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, stacklevel=3)


def launch(kernel):
    """How every op file launches a kernel: `launch(kernel)[grid](...)`, through
    torch.library.wrap_triton, so that torch.compile traces the launch in place of a graph break
    (a kernel with several configs launches through its kernels._configs.Configs, which calls this).
    An absent tensor argument, input or output (a seed without dropout, a missing weight, a
    half-precision copy not asked for, the outputs of the other pass of a kernel launched in
    passes), is None, and its strides 0: Triton compiles None as a constexpr, and every use of
    the pointer, its offsetting included, sits under the constexpr flag that says it is present
    (HAS_DROPOUT, HAS_WEIGHT, WRITE_LOW, DQ_PASS...). A jit helper may take such a None, but not
    return one (Triton 3.6 rejects it, and 3.9 inside a tuple), so an absent pointer is offset in
    the kernel's own body. wrap_triton (torch 2.11 and 2.13) and Inductor pass None on as a
    constexpr too, so a compiled graph launches the same specializations.
    Inside `compile_only()` a launch compiles its kernel and runs nothing. Under the interpreter
    the kernel is launched as it is, as torch 2.13's wrap_triton does (2.11's refuses it). In
    eager mode (`eager()`: no trace, no dispatch mode, no functorch transform) wrap_triton has
    nothing to record: a jit kernel launches through _EagerLaunch, the compiled kernel Triton
    picked for the signature, and an autotuner as it is."""
    if _compile_only.get():
        return _CompileOnly(kernel)
    if INTERPRET:
        return kernel
    if eager():
        # wrap_triton is for tracing; outside a trace, and outside a registered op (an eager twin
        # calls the op's body directly), it would launch through a higher-order op that rebuilds
        # the kernel (an autotuner's disk cache is lost) at tens of microseconds a call
        return _EagerLaunch.of(kernel) if isinstance(kernel, triton.runtime.JITFunction) else kernel
    return torch.library.wrap_triton(kernel)


def aligned(t):
    """Whether a tensor descriptor can start at t's first element: its address a multiple of 16 bytes."""
    return not t.data_ptr() & 15


def _scratch(size, alignment, stream):
    """Triton's allocator for a launch's global scratch (the programs' descriptors): bytes on the
    current CUDA device from PyTorch's caching allocator, so that a CUDA-graph capture takes them
    from its pool. Freed when the launch returns: the next kernel on the stream may reuse them."""
    return torch.empty(size, dtype=torch.int8, device=torch.device("cuda", torch.cuda.current_device()))


def ensure_allocator():
    """Give Triton `_scratch` as its allocator in this thread's context, unless one is set there
    (Triton keeps it in a ContextVar: each thread, autograd's backward worker included, starts
    without). Called before every launch with TMA=True (kernels/_tma.py), by Configs and PreparedLaunch; a
    ContextVar lookup when set."""
    if INTERPRET:  # the interpreter allocates nothing
        return
    if _allocation._allocator.get() is _allocation._NULL_ALLOCATOR:
        triton.set_allocator(_scratch)


def eager():
    """Whether ops run eagerly on real tensors: no torch.compile trace, no dispatch mode (fake
    tensors, functionalization, make_fx's proxies) and no functorch transform that the registered
    torch.library op and wrap_triton have to be seen under. Then an op may skip the dispatcher
    (eager_twin) and a launch Triton's binder (_EagerLaunch)."""
    return (
        not torch.compiler.is_compiling()
        and torch._C._len_torch_dispatch_stack() == 0
        and torch._C._functorch.peek_interpreter_stack() is None
    )


# what a fused op's backward raises where it cannot run (plain_backward)
SECOND_DERIVATIVE = (
    "fastformer's fused kernels have no second derivative, so their backward cannot build a graph of "
    "the gradients (create_graph=True); run the model on the reference backend "
    "(fastformer.use_backend('reference')) for double backward"
)
BATCHED_BACKWARD = (
    "fastformer's fused kernels' backward cannot run batched (autograd.grad(..., is_grads_batched=True), "
    "or a torch.func transform over the backward); run the model on the reference backend "
    "(fastformer.use_backend('reference')) for batched gradients"
)


_legacy_batched = torch._C._functorch.is_legacy_batchedtensor


def plain_backward(backward):
    """An autograd.Function's backward that runs only as an ordinary backward does, first order and
    unbatched, and otherwise raises, naming the reference backend. The fused backwards launch Triton
    kernels, whose outputs autograd cannot differentiate: with create_graph=True (grad mode on
    inside the backward) their gradients would come back without those kernels' part of a second
    derivative, and a later derivative would be silently wrong (torch's once_differentiable guards
    only gradients whose incoming gradient requires grad, not a loss's first backward, and its
    guard is off the path autograd.grad(..., inputs) takes). Under vmap (is_grads_batched) the
    kernels would be handed batched tensors, which have no storage to launch on."""

    @functools.wraps(backward)
    def checked(ctx, *grads):
        if torch.is_grad_enabled():
            raise RuntimeError(SECOND_DERIVATIVE)
        if torch._C._functorch.peek_interpreter_stack() is not None:  # a torch.func vmap
            raise RuntimeError(BATCHED_BACKWARD)
        for grad in grads:  # is_grads_batched runs the backward under torch's older vmap
            if grad is not None and _legacy_batched(grad):
                raise RuntimeError(BATCHED_BACKWARD)
        return backward(ctx, *grads)

    return checked


def eager_twin(forward, setup_context, backward):
    """The autograd.Function an op's public function calls in eager mode in place of its registered
    torch.library op (the op serves torch.compile, fake tensors and transforms): the same Python
    body `forward` (the op's implementation), setup_context and backward as the op registers, with
    no dispatcher, schema defaults or redispatch in between. Returns its `apply`. (Its forward
    takes ctx and calls setup_context itself: a Function that defines setup_context binds every
    call's arguments to forward's signature with inspect, tens of microseconds.)"""

    def forward_with_ctx(ctx, *args):
        output = forward(*args)
        setup_context(ctx, args, output)
        return output

    return type(
        f"_{forward.__name__}_eager",
        (torch.autograd.Function,),
        {"forward": staticmethod(forward_with_ctx), "backward": staticmethod(plain_backward(backward))},
    ).apply


def autograd_apply(function):
    """`function.apply` (a torch.autograd.Function with no setup_context and no defaulted
    arguments) without the Python torch wraps around the C apply on every call: binding defaults
    for setup_context and asking functorch about each argument, a couple of microseconds. For
    planned calls only: eager() (no functorch transform active), and no tensor argument still
    wrapped by a transform that has finished (a dead wrapper, which `signature` keys as
    unplannable: the ordinary path's `function.apply` unwraps it)."""
    return torch._C._FunctionBase.__dict__["apply"].__get__(None, function)


_deferred_ops = []  # kernel modules' op registrations that wait for a process able to run a kernel


def kernels_can_run():
    """Whether a kernel can run in this process as it started: on a CUDA device, or through Triton's
    interpreter (the dry-run driver's block, tools/sm90.py, registers the ops when it is entered)."""
    return HAS_TRITON and (INTERPRET or torch.cuda.is_available())


def defer_ops(namespace, ops, autograd=None):
    """Registers a kernel module's torch.library ops and binds them to its names: for each
    `name: (op, impl)` of `ops`, namespace[name] = torch.library.triton_op("fastformer::" + op)(impl),
    with `autograd`, (backward, setup_context), registered on the first. Now where a kernel can run
    (kernels_can_run), else at the first register_ops(): torch.library.triton_op imports
    torch._inductor and torch._dynamo (1 to 1.5 s), which a process that can only run the PyTorch
    reference (a CPU without TRITON_INTERPRET: `fastformer predict`, `evaluate`) should not pay for.
    Until then the names hold None: nothing calls them, as require_launchable refuses the Triton
    path first."""

    def register():
        for name, (op, impl) in ops.items():
            namespace[name] = torch.library.triton_op(f"fastformer::{op}", mutates_args=())(impl)
        if autograd is not None:
            backward, setup_context = autograd
            torch.library.register_autograd(namespace[next(iter(ops))], backward, setup_context=setup_context)

    if kernels_can_run():
        register()
    else:
        _deferred_ops.append(register)


def register_ops():
    """Registers every kernel module's ops that defer_ops deferred (none where a kernel could run
    from the start): the dry-run driver calls it, and so does a launch."""
    while _deferred_ops:
        _deferred_ops.pop(0)()


def call_op(op, impl, *args):
    """An op called from another op's backward: its implementation `impl` in eager mode, else the
    registered op, which torch.compile traces."""
    return impl(*args) if eager() else op(*args)


class _EagerLaunch:
    """`launch(kernel)[grid](...)` in eager mode: the kernel Triton compiled for these arguments,
    launched directly, its cache keyed on what Triton specializes on.

    `kernel[grid](...)` (JITFunction.run) binds the arguments, asks Triton's specializer about each
    and builds a cache key from its answers on every call: most of a launch's host time. Here the
    first call of a signature goes through it and keeps the CompiledKernel it returns; later calls
    with the same key launch that one. The key holds at least what Triton's holds, so that a kernel
    compiled for aligned pointers is never launched on an unaligned view: per tensor its dtype and
    whether its address is a multiple of 16; per integer whether it is 1, whether it is a multiple
    of 16, and its type's range (i32, i64, u64); that a Python float is one; the value of every
    constexpr, bool and other argument; the launch options (num_warps, ...), Triton's debug knob
    and the current device. A tensor of a subclass other than nn.Parameter (a FakeTensor, say), an
    argument left to its default, or a launch-enter hook (a profiler's) takes Triton's own path
    every time."""

    _by_kernel: ClassVar[dict] = {}  # jit function -> its _EagerLaunch
    MAX_ENTRIES = 4096  # per kernel; a run that somehow keys more starts the cache again

    def __init__(self, kernel):
        self.kernel = kernel
        self.names = kernel.arg_names
        self.index = {name: i for i, name in enumerate(self.names)}
        self.constexpr = tuple(p.is_constexpr for p in kernel.params)
        self.compiled = {}

    @classmethod
    def forget(cls):
        """Drop every kept CompiledKernel, as Triton's caches are dropped (tools.sm90 does both
        between its cases, so that each compiles what it launches)."""
        cls._by_kernel.clear()

    @classmethod
    def of(cls, kernel):
        try:
            return cls._by_kernel[kernel]
        except KeyError:
            return cls._by_kernel.setdefault(kernel, cls(kernel))

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.run(grid, args, kwargs)

    def run(self, grid, args, kwargs):
        values = list(args)
        options = []
        if kwargs:
            values.extend([None] * (len(self.names) - len(values)))
            given = len(args)
            for name, value in kwargs.items():
                i = self.index.get(name)
                if i is None:
                    options.append((name, value))
                else:
                    values[i] = value
                    given += 1
            if given != len(self.names):
                return self.kernel.run(*args, grid=grid, warmup=False, **kwargs)  # a default applies
        elif len(values) != len(self.names):
            return self.kernel.run(*args, grid=grid, warmup=False, **kwargs)
        key = self._key(values, options)
        enter = knobs.runtime.launch_enter_hook  # a HookChain, empty unless a profiler added a hook
        if key is None or getattr(enter, "calls", enter):
            return self.kernel.run(*args, grid=grid, warmup=False, **kwargs)
        compiled = self.compiled.get(key)
        if compiled is None:
            compiled = self.kernel.run(*args, grid=grid, warmup=False, **kwargs)
            if compiled is not None:
                if len(self.compiled) >= self.MAX_ENTRIES:
                    self.compiled.clear()
                self.compiled[key] = compiled
            return compiled
        if callable(grid):
            grid = grid(dict(zip(self.names, values)))
        _run_compiled(compiled, grid, values)
        return compiled

    def _key(self, values, options):
        """The cache key of a launch, or None when it must take Triton's path (a tensor subclass)."""
        key = [driver.active.get_current_device(), knobs.runtime.debug, *options]
        append = key.append
        for value, constexpr in zip(values, self.constexpr):
            kind = type(value)
            if kind is torch.Tensor or kind is torch.nn.Parameter:  # a Parameter is a plain tensor to Triton
                append((value.dtype, value.data_ptr() & 15 == 0))
            elif constexpr or value is None or kind is bool or kind is str:
                append(value)
            elif kind is int:
                append((value == 1, value & 15 == 0, -(2**31) <= value < 2**31, -(2**63) <= value < 2**63))
            elif kind is float:
                append(float)  # always fp32, never specialized
            elif isinstance(value, torch.Tensor):
                return None
            else:
                append(value)
        return tuple(key)


def _run_compiled(compiled, grid, values):
    """Launch a CompiledKernel Triton returned for these arguments' signature on the current
    device's stream, as JITFunction.run does after its binder (no launch-enter hook: callers take
    Triton's path then)."""
    active = driver.active
    stream = active.get_current_stream(active.get_current_device())
    compiled.run(
        grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1, stream,
        compiled.function, compiled.packed_metadata, None, knobs.runtime.launch_enter_hook,
        knobs.runtime.launch_exit_hook, *values,
    )


def forget_launches():
    """Drop every compiled kernel the eager launches keep (_EagerLaunch) and every op's plans
    (Plans), as Triton's own caches are dropped: tools.sm90 does both between its cases, so that
    each case compiles, and records, what it launches."""
    _EagerLaunch.forget()
    for plans in Plans.every:
        plans.clear()


# Plans: what an op's eager call can do once per signature of its arguments.
#
# An op's public function in eager mode (`planning()`) reads its arguments' `signature` (per tensor:
# type, shape, strides, dtype, device; per other argument: type and value; and the global switches
# its result depends on) and looks up its plan, made on the first call of that signature: the
# arguments checked, the config picked, every launch's grid and arguments bound (PreparedLaunch).
# Later calls of the signature skip all of that and allocate their outputs and launch. The cost of
# a wrong key would be silent (a check skipped, a stride reused), so the tests run with
# FASTFORMER_CHECK_PLANS=1: every call of a known signature makes its plan again and compares.
CHECK_PLANS = os.environ.get("FASTFORMER_CHECK_PLANS", "0") == "1"


def planning():
    """Whether an op call may use its plans: eager() and not compile_only() (whose launches only
    compile; an op then takes its ordinary path)."""
    return eager() and not compiling_only()


def signature(*args):
    """The facts an op's checks and launch arguments read of its arguments: a tensor's type, shape,
    strides, dtype and device (not its values or address: a PreparedLaunch checks alignment
    itself), and another argument's type and value (True and 1 differ). Unhashable if an argument
    is (a list), or is a tensor a finished functorch transform left wrapped (a dead wrapper, which
    has no storage to launch on): the op then takes its ordinary path, whose checks say what is
    wrong, and whose autograd.Function.apply unwraps a dead wrapper."""
    return tuple(
        [
            ((type(a), a.shape, a.stride(), a.dtype, a.device) if not _wrapped(a) else _UNPLANNED)
            if isinstance(a, Tensor)
            else (type(a), a)
            for a in args
        ]
    )


_wrapped = torch._C._functorch.is_functorch_wrapped_tensor
_UNPLANNED = []  # an unhashable fact: a key holding it has no plan


def needs_grad(*tensors):
    """Whether autograd must record a call on these arguments: grad mode is on and a tensor among
    them requires grad (others, None included, are skipped). Without, a plan runs with no autograd node."""
    if torch.is_grad_enabled():
        for t in tensors:
            if isinstance(t, Tensor) and t.requires_grad:
                return True
    return False


def autocast_state(t):
    """The autocast dtype in force for t's device, or None when autocast is off there."""
    device_type = "cuda" if t.is_cuda else t.device.type
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None


def allow_tf32():
    """Whether PyTorch's fp32 matmuls on CUDA may use TF32: torch.backends.cuda.matmul.fp32_precision
    is "tf32", which torch.set_float32_matmul_precision("high" or "medium"), the legacy
    `torch.backends.cuda.matmul.allow_tf32 = True` and `torch.backends.fp32_precision = "tf32"` all
    make it. Read as that attribute reads it (the same getter, without the module's attribute
    lookup: this runs on every planned call), never through the legacy allow_tf32, which raises
    once the new API has set the precision (torch 2.11 to 2.13)."""
    return torch._C._get_fp32_precision_getter("cuda", "matmul") == "tf32"


# Dynamo cannot trace the getter (a torch.* call returning no tensor): a compiled model takes its
# result as a constant, which torch.compiler.assume_constant_result marks this way (set here so that
# importing fastformer does not import torch._dynamo, 1.5 s). Dynamo's global-state guard covers the
# precision, so a compiled graph is made again when it changes (tests/test_backend.py).
allow_tf32._dynamo_marked_constant = True


def kept(cache, key, make, *args):
    """cache[key], made by make(*args) on its first use (a cache that somehow holds MAX_KEPT starts
    again); None for an unhashable key. Under CHECK_PLANS it is made again on every use and must
    equal the one kept: a key that leaves out something the made thing depends on fails there
    instead of reusing it."""
    try:
        found = cache[key]
    except KeyError:
        if len(cache) >= MAX_KEPT:
            cache.clear()
        found = cache[key] = make(*args)
        return found
    except TypeError:  # an unhashable key
        return None
    if CHECK_PLANS:
        again = make(*args)
        if again != found:
            raise AssertionError(
                f"{make.__qualname__}: what was kept for a key differs from what its use makes:\n"
                f"kept  {found!r}\nmade  {again!r}"
            )
    return found


MAX_KEPT = 1024


class Plans(dict):
    """One op's plans, by signature (its public function's key): `kept(plans, key, make, *args)` is
    the plan of `key`. `make` raises for bad arguments, as the op's checks do, and returns None
    for a signature the op runs on its ordinary path: a fallback, a cast or a copy of an input.
    An unhashable argument (a list) also gives None, so the ordinary path's checks say what is
    wrong with it."""

    every: ClassVar[list] = []  # every op's Plans, for forget_launches

    def __init__(self, op):
        super().__init__()
        self.op = op
        Plans.every.append(self)


class Plan:
    """What the ops' plans share: equality by what each was made from (its `_made()`, a tuple),
    which the check of `kept` compares; unhashable, as a plan holds the launches it keeps."""

    def __eq__(self, other):
        return type(other) is type(self) and self._made() == other._made()

    __hash__ = None

    def _made(self):
        raise NotImplementedError


class PreparedLaunch:
    """One kernel launch bound once for many calls: the kernel (a jit function, or a Configs or an
    autotuner, which pick their config per call), its grid, its keyword arguments and every
    positional argument but its pointers, as an ordinary launch `launch(kernel)[grid](*args,
    **kwargs)` would take them. `prepared(*pointers)` launches it on new pointers: the positional
    tensor (or None) arguments, in order.

    A jit kernel given every argument launches directly: the first call goes through
    `launch(kernel)` (Triton's binder) and keeps the CompiledKernel Triton picked; later calls run
    that kernel when Triton would pick the same one, its launcher given each pointer's address (see
    _binder). Triton specializes a compiled kernel on each
    pointer's dtype and 16-byte alignment (checked here on every call: an unaligned view, a None or
    another dtype takes `launch(kernel)`), on its integer arguments and constexprs (bound, so the
    same on every call), on the launch options, the debug knob and the current device (checked).
    Under the interpreter, under compile_only() and with a launch-enter hook (a profiler's) every
    call goes through `launch(kernel)`.

    A launch with TMA=True (kernels/_tma.py) readies Triton's scratch allocator first, and runs with
    TMA=False, through Triton's binder, when a tensor named in `tma_bases` (Configs' tma_bases)
    does not start on a 16-byte boundary.

    Equal when the kernel, grid and bound arguments are (Plans' check)."""

    __slots__ = (
        "bind", "compiled", "debug", "device", "direct", "grid", "kernel", "kwargs", "slots", "template", "tma",
        "tma_flag",
    )

    def __init__(self, kernel, grid, args, kwargs, tma_bases=()):
        self.kernel = kernel
        self.direct = HAS_TRITON and not INTERPRET and isinstance(kernel, triton.runtime.JITFunction)
        names = kernel.arg_names
        values = dict(zip(names, args))
        options = {}
        for name, value in kwargs.items():
            (values if name in names else options)[name] = value
        missing = [name for name in names if name not in values]
        if not missing:  # every argument in the kernel's order, the launch options as keywords
            args, kwargs = [values[name] for name in names], options
            if callable(grid):
                grid = grid(values)
            grid = (*grid, *(1,) * (3 - len(grid)))  # x, y and z
        elif self.direct:  # Triton would bind a default per call (an autotuner adds its config's)
            raise TypeError(f"{kernel}: a prepared launch of a jit kernel takes every argument; missing {missing}")
        if any(isinstance(v, torch.Tensor) for v in kwargs.values()):
            raise TypeError(f"{kernel}: a prepared launch takes its tensors as positional arguments")
        self.grid = grid
        self.kwargs = kwargs
        self.slots = tuple(i for i, v in enumerate(args) if v is None or isinstance(v, torch.Tensor))
        self.template = [None if i in self.slots else v for i, v in enumerate(args)]
        self.compiled = self.bind = self.device = self.debug = None
        # TMA: the pointers (by their place among the slots) that descriptors made in the kernel
        # read, and where the flag is, to turn it off for a call whose bases are not aligned
        self.tma = self.tma_flag = None
        if values.get("TMA"):
            bases = {list(names).index(name) for name in tma_bases}
            self.tma = tuple(j for j, i in enumerate(self.slots) if i in bases)
            self.tma_flag = None if missing else list(names).index("TMA")  # positional, else a keyword

    def __eq__(self, other):
        return isinstance(other, PreparedLaunch) and self._bound() == other._bound()

    __hash__ = None

    def _bound(self):
        grid = self.grid
        if callable(grid):  # an autotuner's, per config: its code and the values it closes over
            grid = grid.__code__, tuple(cell.cell_contents for cell in grid.__closure__ or ())
        return self.kernel, grid, self.kwargs, self.slots, self.template

    def __repr__(self):
        return f"PreparedLaunch({self.kernel}, grid={self.grid}, args={self.template}, kwargs={self.kwargs})"

    def __call__(self, *pointers):
        if self.tma is not None:
            ensure_allocator()
        bind = self.bind
        if bind is not None:  # a kept compiled kernel: launch it if Triton would pick it again
            enter = knobs.runtime.launch_enter_hook  # a HookChain, empty unless a profiler added a hook
            active = driver.active
            device = active.get_current_device()
            args = bind(*pointers)
            if (
                args is not None
                and self.device == device
                and self.debug == knobs.runtime.debug
                and not getattr(enter, "calls", enter)
                and not _compile_only.get()
            ):
                run, function, metadata = self.compiled
                stream = active.get_current_stream(device)
                run(*self.grid, stream, function, metadata, None, enter, knobs.runtime.launch_exit_hook, *args)
                return
        values = self.template.copy()
        for i, pointer in zip(self.slots, pointers):
            values[i] = pointer
        kwargs = self.kwargs
        if self.tma and not all(j >= len(pointers) or pointers[j] is None or aligned(pointers[j]) for j in self.tma):
            # a descriptor needs a 16-byte aligned base: this call loads through pointers
            if self.tma_flag is None:
                kwargs = {**kwargs, "TMA": False}
            else:
                values[self.tma_flag] = False
        compiled = launch(self.kernel)[self.grid](*values, **kwargs)
        keeps = kwargs is self.kwargs and (self.tma_flag is None or values[self.tma_flag])  # not a TMA=False call
        if self.direct and self.compiled is None and keeps and eager() and not _compile_only.get():
            # the compiled kernel's launcher, its function handle and packed metadata (loaded by this launch)
            self.compiled = compiled.run, compiled.function, compiled.packed_metadata
            self.device = driver.active.get_current_device()
            self.debug = knobs.runtime.debug
            self.bind = _binder(self.template, self.slots, _specs(pointers))


def _specs(pointers):
    """What Triton specializes a compiled kernel on per pointer: None, or its dtype and 16-byte alignment."""
    return tuple([None if p is None else (p.dtype, p.data_ptr() & 15 == 0) for p in pointers])


def _binder(template, slots, specs):
    """A PreparedLaunch's check and argument list in one generated function of its pointers: the
    kernel's arguments in order when each pointer has the spec it was compiled for (`specs`, as
    _specs gives them for the first pointers; a pointer not passed is None, as in the template),
    else None. Generated so that a launch reads each pointer once, with no loop, as Triton's own
    binder is. A tensor goes to the launcher as its address, an int: the launcher takes an int as
    it is, where for a tensor it calls data_ptr() and asks the CUDA driver what the address is
    (cuPointerGetAttribute, on every launch, for every pointer; Triton 3.6 and 3.9 alike). For
    template [None, 32, None, None] and specs ((torch.float16, True), None, (torch.float32, False)):

        def bind(p0=None, p1=None, p2=None):
            if p0 is not None and p0.dtype is d0 and p1 is None and p2 is not None and p2.dtype is d2:
                a0 = p0.data_ptr()
                a2 = p2.data_ptr()
                if not (a0) & 15 and a2 & 15:
                    return (a0, c1, None, a2)
            return None

    with d0 = torch.float16, d2 = torch.float32 and c1 = 32 bound in its globals."""
    names = [f"p{j}" for j in range(len(slots))]
    specs = (*specs, *(None,) * (len(slots) - len(specs)))
    namespace, tests, addresses, alignments, aligned = {}, [], [], [], []
    values_of = {}  # a slot's pointer name -> what the launcher takes for it
    for j, (name, spec) in enumerate(zip(names, specs)):
        if spec is None:
            tests.append(f"{name} is None")
            values_of[name] = "None"
            continue
        dtype, is_aligned = spec
        namespace[f"d{j}"] = dtype
        tests.append(f"{name} is not None and {name}.dtype is d{j}")
        addresses.append(f"        a{j} = {name}.data_ptr()\n")
        values_of[name] = f"a{j}"
        if is_aligned:
            aligned.append(f"a{j}")
        else:
            alignments.append(f"a{j} & 15")
    if aligned:
        alignments.insert(0, f"not ({' | '.join(aligned)}) & 15")
    pointer_of = dict(zip(slots, names))
    values = []
    for i, value in enumerate(template):
        if i in pointer_of:
            values.append(values_of[pointer_of[i]])
        else:
            namespace[f"c{i}"] = value
            values.append(f"c{i}")
    source = (
        f"def bind({', '.join(f'{name}=None' for name in names)}):\n"
        f"    if {' and '.join(tests) or 'True'}:\n"
        f"{''.join(addresses)}"
        f"        if {' and '.join(alignments) or 'True'}:\n"
        f"            return ({''.join(f'{v}, ' for v in values)})\n"
        "    return None\n"
    )
    exec(source, namespace)
    return namespace["bind"]


_compile_only = contextvars.ContextVar("fastformer_compile_only", default=False)


@contextlib.contextmanager
def compile_only():
    """Inside the block, every kernel launch compiles what it would run and runs nothing: the
    kernels' outputs are left as allocated (torch.empty), so what the ops return is garbage of the
    right shapes, dtypes and strides. A launch on a key the autotuner has not tuned compiles every
    config it would time, and times none. Under a triton.AsyncCompileMode the compiles are
    submitted to its executor and the launches do not wait for them (fastformer.train.warmup)."""
    token = _compile_only.set(True)
    try:
        yield
    finally:
        _compile_only.reset(token)


def compiling_only():
    """Whether launches only compile here (inside compile_only())."""
    return _compile_only.get()


class _CompileOnly:
    """launch(kernel) inside compile_only(): `[grid](...)` is Triton's warm-up call, which specializes
    and compiles the kernel for these arguments (asynchronously under AsyncCompileMode) and launches
    nothing; an autotuner's warm-up does so for each config its pruning keeps."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.kernel.warmup(*args, grid=grid, **kwargs)


def can_launch(*tensors):
    """Whether Triton can run on these tensors: CUDA tensors, or any tensors under the interpreter."""
    if not HAS_TRITON:
        return False
    return INTERPRET or all(t.is_cuda for t in tensors)


def require_launchable(op, *tensors):
    """Raise a clear error when the Triton path is forced on tensors it cannot run on (call it with
    the tensors as the kernel will see them, after autocast)."""
    if not HAS_TRITON:
        raise RuntimeError(f"{op}: the Triton path needs the `triton` package, which is not installed")
    tensors = [t for t in tensors if t is not None]
    if not can_launch(*tensors):
        raise RuntimeError(
            f"{op}: the Triton path got tensors on {tensors[0].device}; Triton compiles for CUDA only. "
            "Use the reference backend, or set TRITON_INTERPRET=1 before importing `kernels` "
            "to run the kernels through Triton's (slow) interpreter."
        )
    if _deferred_ops and not torch.compiler.is_compiling():  # launchable now, not at import (a dry run)
        register_ops()
    if any(t.dtype == torch.bfloat16 for t in tensors):
        require_interpreter_bf16(op)


def require_interpreter_bf16(op, what="bfloat16"):
    """Under the interpreter, a TypeError naming `what` unless the interpreter computes bf16 as a
    GPU does (see interpreter_computes_bf16); nothing on a GPU."""
    if INTERPRET and not interpreter_computes_bf16():
        raise TypeError(
            f"{op}: {what} is not supported under Triton's interpreter (TRITON_INTERPRET=1) as installed, "
            "which computes bf16 wrongly (its bf16 tl.dot or its fp32 -> bf16 rounding differs from a GPU's); "
            "use fp16 or fp32 there (no bf16 autocast), the reference backend, or a GPU"
        )


_interpreter_bf16_ok = None  # the probe's answer, once asked


def interpreter_computes_bf16():
    """Whether Triton's interpreter multiplies bf16 in a tl.dot and rounds fp32 to bf16 as a GPU
    does. Triton 3.6 to 3.9 as shipped do neither (numpy has no bf16: the interpreter multiplies
    the 16-bit patterns as integers and truncates the casts); fastformer's tests correct both.
    Asked once per process, at the first bf16 launch, by running _bf16_probe."""
    global _interpreter_bf16_ok
    if _interpreter_bf16_ok is None:
        _interpreter_bf16_ok = _probe_interpreter_bf16()
    return _interpreter_bf16_ok


@triton.jit
def _bf16_probe(A, B, C, X, Y, N: tl.constexpr):
    """interpreter_computes_bf16's test, run under the interpreter only (not named *_kernel: the
    sm_90a compile check takes those for kernels a launcher launches on a GPU).

    Args:
        A, B: (N, N) bf16, row-major, the dot's operands.
        C: (N, N) fp32, row-major: A @ B accumulated in fp32.
        X: (N,) fp32 values to round.
        Y: (N,) bf16: X rounded to nearest even.
        N: the side of the matrices and the length of X and Y, a power of two of at least 16 (tl.dot's minimum).
    """
    offs = tl.arange(0, N)
    tile = offs[:, None] * N + offs[None, :]
    acc = tl.zeros([N, N], dtype=tl.float32)
    acc = tl.dot(tl.load(A + tile), tl.load(B + tile), acc, out_dtype=tl.float32)
    tl.store(C + tile, acc)
    tl.store(Y + offs, tl.load(X + offs).to(tl.bfloat16))


def _probe_interpreter_bf16():
    """A 16 x 16 x 16 bf16 dot of small integers (every partial sum exact, so any order gives the
    exact product) and fp32 -> bf16 casts of a tie that rounds down to even, ties that round up to
    even and a subnormal, each compared with torch bit for bit. A question about the process, not
    part of the caller's work: it runs on the CPU outside autocast and outside any dispatch mode
    the caller is in (fake tensors while tracing, launch counters)."""
    n = 16
    with _disable_current_modes(), torch.autocast("cpu", enabled=False):
        a = (torch.arange(n * n, dtype=torch.float32).reshape(n, n) % 7 - 3).to(torch.bfloat16)
        b = (torch.arange(n * n, dtype=torch.float32).reshape(n, n) % 5 - 2).to(torch.bfloat16)
        x = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -1 - 3 * 2**-8, 1e-40], dtype=torch.float32).repeat(n // 4)
        c = torch.empty(n, n, dtype=torch.float32)
        y = torch.empty(n, dtype=torch.bfloat16)
        _bf16_probe[(1,)](a, b, c, x, y, N=n)
        rounded = x.to(torch.bfloat16)
        return torch.equal(c, a.float() @ b.float()) and torch.equal(y.view(torch.int16), rounded.view(torch.int16))


if INTERPRET:
    # Dynamo runs it as it is, on real tensors. Only the interpreter runs the probe, and
    # torch.compiler.disable imports torch._dynamo (about 1.5 s), which a process that can run no
    # kernel (a CPU without TRITON_INTERPRET: `fastformer predict`) should not pay for
    _probe_interpreter_bf16 = torch.compiler.disable(_probe_interpreter_bf16)


def autocast_inputs(*tensors):
    """Under torch.autocast, fp32 inputs cast to the autocast dtype, as matmul would see them."""
    device_type = tensors[0].device.type
    if not torch.is_autocast_enabled(device_type):
        return tensors
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(t.to(dtype) if t is not None and t.dtype == torch.float32 else t for t in tensors)


def dot_precision(dtype):
    """tl.dot's input precision: IEEE for fp32 unless the user allowed TF32 for matmuls."""
    if dtype == torch.float32 and not allow_tf32():
        return "ieee"
    return "tf32"
