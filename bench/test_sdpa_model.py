"""The benchmarks' SDPA peer (bench/sdpa_model.py) against fastformer's model on the
reference backend: one state_dict in both, logits and every parameter's gradient compared in fp32
and fp64, on batches with padding, all-padding rows and decoders of one and more tokens."""

import pytest
import torch
import torch.nn.functional as F

import fastformer
from bench.sdpa_model import Mask, MultiHeadAttention, SdpaMovieClassification

SMALL = dict(
    n_layer=2, d_hidn=32, n_head=2, d_head=16, d_ff=64, n_enc_vocab=50, n_dec_vocab=50, n_enc_seq=12, n_dec_seq=12
)
# (atol, rtol) of logits and gradients against fastformer's reference: both are PyTorch on one
# machine, so they differ only by the order of sums
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.float64: (1e-12, 1e-12)}
PAD = 0


def small_config(**overrides):
    return fastformer.Config.tutorial(**{**SMALL, **overrides})


def batch(name):
    """(enc_inputs, dec_inputs) of one kind; ids >= 1 are tokens, PAD is padding."""
    g = torch.Generator().manual_seed(0)

    def ids(lengths, n_seq, left=False):
        """Token ids (len(lengths), n_seq), each row `lengths[i]` tokens then padding (before them: left)."""
        tokens = torch.randint(1, 50, (len(lengths), n_seq), generator=g)
        position = torch.arange(n_seq)
        pad = position < n_seq - torch.tensor(lengths)[:, None] if left else position >= torch.tensor(lengths)[:, None]
        return tokens.masked_fill(pad, PAD)

    if name == "padded_bos":  # the tutorial's classifier: reviews of many lengths, decoder [BOS]
        return ids([12, 3, 7], 12), torch.full((3, 1), 2)
    if name == "seq2seq":  # a decoder of many tokens, padded after them; encoder shorter than n_enc_seq
        return ids([9, 4, 1, 6], 9), ids([7, 2, 5, 1], 7)
    if name == "all_padding":  # a review and a decoder sequence of padding only
        return ids([5, 0, 8], 8), ids([0, 3, 4], 4)
    if name == "left_padded_dec":  # decoder queries before the first token: every key masked
        return ids([6, 2, 5], 6), ids([3, 1, 5], 5, left=True)
    if name == "pad_dec_token":  # a one-token decoder whose token is padding: (bs, 1, 1, 1) all masked
        return ids([4, 7], 7), torch.tensor([[2], [PAD]])
    raise ValueError(name)


BATCHES = ("padded_bos", "seq2seq", "all_padding", "left_padded_dec", "pad_dec_token")


def twin_models(config, dtype):
    """fastformer's MovieClassification and the SDPA model, one state_dict in both, in `dtype`."""
    torch.manual_seed(0)
    reference = fastformer.MovieClassification(config)
    sdpa = SdpaMovieClassification(config)
    sdpa.load_state_dict(reference.state_dict(), strict=True)
    return reference.to(dtype), sdpa.to(dtype)


def reference_forward(model, enc, dec):
    with fastformer.use_backend("reference"):
        return model(enc, dec)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("name", BATCHES)
def test_logits_match_reference(name, dtype):
    reference, sdpa = twin_models(small_config(), dtype)
    reference.eval(), sdpa.eval()
    enc, dec = batch(name)
    with torch.no_grad():
        expected = reference_forward(reference, enc, dec)[0]
        logits, *probs = sdpa(enc, dec)
    assert probs == [None, None, None]
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(logits, expected, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("name", BATCHES)
def test_gradients_match_reference(name, dtype):
    """Train mode with dropout 0: the loss's gradient of every parameter."""
    reference, sdpa = twin_models(small_config(dropout=0.0), dtype)
    enc, dec = batch(name)
    labels = torch.arange(enc.size(0)) % 2
    F.cross_entropy(reference_forward(reference, enc, dec)[0], labels).backward()
    F.cross_entropy(sdpa(enc, dec)[0], labels).backward()
    atol, rtol = TOLERANCE[dtype]
    expected = dict(reference.named_parameters())
    for name, param in sdpa.named_parameters():
        if expected[name].grad is None:  # the frozen position tables
            assert param.grad is None, name
            continue
        torch.testing.assert_close(
            param.grad, expected[name].grad, atol=atol, rtol=rtol, msg=lambda m, name=name: f"{name}: {m}"
        )


def test_relu_feed_forward_matches_reference():
    """config.ffn_activation = "relu", which fastformer also reads."""
    reference, sdpa = twin_models(small_config(ffn_activation="relu"), torch.float64)
    reference.eval(), sdpa.eval()
    enc, dec = batch("seq2seq")
    with torch.no_grad():
        torch.testing.assert_close(sdpa(enc, dec)[0], reference_forward(reference, enc, dec)[0], atol=1e-12, rtol=1e-12)


def test_all_masked_query_gets_mean_of_values():
    """The tutorial's convention for a query whose keys are all masked (the mean of V, no gradient
    to Q or K), on one cross-attention with an arbitrary dense mask, against fastformer's."""
    config = small_config(dropout=0.0)
    torch.manual_seed(0)
    reference = fastformer.MultiHeadAttention(config).double()
    sdpa = MultiHeadAttention(config).double()
    sdpa.load_state_dict(reference.state_dict(), strict=True)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 5, config.d_hidn, generator=g, dtype=torch.float64, requires_grad=True)
    memory = torch.randn(2, 7, config.d_hidn, generator=g, dtype=torch.float64, requires_grad=True)
    masked = torch.rand(2, 5, 7, generator=g) < 0.5  # (bs, n_q_seq, n_k_seq), True = masked
    masked[0, 1] = True  # a query with every key masked
    masked[1, 4] = True
    with fastformer.use_backend("reference"):
        expected, _ = reference(x, memory, memory, masked)
    got = sdpa(x, memory, Mask.of(masked[:, None]))
    torch.testing.assert_close(got, expected, atol=1e-12, rtol=1e-12)
    dy = torch.randn(got.shape, generator=g, dtype=torch.float64)
    expected_grads = torch.autograd.grad(expected, (x, memory), dy)
    for got_grad, expected_grad in zip(torch.autograd.grad(got, (x, memory), dy), expected_grads):
        torch.testing.assert_close(got_grad, expected_grad, atol=1e-12, rtol=1e-12)


def test_dropout_trains():
    """With dropout > 0 in train mode the model drops out (two calls differ), its loss and
    gradients are finite; in eval mode it is deterministic."""
    config = small_config(dropout=0.3)
    _, sdpa = twin_models(config, torch.float32)
    enc, dec = batch("all_padding")
    sdpa.train()
    first, second = sdpa(enc, dec)[0], sdpa(enc, dec)[0]
    assert not torch.equal(first, second), "dropout had no effect in train mode"
    loss = F.cross_entropy(first, torch.tensor([0, 1, 0]))
    assert torch.isfinite(loss), f"loss {loss}"
    loss.backward()
    for name, param in sdpa.named_parameters():
        if param.requires_grad:
            assert torch.isfinite(param.grad).all(), name
    sdpa.eval()
    with torch.no_grad():
        assert torch.equal(sdpa(enc, dec)[0], sdpa(enc, dec)[0])


def test_state_dict_is_fastformers():
    """Key names, order, shapes and dtypes of the state_dict are fastformer's, and the frozen
    position tables, built independently, hold the same values."""
    config = small_config()
    expected = fastformer.MovieClassification(config).state_dict()
    got = SdpaMovieClassification(config).state_dict()
    assert list(got) == list(expected)
    for key, value in got.items():
        assert (value.shape, value.dtype) == (expected[key].shape, expected[key].dtype), key
    for key in ("transformer.encoder.pos_emb.weight", "transformer.decoder.pos_emb.weight"):
        torch.testing.assert_close(got[key], expected[key])
