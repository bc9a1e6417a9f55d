"""attention's `seed`: a one-element int64 tensor, such as the view `draw_seeds(n, device)[i:i + 1]`
of the seeds a model draws once per forward, decides the dropout mask alone, and no seed is drawn
for the call (a call is its kernels alone). The bad seeds are in tests/test_ops_reference.py's argument table.
"""

import pytest
import torch

from fastformer import kernels
from fastformer.kernels import _dropout
from tests.helpers import assert_max_diff, assert_within_torch_error
from tests.test_attention import make_inputs, padding, run
from tools import launches

P = 0.3


def seed_after(manual_seed, device):
    """The seed `attention` draws for itself right after torch.manual_seed(manual_seed)."""
    torch.manual_seed(manual_seed)
    return _dropout.draw_seed(device)


def as_view(seed):
    """`seed` as a model hands it over: a one-element view into a tensor of seeds, 8 bytes in."""
    others = _dropout.draw_seeds(2, seed.device)
    return torch.cat([others[:1], seed, others[1:]])[1:2]


@pytest.mark.parametrize("view", [False, True], ids=["own-tensor", "view-of-seeds"])
def test_the_given_seed_decides_the_dropout(view, device):
    """Output and gradients match the reference under the kernel's keep-mask of that seed, while
    torch's generator is somewhere else; and they equal, bit for bit, the call that draws the same
    seed itself."""
    B, H, Lq, Lk, D = 2, 2, 23, 30, 16
    q, k, v, do = make_inputs(B, H, Lq, Lk, D, device, seed=5)
    pad = padding(B, Lk, "all", device)  # includes rows whose keys are all masked
    seed = seed_after(7, device)
    seed = as_view(seed) if view else seed
    torch.manual_seed(123)  # a call drawing its own seed would not get the mask of seed_after(7)
    ours = run(kernels.attention, q, k, v, do, torch.float32, key_padding_mask=pad, dropout_p=P, seed=seed)
    torch.manual_seed(7)
    keep = kernels.attention_dropout_mask(B, H, Lq, Lk, P, device)

    def with_mask(q, k, v):
        probs = kernels.attention_reference(q, k, v, key_padding_mask=pad, return_probs=True)[1]
        return (probs * keep / (1 - P)) @ v

    reference = run(with_mask, q, k, v, do, torch.float64)
    torch_same = run(with_mask, q, k, v, do, torch.float32)
    for name, a, r, t in zip(("out", "dq", "dk", "dv"), ours, reference, torch_same):
        assert_within_torch_error(name, a, r, t, 1e-5)

    torch.manual_seed(7)
    drawn = run(kernels.attention, q, k, v, do, torch.float32, key_padding_mask=pad, dropout_p=P)
    for name, a, b in zip(("out", "dq", "dk", "dv"), ours, drawn):
        assert torch.equal(a, b), name


def test_same_seed_same_output_and_gradients_another_seed_another(device):
    q, k, v, do = make_inputs(1, 2, 16, 16, 16, device)
    seeds = _dropout.draw_seeds(2, device)
    first = run(kernels.attention, q, k, v, do, torch.float32, dropout_p=P, seed=seeds[0:1])
    again = run(kernels.attention, q, k, v, do, torch.float32, dropout_p=P, seed=seeds[0:1])
    other = run(kernels.attention, q, k, v, do, torch.float32, dropout_p=P, seed=seeds[1:2])
    for name, a, b, c in zip(("out", "dq", "dk", "dv"), first, again, other):
        assert torch.equal(a, b), name
        assert not torch.equal(a, c), name


def test_return_probs_with_a_seed_are_the_probabilities_that_multiplied_v(device):
    q, k, v, _ = make_inputs(1, 2, 16, 16, 16, device)
    q, k, v = q.float(), k.float(), v.float()
    seed = as_view(seed_after(3, device))
    torch.manual_seed(0)
    out, probs = kernels.attention(q, k, v, dropout_p=P, seed=seed, return_probs=True)
    torch.manual_seed(3)
    keep = kernels.attention_dropout_mask(1, 2, 16, 16, P, device)
    assert torch.equal(probs != 0, keep)
    assert_max_diff("out == probs @ v", out, probs @ v, 1e-5)
    assert torch.equal(out, kernels.attention(q, k, v, dropout_p=P, seed=seed))


def test_a_call_with_a_seed_is_its_kernels_alone(device):
    """tests/test_launches.py's test_an_attention_call_is_its_kernels_alone with dropout and the
    seed given: the forward draws none (no aten.randint), one Triton launch; the backward two."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 5, 16, device=device, requires_grad=True) for _ in range(3))
    pad = torch.tensor([[False, False, True, False, True], [True] * 5], device=device)
    grad_out = torch.randn(2, 2, 5, 16, device=device)
    seeds = _dropout.draw_seeds(3, device)
    with launches.counting(device.type) as counter:
        out = kernels.attention(q, k, v, key_padding_mask=pad, causal=True, dropout_p=0.1, seed=seeds[1:2])
        counter.phase = "backward"
        torch.autograd.grad(out, (q, k, v), grad_out)
    assert counter.ops("forward") == {"triton._attn_fwd_kernel": 1}
    assert counter.ops("backward") == {"triton._attn_bwd_kernel": 2}  # its dQ pass, then its dK/dV pass


def test_the_reference_checks_the_seed_and_drops_out_with_torchs_generator():
    q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
    seed = _dropout.draw_seed(q.device)
    torch.manual_seed(0)
    given = kernels.attention_reference(q, k, v, dropout_p=P, seed=seed)
    torch.manual_seed(0)
    assert torch.equal(given, kernels.attention_reference(q, k, v, dropout_p=P))
    with pytest.raises(ValueError, match="seed must be a one-element int64 tensor"):
        kernels.attention_reference(q, k, v, dropout_p=P, seed=seed.int())


@pytest.mark.cuda
@pytest.mark.parametrize("op", ["attention", "attention_reference"])
def test_a_seed_on_another_device_is_rejected(op):
    q = torch.randn(1, 1, 4, 16, device="cuda", dtype=torch.float16)
    with pytest.raises(ValueError, match="seed must be on the op's device"):
        getattr(kernels, op)(q, q, q, dropout_p=P, seed=_dropout.draw_seed("cpu"))


def test_drawn_seeds_are_16_byte_aligned_views():
    """Each seed a model hands over, `draw_seeds(n, device)[i:i + 1]`, starts on a 16-byte boundary,
    as a seed of its own does: Triton specializes pointer arguments on that alignment, so a seed 8
    bytes in would compile every dropout kernel a second time."""
    seeds = _dropout.draw_seeds(7, torch.device("cpu"))
    assert seeds.shape == (7,)
    for i in range(7):
        view = seeds[i : i + 1]
        assert view.data_ptr() % 16 == 0, i
        _dropout.check_seed(view, view.device)
    assert len(set(seeds.tolist())) == 7
