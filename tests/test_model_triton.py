"""The whole model on the Triton backend (attention, linear_gelu, add_layer_norm kernels) against
the reference backend, with shared weights: outputs and every parameter's gradient."""

import pytest
import torch

import fastformer
from tests.helpers import assert_within_torch_error, small_config, token_batch

BF16 = pytest.param(torch.bfloat16, 1e-2, "gelu", id="bf16", marks=pytest.mark.bf16)


@pytest.mark.parametrize(
    "dtype, atol, activation",
    [
        pytest.param(torch.float32, 1e-5, "gelu", id="fp32"),
        pytest.param(torch.float32, 1e-5, "relu", id="fp32-relu"),
        BF16,
    ],
)
def test_model_on_triton_matches_reference_outputs_and_all_gradients(dtype, atol, activation, device):
    """Shared weights: the Triton backend vs the reference backend in the same dtype, both
    measured against the reference backend in fp64."""
    config = small_config(dropout=0.0, ffn_activation=activation)
    torch.manual_seed(0)
    base = fastformer.MovieClassification(config).to(device)
    # 3 reviews (encoder lengths 13, 1, 5; decoder 7, 3, 1): full, length-1 and odd rows, at the
    # tutorial's heads and layers; the interpreter's time grows with the batch
    enc, dec = (t.to(device) for t in token_batch(config, bs=3, enc_len=13, dec_len=7))
    dec[:, 0] = 2  # every decoder sequence starts with [BOS]

    def run_model(backend, run_dtype):
        model = fastformer.MovieClassification(config).to(device)
        model.load_state_dict(base.state_dict())
        model.to(run_dtype)
        with fastformer.use_backend(backend):
            dec_outputs = model.transformer(enc, dec)[0]
        dec_outputs.double().sum().backward()
        return dec_outputs, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    ref_out, ref_grads = run_model("reference", torch.float64)
    torch_out, torch_grads = run_model("reference", dtype)
    out, grads = run_model("triton", dtype)
    assert_within_torch_error("dec_outputs", out, ref_out, torch_out, atol)
    assert grads.keys() == ref_grads.keys()
    for name in ref_grads:
        assert_within_torch_error(f"grad {name}", grads[name], ref_grads[name], torch_grads[name], atol)
