"""Run by tests/test_eager_launch.py in a process without TRITON_INTERPRET: under tools.sm90's
dry-run sm_90a driver, a kernel launched through kernels._runtime.launch in eager mode, after a
first call has been cached, with arguments that Triton specializes differently. Each launch must
run the compiled kernel that Triton's own `kernel.warmup` picks for the same arguments. Prints one
JSON object: {"cases": {case: {"same": bool, "new_entry": bool}}, "compiles": Triton's compiles,
"forgotten": whether tools.sm90's reset between its cases drops the kept kernels}."""

import json

import torch
import triton
import triton.language as tl

from fastformer.kernels._runtime import _EagerLaunch, launch
from tools import sm90


@triton.jit
def _scale(X, Y, n, stride, factor, HAS_Y: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(X + offs * stride, mask=offs < n, other=0.0)
    if HAS_Y:
        x += tl.load(Y + offs * stride, mask=offs < n, other=0.0)
    tl.store(X + offs * stride, x * factor, mask=offs < n)


def main():
    base = torch.zeros(64)
    half = torch.zeros(64, dtype=torch.float16)
    other = torch.zeros(64)
    cases = {
        "first call": (base, other, 32, 1, 0.5, True),
        "the same signature": (torch.zeros(64), torch.zeros(64), 48, 1, 2.0, True),
        "a Parameter": (torch.nn.Parameter(torch.zeros(64)), other, 32, 1, 0.5, True),
        "an unaligned view": (base[1:], other, 32, 1, 0.5, True),
        "an odd length": (base, other, 33, 1, 0.5, True),
        "a length of 1": (base, other, 1, 1, 0.5, True),
        "another stride": (base, other, 16, 2, 0.5, True),
        "another dtype": (half, half, 32, 1, 0.5, True),
        "a None argument": (base, None, 32, 1, 0.5, False),
        "a large integer": (base, other, 2**31 + 16, 1, 0.5, True),
    }
    compiles = []
    real_compile = triton.compiler.compile

    def counting(*args, **kwargs):
        compiles.append(1)
        return real_compile(*args, **kwargs)

    triton.compiler.compile = counting
    results = {}
    with sm90.dry_run(time_configs=False):
        cache = _EagerLaunch.of(_scale).compiled
        for name, (x, y, n, stride, factor, has_y) in cases.items():
            entries = len(cache)
            ran = launch(_scale)[(1,)](x, y, n, stride, factor, HAS_Y=has_y, BLOCK=64)
            expected = _scale.warmup(x, y, n, stride, factor, HAS_Y=has_y, BLOCK=64, grid=(1,))
            results[name] = {"same": ran is expected, "new_entry": len(cache) > entries}
        sm90._reset_jit_caches(["__main__"])
        forgotten = not _EagerLaunch.of(_scale).compiled
    print(json.dumps({"cases": results, "compiles": len(compiles), "forgotten": forgotten}))


if __name__ == "__main__":
    main()
