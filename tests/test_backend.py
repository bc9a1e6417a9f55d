"""The backend switch: set_backend, use_backend, FASTFORMER_BACKEND, and attention probabilities."""

import os
import subprocess
import sys
import warnings

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import fastformer
from fastformer import backend, kernels
from tests.helpers import small_config, token_batch


def test_default_is_auto_and_set_backend_changes_it():
    assert fastformer.get_backend() == "auto"
    fastformer.set_backend("reference")
    assert fastformer.get_backend() == "reference"
    with pytest.raises(ValueError, match="backend must be one of 'auto', 'triton', 'reference', got 'cuda'"):
        fastformer.set_backend("cuda")


def test_use_backend_restores_the_previous_choice_even_on_error():
    fastformer.set_backend("reference")
    with pytest.raises(RuntimeError), fastformer.use_backend("triton"):
        assert fastformer.get_backend() == "triton"
        raise RuntimeError("inside")
    assert fastformer.get_backend() == "reference"


def test_a_use_backend_block_holds_in_its_own_thread_only():
    """Two threads in blocks of their own each see theirs while the other's is open, as torch's
    no_grad and autocast are per thread; set_backend holds in every thread outside a block (issue
    69, round 6: a thread's block changed another's)."""
    import threading

    fastformer.set_backend("auto")
    both_in, checked = threading.Barrier(2), threading.Barrier(2)
    seen, errors = {}, []

    def worker(name):
        try:
            with fastformer.use_backend(name):
                both_in.wait(10)  # the other thread's block is open too
                seen[name] = fastformer.get_backend()
                checked.wait(10)
            seen[f"{name} after"] = fastformer.get_backend()
        except Exception as error:  # noqa: BLE001 (reported by the assertion below)
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(name,)) for name in ("triton", "reference")]
    with fastformer.use_backend("reference"):  # the main thread's block is its own too
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        assert fastformer.get_backend() == "reference"
    assert not errors, errors
    assert seen == {"triton": "triton", "reference": "reference", "triton after": "auto", "reference after": "auto"}
    outside = []
    fastformer.set_backend("reference")
    thread = threading.Thread(target=lambda: outside.append(fastformer.get_backend()))
    thread.start()
    thread.join(10)
    assert outside == ["reference"]  # set_backend: every thread


def test_environment_variable(monkeypatch):
    monkeypatch.setenv("FASTFORMER_BACKEND", "reference")
    assert fastformer.get_backend() == "reference"
    with fastformer.use_backend("triton"):
        assert fastformer.get_backend() == "triton"
    monkeypatch.setenv("FASTFORMER_BACKEND", "fast")
    with pytest.raises(ValueError, match=r"\$FASTFORMER_BACKEND must be one of"):
        fastformer.get_backend()


def test_an_env_setting_is_read_live_and_parsed_once_per_value(monkeypatch):
    """EnvSetting (how the backend and autotune switches read the environment on every op call)
    sees each change made through os.environ at its next call, parses a value once however
    often it is read, and rejects a bad value on every read."""
    parsed = []

    def parse(value):
        parsed.append(value)
        if value == "bad":
            raise ValueError("bad value")
        return value

    setting = kernels._runtime.EnvSetting("FASTFORMER_TEST_SETTING", parse)
    monkeypatch.delenv("FASTFORMER_TEST_SETTING", raising=False)
    assert [setting(), setting()] == [None, None]
    monkeypatch.setenv("FASTFORMER_TEST_SETTING", "a")
    assert [setting(), setting()] == ["a", "a"]
    monkeypatch.setenv("FASTFORMER_TEST_SETTING", "b")
    os.environ["FASTFORMER_TEST_SETTING"] = "b"  # the same value set again: a new object, parsed again
    assert setting() == "b"
    monkeypatch.setenv("FASTFORMER_TEST_SETTING", "bad")
    for _ in range(2):
        with pytest.raises(ValueError, match="bad value"):
            setting()
    monkeypatch.delenv("FASTFORMER_TEST_SETTING")
    assert setting() is None
    assert parsed == [None, "a", "b", "bad", "bad", None]


@pytest.mark.parametrize("value", ["1", "true", "True", "ON", "yes", "Y", "0", "false", "no", "off", "", " 1", "2"])
def test_triton_interpret_is_read_as_triton_reads_it(value, monkeypatch):
    """fastformer reads TRITON_INTERPRET before importing Triton (the CLI's checks) and after (the
    kernels); both must agree with Triton's own reading, which decides whether kernels are interpreted."""
    from fastformer.environment import interpreter_requested, triton_available

    getenv_bool = pytest.importorskip("triton._C.libtriton").getenv_bool
    monkeypatch.setenv("TRITON_INTERPRET", value)
    assert interpreter_requested() == getenv_bool("TRITON_INTERPRET", False)
    monkeypatch.delitem(sys.modules, "fastformer.kernels")  # as before the kernels are imported
    assert triton_available() == (True, getenv_bool("TRITON_INTERPRET", False))


@pytest.mark.versions
def test_the_kernels_are_interpreted_under_a_truthy_value_other_than_1():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="true")
    code = "from fastformer import kernels; print(kernels.INTERPRET)"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "True"


def test_auto_uses_triton_for_cuda_tensors_only():
    cpu = torch.zeros(1)
    assert not backend.uses_triton(cpu)
    with fastformer.use_backend("triton"):
        assert backend.uses_triton(cpu)
    with fastformer.use_backend("reference"):
        assert not backend.uses_triton(cpu)


def test_ops_dispatch_to_the_chosen_implementation(monkeypatch):
    calls = []
    monkeypatch.setattr(backend.kernels, "attention", lambda *a, **kw: calls.append("triton"))
    monkeypatch.setattr(backend.kernels, "attention_reference", lambda *a, **kw: calls.append("reference"))
    q = torch.zeros(1, 1, 1, 16)
    with fastformer.use_backend("triton"):
        backend.attention(q, q, q)
    with fastformer.use_backend("reference"):
        backend.attention(q, q, q)
    backend.attention(q, q, q)  # auto on a CPU tensor
    assert calls == ["triton", "reference", "reference"]


@pytest.mark.parametrize(
    "flag, backend_name, expect_probs",
    [
        (None, "reference", True),  # the tutorial's behaviour on the reference path
        (None, "triton", False),  # the fast path never builds probabilities unless asked
        (True, "triton", True),
        (False, "reference", False),
    ],
)
def test_output_attentions_policy(flag, backend_name, expect_probs):
    overrides = {} if flag is None else {"output_attentions": flag}
    config = small_config(dropout=0.0, **overrides)
    model = fastformer.MovieClassification(config).eval()
    enc, dec = token_batch(config, bs=2)  # a policy: 2 reviews (lengths 13 and 1) show it on the interpreter
    with fastformer.use_backend(backend_name), torch.no_grad():
        _, enc_probs, dec_probs, cross_probs = model(enc, dec)
    for probs in (enc_probs, dec_probs, cross_probs):
        assert len(probs) == config.n_layer
        assert all((p is not None) == expect_probs for p in probs)
    if expect_probs:
        assert enc_probs[0].shape == (enc.size(0), config.n_head, enc.size(1), enc.size(1))
        assert cross_probs[0].shape == (enc.size(0), config.n_head, dec.size(1), enc.size(1))


def test_triton_backend_matches_reference_on_the_model():
    config = small_config(dropout=0.0)
    model = fastformer.MovieClassification(config).eval()
    enc, dec = token_batch(config, bs=3)  # lengths 13, 1, 5: a full, a length-1 and an odd row
    with torch.no_grad():
        with fastformer.use_backend("reference"):
            expected = model(enc, dec)[0]
        with fastformer.use_backend("triton"):
            got = model(enc, dec)[0]
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.versions
def test_model_traces_as_one_graph_on_the_reference_backend():
    """torch.compile(fullgraph=True) sees no graph break in fastformer's own Python (the backend
    switch reading the environment, Config attribute access, AttentionMask). Traced with the
    "eager" compiler backend, so it runs on a CPU; the Triton ops under compile are `cuda` tests."""
    config = small_config(dropout=0.0)
    model = fastformer.MovieClassification(config)
    enc, dec = token_batch(config, enc_len=9, dec_len=5)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    for name in (None, "reference"):  # from $FASTFORMER_BACKEND's default, then set explicitly
        if name:
            fastformer.set_backend(name)
        torch.testing.assert_close(compiled(enc, dec)[0], model(enc, dec)[0], rtol=0, atol=0)


@pytest.mark.versions
def test_model_traces_as_one_graph_under_autocast_with_its_forward_plan():
    """Under bf16 autocast the ForwardPlan casts the weights once and hands the products the half
    copies add + LayerNorm writes (Hidden pairs): torch.compile(fullgraph=True) traces that as
    one graph, forward and backward, with eager's results bit for bit."""
    config = small_config(dropout=0.0)
    model = fastformer.MovieClassification(config)
    enc, dec = token_batch(config, enc_len=9, dec_len=5)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    outputs = []
    for run in (compiled, model):
        model.zero_grad(set_to_none=True)
        with fastformer.use_backend("reference"), torch.autocast("cpu", dtype=torch.bfloat16):
            logits = run(enc, dec)[0]
        logits.float().sum().backward()
        outputs.append((logits, [p.grad for p in model.parameters()]))
    (logits, grads), (expected_logits, expected_grads) = outputs
    assert logits.dtype == torch.bfloat16
    torch.testing.assert_close(logits, expected_logits, rtol=0, atol=0)
    for grad, expected in zip(grads, expected_grads):
        torch.testing.assert_close(grad, expected, rtol=0, atol=0)


def fake_cuda(dtype):
    """A CUDA tensor without a GPU (fake tensors carry a device and a dtype, no data)."""
    return torch.empty(2, 3, dtype=dtype, device="cuda")


@pytest.mark.parametrize(
    "dtype, matmul, expected",
    [
        (torch.bfloat16, True, True),
        (torch.float16, True, True),
        (torch.float32, True, False),  # attention / FFN in fp32 at "highest": the reference (cuBLAS)
        (torch.float32, False, True),  # add + LayerNorm has no matrix product: its kernel takes fp32
    ],
)
def test_auto_keeps_fp32_matrix_products_on_cuda_off_the_kernels(dtype, matmul, expected):
    assert torch.get_float32_matmul_precision() == "highest"  # PyTorch's default, the suite's
    with FakeTensorMode():
        assert backend.uses_triton(fake_cuda(dtype), matmul=matmul) == expected
        with fastformer.use_backend("triton"):  # forcing the kernels still runs them in fp32
            assert backend.uses_triton(fake_cuda(dtype), matmul=matmul)


@pytest.mark.parametrize("allow", ["high", "medium", "legacy"])
def test_auto_runs_fp32_matrix_products_on_the_kernels_where_pytorch_takes_tf32(allow):
    """Where PyTorch's own fp32 matmuls would take TF32 (either precision API), "auto" runs fp32
    attention and the FFN on the kernels, whose fp32 products are then TF32 (issue 68, item 1);
    back at "highest", the reference again. Each API restored by itself: PyTorch refuses legacy
    reads once the two are mixed."""
    assert torch.get_float32_matmul_precision() == "highest"
    try:
        if allow == "legacy":
            torch.backends.cuda.matmul.allow_tf32 = True
        else:
            torch.set_float32_matmul_precision(allow)
        assert kernels._runtime.dot_precision(torch.float32) == "tf32"
        with FakeTensorMode():
            assert backend.uses_triton(fake_cuda(torch.float32))
            assert backend.ops(fake_cuda(torch.float32)).feed_forward is kernels.feed_forward
            assert not backend.uses_triton(torch.zeros(2, 3))  # a CPU tensor: the reference, as always
    finally:
        if allow == "legacy":
            torch.backends.cuda.matmul.allow_tf32 = False
        else:
            torch.set_float32_matmul_precision("highest")
    with FakeTensorMode():
        assert not backend.uses_triton(fake_cuda(torch.float32))


def test_the_tf32_choice_compiles_in_one_graph_and_follows_the_precision():
    """backend.in_tf32 inside torch.compile(fullgraph=True), where "auto" asks it of an fp32 model
    on CUDA: no graph break (Dynamo cannot trace PyTorch's precision getter; it takes its result as
    a constant), and the graph is made again when the precision changes."""
    x = torch.zeros(2)
    compiled = torch.compile(lambda t: t + 1 if backend.in_tf32(t) else t - 1, fullgraph=True, backend="eager")
    assert torch.get_float32_matmul_precision() == "highest"
    try:
        assert compiled(x).tolist() == [-1.0, -1.0]
        torch.set_float32_matmul_precision("high")
        assert compiled(x).tolist() == [1.0, 1.0]
    finally:
        torch.set_float32_matmul_precision("highest")
    assert compiled(x).tolist() == [-1.0, -1.0]


def test_half_precision_follows_autocast():
    x, ids = torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.long)
    assert not backend.in_half_precision(x) and not backend.in_half_precision(ids)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert backend.in_half_precision(x) and backend.in_half_precision(ids)
        assert not backend.in_half_precision(x.double())  # autocast leaves fp64 alone
    assert backend.in_half_precision(x.half())


def test_jit_trace_on_the_reference_backend_says_nothing_of_fastformers_checks_and_generalizes():
    """torch.jit.trace of the model on the reference backend: none of the TracerWarnings that
    fastformer's argument checks gave (168 on 2026-12-02, each shape comparison), and the trace
    computes the model's outputs on other reviews of the same shape (issue 68, item 5)."""
    from pathlib import Path

    config = small_config(dropout=0.0)
    torch.manual_seed(0)
    model = fastformer.MovieClassification(config).eval()
    enc, dec = token_batch(config, bs=3, enc_len=9, dec_len=4)
    repo = str(Path(__file__).resolve().parent.parent)
    with fastformer.use_backend("reference"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        traced = torch.jit.trace(model, (enc, dec), check_trace=False)
        ours = [w for w in caught if issubclass(w.category, torch.jit.TracerWarning) and w.filename.startswith(repo)]
        assert not ours, sorted({f"{w.filename}:{w.lineno}: {w.message}" for w in ours})[:5]
        other = enc.flip(0).roll(1, dims=1)
        assert torch.allclose(traced(other, dec)[0], model(other, dec)[0], atol=1e-6)


def test_jit_trace_on_the_triton_backend_records_the_reference_and_says_so_once(monkeypatch):
    """The kernels' ops do not trace: under torch.jit.trace the reference runs, said once, and the
    trace computes the model's outputs on other reviews (issue 68, item 5; it used to fail with
    `seq_len must be a positive int ... got tensor(20)`)."""
    monkeypatch.setattr(kernels._runtime, "_warned", set())
    config = small_config(dropout=0.0)
    torch.manual_seed(0)
    model = fastformer.MovieClassification(config).eval()
    enc, dec = token_batch(config, bs=3, enc_len=9, dec_len=4)
    with fastformer.use_backend("triton"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        traced = torch.jit.trace(model, (enc, dec), check_trace=False)
    said = [w for w in caught if "under torch.jit.trace the model runs the PyTorch reference" in str(w.message)]
    assert len(said) == 1, [str(w.message) for w in caught]
    other = enc.flip(0).roll(1, dims=1)
    with fastformer.use_backend("reference"):
        assert torch.allclose(traced(other, dec)[0], model(other, dec)[0], atol=1e-6)


@pytest.mark.parametrize("name, warns", [("reference", False), ("triton", True)])
def test_a_torch_func_transform_warns_only_where_the_kernels_would_have_run(monkeypatch, name, warns):
    """Under vmap the reference runs: said once where the kernels would have run, not on the
    reference backend, where nothing falls back (issue 68, item 6)."""
    monkeypatch.setattr(kernels._runtime, "_warned", set())
    x = torch.randn(2, 3, 4)
    with fastformer.use_backend(name), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        used = torch.func.vmap(lambda t: torch.tensor(backend.uses_triton(t)))(x)
        assert not used.any() and backend.uses_triton(x) == (name == "triton")
    said = [w for w in caught if "under a torch.func transform" in str(w.message)]
    assert len(said) == warns, [str(w.message) for w in caught]


def test_fp32_attention_and_ffn_on_cuda_run_the_reference_and_warn_once(monkeypatch):
    calls = []
    for name in ("attention", "attention_reference", "feed_forward", "feed_forward_reference"):
        monkeypatch.setattr(backend.kernels, name, lambda *a, name=name, **kw: calls.append(name))
    monkeypatch.setattr(kernels._runtime, "_warned", set())
    with FakeTensorMode():
        x32, x16 = fake_cuda(torch.float32), fake_cuda(torch.float16)
        with pytest.warns(
            UserWarning,
            match=r"float32 attention and feed-forward run the PyTorch reference on CUDA.*"
            r'torch.autocast.*set_float32_matmul_precision\("high"\)',
        ):
            backend.attention(x32, x32, x32)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # once per process: the second call is silent
            backend.feed_forward(x32, x32, None, x32, None)
            backend.attention(x16, x16, x16)
    assert calls == ["attention_reference", "feed_forward_reference", "attention"]


@pytest.mark.parametrize("precision", ["tf32", "ieee"])
def test_the_kernels_read_pytorchs_newer_fp32_precision_api(precision):
    """torch.backends.cuda.matmul.fp32_precision (PyTorch's newer API) set, PyTorch's legacy
    allow_tf32 raises when read; the kernels read the precision by the newer API's getter, so a
    planned call (kernels._configs.switches) and dot_precision work under it. Before, every planned
    Triton call raised 'PyTorch is checking whether allow_tf32_new is enabled ...'."""
    before = torch.backends.cuda.matmul.fp32_precision
    try:
        torch.backends.cuda.matmul.fp32_precision = precision
        assert kernels._runtime.dot_precision(torch.float32) == precision
        assert kernels._runtime.dot_precision(torch.bfloat16) == "tf32"  # half precision: no question
        x = torch.randn(5, 8)
        assert kernels._configs.switches(x)[4] is (precision == "tf32")
        with fastformer.use_backend("triton"):
            y = kernels.add_layer_norm(x, x, None, None, 1e-5)  # a planned Triton call
        assert torch.allclose(y, kernels.add_layer_norm_reference(x, x, None, None, 1e-5), atol=1e-5)
    finally:
        torch.backends.cuda.matmul.fp32_precision = before
    assert torch.backends.cuda.matmul.allow_tf32 is False  # the legacy reads work again once it is back
