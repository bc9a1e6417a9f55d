"""The benchmarks: every case and its peers (cases.py), how they are timed (timing.py, common.py),
the performance targets (targets.py) and the report (reporting.py; its command is
`python -m bench.report`). The pytest-benchmark suites here, `python -m bench.report` and the GPU
check (tools.gpu_check) all run these cases; bench imports nothing from tools."""
