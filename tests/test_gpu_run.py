"""tools/gpu_run.sh rehearsed on a CPU, as a lent GPU machine runs it: the offline install of this
checkout, the carried wheels installed and put on the path, the mode picked by the first argument,
and the versions printed before and after. Marked `versions`: CI's oldest lane (torch 2.11 and
Triton 3.6, the GPU machines' versions) runs it too."""

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.versions


def gpu_run(tmp_path, *args, carry=None, interpret=True):
    env = dict(os.environ, PYTHON=sys.executable, OUT=str(tmp_path / "out"), TMPDIR=str(tmp_path))
    env["GPU_CARRY"] = str(carry or tmp_path / "none")
    if not interpret:  # as on a GPU machine, where the kernels compile (tools.sweep refuses the interpreter)
        env.pop("TRITON_INTERPRET", None)
        env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    return subprocess.run(
        ["bash", "tools/gpu_run.sh", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )


def tiny_wheel(folder):
    """A pure-Python wheel of a module `carried_probe` that records where it was imported from."""
    folder.mkdir(parents=True)
    path = folder / "carried_probe-0.1-py3-none-any.whl"
    info = "carried_probe-0.1.dist-info"
    files = {
        "carried_probe.py": "import os\nWHERE = os.path.dirname(__file__)\n",
        f"{info}/METADATA": "Metadata-Version: 2.1\nName: carried-probe\nVersion: 0.1\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    files[f"{info}/RECORD"] = "".join(f"{name},,\n" for name in files) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as wheel:
        for name, text in files.items():
            wheel.writestr(name, text)
    return path


def test_the_smoke_rehearsal_installs_runs_the_mode_and_prints_the_versions(tmp_path):
    done = gpu_run(tmp_path, "--smoke", "--stage", "env")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    assert out.startswith("== install (offline)\n")
    assert "no carried wheels in" in out  # said, not failed: the peers they provide skip with the reason
    assert "== tools.gpu_check --smoke, stopped after " in out
    assert out.count("torch.cuda.is_available(): ") == 2  # the versions before the run and after it
    document = json.loads((tmp_path / "out" / "results.json").read_text())
    assert document["mode"] == "smoke" and list(document["stages"]) == ["env"]


def test_carried_wheels_are_installed_offline_and_on_the_path(tmp_path):
    carry = tmp_path / "carry"
    tiny_wheel(carry / "wheels")
    probe = tmp_path / "probe.py"
    done = gpu_run(tmp_path, "--smoke", "--stage", "env", carry=carry)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "carried wheels installed into " in done.stdout and "carried_probe-0.1-py3-none-any.whl" in done.stdout
    site = done.stdout.split("carried wheels installed into ", 1)[1].split(":", 1)[0]
    assert (Path(site) / "carried_probe.py").is_file()
    probe.write_text("import carried_probe; print(carried_probe.WHERE)\n")
    found = subprocess.run([sys.executable, str(probe)], env=dict(os.environ, PYTHONPATH=site), capture_output=True)
    assert found.returncode == 0 and found.stdout.decode().strip() == site


def test_a_bad_command_line_is_gpu_checks_exit_2(tmp_path):
    done = gpu_run(tmp_path, "--rest", "--stage", "nope")
    assert done.returncode == 2 and "unknown stage 'nope'" in done.stderr
    assert "== tools.gpu_check --rest, stopped after " in done.stdout  # the mode the first argument picked


def test_the_sweep_mode_runs_tools_sweep_with_the_time_left(tmp_path):
    """--sweep runs tools.sweep in place of tools.gpu_check, its budget what is left less 30 s; here
    a dry run of the smallest family (tests/test_sweep.py checks the sweep itself)."""
    done = gpu_run(tmp_path, "--sweep", "--dry-run", "--quick", "--family", "gemm ffn M8192", interpret=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "== tools.sweep, stopped after " in done.stdout and "tools.gpu_check" not in done.stdout
    report = json.loads((tmp_path / "out" / "sweep.json").read_text())
    left = int(done.stdout.split("== tools.sweep, stopped after ", 1)[1].split(" s", 1)[0])
    assert report["budget_seconds"] == left - 30 and report["families"] == ["gemm ffn M8192"]
    assert (tmp_path / "out" / "sweep.md").is_file()
