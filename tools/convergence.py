"""The convergence comparison of the GPU check's model stage and of tests/test_convergence.py:
MovieClassification trained from one seed on real review sentences by the Triton kernels, by the
PyTorch reference in the same precision and by the reference in fp64, and the tests' rule on the
loss curves (compare_curves)."""

import itertools
import os
import tempfile

import torch

import fastformer
from fastformer.data import MovieDataSet, movie_collate_fn, read_reviews, train_vocab
from fastformer.train.loop import loss_curve

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the tiny MovieClassification of the GPU check's smoke plan and of the CPU convergence test
TINY = dict(
    n_layer=1, d_hidn=32, n_head=2, d_head=16, d_ff=64, n_enc_vocab=50, n_dec_vocab=50, n_enc_seq=12, n_dec_seq=12
)
# 200 real review sentences (tests/data/README.md), a vocab trained on them, and the atol of the
# rule by autocast ("off", fp32: tests/test_convergence.py measured |fastformer - fp64| up to 1.3e-6
# against 2 x 1.2e-6 + atol; "bf16": on an H100, 0.18 against 2 x 0.114 + atol,
# bench/results/gpu/h100-2026-11-26).
CONVERGENCE_REVIEWS = os.path.join(ROOT, "tests", "data", "rotten_tomatoes_200.tsv")
CONVERGENCE_PIECES = 300
CONVERGENCE_LR = 2e-3
LOSS_ATOL = {"off": 1e-6, "bf16": 1e-3}


def convergence_setup(overrides, batch, steps, reviews):
    """(config, batches) of the convergence comparison: Config.tutorial with `overrides`, dropout 0
    and the vocab of a BPE model trained on CONVERGENCE_REVIEWS; `steps` batches of `batch` reviews
    from the file's first `reviews` in a fixed shuffled order, cycled."""
    texts = read_reviews(CONVERGENCE_REVIEWS)
    with tempfile.TemporaryDirectory(prefix="fastformer-") as folder:
        vocab = train_vocab([r.doc for r in texts], os.path.join(folder, "vocab.model"), n_pieces=CONVERGENCE_PIECES)
    n_vocab = vocab.get_piece_size()
    config = fastformer.Config.tutorial(**dict(overrides, n_enc_vocab=n_vocab, n_dec_vocab=n_vocab, dropout=0.0))
    order = torch.randperm(len(texts), generator=torch.Generator().manual_seed(0)).tolist()[:reviews]
    dataset = MovieDataSet(vocab, [texts[i] for i in order], max_len=config.n_enc_seq, progress=False)
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=batch, collate_fn=lambda b: movie_collate_fn(b, i_pad=config.i_pad)
    )
    return config, list(itertools.islice(itertools.cycle(list(loader)), steps))


def convergence_curves(config, batches, device, amp, lr=CONVERGENCE_LR):
    """The loss of every step of MovieClassification trained from one seed with AdamW on `batches`:
    "fastformer" (the Triton kernels) and "reference" (PyTorch) under `amp`, "reference_fp64"
    (PyTorch in fp64, no autocast; the loss itself is taken in fp32, as fastformer.train.loop does)."""
    curves = {}
    for name, backend_name, dtype, run_amp in (
        ("fastformer", "triton", torch.float32, amp),
        ("reference", "reference", torch.float32, amp),
        ("reference_fp64", "reference", torch.float64, "off"),
    ):
        torch.manual_seed(0)
        model = fastformer.MovieClassification(config).to(device, dtype)
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
        with fastformer.use_backend(backend_name):
            curves[name] = loss_curve(model, batches, optimizer, device=device, amp=run_amp)
    return curves


def compare_curves(curves, atol):
    """The tests' rule on loss curves: at every step |fastformer - reference_fp64| <= 2 * (the
    largest |reference - reference_fp64| over the steps) + atol. Returns the figures and `agree`."""
    fp64 = curves["reference_fp64"]
    ours = [abs(a - b) for a, b in zip(curves["fastformer"], fp64)]
    torch_error = max(abs(a - b) for a, b in zip(curves["reference"], fp64))
    tolerance = 2 * torch_error + atol
    worst = max(range(len(ours)), key=ours.__getitem__)
    return {
        "max_loss_diff": ours[worst],
        "reference_max_loss_diff": torch_error,
        "loss_atol": atol,
        "loss_tolerance": tolerance,
        "worst_step": worst + 1,
        "agree": ours[worst] <= tolerance,
    }
