"""The drop-in keeps PyTorch's module semantics: what hooks, prune, parametrizations, wrappers,
quantization and torch.func do with the tutorial's model, they do with fastformer's.

Each test pairs the tutorial's model (tests/tutorial.py) with fastformer's holding the same weights,
applies one PyTorch mechanism to both, and compares, on the reference backend and on the Triton one
(through the interpreter on a CPU). Dropout is 0 where outputs are compared in training mode: the
two models draw their masks differently.
"""

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.utils.parametrize as parametrize
from torch.nn.utils import prune

import fastformer
from fastformer.fusion import fusable
from fastformer.model import ENCODER_LAYERS_ROLES
from tests import tutorial
from tests.helpers import assert_max_diff, small_config, token_batch

BACKENDS = ["reference", "triton"]
TOL = 2e-5


def paired(dropout=0.0, output_attentions=True):
    """A tutorial model and a fastformer model with the same weights (2 layers), and a batch."""
    config = small_config(dropout=dropout, output_attentions=output_attentions)
    torch.manual_seed(0)
    ref = tutorial.MovieClassification(config)
    ours = fastformer.MovieClassification(config)
    ours.load_state_dict(ref.state_dict(), strict=True)
    enc, dec = token_batch(config, bs=3, enc_len=9, dec_len=4)
    return ref, ours, (enc, dec)


def submodules(model):
    """{name: module} of every submodule the tutorial calls (not the ModuleLists)."""
    return {name: m for name, m in model.named_modules() if name and not isinstance(m, nn.ModuleList)}


def tensors(value):
    """The tensors of a module's output or inputs, in order (None kept as None)."""
    if isinstance(value, torch.Tensor) or value is None:
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in tensors(v)]
    return []


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_submodule_hook_fires_with_the_tutorials_inputs_and_outputs(backend):
    """A forward pre-hook and a forward hook on every submodule: the same modules fire, in the same
    order, and each sees the tutorial's inputs and outputs (masks as the tutorial's dense tensors)."""
    ref, ours, batch = paired()
    seen = {}
    for tag, model in (("ref", ref), ("ours", ours)):
        log = seen[tag] = []
        for name, m in submodules(model).items():
            m.register_forward_pre_hook(lambda m, args, name=name, log=log: log.append((name, "in", tensors(args))))
            m.register_forward_hook(lambda m, args, out, name=name, log=log: log.append((name, "out", tensors(out))))
    ref.eval(), ours.eval()
    ref(*batch)
    with fastformer.use_backend(backend):
        ours(*batch)
    assert [entry[:2] for entry in seen["ours"]] == [entry[:2] for entry in seen["ref"]]
    assert len(seen["ref"]) == 2 * len(submodules(ref))
    for (name, kind, expected), (_, _, actual) in zip(seen["ref"], seen["ours"]):
        assert len(actual) == len(expected), f"{name} {kind}"
        for i, (a, e) in enumerate(zip(actual, expected)):
            where = f"{name} {kind}[{i}]"
            if e is None:
                assert a is None, where
            elif e.dtype == torch.bool:
                assert torch.equal(a.expand_as(e), e), where
            else:
                assert a.shape == e.shape, where
                assert_max_diff(where, a, e, TOL)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("where", ["pos_ffn.conv2", "self_attn", "pos_ffn", "self_attn.W_Q", "layer_norm1", ""])
def test_a_hook_that_returns_a_new_output_takes_effect(backend, where):
    """A forward hook that returns a modified output, on a leaf (conv2, W_Q, a LayerNorm), on a
    sublayer (self_attn, pos_ffn) or on a whole EncoderLayer: the logits follow the tutorial's."""
    ref, ours, batch = paired()

    def halve(module, args, out):
        if isinstance(out, tuple):
            return (out[0] * 0.5, *out[1:])
        return out * 0.5

    for model in (ref, ours):
        model.transformer.encoder.layers[0].get_submodule(where).register_forward_hook(halve)
    assert_logits_follow_the_tutorial(ref, ours, batch, backend, f"{where or 'layer'} halved", "_forward_hooks")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("where", ["pos_ffn.conv1", "self_attn", "pos_ffn", "self_attn.W_K", "layer_norm2", ""])
def test_a_pre_hook_that_returns_new_inputs_takes_effect(backend, where):
    """A forward pre-hook that returns modified inputs (its first tensor scaled along its last
    dim, which a LayerNorm cannot normalize away), on a leaf, a sublayer or a whole EncoderLayer:
    the logits follow the tutorial's."""
    ref, ours, batch = paired()

    def scale_first(module, args):
        return (args[0] * torch.linspace(0.5, 1.5, args[0].size(-1)), *args[1:])

    for model in (ref, ours):
        model.transformer.encoder.layers[0].get_submodule(where).register_forward_pre_hook(scale_first)
    what = f"{where or 'layer'}'s input scaled"
    assert_logits_follow_the_tutorial(ref, ours, batch, backend, what, "_forward_pre_hooks")


def assert_logits_follow_the_tutorial(ref, ours, batch, backend, what, hooks):
    """In eval mode, ours (on `backend`) gives the tutorial's logits with the hooks both hold, and
    the tutorial's model without them (its `hooks` dicts cleared) gives others: the hooks matter."""
    ref.eval(), ours.eval()
    expected = ref(*batch)[0]
    with fastformer.use_backend(backend):
        actual = ours(*batch)[0]
    assert_max_diff(f"logits, {what}", actual, expected, TOL)
    plain = copy.deepcopy(ref)
    for m in plain.modules():
        getattr(m, hooks).clear()
    assert (plain(*batch)[0] - expected).abs().max() > 1e-3, "the hook changes nothing: a test that cannot fail"


@pytest.mark.parametrize("backend", BACKENDS)
def test_full_backward_hooks_fire_with_the_tutorials_gradients(backend):
    ref, ours, batch = paired()
    grads = {}
    names = [
        "transformer.encoder.layers.0.self_attn.W_Q",
        "transformer.decoder.layers.1.pos_ffn.conv1",
        "transformer.encoder.layers.1.layer_norm2",
        "transformer.decoder.layers.0.dec_enc_attn",
    ]

    def keep(tag, name):
        def hook(module, grad_input, grad_output):
            grads.setdefault((tag, name), grad_output[0].clone())

        return hook

    for tag, model in (("ref", ref), ("ours", ours)):
        for name in names:
            model.get_submodule(name).register_full_backward_hook(keep(tag, name))
    ref(*batch)[0].sum().backward()
    with fastformer.use_backend(backend):
        ours(*batch)[0].sum().backward()
    for name in names:
        assert_max_diff(name, grads[("ours", name)], grads[("ref", name)], TOL)


def train_steps(model, batch, backend, steps=3):
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    losses = []
    labels = torch.tensor([0, 1, 2])
    for _ in range(steps):
        with fastformer.use_backend(backend):
            logits = model(*batch)[0]
        loss = torch.nn.functional.cross_entropy(logits, labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("backend", BACKENDS)
def test_prune_then_train(backend):
    """l1_unstructured on conv1 and W_Q (prune recomputes `weight` in a forward pre-hook), then three
    training steps: the same losses as the tutorial's, and the pruned weights stay zero."""
    ref, ours, batch = paired()
    for model in (ref, ours):
        layer = model.transformer.encoder.layers[0]
        prune.l1_unstructured(layer.pos_ffn.conv1, "weight", amount=0.5)
        prune.l1_unstructured(layer.self_attn.W_Q, "weight", amount=0.5)
    expected = train_steps(ref, batch, "reference")
    actual = train_steps(ours, batch, backend)
    assert actual == pytest.approx(expected, abs=1e-5)
    conv1 = ours.transformer.encoder.layers[0].pos_ffn.conv1
    assert (conv1.weight[conv1.weight_mask == 0] == 0).all()


class Halved(nn.Module):
    def forward(self, weight):
        return weight * 0.5


@pytest.mark.parametrize("backend", BACKENDS)
def test_weight_parametrizations(backend):
    ref, ours, batch = paired()
    for model in (ref, ours):
        layer = model.transformer.decoder.layers[0]
        parametrize.register_parametrization(layer.self_attn.W_Q, "weight", Halved())
        parametrize.register_parametrization(layer.pos_ffn.conv1, "weight", Halved())
    expected = train_steps(ref, batch, "reference", steps=2)
    actual = train_steps(ours, batch, backend, steps=2)
    assert actual == pytest.approx(expected, abs=1e-5)


class LoRA(nn.Module):
    """A LoRA-style wrapper: the base Linear, frozen, plus a trained low-rank delta."""

    def __init__(self, base, rank=2):
        super().__init__()
        self.base = base
        self.base.requires_grad_(False)
        self.down = nn.Linear(base.in_features, rank, bias=False)
        self.up = nn.Linear(rank, base.out_features, bias=False)
        nn.init.normal_(self.up.weight, std=0.1)

    def forward(self, x):
        return self.base(x) + self.up(self.down(x))


class Adapter(nn.Module):
    """An adapter as adapter libraries make it: `.weight` is still the base weight (so code that
    reads it finds the base), the forward adds a trained bottleneck."""

    def __init__(self, base):
        super().__init__()
        self.base = base
        self.weight, self.bias = base.weight, base.bias
        self.in_features, self.out_features = base.in_features, base.out_features
        self.adapter = nn.Sequential(nn.Linear(base.out_features, 4), nn.ReLU(), nn.Linear(4, base.out_features))

    def forward(self, x):
        y = self.base(x)
        return y + self.adapter(y)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("wrapper", [LoRA, Adapter])
def test_wrapped_projections_are_called_and_trained(backend, wrapper):
    ref, ours, batch = paired()
    torch.manual_seed(5)
    for model in (ref, ours):
        for layer in model.transformer.encoder.layers:
            torch.manual_seed(5)
            layer.self_attn.W_Q = wrapper(layer.self_attn.W_Q)
            layer.self_attn.W_V = wrapper(layer.self_attn.W_V)
    ours.load_state_dict(ref.state_dict(), strict=True)
    expected = train_steps(ref, batch, "reference")
    actual = train_steps(ours, batch, backend)
    assert actual == pytest.approx(expected, abs=1e-5)
    assert expected[0] != expected[-1]


@pytest.mark.parametrize(
    "backend, reentrant",
    # the Triton path through the interpreter once (25 s here): recomputed, non-reentrant checkpointing
    # holds its saved tensors to the first pass's, which a backward outside the use_backend block breaks
    [("reference", True), ("reference", False), ("triton", False)],
    ids=["reference-reentrant", "reference-non-reentrant", "triton-non-reentrant"],
)
def test_activation_checkpointing_of_every_layer_trains_as_the_tutorial(backend, reentrant):
    """`layer.forward = partial(checkpoint, layer.forward, use_reentrant=...)` on every encoder and
    decoder layer (a forward set on the instance: the layers then run as the tutorial calls them,
    positional arguments only, which reentrant checkpointing needs): the tutorial's losses, checkpointed
    the same way (issue 68, item 5; it used to raise `Unexpected keyword arguments: plan`)."""
    from functools import partial

    from torch.utils.checkpoint import checkpoint

    ref, ours, batch = paired()
    for model in (ref, ours):
        for layer in (*model.transformer.encoder.layers, *model.transformer.decoder.layers):
            layer.forward = partial(checkpoint, layer.forward, use_reentrant=reentrant)
    assert not fusable(ours.transformer.encoder.layers, ENCODER_LAYERS_ROLES)
    expected = train_steps(ref, batch, "reference", steps=2)
    with fastformer.use_backend(backend):  # the backward's recomputation too (docs/backends.md)
        actual = train_steps(ours, batch, backend, steps=2)
    assert actual == pytest.approx(expected, abs=1e-5)
    assert expected[0] != expected[-1]
    for layer in ours.transformer.encoder.layers:
        del layer.forward  # back to the class's: the fusions again, at once
    assert fusable(ours.transformer.encoder.layers, ENCODER_LAYERS_ROLES)


@pytest.mark.parametrize("backend", BACKENDS)
def test_functional_call_and_vmap(backend):
    ref, ours, batch = paired()
    ref.eval(), ours.eval()
    params = {name: p.detach() * 1.01 for name, p in ref.named_parameters()}
    expected = torch.func.functional_call(ref, params, batch)[0]
    with fastformer.use_backend(backend):
        actual = torch.func.functional_call(ours, params, batch)[0]
    assert_max_diff("functional_call", actual, expected, TOL)

    enc, dec = batch
    stacked = torch.stack([enc, enc.flip(0)]), torch.stack([dec, dec.flip(0)])
    expected = torch.func.vmap(lambda e, d: ref(e, d)[0])(*stacked)
    with fastformer.use_backend(backend):
        actual = torch.func.vmap(lambda e, d: ours(e, d)[0])(*stacked)
    assert_max_diff("vmap", actual, expected, TOL)


@pytest.mark.parametrize("backend", BACKENDS)
def test_quantization_observers_by_hooks_and_dynamic_quantization(backend):
    """torch.ao.quantization: observers attached by prepare's hooks see the tutorial's activations
    (the same ranges after calibration); quantize_dynamic's module swap gives the tutorial's outputs."""
    ao = pytest.importorskip("torch.ao.quantization")
    ref, ours, batch = paired()
    ref.eval(), ours.eval()
    prepared = {}
    for tag, model in (("ref", ref), ("ours", ours)):
        model = copy.deepcopy(model)
        model.qconfig = ao.default_qconfig
        ao.prepare(model, inplace=True)
        with fastformer.use_backend(backend if tag == "ours" else "reference"):
            model(*batch)
        prepared[tag] = model
    ranges = {
        tag: {
            name: (m.min_val.item(), m.max_val.item())
            for name, m in model.named_modules()
            if name.endswith("activation_post_process") and m.min_val.numel()
        }
        for tag, model in prepared.items()
    }
    assert ranges["ours"].keys() == ranges["ref"].keys() and len(ranges["ref"]) > 20
    for name, (low, high) in ranges["ref"].items():
        assert ranges["ours"][name] == pytest.approx((low, high), abs=1e-5), name

    q_ref = ao.quantize_dynamic(copy.deepcopy(ref), {nn.Linear}, dtype=torch.qint8)
    q_ours = ao.quantize_dynamic(copy.deepcopy(ours), {nn.Linear}, dtype=torch.qint8)
    expected = q_ref(*batch)[0]
    with fastformer.use_backend(backend):
        actual = q_ours(*batch)[0]
    assert_max_diff("quantize_dynamic", actual, expected, 1e-4)


# the dynamic scheme on the reference alone: the Triton backend's interpreter costs 7 s a case
@pytest.mark.parametrize(
    ("scheme", "backend"),
    [
        ("Int8WeightOnlyConfig", "reference"),
        ("Int8WeightOnlyConfig", "triton"),
        ("Int8DynamicActivationInt8WeightConfig", "reference"),
    ],
)
def test_torchao_quantized_weights_run_module_by_module_as_the_tutorials_do(scheme, backend, monkeypatch):
    """torchao's quantize_ puts tensor subclasses in the Linears' weights; the fused path, which
    concatenates W_Q, W_K and W_V, failed on them (aten.cat on Int8Tensor). The layers now run
    module by module, the subclass's kernels doing the products, said once, and give the
    tutorial's model quantized the same way; a model that fused before quantize_ stops fusing."""
    quantization = pytest.importorskip("torchao.quantization", reason="torchao is not installed")
    monkeypatch.setattr(fastformer.kernels._runtime, "_warned", set())
    ref, ours, batch = paired()
    ref.eval(), ours.eval()
    unquantized = ref(*batch)[0]
    with fastformer.use_backend(backend):
        ours(*batch)  # fused, the answer kept on the layers
    assert fusable(ours.transformer.encoder.layers, ENCODER_LAYERS_ROLES)
    for model in (ref, ours):
        quantization.quantize_(model, getattr(quantization, scheme)())
    weight = ours.transformer.encoder.layers[0].self_attn.W_Q.weight
    assert type(weight) not in (torch.Tensor, nn.Parameter)
    expected = ref(*batch)[0]
    with fastformer.use_backend(backend), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        actual = ours(*batch)[0]
        ours(*batch)
    if scheme == "Int8WeightOnlyConfig":
        assert_max_diff(scheme, actual, expected, TOL)
    else:
        # the feed-forward (its Conv1d weights are not quantized) and the attention still fuse, as
        # they do unquantized, and their rounding (2e-7) moves some activations across a step of the
        # per-token int8 quantizer: the parity rule against the unquantized model then
        quantization_error = (expected - unquantized).abs().max().item()
        assert_max_diff(scheme, actual, unquantized, 2 * quantization_error + TOL)
    assert not fusable(ours.transformer.encoder.layers, ENCODER_LAYERS_ROLES)
    said = [str(w.message) for w in caught if "tensor subclass" in str(w.message)]
    assert len(said) == 1 and type(weight).__name__ in said[0] and "module by module" in said[0], said


@pytest.fixture
def process_group():
    """A gloo process group of this one process, as torchrun's rank 0 of 1 has (no port taken)."""
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("this torch build has no gloo process groups")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("per_layer", [True, False], ids=["fully_shard per layer", "fully_shard the model"])
def test_fsdp2_trains_as_the_plain_model_and_says_when_it_turns_the_fusions_off(process_group, per_layer, monkeypatch):
    """FSDP2's fully_shard of each layer changes the layer's class and hooks it, so the layers run
    module by module (no fused add + LayerNorm: its calls counted), said once in one line that
    names the way out; fully_shard of the model alone keeps every fusion, silently. Both train as
    the unwrapped model does, step for step (AdamW)."""
    fully_shard = pytest.importorskip("torch.distributed.fsdp").fully_shard
    monkeypatch.setattr(fastformer.kernels._runtime, "_warned", set())
    calls = []
    for name in ("add_layer_norm", "add_layer_norm_reference"):  # what a layer plan's add + LayerNorm calls
        op = getattr(fastformer.kernels, name)
        monkeypatch.setattr(fastformer.kernels, name, lambda *a, op=op, **k: calls.append(1) or op(*a, **k))
    _, sharded, (enc, dec) = paired()
    plain = copy.deepcopy(sharded)
    if per_layer:
        for layer in [*sharded.transformer.encoder.layers, *sharded.transformer.decoder.layers]:
            fully_shard(layer)
    fully_shard(sharded)
    labels = torch.arange(enc.size(0)) % 2
    optimizers = {id(m): torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (sharded, plain)}
    n_layer = sharded.config.n_layer
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            losses = []
            for model in (sharded, plain):
                before = len(calls)
                loss = torch.nn.functional.cross_entropy(model(enc, dec)[0], labels)
                fused = len(calls) - before
                loss.backward()
                optimizers[id(model)].step()
                optimizers[id(model)].zero_grad()
                losses.append(loss.detach())
                if model is plain or not per_layer:
                    assert fused == 2 * n_layer + 3 * n_layer, (step, model is plain)  # encoder 2 a layer, decoder 3
                else:
                    assert fused == 0, step
            assert_max_diff(f"loss at step {step}", losses[0], losses[1], TOL)
    said = [str(w.message) for w in caught if "FSDP" in str(w.message)]
    if per_layer:
        assert len(said) == 1 and "module by module" in said[0] and "fully_shard(model)" in said[0], said
        assert "\n" not in said[0]
    else:
        assert said == []


def test_stock_unhooked_layers_keep_their_fusions():
    """Nothing observed, the layers fuse; a hook or a swap anywhere in them, or a global module hook,
    and they do not; removing the hook and the swap brings the fusions back (on the next registration
    of anything, the kept answer being refreshed then)."""
    _, ours, _ = paired()
    layers = ours.transformer.encoder.layers
    assert fusable(layers, ENCODER_LAYERS_ROLES)
    handle = layers[1].pos_ffn.dropout.register_forward_hook(lambda *args: None)
    assert not fusable(layers, ENCODER_LAYERS_ROLES)
    handle.remove()
    original = layers[0].self_attn.linear
    layers[0].self_attn.linear = LoRA(original)
    assert not fusable(layers, ENCODER_LAYERS_ROLES)
    layers[0].self_attn.linear = original
    assert fusable(layers, ENCODER_LAYERS_ROLES)
    handle = nn.modules.module.register_module_forward_hook(lambda *args: None)
    try:
        assert not fusable(layers, ENCODER_LAYERS_ROLES)
    finally:
        handle.remove()
    assert fusable(layers, ENCODER_LAYERS_ROLES)


@pytest.mark.parametrize("autocast", [False, True])
def test_the_forward_plan_reads_what_the_modules_hold_at_each_call(autocast):
    """The fused path keeps where each weight lives between forwards (fastformer.plan.layout), not
    the weights: a parameter replaced, one changed in place, a submodule replaced by a new stock
    one and a layer deleted are each what the next forward runs with, as in the tutorial's model."""
    ref, ours, batch = paired()
    ref.eval(), ours.eval()

    def same_outputs():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            expected, actual = ref(*batch)[0], ours(*batch)[0]
        assert_max_diff("logits", actual, expected, 2e-2 if autocast else TOL)

    def change(how):
        for model in (ref, ours):
            torch.manual_seed(1)
            how(model.transformer)
        same_outputs()

    def new_weight(transformer):
        W_Q = transformer.encoder.layers[0].self_attn.W_Q
        W_Q.weight = nn.Parameter(torch.randn_like(W_Q.weight))

    def new_linear(transformer):
        attn = transformer.decoder.layers[0].dec_enc_attn
        attn.W_K = nn.Linear(attn.W_K.in_features, attn.W_K.out_features)

    same_outputs()  # the layouts are made here
    change(new_weight)
    change(lambda transformer: transformer.decoder.layers[1].pos_ffn.conv2.weight.data.mul_(-3))
    change(new_linear)
    change(lambda transformer: transformer.encoder.layers.__delitem__(0))


def test_double_backward_works_on_the_reference_and_is_refused_by_the_fused_kernels():
    """A gradient penalty (the parameters' gradients taken with create_graph=True, then the
    backward of their squared norm): on the reference backend, the tutorial's second derivative;
    the fused kernels have none, so their backward refuses with the fix, rather than hand back
    gradients that would leave their part out of it."""
    ref, ours, batch = paired()
    labels = torch.tensor([0, 1, 0])

    def penalty(model):
        loss = nn.functional.cross_entropy(model(*batch)[0], labels)
        params = [p for p in model.parameters() if p.requires_grad]
        grads = torch.autograd.grad(loss, params, create_graph=True, allow_unused=True)
        value = sum(g.pow(2).sum() for g in grads if g is not None)
        return value, torch.autograd.grad(value, params, allow_unused=True)

    expected, expected_grads = penalty(ref)
    with fastformer.use_backend("reference"):
        value, grads = penalty(ours)
    assert_max_diff("penalty", value, expected, TOL)
    for i, (got, want) in enumerate(zip(grads, expected_grads)):
        assert (got is None) == (want is None), i
        if got is not None:
            assert_max_diff(f"the penalty's gradient {i}", got, want, TOL)
    with fastformer.use_backend("triton"), pytest.raises(RuntimeError, match="use_backend\\('reference'\\)"):
        penalty(ours)
