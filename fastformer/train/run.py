"""The run object: one `fastformer train` invocation, settled once before any work.

`settle(inputs, log)` takes what the checks made without torch found (inputs.TrainInputs: the
options as given, the step modes, the data, the config and vocab, the run directory, the run
resumed) and settles the rest with what torch knows: the device (and, when --device was not given,
what it cannot run), autocast, the model's fit in the device's memory, the run's own options with
the batch size the device takes, and the checkpoint --resume continues from. Each check runs once:
what needs no torch ran before it. The `Run` it returns is frozen and goes to every step of the job
by name.
"""

import dataclasses
from collections.abc import Callable

import torch

from fastformer import kernels
from fastformer.config import BYTES_TO_TRAIN, check_fits
from fastformer.train.inputs import TrainInputs, size_names
from fastformer.train.options import (
    RunOptions,
    check_on_device,
    check_resumable,
    check_world_size,
    default_batch_size,
)
from fastformer.train.rundir import load_checkpoint
from fastformer.train.runtime import Launch, device_memory, quiet, resolve_amp, resolve_device, torchrun_launch


@dataclasses.dataclass(frozen=True)
class Run:
    """What a train job runs with: its inputs, where and how it runs, and where it starts."""

    inputs: TrainInputs  # the options as given, the data, config, vocab, run directory, run resumed
    options: RunOptions  # what makes the run what it is (run.json's), batch_size settled
    device: torch.device
    amp: str  # "bf16", "fp16" or "off"
    launch: Launch
    cuda_graphs: bool  # each step replayed from a CUDA graph
    compile: bool  # the model through torch.compile(fullgraph=True)
    pad_to_buckets: bool  # batches padded to bucket lengths
    precompile: bool  # the bucket shapes' kernels compiled before the first step
    log: Callable  # the job's `log` on rank 0, quiet on the others
    checkpoint: tuple | None  # load_checkpoint's (model state, its file, trainer state); None: from the start

    @property
    def epochs(self):
        """The run's epochs in total."""
        return self.inputs.epochs

    @property
    def run_dir(self):
        return self.inputs.run_dir

    @property
    def max_steps(self):
        """Where this invocation stops (None: at the end of the epochs)."""
        return self.inputs.options.max_steps

    @property
    def resuming(self):
        return self.inputs.options.resume is not None

    def step_modes(self):
        """The step modes as run.json records them."""
        names = ("cuda_graphs", "compile", "pad_to_buckets", "precompile")
        return {name: getattr(self, name) for name in names}


def settle(inputs, log):
    """The Run of checked inputs (inputs.check_inputs), after the checks that need torch, before
    any work. Raises ValueError/RuntimeError naming what does not fit."""
    options, modes = inputs.options, inputs.modes
    launch = torchrun_launch()
    device = resolve_device(options.device, launch.local_rank)
    if options.device is None:  # a device given was checked before torch
        check_on_device(
            device, options.backend_name, kernels.INTERPRET, cuda_graphs=modes.cuda_graphs, compile=modes.compile
        )
    if inputs.previous is not None:
        check_world_size(options.resume, inputs.previous, launch)
    if inputs.config is not None:  # the default config is checked once its vocab is known (job._train)
        check_fits_device(inputs, inputs.config, device)
    checkpoint = load_checkpoint(inputs.checkpoint) if inputs.checkpoint is not None else None
    if options.resume is not None:
        check_resumable(options.resume, checkpoint, inputs.epochs, options.max_steps)
    run_options = inputs.run_options
    if run_options.batch_size is None:
        run_options = dataclasses.replace(run_options, batch_size=default_batch_size(device.type))
    return Run(
        inputs,
        run_options,
        device,
        resolve_amp(options.amp, device),
        launch,
        **modes._asdict(),
        log=log if launch.rank == 0 else quiet,
        checkpoint=checkpoint,
    )


def check_fits_device(inputs, config, device):
    """The model of `config` (its weights, gradients and AdamW state) must fit the device's memory."""
    where = f"the memory of {device}" if device.type == "cuda" else "this machine's memory"
    check_fits(config, device_memory(device), where, BYTES_TO_TRAIN, size_names(inputs.options))
