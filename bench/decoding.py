"""Cached against full re-decoding: greedy generation with fastformer.compat.aladdinpersson.

    python -m bench.decoding                       # 64 sequences of 128 tokens, the tutorial's default sizes
    python -m bench.decoding --batch 8 --length 32 --embed-size 128 --num-layers 2   # quicker

Both modes decode the same tokens (checked here, and in tests/test_aladdinpersson.py); the cached
mode projects the encoder keys/values once and keeps a key/value cache for decoder self-attention,
so each step runs one position instead of the whole prefix. No eos: every sequence runs to length.
"""

import argparse
import json
import time

import torch

from fastformer import backend
from fastformer.compat.aladdinpersson import Transformer


def _timed(fn, device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out, time.perf_counter() - start


def measure(
    batch=64, length=128, vocab=8000, embed_size=512, num_layers=6, heads=8, forward_expansion=4, device="cpu", seed=0
):
    """Seconds for cached and full greedy decoding of `batch` sequences of `length` tokens, and the
    speed-up; raises if the two decode different tokens."""
    device = torch.device(device)
    torch.manual_seed(seed)
    model = Transformer(
        vocab,
        vocab,
        0,
        0,
        embed_size=embed_size,
        num_layers=num_layers,
        forward_expansion=forward_expansion,
        heads=heads,
        max_length=length,
    ).to(device)
    src = torch.randint(1, vocab, (batch, length), device=device)
    model.generate(src[:, :8], max_len=4, bos_idx=1)  # warm-up (kernels, allocator)
    cached, cached_s = _timed(lambda: model.generate(src, max_len=length, bos_idx=1), device)
    full, full_s = _timed(lambda: model.generate(src, max_len=length, bos_idx=1, use_cache=False), device)
    if not torch.equal(cached, full):
        raise AssertionError("cached and full re-decoding produced different tokens")
    return {
        "batch": batch,
        "length": length,
        "vocab": vocab,
        "embed_size": embed_size,
        "num_layers": num_layers,
        "heads": heads,
        "device": str(device),
        "backend": backend.get_backend(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "cached_s": cached_s,
        "full_s": full_s,
        "speedup": full_s / cached_s,
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--embed-size", type=int, default=512)
    parser.add_argument("--num-layers", type=int, default=6)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", help="also write the result as JSON here")
    args = parser.parse_args(argv)
    result = measure(
        args.batch, args.length, args.vocab, args.embed_size, args.num_layers, args.heads, device=args.device
    )
    print(
        f"{result['batch']} sequences x {result['length']} tokens, embed {result['embed_size']}, "
        f"{result['num_layers']} layers, {result['device']} ({result['threads']} threads), backend {result['backend']}"
    )
    print(
        f"  cached {result['cached_s']:.2f} s   full re-decoding {result['full_s']:.2f} s   "
        f"speed-up {result['speedup']:.1f}x (same tokens)"
    )
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
