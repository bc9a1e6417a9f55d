"""The drop-in model under bf16 autocast, a GPU run's default, checked on a CPU too: there the
Triton kernels run through the interpreter as tests/interpreter_bf16.py corrects it.

One state_dict in three models: the Triton backend and the reference backend, both under
torch.autocast(dtype=torch.bfloat16) with fp32 parameters, and the reference backend in fp64 with
no autocast. flash-attention's rule holds the Triton model to twice PyTorch's own bf16 error:
max|triton - fp64| <= 2 * max|reference_bf16 - fp64| + atol, for the logits and every parameter's
gradient.
"""

import pytest
import torch

import fastformer
from fastformer import kernels
from tests.helpers import assert_within_torch_error, small_config, token_batch

pytestmark = pytest.mark.bf16

ATOL = 1e-2  # the bf16 atol of the ops' parity tests
REFERENCES = ("attention_reference", "feed_forward_reference", "add_layer_norm_reference")  # the backend's choices


def test_model_under_bf16_autocast_matches_fp64_within_twice_torchs_error(device, monkeypatch):
    config = small_config(dropout=0.0)
    torch.manual_seed(0)
    base = fastformer.MovieClassification(config).to(device)
    # padded reviews of lengths 1 to 9: odd lengths, a length-1 query, Lq != Lk across attention
    enc, dec = (t.to(device) for t in token_batch(config, bs=3, enc_len=9, dec_len=5))
    dec[:, 0] = 2  # every decoder sequence starts with [BOS]
    upstream = torch.randn(
        enc.shape[0], config.n_output, generator=torch.Generator().manual_seed(1), dtype=torch.float64
    )

    def run_model(backend, dtype, autocast):
        model = fastformer.MovieClassification(config).to(device)
        model.load_state_dict(base.state_dict())
        model.to(dtype).eval()
        with fastformer.use_backend(backend), torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            logits = model(enc, dec)[0]
        (logits.double() * upstream.to(device)).sum().backward()
        return logits, {name: p.grad for name, p in model.named_parameters() if p.grad is not None}

    ref_logits, ref_grads = run_model("reference", torch.float64, autocast=False)
    torch_logits, torch_grads = run_model("reference", torch.float32, autocast=True)
    with monkeypatch.context() as patch:  # the Triton model runs every op's kernel, no reference
        for name in REFERENCES:
            patch.setattr(
                kernels, name, lambda *args, name=name, **kwargs: pytest.fail(f"the Triton model called {name}")
            )
        logits, grads = run_model("triton", torch.float32, autocast=True)

    assert logits.dtype == torch_logits.dtype == torch.bfloat16
    assert_within_torch_error("logits", logits, ref_logits, torch_logits, ATOL)
    assert grads.keys() == ref_grads.keys() == torch_grads.keys()
    for name in ref_grads:
        assert grads[name].dtype == torch.float32, name
        assert_within_torch_error(f"grad {name}", grads[name], ref_grads[name], torch_grads[name], ATOL)
