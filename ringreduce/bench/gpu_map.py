"""Which GPU each rank uses and, where ranks outnumber the GPUs, how NCCL is told to run anyway.

Note [Ranks sharing a GPU]
~~~~~~~~~~~~~~~~~~~~~~~~~~
Local rank r uses GPU r % G (G visible GPUs). NCCL refuses two ranks of one communicator on one GPU
of one host ("Duplicate GPU detected"), so where ranks outnumber the GPUs each rank gets its own
``NCCL_HOSTID``: NCCL takes every rank for a host of its own and connects them with its socket transport
on ``lo`` (no NVLink, P2P or shared memory). Such figures measure that transport and GPU time-slicing,
never a GPU interconnect, and are labelled so (``nccl_transport_label``). Used by the benchmark
(``rank_main``) and the GPU tests (tests/gpu/gpu_ranks.py).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

GPU_WORLD_VAR = "RINGREDUCE_GPU_WORLD"  # the GPU tests' world size


def gpu_world_size(environ: Mapping[str, str], gpus: int) -> int:
    """The GPU tests' world size: $RINGREDUCE_GPU_WORLD, else one rank per visible GPU, or 2 ranks
    on a single GPU (Note [Ranks sharing a GPU]); 0 without a GPU."""
    raw = environ.get(GPU_WORLD_VAR, "")
    if raw:
        try:
            value = int(raw)
        except ValueError:
            raise ValueError(f"{GPU_WORLD_VAR}={raw!r} is not an integer") from None
        if value < 1:
            raise ValueError(f"{GPU_WORLD_VAR}={value} must be >= 1")
        return value if gpus > 0 else 0
    return max(gpus, 2) if gpus > 0 else 0


def rank_device(local_rank: int, gpus: int) -> int:
    """The GPU of local rank `local_rank`: round-robin over the `gpus` visible GPUs."""
    if gpus <= 0:
        raise ValueError("no CUDA GPU is visible")
    return local_rank % gpus


def ranks_share_gpus(local_ranks: int, gpus: int) -> bool:
    """Whether some GPU serves more than one of the `local_ranks` ranks of this host."""
    return local_ranks > gpus


def nccl_rank_env(rank: int, local_ranks: int, gpus: int, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The NCCL environment of global rank `rank` of `local_ranks` on `gpus` (Note [Ranks sharing a
    GPU]): nothing without sharing; else a NCCL_HOSTID and the socket transport (`environ`'s ifname kept)."""
    if not ranks_share_gpus(local_ranks, gpus):
        return {}
    environ = os.environ if environ is None else environ
    return {
        "NCCL_HOSTID": f"ringreduce-rank{rank}",
        "NCCL_SOCKET_IFNAME": environ.get("NCCL_SOCKET_IFNAME") or "lo",
        "NCCL_IB_DISABLE": "1",
    }


def nccl_transport_label(local_ranks: int, gpus: int) -> str:
    """How NCCL connects the ranks, for tables, JSON and plot titles."""
    if ranks_share_gpus(local_ranks, gpus):
        return f"nccl-socket-lo ({local_ranks} ranks share {gpus} GPU{'s' if gpus != 1 else ''})"
    return "nvlink/p2p (one GPU per rank)"
