"""Run by tests/test_eager_launch.py in a process without TRITON_INTERPRET: under tools.sm90's
dry-run sm_90a driver, kernels launched after a first call has been kept, with arguments that
Triton specializes differently: through kernels._runtime.launch in eager mode, through a
PreparedLaunch, and through `attention`'s plan. Each launch must run the compiled kernel that
Triton's own `kernel.warmup` picks for the same arguments. Prints one JSON object:
{"cases": {case: {"same": bool, "new_entry": bool}}, "compiles": Triton's compiles in those,
"prepared": {case: same}, "addresses": {case: whether a kept kernel's launcher got each pointer as
its address, an int, and a None as None}, "planned": {case: same}, "forgotten": whether tools.sm90's
reset between its cases drops the kept kernels and plans}."""

import importlib
import json

import torch
import triton
import triton.language as tl

from fastformer import kernels
from fastformer.kernels._runtime import Plans, PreparedLaunch, _EagerLaunch, launch
from tools import sm90

attention = importlib.import_module("fastformer.kernels.attention")  # the module (the package exports the function)


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
        compiled = len(compiles)  # by the cases above
        prepared = _prepared_cases()
        addresses = _address_cases()
        planned = _planned_cases()
        sm90._reset_jit_caches(["__main__"])
        forgotten = not _EagerLaunch.of(_scale).compiled and not any(Plans.every)
    report = {"cases": results, "compiles": compiled, "prepared": prepared, "addresses": addresses, "planned": planned}
    print(json.dumps({**report, "forgotten": forgotten}))


def _ran():
    """The compiled kernel's launcher the dry-run driver last called."""
    from triton.runtime.driver import driver

    return driver.active.launcher_cls.last


def _prepared_cases():
    """A PreparedLaunch of _scale bound on aligned fp32 pointers (and one bound on a None), then
    called on pointers Triton specializes otherwise: {case: whether it ran Triton's pick}."""
    base, other, half = torch.zeros(64), torch.zeros(64), torch.zeros(64, dtype=torch.float16)
    with_y = PreparedLaunch(_scale, (1,), (base, other, 32, 1, 0.5), {"HAS_Y": True, "BLOCK": 64})
    without_y = PreparedLaunch(_scale, (1,), (base, None, 32, 1, 0.5), {"HAS_Y": False, "BLOCK": 64})
    first_unaligned = PreparedLaunch(_scale, (1,), (base, other, 32, 1, 0.5), {"HAS_Y": True, "BLOCK": 64})
    cases = {
        "first call": (with_y, base, other),
        "new tensors": (with_y, torch.zeros(64), torch.zeros(64)),
        "a Parameter": (with_y, torch.nn.Parameter(torch.zeros(64)), other),
        "an unaligned first pointer": (with_y, base[1:], other),
        "an unaligned second pointer": (with_y, base, other[3:]),
        "another dtype": (with_y, half, half),
        "the aligned pointers again": (with_y, base, other),
        "a None bound, None given": (without_y, base, None),
        "a None bound, a tensor given": (without_y, base, other),
        "first called unaligned": (first_unaligned, base[1:], other),
        "unaligned again, at another offset": (first_unaligned, base[5:], other),
        "then aligned": (first_unaligned, base, other),
    }
    results = {}
    for name, (prepared, x, y) in cases.items():
        prepared(x, y)
        has_y = prepared is not without_y
        expected = _scale.warmup(x, y, 32, 1, 0.5, HAS_Y=has_y, BLOCK=64, grid=(1,))
        results[name] = _ran() is expected.run
    return results


def _address_cases():
    """A PreparedLaunch of _scale, its kernel kept by a first call, then called again: what its
    launcher got for the pointers (the launcher takes an int as the address it is, and asks the
    driver about a tensor's). {case: whether they went as their addresses, a None as None}."""
    from triton.runtime.driver import driver

    x, y = torch.zeros(64), torch.zeros(64)
    launches = {
        "two tensors": (PreparedLaunch(_scale, (1,), (x, y, 32, 1, 0.5), {"HAS_Y": True, "BLOCK": 64}), y),
        "a tensor and a None": (
            PreparedLaunch(_scale, (1,), (x, None, 32, 1, 0.5), {"HAS_Y": False, "BLOCK": 64}),
            None,
        ),
    }
    results = {}
    for name, (prepared, second) in launches.items():
        prepared(x, second)  # the first call: Triton's own path, which keeps the kernel
        prepared(x, second)
        got = driver.active.launcher_cls.last_args
        expected = (x.data_ptr(), None if second is None else second.data_ptr(), 32, 1, 0.5)
        results[name] = got[:5] == expected and type(got[0]) is int  # then the constexprs, as Triton passes them
    return results


def _planned_cases():
    """`kernels.attention` in eager mode, its plan made by the first call, then called on tensors
    of the same signature at an unaligned address, on new aligned ones, and on other strides,
    another dtype and no padding mask (a plan each): {case: whether the forward ran the kernel
    Triton picks for those arguments}, and whether the calls made the plans expected."""
    B, H, L, D = 2, 2, 16, 64
    n = B * L * 3 * H * D

    def fused(offset=0, dtype=torch.float16):  # the model's views of a fused projection, `offset` elements in
        flat = torch.zeros(n + offset, dtype=dtype)[offset:]
        return [t.view(B, L, H, D).transpose(1, 2) for t in flat.view(B, L, 3 * H * D).split(H * D, dim=-1)]

    pad = torch.zeros(B, L, dtype=torch.bool)
    cases = {
        "first call": (fused(), pad),
        "an unaligned q, k, v": (fused(offset=1), pad),
        "aligned again": (fused(), pad),
        "other strides": ([torch.zeros(B, H, L, D, dtype=torch.float16) for _ in range(3)], pad),
        "another dtype": (fused(dtype=torch.bfloat16), pad),
        "no padding mask": (fused(), None),
    }
    results = {}
    for name, ((q, k, v), key_padding_mask) in cases.items():
        kernels.attention(q, k, v, key_padding_mask=key_padding_mask)
        ran = _ran()
        masking = attention._masking(q, key_padding_mask, None, False, 0.0, D**-0.5)
        o, lse = attention._forward_outputs(q)
        grid, args, kwargs = attention._forward_launch(q, k, v, o, lse, None, masking)
        meta, num_warps, num_stages = attention._attn_fwd.pick(args, kwargs)
        expected = attention._attn_fwd.kernel.warmup(
            *args, **kwargs, **meta, num_warps=num_warps, num_stages=num_stages, grid=grid
        )
        results[name] = ran is expected.run
    results["a plan per signature"] = len(attention._plans) == 4
    return results


if __name__ == "__main__":
    main()
