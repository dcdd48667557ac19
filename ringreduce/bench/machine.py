"""Description of the machine and software a benchmark ran on (for the JSON record and plot title)."""

from __future__ import annotations

import os
import platform
import socket
from typing import Any

import torch

import ringreduce
from ringreduce.bench.targets import load_average, utc_now

_ENV_PREFIXES = ("RINGREDUCE_", "NCCL_", "GLOO_", "OMP_", "CUDA_VISIBLE_DEVICES", "TORCH_NCCL_")


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (platform.processor() elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _nccl_version() -> str | None:
    try:
        version = torch.cuda.nccl.version()
    except Exception:  # noqa: BLE001 - CPU-only torch or no libnccl
        return None
    return ".".join(str(v) for v in version) if isinstance(version, tuple) else str(version)


def _memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def describe(backend: str, world_size: int, hosts: list[str], transport: str | None = None) -> dict[str, Any]:
    """The machine, software, relevant env, NCCL `transport` (nccl_transport_label) and start time/load
    of a run on `world_size` ranks of `backend` across `hosts`."""
    gpus = []
    if torch.cuda.is_available():
        gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count() or 1
    return {
        "hostname": socket.gethostname(),
        "hosts": sorted(set(hosts)),
        "nodes": len(set(hosts)),
        "cpu_model": cpu_model(),
        "cpu_cores": os.cpu_count(),
        "cpu_cores_usable": usable,
        "memory_bytes": _memory_bytes(),
        "gpus": gpus,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "nccl": _nccl_version(),
        "torch_threads": torch.get_num_threads(),
        "backend": backend,
        "transport": transport,
        "world_size": world_size,
        "ringreduce": ringreduce.build_info(),
        "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith(_ENV_PREFIXES)},
        "started_utc": utc_now(),
        "load_average_start": load_average(),
    }


def devices(machine: dict[str, Any]) -> str:
    """The GPUs (else the CPU and its cores) and, beyond one, the nodes."""
    if machine.get("gpus"):
        device = f"{len(machine['gpus'])}x {machine['gpus'][0]}"
    else:
        device = f"{machine['cpu_model']}, {machine['cpu_cores']} cores"
    return device + (f", {machine['nodes']} nodes" if machine.get("nodes", 1) > 1 else "")


def short_title(machine: dict[str, Any]) -> str:
    """One line for titles: devices, nodes, world size and backend."""
    transport = f", {machine['transport']}" if machine.get("transport") else ""
    return f"{devices(machine)}; {machine['world_size']} ranks ({machine['backend']}{transport})"
