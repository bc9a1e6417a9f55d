"""The `fastformer` command."""
import argparse
import sys
import time

from fastformer.version import __version__


def _demo(args):
    """Build the tutorial's MovieClassification, run one forward and backward, and say what happened."""
    import torch

    from fastformer import Config, MovieClassification, backend

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    backend.set_backend(args.backend)
    torch.manual_seed(args.seed)
    config = Config.tutorial()
    model = MovieClassification(config).to(device)
    n_params = sum(p.numel() for p in model.parameters() if p.requires_grad)

    # Reviews of random lengths, padded to the batch maximum; the decoder reads [BOS] (id 2).
    lengths = torch.randint(args.seq_len // 4, args.seq_len + 1, (args.batch_size,), device=device)
    enc_inputs = torch.randint(4, config.n_enc_vocab, (args.batch_size, args.seq_len), device=device)
    enc_inputs = enc_inputs.masked_fill(torch.arange(args.seq_len, device=device) >= lengths[:, None], config.i_pad)
    dec_inputs = torch.full((args.batch_size, 1), 2, device=device)
    labels = torch.randint(0, config.n_output, (args.batch_size,), device=device)

    uses_triton = backend.uses_triton(enc_inputs)
    print(f"fastformer {__version__}: tutorial MovieClassification, {n_params / 1e6:.2f} M trainable parameters")
    print(
        f"  config   n_layer={config.n_layer} d_hidn={config.d_hidn} n_head={config.n_head} "
        f"d_head={config.d_head} d_ff={config.d_ff}"
    )
    print(
        f"  device   {device}, backend {backend.get_backend()!r} -> "
        f"{'Triton kernels' if uses_triton else 'PyTorch reference'}"
    )
    print(
        f"  batch    {args.batch_size} reviews, lengths {lengths.min().item()}..{lengths.max().item()} "
        f"padded to {args.seq_len}"
    )

    model.train()
    start = time.perf_counter()
    logits = model(enc_inputs, dec_inputs)[0]
    loss = torch.nn.functional.cross_entropy(logits, labels)
    loss.backward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = time.perf_counter() - start
    grad_norm = torch.sqrt(sum((p.grad.float() ** 2).sum() for p in model.parameters() if p.grad is not None))
    print(f"  forward  logits {tuple(logits.shape)}, loss {loss.item():.4f}")
    print(f"  backward gradient norm {grad_norm.item():.4f} over {n_params / 1e6:.2f} M parameters")
    print(f"  time     {elapsed * 1e3:.1f} ms for forward + backward")
    return 0


def build_parser():
    parser = argparse.ArgumentParser(
        prog="fastformer",
        description="The tutorial Transformer, drop-in, with Triton kernels on CUDA.",
    )
    parser.add_argument("--version", action="version", version=f"fastformer {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    demo = commands.add_parser(
        "demo", help="build the tutorial model, run one forward and backward, and print what it did"
    )
    demo.add_argument("--device", help="cpu, cuda, cuda:1, ... (default: cuda if available)")
    demo.add_argument("--backend", default="auto", choices=["auto", "triton", "reference"])
    demo.add_argument("--batch-size", type=int, default=8)
    demo.add_argument("--seq-len", type=int, default=64)
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(run=_demo)
    return parser


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return args.run(args)
    except (ValueError, TypeError, RuntimeError) as error:
        print(f"fastformer {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
