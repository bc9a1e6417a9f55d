"""MovieClassification with the tutorial's config, batch 128 of short reviews (8 to 128 tokens,
padded to the batch maximum): a train step (forward, backward, AdamW) and inference, classifying
([BOS] decoder) and seq2seq (decoder as long as the encoder). Providers: fastformer (bf16 autocast),
the reference in fp32 and under bf16 autocast, and torch.compile of the reference."""

import pytest

from bench.conftest import DEVICE, run_case
from tools.benchmarks import cases

CASES = cases.model_cases(DEVICE)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_model(benchmark, case):
    run_case(benchmark, case, rounds=5, warmup_rounds=2)
