"""MovieClassification with the tutorial's config, batch 128 of short reviews (8 to 128 tokens,
padded to the batch maximum): a train step (forward, backward, AdamW) and inference, classifying
([BOS] decoder) and seq2seq (decoder as long as the encoder). Providers: every way of running the
step in bench.cases.MODEL_WAYS: fastformer eager, replayed from CUDA graphs and under
torch.compile; the reference in fp32, under bf16 autocast, written with SDPA, compiled and replayed."""

import pytest

from bench import cases
from bench.conftest import DEVICE, run_case

CASES = cases.model_cases(DEVICE)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_model(benchmark, case):
    run_case(benchmark, case, rounds=5, warmup_rounds=2)
