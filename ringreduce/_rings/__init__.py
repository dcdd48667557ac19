"""One backend per device (``cpu``: the native CPU runtime; ``cuda``: ringreduce's NCCL communicators
and CUDA kernels), each a module with the interface of docs/design.md section 2.5; each backend's Work
carries what Ctrl-C during its wait does (Note [Ctrl-C] in ringreduce/_interrupt.py).
"""

from __future__ import annotations

from types import ModuleType

import torch

from ringreduce._native import C
from ringreduce._rings import cpu, cuda

_BY_TYPE = {"cpu": cpu, "cuda": cuda}


def backend_for(device: torch.device) -> ModuleType:
    """The backend of tensors on `device`; ValueError for a device ringreduce does not run on, and
    RuntimeError for a CUDA device in a build without CUDA, each saying what to do."""
    backend = _BY_TYPE.get(device.type)
    if backend is None:
        raise ValueError(f"ringreduce: tensors on {device.type} are not supported; use CPU or CUDA tensors")
    if backend is cuda and not C.native_info["cuda"]:
        raise RuntimeError(
            "ringreduce: got a CUDA tensor, but this ringreduce build has no CUDA support. Reinstall it "
            "where a CUDA toolkit is found (set CUDA_HOME) with a CUDA build of torch, or reduce a CPU tensor"
        )
    return backend


def refusing_backend(device: torch.device | None) -> ModuleType | None:
    """The backend whose ring the other ranks run a call on that this rank refuses: the CUDA backend's
    for a CUDA `device` (None in a build without CUDA: no communicator to tell), else the CPU's (no
    tensor, or one on a device no backend runs: the others hold CPU tensors there)."""
    if device is not None and device.type == "cuda":
        return cuda if C.native_info["cuda"] else None
    return cpu


def release_group(pg: object) -> None:
    """Releases what the backends hold for the process group `pg`: its CPU rings (worker threads,
    shared memory) and its NCCL communicators."""
    C.release_cpu(pg)
    if C.native_info["cuda"]:
        cuda.release_group(pg)


__all__ = ["backend_for", "cpu", "cuda", "refusing_backend", "release_group"]
