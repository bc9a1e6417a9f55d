"""The env stage: what the machine is (GPU, capability, SMs, memory, driver, versions, the commit
under test) and two ceilings measured on the spot: a bf16 GEMM of 8192^3 (2 * 8192^3 FLOP per
call) and a device-to-device copy (bytes read + written)."""

import platform
import shutil
import subprocess

import torch

from bench.common import time_ms
from tools.gpu_check.run import ROOT, Failed


def copy_gbps(device, nbytes, rep=10, inner=10):
    """Device-to-device copy bandwidth in GB/s, counting the bytes read and written (the ceiling
    of a memory-bound kernel); each timed call runs `inner` copies, so launch and sync costs vanish."""
    src = torch.zeros(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)

    def copies():
        for _ in range(inner):
            dst.copy_(src)

    ms = time_ms(copies, device, warmup=2, rep=rep) / inner
    return 2 * src.numel() * src.element_size() / (ms * 1e-3) / 1e9


def stage(run):
    details = {
        "device": str(run.device),
        "gpu": run.env["gpu"],
        "capability": None,
        "sm_count": None,
        "memory_gib": None,
        "driver": None,
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "triton": run.env["triton"],
        "python": platform.python_version(),
        "git_commit": git_commit(),
        "bf16_gemm_tflops": None,
        "d2d_copy_gbps": None,
        "ceilings_note": None,
    }
    versions = f"torch {details['torch']}, Triton {details['triton']}, CUDA {details['cuda']}"
    if not run.cuda:
        details["ceilings_note"] = "needs CUDA: the ceilings are GPU figures and are not measured on a CPU"
        if not run.plan.tiny:
            raise Failed(
                f"no CUDA device: torch.cuda.is_available() is False ({versions}); the other stages need one", details
            )
        details["summary"] = f"no CUDA device, a CPU smoke run: {versions}; ceilings not measured (needs CUDA)"
        return details
    props = torch.cuda.get_device_properties(run.device)
    details.update(
        capability=f"{props.major}.{props.minor}",
        sm_count=props.multi_processor_count,
        memory_gib=props.total_memory / 2**30,
        driver=_driver_version(run.device),
    )
    details["bf16_gemm_tflops"] = run.gemm_rate()
    details["d2d_copy_gbps"] = run.env["d2d_copy_gbps"] = copy_gbps(run.device, run.plan.copy_bytes)
    details["summary"] = (
        f"{details['gpu']} (sm_{props.major}{props.minor}, {details['sm_count']} SMs, {details['memory_gib']:.0f} GiB, "
        f"driver {details['driver']}), {versions}; bf16 GEMM {details['bf16_gemm_tflops']:.0f} TFLOP/s, "
        f"copy {details['d2d_copy_gbps']:.0f} GB/s"
    )
    return details


def _driver_version(device):
    if shutil.which("nvidia-smi") is None:
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return output(["nvidia-smi", f"--id={index}", "--query-gpu=driver_version", "--format=csv,noheader"])


def git_commit(root=ROOT):
    """The commit of the tree under test, "<sha> + N paths changed" where the tree is not that
    commit's (a device tool's copy of a working tree can carry an older .git), None where the copy
    has no git history."""
    if shutil.which("git") is None:
        return None
    head = output(["git", "rev-parse", "HEAD"], root)
    changed = output(["git", "status", "--porcelain", "--untracked-files=no"], root)
    if head is None or changed is None:
        return head
    return f"{head} + {len(changed.splitlines())} paths changed"


def output(command, cwd=ROOT):
    """A short command's stripped stdout, or None when it fails or prints nothing."""
    try:
        result = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if result.returncode != 0:
        return None
    return result.stdout.strip() or None
