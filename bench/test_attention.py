"""Attention forward and forward + backward: fastformer against the reference, torch SDPA (PyTorch's
choice of backend, and each backend pinned), FlexAttention and torch.compile of the reference, on
every mask, D 64 and 128, bf16 and fp16; and the model's own call (self-attention of a fused QKV
projection, key padding, dropout 0.1) at the tutorial's batch; and attention over packed reviews of
mixed lengths (kernels.attention_varlen) against the same reviews padded. FLOPs: 4 * B * H * L * L * D
forward, causal half, backward 2.5x forward."""

import pytest

from bench import cases
from bench.conftest import DEVICE, run_case

CASES = cases.attention_cases(DEVICE) + cases.attention_model_call_cases(DEVICE) + cases.attention_varlen_cases(DEVICE)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_attention(benchmark, case):
    run_case(benchmark, case)
