"""feed_forward, linear_gelu and add_layer_norm against eager PyTorch, torch.compile (default and
max-autotune-no-cudagraphs) and, for add + LayerNorm, Liger-Kernel's LayerNorm, bf16.
FLOPs: 2 * M * d * d_ff per GEMM forward; backward 2x forward."""

import pytest

from bench import cases
from bench.conftest import DEVICE, run_case

CASES = cases.ffn_cases(DEVICE)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_ffn_and_add_layer_norm(benchmark, case):
    run_case(benchmark, case)
