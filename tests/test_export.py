"""The model exports as PyTorch models do: torch.export, and ONNX by both of torch.onnx's exporters,
run back by onnxruntime on reviews of other shapes than the example's (issue 68, item 3).

The ONNX tests need onnx, onnxscript and onnxruntime (the test extra installs them) and skip with
the reason where they are missing.
"""

import warnings

import numpy as np
import pytest
import torch

import fastformer
from fastformer.kernels import _runtime
from tests.helpers import small_config, token_batch


@pytest.fixture(scope="module")
def model():
    config = small_config(dropout=0.0)
    torch.manual_seed(0)
    return fastformer.MovieClassification(config).eval()


def example(model, bs=3, enc_len=9, seed=0):
    """A batch of reviews for the tutorial's one-token ([BOS]) decoder."""
    return token_batch(model.config, bs=bs, enc_len=enc_len, dec_len=1, seed=seed)


def expected_logits(model, enc, dec):
    with fastformer.use_backend("reference"), torch.no_grad():
        return model(enc, dec)[0].numpy()


def onnx_runtime():
    pytest.importorskip("onnx", reason="onnx is not installed")
    pytest.importorskip("onnxscript", reason="onnxscript is not installed (torch.onnx's dynamo exporter needs it)")
    return pytest.importorskip("onnxruntime", reason="onnxruntime is not installed")


def run_onnx(ort, path, enc, dec):
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    return session.run(None, {names[0]: enc.numpy(), names[1]: dec.numpy()})[0]


def test_torch_export_on_the_reference_backend_runs_as_the_model(model):
    enc, dec = example(model)
    with fastformer.use_backend("reference"):
        program = torch.export.export(model, (enc, dec))
    other = example(model, seed=1)
    np.testing.assert_allclose(program.module()(*other)[0].detach().numpy(), expected_logits(model, *other), atol=1e-5)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_onnx_dynamo_export_runs_in_onnxruntime(model, backend, tmp_path, monkeypatch):
    """torch.onnx.export(dynamo=True) on either backend: the kernels' ops have no ONNX function
    (it failed with 'No ONNX function found for fastformer.attention_forward'), so while exporting
    the model takes the PyTorch reference, said once where the kernels would have run."""
    ort = onnx_runtime()
    monkeypatch.setattr(_runtime, "_warned", set())
    enc, dec = example(model)
    with fastformer.use_backend(backend), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.onnx.export(model, (enc, dec), dynamo=True, verbose=False).save(tmp_path / "model.onnx")
    said = [str(w.message) for w in caught if "under torch.onnx.export" in str(w.message)]
    assert len(said) == (backend == "triton"), said
    logits = run_onnx(ort, tmp_path / "model.onnx", enc, dec)
    np.testing.assert_allclose(logits, expected_logits(model, enc, dec), atol=1e-5)


def test_onnx_legacy_export_with_dynamic_axes_runs_other_shapes(model, tmp_path):
    """The TorchScript-based exporter with dynamic batch and length: add + LayerNorm's reference
    takes its normalized shape from the LayerNorm's weight, a constant in the trace (it failed with
    a SymbolicValueError on F.layer_norm's shape taken from x)."""
    ort = onnx_runtime()
    enc, dec = example(model)
    path = tmp_path / "model.onnx"
    with fastformer.use_backend("reference"), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the legacy exporter's own deprecation warnings
        torch.onnx.export(
            model,
            (enc, dec),
            str(path),
            dynamo=False,
            input_names=["enc_inputs", "dec_inputs"],
            dynamic_axes={"enc_inputs": {0: "batch", 1: "length"}, "dec_inputs": {0: "batch"}},
        )
    other = example(model, bs=4, enc_len=12, seed=2)
    np.testing.assert_allclose(run_onnx(ort, path, *other), expected_logits(model, *other), atol=1e-5)
