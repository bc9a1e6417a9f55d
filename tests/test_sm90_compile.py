"""The sm_90a compile check: every kernel under kernels/, with every autotune config a launch can
select on the GPU machines' Triton (CI's oldest lane; the rules' picks on other versions:
`tools.sm90_cases.ci_cases_here`), compiled for Hopper on this CPU machine, and held to the rules
in `tools.sm90.problems`: it compiles, fits in shared memory, does not spill registers, runs its
fp16/bf16 dots on wgmma and pipelines its main loops.

How it compiles without a GPU is in tools/sm90.py; the matrix (masks, dropout, head dims, layouts,
FFN and LayerNorm variants, fp16 and bf16) is `tools.sm90_cases.ci_cases`. A config that breaks a
rule is removed from its kernel's list or pruned for the flags where it breaks, never exempted here.

What this cannot see: faults at run time (illegal addresses, races), numerics (the interpreter
tests check them, bf16 included, on a CPU), occupancy and timing. The `cuda` tests and the
benchmarks cover those on a GPU. The full table: `python -m tools.sm90_report` (tools/results/sm90-compile.md).
"""

import ast
import collections
import itertools
import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

pytestmark = pytest.mark.versions  # CI runs it on Triton 3.9 and on 3.6

from tests import sm90_early, sm90_planted  # noqa: E402
from tools import sm90  # noqa: E402
from tools.sm90_cases import GPU_TRITON, ci_cases, ci_cases_here  # noqa: E402

KERNELS_DIR = Path(__file__).resolve().parent.parent / "kernels"


def _launched_kernels():
    """Names of the `@triton.jit` functions under kernels/ that launchers launch (`*_kernel`);
    the others are helpers inlined into them. A kernel launched in passes (a constexpr named
    `*_PASS`) counts once per pass, named as tools.sm90 records it: `_attn_bwd_kernel(DQ_PASS=True)`."""
    names = []
    for path in sorted(KERNELS_DIR.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.FunctionDef)
                and node.name.endswith("_kernel")
                and any("jit" in ast.unparse(d) for d in node.decorator_list)
            ):
                passes = sorted(arg.arg for arg in node.args.args if arg.arg.endswith("_PASS"))
                for values in itertools.product((True, False), repeat=len(passes)):
                    choice = ", ".join(f"{name}={value}" for name, value in zip(passes, values))
                    names.append(f"{node.name}({choice})" if passes else node.name)
    return names


KERNELS = _launched_kernels()


@pytest.fixture(scope="module")
def records(request):
    """Every (case, kernel, config) of the CI matrix, compiled in two worker processes begun at
    nice 19 when collection ended (tests/sm90_early.py)."""
    return sm90_early.records(request.config)


@pytest.fixture(scope="module")
def planted():
    """The planted cases' Records, compiled by one worker begun at nice 19 as CI's matrix is, and
    its niceness as begun and once waited for (under "niceness")."""
    compilation = sm90.Compilation("tests.sm90_planted:cases", jobs=1, nice=sm90_early.NICE)
    (worker, _, _), ours = compilation._workers[0], os.getpriority(os.PRIO_PROCESS, 0)
    began = os.getpriority(os.PRIO_PROCESS, worker.pid) - ours
    compilation._hurry()  # what records() does first
    waited = os.getpriority(os.PRIO_PROCESS, worker.pid) - ours
    return {**{r.case: r for r in compilation.records()}, "niceness": (began, waited)}


def test_a_worker_begun_early_compiles_at_nice_19_until_it_is_waited_for(planted):
    began, waited = planted["niceness"]
    assert began == min(sm90_early.NICE, 19 - os.getpriority(os.PRIO_PROCESS, 0))
    # raising a priority takes root's right: without it the worker stays as it began
    assert waited == (0 if os.geteuid() == 0 else began)


def test_the_scan_finds_the_kernels():
    assert {
        "_attn_fwd_kernel",
        "_attn_bwd_kernel(DQ_PASS=True)",
        "_attn_bwd_kernel(DQ_PASS=False)",
        "_linear_gelu_fwd_kernel",
        "_add_ln_fwd_kernel",
    } <= set(KERNELS)


def test_each_worker_takes_whole_families_of_cases():
    """Cases that compile the same kernels (one family: the causal ones at L256 and L4096, the
    model's two) go to one worker, which compiles them once; every case to exactly one worker."""
    names = [case.name for case in ci_cases()]
    shards = sm90._shards(names, jobs=2)
    assert sorted(n for shard in shards for n in shard) == sorted(names)
    worker = {name: i for i, shard in enumerate(shards) for name in shard}
    for family in (("attention/fp16/d64/causal/self/L256", "attention/fp16/d64/causal/contiguous/L4096"),
                   ("ffn/fp16/gelu/train/d256x1024/M2048", "ffn/fp16/gelu/train/d1024x4096/M8192"),
                   [name for name in names if name.startswith("model/")]):  # fmt: skip
        assert len({worker[name] for name in family}) == 1, family
    assert 0.8 < len(shards[0]) / len(shards[1]) < 1.25, [len(shard) for shard in shards]


def test_a_mask_compiled_with_the_rules_picks_only_has_its_supersets_compiled_with_every_config():
    """tools.sm90_cases.SUBSET_MASKS: CI compiles three fp16 masks at the tutorial's head dim with
    the rules' picks only, each on the ground that the cases whose flags hold its own compile every
    config; those cases must be in the matrix, autotuning, and the three with the picks."""
    from tools.sm90_cases import MASKS, SUBSET_MASKS

    def name(mask, dropout):
        return f"attention/fp16/d64/{mask}{'+dropout' if dropout else ''}/self/L256"

    cases = {case.name: case for case in ci_cases()}
    for (mask, dropout), supersets in SUBSET_MASKS.items():
        assert not cases[name(mask, dropout)].autotune
        for other, other_dropout in supersets:
            assert other_dropout == dropout and all(a <= b for a, b in zip(MASKS[mask], MASKS[other]))
            superset = cases.get(name(other, other_dropout)) or cases[name(other, other_dropout) + "+probs"]
            assert superset.autotune, superset.name


@pytest.mark.parametrize("version", [f"{GPU_TRITON}.0", "3.9.0", "3.10.1"])
def test_every_config_is_compiled_on_the_gpu_machines_triton_and_the_rules_picks_elsewhere(monkeypatch, version):
    import triton

    monkeypatch.setattr(triton, "__version__", version)
    every, here = ci_cases(), ci_cases_here()
    assert [case.name for case in here] == [case.name for case in every]
    assert any(case.autotune for case in every)
    expected = [case.autotune for case in every] if version.startswith(GPU_TRITON + ".") else [False] * len(every)
    assert [case.autotune for case in here] == expected


def test_the_tf32_matrix_compiles_fp32_products_as_tf32():
    """tools.sm90_cases.tf32_cases (python -m tools.sm90_report --tf32, not CI's): fp32 cases only,
    named apart, each compiling its products as TF32 inside its run (dot_precision) and leaving
    PyTorch's precision as it found it."""
    from fastformer.kernels._runtime import dot_precision
    from tools.sm90_cases import tf32_cases, tf32_precision

    names = [case.name for case in tf32_cases()]
    assert len(set(names)) == len(names) and all("/fp32/" in name for name in names)
    before = torch.backends.cuda.matmul.fp32_precision
    with tf32_precision("fp32"):
        assert dot_precision(torch.float32) == "tf32"
    with tf32_precision("fp16"):
        assert torch.backends.cuda.matmul.fp32_precision == before  # half precision: untouched
    assert torch.backends.cuda.matmul.fp32_precision == before


def test_every_case_launches_and_compiles_something(records):
    by_case = collections.defaultdict(list)
    for r in records:
        by_case[r.case].append(r)
    failed = [f"{r.case}: {r.error}" for r in records if r.kernel == "<launch>"]
    assert not failed, "launchers failed outside compilation:\n" + "\n".join(failed)
    assert sorted(by_case) == sorted(case.name for case in ci_cases())


def test_the_matrix_began_compiling_when_collection_ended(records, request):
    """The records come from the Compilation tests/conftest.py began (tests/sm90_early.py), not
    from one begun when the fixture was first asked for."""
    assert isinstance(request.config.stash.get(sm90_early.COMPILATION, None), sm90.Compilation)


def test_bf16_compiles_as_fp16_does(records):
    """The matrix compiles bf16 with the configs the rules pick, fp16 with every config (off the GPU
    machines' Triton the picks too), on the ground that bf16 compiles as fp16 does
    (tools.sm90_cases.ci_cases): each bf16 op compile is held to its fp16 twin's (the same case,
    kernel and config in fp16), which must exist."""
    by_key = {(r.case, r.kernel, r.config): r for r in records}
    facts = ("error", "shared", "spill_stores", "spill_loads", "dots", "wgmma_dots", "dot_loops", "pipelined_dot_loops")
    twins = 0
    for r in records:
        if r.dtype == "bfloat16" and r.case.split("/")[0] in ("attention", "ffn") and "/cross/" not in r.case:
            name = r.case.replace("/bf16/", "/fp16/")  # the fp16 case may also ask for the probabilities
            twin = by_key.get((name, r.kernel, r.config)) or by_key.get((name + "+probs", r.kernel, r.config))
            assert twin is not None, f"{r.case} {r.kernel} {r.config}: no fp16 twin compiled"
            differ = [f"{f} {getattr(r, f)} vs {getattr(twin, f)}" for f in facts if getattr(r, f) != getattr(twin, f)]
            assert not differ, f"{r.case} {r.kernel} {r.config}: bf16 and fp16 differ: {differ}"
            assert abs(r.registers - twin.registers) <= 16, (r.case, r.kernel, r.config, r.registers, twin.registers)
            twins += 1
    assert twins >= 10, twins


@pytest.mark.parametrize("kernel", KERNELS)
def test_kernel_meets_the_sm90_rules(records, kernel):
    mine = [r for r in records if r.kernel == kernel]
    assert mine, f"{kernel} was not compiled by any case of tools.sm90_cases.ci_cases"
    broken = [f"{r.config} in {r.case}: {'; '.join(sm90.problems(r))}" for r in mine if sm90.problems(r)]
    assert not broken, f"{kernel} breaks the sm_90a rules in {len(broken)} of {len(mine)} compiles:\n" + "\n".join(
        broken[:40]
    )


@pytest.mark.parametrize("case", sorted(sm90_planted.EXPECTED))
def test_the_check_detects_a_planted_failure(planted, case):
    """Each rule fires on a kernel made to break it, and only that rule; the control passes all."""
    found = sm90.problems(planted[case])
    expected = sm90_planted.EXPECTED[case]
    if expected is None:
        assert found == []
    else:
        assert found and all(expected in problem for problem in found), found
