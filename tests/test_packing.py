"""The drop-in model on real tokens only (fastformer.packing): Transformer and MovieClassification
given padded ids run the encoder on the packed rows of their real tokens, and give what the padded
model gives, by the parity rule against fp64; and run padded wherever something could see the
difference, or the count cannot be read."""

import copy

import pytest
import torch

import fastformer
import fastformer.model
from fastformer.packing import ENV_VAR, _choice, packing_enabled, set_packing, token_bucket, use_packing
from tests.helpers import assert_max_diff, assert_within_torch_error, small_config, token_batch


@pytest.fixture
def packed_calls(monkeypatch):
    """The query rows of every packed attention the model runs."""
    calls = []
    original = fastformer.model.attention_packed

    def spy(q, *args):
        calls.append(q.shape[0])
        return original(q, *args)

    monkeypatch.setattr(fastformer.model, "attention_packed", spy)
    return calls


def padded_batch(config, bs=4):
    """Reviews of 13, 1, 5 and 9 real tokens, the second padded before and after its token (the
    one-token decoder's [BOS] for each); 28 real tokens of 52 positions."""
    enc, _ = token_batch(config, bs=bs, enc_len=13)
    enc[1] = config.i_pad
    enc[1, 6] = 7  # one token amid padding: its position, 7, is kept
    return enc, torch.full((bs, 1), 2)


def run(model, enc, dec, backend, packing=True):
    """dec_outputs and every parameter's gradient of one forward and backward."""
    model.zero_grad(set_to_none=True)
    with fastformer.use_backend(backend), use_packing(packing):
        dec_outputs = model.transformer(enc, dec)[0]
    dec_outputs.double().square().sum().backward()
    return dec_outputs.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("dec_len", [1, 5], ids=["one-token-decoder", "seq2seq"])
def test_the_packed_model_matches_the_padded_by_the_parity_rule(packed_calls, dec_len):
    """Outputs and every gradient, fp32, against the fp64 reference: packed and padded kernels
    within twice the reference's fp32 error; the packed encoder ran on the 28 real tokens, its
    decoder's cross-attention over them; the padded model never packs."""
    config = small_config(dropout=0.0)
    torch.manual_seed(0)
    model = fastformer.MovieClassification(config)
    enc, dec = padded_batch(config)
    if dec_len > 1:  # a padded decoder of several positions (002's seq2seq shape)
        dec = token_batch(config, bs=4, dec_len=dec_len)[1]
    oracle = copy.deepcopy(model).double()
    ref_out, ref_grads = run(oracle, enc, dec, "reference")
    torch_out, torch_grads = run(model, enc, dec, "reference")
    padded_out, padded_grads = run(model, enc, dec, "triton", packing=False)
    assert packed_calls == []
    out, grads = run(model, enc, dec, "triton")
    # per layer: the encoder's self-attention on 28 rows, the decoder's cross-attention on 4 * dec_len
    assert packed_calls == [28, 28, 4 * dec_len, 4 * dec_len]
    assert grads.keys() == padded_grads.keys() == ref_grads.keys()
    for name, actual, padded, ref, same_dtype in [
        ("dec_outputs", out, padded_out, ref_out, torch_out),
        *((f"grad {n}", grads[n], padded_grads[n], ref_grads[n], torch_grads[n]) for n in ref_grads),
    ]:
        assert_within_torch_error(name, padded, ref, same_dtype, 1e-5)
        assert_within_torch_error(name, actual, ref, same_dtype, 1e-5)
    # padding gave the weights nothing: the [PAD] embedding's gradient is zero either way
    assert grads["transformer.encoder.enc_emb.weight"][config.i_pad].abs().max() == 0


def test_a_packed_train_step_with_dropout_is_seeded(packed_calls):
    """With dropout the packed masks are drawn for the rows, not the padded positions (so not the
    padded model's), from torch's generator: the same seed gives the same logits and gradients."""
    config = small_config(dropout=0.2, n_layer=1)
    torch.manual_seed(0)
    model = fastformer.MovieClassification(config).train()
    enc, dec = padded_batch(config)
    results = []
    for _ in range(2):
        torch.manual_seed(1)
        results.append(run(model, enc, dec, "triton"))
    assert len(packed_calls) == 4  # two forwards, the one layer's two attentions each
    (out_a, grads_a), (out_b, grads_b) = results
    assert torch.isfinite(out_a).all()
    assert torch.equal(out_a, out_b)
    assert all(torch.equal(grads_a[n], grads_b[n]) for n in grads_a)


def _probabilities(model):
    model.config.output_attentions = True


def _hook(model):
    model.transformer.encoder.layers[0].register_forward_hook(lambda module, args, out: None)


class Swapped(torch.nn.Conv1d):
    """A user's own Conv1d, as an adapter library swaps in."""


def _swap(model):
    layer = model.transformer.decoder.layers[0].pos_ffn
    layer.conv1 = Swapped(layer.conv1.in_channels, layer.conv1.out_channels, 1)


def _no_padding(model):
    model.test_enc = torch.randint(1, model.config.n_enc_vocab, (4, 9))


def _a_review_of_padding_alone(model):
    enc, _ = padded_batch(model.config)
    enc[3] = model.config.i_pad
    model.test_enc = enc


@pytest.mark.parametrize(
    "change, backend",
    [
        (None, "reference"),  # the oracle runs padded, as the tutorial
        (_probabilities, "triton"),  # the packed kernels give no probabilities
        (_hook, "triton"),  # a hook sees the tutorial's tensors
        (_swap, "triton"),  # a swapped module runs module by module, with the tutorial's tensors
        (_no_padding, "triton"),  # nothing to leave out
        # its decoder's cross-attention has no key: the tutorial's weights are then uniform over
        # the padding, whose encoder outputs count
        (_a_review_of_padding_alone, "triton"),
    ],
    ids=["reference", "probabilities", "hook", "swapped-module", "no-padding", "all-padding-review"],
)
def test_the_model_runs_padded_where_packing_would_show(packed_calls, change, backend):
    config = small_config(dropout=0.0, n_layer=1)
    torch.manual_seed(0)
    model = fastformer.MovieClassification(config)
    if change is not None:
        change(model)
    enc, dec = padded_batch(config)
    enc = getattr(model, "test_enc", enc)
    with fastformer.use_backend(backend):
        logits, enc_probs, _, cross_probs = model(enc, dec)
        with use_packing(False):
            expected = model(enc, dec)[0]
    assert packed_calls == []
    assert torch.equal(logits, expected)
    if change is _probabilities:
        assert all(p is not None for p in enc_probs + cross_probs)


def test_an_encoder_called_alone_returns_every_position(packed_calls):
    """The Encoder's caller takes its outputs at the pads too, as the tutorial computes them."""
    config = small_config(dropout=0.0, n_layer=1)
    torch.manual_seed(0)
    model = fastformer.MovieClassification(config)
    enc, _ = padded_batch(config)
    with fastformer.use_backend("triton"):
        outputs, _ = model.transformer.encoder(enc)
    assert outputs.shape == (4, 13, config.d_hidn)
    assert packed_calls == []


def test_the_packed_ids_are_checked_in_the_same_read():
    """Out-of-range ids are refused on the packed path as on the padded one, naming the argument."""
    config = small_config(dropout=0.0, n_layer=1)
    model = fastformer.MovieClassification(config)
    enc, dec = padded_batch(config)
    enc[0, 0] = config.n_enc_vocab
    with fastformer.use_backend("triton"), pytest.raises(ValueError, match=r"enc_inputs holds token id 50"):
        model(enc, dec)
    enc[0, 0], dec[0, 0] = 1, config.n_dec_vocab
    with fastformer.use_backend("triton"), pytest.raises(ValueError, match=r"dec_inputs holds token id 40"):
        model(enc, dec)


def test_the_switch_and_its_variable(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert packing_enabled()  # the default
    with use_packing(False):
        assert not packing_enabled()
    assert packing_enabled()
    with pytest.raises(TypeError, match="set_packing"):
        set_packing("no")
    monkeypatch.setenv(ENV_VAR, "0")
    assert not packing_enabled()
    set_packing(True)
    try:
        assert packing_enabled()  # Python's choice over the variable's
    finally:
        set_packing(None)
    monkeypatch.setenv(ENV_VAR, "off")
    with pytest.raises(ValueError, match=ENV_VAR):
        _choice()


def test_padding_in_front_amid_and_after_the_tokens():
    """A review padded before, between and after its tokens: packed, the logits of the padded
    model (each token keeps its position)."""
    config = small_config(dropout=0.0, n_layer=1)
    torch.manual_seed(0)
    model = fastformer.MovieClassification(config).eval()
    tokens = torch.tensor([5, 9, 3, 7])
    scattered = torch.zeros(1, 10, dtype=torch.long)
    scattered[0, [1, 4, 5, 8]] = tokens
    with fastformer.use_backend("triton"):
        packed = model(scattered, torch.full((1, 1), 2))[0]
        with use_packing(False):
            padded = model(scattered, torch.full((1, 1), 2))[0]
    assert_max_diff("logits", packed, padded, 1e-5)


@pytest.mark.parametrize("view", ["strided", "expanded"])
def test_ids_as_a_strided_or_an_expanded_view(packed_calls, view):
    """The ids a caller slices or broadcasts pack as their contiguous copy does, bit for bit."""
    config = small_config(dropout=0.0, n_layer=1)
    torch.manual_seed(0)
    model = fastformer.MovieClassification(config).eval()
    enc, dec = padded_batch(config)
    if view == "strided":  # every other column of a wider tensor
        wide = torch.zeros(enc.size(0), 2 * enc.size(1), dtype=enc.dtype)
        wide[:, ::2] = enc
        enc = wide[:, ::2]
    else:  # one review broadcast over the batch
        enc = enc[2:3].expand(4, -1)
    with fastformer.use_backend("triton"):
        logits = model(enc, dec)[0]
        expected = model(enc.contiguous(), dec)[0]
    assert len(packed_calls) == 4
    assert torch.equal(logits, expected)


# -- a token bucket: the rows' count fixed, nothing read on the host (what a captured step needs) ----


def packed_lengths_calls(monkeypatch):
    """(query rows, key offsets) of every packed attention the model runs."""
    calls = []
    original = fastformer.model.attention_packed

    def spy(q, k, v, cu_seqlens_q, cu_seqlens_k, *args):
        calls.append((q.shape[0], k.shape[0], cu_seqlens_q.tolist(), cu_seqlens_k.tolist()))
        return original(q, k, v, cu_seqlens_q, cu_seqlens_k, *args)

    monkeypatch.setattr(fastformer.model, "attention_packed", spy)
    return calls


@pytest.mark.parametrize("rows", [28, 61])
def test_a_token_bucket_packs_into_its_rows_and_matches_the_padded_model(monkeypatch, rows):
    """In token_bucket(rows) the 28 real tokens and fillers up to `rows` (61: more than the 52
    positions) run as one static packing: outputs and every gradient by the parity rule against
    fp64, the fillers in sequences of their own that no decoder query reads (so their gradients
    are zeros and every weight's is the padded model's), and no count read on the host."""
    calls = packed_lengths_calls(monkeypatch)
    config = small_config(dropout=0.0, n_layer=1)
    torch.manual_seed(0)
    model = fastformer.MovieClassification(config)
    enc, dec = padded_batch(config)
    ref_out, ref_grads = run(copy.deepcopy(model).double(), enc, dec, "reference")
    torch_out, torch_grads = run(model, enc, dec, "reference")
    reads = []
    original = fastformer.model.check_token_ids
    monkeypatch.setattr(
        fastformer.model, "check_token_ids", lambda *a, counts=(), **k: reads.append(counts) or original(*a, **k)
    )
    with token_bucket(rows):
        out, grads = run(model, enc, dec, "triton")
    assert reads == [(), ()]  # the encoder's and the decoder's ids' range: no count
    # fillers in sequences of at most 13 rows (n_seq), enough for `rows` of them, the rest empty
    fillers = [min(28 + 13 * i, rows) for i in range(1, -(-rows // 13) + 1)]
    offsets = [0, 13, 14, 19, 28, *fillers]
    assert calls == [(rows, rows, offsets, offsets), (4, rows, [0, 1, 2, 3, 4] + [4] * len(fillers), offsets)]
    for name, actual, ref, same_dtype in [
        ("dec_outputs", out, ref_out, torch_out),
        *((f"grad {n}", grads[n], ref_grads[n], torch_grads[n]) for n in ref_grads),
    ]:
        assert_within_torch_error(name, actual, ref, same_dtype, 1e-5)


def test_a_token_bucket_refuses_what_it_cannot_run_as_the_tutorial():
    """A batch of more real tokens than the bucket's rows, or with a review of padding alone (whose
    decoder would attend over its padding), fails the packing's device-side asserts (on a CPU at
    once): never a token left out, never another answer. A bad bucket is refused, naming rows."""
    config = small_config(dropout=0.0, n_layer=1)
    model = fastformer.MovieClassification(config)
    enc, dec = padded_batch(config)
    with fastformer.use_backend("triton"):
        with token_bucket(27), pytest.raises(RuntimeError, match="more real tokens than the token bucket's 27 rows"):
            model(enc, dec)
        enc[3] = config.i_pad
        with token_bucket(40), pytest.raises(RuntimeError, match="a review of padding alone"):
            model(enc, dec)
    for rows, error in [(0, ValueError), (-3, ValueError), (2.5, TypeError), (True, TypeError)]:
        with pytest.raises(error, match="rows"), token_bucket(rows):
            pass
    with token_bucket(None):
        assert fastformer.packing.bucket_rows() is None


def test_replay_rows_rounds_the_count_up_to_an_eighth_of_the_positions(monkeypatch):
    """The rows the job replays a batch in (its CUDA graphs): read on the host, the count of real
    tokens rounded up to a multiple of an eighth of the positions; None (padded) where packing is
    off, nothing is left out once rounded, a review is padding alone or the ids are on a device."""
    from fastformer.packing import replay_rows

    config = small_config()
    enc, _ = padded_batch(config)  # 28 real tokens of 52 positions: eighths of 7 rows
    assert replay_rows(enc, config.i_pad) == 28
    enc[0, 12] = config.i_pad
    assert replay_rows(enc, config.i_pad) == 28  # 27 rounded up
    assert replay_rows(enc, config.i_pad, steps=4) == 39  # quarters of 13 rows
    with use_packing(False):
        assert replay_rows(enc, config.i_pad) is None
    assert replay_rows(enc.to("meta"), config.i_pad) is None  # not on the host: no read
    full = torch.randint(1, config.n_enc_vocab, (4, 13))
    full[0, 12] = config.i_pad  # 51 of 52, rounded up to all of them
    assert replay_rows(full, config.i_pad) is None
    enc[3] = config.i_pad
    assert replay_rows(enc, config.i_pad) is None  # a review of padding alone
