"""The project's tools, apart from the benchmarks (bench/):

    python -m tools.gpu_check      everything a GPU can tell in one command: tests, compile, determinism,
                                   benchmarks, the model's throughput and convergence (docs/benchmarks.md)
    python -m tools.sm90_report    the sm_90a compile check's table: every kernel and config compiled
                                   for Hopper on a CPU (tools/sm90.py's dry-run driver; docs/sm90.md)
    python -m tools.launches       kernels launched per train step and per inference (docs/launches.md)
    python -m tools.cold_start     what a first and a second GPU run compile and time (docs/cold-start.md)

Their outputs that are committed live in tools/results/. The tests use tools.sm90 and
tools.launches; nothing in fastformer or kernels imports this package.
"""
