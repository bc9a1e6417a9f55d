"""Padding to buckets (--pad-to-buckets, on with --cuda-graphs): the bucket rule, the collate, the
job's loaders, and that the extra padding changes the model's logits and gradients by rounding only."""

import pytest
import torch
import torch.nn.functional as F

import fastformer
from fastformer.data.reviews import BUCKET_MULTIPLE, bucket_length, movie_collate_fn, pad_to_bucket
from tests.helpers import assert_max_diff, assert_within_torch_error, small_config, token_batch


def test_bucket_length_rounds_up_to_a_multiple_of_16_within_n_enc_seq():
    assert BUCKET_MULTIPLE == 16
    assert [bucket_length(n, 256) for n in (1, 15, 16, 17, 60, 240, 241, 256)] == [16, 16, 16, 32, 64, 240, 256, 256]
    assert [bucket_length(n, 24) for n in (1, 16, 17, 24)] == [16, 16, 24, 24]  # n_enc_seq is the last bucket
    assert bucket_length(30, 24) == 30  # beyond n_enc_seq: left for the model to refuse
    assert {bucket_length(n, 128) for n in range(1, 129)} == {16, 32, 48, 64, 80, 96, 112, 128}


def test_collate_pads_the_encoder_ids_to_the_bucket():
    items = [(torch.tensor(label), torch.arange(1, n + 1), torch.tensor([2])) for label, n in ((1, 5), (0, 11), (1, 3))]
    labels, enc, dec = movie_collate_fn(items, i_pad=0)
    assert enc.shape == (3, 11)
    labels_b, bucketed, dec_b = movie_collate_fn(items, i_pad=0, bucket_max_len=24)
    assert bucketed.shape == (3, 16)
    assert torch.equal(bucketed[:, :11], enc) and bucketed[:, 11:].eq(0).all()
    assert torch.equal(labels_b, labels) and torch.equal(dec_b, dec)
    assert movie_collate_fn(items, i_pad=7, bucket_max_len=12)[1][:, 11:].eq(7).all()  # capped at 12, padded with i_pad


def test_pad_to_bucket_pads_as_the_job_collates():
    """The public helper (fastformer.pad_to_bucket) gives the job's collate's bucket padding."""
    config = small_config(n_enc_seq=24, i_pad=0)
    items = [(torch.tensor(1), torch.arange(1, n + 1), torch.tensor([2])) for n in (5, 11, 3)]
    _, enc, _ = movie_collate_fn(items, i_pad=config.i_pad)
    padded = fastformer.pad_to_bucket(enc, config)
    assert torch.equal(padded, movie_collate_fn(items, i_pad=config.i_pad, bucket_max_len=config.n_enc_seq)[1])
    assert padded.shape == (3, 16) and padded.dtype == enc.dtype
    assert fastformer.pad_to_bucket(padded, config) is padded  # at its bucket already: itself
    assert fastformer.pad_to_bucket(torch.ones(2, 20, dtype=torch.int32), config).shape == (2, 24)  # n_enc_seq


@pytest.mark.parametrize(
    "ids, error, message",
    [
        ([[1, 2]], TypeError, "enc_inputs must be a torch.Tensor of token ids, got list"),
        (torch.ones(2, 3), ValueError, r"integer token ids of shape \(batch, length\), got torch.float32 \(2, 3\)"),
        (torch.ones(6, dtype=torch.long), ValueError, r"got torch.int64 \(6,\)"),
        (torch.ones(1, 25, dtype=torch.long), ValueError, r"25 positions, more than config.n_enc_seq \(24\)"),
    ],
)
def test_pad_to_bucket_names_what_is_wrong(ids, error, message):
    with pytest.raises(error, match=message):
        pad_to_bucket(ids, small_config(n_enc_seq=24))


@pytest.mark.parametrize("backend_name", ["reference", "triton"])
def test_padding_to_the_bucket_changes_logits_and_gradients_by_rounding_only(backend_name):
    """A batch padded to its longest review (13) and to its bucket (16): the extra columns are keys
    the model masks. In fp64 both give the same logits and gradients to 1e-12 (the math is the
    same); in fp32 the bucketed run must stay within the tests' rule, 2 x the error of the
    unbucketed run against fp64 + 1e-6 (8 fp32 ulps at 1), since a longer row changes the order of
    the softmax sums and the blocking of the products. On this project's CPU machine (3 reviews, 2
    heads) the fp32 logits moved by 1.8e-7 on the Triton kernels (interpreter) and not at all on the
    reference, the gradients by up to 1.2e-7 and 3.7e-9."""
    # n_enc_seq 24; 2 heads and 3 reviews, since the interpreter's time grows with batch x heads
    config = small_config(dropout=0.0, n_head=2)
    torch.manual_seed(0)
    base = fastformer.MovieClassification(config)
    enc, _ = token_batch(config, bs=3, enc_len=13)  # review lengths 13, 1, 5
    dec = torch.full((enc.size(0), 1), 2)  # [BOS], as the job's data gives
    labels = torch.tensor([0, 1, 2])
    bucketed = F.pad(enc, (0, bucket_length(13, config.n_enc_seq) - 13), value=config.i_pad)
    assert bucketed.shape == (3, 16)

    def run(name, dtype, enc_inputs):
        model = fastformer.MovieClassification(config).to(dtype).eval()
        model.load_state_dict(base.state_dict())
        with fastformer.use_backend(name):
            logits = model(enc_inputs, dec)[0]
        F.cross_entropy(logits, labels).backward()
        return {
            "logits": logits.detach(),
            **{f"grad {n}": p.grad for n, p in model.named_parameters() if p.grad is not None},
        }

    fp64 = run("reference", torch.float64, enc)
    fp64_bucketed = run("reference", torch.float64, bucketed)
    unbucketed = run(backend_name, torch.float32, enc)
    ours = run(backend_name, torch.float32, bucketed)
    assert ours.keys() == unbucketed.keys() == fp64.keys() == fp64_bucketed.keys()
    for name in fp64:
        assert_max_diff(f"fp64 {name}", fp64_bucketed[name], fp64[name], 1e-12)
        assert_within_torch_error(name, ours[name], fp64[name], unbucketed[name], atol=1e-6)


def test_the_jobs_loaders_pad_to_buckets_when_asked(tmp_path):
    from fastformer.data import Review, train_vocab
    from fastformer.train.job import loaders as job_loaders
    from fastformer.train.runtime import Launch

    words = ["the", "film", "was", "good", "bad", "long", "short", "dull", "great", "fine", "and", "but", "not", "very"]
    g = torch.Generator().manual_seed(0)
    reviews = [
        Review(str(i), " ".join(words[j] for j in torch.randint(0, len(words), (int(n),), generator=g).tolist()), i % 2)
        for i, n in enumerate(torch.randint(1, 30, (80,), generator=g))
    ]
    vocab = train_vocab([r.doc for r in reviews], str(tmp_path / "vocab.model"), n_pieces=40)
    config = small_config(n_enc_seq=24, n_enc_vocab=vocab.get_piece_size(), n_dec_vocab=vocab.get_piece_size())
    for pad_to_buckets in (False, True):
        loaders = job_loaders(config, vocab, reviews, reviews[:20], 8, True, 0, Launch(), pad_to_buckets)
        widths = set()
        for loader in loaders[:2]:
            for _, enc, _ in loader:
                longest = int(enc.ne(config.i_pad).sum(1).max())
                widths.add(enc.size(1))
                assert enc[:, longest:].eq(config.i_pad).all()
                assert enc.size(1) == (bucket_length(longest, 24) if pad_to_buckets else longest)
        if pad_to_buckets:
            assert widths == {16, 24}
        else:
            assert len(widths) > 2  # without buckets, many shapes
