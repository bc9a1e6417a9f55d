"""How a kernel with several configs is launched: the rule's one config by default, autotuning on request.

A kernel whose block sizes, warps and stages are chosen per launch has a `Configs`: its jit
function, its candidates `(meta, num_warps, num_stages)` in order of preference, and its rule
`fits(meta, num_warps, num_stages, launch)`, `launch` being the launch's arguments by name. The
rule rejects what does not compile cleanly for sm_90a for the launch's flags (spills, shared
memory) and tiles the launch does not need; the sm_90a compile check holds every candidate to that.

- By default a launch runs the first candidate that fits: one compile per kernel specialization,
  no timing, as Inductor's heuristics and Liger's `calculate_settings` choose without measuring.
  The pick depends only on the autotune key's arguments, the launch's keyword flags and the
  tensors' dtypes, and is kept per those, so a launch costs a dictionary lookup. No
  triton.autotune is involved (Triton 3.6 times the one config left after pruning).
- With FASTFORMER_AUTOTUNE=1 in the environment, or `set_autotune(True)`, a launch goes through
  triton.autotune over every candidate that fits: each new key compiles and times them on the
  GPU, and the best is kept on disk (Triton's cache folder) for the next process, keyed also by
  the GPU's name (`_Autotuner`).

- Where a GPU's sweep found a variant and config faster than the rule's pick (a tuned table,
  kernels/_tuned.py), a launch it matches runs those: `tuned` says which entry, `prefers_tma`
  which variant, and `pick` takes the entry's config before the rule's order.

Under the interpreter there is one config, `interpreter_meta` with 4 warps and 1 stage, either way.
Where the candidate lists and their order come from: docs/cold-start.md.
"""

import torch

from . import _tuned
from ._backward_choice import attention_backward_choice
from ._gemm_choice import ffn_gemm_choice
from ._runtime import (
    HAS_TRITON,
    INTERPRET,
    Choice,
    PreparedLaunch,
    aligned,
    allow_tf32,
    ensure_allocator,
    launch,
    triton,
)
from ._tma import tma_choice

ENV_VAR = "FASTFORMER_AUTOTUNE"


# Whether launches autotune: set_autotune's choice, else FASTFORMER_AUTOTUNE ("1": yes; unset, ""
# or "0": no)
autotune_enabled = Choice.switch(ENV_VAR, "set_autotune", "autotune kernel configs", "pick them by rule", False)


def set_autotune(enabled):
    """Autotune kernel configs (True), pick them by each kernel's rule (False), or follow
    FASTFORMER_AUTOTUNE (None, the default). Takes effect at the next launch."""
    autotune_enabled.set(enabled)


def autotuning(enabled=True):
    """set_autotune(enabled) inside the block, and the choice in force before it after the block
    (how `fastformer train --autotune` scopes its choice to the job)."""
    return autotune_enabled.within(enabled)


def check_environment():
    """Read every environment variable the ops read on a call: FASTFORMER_AUTOTUNE, FASTFORMER_TMA,
    FASTFORMER_FFN_GEMM, FASTFORMER_ATTENTION_BACKWARD and FASTFORMER_TUNED. A value none of them
    takes raises its ValueError now, not at the first kernel launch, by which time a job has
    written its run directory (and on a machine where no kernel launches, never). A choice made in
    Python (set_tma, ...) stands for its variable, which is then not read."""
    for choice in (autotune_enabled, tma_choice, ffn_gemm_choice, attention_backward_choice, _tuned.tuned_choice):
        choice()


def switches(t):
    """What an op's plan depends on besides its arguments (kernels._runtime.signature): autotuning,
    the choice of tile loads (kernels/_tma.py), the choice of the FFN's first GEMM
    (kernels/_gemm_choice.py), the tuned table chosen (kernels/_tuned.py; the installed one follows
    from the device, which the signature holds), TF32 for fp32 products, and the autocast dtype in
    force for t's device. (autocast_state written out: this runs on every planned call.)"""
    device_type = "cuda" if t.is_cuda else t.device.type
    return (
        autotune_enabled(),
        tma_choice(),
        ffn_gemm_choice(),
        _tuned.tuned_choice(),
        allow_tf32(),
        torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None,
    )


def fp32_launch(launch, name):
    """Whether the launch's tensor argument `name` is fp32 (its products TF32 or IEEE): a rule's
    fp32 tiles hold twice the bytes of fp16/bf16 ones in registers and shared memory, so the rules
    take fewer of them there. A launch described without its tensors (a rule asked by name) is
    taken as fp16/bf16."""
    tensor = launch.get(name)
    return isinstance(tensor, torch.Tensor) and tensor.dtype == torch.float32


def gemm_tile_warps(meta):
    """The GEMM tile rule of every matrix-product kernel here: an output tile of 128 x 128 or more
    takes 8 warps (two warp groups, each a 64-row wgmma), a smaller one 4 (one warp group). Fewer
    warps for a large tile spill its fp32 accumulator on sm_90a; more for a small one idle."""
    return 8 if meta["BLOCK_M"] * meta["BLOCK_N"] >= 128 * 128 else 4


def device_name():
    """The name of the GPU the launches go to, as the active Triton driver's torch device module
    gives it ("NVIDIA H100 80GB HBM3")."""
    from triton.runtime.driver import driver

    active = driver.active
    return active.get_device_interface().get_device_name(active.get_current_device())


if HAS_TRITON:  # without Triton nothing launches

    class _Autotuner(triton.runtime.Autotuner):
        """triton.autotune whose results go to disk (cache_results) and are read back only on the GPU
        model that timed them. Triton's own disk key holds its version, the target (sm_90 for an
        H100 and an H200 alike), the kernel's source and the jit functions it calls, the environment
        variables that change compiles, the tuning key and the configs kept; this adds the GPU's
        name to the tuning key. `self.cache` stays keyed as `run` reads it."""

        def check_disk_cache(self, tuning_key, configs, bench_fn):
            on_this_gpu = (*tuning_key, device_name())
            found = super().check_disk_cache(on_this_gpu, configs, bench_fn)
            if on_this_gpu in self.cache:  # read from disk: moved to the key run() looks up
                self.cache[tuning_key] = self.cache.pop(on_this_gpu)
            return found


def _pruner(name, fits):
    """triton.autotune's early_config_prune for `fits`: the configs that fit the launch."""

    def prune(configs, named_args, **kwargs):
        launch_args = {**named_args, **kwargs}
        kept = [c for c in configs if fits(c.kwargs, c.num_warps, c.num_stages, launch_args)]
        if not kept:
            raise RuntimeError(f"{name}: no config fits the launch ({_flags(launch_args)}); this is a bug in kernels/")
        return kept

    return prune


def _flags(launch_args):
    return ", ".join(f"{k}={v}" for k, v in sorted(launch_args.items()) if k.isupper() and not hasattr(v, "dtype"))


def _fits_always(meta, num_warps, num_stages, launch_args):
    return True


class Configs:
    """A jit kernel and its configs. `Configs(...)[grid](*args, **kwargs)` launches it as
    `launch(kernel)[grid]` does, with the rule's config or, when autotuning, the autotuner's.

    Args:
        kernel: the @triton.jit function.
        name: what errors call it ("attention forward").
        candidates: [(meta, num_warps, num_stages)], best first: meta is the dict of the config's
            constexprs (BLOCK_M, ...).
        key: the kernel arguments whose values select a config (triton.autotune's key); the rule
            may read only these, the launch's constexprs and the tensors' dtypes.
        fits: fits(meta, num_warps, num_stages, launch) -> bool, the rule; every launch must have
            a candidate that fits (the test of each op file holds it to that).
        interpreter_meta: the one config's meta under the interpreter.
        tma_bases: the names of the tensor arguments a launch with TMA=True reads through tensor
            descriptors (kernels/_tma.py): a launch whose one of them does not start on a 16-byte
            boundary runs with TMA=False, through pointers.
        reset_to_zero: the names of the tensor arguments a launch adds into (atomics): zeroed
            before each config the autotuner times, and once more before the launch it then runs.
    """

    def __init__(
        self, kernel, name, candidates, key, fits=_fits_always, *, interpreter_meta, tma_bases=(), reset_to_zero=()
    ):
        self.kernel = kernel
        self.name = name
        self.candidates = [(dict(meta), num_warps, num_stages) for meta, num_warps, num_stages in candidates]
        self.key = list(key)
        self.key_index = [kernel.arg_names.index(name) for name in self.key] if HAS_TRITON else []
        self.fits = fits
        self.interpreter_meta = dict(interpreter_meta)
        self.tma_bases = tuple(tma_bases)
        self.tma_index = [kernel.arg_names.index(name) for name in self.tma_bases] if HAS_TRITON else []
        self.picks = {}  # key values and dtypes -> the rule's candidate
        self.autotuner = None
        if HAS_TRITON:
            tried = [(self.interpreter_meta, 4, 1)] if INTERPRET else self.candidates
            self.autotuner = _Autotuner(
                kernel, kernel.arg_names, [triton.Config(meta, num_warps=w, num_stages=s) for meta, w, s in tried],
                self.key, list(reset_to_zero) or None, None,
                prune_configs_by=None if INTERPRET else {"early_config_prune": _pruner(name, fits)},
                cache_results=True,
            )

    def pick(self, args, kwargs):
        """The (meta, num_warps, num_stages) for a launch's positional and keyword arguments: the
        tuned table's entry for it in its variant (`tuned`), else the rule's first fit; kept per
        value of the key's arguments, the tensors' dtypes, the keywords (flags) and the table in
        force: the arguments by name are built only on a new key."""
        if INTERPRET:
            return self.interpreter_meta, 4, 1
        n = len(args)
        keyed = tuple(args[i] if i < n else kwargs[name] for name, i in zip(self.key, self.key_index))
        dtypes = tuple(a.dtype for a in args if isinstance(a, torch.Tensor))
        named = tuple((k, v.dtype if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items())
        table = _tuned.in_force()
        key = (keyed, dtypes, named, table)
        try:
            return self.picks[key]
        except KeyError:
            pass
        except TypeError:  # a symbolic size while torch.compile traces: no memo, no table
            return self._first_fit({**dict(zip(self.kernel.arg_names, args)), **kwargs})
        self.picks[key] = self._tuned_or_first_fit(args, kwargs, table)
        return self.picks[key]

    def tuned(self, args, kwargs, table=None):
        """The tuned table's entry (kernels/_tuned.py) for a launch given its arguments, with or
        without its TMA flag (the entry's variant sets it), or None: none in force, no entry
        near the launch's key, or an entry whose config this kernel's rule does not let the launch
        run in the entry's variant. `table`: the one in force, where the caller has it."""
        if INTERPRET or autotune_enabled():
            return None
        if table is None:
            table = _tuned.in_force()
        if table is None or not table.by_kernel.get(self.name):  # no table, or none of this kernel's launches
            return None
        named = {**dict(zip(self.kernel.arg_names, args)), **kwargs}
        key = {name: named[name] for name in self.key if name != "TMA"}
        if not all(type(v) in (int, bool, str) for v in key.values()):  # symbolic while tracing
            return None
        dtype = next((str(a.dtype) for a in args if isinstance(a, torch.Tensor)), None)
        entry = table.entry(self.name, key, dtype)
        if entry is None or entry.config is None:
            return entry
        meta, num_warps, num_stages = entry.config
        in_variant = {**named, "TMA": entry.variant == "tma"}
        if entry.config not in self.candidates or not self.fits(meta, num_warps, num_stages, in_variant):
            return None
        return entry

    def prefers_tma(self, args, kwargs, rule):
        """Whether a launch (its arguments without TMA) would load tiles through descriptors: as
        its tuned entry's variant says, else as the kernel's `rule` (its module's PREFERS_TMA).
        kernels._tma.use_tma then says whether TMA can serve."""
        entry = self.tuned(args, kwargs)
        return rule if entry is None else entry.variant == "tma"

    def _tuned_or_first_fit(self, args, kwargs, table):
        entry = self.tuned(args, kwargs, table)
        if entry is not None and entry.variant == ("tma" if kwargs.get("TMA") else "pointer"):
            return entry.config
        return self._first_fit({**dict(zip(self.kernel.arg_names, args)), **kwargs})

    def _first_fit(self, launch_args):
        for meta, num_warps, num_stages in self.candidates:
            if self.fits(meta, num_warps, num_stages, launch_args):
                return meta, num_warps, num_stages
        raise RuntimeError(f"{self.name}: no config fits the launch ({_flags(launch_args)}); this is a bug in kernels/")

    def prepare(self, grid, args, kwargs):
        """The PreparedLaunch of `self[grid](*args, **kwargs)`: the rule's config, or the autotuner
        (which picks one per call) while autotuning."""
        if autotune_enabled():
            return PreparedLaunch(self.autotuner, grid, args, kwargs, tma_bases=self.tma_bases)
        meta, num_warps, num_stages = self.pick(args, kwargs)
        options = {"num_warps": num_warps, "num_stages": num_stages}
        return PreparedLaunch(self.kernel, grid, args, {**kwargs, **meta, **options}, tma_bases=self.tma_bases)

    def _tma_checked(self, args, kwargs):
        """kwargs of a launch with TMA=True: as they are, Triton's scratch allocator made ready, when
        every tensor named in tma_bases starts on a 16-byte boundary; else with TMA=False."""
        n = len(args)
        for name, i in zip(self.tma_bases, self.tma_index):
            t = args[i] if i < n else kwargs.get(name)
            if t is not None and not aligned(t):
                return {**kwargs, "TMA": False}
        ensure_allocator()  # descriptors made in the kernel take their bytes from it
        return kwargs

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            if kwargs.get("TMA"):
                kwargs = self._tma_checked(args, kwargs)
            if autotune_enabled():
                return launch(self.autotuner)[grid](*args, **kwargs)
            meta, num_warps, num_stages = self.pick(args, kwargs)
            return launch(self.kernel)[grid](*args, **kwargs, **meta, num_warps=num_warps, num_stages=num_stages)

        return run

    def __repr__(self):
        return f"Configs({self.name!r}, {len(self.candidates)} candidates)"
