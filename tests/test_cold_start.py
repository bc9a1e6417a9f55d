"""What a first and a second GPU run compile and time, from a CPU (tools.cold_start, tools.sm90's
dry-run sm_90a driver, subprocesses without TRITON_INTERPRET on a new Triton cache each):

- by default, one config per kernel specialization and no timing; a second process on the same
  cache compiles and times nothing (`python -m tools.cold_start --quick`);
- with autotuning on, the timings are kept on disk for the GPU that took them: a second process on
  that GPU times nothing, one on another GPU model times again (and compiles nothing).
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("triton")

pytestmark = pytest.mark.versions  # CI runs it on Triton 3.9 and on 3.6

ROOT = Path(__file__).resolve().parent.parent


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FASTFORMER_AUTOTUNE")}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    return dict(env, **extra)


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("cold-start") / "quick.json"
    proc = subprocess.run(
        [sys.executable, "-m", "tools.cold_start", "--quick", "--json", str(out)],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(out.read_text())["jobs"]["demo --quick"]


def test_a_first_run_compiles_one_config_per_specialization_and_times_none(quick):
    kernels = quick["first"]["kernels"]
    assert {"_attn_fwd_kernel", "_linear_gelu_fwd_kernel", "_add_ln_bwd_kernel"} <= set(kernels)
    for name, counts in kernels.items():
        assert counts["timings"] == 0 and counts["keys"] == 0, (name, counts)
        assert counts["most_configs"] == 1, f"{name} compiled {counts['most_configs']} configs of one specialization"
        assert counts["compiles"] == counts["specializations"], (name, counts)


def test_a_second_run_compiles_and_times_nothing(quick):
    second = quick["second"]["kernels"]
    assert sum(c["compiles"] for c in second.values()) == 0, second
    assert sum(c["timings"] for c in second.values()) == 0, second
    assert {k: c["specializations"] for k, c in second.items()} == {
        k: c["specializations"] for k, c in quick["first"]["kernels"].items()
    }


AUTOTUNED_LAUNCH = textwrap.dedent("""
    import json, sys
    import torch
    from tools import cold_start, sm90
    from fastformer import kernels

    sm90.DEVICE_NAME = sys.argv[1]  # the GPU the dry run stands for
    counts = cold_start._Counts()
    with sm90.dry_run(), counts.counting():
        kernels.linear_gelu(torch.zeros(100, 32, dtype=torch.float16), torch.zeros(64, 32, dtype=torch.float16), None)
    print(json.dumps(counts.result()["_linear_gelu_fwd_kernel"]))
""")


def test_autotuning_keeps_its_timings_on_disk_for_the_gpu_that_took_them(tmp_path):
    env = _env(TRITON_CACHE_DIR=str(tmp_path), FASTFORMER_AUTOTUNE="1")

    def run(gpu):
        proc = subprocess.run(
            [sys.executable, "-c", AUTOTUNED_LAUNCH, gpu],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert proc.returncode == 0, proc.stderr[-6000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    first = run("NVIDIA H100 80GB HBM3")
    assert first["timings"] >= 2 and first["compiles"] == first["timings"], first  # each config the rule keeps
    again = run("NVIDIA H100 80GB HBM3")
    assert (again["timings"], again["compiles"]) == (0, 0), again
    other_gpu = run("NVIDIA H200")  # the same sm_90 target: Triton's own key alone would reuse the H100's timings
    assert (other_gpu["timings"], other_gpu["compiles"]) == (first["timings"], 0), other_gpu
