"""fastformer is a drop-in for the tutorial: same API, state_dict, and outputs on the reference path."""

import inspect

import pytest
import torch

import fastformer
from fastformer import Config
from tests import tutorial
from tests.helpers import assert_max_diff, small_config, token_batch

PUBLIC_MODULES = [
    "ScaledDotProductAttention",
    "MultiHeadAttention",
    "PoswiseFeedForwardNet",
    "EncoderLayer",
    "Encoder",
    "DecoderLayer",
    "Decoder",
    "Transformer",
    "MovieClassification",
]


def paired_models(config, cls_name="MovieClassification"):
    """A tutorial model and a fastformer model holding the same weights."""
    torch.manual_seed(0)
    ref = getattr(tutorial, cls_name)(config)
    ours = getattr(fastformer, cls_name)(config)
    ours.load_state_dict(ref.state_dict(), strict=True)
    return ref, ours


def test_exports_the_tutorial_names():
    for name in [
        *PUBLIC_MODULES,
        "Config",
        "get_sinusoid_encoding_table",
        "get_attn_pad_mask",
        "get_attn_decoder_mask",
        "pad_to_bucket",  # not the tutorial's: the bucket padding a compiled or replayed step wants
    ]:
        assert hasattr(fastformer, name), name
    assert isinstance(fastformer.__version__, str)


@pytest.mark.parametrize("name", PUBLIC_MODULES)
def test_signatures_match_the_tutorial(name):
    """The tutorial's parameters, in its order; anything more is keyword-only with a default (the
    `plan` of a layer, an attention or a feed-forward, ScaledDotProductAttention's `seed`, the
    Encoder's `ids_name`), so every call the tutorial's code makes binds the same."""
    ours, theirs = getattr(fastformer, name), getattr(tutorial, name)
    assert list(inspect.signature(ours.__init__).parameters) == ["self", "config"]
    params = list(inspect.signature(ours.forward).parameters.values())
    tutorials = list(inspect.signature(theirs.forward).parameters)
    assert [p.name for p in params[: len(tutorials)]] == tutorials
    assert all(p.kind is not inspect.Parameter.KEYWORD_ONLY for p in params[: len(tutorials)])
    for extra in params[len(tutorials) :]:
        assert extra.kind is inspect.Parameter.KEYWORD_ONLY and extra.default is None, extra


@pytest.mark.parametrize("name", PUBLIC_MODULES[1:])
def test_state_dict_names_and_shapes_match(name):
    config = small_config()
    ours = getattr(fastformer, name)(config).state_dict()
    theirs = getattr(tutorial, name)(config).state_dict()
    assert {k: tuple(v.shape) for k, v in ours.items()} == {k: tuple(v.shape) for k, v in theirs.items()}


def test_tutorial_checkpoint_loads_strictly_and_matches_in_eval(tmp_path):
    config = small_config(output_attentions=True)
    torch.manual_seed(0)
    ref = tutorial.MovieClassification(config)
    torch.save(ref.state_dict(), tmp_path / "tutorial.pt")
    ours = fastformer.MovieClassification(config)
    ours.load_state_dict(torch.load(tmp_path / "tutorial.pt"), strict=True)
    ref.eval(), ours.eval()
    enc, dec = token_batch(config)
    with fastformer.use_backend("reference"), torch.no_grad():
        expected, got = ref(enc, dec), ours(enc, dec)
    assert len(got) == len(expected) == 4
    assert_max_diff("logits", got[0], expected[0], 1e-5)
    for group, (exp_probs, got_probs) in enumerate(zip(expected[1:], got[1:])):
        assert len(got_probs) == config.n_layer
        for layer, (e, g) in enumerate(zip(exp_probs, got_probs)):
            assert_max_diff(f"probs group {group} layer {layer}", g, e, 1e-5)


def test_transformer_outputs_match_in_train_mode_with_dropout_zero():
    config = small_config(dropout=0.0)
    ref, ours = paired_models(config, "Transformer")
    enc, dec = token_batch(config, seed=1)
    with fastformer.use_backend("reference"):
        expected, got = ref(enc, dec)[0], ours(enc, dec)[0]
        upstream = torch.randn_like(expected)
        (expected * upstream).sum().backward()
        (got * upstream).sum().backward()
    assert_max_diff("dec_outputs", got, expected, 1e-5)
    ours_params = dict(ours.named_parameters())
    for name, p in ref.named_parameters():
        if p.grad is None:
            assert ours_params[name].grad is None, name
        else:
            assert_max_diff(f"grad {name}", ours_params[name].grad, p.grad, 1e-5)


@pytest.mark.parametrize("module", ["MovieClassification", "PoswiseFeedForwardNet"])
def test_a_seeded_run_on_the_reference_backend_draws_the_tutorials_dropout_masks(module):
    """Same seed, same run: in training mode with dropout, the reference backend draws every mask as
    the tutorial does, from torch's generator in the tutorial's order and on tensors of its layout
    (the feed-forward's dropout sees conv2's output transposed), so a seeded tutorial run and a
    seeded run of fastformer's model agree: the outputs, every gradient, and the outputs again
    after an AdamW step. (Before, the feed-forward's masks differed: 2.3e-2 in the logits.)"""
    config = small_config(dropout=0.3)
    ref, ours = paired_models(config, module)
    if module == "MovieClassification":
        enc, dec = token_batch(config, seed=2)
        inputs, output = (enc, dec), lambda out: out[0]
    else:
        x = torch.randn(3, 7, config.d_hidn, generator=torch.Generator().manual_seed(5))
        inputs, output = (x,), lambda out: out
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ref, ours)]
    with fastformer.use_backend("reference"):
        for step in range(2):
            outputs = []
            for model in (ref, ours):
                torch.manual_seed(10 + step)
                outputs.append(output(model(*inputs)))
                outputs[-1].square().mean().backward()
            expected, got = outputs
            assert_max_diff(f"output at step {step}", got, expected, 1e-5)
            ours_params = dict(ours.named_parameters())
            for name, p in ref.named_parameters():
                if p.grad is not None:
                    assert_max_diff(f"grad {name} at step {step}", ours_params[name].grad, p.grad, 1e-5)
            for optimizer in optimizers:
                optimizer.step()
                optimizer.zero_grad()


def test_layers_accept_the_tutorials_dense_masks():
    config = small_config(dropout=0.0, output_attentions=True)
    enc, dec = token_batch(config, seed=2)
    x = torch.randn(enc.size(0), enc.size(1), config.d_hidn)
    y = torch.randn(dec.size(0), dec.size(1), config.d_hidn)
    ref, ours = paired_models(config, "EncoderLayer")
    mask = tutorial.pad_mask(enc, enc, config.i_pad)
    with fastformer.use_backend("reference"):
        for e, g in zip(ref(x, mask), ours(x, mask)):
            assert_max_diff("encoder layer", g, e, 1e-5)
    ref, ours = paired_models(config, "DecoderLayer")
    self_mask = torch.gt(tutorial.pad_mask(dec, dec, 0) + tutorial.decoder_mask(dec), 0)
    cross_mask = tutorial.pad_mask(dec, enc, 0)
    with fastformer.use_backend("reference"):
        for e, g in zip(ref(y, x, self_mask, cross_mask), ours(y, x, self_mask, cross_mask)):
            assert_max_diff("decoder layer", g, e, 1e-5)


def test_scaled_dot_product_attention_takes_a_per_head_mask():
    config = small_config(dropout=0.0, output_attentions=True)
    q, k, v = (torch.randn(2, 4, 5, 8) for _ in range(3))
    mask = torch.rand(2, 4, 5, 5) < 0.3
    expected = tutorial.ScaledDotProductAttention(config)(q, k, v, mask)
    got = fastformer.ScaledDotProductAttention(config)(q, k, v, mask)
    for e, g in zip(expected, got):
        assert_max_diff("sdpa", g, e, 1e-5)


def test_mask_helpers_match_the_tutorial():
    seq_q = torch.tensor([[5, 6, 0], [7, 0, 0]])
    seq_k = torch.tensor([[1, 2, 3, 0], [0, 4, 0, 9]])
    assert torch.equal(fastformer.get_attn_pad_mask(seq_q, seq_k, 0), tutorial.pad_mask(seq_q, seq_k, 0))
    got = fastformer.get_attn_decoder_mask(seq_k)
    assert got.dtype == seq_k.dtype
    assert torch.equal(got, tutorial.decoder_mask(seq_k))
    assert got[0].tolist() == [[0, 1, 1, 1], [0, 0, 1, 1], [0, 0, 0, 1], [0, 0, 0, 0]]


def test_sinusoid_table_matches_the_tutorials_loop():
    table = torch.from_numpy(fastformer.get_sinusoid_encoding_table(17, 12))
    assert table.shape == (17, 12)
    assert_max_diff("sinusoid table", table, tutorial.sinusoid_table(17, 12), 1e-12)


def test_position_embedding_is_frozen_and_pads_get_row_zero():
    config = small_config()
    encoder = fastformer.Encoder(config)
    assert not encoder.pos_emb.weight.requires_grad
    assert encoder.pos_emb.weight.shape == (config.n_enc_seq + 1, config.d_hidn)
    assert torch.equal(
        encoder.pos_emb.weight[0], torch.tensor(fastformer.get_sinusoid_encoding_table(1, 32)[0]).float()
    )


def test_fully_padded_review_gives_finite_outputs():
    config = small_config(dropout=0.0)
    model = fastformer.MovieClassification(config).eval()
    enc = torch.zeros(2, 6, dtype=torch.long)  # both reviews entirely padding
    dec = torch.full((2, 1), 2)
    with fastformer.use_backend("reference"):
        logits = model(enc, dec)[0]
    assert torch.isfinite(logits).all()


def test_bad_token_inputs_raise_clear_errors():
    config = small_config()
    model = fastformer.MovieClassification(config)
    dec = torch.full((2, 1), 2)
    with pytest.raises(ValueError, match=r"^enc_inputs has length 30, longer than the config's maximum 24"):
        model(torch.ones(2, 30, dtype=torch.long), dec)
    with pytest.raises(ValueError, match=r"^enc_inputs must be a \(bs, n_seq\) tensor of token ids"):
        model(torch.ones(2, 3, 4, dtype=torch.long), dec)
    with pytest.raises(ValueError, match=r"^inputs has length 30"):  # the Encoder's own argument
        model.transformer.encoder(torch.ones(2, 30, dtype=torch.long))
    with pytest.raises(ValueError, match="dec_inputs"):
        model(torch.ones(2, 3, dtype=torch.long), torch.ones(2, 1))


def test_config_attribute_access_and_load(tmp_path):
    config = Config.tutorial(n_enc_vocab=100)
    assert config.d_hidn == config["d_hidn"] == 256
    config.extra = 3
    assert config["extra"] == 3
    with pytest.raises(AttributeError, match="no key 'missing'"):
        _ = config.missing
    config.device = torch.device("cpu")
    config.save(tmp_path / "config.json")
    loaded = Config.load(tmp_path / "config.json")
    assert isinstance(loaded, Config)
    assert loaded.n_enc_vocab == 100 and loaded.device == "cpu"


def test_fp16_and_bf16_models_run_on_the_reference_path():
    config = small_config(dropout=0.0)
    enc, dec = token_batch(config)
    for dtype in (torch.bfloat16, torch.float16):
        model = fastformer.MovieClassification(config).to(dtype)
        with fastformer.use_backend("reference"):
            logits = model(enc, dec)[0]
            logits.float().sum().backward()
        assert logits.dtype == dtype and torch.isfinite(logits).all()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_autocast_runs_the_reference_path():
    config = small_config(dropout=0.0)
    model = fastformer.MovieClassification(config)
    enc, dec = token_batch(config)
    with fastformer.use_backend("reference"), torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(enc, dec)[0]
    logits.float().sum().backward()
    assert torch.isfinite(logits).all()
    assert model.transformer.encoder.enc_emb.weight.grad is not None


def test_ffn_activation_option():
    """config.ffn_activation = "relu" gives conv2(relu(conv1(x))); gelu stays the default; others are refused."""
    torch.manual_seed(0)
    config = small_config(ffn_activation="relu")
    x = torch.randn(2, 5, config.d_hidn)
    relu_ffn = fastformer.PoswiseFeedForwardNet(config).eval()
    expected = relu_ffn.conv2(torch.relu(relu_ffn.conv1(x.transpose(1, 2)))).transpose(1, 2)
    assert_max_diff("relu ffn", relu_ffn(x), expected, 1e-6)
    gelu_ffn = fastformer.PoswiseFeedForwardNet(small_config()).eval()
    assert gelu_ffn.activation == "gelu"
    with pytest.raises(ValueError, match="ffn_activation must be one of"):
        fastformer.PoswiseFeedForwardNet(small_config(ffn_activation="tanh"))


@pytest.mark.parametrize("bad, where", [(-1, "enc"), ("vocab", "enc"), ("vocab", "dec")])
def test_token_ids_outside_the_vocabulary_name_the_input_and_the_value(bad, where):
    config = small_config()
    model = fastformer.MovieClassification(config)
    enc, dec = token_batch(config)
    vocab = config.n_enc_vocab if where == "enc" else config.n_dec_vocab
    value = vocab if bad == "vocab" else bad
    (enc if where == "enc" else dec)[0, 0] = value
    name = "enc_inputs" if where == "enc" else "dec_inputs"
    with pytest.raises(ValueError, match=rf"^{name} holds token id {value}, outside \[0, {vocab}\)"):
        model(enc, dec)


def assert_same_gradients(ref, expected, ours, got, backend):
    """Every parameter's gradient of the same upstream gradient through the tutorial's module
    (output `expected`) and ours (`got`, backward on `backend`) agrees to 1e-5."""
    upstream = torch.randn_like(expected)
    (expected * upstream).sum().backward()
    with fastformer.use_backend(backend):
        (got * upstream).sum().backward()
    ours_params = dict(ours.named_parameters())
    for name, p in ref.named_parameters():
        assert_max_diff(f"grad {name}", ours_params[name].grad, p.grad, 1e-5)


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("inputs", ["self", "cross", "three"])
@pytest.mark.parametrize("output_attentions", [True, False])
def test_an_attention_called_alone_matches_the_tutorial(backend, inputs, output_attentions):
    """A MultiHeadAttention called on its own (its own plan: one body with the layers' calls), for
    self-attention (Q is K is V: one fused op), cross-attention (K is V) and three tensors, in
    training mode with dropout 0: its output, probabilities and every parameter's gradient."""
    config = small_config(dropout=0.0, output_attentions=output_attentions)
    ref, ours = paired_models(config, "MultiHeadAttention")
    enc, dec = token_batch(config, seed=3)
    generator = torch.Generator().manual_seed(3)
    x, y, z = (
        torch.randn(enc.size(0), n, config.d_hidn, generator=generator) for n in (dec.size(1), enc.size(1), enc.size(1))
    )
    q, k, v, mask = {
        "self": (x, x, x, torch.gt(tutorial.pad_mask(dec, dec, 0) + tutorial.decoder_mask(dec), 0)),
        "cross": (x, y, y, tutorial.pad_mask(dec, enc, 0)),
        "three": (x, y, z, tutorial.pad_mask(dec, enc, 0)),
    }[inputs]
    expected, expected_probs = ref(q, k, v, mask)
    with fastformer.use_backend(backend):
        got, got_probs = ours(q, k, v, mask)
    assert_max_diff("attention output", got, expected, 1e-5)
    if output_attentions:
        assert_max_diff("probabilities", got_probs, expected_probs, 1e-5)
    else:
        assert got_probs is None
    assert_same_gradients(ref, expected, ours, got, backend)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_a_feed_forward_called_alone_matches_the_tutorial(backend):
    """A PoswiseFeedForwardNet called on its own (its own plan), conv2's bias in its product, in
    training mode with dropout 0: its output and every parameter's gradient."""
    config = small_config(dropout=0.0)
    ref, ours = paired_models(config, "PoswiseFeedForwardNet")
    x = torch.randn(3, 7, config.d_hidn, generator=torch.Generator().manual_seed(4))
    expected = ref(x)
    with fastformer.use_backend(backend):
        got = ours(x)
    assert_max_diff("feed-forward output", got, expected, 1e-5)
    assert_same_gradients(ref, expected, ours, got, backend)
