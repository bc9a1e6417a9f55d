"""The main job behind `fastformer train`, `evaluate` and `predict`: the tutorial's NSMC sentiment
pipeline (SentencePiece vocab, MovieClassification, cross-entropy, per-epoch evaluation) in one call.

A run directory holds everything needed to use or continue the model:

    config.json   the model's Config (Config.load reads it; the tutorial's classes accept it)
    vocab.model   the SentencePiece vocab
    model.pt      the model's state_dict: the tutorial's own MovieClassification loads it strictly
    trainer.pt    optimizer, schedule, scaler and epoch, for --resume
    metrics.json  per-epoch loss, accuracy and tokens/s, and the final test accuracy
    curves.png    loss and accuracy per epoch
    run.json      data files, device, backend, amp and the command's options

Inputs are all checked before the directory is created, so a bad file or option leaves nothing.
"""
import json
import os
import random
import shutil
import tempfile
import time

import torch
from tqdm.auto import tqdm

from fastformer import backend
from fastformer.config import Config
from fastformer.data import demo
from fastformer.data.reviews import LengthBucketSampler, MovieDataSet, check_labels, movie_collate_fn, read_reviews
from fastformer.data.vocab import check_vocab_matches, load_vocab, train_vocab
from fastformer.model import MovieClassification
from fastformer.training import evaluate, linear_warmup_decay_scheduler, predict_proba, train_epoch
from fastformer.version import __version__

# The tutorial's model is the CUDA default; on a CPU the job trains this smaller one (same shape
# of network, 2 layers of width 64) so that the default run finishes in a few minutes.
CPU_OVERRIDES = {"n_layer": 3, "d_hidn": 128, "n_head": 4, "d_head": 32, "d_ff": 512, "n_enc_seq": 128, "n_dec_seq": 8}
LABEL_NAMES = {2: ["negative", "positive"]}
RUN_FILES = ("config.json", "vocab.model", "model.pt", "trainer.pt", "metrics.json", "curves.png", "run.json")


def resolve_device(name):
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device: not a device: {name!r}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: CUDA is not available on this machine")
    return device


def resolve_amp(amp, device):
    """"auto" is bf16 autocast on a CUDA GPU that supports it, else off."""
    if amp == "auto":
        return "bf16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "off"
    return amp


def label_names(n_output):
    return LABEL_NAMES.get(n_output, [str(i) for i in range(n_output)])


def _write_atomic(path, write):
    """Write a file through a temporary name, so a crash never leaves half a file."""
    tmp = f"{path}.tmp"
    write(tmp)
    os.replace(tmp, path)


def _write_json(path, obj):
    def write(tmp):
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=2)
            f.write("\n")

    _write_atomic(path, write)


def plot_curves(history, path):
    """Loss and accuracy per epoch, train and test, side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    epochs = [h["epoch"] for h in history]
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 4))
    for split in ("train", "test"):
        ax_loss.plot(epochs, [h[f"{split}_loss"] for h in history], marker="o", label=split)
        ax_acc.plot(epochs, [h[f"{split}_accuracy"] for h in history], marker="o", label=split)
    ax_loss.set(xlabel="epoch", ylabel="cross-entropy", title="loss")
    ax_acc.set(xlabel="epoch", ylabel="accuracy", title="accuracy")
    for ax in (ax_loss, ax_acc):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    _write_atomic(path, lambda tmp: fig.savefig(tmp, format="png", dpi=100))
    plt.close(fig)


def default_config(device, n_vocab, n_output):
    overrides = {} if device.type == "cuda" else CPU_OVERRIDES
    return Config.tutorial(n_enc_vocab=n_vocab, n_dec_vocab=n_vocab, n_output=n_output, **overrides)


def _split(reviews, fraction, seed):
    order = list(range(len(reviews)))
    random.Random(seed).shuffle(order)
    n_test = max(1, int(len(reviews) * fraction))
    if n_test >= len(reviews):
        raise ValueError(f"--train has {len(reviews)} reviews: too few to hold out a test split; pass --test")
    return [reviews[i] for i in order[n_test:]], [reviews[i] for i in order[:n_test]]


def _loaders(config, vocab, train_reviews, test_reviews, batch_size, bucket, seed):
    train_set = MovieDataSet(vocab, train_reviews, max_len=config.n_enc_seq)
    test_set = MovieDataSet(vocab, test_reviews, max_len=config.n_enc_seq)

    def collate(batch):
        return movie_collate_fn(batch, i_pad=config.i_pad)

    if bucket:
        sampler = LengthBucketSampler(train_set.lengths(), batch_size, shuffle=True, seed=seed)
        train_loader = torch.utils.data.DataLoader(train_set, batch_sampler=sampler, collate_fn=collate)
    else:
        sampler = None
        g = torch.Generator().manual_seed(seed)
        train_loader = torch.utils.data.DataLoader(
            train_set, batch_size=batch_size, shuffle=True, generator=g, collate_fn=collate
        )
    test_loader = torch.utils.data.DataLoader(test_set, batch_size=batch_size, shuffle=False, collate_fn=collate)
    return train_loader, test_loader, sampler


def _check_positive(**values):
    for name, value in values.items():
        if value is not None and value <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {value}")


def train(
    *, train=None, test=None, vocab=None, config=None, epochs=None, batch_size=None, lr=5e-4,
    device=None, backend_name="auto", amp="auto", out=None, seed=0, max_steps=None, resume=None,
    vocab_size=8000, warmup=0.1, weight_decay=0.01, bucket=True, log=print,
):
    """Train MovieClassification end to end and write a run directory; returns its metrics dict.

    With no data arguments it runs on the embedded demo set; with --train only, 10% of it is held
    out as the test split. `resume` continues a run directory up to `epochs` in total.
    """
    _check_positive(epochs=epochs, batch_size=batch_size, lr=lr, max_steps=max_steps, vocab_size=vocab_size)
    if not 0 <= warmup < 1:
        raise ValueError(f"--warmup is a fraction of the steps in [0, 1), got {warmup}")
    device = resolve_device(device)
    amp = resolve_amp(amp, device)
    backend.set_backend(backend_name)
    previous = {}
    if resume is not None:
        previous = _load_run_json(resume)
        train = train or previous["train"]
        test = test if test is not None else previous.get("test")
        epochs = epochs or previous["epochs"]
        batch_size = batch_size or previous["batch_size"]
        seed = previous["seed"]  # the same held-out split and data order
    epochs = epochs or 5
    batch_size = batch_size or (128 if device.type == "cuda" else 64)
    torch.manual_seed(seed)
    random.seed(seed)

    # 1. data
    using_demo = train is None
    if using_demo:
        train, test = demo.TRAIN_FILE, demo.TEST_FILE
    if test is not None and resume is None and os.path.abspath(test) == os.path.abspath(train):
        raise ValueError("--test is the same file as --train")
    train_reviews = read_reviews(train, "train")
    if test is not None:
        test_reviews = read_reviews(test, "test")
    else:
        train_reviews, test_reviews = _split(train_reviews, 0.1, seed)

    # 2. vocab (trained into a scratch directory; it moves into the run directory below)
    scratch = tempfile.mkdtemp(prefix="fastformer-")
    try:
        if resume is not None:
            vocab = vocab or os.path.join(resume, "vocab.model")
        if vocab is not None:
            sp = load_vocab(vocab)
        else:
            if any(not isinstance(r.doc, str) for r in train_reviews):
                raise ValueError(f"{train} holds pieces of an existing vocab (JSONL); pass that vocab with --vocab")
            log(f"Training a BPE vocab of up to {vocab_size} + 7 pieces on {len(train_reviews)} reviews")
            sp = train_vocab((r.doc for r in train_reviews), os.path.join(scratch, "vocab.model"), n_pieces=vocab_size)
        vocab_file = vocab or os.path.join(scratch, "vocab.model")

        # 3. config
        n_classes = max(r.label for r in train_reviews) + 1
        if resume is not None:
            config = Config.load(os.path.join(resume, "config.json"))
        elif config is not None:
            if not os.path.isfile(config):
                raise FileNotFoundError(f"config file not found: {config}")
            config = Config.load(config)
        else:
            config = default_config(device, sp.get_piece_size(), max(2, n_classes))
        check_vocab_matches(sp, config, "--vocab" if vocab else "the vocab")
        check_labels(train_reviews, config.n_output, f"{train} (config.n_output)")
        check_labels(test_reviews, config.n_output, f"{test or train} (config.n_output)")

        # 4. model, data loaders, optimizer, schedule
        train_loader, test_loader, sampler = _loaders(config, sp, train_reviews, test_reviews, batch_size, bucket, seed)
        model = MovieClassification(config).to(device)
        decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() >= 2]
        no_decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() < 2]
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}], lr=lr
        )
        total_steps = epochs * len(train_loader) if max_steps is None else min(max_steps, epochs * len(train_loader))
        scheduler = linear_warmup_decay_scheduler(optimizer, int(warmup * total_steps), total_steps)
        scaler = torch.amp.GradScaler(device.type) if amp == "fp16" else None
        history, start_epoch, step = [], 0, 0
        if resume is not None:
            model.load_state_dict(torch.load(os.path.join(resume, "model.pt"), map_location=device))
            state = torch.load(os.path.join(resume, "trainer.pt"), map_location=device)
            optimizer.load_state_dict(state["optimizer"])
            scheduler.load_state_dict(state["scheduler"])
            if scaler is not None and state.get("scaler"):
                scaler.load_state_dict(state["scaler"])
            start_epoch, step = state["epoch"], state["step"]
            history = _read_json(os.path.join(resume, "metrics.json"))["epochs"]
            if start_epoch >= epochs:
                raise ValueError(f"--resume {resume}: the run already has {start_epoch} epochs; pass --epochs > {start_epoch}")

        # 5. the run directory: created only now that every input has been checked
        run_dir = resume or out or os.path.join("runs", time.strftime("sentiment-%Y%m%d-%H%M%S"))
        if resume is None:
            if os.path.exists(run_dir) and os.listdir(run_dir):
                raise ValueError(f"--out {run_dir} exists and is not empty; choose another, or --resume it")
            os.makedirs(run_dir, exist_ok=True)
            shutil.copyfile(vocab_file, os.path.join(run_dir, "vocab.model"))
            config.save(os.path.join(run_dir, "config.json"))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    run_info = {
        "fastformer": __version__,
        "train": os.path.abspath(train),
        "test": os.path.abspath(test) if test else None,
        "demo_data": using_demo,
        "epochs": epochs,
        "batch_size": batch_size,
        "lr": lr,
        "warmup": warmup,
        "weight_decay": weight_decay,
        "seed": seed,
        "device": str(device),
        "backend": backend.get_backend(),
        "kernels": "triton" if backend.uses_triton(torch.empty(0, device=device)) else "reference",
        "amp": amp,
        "label_names": label_names(config.n_output),
    }
    _write_json(os.path.join(run_dir, "run.json"), run_info)
    n_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    log(
        f"fastformer train: {len(train_reviews)} train / {len(test_reviews)} test reviews"
        f"{' (the embedded demo set)' if using_demo else ''}, vocab {sp.get_piece_size()} pieces"
    )
    log(
        f"  model    MovieClassification, {n_params / 1e6:.2f} M parameters: n_layer={config.n_layer} "
        f"d_hidn={config.d_hidn} n_head={config.n_head} d_ff={config.d_ff}"
    )
    log(f"  device   {device}, {run_info['kernels']} kernels (backend {run_info['backend']!r}), amp {amp}")
    log(f"  run dir  {run_dir}")

    try:
        for epoch in range(start_epoch, epochs):
            if max_steps is not None and step >= max_steps:
                break
            if sampler is not None:
                sampler.set_epoch(epoch)
            lr_now = scheduler.get_last_lr()[0]
            train_stats = train_epoch(
                model, train_loader, optimizer, scheduler, device=device, amp=amp, scaler=scaler,
                max_steps=None if max_steps is None else max_steps - step, desc=f"Train {epoch + 1}/{epochs}",
            )
            step += train_stats["steps"]
            test_stats = evaluate(model, test_loader, device=device, amp=amp, desc=f"Test  {epoch + 1}/{epochs}")
            history.append({
                "epoch": epoch + 1,
                "steps": step,
                "lr": lr_now,
                "train_loss": train_stats["loss"],
                "train_accuracy": train_stats["accuracy"],
                "test_loss": test_stats["loss"],
                "test_accuracy": test_stats["accuracy"],
                "tokens_per_s": train_stats["tokens_per_s"],
                "seconds": train_stats["seconds"],
            })
            _save_checkpoint(run_dir, model, optimizer, scheduler, scaler, epoch + 1, step, history)
            tqdm.write(
                f"epoch {epoch + 1}/{epochs}  train loss {train_stats['loss']:.4f} acc {train_stats['accuracy']:.3f}  "
                f"test loss {test_stats['loss']:.4f} acc {test_stats['accuracy']:.3f}  "
                f"{train_stats['tokens_per_s']:,.0f} tok/s  {train_stats['seconds']:.1f} s"
            )
    except BaseException:
        if resume is None and not history:  # nothing worth keeping: leave no half-written run
            shutil.rmtree(run_dir, ignore_errors=True)
        raise
    metrics = _read_json(os.path.join(run_dir, "metrics.json"))
    log(f"test accuracy {metrics['test_accuracy']:.4f} on {len(test_reviews)} reviews; run saved in {run_dir}")
    return metrics


def _save_checkpoint(run_dir, model, optimizer, scheduler, scaler, epoch, step, history):
    state_dict = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    _write_atomic(os.path.join(run_dir, "model.pt"), lambda tmp: torch.save(state_dict, tmp))
    trainer = {
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "scaler": scaler.state_dict() if scaler is not None else None,
        "epoch": epoch,
        "step": step,
    }
    _write_atomic(os.path.join(run_dir, "trainer.pt"), lambda tmp: torch.save(trainer, tmp))
    _write_json(os.path.join(run_dir, "metrics.json"), {"epochs": history, "test_accuracy": history[-1]["test_accuracy"]})
    plot_curves(history, os.path.join(run_dir, "curves.png"))


def _read_json(path):
    with open(path, "r", encoding="utf-8") as f:
        return json.load(f)


def _load_run_json(run_dir):
    if not os.path.isdir(run_dir):
        raise FileNotFoundError(f"run directory not found: {run_dir}")
    missing = [f for f in ("config.json", "vocab.model", "model.pt", "run.json") if not os.path.isfile(os.path.join(run_dir, f))]
    if missing:
        raise ValueError(f"{run_dir} is not a fastformer run directory (missing {', '.join(missing)})")
    return _read_json(os.path.join(run_dir, "run.json"))


def load_run(run_dir, device=None):
    """(config, vocab, model in eval mode, run info) from a run directory."""
    info = _load_run_json(run_dir)
    device = resolve_device(device)
    config = Config.load(os.path.join(run_dir, "config.json"))
    vocab = load_vocab(os.path.join(run_dir, "vocab.model"))
    check_vocab_matches(vocab, config)
    model = MovieClassification(config)
    model.load_state_dict(torch.load(os.path.join(run_dir, "model.pt"), map_location="cpu"))
    return config, vocab, model.to(device).eval(), info


def evaluate_run(*, run, test=None, batch_size=128, device=None, backend_name="auto", amp="auto", log=print):
    """Accuracy and loss of a saved run on a test file (default: the run's own test file)."""
    backend.set_backend(backend_name)
    config, vocab, model, info = load_run(run, device)
    device = next(model.parameters()).device
    test = test or info.get("test")
    if test is None:
        raise ValueError(f"{run} was trained with a held-out split of --train; pass --test FILE")
    reviews = read_reviews(test, "test")
    check_labels(reviews, config.n_output, f"{test} (config.n_output)")
    dataset = MovieDataSet(vocab, reviews, max_len=config.n_enc_seq)
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=batch_size, collate_fn=lambda b: movie_collate_fn(b, i_pad=config.i_pad)
    )
    stats = evaluate(model, loader, device=device, amp=resolve_amp(amp, device), desc="Test")
    log(f"accuracy {stats['accuracy']:.4f}  loss {stats['loss']:.4f}  on {stats['n']} reviews from {test}")
    return stats


def predict(*, run, texts, device=None, backend_name="auto", amp="auto", log=print):
    """The predicted label and its probability for each text; returns [(label_name, prob)]."""
    if not texts:
        raise ValueError("give at least one text to classify")
    backend.set_backend(backend_name)
    config, vocab, model, info = load_run(run, device)
    device = next(model.parameters()).device
    probs = predict_proba(model, vocab, texts, device=device, amp=resolve_amp(amp, device), max_len=config.n_enc_seq)
    names = info.get("label_names") or label_names(config.n_output)
    results = []
    for text, p in zip(texts, probs):
        label = int(p.argmax())
        results.append((names[label], float(p[label])))
        log(f"{names[label]:>8}  {float(p[label]):.3f}  {text}")
    return results
