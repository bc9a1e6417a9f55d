"""The GPU check's job stage (tools.gpu_check.job) on a CPU: the reading of what a job prints and
writes, the data it falls back to without the carried sdist, and a job that fails or is cut at its
budget. Both jobs end to end at the smoke size: tests/test_gpu_check.py, on the --smoke run's stage."""

import json
import os
import time
from types import SimpleNamespace

import pytest
import torch

from tools.convergence import TINY
from tools.gpu_check import job
from tools.gpu_check.run import ROOT, Failed

on_a_cpu = pytest.mark.skipif(torch.cuda.is_available(), reason="the stage's CPU behaviour; on a GPU run the command")


def smoke_run(budget=300):
    """What the stage reads of a Run: the smoke plan's config and budget, on a CPU, started now."""
    plan = SimpleNamespace(budget_seconds={"job": budget}, config=TINY, tiny=True)
    started = time.monotonic()
    return SimpleNamespace(
        plan=plan, mode="smoke", cuda=False, stage_started=started, deadline=lambda stage: started + budget
    )


def test_the_setup_is_read_from_the_headers_last_line():
    lines = [
        (1.0, "Training a BPE vocab of up to 8000 + 7 pieces on 8985 reviews"),
        (3.0, "  run dir  runs/sentiment-20261128-120000"),
        (3.1, "Train 1/1:   0%|          | 0/45 [00:00<?, ? batch/s]"),
    ]
    assert job.setup_seconds(lines) == 3.0 and job.setup_seconds(lines[:1]) is None


@pytest.mark.parametrize(
    "modes, step_mode",
    [
        ({"cuda_graphs": False, "compile": False}, "eager"),
        ({"cuda_graphs": True, "compile": False}, "CUDA graphs"),
        ({"cuda_graphs": False, "compile": True}, "compile"),
    ],
)
def test_a_run_directory_gives_the_epochs_figures_and_what_ran(tmp_path, modes, step_mode):
    epoch = {"epoch": 1, "steps": 71, "epoch_steps": 71, "seconds": 4.0, "tokens_per_s": 250_000.0}
    epoch["first_step_seconds"] = 12.5
    (tmp_path / "metrics.json").write_text(json.dumps({"epochs": [epoch], "test_accuracy": 0.75}))
    info = {"kernels": "triton", "amp": "bf16", "device": "cuda", "max_steps": None, "eager_because": None, **modes}
    (tmp_path / "run.json").write_text(json.dumps(info))
    assert job.read_run(str(tmp_path)) == {
        "train_seconds": 4.0,
        "tokens_per_s": 250_000.0,
        "accuracy": 0.75,
        "first_step_seconds": 12.5,
        "steps": 71,
        "step_mode": step_mode,
        "eager_because": None,
        "kernels": "triton",
        "amp": "bf16",
        "device": "cuda",
        "max_steps": None,
    }


def test_without_the_carried_sdist_the_jobs_train_on_the_200_reviews_and_say_so(monkeypatch):
    monkeypatch.setattr(job, "CARRY", "no-such-carry")
    options, data = job.choose_data(SimpleNamespace(mode="full", plan=SimpleNamespace(tiny=False)), {}, 60)
    assert options == ["--train", os.path.join(ROOT, job.REVIEWS_200)]
    assert data["data"] == job.REVIEWS_200 and data["data_command"] is None
    assert "no no-such-carry/vaderSentiment-3.3.2.tar.gz" in data["data_note"]
    assert "tools/gpu_carry.sh" in data["data_note"]
    figures = {"accuracy": 0.7, "tokens_per_s": 1e5, "first_step_seconds": 9.0, "steps": 2, "max_steps": None}
    line = job.summary({"triton": figures, "triton_warm": figures, "reference": figures, **data}, cuda=True)
    assert data["data_note"] in line and not line.startswith("CPU")


@pytest.mark.skipif(
    not os.path.isfile(os.path.join(ROOT, job.CARRY, "vaderSentiment-3.3.2.tar.gz")),
    reason="no gpu-carry/ here (tools/gpu_carry.sh fills it)",
)
def test_the_carried_sdist_becomes_the_dataset_in_the_jobs_cache(tmp_path):
    options, data = job.choose_data(
        SimpleNamespace(mode="full", plan=SimpleNamespace(tiny=False)), {"XDG_CACHE_HOME": str(tmp_path)}, 60
    )
    assert options == ["--dataset", "rotten-tomatoes"] and data["data"] == "rotten-tomatoes"
    assert sorted(os.listdir(tmp_path / "fastformer" / "rotten-tomatoes")) == ["test.tsv", "train.tsv"]


@on_a_cpu
def test_a_job_that_exits_non_zero_fails_the_stage_with_its_last_lines(monkeypatch):
    monkeypatch.setattr(job, "REVIEWS_200", os.path.join("tests", "data", "no-such-file.tsv"))
    with pytest.raises(Failed) as failed:
        job.stage(smoke_run())
    message, details = str(failed.value), failed.value.details
    assert message.startswith("the triton job exited 2; the triton_warm job exited 2; the reference job exited 2\n")
    assert "fastformer train: error: train file not found" in message
    for name in ("triton", "triton_warm", "reference"):
        assert details[name]["returncode"] == 2
        assert details[name]["last_lines"][-1].startswith("fastformer train: error: train file not found")
    assert details["summary"].count("train file not found") == 3


@on_a_cpu
def test_a_job_cut_at_its_budget_fails_the_stage():
    cut = r"^the triton job stopped at its \d s; the triton_warm job stopped at its \d s; the reference job stopped"
    with pytest.raises(Failed, match=cut):
        job.stage(smoke_run(budget=3))
