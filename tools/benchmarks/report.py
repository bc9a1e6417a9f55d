"""Run the benchmark cases outside pytest and write the results.

    python -m bench.report                     # on CUDA: the full suite
    python -m bench.report --filter attention_fwd-   # only cases whose id contains this
    python -m bench.report --targets           # only the cases the performance targets are judged on
    python -m bench.report --smoke --out /tmp/r # tiny shapes on a CPU: checks the report's code paths
    python -m bench.report --update-readme      # also splice the markdown table into README.md
    python -m bench.report --from r.json --update-readme   # render saved results (no GPU needed)

Writes into --out (default bench/results/):
    <gpu>.json   {"env": {gpu, torch, triton, cuda, date, bf16_gemm_tflops},
                  "results": [{bench, provider, params, ms, tflops, tokens_per_s, peak_mem_mb, mfu}],
                  "skipped": [{bench, provider, params, reason}], "failed": [...]}
    <gpu>.md     tables: speed-ups against every peer measured in this run, and the targets
    <gpu>-attention_<mode>_d<D>.png   TFLOP/s against sequence length per provider, one panel per mask
    <gpu>-model.png                   model tokens/s per provider
Providers are those of the schema (fastformer, reference, reference_fp32, sdpa, flex, compile, eager)
plus fastformer_fused on ffn_fwd: the inference-only fully fused FFN, measured beside the two-GEMM
path so the no-grad choice of kernels.feed_forward can follow the numbers.
A case whose result fails its check is listed under "failed" and makes the command exit 1.
`--from` reads reports already measured (this schema, or the "report" of a `tools.gpu_check`
results.json), merges them and writes the same files, measuring nothing.
"""

import argparse
import json
import os
import re
import sys
import traceback
from collections import defaultdict

import torch

from tools.benchmarks import cases as suite
from tools.benchmarks.common import Skip, environment, gemm_tflops, measure

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
README = os.path.join(ROOT, "README.md")
RESULTS = os.path.join(ROOT, "bench", "results")
README_START, README_END = "<!-- bench:start -->", "<!-- bench:end -->"


def _tutorial(p):
    return p["scenario"] == "classify" and p["n_layer"] == 6 and p["d_hidn"] == 256


# (name, bench, select(params), peer, minimum speed-up of fastformer over the peer)
TARGETS = [
    ("model_train, tutorial config: tokens/s vs reference_fp32", "model_train", _tutorial, "reference_fp32", 4.0),
    ("model_train, tutorial config: tokens/s vs reference (bf16)", "model_train", _tutorial, "reference", 2.0),
    ("model_train, tutorial config: tokens/s vs compile", "model_train", _tutorial, "compile", 1.5),
    (
        "attention_fwd, D 64, causal, L >= 4096 vs sdpa",
        "attention_fwd",
        lambda p: p["D"] == 64 and p["mask"] == "causal" and p["L"] >= 4096 and p["dtype"] == "bf16",
        "sdpa",
        1.0,
    ),
    (
        "attention_fwd, D 64, padding + causal, L >= 4096 vs flex",
        "attention_fwd",
        lambda p: p["D"] == 64 and p["mask"] == "padding_causal" and p["L"] >= 4096 and p["dtype"] == "bf16",
        "flex",
        1.3,
    ),
    (
        "attention_fwd, D 64, padding + causal, L >= 4096 vs sdpa (boolean mask)",
        "attention_fwd",
        lambda p: p["D"] == 64 and p["mask"] == "padding_causal" and p["L"] >= 4096 and p["dtype"] == "bf16",
        "sdpa",
        2.0,
    ),
    (
        "attention_fwd_bwd, causal vs sdpa",
        "attention_fwd_bwd",
        lambda p: p["mask"] == "causal" and p["dtype"] == "bf16",
        "sdpa",
        0.9,
    ),
    (
        "attention_fwd_bwd, padding + causal vs flex",
        "attention_fwd_bwd",
        lambda p: p["mask"] == "padding_causal" and p["dtype"] == "bf16",
        "flex",
        1.2,
    ),
    ("ffn_fwd_bwd vs eager", "ffn_fwd_bwd", lambda p: p["op"] == "feed_forward", "eager", 1.15),
    ("ffn_fwd_bwd vs compile", "ffn_fwd_bwd", lambda p: p["op"] == "feed_forward", "compile", 1.0),
]
MEMORY_TARGET = ("model_train, tutorial config: peak memory vs reference_fp32", 0.4)


# params that describe how a provider runs, not the case: the SDPA backend PyTorch picked, and
# autocast (reference_fp32 is the model without it; the other providers run under bf16 autocast)
PROVIDER_PARAMS = ("sdpa_backend", "amp")


def _key(record):
    return record["bench"], json.dumps(
        {k: v for k, v in record["params"].items() if k not in PROVIDER_PARAMS}, sort_keys=True
    )


def speedups(results):
    """{(bench, params-json): {provider: record}} for grouping each case with its peers."""
    groups = defaultdict(dict)
    for r in results:
        groups[_key(r)][r["provider"]] = r
    return groups


def judged(case):
    """Whether some target is judged on this case (fastformer's or its peer's)."""
    return any(
        case.bench == bench and select(case.params) and case.provider in ("fastformer", peer)
        for _, bench, select, peer, _ in TARGETS
    ) or (case.bench == "model_train" and _tutorial(case.params) and case.provider in ("fastformer", "reference_fp32"))


def evaluate_targets(results):
    """Each target with the worst measured speed-up over its cases (None where not measured)."""
    groups = speedups(results)
    rows = []
    for name, bench, select, peer, minimum in TARGETS:
        ratios = [
            g[peer]["ms"] / g["fastformer"]["ms"]
            for (b, params), g in groups.items()
            if b == bench and select(json.loads(params)) and "fastformer" in g and peer in g
        ]
        worst = min(ratios) if ratios else None
        rows.append(
            {
                "target": name,
                "required": minimum,
                "worst": worst,
                "cases": len(ratios),
                "met": None if worst is None else worst >= minimum,
            }
        )
    name, maximum = MEMORY_TARGET
    mem = [
        g["fastformer"]["peak_mem_mb"] / g["reference_fp32"]["peak_mem_mb"]
        for (b, params), g in groups.items()
        if b == "model_train"
        and _tutorial(json.loads(params))
        and "fastformer" in g
        and "reference_fp32" in g
        and g["reference_fp32"]["peak_mem_mb"]
    ]
    worst = max(mem) if mem else None
    rows.append(
        {
            "target": name,
            "required": maximum,
            "worst": worst,
            "cases": len(mem),
            "met": None if worst is None else worst <= maximum,
        }
    )
    return rows


def _fmt(value, spec):
    return "-" if value is None else format(value, spec)


def in_summary(bench, params):
    """The rows the README shows: the model, the FFN, and attention at the tutorial's shape and L 4096 (D 64, bf16)."""
    if bench.startswith("attention"):
        return params["D"] == 64 and params["dtype"] == "bf16" and params["L"] in (256, 4096)
    return True


def readme_summary(report, source):
    """The README's short form of `markdown`: a line per case of in_summary, fastformer's time,
    its speed-up over each peer and the time of its other ways of running (fastformer_*), then a
    count of the targets met; `source` names where the full tables are."""
    env = report["env"]
    lines = [
        f"Measured on {env['gpu']}, torch {env['torch']}, Triton {env['triton']}, {env['date']}. Speed-up: "
        "the peer's time over fastformer's (above 1x, fastformer is faster).",
        "",
        "| bench | case | fastformer | speed-up over | fastformer's other ways |",
        "|---|---|---|---|---|",
    ]
    for (bench, params), group in speedups(report["results"]).items():
        ours = group.get("fastformer")
        if ours is None or not in_summary(bench, json.loads(params)):
            continue
        case = ", ".join(f"{k}={v}" for k, v in json.loads(params).items() if k not in ("scenario", "shape"))
        peers = ", ".join(
            f"{p} {r['ms'] / ours['ms']:.2f}x" for p, r in sorted(group.items()) if not p.startswith("fastformer")
        )
        variants = ", ".join(
            f"{p[len('fastformer_') :]} {r['ms']:.2f} ms"
            for p, r in sorted(group.items())
            if p.startswith("fastformer_")
        )
        lines.append(f"| {bench} | {case} | {ours['ms']:.2f} ms | {peers or '-'} | {variants or '-'} |")
    targets = evaluate_targets(report["results"])
    judged = [t for t in targets if t["met"] is not None]
    lines += [
        "",
        f"Targets met: {sum(t['met'] for t in judged)} of the {len(judged)} measured ({len(targets)} in all). "
        f"Every row, target and plot: {source}.",
    ]
    return "\n".join(lines) + "\n"


def markdown(report, select=None, targets=True):
    """The results as markdown: one row per provider and case, with fastformer's speed-up over it,
    then (unless `targets` is False) the targets. `select(bench, params)` keeps only some cases."""
    env = report["env"]
    lines = [
        f"Measured on {env['gpu']}, torch {env['torch']}, Triton {env['triton']}, CUDA {env['cuda']}, "
        f"{env['date']}; bf16 GEMM rate {_fmt(env.get('bf16_gemm_tflops'), '.0f')} TFLOP/s (MFU denominator).",
        "",
        "| bench | params | provider | ms | TFLOP/s | tokens/s | peak MB | fastformer speed-up |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for (bench, params), group in speedups(report["results"]).items():
        if select is not None and not select(bench, json.loads(params)):
            continue
        ours = group.get("fastformer")
        for provider, r in sorted(group.items()):
            ratio = ours["ms"] and r["ms"] / ours["ms"] if ours and provider != "fastformer" else None
            short = ", ".join(f"{k}={v}" for k, v in json.loads(params).items())
            lines.append(
                f"| {bench} | {short} | {provider} | {r['ms']:.3f} | {_fmt(r['tflops'], '.1f')} | "
                f"{_fmt(r['tokens_per_s'], ',.0f')} | {_fmt(r['peak_mem_mb'], ',.0f')} | "
                f"{_fmt(ratio, '.2f') + 'x' if ratio else '-'} |"
            )
    if targets:
        lines += ["", "| target | required | worst measured | cases | met |", "|---|---|---|---|---|"]
        for t in evaluate_targets(report["results"]):
            met = "not measured" if t["met"] is None else ("yes" if t["met"] else "**no**")
            lines.append(f"| {t['target']} | {t['required']}x | {_fmt(t['worst'], '.2f')} | {t['cases']} | {met} |")
    if report["skipped"]:
        lines += ["", f"{len(report['skipped'])} cases skipped (see the JSON for each reason)."]
    return "\n".join(lines) + "\n"


def plot(report, prefix):
    """TFLOP/s against L per provider, a panel per mask (the long shapes, bf16); model tokens/s bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    attention = [r for r in report["results"] if r["bench"].startswith("attention") and r["tflops"]]
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


def run(cases, device, warmup=3, rep=10, log=print, gemm_rate=None):
    """Measure every case; returns the report dict (env, results, skipped, failed).

    `gemm_rate` is the bf16 GEMM TFLOP/s used as the MFU denominator; when None it is measured
    here on CUDA (and left None on a CPU)."""
    env = environment(device)
    if gemm_rate is None and torch.device(device).type == "cuda":
        gemm_rate = gemm_tflops(device)
    env["bf16_gemm_tflops"] = gemm_rate
    report = {"env": env, "results": [], "skipped": [], "failed": []}
    for case in cases:
        try:
            record = measure(case, device, warmup=warmup, rep=rep)
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
            f"{case.id:90s} {record['ms']:9.3f} ms  {_fmt(record['tflops'], '7.1f')} TFLOP/s  "
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
            key = (*_key(record), record["provider"])
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
    parser = argparse.ArgumentParser(description="Run fastformer's benchmarks and write bench/results/.")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, runs on a CPU (checks the code paths)")
    parser.add_argument("--filter", default="", help="only cases whose id contains this string")
    parser.add_argument("--targets", action="store_true", help="only the cases the targets are judged on (a short run)")
    parser.add_argument("--out", default=RESULTS)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rep", type=int, default=10)
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
        for path in write(merged, args.out, update_readme=args.update_readme, source=source):
            print(f"wrote {path}")
        return 0
    if torch.device(args.device).type != "cuda" and not args.smoke:
        print(
            "bench.report: no CUDA GPU here; the benchmarks need one. Use --smoke for a CPU check "
            "of the report's code paths.",
            file=sys.stderr,
        )
        return 2
    cases = suite.smoke_suite(args.device) if args.smoke else suite.full_suite(args.device)
    cases = [c for c in cases if args.filter in c.id and (not args.targets or judged(c))]
    report = run(cases, args.device, warmup=1 if args.smoke else 3, rep=2 if args.smoke else args.rep)
    for path in write(report, args.out, update_readme=args.update_readme):
        print(f"wrote {path}")
    print(f"{len(report['results'])} measured, {len(report['skipped'])} skipped, {len(report['failed'])} failed")
    return 1 if report["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
