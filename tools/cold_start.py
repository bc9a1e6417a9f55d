"""What the first GPU run of `fastformer train` compiles and times before it runs at speed, from a CPU.

    python -m tools.cold_start                       # the demo set and Rotten Tomatoes, +/- --pad-to-buckets
    python -m tools.cold_start --autotune            # the same with FASTFORMER_AUTOTUNE=1
    python -m tools.cold_start --quick               # a small config and a few batches (CI)
    python -m tools.cold_start --json /tmp/cold.json

Each job runs the real model of the default CUDA job (the tutorial config for the vocab trained on
the data, bf16 autocast, dropout 0.1, batch 128, length-bucketed batches) over its data as the job
loads it (fastformer.train.run.read_data, fastformer.train.job.loaders): one train step (forward and
backward, no optimizer step) per distinct batch shape of the first epoch in job order, then one
evaluation forward per distinct test batch shape. It runs under tools.sm90's dry-run sm_90a driver,
so Triton compiles real Hopper binaries and launches nothing, in a subprocess without
TRITON_INTERPRET whose TRITON_CACHE_DIR is a new empty folder; then again in a second process on
the same folder, as a second `fastformer train` on the same machine would.

Per kernel it prints: the specializations compiled (kernel code, config aside), the compiles (those
the Triton cache did not hold), the config timings a GPU would run (the autotuner's benchmarks; the
dry run compiles each config in their place), the autotune keys tuned, and the CPU seconds of the
compiles (this process and ptxas). With --pad-to-buckets (the default CUDA job's batches: it
replays its steps from CUDA graphs, fastformer.train.graphs) each batch shape is also a graph the
job captures, a train step's or an evaluation's, the first time it meets it: the table says how
many. Nothing is timed on a GPU: there is none.

Rotten Tomatoes comes from the files `fastformer data rotten-tomatoes` writes (it downloads the
archive with pip), found in --rotten-tomatoes DIR or the default cache; without them the job runs
on the 200 snippets embedded in tests/data, and the table says so.
"""

import argparse
import collections
import contextlib
import datetime
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
EMBEDDED_ROTTEN_TOMATOES = REPO / "tests" / "data" / "rotten_tomatoes_200.tsv"
BATCH_SIZE = 128  # the CUDA job's default (fastformer.train.run.DEFAULT_BATCH_SIZE)
# --quick: a model of the tutorial's shape at a fraction of its width, on the first batches
QUICK_CONFIG = {"n_layer": 1, "d_hidn": 64, "n_head": 2, "d_head": 32, "d_ff": 128, "n_enc_seq": 64, "n_dec_seq": 8}
QUICK_BATCHES = 3
COLUMNS = ("specializations", "compiles", "timings", "keys", "compile_s")


# ----------------------------------------------------------------------------------------------
# The worker: one process, one job, the counts
# ----------------------------------------------------------------------------------------------
class _Counts:
    """Counts, per kernel, what Triton compiles and what the autotuner times while it is open: it
    wraps triton.compile (before the first launch, which binds it), Autotuner._bench and
    prune_configs, and the launches of kernels with configs (kernels._configs.Configs), whose
    key arguments count in the specialization: a rule may pick two configs for one kernel code
    (attention's tiles by sequence length), never two for one launch key."""

    def __init__(self):
        from tools import sm90

        self.sm90 = sm90
        self.kernels = collections.defaultdict(lambda: dict.fromkeys(COLUMNS, 0))
        self.specializations = collections.defaultdict(set)
        self.configs = collections.defaultdict(set)  # (kernel, specialization) -> configs compiled
        self.launch_key = None  # the key arguments of the Configs launch under way

    @contextlib.contextmanager
    def counting(self):
        import triton.compiler
        from triton import knobs
        from triton.runtime.autotuner import Autotuner

        from fastformer.kernels._configs import Configs

        real = (
            triton.compiler.compile,
            Autotuner._bench,
            Autotuner.prune_configs,
            knobs.compilation.listener,
            Configs.__getitem__,
        )
        real_compile, real_bench, real_prune, _, real_getitem = real
        hits = []

        def listener(*, src, metadata, metadata_group, times, cache_hit):
            hits.append(cache_hit)

        def compile(src, target=None, options=None, **kwargs):
            start = _cpu_seconds()
            hits.clear()
            kernel = real_compile(src, target=target, options=options, **kwargs)
            name, spec, config = self._describe(src, options or {})
            counts = self.kernels[name]
            self.specializations[name].add(spec)
            if hits and not hits[-1]:
                counts["compiles"] += 1
                counts["compile_s"] += _cpu_seconds() - start
                self.configs[(name, spec)].add(config)
            return kernel

        def bench(autotuner, *args, config, **meta):
            self.kernels[_autotuned_name(autotuner, meta)]["timings"] += 1
            return real_bench(autotuner, *args, config=config, **meta)

        def prune(autotuner, kwargs):  # the autotuner asks for the configs of a key it has not tuned
            self.kernels[_autotuned_name(autotuner, kwargs)]["keys"] += 1
            return real_prune(autotuner, kwargs)

        def getitem(tuned, grid):
            run = real_getitem(tuned, grid)

            def launch(*args, **kwargs):
                named = {**dict(zip(tuned.kernel.arg_names, args)), **kwargs}
                self.launch_key = tuple(str(named[name]) for name in tuned.key)
                try:
                    return run(*args, **kwargs)
                finally:
                    self.launch_key = None

            return launch

        patched = compile, bench, prune, listener, getitem
        (
            triton.compiler.compile,
            Autotuner._bench,
            Autotuner.prune_configs,
            knobs.compilation.listener,
            Configs.__getitem__,
        ) = patched
        try:
            yield self
        finally:
            (
                triton.compiler.compile,
                Autotuner._bench,
                Autotuner.prune_configs,
                knobs.compilation.listener,
                Configs.__getitem__,
            ) = real

    def _describe(self, src, options):
        """(kernel name, its specialization with the config left out, the config)."""
        constexprs = self.sm90._constexprs(src)
        config_names = {name for (name,) in constexprs if name.startswith("BLOCK_") or name == "GROUP_M"}
        spec = (
            tuple(sorted((k, str(v)) for k, v in src.signature.items())),
            str(sorted(src.attrs.items())),
            tuple(sorted((name, str(v)) for (name,), v in constexprs.items() if name not in config_names)),
            self.launch_key,
        )
        config = tuple(sorted((name, constexprs[(name,)]) for name in config_names))
        config += (options.get("num_warps"), options.get("num_stages"))
        return self.sm90._kernel_name(src), spec, config

    def result(self):
        """{kernel: counts}."""
        for name, specs in self.specializations.items():
            self.kernels[name]["specializations"] = len(specs)
        out = {name: dict(c, compile_s=round(c["compile_s"], 2)) for name, c in sorted(self.kernels.items())}
        for name in out:
            out[name]["most_configs"] = max((len(v) for (n, _), v in self.configs.items() if n == name), default=0)
        return out


def _autotuned_name(autotuner, kwargs):
    """The kernel's name as tools.sm90 records it: with its pass for a kernel launched in passes."""
    passes = sorted(f"{k}={v}" for k, v in kwargs.items() if k.endswith("_PASS"))
    name = autotuner.base_fn.__name__
    return f"{name}({', '.join(passes)})" if passes else name


def _cpu_seconds():
    """CPU time of this process and of its finished children (ptxas)."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def _reviews(dataset, rotten_tomatoes):
    """The job's Data (train, test, classes) for `dataset`, read as fastformer.train.run reads it,
    and where it came from."""
    from fastformer.data import demo
    from fastformer.data import rotten_tomatoes as rt
    from fastformer.train.run import DEFAULTS, RUN_OPTIONS, RunOptions, read_data

    if dataset == "demo":
        files, source = {"train": demo.TRAIN_FILE, "test": demo.TEST_FILE}, "demo set"
    else:
        files = rt.split_files(rotten_tomatoes)
        source = "Rotten Tomatoes"
        if not all(os.path.isfile(path) for path in files.values()):
            files, source = (
                {"train": str(EMBEDDED_ROTTEN_TOMATOES), "test": None},
                "Rotten Tomatoes, 200 embedded snippets",
            )
    # a new run's options on these files, the defaults for the rest (seed 0, n_output from the labels' 2)
    options = RunOptions(**({name: DEFAULTS.get(name) for name in RUN_OPTIONS} | files))
    return read_data(options, None, resuming=False)[0], source


def _job_batches(dataset, pad_to_buckets, quick, rotten_tomatoes, scratch):
    """The model's config and the job's batches, one per distinct shape, as (mode, labels, enc, dec)
    with mode "train" or "eval", in the order the job meets them."""
    from fastformer.data.vocab import train_vocab
    from fastformer.train.job import loaders
    from fastformer.train.run import default_config
    from fastformer.train.runtime import Launch

    data, source = _reviews(dataset, rotten_tomatoes)
    vocab = train_vocab((r.doc for r in data.train), os.path.join(scratch, "vocab.model"), n_pieces=8000)
    config = default_config("cuda", vocab.get_piece_size(), data.n_classes)
    if quick:
        config.update(QUICK_CONFIG)
    train, test, set_epoch = loaders(
        config, vocab, data.train, data.test, BATCH_SIZE, True, 0, Launch(), pad_to_buckets
    )
    set_epoch(0)
    batches, seen = [], set()
    for mode, loader in (("train", train), ("eval", test)):
        taken = 0
        for labels, enc, dec in loader:
            shape = (mode, tuple(enc.shape), tuple(dec.shape))
            if shape not in seen:
                seen.add(shape)
                batches.append((mode, labels, enc, dec))
                taken += 1
            if quick and taken == (QUICK_BATCHES if mode == "train" else 1):
                break
    return config, batches, source


def _run_batches(model, batches):
    """A train step's forward and backward per train batch, an evaluation forward per eval batch."""
    import torch
    import torch.nn.functional as F

    import fastformer
    from tools import sm90

    with fastformer.use_backend("triton"), sm90.no_matmuls():
        for mode, labels, enc, dec in batches:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                if mode == "train":
                    model.train()
                    logits = model(enc, dec)[0]
                else:
                    model.eval()
                    with torch.no_grad():
                        logits = model(enc, dec)[0]
            if mode == "train":
                F.cross_entropy(logits.float(), labels).backward()
                model.zero_grad(set_to_none=True)


def worker(dataset, pad_to_buckets, quick, rotten_tomatoes):
    """One process of a job: its counts as a dict (printed as JSON by main)."""
    import torch

    from fastformer.model import MovieClassification
    from tools import sm90

    with tempfile.TemporaryDirectory(prefix="cold-start-") as scratch:
        config, batches, source = _job_batches(dataset, pad_to_buckets, quick, rotten_tomatoes, scratch)
    torch.manual_seed(0)
    model = MovieClassification(config)
    counts = _Counts()
    start = time.perf_counter()
    with sm90.dry_run(time_configs=True), counts.counting():
        _run_batches(model, batches)
    return {
        "source": source,
        "shapes": {"train": sum(b[0] == "train" for b in batches), "eval": sum(b[0] == "eval" for b in batches)},
        "seconds": round(time.perf_counter() - start, 1),
        "kernels": counts.result(),
    }


# ----------------------------------------------------------------------------------------------
# The driver: each job in two processes on one empty cache
# ----------------------------------------------------------------------------------------------
def run_job(dataset, pad_to_buckets, quick=False, autotune=False, rotten_tomatoes=None):
    """{"first": counts, "second": counts} of one job run twice on one new Triton cache."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9 warns when it is unset
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["FASTFORMER_AUTOTUNE"] = "1" if autotune else "0"
    cmd = [
        sys.executable,
        "-m",
        "tools.cold_start",
        "--worker",
        dataset,
        "--pad-to-buckets" if pad_to_buckets else "--no-pad-to-buckets",
    ]
    cmd += ["--quick"] if quick else []
    cmd += ["--rotten-tomatoes", rotten_tomatoes] if rotten_tomatoes else []
    result = {}
    with tempfile.TemporaryDirectory(prefix="cold-start-cache-") as cache:
        env["TRITON_CACHE_DIR"] = cache
        for run in ("first", "second"):
            proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(
                    f"cold-start worker failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-6000:]}"
                )
            result[run] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def totals(kernels):
    return {c: round(sum(k[c] for k in kernels.values()), 2) for c in COLUMNS}


def table(name, result):
    """Markdown: per kernel, the first process's counts, then both processes' totals."""
    first, second = result["first"], result["second"]
    shapes = first["shapes"]
    captures = (
        f"; the default CUDA job captures a CUDA graph of each: {shapes['train'] + shapes['eval']}"
        if "--pad-to-buckets" in name
        else ""
    )
    lines = [
        f"**{name}** ({first['source']}; {shapes['train']} train and {shapes['eval']} eval batch shapes{captures})",
        "",
        "| kernel | specializations | compiles | config timings | autotune keys | compile CPU s |",
        "|---|---|---|---|---|---|",
    ]
    for kernel, c in first["kernels"].items():
        cells = (c["specializations"], c["compiles"], c["timings"], c["keys"], f"{c['compile_s']:.1f}")
        lines.append(f"| `{kernel}` | " + " | ".join(map(str, cells)) + " |")
    for run, r in (("first process", first), ("second process", second)):
        t = totals(r["kernels"])
        cells = (t["specializations"], t["compiles"], t["timings"], t["keys"], f"{t['compile_s']:.1f}")
        lines.append(f"| **{run}** | " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


def summary_row(name, result):
    f, s = totals(result["first"]["kernels"]), totals(result["second"]["kernels"])
    return (
        f"| {name} | {f['keys']} | {f['timings']} | {f['compiles']} | {f['compile_s']:.0f} s "
        f"| {s['compiles']} | {s['timings']} |"
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small config and the first batches, demo set only")
    parser.add_argument("--autotune", action="store_true", help="run with FASTFORMER_AUTOTUNE=1")
    parser.add_argument("--datasets", nargs="+", choices=("demo", "rotten-tomatoes"), default=None)
    parser.add_argument(
        "--rotten-tomatoes", metavar="DIR", help="where `fastformer data rotten-tomatoes` wrote its files"
    )
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    parser.add_argument("--worker", metavar="DATASET", help=argparse.SUPPRESS)
    parser.add_argument(
        "--pad-to-buckets", action=argparse.BooleanOptionalAction, default=False, help=argparse.SUPPRESS
    )
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker, args.pad_to_buckets, args.quick, args.rotten_tomatoes)))
        sys.stdout.flush()
        os._exit(0)  # skip interpreter teardown: Triton's bindings report spurious leaks there
    import torch
    import triton

    datasets = args.datasets or (["demo"] if args.quick else ["demo", "rotten-tomatoes"])
    jobs = [(d, pad) for d in datasets for pad in ((False,) if args.quick else (False, True))]
    mode = "FASTFORMER_AUTOTUNE=1" if args.autotune else "default (one config per specialization)"
    print(f"# cold start, {mode}: torch {torch.__version__}, Triton {triton.__version__}, {datetime.date.today()}\n")
    results, rows = {}, []
    for dataset, pad in jobs:
        name = f"{dataset}{' --pad-to-buckets' if pad else ''}{' --quick' if args.quick else ''}"
        results[name] = run_job(dataset, pad, args.quick, args.autotune, args.rotten_tomatoes)
        print(table(name, results[name]) + "\n", flush=True)
        rows.append(summary_row(name, results[name]))
    print("| job | autotune keys | config timings | compiles | compile CPU | second process: compiles | timings |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "torch": torch.__version__,
                    "triton": triton.__version__,
                    "date": str(datetime.date.today()),
                    "mode": mode,
                    "jobs": results,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
