"""The train wing: `fastformer train` and its Python twin `fastformer.train.job.train(...)`.

    run.py       the run: TrainOptions (train()'s arguments, built once from the command's),
                 defaults, --resume; the inputs checked before torch is imported (options,
                 files, reviews, the split); the Run, one invocation settled once (device, amp,
                 step modes, the run's options, the checkpoint resumed), passed by name to every
                 step of the job
    runtime.py   CPU threads, device, amp, the torchrun process group, how the steps run
    loop.py      schedules, the padding-masked loss, the train step, the train and evaluate loops
    graphs.py    the train step captured into CUDA graphs, one per batch shape
    warmup.py    a job's kernels compiled before its first step (--precompile)
    rundir.py    the run directory: atomic writes, checkpoints, run.json, load_run
    job.py       the jobs: train (in named steps: the vocab, the loaders, the trainer), evaluate_run,
                 predict, demo

Nothing here is imported with the package, so that `fastformer --help` and the checks made
before torch stay light: import the module you need.
"""
