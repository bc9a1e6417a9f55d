"""The job stage: the default `fastformer train` job end to end, as a user runs it, on the Triton
kernels and on the PyTorch reference:

    fastformer data rotten-tomatoes --from gpu-carry/vaderSentiment-3.3.2.tar.gz
    fastformer train --dataset rotten-tomatoes --epochs 1 --backend triton      (twice, then reference)

the triton job first on an empty Triton cache (cold: a machine's first run), then again on the
cache it filled (warm: triton_warm), then the reference. Each command runs in a subprocess
(run.stream, which echoes it into the log and interrupts it at its budget), with $XDG_CACHE_HOME
(where `fastformer data` writes and --dataset reads) and $TRITON_CACHE_DIR new empty folders of a
temporary folder that also holds the run directories and goes after the stage.

The GPU machine has no network: tools/gpu_carry.sh puts the sdist into gpu-carry/ here, and the
device tool carries that ignored folder. Without it the jobs train on the 200 reviews of
tests/data/rotten_tomatoes_200.tsv (10% of them held out as the test split) and the details and
the summary say so. --smoke trains on those 200 reviews too, with the smoke plan's tiny model; on
a CPU, where Triton's interpreter takes seconds a step, the triton jobs stop after their first step.

The figures of each job:
  wall_seconds        the subprocess, from its start to its exit
  setup_seconds       from the start to the job's header line "  run dir  ...", the last it prints
                      before its first train step (interpreter, imports, data, vocab, model)
  first_step_seconds  the job's own figure (metrics.json's first epoch): from the start of its
                      inputs' checks, just after the command's start, to its first train step done
                      on the device: the compiles, the graphs' captures and the first step included
  train_seconds       the epoch's train loop (metrics.json): the first step's compiles included,
                      the test evaluation not
  tokens_per_s        the epoch's real (non-padding) encoder and decoder tokens over train_seconds
                      (metrics.json's figure, the one the epoch's line prints)
  accuracy            the test accuracy after the epoch (metrics.json)
  steps, step_mode, kernels, amp, device, max_steps   what ran (metrics.json, run.json); step_mode
                      "CUDA graphs", "compile" or "eager", and eager_because why (run.json)
"""

import json
import os
import re
import shlex
import sys
import tempfile
import time

from fastformer.config import Config
from fastformer.data import rotten_tomatoes
from fastformer.data.vocab import N_SPECIAL
from tools.gpu_check.run import ROOT, Failed, stream

CARRY = "gpu-carry"  # under ROOT: what the GPU machine cannot download (tools/gpu_carry.sh)
REVIEWS_200 = os.path.join("tests", "data", "rotten_tomatoes_200.tsv")  # under ROOT
DATA_SECONDS = 60  # for `fastformer data`: it converts 2.5 MB in a second or two
SMOKE_PIECES, SMOKE_BATCH = 120, 4  # --smoke: the 200 reviews need 65 pieces for their characters alone
INTERPRETED_STEPS = 1  # the triton job on a CPU: a step of the tiny model takes Triton's interpreter ~2.5 s
LAST_LINES = 12  # of a failed job's output, in the error
RUN_DIR_LINE = re.compile(r"  run dir  ")  # fastformer.train.job._log_header's last line


def run_command(command, timeout):
    """run.stream(command, timeout), and what it printed: {returncode, timed_out, wall_seconds,
    lines: [(seconds from the start to the line's arrival, line)]}."""
    start, lines = time.monotonic(), []
    returncode, timed_out = stream(command, timeout, lambda line: lines.append((time.monotonic() - start, line)))
    return {
        "returncode": returncode,
        "timed_out": timed_out,
        "wall_seconds": time.monotonic() - start,
        "lines": lines,
    }


def fastformer_command(environment, *args):
    """The command line of `fastformer ARGS` under `environment` (added to this process's)."""
    return ["env", *(f"{key}={value}" for key, value in environment.items()), sys.executable, "-m", "fastformer", *args]


def shown(command):
    return shlex.join("python" if part == sys.executable else part for part in command)


def last_lines(lines, n=LAST_LINES):
    """The last n lines with text in them (tqdm's bars leave blank ones)."""
    return [line.strip() for _, line in lines if line.strip()][-n:]


def choose_data(run, environment, timeout):
    """(the train command's data options, the details of the data) the jobs train on: the Rotten
    Tomatoes snippets, prepared from the carried sdist by `fastformer data` into the jobs'
    $XDG_CACHE_HOME; the 200 reviews of REVIEWS_200 in --smoke, without the carry, or when the
    carried file does not convert (each said in data_note)."""
    sdist = os.path.join(ROOT, CARRY, rotten_tomatoes.SDIST)
    reviews = ["--train", os.path.join(ROOT, REVIEWS_200)]
    if run.plan.tiny:
        return reviews, {"data": REVIEWS_200, "data_note": "the smoke mode's size", "data_command": None}
    if not os.path.isfile(sdist):
        note = f"no {CARRY}/{rotten_tomatoes.SDIST}: tools/gpu_carry.sh fetches it; carry {CARRY}"
        return reviews, {"data": REVIEWS_200, "data_note": note, "data_command": None}
    command = fastformer_command(environment, "data", "rotten-tomatoes", "--from", sdist)
    result = run_command(command, timeout)
    if result["returncode"] == 0 and not result["timed_out"]:
        details = {"data": "rotten-tomatoes", "data_note": f"from {CARRY}/{rotten_tomatoes.SDIST}"}
        return ["--dataset", "rotten-tomatoes"], dict(details, data_command=shown(command))
    why = "timed out" if result["timed_out"] else f"exited {result['returncode']}"
    note = f"`fastformer data rotten-tomatoes --from {CARRY}/{rotten_tomatoes.SDIST}` {why}: "
    note += " / ".join(last_lines(result["lines"], 2))
    return reviews, {"data": REVIEWS_200, "data_note": note, "data_command": shown(command)}


def smoke_options(run, folder):
    """The train options of --smoke: the plan's tiny model (written into `folder` as a config
    file) with a vocab the 200 reviews fill, and small batches."""
    config = os.path.join(folder, "config.json")
    n_vocab = SMOKE_PIECES + N_SPECIAL
    Config.tutorial(**dict(run.plan.config, n_enc_vocab=n_vocab, n_dec_vocab=n_vocab)).save(config)
    return ["--config", config, "--vocab-size", str(SMOKE_PIECES), "--batch-size", str(SMOKE_BATCH)]


def setup_seconds(lines):
    """When the job's header's last line ("  run dir  ...") arrived, from the job's output lines
    [(seconds, text)]; None where it is not there."""
    return next((seconds for seconds, text in lines if RUN_DIR_LINE.match(text)), None)


def read_run(run_dir):
    """The figures a train job of one epoch wrote into its run directory (metrics.json, run.json)."""
    with open(os.path.join(run_dir, "metrics.json"), encoding="utf-8") as f:
        metrics = json.load(f)
    with open(os.path.join(run_dir, "run.json"), encoding="utf-8") as f:
        info = json.load(f)
    (epoch,) = metrics["epochs"]
    return {
        "train_seconds": epoch["seconds"],
        "tokens_per_s": epoch["tokens_per_s"],
        "accuracy": metrics["test_accuracy"],
        "first_step_seconds": epoch.get("first_step_seconds"),
        "steps": epoch["epoch_steps"],
        "step_mode": "CUDA graphs" if info["cuda_graphs"] else "compile" if info["compile"] else "eager",
        "eager_because": info.get("eager_because"),
        "kernels": info["kernels"],
        "amp": info["amp"],
        "device": info["device"],
        "max_steps": info["max_steps"],
    }


def train_job(name, backend, options, environment, out, timeout):
    """`fastformer train OPTIONS --epochs 1 --backend BACKEND --out OUT` within `timeout` seconds:
    its figures, or "error" and its last lines when it failed, was cut or left a figure unread."""
    command = fastformer_command(environment, "train", *options, "--epochs", "1", "--backend", backend, "--out", out)
    result = run_command(command, timeout)
    job = {
        "command": shown(command),
        "returncode": result["returncode"],
        "timed_out": result["timed_out"],
        "timeout_seconds": round(timeout, 1),
        "wall_seconds": result["wall_seconds"],
    }
    if result["timed_out"] or result["returncode"] != 0:
        how = f"stopped at its {timeout:.0f} s" if result["timed_out"] else f"exited {result['returncode']}"
        return dict(job, error=f"the {name} job {how}", last_lines=last_lines(result["lines"]))
    job.update(setup_seconds=setup_seconds(result["lines"]), **read_run(out))
    if job["setup_seconds"] is None or job["first_step_seconds"] is None:
        missing = "its header's run dir line" if job["setup_seconds"] is None else "metrics.json's first_step_seconds"
        return dict(job, error=f"the {name} job left no {missing}", last_lines=last_lines(result["lines"]))
    return job


def summary(details, cuda):
    """One line: each job's accuracy, tokens/s and time to first step, their ratios, the data."""
    parts = []
    for name, _, _ in JOBS:
        job = details[name]
        if "error" in job:
            parts.append(f"{job['error']}: {(job['last_lines'] or [''])[-1]}")
        else:
            cut = f" ({job['steps']} step)" if job["max_steps"] else ""
            parts.append(
                f"{name}{cut}: accuracy {job['accuracy']:.3f}, {job['tokens_per_s']:,.0f} tok/s, "
                f"first step done at {job['first_step_seconds']:.1f} s"
            )
    triton, reference = details["triton"], details["reference"]
    if "error" not in triton and "error" not in reference:
        parts.append(
            f"triton/reference {triton['tokens_per_s'] / reference['tokens_per_s']:.3g}x tok/s, "
            f"{triton['first_step_seconds'] / reference['first_step_seconds']:.3g}x the time to first step"
        )
    data = details["data"] if details["data"] != REVIEWS_200 else f"{details['data']} ({details['data_note']})"
    where = "" if cuda else "CPU figures (the triton jobs through Triton's interpreter): "
    return f"{where}{'; '.join(parts)}; data {data}"


# (name, backend, share of the budget left when it starts): the default job cold (an empty Triton
# cache), then again on the cache it filled (a second run on the same machine), then the reference
JOBS = (("triton", "triton", 0.5), ("triton_warm", "triton", 0.5), ("reference", "reference", 1.0))


def stage(run):
    deadline = run.deadline("job")
    details = {"budget_seconds": round(deadline - run.stage_started, 1)}
    with tempfile.TemporaryDirectory(prefix="gpu-check-job-") as folder:
        environment = {
            "PYTHONUNBUFFERED": "1",  # the header's lines arrive as printed: setup_seconds times one
            "XDG_CACHE_HOME": os.path.join(folder, "cache"),
            "TRITON_CACHE_DIR": os.path.join(folder, "triton"),
        }
        options, data = choose_data(run, environment, min(DATA_SECONDS, deadline - time.monotonic()))
        details.update(data)
        if run.plan.tiny:
            options += smoke_options(run, folder)
        for name, backend, share in JOBS:
            timeout = max(1.0, (deadline - time.monotonic()) * share)
            cut = ["--max-steps", str(INTERPRETED_STEPS)] if backend == "triton" and not run.cuda else []
            out = os.path.join(folder, f"run-{name}")
            details[name] = train_job(name, backend, options + cut, environment, out, timeout)
    details["summary"] = summary(details, run.cuda)
    errors = [details[name] for name, _, _ in JOBS if "error" in details[name]]
    if errors:
        raise Failed(
            "; ".join(job["error"] for job in errors)
            + "".join(f"\n{job['error']}, its last lines:\n" + "\n".join(job["last_lines"]) for job in errors),
            details,
        )
    return details
