"""fastformer.train.warmup: the compiles of a job's shapes paid before its first step, in parallel, with the
model left as it was. The compiling half runs as on a GPU, under tools.sm90's dry-run sm_90a
driver in a subprocess without TRITON_INTERPRET; under the interpreter the warm-up does nothing."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import fastformer
from fastformer.train import warmup
from tests.helpers import small_config

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = textwrap.dedent("""
    import json, threading
    import torch
    import triton.compiler
    import fastformer
    from tools import sm90
    from fastformer.train import warmup
    from tests.helpers import small_config

    compiles = []  # the thread of each compile
    real_compile = triton.compiler.compile

    def compile(*args, **kwargs):
        compiles.append(threading.current_thread() is threading.main_thread())
        return real_compile(*args, **kwargs)

    triton.compiler.compile = compile  # before the first launch, which binds it
    torch.manual_seed(0)
    config = small_config(n_layer=1, d_head=16, n_enc_seq=32)
    model = fastformer.MovieClassification(config).eval()
    shapes = warmup.bucket_shapes(config, 4)
    with sm90.dry_run(time_configs=False), fastformer.use_backend("triton"):
        rng = torch.get_rng_state()
        result = warmup.warm_up(model, shapes, device="cpu", amp="bf16", workers=2, progress=False)
        kept = {
            "rng": torch.equal(torch.get_rng_state(), rng),
            "grads": all(p.grad is None for p in model.parameters()),
            "eval": not model.training,
        }
        warmed_up = list(compiles)
        for shape in shapes:  # the job's steps: everything they launch is compiled
            warmup._steps(model, shape, 1, torch.device("cpu"), "bf16", True, True)
    print(json.dumps({"result": result, "shapes": shapes, "kept": kept, "warm_up": warmed_up,
                      "steps": compiles[len(warmed_up):]}))
""")


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(
        TRITON_DEFAULT_FP_FUSION="1", FASTFORMER_AUTOTUNE="0", TRITON_CACHE_DIR=str(tmp_path_factory.mktemp("triton"))
    )
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_warm_up_compiles_every_kernel_of_the_steps_in_parallel(dry_run):
    assert dry_run["result"]["shapes"] == 2 and dry_run["shapes"] == [[4, 16], [4, 32]]
    assert dry_run["warm_up"], "the warm-up compiled nothing"
    assert not any(dry_run["warm_up"]), "compiles ran on the main thread, not in the pool"
    assert dry_run["steps"] == [], f"the steps after the warm-up compiled {len(dry_run['steps'])} kernels"


def test_the_warm_up_leaves_the_model_and_the_generators_as_they_were(dry_run):
    assert dry_run["kept"] == {"rng": True, "grads": True, "eval": True}


def test_bucket_shapes_are_the_lengths_of_pad_to_buckets():
    config = small_config(n_enc_seq=40)
    assert warmup.bucket_shapes(config, 8) == [(8, 16), (8, 32), (8, 40)]
    # the data's lengths: only the buckets their longest-review batches can reach
    assert warmup.bucket_shapes(config, 8, [3, 5, 16]) == [(8, 16)]
    assert warmup.bucket_shapes(config, 8, [3, 17, 39]) == [(8, 16), (8, 32), (8, 40)]


def test_nothing_to_compile_on_the_reference_or_the_interpreter():
    model = fastformer.MovieClassification(small_config())
    with fastformer.use_backend("reference"):
        assert warmup.warm_up(model, [(2, 16)], device="cpu", amp="off", progress=False) == {
            "shapes": 0,
            "seconds": 0.0,
        }
    assert all(p.grad is None for p in model.parameters())
    assert torch.is_grad_enabled()
