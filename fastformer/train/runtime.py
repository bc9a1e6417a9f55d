"""Where and how a job runs: CPU threads, the device, the autocast dtype, the torchrun process
group, and how each training step runs.

Under torchrun (`torchrun --nproc_per_node N -m fastformer train ...`) each process trains a
DistributedDataParallel replica (replicated): the process group comes from the environment
torchrun sets (process_group: nccl on CUDA, each process on the GPU of its LOCAL_RANK; gloo on a
CPU), --batch-size is per process, and every batch of batch_size * N reviews is shared out by
ShardedBatchSampler, so N processes at batch b train on the batches one process draws at N * b.
Rank 0 trains the vocab and sends it to the others, and alone writes the run directory and shows
progress; the metrics are summed over the processes. A checkpoint keeps every process's RNG state
(rng_state), and --resume needs the same N.

How each step runs (fastformer.train.run.step_modes and settle_steps): on CUDA, by default, as
replays of CUDA graphs captured once per batch shape (fastformer.train.graphs), the loaders padding
the encoder ids to bucket lengths (fastformer.data.reviews.bucket_length) so that there are few
shapes; eagerly where graphs do not apply (a CPU, --amp fp16, torchrun, --no-pad-to-buckets) or
with --no-cuda-graphs; with --compile, through torch.compile(model, fullgraph=True). These, and
--pad-to-buckets, change the speed and the rounding, not the math: a run may resume with other
values of them.
"""

import contextlib
import os
import warnings
from typing import NamedTuple

import torch

from fastformer import backend
from fastformer.config import host_memory
from fastformer.data.reviews import BUCKET_MULTIPLE
from fastformer.environment import TORCHRUN_ENV, under_torchrun
from fastformer.train.loop import autocast


def cpu_threads():
    """Threads for torch's CPU ops: $OMP_NUM_THREADS when set, else the cores this process may run
    on that are not already busy (their count less the 1-minute load average, at least 1). Threads
    that outnumber the free cores spin in OpenMP: on a 2-core machine shared with one other busy
    process, the CPU job ran 3.6x slower on 2 threads than on 1; on the idle machine, 2 threads ran
    it 2x faster than 1."""
    if "OMP_NUM_THREADS" in os.environ:
        return torch.get_num_threads()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    busy = round(os.getloadavg()[0]) if hasattr(os, "getloadavg") else 0
    return max(1, min(cores, cores - busy))


def resolve_device(name, local_rank=None):
    """The device `name` names (a name fastformer.train.run's Check of --device passed; default: cuda
    if available, else cpu). In a torchrun job (`local_rank` given) a CUDA device is the GPU of the process's
    local rank."""
    if name is None:
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: CUDA is not available on this machine")
    if device.type == "cuda" and local_rank is not None:
        if device.index is not None:
            raise ValueError(
                f"--device {name}: under torchrun each process takes the GPU of its LOCAL_RANK; pass --device cuda"
            )
        device = torch.device("cuda", local_rank)
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


def resolve_amp(amp, device):
    """ "auto" is bf16 autocast on a CUDA GPU that supports it, else off."""
    if amp == "auto":
        return "bf16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "off"
    return amp


def kernels_in_use(device, amp):
    """Where attention and the feed-forward run under this device, amp and backend: "triton" or
    "reference" (the "auto" backend keeps fp32 off the kernels on CUDA, see fastformer.backend)."""
    with autocast(device, amp):
        return "triton" if backend.uses_triton(torch.empty(0, device=device)) else "reference"


# torchrun


class Launch(NamedTuple):
    """Where this process stands: (rank, world_size, local_rank) in a torchrun job, and whether it
    is one; a plain run is (0, 1, None, False) and starts no process group."""

    rank: int = 0
    world_size: int = 1
    local_rank: int | None = None
    distributed: bool = False


def torchrun_launch():
    """The Launch torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE) describes, or a plain one."""
    if not under_torchrun():
        return Launch()
    try:
        rank, local_rank, world_size = (int(os.environ[name]) for name in TORCHRUN_ENV)
    except ValueError:
        values = ", ".join(f"{name}={os.environ[name]!r}" for name in TORCHRUN_ENV)
        raise ValueError(f"torchrun's environment is not integers: {values}") from None
    if not 0 <= rank < world_size:
        raise ValueError(f"RANK {rank} is outside 0..WORLD_SIZE-1 (WORLD_SIZE {world_size})")
    return Launch(rank, world_size, local_rank, True)


def crowded_cores(launch, device, environ=os.environ):
    """A warning when a torchrun job on a CPU starts more processes on this machine than it has
    cores for this process (LOCAL_WORLD_SIZE, which torchrun sets, against the cores of
    os.sched_getaffinity): they would take turns on the cores and train slower than fewer processes
    would. None where they fit, on a GPU, or in a plain run."""
    if not launch.distributed or device.type != "cpu":
        return None
    try:
        processes = int(environ.get("LOCAL_WORLD_SIZE", launch.world_size))
    except ValueError:
        processes = launch.world_size
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if processes <= cores:
        return None
    return (
        f"torchrun started {processes} processes on this machine, which has {cores} CPU core(s) for them: "
        f"they take turns on the cores and train slower than {cores} would (--nproc_per_node {cores})"
    )


@contextlib.contextmanager
def process_group(launch, device):
    """Join the torchrun job's process group for the block (nccl on CUDA, gloo on a CPU, set up from
    the environment) and leave it after; a plain run starts none. Rank 0 warns when the job's
    processes outnumber the CPU cores (crowded_cores)."""
    if not launch.distributed:
        yield
        return
    crowded = crowded_cores(launch, device)
    if crowded and launch.rank == 0:
        warnings.warn(crowded, stacklevel=2)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        yield
    finally:
        torch.distributed.destroy_process_group()


def barrier(launch):
    if launch.distributed:
        torch.distributed.barrier()


def quiet(*args, **kwargs):
    """The log of the processes other than rank 0."""


def replicated(model, launch, device):
    """`model` wrapped in DistributedDataParallel in a torchrun job (its construction broadcasts
    rank 0's weights); the model itself in a plain run."""
    if not launch.distributed:
        return model
    device_ids = [device.index] if device.type == "cuda" else None
    return torch.nn.parallel.DistributedDataParallel(model, device_ids=device_ids)


def rng_state(device, launch):
    """This process's RNG states; in a torchrun job {"ranks": [every process's, by rank]} (a
    collective: every process calls it)."""
    state = {"torch": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state_all() if device.type == "cuda" else None}
    if not launch.distributed:
        return state
    states = [None] * launch.world_size
    torch.distributed.all_gather_object(states, state)
    return {"ranks": states}


def set_rng_state(state, device, launch):
    """Restore this process's RNG states from what rng_state returned."""
    if "ranks" in state:
        state = state["ranks"][launch.rank]
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and state["cuda"] is not None:
        torch.cuda.set_rng_state_all(state["cuda"])


# How the steps run


def device_memory(device):
    """The bytes of memory of `device`: the GPU's, or this machine's for a CPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return host_memory()


def step_mode(cuda_graphs, compile, pad_to_buckets, eager_because=None):
    """How the steps run, for the header: "CUDA graphs" or "torch.compile", or "eager" with why
    where graphs were not given and do not apply; and the buckets' padding."""
    if cuda_graphs:
        parts = ["CUDA graphs"]
    elif compile:
        parts = ["torch.compile"]
    else:
        parts = [f"eager steps ({eager_because})" if eager_because else "eager steps"]
    if pad_to_buckets:
        parts.append(f"padded to multiples of {BUCKET_MULTIPLE}")
    return "".join(f", {part}" for part in parts)
