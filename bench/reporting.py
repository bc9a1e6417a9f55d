"""Run the benchmark cases outside pytest and write the results.

    python -m bench.report                     # on CUDA: the full suite
    python -m bench.report --filter attention_fwd-   # only cases whose id contains this
    python -m bench.report --targets           # only the cases the performance targets are judged on
    python -m bench.report --smoke --out /tmp/r # tiny shapes on a CPU: checks the report's code paths
    python -m bench.report --update-readme      # also splice the markdown table into README.md
    python -m bench.report --from r.json --update-readme   # render saved results (no GPU needed)

Writes into --out (default bench/results/):
    <gpu>.json   {"env": {gpu, torch, triton, cuda, date, bf16_gemm_tflops},
                  "results": [a record per case: bench.common.RECORD_KEYS, and mfu],
                  "skipped": [{bench, provider, params, reason}], "failed": [...]}
    <gpu>.md     tables: each case's time as called and replayed (median and p20-p80), the speed-ups
                 against every peer measured in this run with their intervals, and the targets
    <gpu>-attention_<mode>_d<D>.png   TFLOP/s against sequence length per provider, one panel per mask
    <gpu>-model.png                   model tokens/s per provider
How a case is timed and how two are compared: bench.timing and bench.targets.
The providers are bench.cases' (its docstring lists them per bench).
A case whose result fails its check is listed under "failed" and makes the command exit 1.
`--from` reads reports already measured (this schema, or the "report" of a `tools.gpu_check`
results.json), merges them and writes the same files, measuring nothing.
"""

import argparse
import json
import os
import re
import sys
import tempfile
import traceback
from collections import Counter

import torch

from bench import cases as suite
from bench.common import Skip, environment, gemm_tflops, measure
from bench.targets import case_key, evaluate_targets, groups, judged, ratio_text, speedup

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
README = os.path.join(ROOT, "README.md")
RESULTS = os.path.join(ROOT, "bench", "results")
README_START, README_END = "<!-- bench:start -->", "<!-- bench:end -->"


def _fmt(value, spec):
    return "-" if value is None else format(value, spec)


def in_summary(bench, params):
    """The rows the README shows: the model, the FFN, and attention at the tutorial's shape and L 4096 (D 64, bf16)."""
    if bench.startswith("attention"):
        return params["D"] == 64 and params["dtype"] == "bf16" and params["L"] in (256, 4096)
    return True


def _speedup_text(ours, peer):
    """fastformer's speed-up over a peer as "1.23x [1.20-1.26] graph": the median ratio, the
    interval the spreads allow, and the figure compared (timing.Ratio, targets.basis)."""
    ratio, on = speedup(ours, peer)
    return f"{ratio_text(ratio)} {on}"


def _time_text(record, prefix=""):
    """A record's time as "0.512 (0.508-0.520)": the median ms and its p20-p80 spread, or "-"."""
    if record.get(f"{prefix}ms") is None:
        return "-"
    if record.get(f"{prefix}p20_ms") is None:  # a run from before spreads were kept
        return f"{record[f'{prefix}ms']:.3f}"
    return f"{record[f'{prefix}ms']:.3f} ({record[f'{prefix}p20_ms']:.3f}-{record[f'{prefix}p80_ms']:.3f})"


def readme_summary(report, source):
    """The README's short form of `markdown`: a line per case of in_summary, fastformer's time,
    its speed-up over each peer and the time of its other ways of running (fastformer_*), then a
    count of the targets by verdict; `source` names where the full tables are."""
    env = report["env"]
    lines = [
        f"Measured on {env['gpu']}, torch {env['torch']}, Triton {env['triton']}, {env['date']}. Speed-up: "
        "the peer's time over fastformer's (above 1x, fastformer is faster), with the interval the two "
        "spreads (p20-p80) allow and the figure compared: graph (device time replayed from a CUDA graph), "
        "events (device time as called) or wall (a step).",
        "",
        "| bench | case | fastformer ms | speed-up over | fastformer's other ways |",
        "|---|---|---|---|---|",
    ]
    for (bench, params), group in groups(report["results"]).items():
        ours = group.get("fastformer")
        if ours is None or not in_summary(bench, json.loads(params)):
            continue
        case = ", ".join(f"{k}={v}" for k, v in json.loads(params).items() if k not in ("scenario", "shape"))
        peers = ", ".join(
            f"{p} {_speedup_text(ours, r)}" for p, r in sorted(group.items()) if not p.startswith("fastformer")
        )
        variants = ", ".join(
            f"{p[len('fastformer_') :]} {r['ms']:.2f} ms"
            for p, r in sorted(group.items())
            if p.startswith("fastformer_")
        )
        lines.append(f"| {bench} | {case} | {_time_text(ours)} | {peers or '-'} | {variants or '-'} |")
    targets = evaluate_targets(report["results"])
    counts = Counter(t["verdict"] for t in targets)
    lines += [
        "",
        f"Targets: {counts['met']} met, {counts['not met']} not met, {counts['within noise']} within noise, "
        f"{counts['not measured']} not measured ({len(targets)} in all). Every row, target and plot: {source}.",
    ]
    return "\n".join(lines) + "\n"


def markdown(report, select=None, targets=True):
    """The results as markdown: one row per provider and case (its time as called and replayed,
    each with its p20-p80 spread, TFLOP/s, tokens/s, peak memory) with fastformer's speed-up over
    it, then (unless `targets` is False) the targets. `select(bench, params)` keeps only some cases."""
    env = report["env"]
    lines = [
        f"Measured on {env['gpu']}, torch {env['torch']}, Triton {env['triton']}, CUDA {env['cuda']}, "
        f"{env['date']}; bf16 GEMM rate {_fmt(env.get('bf16_gemm_tflops'), '.0f')} TFLOP/s (MFU denominator). "
        "Times in ms, median (p20-p80): kernel cases by device time (CUDA events, L2 flushed) as called "
        "and replayed from a CUDA graph; steps by wall time.",
        "",
        "| bench | params | provider | ms | graph ms | TFLOP/s | tokens/s | peak MB | fastformer speed-up |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for (bench, params), group in groups(report["results"]).items():
        if select is not None and not select(bench, json.loads(params)):
            continue
        ours = group.get("fastformer")
        for provider, r in sorted(group.items()):
            ratio = _speedup_text(ours, r) if ours and provider != "fastformer" else "-"
            short = ", ".join(f"{k}={v}" for k, v in json.loads(params).items())
            tflops = r.get("graph_tflops") or r.get("tflops")
            lines.append(
                f"| {bench} | {short} | {provider} | {_time_text(r)} | {_time_text(r, 'graph_')} | "
                f"{_fmt(tflops, '.1f')} | {_fmt(r['tokens_per_s'], ',.0f')} | {_fmt(r['peak_mem_mb'], ',.0f')} | "
                f"{ratio} |"
            )
    if targets:
        lines += ["", *target_table(evaluate_targets(report["results"]))]
    if report["skipped"]:
        lines += ["", f"{len(report['skipped'])} cases skipped (see the JSON for each reason)."]
    return "\n".join(lines) + "\n"


def target_table(targets):
    """Markdown lines of judged targets: required, the worst case's ratio with its interval, the
    figure and peer it was judged on, and the verdict."""
    lines = [
        "| target | required | worst case [interval] | on | peer | cases | verdict |",
        "|---|---|---|---|---|---|---|",
    ]
    for t in targets:
        required = {"speedup": f">= {t['required']:.2f}x", "memory": f"<= {t['required']:.2f}x"}.get(
            t["kind"], f">= {t['required']:.0f} TFLOP/s"
        )
        worst = "-" if t["worst"] is None else f"{t['worst']:.2f} [{t['low']:.2f}-{t['high']:.2f}]"
        verdict = t["verdict"] if t["verdict"] != "not met" else "**not met**"
        lines.append(
            f"| {t['target']} | {required} | {worst} | {t['basis'] or '-'} | {t['peer'] or '-'} | {t['cases']} | "
            f"{verdict} |"
        )
    return lines


def plot(report, prefix):
    """TFLOP/s against L per provider, a panel per mask (the long shapes, bf16); model tokens/s bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    attention = [
        dict(r, tflops=r.get("graph_tflops") or r["tflops"])  # replayed where it was, as the tables compare
        for r in report["results"]
        if r["bench"] in ("attention_fwd", "attention_fwd_bwd") and r["tflops"]
    ]
    for bench, D in sorted({(r["bench"], r["params"]["D"]) for r in attention}):
        fig, axes = plt.subplots(1, len(suite.MASKS), figsize=(4 * len(suite.MASKS), 3.6), sharey=True)
        for ax, mask in zip(axes, suite.MASKS):
            for provider in suite.ATTENTION_PROVIDERS:
                points = sorted(
                    (r["params"]["L"], r["tflops"])
                    for r in attention
                    if r["bench"] == bench
                    and r["params"]["D"] == D
                    and r["params"]["mask"] == mask
                    and r["provider"] == provider
                    and r["params"]["dtype"] in ("bf16", "fp32")
                    and r["params"]["shape"] != "tutorial"  # the length sweep
                )
                if points:
                    ax.plot(*zip(*points), marker="o", label=provider)
            lengths = sorted({r["params"]["L"] for r in attention if r["params"]["shape"] != "tutorial"})
            ax.set_xscale("log", base=2)
            ax.set_xticks(lengths, [str(L) for L in lengths])
            ax.set(title=mask, xlabel="sequence length")
            ax.grid(alpha=0.3)
        axes[0].set_ylabel("TFLOP/s")
        handles = {label: h for ax in axes for h, label in zip(*ax.get_legend_handles_labels())}
        if handles:
            fig.legend(handles.values(), handles.keys(), loc="upper right", fontsize=8)
        fig.suptitle(f"{bench}, head dim {D}, {report['env']['gpu']}")
        fig.tight_layout()
        path = f"{prefix}-{bench}_d{D}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    model = [r for r in report["results"] if r["bench"].startswith("model") and r["tokens_per_s"]]
    if model:
        labels = sorted({f"{r['bench']} {r['params']['scenario']}" for r in model})
        providers = [p for p in suite.MODEL_PROVIDERS if any(r["provider"] == p for r in model)]
        fig, ax = plt.subplots(figsize=(2 + 2.5 * len(labels), 4))
        width = 0.8 / len(providers)
        for i, provider in enumerate(providers):
            values = [
                next(
                    (
                        r["tokens_per_s"]
                        for r in model
                        if r["provider"] == provider and f"{r['bench']} {r['params']['scenario']}" == label
                    ),
                    0,
                )
                for label in labels
            ]
            ax.bar([j + i * width for j in range(len(labels))], values, width, label=provider)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(labels))], labels)
        ax.set(ylabel="tokens/s", title=f"MovieClassification, {report['env']['gpu']}")
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = f"{prefix}-model.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


def run(cases, device, warmup=3, rep=25, log=print, gemm_rate=None, profiled=frozenset()):
    """Measure every case; returns the report dict (env, results, skipped, failed).

    `gemm_rate` is the bf16 GEMM TFLOP/s used as the MFU denominator; when None it is measured
    here on CUDA (and left None on a CPU). The cases whose ids are in `profiled` also record
    their kernels (bench.common.profile_kernels)."""
    env = environment(device)
    if gemm_rate is None and torch.device(device).type == "cuda":
        gemm_rate = gemm_tflops(device)
    env["bf16_gemm_tflops"] = gemm_rate
    report = {"env": env, "results": [], "skipped": [], "failed": []}
    for case in cases:
        try:
            record = measure(case, device, warmup=warmup, rep=rep, profile=case.id in profiled)
        except Skip as reason:
            report["skipped"].append(
                {"bench": case.bench, "provider": case.provider, "params": case.params, "reason": str(reason)}
            )
            continue
        except Exception as error:  # noqa: BLE001 (a failing case is reported, the rest still run)
            report["failed"].append(
                {
                    "bench": case.bench,
                    "provider": case.provider,
                    "params": case.params,
                    "error": f"{type(error).__name__}: {error}",
                }
            )
            log(f"FAILED {case.id}: {type(error).__name__}: {error}")
            if not isinstance(error, AssertionError):
                traceback.print_exc()
            continue
        record["mfu"] = (
            record["tflops"] / env["bf16_gemm_tflops"] if record["tflops"] and env["bf16_gemm_tflops"] else None
        )
        report["results"].append(record)
        log(
            f"{case.id:90s} {_time_text(record)} ms, replayed {_time_text(record, 'graph_')} ms  "
            f"{_fmt(record['graph_tflops'] or record['tflops'], '7.1f')} TFLOP/s  "
            f"{_fmt(record['peak_mem_mb'], '9,.0f')} MB"
        )
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return report


def write(report, out_dir, update_readme=False, source=None):
    """<gpu>.json, <gpu>.md and the plots in out_dir; with update_readme, README's summary, which
    names `source` (default: <gpu>.md) as where the full tables are. Returns the paths written."""
    os.makedirs(out_dir, exist_ok=True)
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", report["env"]["gpu"]).strip("_")
    prefix = os.path.join(out_dir, name)
    with open(prefix + ".json", "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
        f.write("\n")
    table = markdown(report)
    with open(prefix + ".md", "w", encoding="utf-8") as f:
        f.write(table)
    paths = [prefix + ".json", prefix + ".md", *plot(report, prefix)]
    if update_readme:
        splice_readme(readme_summary(report, source or os.path.relpath(prefix + ".md", os.path.dirname(README))))
    return paths


def load(path):
    """A report saved by `write`, or the "report" inside a `tools.gpu_check` results.json."""
    with open(path, encoding="utf-8") as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path} is not JSON ({error.msg}, line {error.lineno})") from None
    report = data.get("report", data) if isinstance(data, dict) else None
    missing = {"env", "results", "skipped", "failed"} - set(report or {})
    if missing:
        raise ValueError(f"{path} is not a benchmark report (missing {', '.join(sorted(missing))})")
    return report


def merge(reports):
    """One report from several runs on one GPU: a case measured twice keeps its first record, an
    identical skip or failure is listed once; the env is the first one's, with the first measured
    GEMM rate."""
    merged, seen = None, set()
    for report in reports:
        if merged is None:
            merged = {"env": dict(report["env"]), "results": [], "skipped": [], "failed": []}
        elif report["env"]["gpu"] != merged["env"]["gpu"]:
            raise ValueError(f"reports from different GPUs: {merged['env']['gpu']!r} and {report['env']['gpu']!r}")
        if merged["env"].get("bf16_gemm_tflops") is None:
            merged["env"]["bf16_gemm_tflops"] = report["env"].get("bf16_gemm_tflops")
        for record in report["results"]:
            key = (*case_key(record), record["provider"])
            if key not in seen:
                seen.add(key)
                merged["results"].append(record)
        for kind in ("skipped", "failed"):
            merged[kind] += [entry for entry in report[kind] if entry not in merged[kind]]
    if merged is None:
        raise ValueError("no report given")
    return merged


def splice_readme(table, readme=README):
    with open(readme, encoding="utf-8") as f:
        text = f.read()
    if README_START not in text or README_END not in text:
        raise ValueError(f"{readme} has no {README_START} ... {README_END} markers")
    head, rest = text.split(README_START, 1)
    _, tail = rest.split(README_END, 1)
    with open(readme, "w", encoding="utf-8") as f:
        f.write(f"{head}{README_START}\n{table}{README_END}{tail}")


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m bench.report",
        description="Run fastformer's benchmarks and write bench/results/.",
        allow_abbrev=False,
    )
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, runs on a CPU (checks the code paths)")
    parser.add_argument("--filter", default="", help="only cases whose id contains this string")
    parser.add_argument("--targets", action="store_true", help="only the cases the targets are judged on (a short run)")
    parser.add_argument(
        "--out",
        help="where the files go (default: bench/results/; with --smoke, a new temporary directory)",
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rep", type=int, default=25, help="timed repetitions per case (default 25)")
    parser.add_argument("--update-readme", action="store_true", help="splice the table into README.md")
    parser.add_argument(
        "--from",
        dest="sources",
        nargs="+",
        metavar="JSON",
        help="write the files from reports already measured (merged in order), measuring nothing",
    )
    args = parser.parse_args(argv)
    if args.sources:
        try:
            merged = merge(load(path) for path in args.sources)
        except (OSError, ValueError) as error:
            print(f"bench.report: --from: {error}", file=sys.stderr)
            return 2
        if args.update_readme and merged["env"]["gpu"] == "cpu":
            print(
                "bench.report: --from: these results were measured on a CPU; the README table holds GPU results",
                file=sys.stderr,
            )
            return 2
        # the README names the folder of the first file read: a GPU check's, with its summary.md
        source = os.path.relpath(os.path.dirname(os.path.abspath(args.sources[0])), os.path.dirname(README))
        for path in write(merged, args.out or RESULTS, update_readme=args.update_readme, source=source):
            print(f"wrote {path}")
        return 0
    if torch.device(args.device).type != "cuda" and not args.smoke:
        print(
            "bench.report: no CUDA GPU here; the benchmarks need one. Use --smoke for a CPU check "
            "of the report's code paths.",
            file=sys.stderr,
        )
        return 2
    if torch.device(args.device).type == "cpu":
        from fastformer.kernels import _runtime

        if not _runtime.INTERPRET:
            print(
                "bench.report: --smoke on a CPU runs the Triton kernels through Triton's interpreter, and "
                "TRITON_INTERPRET is off; run `python -m bench.report --smoke`, which sets it, or unset it",
                file=sys.stderr,
            )
            return 2
        print(
            "bench.report: smoke run on the CPU, the Triton kernels through Triton's interpreter "
            "(TRITON_INTERPRET=1): tiny shapes, checking the code paths; the times mean nothing"
        )
    if args.out is None:  # a smoke run's files are not results: they go to a new temporary directory
        args.out = tempfile.mkdtemp(prefix="fastformer-smoke-") if args.smoke else RESULTS
    cases = suite.smoke_suite(args.device) if args.smoke else suite.full_suite(args.device)
    cases = [c for c in cases if args.filter in c.id and (not args.targets or judged(c))]
    report = run(cases, args.device, warmup=1 if args.smoke else 3, rep=2 if args.smoke else args.rep)
    for path in write(report, args.out, update_readme=args.update_readme):
        print(f"wrote {path}")
    print(f"{len(report['results'])} measured, {len(report['skipped'])} skipped, {len(report['failed'])} failed")
    return 1 if report["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
