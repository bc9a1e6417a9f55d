"""`python -m bench.report`: fastformer's benchmarks into bench/results/ (and README's table). The
report's code is bench.reporting, which the GPU check runs too; its docstring has the usage.

`--smoke` on a machine without CUDA (or with `--device cpu`) runs the kernels through Triton's
interpreter: Triton reads TRITON_INTERPRET when a kernel is decorated, so it is set here, before the
report imports fastformer's kernels."""

import argparse
import os
import sys


def interpreted_smoke(argv):
    """Whether `argv` asks for the smoke run on a CPU: --smoke, and --device cpu or no CUDA GPU."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--device")
    parser.add_argument("--from", dest="sources", nargs="+")
    args, _ = parser.parse_known_args(argv)
    if not args.smoke or args.sources:
        return False
    if args.device is not None:
        return args.device.split(":")[0] == "cpu"
    import torch

    return not torch.cuda.is_available()


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if interpreted_smoke(argv) and "TRITON_INTERPRET" not in os.environ:
        os.environ["TRITON_INTERPRET"] = "1"
    from bench.reporting import main as report_main

    return report_main(argv)


if __name__ == "__main__":
    sys.exit(main())
