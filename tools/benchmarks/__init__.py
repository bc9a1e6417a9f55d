"""The benchmark cases, their timing and the report, shared by the pytest-benchmark suites in
bench/ (and their command, `python -m bench.report`) and by the GPU check (tools.gpu_check): what
both run lives here, so that tools import nothing from bench.

    common.py   timing, peak memory, FLOP formulas, the environment record, `Case`
    cases.py    every benchmark case, defined once
    report.py   runs cases, judges the performance targets, writes bench/results/ and README's table
"""
