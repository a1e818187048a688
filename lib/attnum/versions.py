"""The versions that decide what an attention kernel computes: torch and its build, CUDA, cuDNN, Triton, the
GPU and its driver. Light (torch is imported when asked), so that the kernels' own benchmark and the NetCDF
writer (``ncio``, which records them in every results file) share one collection without importing each other.
"""
from __future__ import annotations

import subprocess
from importlib import metadata


def accelerator_versions(device: str = "cpu") -> dict[str, str]:
    """The versions that decide what a GPU kernel computes, as strings: torch (with its build tag),
    the CUDA runtime torch was built with, cuDNN, Triton, and on a CUDA device the GPU, its compute
    capability and the NVIDIA driver (``nvidia-smi``; "unknown" where it cannot be asked). "none"
    where a component is absent (a CPU build of torch has no CUDA or cuDNN)."""
    import torch

    out = {"torch": torch.__version__, "cuda": str(torch.version.cuda or "none"),
           "cudnn": str(torch.backends.cudnn.version()) if torch.backends.cudnn.is_available() else "none"}
    try:
        out["triton"] = metadata.version("triton")
    except metadata.PackageNotFoundError:
        out["triton"] = "not installed"
    if str(device).startswith("cuda") and torch.cuda.is_available():
        idx = torch.device(device).index or 0
        major, minor = torch.cuda.get_device_capability(idx)
        out.update(gpu=torch.cuda.get_device_name(idx), gpu_capability=f"{major}.{minor}", driver="unknown")
        try:  # one driver serves every GPU of a host: the first line answers
            query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
            lines = subprocess.run(query, capture_output=True, text=True, timeout=20).stdout.split()
            out["driver"] = lines[0] if lines else "unknown"
        except (OSError, subprocess.SubprocessError):
            pass
    else:
        out.update(gpu="none", gpu_capability="none", driver="none")
    return out
