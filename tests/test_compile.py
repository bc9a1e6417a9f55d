"""torch.compile(fullgraph=True) of the drop-in models over the Triton ops, on this machine's torch
and Triton: train mode, dropout, padding, bf16 autocast, two sequence lengths, forward and
backward, with the aot_eager and inductor backends, Inductor's Triton kernels compiled for sm_90a
(how: the docstring of tests/compile_harness.py). CI runs this on the newest and the oldest stack."""

import json

import pytest

pytest.importorskip("triton")

from tests import compile_early

pytestmark = pytest.mark.versions

MODELS, BACKENDS = compile_early.MODELS, compile_early.BACKENDS


@pytest.fixture(scope="module")
def results(request):
    """{(model, backend): result} from one harness process (the kernels must be imported there
    without TRITON_INTERPRET, which this test process has set), begun at nice 19 when collection
    ended, this module run last (tests/compile_early.py)."""
    returncode, stdout, stderr = compile_early.result(request.config)
    assert returncode == 0, stdout[-3000:] + stderr[-6000:]
    found = json.loads(stdout.strip().splitlines()[-1])
    return {(r["model"], r.get("backend", r.get("loop"))): r for r in found}


def test_the_harness_began_when_collection_ended_and_this_module_runs_last(results, request):
    """The results come from the harness tests/conftest.py began (tests/compile_early.py), and
    every test of this module comes after the others selected."""
    assert isinstance(request.config.stash.get(compile_early.HARNESS, None), compile_early.Harness)
    names = [item.path.name for item in request.session.items]
    assert names[names.index(compile_early.MODULE) :] == [compile_early.MODULE] * names.count(compile_early.MODULE)


# the kernels a train step of each model launches: attention both ways, the FFN both ways (its
# backward's dH GEMM with the activation gradient), add + LayerNorm
KERNELS = {
    "movie": {
        "_attn_fwd_kernel",
        "_attn_bwd_kernel",
        "_linear_gelu_fwd_kernel",
        "_ffn_act_grad_kernel",
        "_add_ln_fwd_kernel",
        "_add_ln_bwd_kernel",
    },
    "seq2seq": {"_attn_fwd_kernel", "_attn_bwd_kernel", "_linear_gelu_fwd_kernel", "_ffn_act_grad_kernel"},
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
        # Inductor compiled every kernel itself (for sm_90a here), with its own signature, in which
        # a Python float is fp64: each kernel casts its float arguments to fp32 first, or its math
        # runs in fp64 (add + LayerNorm) or fails to compile (attention's fp32 accumulator)
        missing = KERNELS[model] - set(result["inductor_compiled"])
        assert not missing, f"Inductor did not compile {sorted(missing)}"
        assert result["fp64_math"] == [], f"these kernels compute in fp64 under Inductor: {result['fp64_math']}"


def test_the_inductor_backend_lowers_or_fails(monkeypatch):
    """The harness's Inductor backend records a graph Inductor compiled and returns it as given;
    any error of Inductor's fails the run."""
    import torch
    import torch._inductor.compile_fx

    from tests import compile_harness

    gm = torch.fx.symbolic_trace(torch.nn.ReLU())
    harness = compile_harness.InductorForSm90()
    monkeypatch.setattr(torch._inductor.compile_fx, "compile_fx_inner", lambda gm, example_inputs, **kwargs: None)
    run = harness.inner_compile(gm, [torch.zeros(2)], is_backward=True)
    assert harness.lowered == ["backward"]
    assert torch.equal(run([torch.tensor([-1.0, 2.0])]), torch.tensor([0.0, 2.0]))  # the graph as given

    def compile_fx_inner(gm, example_inputs, **kwargs):
        raise NotImplementedError("torch.bool is not supported by torch.iinfo")

    monkeypatch.setattr(torch._inductor.compile_fx, "compile_fx_inner", compile_fx_inner)
    with pytest.raises(NotImplementedError, match="iinfo"):
        harness.inner_compile(gm, [torch.zeros(2)])
    assert harness.lowered == ["backward"]


def test_the_fp64_check_reads_ptx_arithmetic():
    from tests.compile_harness import FP64_ARITHMETIC

    assert FP64_ARITHMETIC.search("\tmul.rn.f64 \t%fd3, %fd1, %fd2;")
    assert FP64_ARITHMETIC.search("  fma.rn.f64 %fd4, %fd1, %fd2, %fd3;")
    assert FP64_ARITHMETIC.search("\tadd.f64 %fd2, %fd1, 0d3FF0000000000000;")
    assert not FP64_ARITHMETIC.search("\tcvt.rn.f32.f64 \t%f1, %fd1;")  # the cast to fp32 itself
    assert not FP64_ARITHMETIC.search("\tmul.f32 %f2, %f1, %f1;")
    assert not FP64_ARITHMETIC.search("\tld.param.f64 %fd1, [param_3];")


def test_the_drop_in_loop_compiles_once_per_bucket(results):
    """The tutorial's train step on the model compiled as mode="reduce-overhead" compiles it
    (fullgraph: no graph break) over batches padded by fastformer.pad_to_bucket: a graph for the
    first bucket, one more for the second (Dynamo's automatic dynamic shapes), then none for any
    batch of a bucket met before, whatever its longest review."""
    result = results[("movie", "reduce-overhead, bucketed")]
    assert "error" not in result, result["error"]
    batches = [(b["longest"], b["bucket"], b["frames"]) for b in result["batches"]]
    assert batches == [(5, 16, 1), (9, 16, 1), (14, 16, 1), (20, 24, 2), (3, 16, 2), (24, 24, 2), (12, 16, 2)]


def test_the_classifier_exports_with_fastformers_ops(results):
    """torch.export on the Triton path (the dry-run driver's, as on a GPU) holds fastformer's
    registered ops, so the exported program runs the kernels (docs/drop-in.md, Export)."""
    result = results[("movie", "torch.export")]
    assert "error" not in result, result.get("error")
    # self-attention on its fused projection, cross-attention on its heads
    ops = ("self_attention_forward", "attention_forward", "add_layer_norm_forward", "feed_forward_forward")
    expected = {f"fastformer.{op}.default" for op in ops}
    assert expected <= set(result["ops"]), result["ops"]
