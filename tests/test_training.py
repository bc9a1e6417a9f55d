"""fastformer.train.loop: the schedules' values, the padding-masked loss, and the loops."""

import math

import pytest
import torch
import torch.nn.functional as F

from fastformer import MovieClassification
from fastformer.train.graphs import make_capturable
from fastformer.train.loop import (
    adamw,
    inverse_sqrt_scheduler,
    inverse_sqrt_warmup,
    keep_form,
    linear_warmup_decay,
    linear_warmup_decay_scheduler,
    sequence_cross_entropy,
)
from tests.helpers import small_config


def test_linear_warmup_decay_values():
    assert [linear_warmup_decay(s, 4, 12) for s in (0, 1, 2, 4, 8, 12, 13)] == [0.0, 0.25, 0.5, 1.0, 0.5, 0.0, 0.0]
    assert linear_warmup_decay(0, 0, 10) == 1.0  # no warm-up: start at the peak


def test_linear_warmup_decay_scheduler_drives_the_optimizer():
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.AdamW([param], lr=0.1)
    scheduler = linear_warmup_decay_scheduler(optimizer, warmup_steps=2, total_steps=6)
    seen = []
    for _ in range(6):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert seen == pytest.approx([0.0, 0.05, 0.1, 0.075, 0.05, 0.025])


def test_adamw_decays_the_matrices_only_and_its_fused_form_steps_as_foreach():
    """`fastformer train`'s AdamW: every parameter once, weight decay on the matrices only; fused,
    torch's fused implementation, which steps as the foreach one to fp32 rounding; not fused,
    torch's default."""

    def trained(fused):
        torch.manual_seed(0)
        model = MovieClassification(small_config())
        params = [p for p in model.parameters() if p.requires_grad]  # not the fixed position table
        start = [p.detach().clone() for p in params]
        optimizer = adamw(model, 1e-2, 0.1, fused=fused, foreach=not fused)  # fused, or foreach by name
        assert all(group["foreach"] is (not fused or None) for group in optimizer.param_groups)
        for step in range(3):
            for i, p in enumerate(params):
                p.grad = torch.full_like(p, (-1.0) ** (i + step) * (i + 1) / 7)
            optimizer.step()
        assert all(not torch.equal(p, p0) for p, p0 in zip(params, start))  # each one stepped
        return model, optimizer

    model, fused = trained(True)
    decay, no_decay = fused.param_groups
    params = [p for p in model.parameters() if p.requires_grad]
    assert len(params) < len(list(model.parameters()))  # the position table takes no step
    matrices, vectors = [p for p in params if p.dim() >= 2], [p for p in params if p.dim() < 2]
    assert list(map(id, decay["params"])) == list(map(id, matrices)) and vectors
    assert list(map(id, no_decay["params"])) == list(map(id, vectors))
    assert (decay["weight_decay"], no_decay["weight_decay"], decay["lr"]) == (0.1, 0.0, 1e-2)
    assert fused.defaults["fused"] is True
    default = adamw(model, 1e-2, 0.1, fused=False).defaults
    assert (default["fused"], default["foreach"]) == (None, None)
    foreach_model, _ = trained(False)
    for (name, a), b in zip(model.named_parameters(), foreach_model.parameters()):
        torch.testing.assert_close(a, b, msg=name)


def test_keep_form_gives_a_loaded_adamw_the_form_it_was_made_in():
    """load_state_dict takes the form a checkpoint was written in from its parameter groups: a
    default AdamW's state loaded into adamw(fused=True) makes it step in the default form, until
    keep_form makes it fused again; it then goes on from the loaded counts and moments. The other
    way round, a fused state loaded into the default form (a run resumed with --cuda-graphs)."""
    torch.manual_seed(0)
    model = MovieClassification(small_config())
    params = [p for p in model.parameters() if p.requires_grad]
    default = adamw(model, 1e-2, 0.1, fused=False)
    for _ in range(2):
        for p in params:
            p.grad = torch.ones_like(p)
        default.step()
    fused = adamw(model, 1e-2, 0.1, fused=True)
    fused.load_state_dict(default.state_dict())
    assert all(group["fused"] is None for group in fused.param_groups)  # the checkpoint's form
    make_capturable(keep_form(fused, True), False)
    assert all(group["fused"] is True and group["foreach"] is None for group in fused.param_groups)
    states = [fused.state[p] for p in params]
    assert all(state["step"].item() == 2 and state["step"].device == p.device for state, p in zip(states, params))
    assert all(torch.equal(fused.state[p]["exp_avg"], default.state[p]["exp_avg"]) for p in params)
    fused.step()
    assert {state["step"].item() for state in states} == {3.0}
    again = adamw(model, 1e-2, 0.1, fused=False)
    again.load_state_dict(fused.state_dict())
    assert all(group["fused"] is None for group in keep_form(again, False).param_groups)


def test_inverse_sqrt_warmup_values():
    """The Keras tutorial's formula: d_model^-0.5 * min(step^-0.5, step * warmup^-1.5), peak at step = warmup."""
    d, warmup = 512, 4000
    assert inverse_sqrt_warmup(1, d, warmup) == pytest.approx(d**-0.5 * warmup**-1.5)
    assert inverse_sqrt_warmup(warmup, d, warmup) == pytest.approx(d**-0.5 * warmup**-0.5)
    assert inverse_sqrt_warmup(4 * warmup, d, warmup) == pytest.approx(d**-0.5 * (4 * warmup) ** -0.5)
    assert inverse_sqrt_warmup(2000, d, warmup) == pytest.approx(2000 * d**-0.5 * warmup**-1.5)
    peak = max(range(1, 20000, 7), key=lambda s: inverse_sqrt_warmup(s, d, warmup))
    assert abs(peak - warmup) < 7
    assert inverse_sqrt_warmup(0, d, warmup) == inverse_sqrt_warmup(1, d, warmup)

    optimizer = torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = inverse_sqrt_scheduler(optimizer, d, warmup_steps=10)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(inverse_sqrt_warmup(1, d, 10))
    for _ in range(9):
        optimizer.step()
        scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(d**-0.5 * 10**-0.5)


def test_sequence_cross_entropy_ignores_padding():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 7, generator=g)
    targets = torch.tensor([[3, 4, 0, 0, 0], [1, 2, 6, 5, 0]])
    keep = targets.ne(0)
    expected = F.cross_entropy(logits[keep], targets[keep])
    assert sequence_cross_entropy(logits, targets, pad_idx=0) == pytest.approx(expected.item())
    # changing the logits at padded positions changes nothing
    noisy = logits.clone()
    noisy[~keep] = 100.0
    assert sequence_cross_entropy(noisy, targets, pad_idx=0) == pytest.approx(expected.item())
    assert sequence_cross_entropy(logits, torch.zeros_like(targets), pad_idx=0).item() == 0.0
    assert math.isfinite(sequence_cross_entropy(logits, targets, pad_idx=0).item())
