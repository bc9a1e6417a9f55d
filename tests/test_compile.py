"""torch.compile(fullgraph=True) of the drop-in models over the Triton ops, on this machine's torch
and Triton: train mode, dropout, padding, bf16 autocast, two sequence lengths, forward and
backward, with the aot_eager and inductor backends (how, and where a CPU must stop: the docstring
of tests/compile_harness.py). CI runs this on the newest and on the oldest supported stack."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

pytestmark = pytest.mark.versions

ROOT = Path(__file__).resolve().parent.parent
MODELS = ("movie", "seq2seq")
BACKENDS = ("aot_eager", "inductor")


@pytest.fixture(scope="module")
def results():
    """{(model, backend): result} from one harness process (the kernels must be imported there
    without TRITON_INTERPRET, which this test process has set)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.compile_harness", "--models", *MODELS, "--backends", *BACKENDS],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return {(r["model"], r["backend"]): r for r in json.loads(proc.stdout.strip().splitlines()[-1])}


# the kernels a train step of each model launches: attention both ways, the FFN, add + LayerNorm
KERNELS = {
    "movie": {
        "_attn_fwd_kernel",
        "_attn_bwd_kernel",
        "_linear_gelu_fwd_kernel",
        "_activation_grad_kernel",
        "_add_ln_fwd_kernel",
        "_add_ln_bwd_kernel",
    },
    "seq2seq": {"_attn_fwd_kernel", "_attn_bwd_kernel", "_linear_gelu_fwd_kernel", "_activation_grad_kernel"},
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("model", MODELS)
def test_the_model_compiles_as_one_graph_forward_and_backward(results, model, backend):
    result = results[(model, backend)]
    assert "error" not in result, result["error"]
    assert result["lengths"] == {str(n): {"forward": True, "backward": True} for n in (13, 20)}, result
    missing = KERNELS[model] - set(result["kernels"])
    assert not missing, f"the compiled {model} did not launch {sorted(missing)}: not on the Triton path"
    if backend == "inductor":
        # each length's graphs: the second length recompiles them with dynamic shapes
        assert result["lowered"] == ["forward", "backward"] * 2, result["lowered"]


def test_the_inductor_backend_stops_only_where_a_cpu_must(monkeypatch):
    """The harness lets through Triton's missing cpu backend and nothing else: any other error of
    Inductor's fails, and so would a compile that went through (it cannot, on a CPU)."""
    import torch
    import torch._inductor.compile_fx

    from tests import compile_harness

    def inductor_raising(error):
        def compile_fx_inner(gm, example_inputs, **kwargs):
            raise error

        monkeypatch.setattr(torch._inductor.compile_fx, "compile_fx_inner", compile_fx_inner)

    gm = torch.fx.symbolic_trace(torch.nn.ReLU())
    harness = compile_harness.InductorUntilTriton()
    inductor_raising(RuntimeError("0 compatible backends for target (cpu) ([]). There should only be one."))
    run = harness.inner_compile(gm, [torch.zeros(2)], is_backward=True)
    assert harness.lowered == ["backward"]
    assert torch.equal(run([torch.tensor([-1.0, 2.0])]), torch.tensor([0.0, 2.0]))  # the graph as given
    inductor_raising(NotImplementedError("torch.bool is not supported by torch.iinfo"))
    with pytest.raises(NotImplementedError, match="iinfo"):
        harness.inner_compile(gm, [torch.zeros(2)])
    monkeypatch.setattr(torch._inductor.compile_fx, "compile_fx_inner", lambda gm, example_inputs, **kwargs: gm)
    with pytest.raises(AssertionError, match="compiled the forward graph"):
        harness.inner_compile(gm, [torch.zeros(2)])
    assert harness.lowered == ["backward"]
