"""`python -m bench.report`: fastformer's benchmarks into bench/results/ (and README's table). The
report's code is tools.benchmarks.report, which the GPU check runs too; its docstring has the usage."""

import sys

from tools.benchmarks.report import main

if __name__ == "__main__":
    sys.exit(main())
