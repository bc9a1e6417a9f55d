"""tools.launches: its kernel counter against hand-counted ops and Triton launches, counts that do
not depend on the batch, and the model-side cuts it measures (autocast's results, bit for bit)."""

import json

import pytest
import torch

import fastformer
from fastformer import kernels
from tests.helpers import small_config, token_batch
from tools import launches

# the tutorial's structure at widths the interpreter runs quickly (the counts do not depend on widths)
NARROW = {"n_layer": 1, "d_hidn": 32, "n_head": 2, "d_head": 16, "d_ff": 64}


@pytest.mark.parametrize("input_grad", [False, True], ids=["x-no-grad", "x-grad"])
def test_counter_matches_the_kernels_of_linear_relu_sum(input_grad):
    """Forward: addmm, relu, sum. Backward: the seed's ones_like, threshold_backward, mm and sum
    for the weight and bias, and one more mm when x needs a gradient. Views (t, expand, view,
    detach), an allocation and two host reads (.item(), .tolist()) launch no kernel."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(8, 4)
    x = torch.randn(3, 8, requires_grad=input_grad)
    with launches.counting("cpu") as counter:
        y = linear(x).relu().sum()
        x.view(24).unsqueeze(0).t()
        torch.empty(5)
        y.item()
        x[0, :2].tolist()
        counter.phase = "backward"
        y.backward()
    assert counter.ops("forward") == {"aten.addmm": 1, "aten.relu": 1, "aten.sum": 1}
    assert counter.ops("backward") == {
        "aten.ones_like": 1,
        "aten.threshold_backward": 1,
        "aten.mm": 2 if input_grad else 1,
        "aten.sum": 1,
    }
    assert sum(counter.syncs.values()) == 2


@torch.library.custom_op("launches_test::cast_sum", mutates_args=())
def cast_sum(x: torch.Tensor) -> torch.Tensor:
    """A torch.library op whose implementation runs CompositeImplicitAutograd ops (to, reshape)."""
    return x.to(torch.float64).reshape(-1).sum()


def test_ops_without_a_kernel_count_the_kernels_they_run():
    """masked_fill is clone and masked_fill_, isinf abs and eq, zeros one fill; copy_ runs its copy
    itself. Inside a torch.library op, `.to` is a cast or nothing and a contiguous reshape a view."""
    x = torch.randn(4, 3)
    x64 = x.double()
    with launches.counting("cpu") as counter:
        x.masked_fill(x > 0, 0.0)
        x.isinf()
        torch.zeros(3)
        torch.empty(4, 3).copy_(x)
        cast_sum(x)
        cast_sum(x64)
    assert counter.ops("forward") == {
        "aten.gt": 1,
        "aten.masked_fill": 2,
        "aten.isinf": 2,
        "aten.zeros": 1,
        "aten.copy_": 1,
        "aten._to_copy": 1,
        "aten.sum": 2,
    }


def test_counter_counts_triton_launches_and_not_what_the_interpreter_runs():
    """add_layer_norm is a torch.library op around Triton kernels (one forward; in the backward its
    kernel and the second pass of the weight and bias sums): the counter sees the launches inside
    it, and none of the copies Triton's interpreter makes of the arguments."""
    torch.manual_seed(0)
    x = torch.randn(6, 16, requires_grad=True)
    residual = torch.randn(6, 16)
    weight, bias = torch.ones(16, requires_grad=True), torch.zeros(16, requires_grad=True)
    dy = torch.randn(6, 16)
    with launches.counting("cpu") as counter:
        y = kernels.add_layer_norm(x, residual, weight, bias, 1e-5)
        counter.phase = "backward"
        y.backward(dy)
    forward, backward = counter.ops("forward"), counter.ops("backward")
    assert forward == {"triton._add_ln_fwd_kernel": 1}
    assert backward["triton._add_ln_bwd_kernel"] == 1
    assert {op for op in backward if op.startswith("triton.")} == {
        "triton._add_ln_bwd_kernel",
        "triton._sum_partials_kernel",
    }
    assert "aten.copy_" not in backward


@pytest.mark.parametrize("dropout_p", [0.0, 0.1], ids=["no-dropout", "dropout"])
def test_an_attention_call_is_its_kernels_alone(dropout_p):
    """With key padding (a fully padded sequence included) and a causal mask, the forward is one
    Triton launch (and the seed's draw under dropout) and the backward two: the padding's extent,
    the fully masked rows and delta = rowsum(dO * O) are found inside the kernels, and autograd
    makes no zero gradients for the lse and the seed."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 5, 16, requires_grad=True) for _ in range(3))
    pad = torch.tensor([[False, False, True, False, True], [True] * 5])
    grad_out = torch.randn(2, 2, 5, 16)
    with launches.counting("cpu") as counter:
        out = kernels.attention(q, k, v, key_padding_mask=pad, causal=True, dropout_p=dropout_p)
        counter.phase = "backward"
        torch.autograd.grad(out, (q, k, v), grad_out)  # the gradients as they are, not copied into .grad
    seed = {"aten.randint": 1} if dropout_p else {}
    assert counter.ops("forward") == {"triton._attn_fwd_kernel": 1, **seed}
    assert counter.ops("backward") == {"triton._attn_bwd_kernel": 2}  # its dQ pass, then its dK/dV pass


def test_a_self_attention_call_is_its_kernels_alone():
    """self_attention on a fused QKV projection, counted (a dispatch mode: its registered ops run):
    one forward launch and the backward's two, which write qkv's gradient as one tensor; no stack
    of dq, dk and dv (which unbind's backward would make), no copy."""
    torch.manual_seed(0)
    qkv = torch.randn(2, 5, 3 * 2 * 16, requires_grad=True)
    pad = torch.tensor([[False, False, True, False, True], [True] * 5])
    grad_out = torch.randn(2, 5, 2 * 16)
    with launches.counting("cpu") as counter:
        out = kernels.self_attention(qkv, 2, key_padding_mask=pad, causal=True)
        counter.phase = "backward"
        (grad,) = torch.autograd.grad(out, (qkv,), grad_out)
    assert counter.ops("forward") == {"triton._attn_fwd_kernel": 1}
    assert counter.ops("backward") == {"triton._attn_bwd_kernel": 2}
    assert grad.shape == qkv.shape


@pytest.mark.parametrize("provider", list(launches.PROVIDERS))
def test_counts_depend_on_neither_batch_nor_review_length(provider):
    """Every op lands in a layer type, no op meets CUDA's fp32 autocast policy with half inputs,
    and two shapes give the same counts, op for op."""
    config = fastformer.Config.tutorial(**NARROW)
    for step in launches.STEPS:
        counts = [launches.count_step(provider, step, config, *shape, "cpu") for shape in ((2, 8), (3, 13))]
        assert counts[0].kernels == counts[1].kernels, step
        assert counts[0].syncs == counts[1].syncs, step
        summary = launches.summary(counts[0])
        assert "other" not in summary["by_layer"], summary["ops"].get("other")
        assert not summary["autocast_mismatches"]
        assert (summary["triton"] > 0) == (provider == "fastformer")


def test_main_prints_the_table_and_writes_the_json(tmp_path, capsys):
    out = tmp_path / "launches.json"
    launches.main(["--providers", "reference_fp32", "reference_bf16", "--out", str(out)])
    report = json.loads(out.read_text())
    assert report["config"] == dict(fastformer.Config.tutorial())
    assert report["shape"] == {"batch": launches.SHAPE["batch"], "enc_len": launches.SHAPE["enc_len"], "dec_len": 1}
    fp32 = report["providers"]["reference_fp32"]
    assert fp32["autocast"] is None and report["providers"]["reference_bf16"]["autocast"] == "bfloat16"
    train = fp32["train"]
    assert train["kernels"] == sum(train["by_phase"].values()) == sum(train["by_layer"].values())
    assert set(train["by_phase"]) == set(launches.PHASES)
    table = capsys.readouterr().out
    assert f"| **kernels** | {train['kernels']} |" in table
    with pytest.raises(SystemExit):
        launches.main(["--batch", "1", "--out", str(out)])


@pytest.mark.parametrize(
    "backend, dtype",
    # the Triton path in one dtype only: through the interpreter each one is a slow run
    [("reference", torch.bfloat16), ("triton", torch.float16)],
)
def test_the_forward_plan_casts_once_and_gives_autocasts_results_bit_for_bit(backend, dtype, monkeypatch):
    """Under autocast a ForwardPlan casts all its layers' weights in one go and add + LayerNorm
    writes the half-precision copy the next product reads: fewer kernels, and the outputs and every
    gradient equal those of autocast casting each weight and each activation at its use."""
    # two layers, so that a layer's product reads the half copy the layer before wrote; 2 reviews
    # and 2 heads, since the interpreter's time grows with batch x heads and the counts do not
    config = small_config(n_layer=2, n_head=2)
    torch.manual_seed(0)
    model = fastformer.MovieClassification(config)
    enc, dec = token_batch(config, bs=2, enc_len=8, dec_len=5)  # lengths 8 and 1; 5 and 3

    def train_step():
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1)  # the same dropout draws
        with launches.counting("cpu") as counter, fastformer.use_backend(backend):
            with torch.autocast("cpu", dtype=dtype):
                logits = model(enc, dec)[0]
            counter.phase = "backward"
            logits.float().sum().backward()
        return logits, {name: p.grad for name, p in model.named_parameters()}, counter

    def casts(counter, phase):
        """Casts in the layers: the attention, feed-forward and add + LayerNorm rows."""
        layers = ("attention", "feed-forward", "add + LayerNorm")
        kernels = counter.kernels.items()
        return sum(n for (p, layer, op), n in kernels if p == phase and layer in layers and op == "aten._to_copy")

    logits, grads, counter = train_step()
    with monkeypatch.context() as patch:
        patch.setattr(fastformer.plan, "autocast_dtype", lambda layers, like: None)
        expected_logits, expected_grads, expected_counter = train_step()
    assert torch.equal(logits, expected_logits)
    for name, grad in expected_grads.items():
        assert (grads[name] is None and grad is None) or torch.equal(grads[name], grad), name
    assert sum(counter.kernels.values()) < sum(expected_counter.kernels.values())
    # one concatenation and one cast of the weights per Encoder and per Decoder forward
    weights = {
        op: n for (p, layer, op), n in counter.kernels.items() if p == "forward" and layer == "weight cat + cast"
    }
    assert weights == {"aten.cat": 2, "aten._to_copy": 2}
    if backend == "triton":  # the reference ops cast inside themselves
        # what is left: the two embeddings' sums and the encoder output, cast for their first product
        assert casts(counter, "forward") == casts(counter, "backward") == 3
        assert casts(expected_counter, "forward") > 3
        # the kernels' dropout seeds: one draw per Encoder and per Decoder forward
        randint = {layer: n for (p, layer, op), n in counter.kernels.items() if op == "aten.randint"}
        assert randint == {"dropout seeds": 2}


@pytest.mark.parametrize("dec_len", [1, 3])
def test_the_head_takes_one_decoder_position_as_a_view_bit_for_bit(dec_len):
    """MovieClassification's max over the decoder positions: over one position (the [BOS] token the
    tutorial and the job feed) a view, no max forward and no zeros + scatter backward, with the
    logits and every gradient of torch.max's; over more, torch.max as the tutorial computes it."""
    config = small_config(**NARROW)
    torch.manual_seed(0)
    model = fastformer.MovieClassification(config)
    enc, dec = token_batch(config, bs=2, enc_len=6, dec_len=dec_len)

    def step(forward):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1)  # the same dropout draws
        with launches.counting("cpu") as counter, fastformer.use_backend("reference"):
            logits = forward()
            counter.phase = "backward"
            logits.sum().backward()
        ops = {op for (_, _, op) in counter.kernels}
        return logits, {name: p.grad for name, p in model.named_parameters()}, ops

    def tutorial():
        dec_outputs = model.transformer(enc, dec)[0]
        return model.projection(torch.max(dec_outputs, dim=1)[0])

    logits, grads, ops = step(lambda: model(enc, dec)[0])
    expected_logits, expected_grads, expected_ops = step(tutorial)
    assert torch.equal(logits, expected_logits)
    for name, grad in expected_grads.items():
        assert (grads[name] is None and grad is None) or torch.equal(grads[name], grad), name
    assert {"aten.max", "aten.scatter"} <= expected_ops
    assert ("aten.max" in ops) == ("aten.scatter" in ops) == (dec_len > 1)
