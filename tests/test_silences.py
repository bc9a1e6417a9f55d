"""What a newcomer trips on when the job says nothing (issue 62): a demo through Triton's
interpreter that runs for minutes without a word, torchrun starting more processes than a CPU has
cores, and the ranks of an interrupted torchrun job each naming a last checkpoint of their own."""

import functools
import time

import torch

from fastformer import Config, use_backend
from fastformer.train import job, runtime
from fastformer.train.runtime import Launch


def test_a_long_pass_says_it_still_runs_and_how_long_it_took():
    lines = []
    with job._still_running("forward", lines.append, True, every=0.05):
        time.sleep(0.3)
    ticks = [line for line in lines if "forward still running" in line]
    assert len(ticks) >= 2, lines
    assert lines[-1].strip().startswith("...") and "forward done in" in lines[-1]
    quiet = []
    with job._still_running("forward", quiet.append, False, every=0.01):
        time.sleep(0.05)
    assert quiet == []


def test_the_demo_through_the_interpreter_warns_first_and_shows_each_pass(monkeypatch):
    """The kernels run through the interpreter here (tests/conftest.py): the demo says so before it
    starts, with how to make it quicker, and each pass reports while it runs. The tutorial's config
    is made small so that the test takes seconds."""
    small = Config.tutorial(n_enc_vocab=64, n_dec_vocab=64, n_layer=1, d_hidn=32, n_head=2, d_head=16, d_ff=64)
    monkeypatch.setattr(Config, "tutorial", staticmethod(lambda: small))
    monkeypatch.setattr(job, "_still_running", functools.partial(job._still_running, every=0.001))
    lines = []
    with use_backend("auto"):
        job.demo(device="cpu", backend_name="triton", batch_size=2, seq_len=8, log=lines.append)
    text = "\n".join(lines)
    assert "Triton kernels" in text
    note = next(i for i, line in enumerate(lines) if "Triton's interpreter" in line)
    assert "--batch-size 2 --seq-len 16" in lines[note]
    assert note < next(i for i, line in enumerate(lines) if "forward done in" in line)
    assert "backward done in" in text
    reference = []
    job.demo(device="cpu", backend_name="reference", batch_size=2, seq_len=8, log=reference.append)
    assert not any("interpreter" in line or "done in" in line for line in reference)


def test_more_torchrun_processes_than_cores_on_a_cpu_is_a_warning_naming_both(monkeypatch):
    monkeypatch.setattr(runtime.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    crowded = runtime.crowded_cores(Launch(0, 4, 0, True), cpu, {"LOCAL_WORLD_SIZE": "4"})
    assert "4 processes" in crowded and "2 CPU core(s)" in crowded and "--nproc_per_node 2" in crowded
    assert runtime.crowded_cores(Launch(0, 2, 0, True), cpu, {"LOCAL_WORLD_SIZE": "2"}) is None
    assert runtime.crowded_cores(Launch(0, 4, 0, True), cuda, {"LOCAL_WORLD_SIZE": "4"}) is None
    assert runtime.crowded_cores(Launch(), cpu, {}) is None
    # two machines of 2 processes each: this machine's count is what crowds its cores
    assert runtime.crowded_cores(Launch(0, 4, 0, True), cpu, {"LOCAL_WORLD_SIZE": "2"}) is None


def test_an_interrupted_torchrun_job_names_its_checkpoint_on_rank_0_alone(monkeypatch, tmp_path):
    """Rank 0 alone saves checkpoints, so the others cannot know the last one: on Ctrl-C they stop
    without a word of their own (the command prints nothing for them), and rank 0 names it."""
    from types import SimpleNamespace

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(job, "_epoch", interrupted)
    trainer = SimpleNamespace(epoch=1, step=0, history=[])
    stops = {}
    for rank in (0, 1):
        run = SimpleNamespace(
            inputs=SimpleNamespace(checkpoint=str(tmp_path / "epoch-1")),
            max_steps=None,
            epochs=3,
            run_dir=str(tmp_path),
            launch=Launch(rank, 2, rank, True),
        )
        try:
            job._train_epochs(trainer, run)
        except KeyboardInterrupt as stop:
            stops[rank] = str(stop)
    assert "epoch-1" in stops[0] and "--resume" in stops[0]
    assert stops[1] == ""


def test_the_command_stops_quietly_on_the_other_ranks_and_says_so_on_rank_0(monkeypatch, capsys):
    from fastformer.cli import main

    def interrupted(**options):
        raise KeyboardInterrupt

    monkeypatch.setattr(job, "demo", interrupted)
    demo = ["demo", "--device", "cpu", "--backend", "reference"]
    for rank, said in (("1", ""), ("0", "fastformer demo: interrupted\n")):
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("LOCAL_RANK", rank)
        monkeypatch.setenv("WORLD_SIZE", "2")
        assert main(demo) == 130
        assert capsys.readouterr().err == said
    monkeypatch.delenv("RANK")
    assert main(demo) == 130 and capsys.readouterr().err == "fastformer demo: interrupted\n"


def test_a_path_that_is_not_utf8_prints_as_its_bytes():
    """A --test path with a byte that is not UTF-8 is read, and the line naming it after the
    evaluation must print too (it raised UnicodeEncodeError once the work was done)."""
    import subprocess
    import sys

    code = "from fastformer.cli import paths_print_as_given as p; p(); print('test file \\udcff.tsv')"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, env={"PYTHONIOENCODING": "utf-8"})
    assert done.returncode == 0 and done.stdout == b"test file \xff.tsv\n", done.stderr
