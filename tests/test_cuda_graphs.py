"""fastformer.train.graphs and `fastformer train`'s CUDA graphs (the default where they apply,
--cuda-graphs, --no-cuda-graphs): the option checks, the default and why it falls back, and the
optimizer's two forms on a CPU; on a GPU (`cuda`), replayed steps against eager steps, bit for bit."""

import json

import pytest
import torch

import fastformer
from fastformer.cli import main
from fastformer.packing import use_packing
from fastformer.train import job
from fastformer.train.graphs import GraphedSteps, make_capturable
from fastformer.train.loop import adamw, autocast, evaluate, linear_warmup_decay_scheduler, train_epoch, train_step
from fastformer.train.run import StepModes, check_on_device, settle_steps, step_modes
from tests.helpers import small_config, tiny_job_files, token_batch, train_args

CUDA = torch.device("cuda")
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """test_train_job's tiny separable set."""
    return tiny_job_files(tmp_path_factory.mktemp("data"))


GRAPHS_ON_CPU = "--cuda-graphs needs a CUDA device; the device is cpu"


@pytest.mark.parametrize(
    "device, amp, backend_name, distributed, options, message",
    [
        ("cpu", "off", "reference", False, dict(cuda_graphs=True), GRAPHS_ON_CPU),
        (CPU, "off", "auto", False, dict(cuda_graphs=True), GRAPHS_ON_CPU),
        (CUDA, "bf16", "triton", False, dict(cuda_graphs=True, compile=True), "--cuda-graphs and --compile are"),
        (CUDA, "fp16", "triton", False, dict(cuda_graphs=True), "--cuda-graphs does not take --amp fp16"),
        (CUDA, "bf16", "auto", False, dict(cuda_graphs=True, pad_to_buckets=False), "--cuda-graphs needs --pad-to"),
        (CUDA, "bf16", "triton", True, dict(cuda_graphs=True), "--cuda-graphs is not supported under torchrun"),
        ("cpu", "off", "triton", False, dict(compile=True), "--compile on cpu needs the reference kernels"),
        (CPU, "off", "reference", True, dict(compile=True), "--compile is not supported under torchrun"),
        (CUDA, "bf16", "auto", False, dict(precompile=True, pad_to_buckets=False), "--precompile needs --pad-to-"),
        (CUDA, "bf16", "auto", False, dict(precompile=True, pad_to_buckets=True, compile=True), "--precompile and"),
        ("cpu", "off", "triton", False, dict(interpret=False), "--backend triton on cpu needs a CUDA GPU, or Triton's"),
    ],
)
def test_step_options_that_cannot_run_are_refused(device, amp, backend_name, distributed, options, message):
    """step_modes refuses the combinations of the flags, amp and torchrun; check_on_device what
    the device decides (a name before torch, a torch.device after; Triton's interpreter on unless
    named): the job runs each check once."""
    options = dict(options)  # the parameters are shared between runs
    interpret = options.pop("interpret", True)
    modes = dict(dict(cuda_graphs=None, compile=False, pad_to_buckets=None, precompile=None), **options)
    with pytest.raises(ValueError, match=message):
        step_modes(amp, distributed, **modes)
        check_on_device(device, backend_name, interpret, cuda_graphs=modes["cuda_graphs"], compile=modes["compile"])


NO_CUDA = "CUDA graphs need a CUDA device; the device is cpu"


@pytest.mark.parametrize(
    "device, amp, distributed, backend_name, options, resolved, why",
    [
        # not given: CUDA graphs where they apply, buckets and precompiling with them
        (CUDA, "bf16", False, "triton", dict(), (True, False, True, True), None),
        (CUDA, "off", False, "reference", dict(), (True, False, True, True), None),
        (CUDA, "fp16", False, "triton", dict(), (False, False, False, False), "--amp fp16: its GradScaler reads"),
        (CUDA, "bf16", False, "triton", dict(compile=True), (False, True, False, False), "--compile runs torch.co"),
        (CUDA, "bf16", True, "triton", dict(), (False, False, False, False), "CUDA graphs are not supported under tor"),
        (CUDA, "bf16", False, "auto", dict(pad_to_buckets=False), (False, False, False, False), "--no-pad-to-buckets"),
        (CPU, "off", False, "reference", dict(), (False, False, False, False), NO_CUDA),  # eager, to the longest
        ("cpu", "off", False, "triton", dict(pad_to_buckets=True), (False, False, True, True), NO_CUDA),
        (CPU, "off", False, "reference", dict(compile=True), (False, True, False, False), NO_CUDA),
        (CPU, "off", False, "auto", dict(compile=True, pad_to_buckets=True), (False, True, True, False), NO_CUDA),
        # given
        (CUDA, "bf16", False, "triton", dict(cuda_graphs=True), (True, False, True, True), None),
        (
            CUDA,
            "off",
            False,
            "auto",
            dict(cuda_graphs=True, pad_to_buckets=True, precompile=False),
            (True, False, True, False),
            None,
        ),
        (CUDA, "bf16", False, "triton", dict(cuda_graphs=False), (False, False, False, False), None),
        (CUDA, "bf16", False, "triton", dict(cuda_graphs=False, pad_to_buckets=True), (False, False, True, True), None),
    ],
)
def test_step_options_that_run_and_the_modes_they_get(device, amp, distributed, backend_name, options, resolved, why):
    """step_modes checks what is given; settle_steps resolves the rest on the device, and says why
    the steps run eagerly where CUDA graphs were not given and do not apply."""
    modes = dict(dict(cuda_graphs=None, compile=False, pad_to_buckets=None, precompile=None), **options)
    check_on_device(device, backend_name, True, cuda_graphs=modes["cuda_graphs"], compile=modes["compile"])
    settled, eager = settle_steps(step_modes(amp, distributed, **modes), torch.device(device), amp, distributed)
    assert settled == StepModes(*resolved)
    assert (eager is None) if why is None else eager.startswith(why), eager


def test_precompile_without_buckets_is_refused_where_graphs_do_not_apply():
    modes = step_modes("off", False, cuda_graphs=None, compile=False, pad_to_buckets=None, precompile=True)
    assert settle_steps(modes, CUDA, "bf16", False)[0] == StepModes(True, False, True, True)  # buckets with graphs
    with pytest.raises(ValueError, match="--precompile needs --pad-to-buckets"):
        settle_steps(modes, CPU, "off", False)


def test_a_job_on_a_cpu_runs_eagerly_says_nothing_of_graphs_and_run_json_says_why(files, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(train_args(files, out, "--epochs", "1")) == 0
    header = capsys.readouterr().out
    assert "amp off, eager steps\n" in header and "CUDA" not in header  # nothing to say of CUDA graphs on a CPU
    run = json.loads((out / "run.json").read_text())
    assert (run["cuda_graphs"], run["pad_to_buckets"], run["eager_because"]) == (False, False, NO_CUDA)


@pytest.mark.parametrize("device_given", [True, False])
@pytest.mark.parametrize(
    "argv, message",
    [
        (["--cuda-graphs"], "--cuda-graphs needs a CUDA device; the device is cpu"),
        (["--compile", "--backend", "triton"], "--compile on cpu needs the reference kernels"),
    ],
)
def test_the_command_refuses_them_in_one_line_before_any_work(files, tmp_path, capsys, argv, message, device_given):
    """With --device cpu the check runs before torch; without, on the device the job resolves (the
    CPU, on a machine with no GPU)."""
    if not device_given and torch.cuda.is_available():
        pytest.skip("without --device the job takes the GPU, where these run")
    out = tmp_path / "run"
    args = train_args(files, out, *argv)
    if not device_given:
        at = args.index("--device")
        del args[at : at + 2]
    assert main(args) == 2
    stdout, err = capsys.readouterr()
    assert err.startswith(f"fastformer train: error: {message}") and err.count("\n") == 1, err
    assert stdout == "" and not out.exists()


def test_the_python_api_raises_value_error_naming_the_option():
    with pytest.raises(ValueError, match="--cuda-graphs needs a CUDA device"):
        job.train(cuda_graphs=True, device="cpu")


def test_graphed_steps_need_a_cuda_model():
    model = fastformer.MovieClassification(small_config())
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.5)
    with pytest.raises(ValueError, match="CUDA graphs need the model on a CUDA device; it is on cpu"):
        GraphedSteps(model, optimizer)


def test_the_captured_train_step_is_the_train_step(monkeypatch):
    """What GraphedSteps captures for training is fastformer.train.loop.train_step itself, with
    autocast's cast cache off and grad enabled (a replay may be asked for under no_grad): checked on
    a CPU by calling the body a capture records."""
    calls = []

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return train_step(*args, **kwargs)

    monkeypatch.setattr(fastformer.train.graphs, "train_step", spy)
    g = torch.Generator().manual_seed(0)
    batch = (torch.randint(0, 3, (4,), generator=g), torch.randint(1, 50, (4, 16), generator=g), torch.full((4, 1), 2))

    def fresh():
        torch.manual_seed(0)
        model = fastformer.MovieClassification(small_config(dropout=0.0))
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    model, optimizer = fresh()
    graphs = object.__new__(GraphedSteps)  # its constructor wants a CUDA model
    graphs.model, graphs.optimizer, graphs.device, graphs.amp = model, optimizer, CPU, "bf16"
    with torch.no_grad():
        loss, logits = graphs._train_body(*batch)
    eager_model, eager_optimizer = fresh()
    eager_loss, eager_logits = train_step(eager_model, batch, eager_optimizer, device=CPU, amp="bf16")
    assert calls == [dict(device=CPU, amp="bf16", cache=False)]
    assert torch.equal(loss, eager_loss) and torch.equal(logits, eager_logits)
    for (name, a), b in zip(model.state_dict().items(), eager_model.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("fused", [False, True], ids=["default", "fused"])
def test_make_capturable_switches_forms_and_keeps_every_value(fused):
    """Eager -> capturable -> eager leaves an AdamW that steps exactly as one never switched (lr 0.5
    is exact in fp32, the capturable form's lr dtype), the fused form as `fastformer train` builds
    it included."""

    def adamw():
        torch.manual_seed(0)
        param = torch.nn.Parameter(torch.randn(4, 3))
        return param, torch.optim.AdamW([param], lr=0.5, weight_decay=0.1, fused=fused)

    def step(param, optimizer):
        optimizer.zero_grad()
        (param**2).sum().backward()
        optimizer.step()

    switched, untouched = adamw(), adamw()
    step(*switched)
    step(*untouched)
    optimizer = make_capturable(switched[1])
    group, state = optimizer.param_groups[0], optimizer.state[switched[0]]
    assert group["capturable"] and isinstance(group["lr"], torch.Tensor) and group["lr"].dtype == torch.float32
    assert group["lr"].item() == 0.5 and state["step"].device == switched[0].device and state["step"].item() == 1
    make_capturable(optimizer, False)
    assert group["capturable"] is False and group["lr"] == 0.5 and state["step"].device.type == "cpu"
    step(*switched)
    step(*untouched)
    torch.testing.assert_close(switched[0], untouched[0], rtol=0, atol=0)
    with pytest.raises(TypeError, match="SGD has no capturable option"):
        make_capturable(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1))


def test_a_fused_optimizer_keeps_its_step_counts_on_the_parameters_device():
    """A fused AdamW (`fastformer train`'s eager optimizer) keeps its step counts where its
    parameters are in its eager form too, as its kernel requires (the capturable form puts every
    optimizer's there): shown on the meta device, which a count moved to the CPU would leave. Its
    capturable form steps an lr of exactly 0 to no change (the NaN make_capturable's docstring
    warns of is the per-tensor form's)."""
    param = torch.nn.Parameter(torch.zeros(2, device="meta"))
    optimizer = torch.optim.AdamW([param], lr=0.5, fused=True)
    optimizer.state[param]["step"] = torch.zeros((), device="meta")
    make_capturable(optimizer, False)
    assert optimizer.state[param]["step"].device.type == "meta"
    param = torch.nn.Parameter(torch.ones(3))
    optimizer = make_capturable(torch.optim.AdamW([param], lr=0.0, fused=True))
    param.grad = torch.zeros(3)
    optimizer.step()
    assert torch.equal(param, torch.ones(3))


class EagerGraphs:
    """Stands in for GraphedSteps on a CPU: the eager steps, counted, to check the loops' wiring."""

    def __init__(self, model, optimizer):
        self.model, self.optimizer, self.calls, self.rows = model, optimizer, [], []

    def train_step(self, batch, rows=None):
        self.calls.append("train")
        self.rows.append(rows)
        return train_step(self.model, batch, self.optimizer, device="cpu")

    def logits(self, enc_inputs, dec_inputs, rows=None):
        self.calls.append("eval")
        self.rows.append(rows)
        return self.model(enc_inputs, dec_inputs)[0]


def test_the_loops_take_their_steps_from_the_graphs_and_step_the_schedule():
    config = small_config(dropout=0.0)
    g = torch.Generator().manual_seed(0)
    batches = [
        (torch.randint(0, 3, (4,), generator=g), torch.randint(1, 50, (4, 16), generator=g), torch.full((4, 1), 2))
        for _ in range(3)
    ]
    batches[1][1][:, 9:] = config.i_pad  # padding: replayed in a token bucket of 40 rows (eighths of 8)

    def run(graphed):
        torch.manual_seed(0)
        model = fastformer.MovieClassification(config)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        scheduler = linear_warmup_decay_scheduler(optimizer, 1, 3)
        graphs = EagerGraphs(model, optimizer) if graphed else None
        stats = train_epoch(model, batches, optimizer, scheduler, device="cpu", graphs=graphs)
        stats = [stats[k] for k in ("loss", "accuracy", "tokens")]
        stats += evaluate(model, batches, device="cpu", graphs=graphs).values()
        return stats, model, scheduler, graphs

    eager, eager_model, eager_scheduler, _ = run(False)
    graphed, graphed_model, graphed_scheduler, graphs = run(True)
    assert graphs.calls == ["train"] * 3 + ["eval"] * 3
    assert graphs.rows == [None, 40, None] * 2  # each batch's replay_rows, read on the host
    assert graphed_scheduler.last_epoch == eager_scheduler.last_epoch == 3
    assert graphed == eager
    for (name, a), b in zip(graphed_model.state_dict().items(), eager_model.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


# On a GPU: replays against the eager steps. Bit for bit: a replay runs the kernels the eager step
# launches, on the same inputs, and the project's kernels are deterministic (gpu_check's
# determinism stage checks eager steps twice), so any difference means the graph replays something
# else (a stale input, a constant lr, a state the warm-up left behind). A capture cannot read the
# count of real tokens: given no rows, replays run padded (fastformer.packing), and the eager steps
# held to them run padded too; given a batch's rows, in its token bucket, as the eager steps then.


def _batches(config, shapes, seed=0):
    """(labels, enc_inputs, dec_inputs) on the GPU, one batch per (batch size, padded length)."""
    g = torch.Generator().manual_seed(seed)
    batches = []
    for bs, width in shapes:
        lengths = torch.randint(1, width + 1, (bs,), generator=g)
        enc = torch.randint(1, config.n_enc_vocab, (bs, width), generator=g)
        enc = enc.masked_fill(torch.arange(width) >= lengths[:, None], config.i_pad)
        labels = torch.randint(0, config.n_output, (bs,), generator=g)
        batches.append(tuple(t.to(CUDA) for t in (labels, enc, torch.full((bs, 1), 2))))
    return batches


# shapes repeat after another was captured, and a short last batch: 3 graphs, 6 steps
SHAPES = [(8, 16), (8, 24), (8, 16), (8, 24), (5, 16), (8, 16)]
PATHS = [pytest.param("triton", "bf16", id="triton-bf16"), pytest.param("reference", "off", id="reference-fp32")]


@pytest.mark.cuda
@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
@pytest.mark.parametrize("backend_name, amp", PATHS)
def test_replayed_train_steps_give_the_losses_and_weights_of_eager_steps(backend_name, amp, fused):
    """Both capturable forms of AdamW: the fused one, which the job's steps take eager and replayed
    (11 launches a step: tools.work), and torch's default foreach (68), a drop-in user's."""
    config = small_config(dropout=0.0)
    batches = _batches(config, SHAPES)

    def run(graphed):
        torch.manual_seed(0)
        model = fastformer.MovieClassification(config).to(CUDA).train()
        optimizer = make_capturable(torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, fused=fused))
        scheduler = linear_warmup_decay_scheduler(optimizer, 2, len(batches))
        graphs = GraphedSteps(model, optimizer, amp=amp) if graphed else None
        initial, losses = model.projection.weight.detach().clone(), []
        with fastformer.use_backend(backend_name):
            for batch in batches:
                if graphed:
                    loss, _ = graphs.train_step(batch)
                else:
                    with use_packing(False):
                        loss, _ = train_step(model, batch, optimizer, device=CUDA, amp=amp)
                scheduler.step()
                losses.append(loss)
        return torch.stack(losses), model.state_dict(), graphs, initial

    eager_losses, eager_weights, _, _ = run(False)
    losses, weights, graphs, initial = run(True)
    assert graphs.captured == 3
    torch.testing.assert_close(losses, eager_losses, rtol=0, atol=0)
    for name in eager_weights:
        torch.testing.assert_close(weights[name], eager_weights[name], rtol=0, atol=0, msg=name)
    assert not torch.equal(weights["projection.weight"], initial)  # it trained


@pytest.mark.cuda
def test_replayed_train_steps_on_real_tokens_give_the_losses_and_weights_of_eager_steps_in_their_bucket():
    """Given each batch's replay_rows (read on the host), a graph is captured per shape and rows, its
    encoder on the real tokens and fillers up to the rows (fastformer.packing.token_bucket): bit
    for bit the eager steps in the same token bucket, within rounding of the padded ones."""
    from fastformer.packing import replay_rows, token_bucket

    config = small_config(dropout=0.0)
    batches = _batches(config, SHAPES)
    rows = [replay_rows(enc.cpu(), config.i_pad) for _, enc, _ in batches]
    assert all(r is not None for r in rows) and len(set(rows)) > 1, rows

    def run(mode):
        torch.manual_seed(0)
        model = fastformer.MovieClassification(config).to(CUDA).train()
        optimizer = make_capturable(torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, fused=True))
        graphs = GraphedSteps(model, optimizer, amp="bf16") if mode == "replayed" else None
        packed = []
        model.transformer.packed = _spy(model.transformer.packed, packed)
        losses = []
        with fastformer.use_backend("triton"):
            for batch, r in zip(batches, rows):
                if mode == "replayed":
                    loss, _ = graphs.train_step(batch, r)
                else:
                    with token_bucket(r) if mode == "bucket" else use_packing(False):
                        loss, _ = train_step(model, batch, optimizer, device=CUDA, amp="bf16")
                losses.append(loss)
        return torch.stack(losses), model.state_dict(), graphs, packed

    padded_losses, _, _, _ = run("padded")
    bucket_losses, bucket_weights, _, bucket_packed = run("bucket")
    losses, weights, graphs, packed = run("replayed")
    assert graphs.captured == len({(r, shape) for r, shape in zip(rows, SHAPES)})
    assert bucket_packed and packed  # the encoder ran packed, eager and in the captures
    torch.testing.assert_close(losses, bucket_losses, rtol=0, atol=0)
    for name in bucket_weights:
        torch.testing.assert_close(weights[name], bucket_weights[name], rtol=0, atol=0, msg=name)
    torch.testing.assert_close(losses, padded_losses, rtol=2e-2, atol=2e-2)  # bf16: another order of sums


def _spy(method, calls):
    def spied(*args, **kwargs):
        calls.append(args[0].shape)
        return method(*args, **kwargs)

    return spied


@pytest.mark.cuda
@pytest.mark.parametrize("backend_name, amp", PATHS)
def test_replayed_evaluation_gives_the_eager_logits_of_the_current_weights(backend_name, amp):
    config = small_config(dropout=0.1)
    first, second = _batches(config, [(8, 16), (8, 24)])
    torch.manual_seed(0)
    model = fastformer.MovieClassification(config).to(CUDA)
    optimizer = make_capturable(torch.optim.AdamW(model.parameters(), lr=1e-2))
    graphs = GraphedSteps(model, optimizer, amp=amp)

    def both(batch):
        with fastformer.use_backend(backend_name):
            replayed = graphs.logits(*batch[1:])
            with torch.no_grad(), autocast(CUDA, amp), use_packing(False):
                return replayed, model(*batch[1:])[0]

    model.eval()
    before = [both(batch) for batch in (first, second)]
    model.train()
    with fastformer.use_backend(backend_name):
        graphs.train_step(first)  # the weights change; the eval graphs must read the new ones
    model.eval()
    after = [both(batch) for batch in (first, second)]
    assert graphs.captured == 3
    for replayed, eager in before + after:
        torch.testing.assert_close(replayed, eager, rtol=0, atol=0)
    assert not torch.equal(after[0][0], before[0][0])


@pytest.mark.cuda
def test_every_replay_draws_new_dropout_masks():
    """lr 0: the weights stay, so the same batch replayed gives other losses only through dropout."""
    config = small_config(dropout=0.1)
    batch = _batches(config, [(8, 16)])[0]
    torch.manual_seed(0)
    model = fastformer.MovieClassification(config).to(CUDA).train()
    graphs = GraphedSteps(model, make_capturable(torch.optim.AdamW(model.parameters(), lr=0.0)), amp="bf16")
    with fastformer.use_backend("triton"):
        losses = [graphs.train_step(batch)[0].item() for _ in range(3)]
    assert len(set(losses)) == 3, losses


@pytest.mark.cuda
def test_the_default_job_on_cuda_replays_its_steps_and_says_why_where_it_does_not(files, tmp_path, capsys):
    """No option: CUDA graphs with buckets; --amp fp16: eager, with the reason in the header and
    run.json; --no-cuda-graphs: eager, with no reason to give."""
    runs = {}
    for name, options in (("default", ()), ("fp16", ("--amp", "fp16")), ("no", ("--no-cuda-graphs",))):
        assert main(train_args(files, tmp_path / name, "--device", "cuda", "--epochs", "1", *options)) == 0
        runs[name] = (json.loads((tmp_path / name / "run.json").read_text()), capsys.readouterr().out)
    run, header = runs["default"]
    assert (run["cuda_graphs"], run["pad_to_buckets"], run["eager_because"], run["amp"]) == (True, True, None, "bf16")
    assert "amp bf16, CUDA graphs, padded to multiples of 16\n" in header
    run, header = runs["fp16"]
    assert (run["cuda_graphs"], run["pad_to_buckets"]) == (False, False)
    assert run["eager_because"].startswith("--amp fp16: its GradScaler reads the host")
    assert f"amp fp16, eager steps ({run['eager_because']})\n" in header
    run, header = runs["no"]
    assert (run["cuda_graphs"], run["eager_because"]) == (False, None) and "amp bf16, eager steps\n" in header


@pytest.mark.cuda
def test_the_default_jobs_replayed_steps_take_the_fused_adamw_made_capturable(files, tmp_path, monkeypatch):
    """The job's one AdamW (loop.adamw) is fused in its replayed steps as in its eager ones, made
    capturable: its lr a device tensor, its step counts on the device (11 launches a step, where the
    capturable foreach form makes 68: tools.work)."""
    built = []
    monkeypatch.setattr(job, "adamw", lambda *args, **kwargs: built.append(adamw(*args, **kwargs)) or built[-1])
    assert main(train_args(files, tmp_path / "run", "--device", "cuda", "--max-steps", "2")) == 0
    (optimizer,) = built
    for group in optimizer.param_groups:
        assert group["fused"] is True and group["capturable"] is True and group["lr"].device.type == "cuda"
    assert {state["step"].device.type for state in optimizer.state.values()} == {"cuda"}
    assert {state["step"].item() for state in optimizer.state.values()} == {2.0}


@pytest.mark.cuda
def test_evaluate_replays_a_graph_per_bucket_and_gives_the_eager_accuracy(files, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(train_args(files, out, "--device", "cuda", "--epochs", "1")) == 0
    capsys.readouterr()
    results = {}
    for how in ("--cuda-graphs", "--no-cuda-graphs"):
        assert main(["evaluate", "--run", str(out), "--device", "cuda", how]) == 0
        results[how] = capsys.readouterr().out.strip().splitlines()[-1]
    assert results["--cuda-graphs"].endswith("; CUDA graphs") and results["--no-cuda-graphs"].endswith("; eager")
    accuracy = {how: float(line.split()[1]) for how, line in results.items()}
    reviews = int(results["--cuda-graphs"].split(" on ")[1].split()[0])
    # bucket padding changes the logits by rounding only: a review on the boundary may flip, no more
    assert abs(accuracy["--cuda-graphs"] - accuracy["--no-cuda-graphs"]) <= 1 / reviews


# the drop-in loop's batches, two epochs of the longest review of each (small_config's n_enc_seq is
# 24: buckets 16 and 24)
DROP_IN_LENGTHS = (5, 9, 20, 14, 22, 3, 16, 24) * 2


def drop_in_losses(config, compiled, dtype=torch.float32, backend_name="auto", amp="bf16", step=None):
    """The tutorial's training loop (docs/drop-in.md) over DROP_IN_LENGTHS, batches padded by
    fastformer.pad_to_bucket: the model eager, or under torch.compile(mode="reduce-overhead").
    `step` (a list) holds the index of the batch running."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = fastformer.MovieClassification(config).to(CUDA, dtype).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    forward = torch.compile(model, mode="reduce-overhead") if compiled else model
    losses = []
    with fastformer.use_backend(backend_name):
        for i, length in enumerate(DROP_IN_LENGTHS):
            if step is not None:
                step[:] = [i]
            enc, _ = token_batch(config, bs=5, enc_len=length, seed=i)
            dec = torch.full((5, 1), 2)
            labels = torch.randint(0, config.n_output, (5,), generator=torch.Generator().manual_seed(i))
            enc, dec, labels = fastformer.pad_to_bucket(enc, config).to(CUDA), dec.to(CUDA), labels.to(CUDA)
            torch.compiler.cudagraph_mark_step_begin()
            optimizer.zero_grad(set_to_none=True)
            with autocast(CUDA, amp):
                logits = forward(enc, dec)[0]
            loss = torch.nn.functional.cross_entropy(logits.float(), labels)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    return losses


@pytest.mark.cuda
def test_the_drop_in_loop_under_reduce_overhead_replays_a_graph_per_bucket_and_tracks_eager(monkeypatch):
    """torch.compile(model, mode="reduce-overhead") over batches padded to their buckets: Inductor's
    CUDA graphs are recorded a bounded number of times (a forward and a backward graph per bucket,
    and the first bucket's once more under the graph Dynamo recompiles with dynamic shapes at the
    second), all in the first epoch, none skipped; the second epoch replays them. The losses keep to
    the tests' rule against fp64 beside the eager loop's."""
    from torch._dynamo.utils import counters
    from torch._inductor import cudagraph_trees

    from tools.convergence import LOSS_ATOL, compare_curves

    step, recorded = [0], []
    record = cudagraph_trees.CUDAGraphTreeManager.record_function
    monkeypatch.setattr(
        cudagraph_trees.CUDAGraphTreeManager,
        "record_function",
        lambda self, *args, **kwargs: recorded.append(step[0]) or record(self, *args, **kwargs),
    )
    config = small_config(dropout=0.0)
    counters.clear()
    curves = {
        "fastformer": drop_in_losses(config, compiled=True, step=step),
        "reference": drop_in_losses(config, compiled=False),
        "reference_fp64": drop_in_losses(config, False, torch.float64, "reference", "off"),
    }
    buckets, epoch = {16, 24}, len(DROP_IN_LENGTHS) // 2
    assert recorded and all(i < epoch for i in recorded), recorded  # the second epoch only replays
    assert len(recorded) <= 2 * (len(buckets) + 1), recorded
    assert counters["inductor"]["cudagraph_skips"] == 0
    result = compare_curves(curves, LOSS_ATOL["bf16"])
    assert result["agree"], (result, curves)


@pytest.mark.cuda
def test_train_with_cuda_graphs_learns_and_resumes_without_them(files, tmp_path):
    out = tmp_path / "run"
    assert main(train_args(files, out, "--device", "cuda", "--cuda-graphs")) == 0
    run = json.loads((out / "run.json").read_text())
    assert (run["cuda_graphs"], run["pad_to_buckets"], run["amp"]) == (True, True, "bf16")
    assert json.loads((out / "metrics.json").read_text())["test_accuracy"] >= 0.9  # chance is 0.5
    # the checkpoint holds the capturable optimizer; an eager resume converts it back
    assert main(["train", "--resume", str(out), "--epochs", "4", "--device", "cuda", "--no-cuda-graphs"]) == 0
    run = json.loads((out / "run.json").read_text())
    assert [(r["cuda_graphs"], r["pad_to_buckets"], r["eager_because"]) for r in run["resumed"]] == [
        (False, False, None)  # asked for: no reason to give
    ]
    assert json.loads((out / "metrics.json").read_text())["test_accuracy"] >= 0.9
