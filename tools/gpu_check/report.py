"""The run's summary: the plain-text table printed at the end, and summary.md (stages, targets,
each stage's details as tables, the benchmark tables, every traceback)."""

import json

from bench import reporting as bench_report


def note(entry):
    if entry["status"] == "skipped":
        return entry["reason"]
    if entry["status"] == "failed":
        return entry["details"].get("summary") or entry["error"]
    return entry["details"].get("summary", "")


def _required(target):
    if target["kind"] == "tflops":
        return f">= {target['required']:.0f} TFLOP/s"
    return f"{'<=' if target['kind'] == 'memory' else '>='} {target['required']:.2f}x"


def _worst(target):
    if target["worst"] is None:
        return "-"
    return f"{target['worst']:.2f} [{target['low']:.2f}-{target['high']:.2f}]"


def summary_table(document):
    """The plain-text table printed at the end, the tail of the output a device tool brings back
    even when no file comes: the plan's reasons, the stages, the sweep's best per pass and what
    it put in force, then the targets."""
    lines = [f"plan: {line}" for line in document["plan"]]
    lines.append(f"{'stage':<12} {'status':<8} {'time':>8}  note")
    for name, entry in document["stages"].items():
        seconds = "-" if entry["seconds"] is None else f"{entry['seconds']:.1f} s"
        lines.append(f"{name:<12} {entry['status']:<8} {seconds:>8}  {note(entry)}")
    sweep = document["stages"].get("sweep", {}).get("details") or {}
    lines += [f"sweep: {line}" for line in sweep.get("best", [])]
    lines += [f"sweep: {line.strip()}" for line in sweep.get("adopted", [])]
    tuned = document["env"].get("tuned")
    if tuned:
        lines.append(f"tuned table in force: {tuned['source']} ({tuned['launches']} launches)")
    width = max(len(t["target"]) for t in document["targets"])
    lines += ["", f"{'target':<{width}}  {'required':>15}  {'worst [interval]':>20}  verdict"]
    for t in document["targets"]:
        lines.append(f"{t['target']:<{width}}  {_required(t):>15}  {_worst(t):>20}  {t['verdict']}")
    return "\n".join(lines)


def summary_markdown(document):
    env = document["env"]
    if document["finished"]:
        status = f"finished {document['finished']}"
    else:
        status = "**not finished**: still running, or killed (a stage marked running did not end)"
    lines = [
        f"# gpu_check on {env['gpu']} ({document['mode']})",
        "",
        f"torch {env['torch']}, Triton {env['triton']}, CUDA {env['cuda']}; started {document['started']}, {status}.",
        f"Command: `{document['command']}`",
        "",
        *[f"- plan: {_cell(line)}" for line in document["plan"]],
        *([""] if document["plan"] else []),
        "| stage | status | time | note |",
        "|---|---|---|---|",
    ]
    for name, entry in document["stages"].items():
        seconds = "-" if entry["seconds"] is None else f"{entry['seconds']:.1f} s"
        lines.append(f"| {name} | {entry['status']} | {seconds} | {_cell(note(entry))} |")
    lines += ["", "## Targets", ""]
    if document["targets_note"]:
        lines += [f"Targets {document['targets_note']}.", ""]
    lines += bench_report.target_table(document["targets"])
    for name, entry in document["stages"].items():
        lines += ["", f"## {name}: {entry['status']}", ""]
        if entry["reason"]:
            lines.append(f"Reason: {entry['reason']}")
        lines += _markdown_details(entry["details"])
        if entry["traceback"]:
            lines += ["", "```text", entry["traceback"].rstrip(), "```"]
    if document["report"]["results"] or document["report"]["failed"]:
        lines += ["", "## Benchmarks", "", bench_report.markdown(document["report"], targets=False).rstrip()]
        for failure in document["report"]["failed"]:
            lines.append(f"- failed: {failure['bench']} {failure['provider']} {failure['params']}: {failure['error']}")
    if document["plots"]:
        lines += ["", "Plots: " + ", ".join(document["plots"])]
    return "\n".join(lines) + "\n"


def _cell(text):
    return str(text).replace("|", "\\|").replace("\n", " ")


def _markdown_details(details, prefix=""):
    """A stage's details: lists of records and {name: record} as tables, other lists as bullets,
    a dict holding records or lists through its keys (`attention.settings`), anything else on a line."""
    lines = []
    for key, value in details.items():
        name = prefix + key
        if key == "summary" and not prefix:
            continue
        if isinstance(value, dict) and value and all(isinstance(v, dict) for v in value.values()):
            lines += _markdown_table(name, list(value.values()), list(value))
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            lines += _markdown_table(name, value)
        elif isinstance(value, dict) and any(isinstance(v, (dict, list)) for v in value.values()):
            lines += _markdown_details(value, prefix=f"{name}.")
        elif isinstance(value, list):
            lines.append(f"- {name}: " + ("none" if not value else ""))
            lines += [f"  - {_cell(_fmt(v))}" for v in value[:30]]
            if len(value) > 30:
                lines.append(f"  - ... {len(value) - 30} more (results.json has them all)")
        else:
            lines.append(f"- {name}: {_cell(_fmt(value))}")
    return lines


def _markdown_table(name, rows, labels=None):
    columns = list(dict.fromkeys(k for row in rows for k in row))
    head = ([""] if labels else []) + columns
    lines = ["", f"{name}:", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for i, row in enumerate(rows):
        cells = ([labels[i]] if labels else []) + [_cell(_fmt(row.get(c))) for c in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return [*lines, ""]


def _fmt(value):
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (dict, list)):
        return json.dumps(value, default=str)
    return "-" if value is None else str(value)
