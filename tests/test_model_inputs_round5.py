"""What the model does with inputs it cannot run, on both backends alike: empty batches and
sequences, ids of the wrong dtype or rank (a ValueError naming the argument); a float64 model (the
reference, with a one-time warning naming the dtype); config numbers out of any range (a
ValueError naming the field)."""

import json
import re
import warnings

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import fastformer
from fastformer import Config, backend, kernels
from fastformer.compat import aladdinpersson as compat
from fastformer.config import BYTES_TO_BUILD, SIZES, TUTORIAL, check_config, check_fits
from tests.helpers import small_config, token_batch
from tests.test_aladdinpersson import SMALL, batch

BACKENDS = ("reference", "triton")


def raised_on_each_backend(call):
    """The (type, message) `call` raises on each backend (it must raise on both)."""
    seen = []
    for name in BACKENDS:
        # any type here: the caller asserts it, and that both backends raise the same
        with fastformer.use_backend(name), pytest.raises(Exception) as info:
            call()
        seen.append((info.type, str(info.value)))
    return seen


def assert_raises_alike(call, error, message):
    """`call` raises `error` with `message` (a regex) on the reference and on the Triton backend."""
    (ref_type, ref_text), (triton_type, triton_text) = raised_on_each_backend(call)
    assert (ref_type, ref_text) == (triton_type, triton_text), f"reference: {ref_text!r}; triton: {triton_text!r}"
    assert ref_type is error, f"{ref_type.__name__}: {ref_text}"
    assert re.search(message, ref_text), (message, ref_text)


# Token ids: the drop-in model's modules


@pytest.fixture(scope="module")
def modules():
    config = small_config(dropout=0.0)
    torch.manual_seed(0)
    model = fastformer.MovieClassification(config).eval()
    enc, dec = token_batch(config)
    enc_outputs = torch.randn(*enc.shape, config.d_hidn)
    return model, enc, dec, enc_outputs


EMPTY_ROWS = r"^{} holds sequences of no tokens, shape \({}, 0\): each needs at least one"
EMPTY_BATCH = r"^{} is an empty batch, shape \(0, {}\): the model needs at least one sequence$"
NOT_2D = r"^{} must be a \(bs, n_seq\) tensor of token ids, got shape \({},\)$"
NOT_INT = r"^{} must hold integer token ids \(torch.long\), got torch.float32: the embedding takes torch.long and "

# (the module called, its arguments made of (enc, dec, enc_outputs), the message)
MODEL_CASES = {
    # an empty sequence: a reshape of 0 elements on the reference, seq_len's check on Triton
    "classifier-enc-no-tokens": ("classifier", lambda e, d, o: (e[:, :0], d), EMPTY_ROWS.format("enc_inputs", 5)),
    "classifier-dec-no-tokens": ("classifier", lambda e, d, o: (e, d[:, :0]), EMPTY_ROWS.format("dec_inputs", 5)),
    "transformer-enc-no-tokens": ("transformer", lambda e, d, o: (e[:, :0], d), EMPTY_ROWS.format("enc_inputs", 5)),
    "transformer-dec-no-tokens": ("transformer", lambda e, d, o: (e, d[:, :0]), EMPTY_ROWS.format("dec_inputs", 5)),
    "encoder-no-tokens": ("encoder", lambda e, d, o: (e[:, :0],), EMPTY_ROWS.format("inputs", 5)),
    "decoder-dec-no-tokens": ("decoder", lambda e, d, o: (d[:, :0], e, o), EMPTY_ROWS.format("dec_inputs", 5)),
    "decoder-enc-no-tokens": ("decoder", lambda e, d, o: (d, e[:, :0], o[:, :0]), EMPTY_ROWS.format("enc_inputs", 5)),
    # an empty batch: attention's "needs non-empty inputs" on both backends
    "classifier-no-reviews": ("classifier", lambda e, d, o: (e[:0], d[:0]), EMPTY_BATCH.format("enc_inputs", 13)),
    "classifier-dec-no-reviews": ("classifier", lambda e, d, o: (e[:1], d[:0]), EMPTY_BATCH.format("dec_inputs", 7)),
    "transformer-no-reviews": ("transformer", lambda e, d, o: (e[:0], d[:0]), EMPTY_BATCH.format("enc_inputs", 13)),
    "encoder-no-reviews": ("encoder", lambda e, d, o: (e[:0],), EMPTY_BATCH.format("inputs", 13)),
    "decoder-no-reviews": ("decoder", lambda e, d, o: (d[:0], e[:0], o[:0]), EMPTY_BATCH.format("dec_inputs", 7)),
    # rank 1: was "must hold the same reviews" (the first dimensions, 13 and 7, compared)
    "classifier-1d": ("classifier", lambda e, d, o: (e[0], d[0]), NOT_2D.format("enc_inputs", 13)),
    "classifier-dec-1d": ("classifier", lambda e, d, o: (e, d[0]), NOT_2D.format("dec_inputs", 7)),
    "transformer-1d": ("transformer", lambda e, d, o: (e[0], d[0]), NOT_2D.format("enc_inputs", 13)),
    # the Decoder's enc_inputs, which it reads for their padding alone: was not checked but for rank
    "decoder-enc-float": ("decoder", lambda e, d, o: (d, e.float(), o), NOT_INT.format("enc_inputs")),
    # integer ids the embedding does not take: were torch's own embedding error (issue 69, round 6)
    "classifier-enc-int16": (
        "classifier",
        lambda e, d, o: (e.to(torch.int16), d),
        NOT_INT.replace("float32", "int16").format("enc_inputs"),
    ),
    "classifier-dec-uint8": (
        "classifier",
        lambda e, d, o: (e, d.to(torch.uint8)),
        NOT_INT.replace("float32", "uint8").format("dec_inputs"),
    ),
    "encoder-int8": (
        "encoder",
        lambda e, d, o: (e.to(torch.int8),),
        NOT_INT.replace("float32", "int8").format("inputs"),
    ),
}


def test_int32_ids_run_as_long_ids_do(modules):
    """torch.int32, which nn.Embedding takes as the tutorial's model does, gives the same logits."""
    model, enc, dec, _ = modules
    with torch.no_grad():
        torch.testing.assert_close(model(enc.int(), dec.int())[0], model(enc, dec)[0], rtol=0, atol=0)


@pytest.mark.parametrize("case", list(MODEL_CASES))
def test_ids_the_model_cannot_run_name_the_argument_alike_on_both_backends(modules, case):
    model, enc, dec, enc_outputs = modules
    target, arguments, message = MODEL_CASES[case]
    module = {
        "classifier": model,
        "transformer": model.transformer,
        "encoder": model.transformer.encoder,
        "decoder": model.transformer.decoder,
    }[target]
    args = arguments(enc, dec, enc_outputs)
    assert_raises_alike(lambda: module(*args), ValueError, message)


# Token ids: the Aladdin Persson compat model


@pytest.fixture(scope="module")
def compat_model():
    torch.manual_seed(0)
    return compat.Transformer(**SMALL).eval()


COMPAT_CASES = {
    "src-no-tokens": ("forward", lambda s, t: (s[:, :0], t), EMPTY_ROWS.format("src", 3)),
    "trg-no-tokens": ("forward", lambda s, t: (s, t[:, :0]), EMPTY_ROWS.format("trg", 3)),
    "no-sentences": ("forward", lambda s, t: (s[:0], t[:0]), EMPTY_BATCH.format("src", 11)),
    # trg's checks were the Decoder's, named x; rank 1 failed unpacking x.shape
    "trg-float": ("forward", lambda s, t: (s, t.float()), NOT_INT.format("trg")),
    "trg-1d": ("forward", lambda s, t: (s, t[0]), NOT_2D.format("trg", 7)),
    "batches-differ": (
        "forward",
        lambda s, t: (s, t[:2]),
        r"^src and trg must hold the same sentences, one per row: got src \(3, 11\) and trg \(2, 7\)$",
    ),
    "encoder-1d": ("encoder", lambda s, t: (s[0], None), NOT_2D.format("x", 11)),
    "encoder-no-tokens": ("encoder", lambda s, t: (s[:, :0], None), EMPTY_ROWS.format("x", 3)),
    "decoder-1d": ("decoder", lambda s, t: (t[0], torch.zeros(3, 11, 64), None, None), NOT_2D.format("x", 7)),
    "generate-no-tokens": ("generate", lambda s, t: (s[:, :0], 5, 1), EMPTY_ROWS.format("src", 3)),
    "generate-no-sentences": ("generate", lambda s, t: (s[:0], 5, 1), EMPTY_BATCH.format("src", 11)),
}


@pytest.mark.parametrize("case", list(COMPAT_CASES))
def test_the_compat_models_ids_name_the_argument_alike_on_both_backends(compat_model, case):
    target, arguments, message = COMPAT_CASES[case]
    call = {
        "forward": compat_model,
        "encoder": compat_model.encoder,
        "decoder": compat_model.decoder,
        "generate": compat_model.generate,
    }[target]
    args = arguments(*batch())
    assert_raises_alike(lambda: call(*args), ValueError, message)


# A float64 model: the kernels take fp16, bf16 and fp32

FLOAT64_WARNING = (
    r"^fastformer: the Triton kernels take fp16, bf16 and fp32; this model is float64, so it runs the PyTorch "
    r"reference: use model\.float\(\) for the kernels, or fastformer\.set_backend\('reference'\)$"
)


@pytest.fixture
def fresh_warnings(monkeypatch):
    """No one-time warning given yet in this process."""
    monkeypatch.setattr(kernels._runtime, "_warned", set())


def test_a_float64_model_on_the_triton_backend_runs_the_reference_with_one_warning(fresh_warnings):
    """It raised "qkv must be one of (float16, bfloat16, float32)" from the kernel's check."""
    config = small_config(dropout=0.0)
    torch.manual_seed(0)
    model = fastformer.MovieClassification(config).double().eval()
    enc, dec = token_batch(config)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the reference chosen, or "auto" on a CPU: nothing to warn about
        with fastformer.use_backend("reference"):
            expected = model(enc, dec)
        torch.testing.assert_close(model(enc, dec), expected, rtol=0, atol=0)
    with fastformer.use_backend("triton"):
        with pytest.warns(UserWarning, match=FLOAT64_WARNING) as record:
            outputs = model(enc, dec)
        assert len([w for w in record if "float64" in str(w.message)]) == 1
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # once per process
            again = model(enc, dec)
    assert outputs[0].dtype == torch.float64
    # the reference's ops, the reference's probabilities (the Triton path would return None)
    torch.testing.assert_close(outputs, expected, rtol=0, atol=0)
    torch.testing.assert_close(again, expected, rtol=0, atol=0)


def test_a_float64_compat_model_on_the_triton_backend_runs_the_reference(fresh_warnings):
    torch.manual_seed(0)
    model = compat.Transformer(**SMALL).double().eval()
    src, trg = batch()
    with fastformer.use_backend("reference"):
        expected, expected_tokens = model(src, trg), model.generate(src, 5, 1)
    with fastformer.use_backend("triton"), pytest.warns(UserWarning, match=FLOAT64_WARNING):
        logits, tokens = model(src, trg), model.generate(src, 5, 1)
    torch.testing.assert_close(logits, expected, rtol=0, atol=0)
    assert torch.equal(tokens, expected_tokens)


@pytest.mark.parametrize("name", ["attention", "feed_forward", "add_layer_norm"])
def test_auto_runs_float64_cuda_tensors_on_the_reference_with_the_dtype_warning(monkeypatch, fresh_warnings, name):
    """On CUDA, "auto" kept float64 attention and feed-forward off the kernels with the fp32
    warning's advice (autocast, which leaves float64 alone), and sent add + LayerNorm to its
    kernel, which refuses float64."""
    calls = []
    for op in (name, f"{name}_reference"):
        monkeypatch.setattr(backend.kernels, op, lambda *a, op=op, **kw: calls.append(op))
    with FakeTensorMode():
        x = torch.empty(2, 3, dtype=torch.float64, device="cuda")  # a fake CUDA tensor: no GPU needed
        args = {"attention": (x, x, x), "feed_forward": (x, x, x, x, x), "add_layer_norm": (x, x, x, x, 1e-5)}
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            getattr(backend, name)(*args[name])
            ops = backend.ops(x)
            assert not ops.kernels and ops.add_layer_norm is backend.kernels.add_layer_norm_reference
    assert calls == [f"{name}_reference"]
    assert [str(w.message) for w in record] == [
        "fastformer: the Triton kernels take fp16, bf16 and fp32; this model is float64, so it runs the PyTorch "
        "reference: use model.float() for the kernels, or fastformer.set_backend('reference')"
    ]


# Config numbers out of any range

NUMBERS = [*SIZES, "i_pad", "dropout", "layer_norm_epsilon"]
# every number no field takes, in every field; the first three were the hole: 10**400 passed
# check_config as a size (OverflowError in the memory check, or torch's error building the model)
# and raised OverflowError as layer_norm_epsilon; an integer over 4,300 digits cannot be repr()'d
OUT_OF_RANGE = [10**400, -(10**400), 10**5000, 1e400, -1e400, float("nan"), True, False]


def test_config_numbers_out_of_any_range_name_their_field():
    wrong = []
    for key in NUMBERS:
        for value in OUT_OF_RANGE:
            try:
                check_config(Config.tutorial(**{key: value}), classifier=True)
                wrong.append(f"{key}={type(value).__name__}: passed")
            except ValueError as error:  # named, and short: a huge integer is described, not printed
                if not str(error).startswith(f"config.{key} ") or len(str(error)) > 160:
                    wrong.append(f"{key}: {str(error)[:200]}")
            except OverflowError as error:  # what 10**400 as layer_norm_epsilon raised
                wrong.append(f"{key}={type(value).__name__}: {type(error).__name__}: {error}")
    assert not wrong, "\n".join(wrong)


def test_a_size_too_large_for_any_tensor_says_so_and_the_model_is_not_built():
    message = r"^config\.d_hidn must be at most 2\*\*63 - 1 \(torch's largest size\), got an integer of 401 digits$"
    with pytest.raises(ValueError, match=message):
        fastformer.MovieClassification(Config.tutorial(d_hidn=10**400))
    with pytest.raises(ValueError, match=r"^config\.n_enc_vocab must be at most 2\*\*63 - 1 .* 9223372036854775808$"):
        fastformer.Transformer(Config.tutorial(n_enc_vocab=2**63))


def test_the_memory_check_names_a_size_too_large_for_any_tensor():
    """check_fits meets sizes check_config has not seen (--n-output): it raised OverflowError
    writing the bytes such a model needs."""
    config = Config.tutorial(n_output=10**400)
    with pytest.raises(ValueError, match=r"^--n-output must be at most 2\*\*63 - 1 .*, got an integer of 401 digits$"):
        check_fits(config, 2**30, "the memory", BYTES_TO_BUILD, {"n_output": "--n-output"})
    with pytest.raises(ValueError, match=r"^config\.d_ff must be at most 2\*\*63 - 1"):
        check_fits(Config.tutorial(d_ff=10**400), 2**30, "the memory", BYTES_TO_BUILD)


def test_a_config_file_with_numbers_out_of_range_names_the_field(tmp_path):
    """JSON gives 1e400 as inf, NaN and Infinity as floats, a 401-digit literal as an int."""
    huge = "1" + "0" * 400
    cases = {
        f'"d_hidn": {huge}': r"config\.d_hidn must be at most 2\*\*63 - 1 .*, got an integer of 401 digits",
        f'"layer_norm_epsilon": {huge}': r"config\.layer_norm_epsilon must be a finite number > 0, got an integer of",
        f'"i_pad": -{huge}': r"config\.i_pad must be a token id in 0\.\.8006 .*, got a negative integer of 401",
        '"n_enc_vocab": 1e400': r"config\.n_enc_vocab must be a positive integer, got inf",
        '"n_layer": NaN': r"config\.n_layer must be a positive integer, got nan",
        '"n_head": true': r"config\.n_head must be a positive integer, got True",
        '"layer_norm_epsilon": -Infinity': r"config\.layer_norm_epsilon must be a finite number > 0, got -inf",
        '"dropout": 1e400': r"config\.dropout is a probability in \[0, 1\), got inf",
    }
    path = tmp_path / "config.json"
    for text, message in cases.items():
        path.write_text(json.dumps(TUTORIAL)[:-1] + ", " + text + "}")  # the later key wins
        with pytest.raises(ValueError, match=f"^{message}"):
            check_config(Config.load(path), classifier=True)
