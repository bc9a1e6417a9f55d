"""Compile the Triton kernels for Hopper (sm_90a) on a machine with no GPU, and read what came out.

How: a dry-run CUDA driver becomes Triton's active driver. Its target is sm_90a, its device,
stream and module calls return dummies, and its launcher launches nothing. The project's real
launchers (`_attn_forward`, `_linear_gelu_forward`, ...) are then called with CPU tensors laid out
as the model lays them out (fused-QKV views, Conv1d weight views), so Triton's JIT specializes each
kernel from real arguments: 16-byte alignment of pointers and divisibility of integers by 16, as a
launch on a GPU would. (Compiled without that specialization nothing pipelines, and the check
would lie.) A case runs with autotuning on (FASTFORMER_AUTOTUNE=1, `Case.autotune`) and the
autotuner's benchmarker compiles each config instead of timing it, so every config a launch can
select is compiled; or, as a GPU run does by default, with each launch's rule picking one.

Each compile is recorded (`Record`; a kernel launched in passes, per pass): the config, the
shared memory, registers and spills that ptxas reports (`ptxas -v`), the ptxas warnings (wgmma
serialization), whether every dot became a Hopper `wgmma` (TTGIR `ttng.warp_group_dot`, PTX
`wgmma.mma_async`) and whether every loop that holds a dot is software-pipelined (its loads are
async copies into multi-buffered shared memory).
`problems(record)` says which of the rules a record breaks; the test and the report share it.

What this cannot see: run-time faults (illegal addresses, races), numerics (the interpreter tests
check those on a CPU, bf16 through tests/interpreter_bf16.py), occupancy and timing. The `cuda` tests
and the benchmarks cover those on a GPU.

The kernels must be imported without TRITON_INTERPRET (the interpreter replaces `triton.jit`
and the autotune lists at import time), so `compile_cases` (a `Compilation`) runs the work in fresh subprocesses;
`python -m tools.sm90 --worker` is that subprocess.
"""

import argparse
import contextlib
import dataclasses
import importlib
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

MAX_SHARED_SM90 = 232_448  # bytes of shared memory one block may use on sm_90 (227 KiB)
REPO = Path(__file__).resolve().parent.parent


@dataclasses.dataclass
class Case:
    """One call of a project launcher: `run()` builds CPU tensors and launches (dry)."""

    name: str
    run: Callable[[], object]
    dtype: str = ""
    # True: the kernels autotune (FASTFORMER_AUTOTUNE=1), so every config a launch's rule keeps is
    # compiled; False: each launch runs its rule's pick, as a GPU run does by default
    autotune: bool = True


@dataclasses.dataclass
class Record:
    """One compiled (kernel, config) as seen in one case."""

    case: str
    kernel: str  # the jit function's name, with its pass where it has passes (_kernel_name)
    config: str  # "BLOCK_M=64 BLOCK_N=64 w4 s3"
    num_stages: int
    dtype: str
    error: str | None = None
    shared: int = 0
    registers: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    dots: int = 0  # dots in the TTGIR
    wgmma_dots: int = 0  # of which Hopper warp-group MMAs (wgmma)
    ptx_wgmma: bool = False  # wgmma.mma_async in the PTX
    dot_loops: int = 0  # innermost loops holding a dot
    pipelined_dot_loops: int = 0  # of which load no dot operand synchronously
    outer_dot_loops: int = 0  # loops holding a dot and another loop (not pipelined by Triton)
    warnings: list[str] = dataclasses.field(default_factory=list)
    seconds: float = 0.0


def problems(record: Record) -> list[str]:
    """The rules a compiled kernel must meet on sm_90a, as failure messages (empty: all met)."""
    if record.error:
        return [f"does not compile: {record.error}"]
    found = []
    if record.shared > MAX_SHARED_SM90:
        found.append(f"shared memory {record.shared:,} B > {MAX_SHARED_SM90:,} B")
    if record.spill_stores or record.spill_loads:
        found.append(f"register spills: {record.spill_stores} B stores, {record.spill_loads} B loads")
    if record.dtype in ("float16", "bfloat16") and record.wgmma_dots < record.dots:
        found.append(f"{record.dots - record.wgmma_dots} of {record.dots} dots are not wgmma (mma.sync or FMA)")
    if record.dtype in ("float16", "bfloat16") and record.dots and not record.ptx_wgmma:
        found.append("no wgmma.mma_async in the PTX")
    if record.num_stages >= 2 and record.pipelined_dot_loops < record.dot_loops:
        found.append(f"{record.dot_loops - record.pipelined_dot_loops} of {record.dot_loops} dot loops not pipelined")
    return found


# ----------------------------------------------------------------------------------------------
# Reading a compiled kernel: ptxas -v, TTGIR, PTX
# ----------------------------------------------------------------------------------------------
_PTXAS_USAGE = re.compile(r"Used (\d+) registers")
_PTXAS_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_OP = re.compile(r"^\s*(%[\w.]+)(?::\d+)? = ([\w.]+) ([^:]*)")
_VALUE = re.compile(r"%[\w.]+")
_DOTS = ("tt.dot", "ttng.warp_group_dot")
_PASS_THROUGH = ("ttg.convert_layout", "tt.trans", "ttg.memdesc_trans")


def read_ptxas_log(log: str) -> dict[str, object]:
    registers = [int(m) for m in _PTXAS_USAGE.findall(log)]
    spills = [(int(stores), int(loads)) for stores, loads in _PTXAS_SPILLS.findall(log)]
    notes = {
        line.split(":", 1)[-1].strip() for line in log.splitlines() if "warning" in line or "Performance Loss" in line
    }
    return {
        "registers": max(registers, default=0),
        "spill_stores": max((s for s, _ in spills), default=0),
        "spill_loads": max((loads for _, loads in spills), default=0),
        "warnings": sorted(notes),
    }


def read_ttgir(ttgir: str) -> dict[str, int]:
    """Dots, how many are wgmma, and the innermost loops (scf.for) that hold a dot and whether they
    are pipelined: no dot operand of the loop is loaded synchronously (a `tt.load` whose value goes
    into a dot or into shared memory for one, instead of an async copy into a multi-buffer; or a
    tensor-descriptor load that Triton did not pipeline, which it lowers to a TMA copy into a buffer
    and a barrier made, waited on and dropped within each iteration: a `ttng.init_barrier` in the
    loop, where a pipelined one indexes barriers made before it).
    Triton's software pipeliner handles innermost loops only; a loop around another loop is
    counted apart (outer_dot_loops), and its limits belong in the kernel's docstring."""
    dots = wgmma = 0
    # stack of {"depth", "dot", "inner": holds a loop, "loaded": tt.load values, "sync": synchronous operand loads}
    loops = []
    finished = []
    depth = 0
    for line in ttgir.splitlines():
        code = line.split(" loc(")[0]
        op = _OP.match(code)
        name, kind, operands = (op.group(1), op.group(2), _VALUE.findall(op.group(3))) if op else (None, None, [])
        if code.lstrip().startswith("scf.for "):  # a loop without results
            kind = "scf.for"
        if code.lstrip().startswith("ttng.init_barrier "):  # no result either
            kind = "ttng.init_barrier"
        if loops:
            loop = loops[-1]
            if kind == "ttng.init_barrier":  # an unpipelined TMA load's own barrier
                loop["sync"] += 1
            if kind in _DOTS:
                loop["dot"] = True
            if kind == "tt.load" or (kind in _PASS_THROUGH and operands and operands[0] in loop["loaded"]):
                loop["loaded"].add(name)
            elif (kind in _DOTS and any(v in loop["loaded"] for v in operands[:2])) or (
                kind == "ttg.local_alloc" and operands and operands[0] in loop["loaded"]
            ):
                loop["sync"] += 1
        if kind in _DOTS:
            dots += 1
            wgmma += kind == "ttng.warp_group_dot"
        depth += code.count("{") - code.count("}")
        if kind == "scf.for":
            if loops:
                loops[-1]["inner"] = True
            loops.append({"depth": depth, "dot": False, "inner": False, "loaded": set(), "sync": 0})
        while loops and depth < loops[-1]["depth"]:
            finished.append(loops.pop())
    dot_loops = [loop for loop in finished if loop["dot"] and not loop["inner"]]
    return {
        "dots": dots,
        "wgmma_dots": wgmma,
        "dot_loops": len(dot_loops),
        "pipelined_dot_loops": sum(loop["sync"] == 0 for loop in dot_loops),
        "outer_dot_loops": sum(loop["dot"] and loop["inner"] for loop in finished),
    }


# ----------------------------------------------------------------------------------------------
# The dry-run driver
# ----------------------------------------------------------------------------------------------
DEVICE_NAME = "dry-run sm_90a (no GPU)"  # what the dry-run driver calls its device


def _dry_run_driver(time_configs=True):
    """A Triton driver for an sm_90a GPU that is not there (Triton 3.6 to 3.9's driver interface).
    time_configs: the autotuner's benchmarker compiles every config it would time on a GPU;
    False: it compiles none, so a launch compiles only the config the autotuner picks (the first kept)."""
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.backends.driver import DriverBase

    class _Utils:
        def get_device_properties(self, device):
            # max_shared_mem far above the real limit: a kernel over the real one must still "load",
            # so the check reports its size instead of the autotuner silently dropping it
            return {"max_shared_mem": 1 << 30, "multiprocessor_count": 132, "max_num_regs": 65536, "warpSize": 32}

        def load_binary(self, name, kernel, shared, device):
            return 0, 0, 0, 0, 1024  # module, function, registers, spills, max threads

        def unload_module(self, module):
            pass

    class _Device:
        """The torch device module of the driver: torch.cpu's, and the name of the device."""

        def __getattr__(self, name):
            return getattr(torch.cpu, name)

        def get_device_name(self, device=None):
            return DEVICE_NAME

    class _NoLaunch:
        """A compiled kernel's launcher that launches nothing; the last one called is
        `_NoLaunch.last`, and the kernel's arguments it was given (after the grid, the stream, the
        function, the metadata and the hooks) `_NoLaunch.last_args`: tests ask which compiled
        kernel a launch ran, and with what."""

        last = None
        last_args = None

        def __init__(self, src, metadata):
            pass

        def __call__(self, *args, **kwargs):
            _NoLaunch.last = self
            _NoLaunch.last_args = args[9:]  # gridX, gridY, gridZ, stream, function, metadata, launch metadata, hooks

    class DryRunDriver(DriverBase):
        def __init__(self):
            self.utils = _Utils()
            self.launcher_cls = _NoLaunch

        @classmethod
        def is_active(cls):
            return False

        def map_python_to_cpp_type(self, ty):
            from triton.backends.nvidia.driver import ty_to_cpp

            return ty_to_cpp(ty)

        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_current_device(self):
            return 0

        def set_current_device(self, device):
            pass

        def get_current_stream(self, device=None):
            return 0

        def get_device_capability(self, device=None):
            return (9, 0)

        def get_active_torch_device(self):
            return torch.device("cpu")

        def get_device_interface(self):
            return _Device()

        def get_benchmarker(self):
            return _compile_instead_of_timing if time_configs else _time_nothing

    return DryRunDriver()


def _compile_instead_of_timing(kernel_call, quantiles=None, **kwargs):
    """The autotuner's benchmarker: compile the config (by calling it) and report a dummy time.
    A config that fails is recorded by the compile hook and ranked last, so the others still run."""
    try:
        kernel_call()
    except Exception:  # noqa: BLE001  (recorded by _Recorder; the autotuner must go on)
        return [float("inf")] * 3
    return [1.0] * 3


def _time_nothing(kernel_call, quantiles=None, **kwargs):
    """The autotuner's benchmarker when configs are not compiled ahead: every config ties."""
    return [1.0] * 3


@contextlib.contextmanager
def dry_run(time_configs=True):
    """Inside the block the dry-run sm_90a driver is Triton's active driver (see _dry_run_driver),
    and fastformer's ops take the Triton path on CPU tensors, as they would on CUDA ones, so whole
    models can run "on the GPU" here. Both are restored after (no real driver can be active: there
    is no GPU)."""
    from fastformer.environment import interpreter_requested

    if interpreter_requested():
        raise RuntimeError("tools.sm90 compiles for a GPU: run it without TRITON_INTERPRET=1")
    from triton.runtime.driver import driver

    from fastformer.kernels import _runtime

    _runtime.register_ops()  # deferred in a process that could run no kernel: ops for the traces to see
    previous = getattr(driver, "_active", None), _runtime.can_launch
    driver.set_active(_dry_run_driver(time_configs))
    _runtime.can_launch = lambda *tensors: True
    try:
        yield
    finally:
        driver._active, _runtime.can_launch = previous


def no_matmuls():
    """A dispatch mode under which PyTorch's matrix products (the projections and the second FFN
    GEMM, forward and backward) return uncomputed tensors with the shape, dtype and strides the
    product would have (found on the meta device). Beside dry_run: its kernels launch nothing, so
    no value in the model is right anyway, and no value changes what Triton compiles or what a
    step allocates; computed, the CPU's bf16 products would take minutes a batch at the tutorial's
    widths (tools.cold_start). A dispatch mode sends fastformer's ops down their ordinary paths, not
    their plans."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_map

    aten = torch.ops.aten
    products = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default}

    def on_meta(value):
        return value.to("meta") if isinstance(value, torch.Tensor) else value

    class NoMatmuls(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func not in products:
                return func(*args, **kwargs)
            out = func(*tree_map(on_meta, args), **tree_map(on_meta, kwargs))
            return torch.empty_strided(out.shape, out.stride(), dtype=out.dtype, device=args[0].device)

    return NoMatmuls()


class _Recorder:
    """Wraps triton.compile: captures each compile's ptxas log and reads the result. A compile is
    done once per process (memoized by its specialization), and attributed to every case using it."""

    def __init__(self):
        import triton.compiler

        self.compiler = triton.compiler
        self.real_compile = triton.compiler.compile
        self.memo = {}  # specialization -> (kernel or exception, facts)
        self.records: list[Record] = []
        self.case: Case | None = None
        self.seen = set()

    def __enter__(self):
        self.compiler.compile = self.compile
        return self

    def __exit__(self, *exc):
        self.compiler.compile = self.real_compile

    def compile(self, src, target=None, options=None, **kwargs):
        key = (src.hash(), json.dumps(options, sort_keys=True, default=str))
        if key not in self.memo:
            self.memo[key] = self._compile(src, target, options, kwargs)
        kernel, facts = self.memo[key]
        self._record(src, options, facts)
        if isinstance(kernel, BaseException):
            raise kernel
        return kernel

    def _compile(self, src, target, options, kwargs):
        from triton import knobs

        log = io.StringIO()
        start = time.perf_counter()
        knobs.nvidia.dump_ptxas_log = True  # ptxas -v's report goes to stdout
        try:
            with contextlib.redirect_stdout(log):
                kernel = self.real_compile(src, target=target, options=options, **kwargs)
        except Exception as error:  # noqa: BLE001  (a failed compile is a result)
            return error, {"error": _summary(error)}
        facts = {"shared": kernel.metadata.shared, "seconds": time.perf_counter() - start}
        facts.update(read_ptxas_log(log.getvalue()))
        facts.update(read_ttgir(kernel.asm["ttgir"]))
        facts["ptx_wgmma"] = "wgmma.mma_async" in kernel.asm["ptx"]
        return kernel, facts

    def _record(self, src, options, facts):
        config, num_stages = config_of(src, options)
        kernel = _kernel_name(src)
        ident = (self.case.name, kernel, config)
        if ident in self.seen:
            return
        self.seen.add(ident)
        self.records.append(
            Record(
                case=self.case.name, kernel=kernel, config=config, num_stages=num_stages, dtype=self.case.dtype, **facts
            )
        )


def _summary(error):
    """One line for a failed compile: the compiler's own message, without the source excerpt."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip().strip("^~").strip()]
    message = next((line for line in reversed(lines) if "rror" in line or "annot" in line), lines[-1] if lines else "")
    return f"{type(error).__name__}: {message}"[:400]


def config_of(src, options):
    """("BLOCK_M=64 BLOCK_N=64 w4 s3", num_stages) of a compile: its block constexprs, warps and
    stages, and " tma" where its tiles load through tensor descriptors (TMA=True, kernels/_tma.py)."""
    constexprs = _constexprs(src)
    meta = {name: value for (name,), value in constexprs.items() if name.startswith("BLOCK_") or name == "GROUP_M"}
    num_stages = (options or {}).get("num_stages", 3)
    config = " ".join(f"{k}={v}" for k, v in sorted(meta.items()))
    config += f" w{(options or {}).get('num_warps', 4)} s{num_stages}"
    return config + (" tma" if constexprs.get(("TMA",)) else ""), num_stages


def _constexprs(src):
    """{(name,): value} of an ASTSource's constexpr arguments, by name."""
    names = src.fn.arg_names
    return {(names[path[0]],): value for path, value in src.constants.items() if len(path) == 1}


def _kernel_name(src):
    """The compiled kernel's name in the records: its jit function's, and for one jit function
    launched in passes, whose constexpr named `*_PASS` picks each pass's code (attention's
    backward: DQ_PASS), also the pass, `_attn_bwd_kernel(DQ_PASS=True)`. Each pass is a kernel of
    its own to the rules, the report and the test, as it was when the passes were two functions."""
    passes = sorted(f"{name}={value}" for (name,), value in _constexprs(src).items() if name.endswith("_PASS"))
    return f"{src.name}({', '.join(passes)})" if passes else src.name


def _reset_jit_caches(module_names):
    """Forget compiled kernels and autotuning results, and keep none on disk, so the next case goes
    through compile() for every config again (the recorder's memo keeps that cheap)."""
    import triton

    from fastformer.kernels._configs import Configs
    from fastformer.kernels._runtime import forget_launches

    forget_launches()  # the compiled kernels eager launches and plans keep: each case compiles (and records) anew
    for module_name in module_names:
        module = sys.modules[module_name]
        for value in vars(module).values():
            fn = value.autotuner if isinstance(value, Configs) else value
            while fn is not None:
                if isinstance(fn, triton.runtime.Autotuner):
                    fn.cache.clear()
                    fn.cache_results = False
                if isinstance(fn, triton.runtime.JITFunction):
                    fn.device_caches.clear()
                    break
                fn = getattr(fn, "fn", None)


def run_cases(cases: list[Case], modules=("fastformer.kernels",)) -> list[Record]:
    """Compile what each case launches for sm_90a, in this process (which must not have imported
    the kernels under TRITON_INTERPRET). Returns one Record per (case, kernel, config); a case that
    fails outside compilation gives a Record with kernel "<launch>"."""
    from fastformer.kernels import set_autotune

    kernel_modules = [name for name in sys.modules if any(name == m or name.startswith(m + ".") for m in modules)]
    with dry_run(), _Recorder() as recorder:
        for case in cases:
            recorder.case = case
            _reset_jit_caches(kernel_modules)
            set_autotune(case.autotune)
            try:
                case.run()
            except Exception as error:  # noqa: BLE001
                if not any(r.case == case.name and r.error for r in recorder.records):
                    recorder.records.append(
                        Record(
                            case=case.name,
                            kernel="<launch>",
                            config="",
                            num_stages=0,
                            dtype=case.dtype,
                            error=f"{type(error).__name__}: {error}"[:400],
                        )
                    )
                    traceback.print_exc()
            finally:
                set_autotune(None)
    return recorder.records


# ----------------------------------------------------------------------------------------------
# Running the matrix in subprocesses
# ----------------------------------------------------------------------------------------------
def compile_cases(source: str, names: list[str] | None = None, jobs: int = 2, timeout: float = 1800) -> list[Record]:
    """Compile the cases that `source` ("module:function" returning a list of Case) names, in
    `jobs` fresh subprocesses without TRITON_INTERPRET, each with its own empty Triton cache (so
    every compile runs ptxas, whose report is read). Returns all their Records."""
    return Compilation(source, names, jobs).records(timeout)


class Compilation:
    """compile_cases begun: the workers start at construction and compile while the caller does
    other work; `records()` waits for them, `cancel()` stops them. Either removes the workers'
    folder. `nice`: the workers' niceness until `records()` is called, when it is set back to this
    process's (where the system lets it): begun early at nice 19 (tests/sm90_early.py), they take
    only a core nothing else wants (CI's rehearsal of 2026-12-04 took 35 minutes, 54 before). Begun
    early at the default niceness, they made the rehearsal of 2026-12-03 slower, 56 minutes to 54:
    they took cores from the newest lane's test process, the run's critical path; docs/testing.md."""

    def __init__(self, source: str, names: list[str] | None = None, jobs: int = 2, nice: int = 0):
        all_names = names if names is not None else [case.name for case in _load(source)()]
        shards = [shard for shard in _shards(all_names, jobs) if shard]
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9 warns when it is unset
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        self._folder = tempfile.TemporaryDirectory(prefix="sm90-")
        tmp = Path(self._folder.name)
        self._workers = []  # (process, its records file, its log)
        self._nice = nice
        begin = (lambda: os.nice(nice)) if nice else None
        for i, shard in enumerate(shards):
            out = tmp / f"shard{i}.json"
            shard_env = dict(env, TRITON_CACHE_DIR=str(tmp / f"cache{i}"))
            cmd = [sys.executable, "-m", "tools.sm90", "--worker", source, "--out", str(out), "--cases", *shard]
            log = open(tmp / f"shard{i}.log", "w")  # noqa: SIM115 (closed once its worker exits)
            process = subprocess.Popen(
                cmd, env=shard_env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, preexec_fn=begin
            )
            self._workers.append((process, out, log))

    def records(self, timeout: float = 1800) -> list[Record]:
        """Every worker's Records, once all have exited (a worker still running at `timeout`
        seconds from this call is killed, and fails it like a worker that failed)."""
        deadline = time.monotonic() + timeout
        self._hurry()
        try:
            records = []
            for process, out, log in self._workers:
                try:
                    process.wait(timeout=max(1.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
                log.close()
                if process.returncode != 0 or not out.exists():
                    text = Path(log.name).read_text()[-4000:]
                    raise RuntimeError(f"sm90 compile worker failed (exit {process.returncode}):\n{text}")
                records += [Record(**r) for r in json.loads(out.read_text())]
            return records
        finally:
            self.cancel()

    def _hurry(self):
        """The workers waited for now: back to this process's niceness, they and the compilers they
        start from now on (raising a priority takes root's right, CAP_SYS_NICE: without it they
        stay as they began)."""
        if not self._nice:
            return
        ours = os.getpriority(os.PRIO_PROCESS, 0)
        for process, _, _ in self._workers:
            with contextlib.suppress(PermissionError, ProcessLookupError):
                os.setpriority(os.PRIO_PROCESS, process.pid, ours)

    def cancel(self):
        """Stop the workers still running and remove their folder; safe to call again."""
        for process, _, log in self._workers:
            if process.poll() is None:
                process.kill()
                process.wait()
            log.close()
        self._folder.cleanup()


def _shards(names, jobs):
    """The case names in `jobs` shards, a family at a time in turn: the cases of one family (the
    parts of a name before its shapes and layout, "attention/fp16/d64/causal"; the model's cases
    are one) compile mostly the same kernels, which a worker compiles once (its recorder's memo), so
    a family split between workers would be compiled twice. On the CI matrix: 795 distinct compiles,
    the busier of two workers had 890 s of them by case in turn, 806 s by family (compile seconds on
    this CPU, 2026-12-02)."""
    families = {}
    for name in names:
        parts = name.split("/")
        families.setdefault("model" if parts[0] == "model" else "/".join(parts[:4]), []).append(name)
    shards = [[] for _ in range(jobs)]
    for i, family in enumerate(families.values()):
        shards[i % jobs] += family
    return shards


def _load(source: str):
    module, function = source.split(":")
    return getattr(importlib.import_module(module), function)


def _worker(argv=None):
    parser = argparse.ArgumentParser(description="internal: compile some cases for sm_90a and write their records")
    parser.add_argument("--worker", required=True, metavar="MODULE:FUNCTION")
    parser.add_argument("--out", required=True)
    parser.add_argument("--cases", nargs="+", required=True)
    args = parser.parse_args(argv)
    wanted = set(args.cases)
    cases = [case for case in _load(args.worker)() if case.name in wanted]
    records = run_cases(cases, modules=("fastformer.kernels", args.worker.split(":")[0]))
    Path(args.out).write_text(json.dumps([dataclasses.asdict(r) for r in records]))
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown: Triton's bindings report spurious leaks there


if __name__ == "__main__":
    _worker()
