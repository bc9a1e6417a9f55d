"""The train wing: `fastformer train` and its Python twin `fastformer.train.job.train(...)`.

    inputs.py    the job's inputs checked before torch is imported: options, files, reviews, the split
    options.py   TrainOptions (train()'s arguments, built once from the command's), defaults, --resume
    runtime.py   CPU threads, device, amp, the torchrun process group, how the steps run
    run.py       the Run: one invocation settled once (device, amp, step modes, the run's options,
                 the checkpoint resumed), passed by name to every step of the job
    loaders.py   the data once torch is there: the vocab trained on the reviews, the loaders
    loop.py      schedules, the padding-masked loss, the train step, the train and evaluate loops
    graphs.py    the train step captured into CUDA graphs, one per batch shape
    warmup.py    a job's kernels compiled before its first step (--precompile)
    rundir.py    the run directory: atomic writes, checkpoints, run.json, load_run
    job.py       the jobs: train (in named steps), evaluate_run, predict, demo

Nothing here is imported with the package, so that `fastformer --help` and the checks made
before torch stay light: import the module you need.
"""
