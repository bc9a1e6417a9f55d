"""fastformer.compat.aladdinpersson against a transcription of Aladdin Persson's Transformer
(tests/aladdinpersson.py): signatures, strict checkpoint loading, outputs and gradients on both
backends, masks, training steps, and cached greedy decoding."""

import copy
import inspect

import pytest
import torch

import fastformer
from fastformer.compat import aladdinpersson as ours
from fastformer.masks import AttentionMask
from tests import aladdinpersson as theirs
from tests.helpers import assert_max_diff, assert_within_torch_error

CLASSES = ["SelfAttention", "TransformerBlock", "Encoder", "DecoderBlock", "Decoder", "Transformer"]
SMALL = dict(
    src_vocab_size=23,
    trg_vocab_size=19,
    src_pad_idx=0,
    trg_pad_idx=0,
    embed_size=64,
    num_layers=2,
    forward_expansion=2,
    heads=4,
    max_length=24,
)


def batch(n=3, src_len=11, trg_len=7, seed=0):
    """Source ids with trailing padding of different lengths (one row all padding), target ids."""
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(1, SMALL["src_vocab_size"], (n, src_len), generator=g)
    src[0, 8:] = 0
    src[1, 3:] = 0
    src[-1, :] = 0  # a source that is all padding
    trg = torch.randint(1, SMALL["trg_vocab_size"], (n, trg_len), generator=g)
    return src, trg


def pair(dropout=0.0, **overrides):
    """The transcription and fastformer's model with the same weights (loaded strictly)."""
    torch.manual_seed(0)
    reference = theirs.Transformer(**{**SMALL, **overrides}, dropout=dropout)
    model = ours.Transformer(**{**SMALL, **overrides}, dropout=dropout)
    model.load_state_dict(reference.state_dict(), strict=True)
    return reference, model


@pytest.mark.parametrize("name", CLASSES)
def test_signatures_match_002(name):
    for method in ("__init__", "forward"):
        assert inspect.signature(getattr(getattr(ours, name), method)) == inspect.signature(
            getattr(getattr(theirs, name), method)
        ), (name, method)


def test_same_seed_gives_the_same_initial_weights():
    """Modules are built in the original's order, so torch.manual_seed reproduces its initialization."""
    torch.manual_seed(1)
    a = theirs.Transformer(**SMALL).state_dict()
    torch.manual_seed(1)
    b = ours.Transformer(**SMALL).state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_checkpoint_loads_strictly_and_outputs_match_on_the_reference_backend(tmp_path):
    reference, _ = pair()
    torch.save(reference.state_dict(), tmp_path / "original.pt")
    model = ours.Transformer(**SMALL)
    model.load_state_dict(torch.load(tmp_path / "original.pt"), strict=True)
    src, trg = batch()
    with fastformer.use_backend("reference"):
        for mode in (True, False):
            reference.train(mode)
            model.train(mode)
            assert_max_diff(f"logits (train={mode})", model(src, trg), reference(src, trg), 1e-5)


def test_gradients_match_002_on_the_reference_backend():
    reference, model = pair()
    src, trg = batch()
    with fastformer.use_backend("reference"):
        model(src, trg).square().mean().backward()
    reference(src, trg).square().mean().backward()
    theirs_grads = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        assert_max_diff(f"grad {name}", param.grad, theirs_grads[name].grad, 1e-5)


def test_modules_take_the_originals_dense_masks():
    """Encoder and Decoder called directly with make_src_mask / make_trg_mask tensors, and a
    SelfAttention with a per-head mask (the dense path), match the original."""
    reference, model = pair()
    src, trg = batch()
    src_mask, trg_mask = reference.make_src_mask(src), reference.make_trg_mask(trg)
    assert torch.equal(model.make_src_mask(src), src_mask) and torch.equal(model.make_trg_mask(trg), trg_mask)
    with fastformer.use_backend("reference"):
        enc = model.encoder(src, src_mask)
        assert_max_diff("encoder", enc, reference.encoder(src, src_mask), 1e-5)
        out = model.decoder(trg, enc, src_mask, trg_mask)
        assert_max_diff("decoder", out, reference.decoder(trg, enc, src_mask, trg_mask), 1e-5)
        x = torch.randn(3, 7, SMALL["embed_size"])
        per_head = torch.rand(3, SMALL["heads"], 7, 7) > 0.3
        attention = model.encoder.layers[0].attention
        expected = reference.encoder.layers[0].attention(x, x, x, per_head)
        assert_max_diff("per-head mask", attention(x, x, x, per_head), expected, 1e-5)


def test_mask_conversion():
    n, heads, q_len, k_len = 2, 4, 5, 6
    src = torch.tensor([[3, 4, 0, 0, 0, 0], [5, 6, 7, 8, 9, 1]])
    padding = ours.attention_mask((src != 0)[:, None, None, :], n, heads, q_len, k_len)
    assert padding.dense is None and torch.equal(padding.key_padding_mask, src.eq(0))
    shared = ours.attention_mask(torch.ones(1, 1, 1, k_len), n, heads, q_len, k_len)
    assert shared.dense is None and shared.key_padding_mask.shape == (n, k_len) and not shared.key_padding_mask.any()
    tril = torch.tril(torch.ones(q_len, k_len)).expand(n, 1, q_len, k_len)
    dense = ours.attention_mask(tril, n, heads, q_len, k_len)
    assert dense.key_padding_mask is None and dense.dense.shape == (n, heads, q_len, k_len)
    assert torch.equal(dense.dense[1, 3], tril[0, 0] == 0)
    assert ours.attention_mask(None, n, heads, q_len, k_len) == AttentionMask()
    with pytest.raises(ValueError, match=r"mask of shape \(2, 1, 1, 5\) does not broadcast to .* \(2, 4, 5, 6\)"):
        ours.attention_mask(torch.ones(2, 1, 1, 5), n, heads, q_len, k_len)
    with pytest.raises(TypeError, match="mask must be a tensor"):
        ours.attention_mask([[1, 0]], n, heads, q_len, k_len)


def test_bad_arguments():
    with pytest.raises(ValueError, match="divisible by heads: embed_size=30, heads=4"):
        ours.SelfAttention(30, 4)
    model = ours.Transformer(**SMALL)
    with pytest.raises(ValueError, match="src has length 25, longer than max_length 24"):
        model(torch.ones(1, 25, dtype=torch.long), torch.ones(1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"max_len must be in 1\.\.24"):
        model.generate(torch.ones(1, 4, dtype=torch.long), max_len=30, bos_idx=1)
    src, trg = batch()
    with pytest.raises(ValueError, match=r"^src holds token id 23, outside \[0, 23\)"):
        model(src.masked_fill(src == src.max(), 23), trg)
    with pytest.raises(ValueError, match=r"^x holds token id -4, outside \[0, 19\)"):
        model(src, trg.masked_fill(trg == trg.max(), -4))


@pytest.mark.parametrize(
    "dtype, atol",
    [
        pytest.param(torch.float32, 1e-5, id="fp32"),
        pytest.param(torch.bfloat16, 1e-2, id="bf16", marks=pytest.mark.bf16),
    ],
)
def test_triton_backend_matches_reference_outputs_and_all_gradients(dtype, atol, device):
    """Shared weights: the Triton backend vs the reference backend in the same dtype, both against
    the reference backend in fp64."""
    _, base = pair()
    src, trg = (t.to(device) for t in batch())

    def run(backend, run_dtype):
        model = ours.Transformer(**SMALL).to(device)
        model.load_state_dict(base.state_dict())
        model.to(run_dtype)
        with fastformer.use_backend(backend):
            out = model(src, trg)
        out.double().square().mean().backward()
        return out, {n: p.grad for n, p in model.named_parameters()}

    ref_out, ref_grads = run("reference", torch.float64)
    torch_out, torch_grads = run("reference", dtype)
    out, grads = run("triton", dtype)
    assert_within_torch_error("logits", out, ref_out, torch_out, atol)
    for name in ref_grads:
        assert_within_torch_error(f"grad {name}", grads[name], ref_grads[name], torch_grads[name], atol)


def test_a_few_training_steps_on_the_fast_path_track_the_reference(device):
    """Same init, same batches, Adam: the loss curves of the two backends agree step by step.

    Sized for the interpreter, whose time grows with batch x heads x layers: 3 sources (lengths 8,
    3 and 10 of 10), 2 heads and one layer in the encoder and in the decoder still run every kind of
    attention (padded self-attention, causal self-attention, cross-attention) and every kernel,
    forward and backward, through 4 Adam steps."""
    src, trg = batch(n=3, src_len=10, trg_len=9, seed=3)
    # no all-padding source here, a real training batch: batch() empties the last one, refill it
    src[-1] = torch.randint(1, SMALL["src_vocab_size"], (10,), generator=torch.Generator().manual_seed(4))
    src, trg = src.to(device), trg.to(device)
    assert src.ne(0).sum(1).tolist() == [8, 3, 10]

    def train(backend):
        torch.manual_seed(0)
        model = ours.Transformer(**{**SMALL, "heads": 2, "num_layers": 1}).to(device)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.9, 0.98), eps=1e-9)
        losses = []
        with fastformer.use_backend(backend):
            for _ in range(4):
                logits = model(src, trg[:, :-1])
                loss = torch.nn.functional.cross_entropy(
                    logits.reshape(-1, logits.shape[-1]), trg[:, 1:].reshape(-1), ignore_index=0
                )
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                losses.append(loss.item())
        return losses

    reference, fast = train("reference"), train("triton")
    assert reference[-1] < reference[0]  # it trains
    assert fast == pytest.approx(reference, rel=1e-4), (fast, reference)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_cached_greedy_decoding_equals_full_re_decoding(dtype):
    torch.manual_seed(0)
    model = ours.Transformer(**SMALL).to(dtype)
    model.train()  # generate switches to eval and back
    src, _ = batch(n=5, src_len=9, seed=4)
    with fastformer.use_backend("reference"):
        full = model.generate(src, max_len=20, bos_idx=1, use_cache=False)
        cached = model.generate(src, max_len=20, bos_idx=1)
    assert model.training
    assert cached.shape == (5, 20) and (cached[:, 0] == 1).all()
    assert torch.equal(cached, full)


def test_generation_stops_per_sequence_at_eos():
    torch.manual_seed(0)
    model = ours.Transformer(**SMALL)
    src, _ = batch(n=6, src_len=9, seed=5)
    with fastformer.use_backend("reference"):
        free = model.generate(src, max_len=20, bos_idx=1)
        eos = int(free[0, 3])  # a token the first sequence produces at step 3
        stopped = model.generate(src, max_len=20, bos_idx=1, eos_idx=eos)
        assert torch.equal(stopped, model.generate(src, max_len=20, bos_idx=1, eos_idx=eos, use_cache=False))
    for row, tokens in zip(free, stopped):
        hits = (row[1:] == eos).nonzero()
        end = int(hits[0]) + 2 if len(hits) else row.numel()  # through the first eos
        assert torch.equal(tokens[:end], row[:end])
        assert (tokens[end:] == model.trg_pad_idx).all()
    assert stopped.shape[1] == max(
        int((r[1:] == eos).nonzero()[0]) + 2 if (r[1:] == eos).any() else r.numel() for r in free
    )


def test_cached_decoding_on_the_triton_backend(device):
    torch.manual_seed(3)  # a seed whose two sources decode to different tokens (asserted below)
    # 2 heads: the interpreter's time grows with batch x heads; two layers, each with its own cache
    model = ours.Transformer(**{**SMALL, "heads": 2}).to(device)
    src, _ = (t.to(device) for t in batch(n=2, src_len=6, seed=6))
    with fastformer.use_backend("triton"):
        cached = model.generate(src, max_len=6, bos_idx=1)
        full = model.generate(src, max_len=6, bos_idx=1, use_cache=False)
    with fastformer.use_backend("reference"):
        reference = model.generate(src, max_len=6, bos_idx=1, use_cache=False)
    assert torch.equal(cached, full) and torch.equal(cached, reference)
    assert not torch.equal(cached[0], cached[1])  # so rows mixed up in a cache would show


@pytest.mark.versions
def test_forward_traces_as_one_graph_on_the_reference_backend():
    """No graph break in the compat layer's Python (mask conversion, the backend switch)."""
    reference, model = pair()
    src, trg = batch()
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    with fastformer.use_backend("reference"):
        torch.testing.assert_close(compiled(src, trg), reference(src, trg), rtol=0, atol=1e-5)


# -- on real tokens only (fastformer.packing): the encoder on the real tokens' rows ------------------


@pytest.fixture
def packed_calls(monkeypatch):
    """The query rows of every packed attention the model runs."""
    calls = []
    original = ours.attention_packed

    def spy(q, *args):
        calls.append(q.shape[0])
        return original(q, *args)

    monkeypatch.setattr(ours, "attention_packed", spy)
    return calls


def packed_batch():
    """Sources of 8, 2 and 11 real tokens of 11 (the second padded before and after its two) and
    targets of 5 tokens: 21 real tokens of 33 positions."""
    src, trg = batch(src_len=11, trg_len=5)
    src[1] = torch.tensor([0, 0, 0, 5, 6, 0, 0, 0, 0, 0, 0])
    src[2] = torch.arange(1, 12)
    return src, trg


# sized for the interpreter: one layer, two heads of 16
PACKED_MODEL = dict(num_layers=1, heads=2, embed_size=32)


def run_both(model, src, trg, backend, packing=True):
    """The logits and every parameter's gradient of one forward and backward."""
    model.zero_grad(set_to_none=True)
    with fastformer.use_backend(backend), fastformer.packing.use_packing(packing):
        out = model(src, trg)
    out.double().square().mean().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(
    "dtype, atol",
    [
        pytest.param(torch.float32, 1e-5, id="fp32"),
        pytest.param(torch.bfloat16, 1e-2, id="bf16", marks=pytest.mark.bf16),
    ],
)
def test_the_packed_model_matches_the_padded_by_the_parity_rule(packed_calls, dtype, atol):
    """Logits and every gradient against the fp64 reference: packed and padded kernels within twice
    the reference backend's error in the same dtype; the encoder ran on the 21 real tokens, the
    decoder's cross-attention of the 3 x 5 target positions over them."""
    _, model = pair(**PACKED_MODEL)
    src, trg = packed_batch()
    ref_out, ref_grads = run_both(copy.deepcopy(model).double(), src, trg, "reference")
    model.to(dtype)
    torch_out, torch_grads = run_both(model, src, trg, "reference")
    padded_out, padded_grads = run_both(model, src, trg, "triton", packing=False)
    assert packed_calls == []
    out, grads = run_both(model, src, trg, "triton")
    assert packed_calls == [21, 15]
    assert grads.keys() == padded_grads.keys() == ref_grads.keys()
    for name, actual, padded, ref, same_dtype in [
        ("logits", out, padded_out, ref_out, torch_out),
        *((f"grad {n}", grads[n], padded_grads[n], ref_grads[n], torch_grads[n]) for n in ref_grads),
    ]:
        assert_within_torch_error(name, padded, ref, same_dtype, atol)
        assert_within_torch_error(name, actual, ref, same_dtype, atol)
    # padding gave the weights nothing: the [PAD] embedding's gradient is zero
    assert grads["encoder.word_embedding.weight"][SMALL["src_pad_idx"]].abs().max() == 0


def _hook(model):
    model.encoder.layers[0].attention.fc_out.register_forward_hook(lambda module, args, out: None)


def _swap(model):
    model.decoder.layers[0].transformer_block.feed_forward[1] = torch.nn.GELU()  # a user's activation


def _of_padding_alone(src):
    src[1] = 0


def _no_padding(src):
    src[:] = torch.randint(1, SMALL["src_vocab_size"], src.shape)


@pytest.mark.parametrize(
    "backend, change_model, change_src, packing",
    [
        ("reference", None, None, True),
        ("triton", _hook, None, True),
        ("triton", _swap, None, True),
        ("triton", None, _of_padding_alone, True),
        ("triton", None, _no_padding, True),
        ("triton", None, None, False),
    ],
    ids=["reference", "hook", "swapped-module", "a-source-of-padding-alone", "no-padding", "packing-off"],
)
def test_the_model_runs_padded_where_something_could_tell(packed_calls, backend, change_model, change_src, packing):
    """Where a hook or a swapped module would see the packed rows, a source of padding alone attends
    over its padding's encoder outputs, there is nothing to leave out, or packing is off: no packed
    attention runs, and the logits are the padded model's, bit for bit."""
    _, model = pair(**PACKED_MODEL)
    src, trg = packed_batch()
    if change_model:
        change_model(model)
    if change_src:
        change_src(src)
    with fastformer.use_backend(backend), fastformer.packing.use_packing(packing):
        out = model(src, trg)
    assert packed_calls == []
    with fastformer.use_backend(backend), fastformer.packing.use_packing(False):
        assert torch.equal(out, model(src, trg))


def test_packed_ids_are_checked_in_the_same_read(monkeypatch):
    """The packed forward reads the ids' range and its counts in one check, which raises as the
    padded forward's does, naming src."""
    _, model = pair(**PACKED_MODEL)
    src, trg = packed_batch()
    reads = []
    original = ours.check_token_ids

    def spy(name, *args, counts=(), **kwargs):
        reads.append((name, len(counts)))
        return original(name, *args, counts=counts, **kwargs)

    monkeypatch.setattr(ours, "check_token_ids", spy)
    with fastformer.use_backend("triton"):
        model(src, trg)
        assert reads[0] == ("src", 3) and [name for name, _ in reads[1:]] == ["x"]  # then the decoder's ids
        with pytest.raises(ValueError, match=r"^src holds token id 23, outside \[0, 23\)"):
            model(src.masked_fill(src == src.max(), 23), trg)


def test_a_packed_train_step_with_dropout_is_seeded(packed_calls):
    """With dropout the packed encoder's masks are drawn for its rows, from torch's generator: the
    same seed gives the same logits and gradients."""
    _, model = pair(dropout=0.2, **PACKED_MODEL)
    model.train()
    src, trg = packed_batch()
    results = []
    for _ in range(2):
        torch.manual_seed(1)
        results.append(run_both(model, src, trg, "triton"))
    assert packed_calls == [21, 15] * 2
    (out_a, grads_a), (out_b, grads_b) = results
    assert torch.isfinite(out_a).all() and torch.equal(out_a, out_b)
    assert all(torch.equal(grads_a[n], grads_b[n]) for n in grads_a)
