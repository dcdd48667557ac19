"""Starting the ranks: local processes spawned here, or the current process under torchrun; which
GPU each rank uses and, where ranks outnumber the GPUs, how NCCL is told to run anyway.

Note [Ranks sharing a GPU]
~~~~~~~~~~~~~~~~~~~~~~~~~~
Local rank r uses GPU r % G (G visible GPUs), so any number of ranks runs on any number of GPUs,
one GPU included. NCCL refuses two ranks of one communicator on one GPU of one host ("Duplicate GPU
detected"); where ranks outnumber the GPUs, each rank therefore gets its own ``NCCL_HOSTID``, so that
NCCL takes every rank for a host of its own and connects them with its socket transport over the
loopback interface (``NCCL_SOCKET_IFNAME=lo``, ``NCCL_IB_DISABLE=1``): no NVLink, no P2P, no shared
memory. That is how a one-GPU machine runs the multi-rank GPU tests and the NCCL benchmark; its
figures measure NCCL's socket transport and GPU time-slicing between processes, never a GPU
interconnect, and are labelled so (``nccl_transport_label``). The same functions serve the
benchmark (``rank_main``) and the GPU tests (tests/gpu/gpu_ranks.py).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import socket
import sys
import time
from collections.abc import Mapping

from ringreduce.bench.config import BenchConfig

LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
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
    if gpus <= 0:
        return 0
    return gpus if gpus >= 2 else 2


def rank_device(local_rank: int, gpus: int) -> int:
    """The GPU of local rank `local_rank`: round-robin over the `gpus` visible GPUs."""
    if gpus <= 0:
        raise ValueError("no CUDA GPU is visible")
    return local_rank % gpus


def ranks_share_gpus(local_ranks: int, gpus: int) -> bool:
    """Whether some GPU serves more than one of the `local_ranks` ranks of this host."""
    return local_ranks > gpus


def nccl_rank_env(rank: int, local_ranks: int, gpus: int, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The NCCL environment of global rank `rank` (Note [Ranks sharing a GPU]): nothing when every
    local rank has a GPU of its own; else its own NCCL_HOSTID and the socket transport over `lo`
    (a NCCL_SOCKET_IFNAME already set is kept)."""
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


def under_launcher() -> bool:
    """True when torchrun (or another launcher) set RANK, WORLD_SIZE and LOCAL_RANK."""
    return all(var in os.environ for var in LAUNCHER_VARS)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _child(cfg: BenchConfig, env: dict[str, str], threads: int) -> None:
    os.environ.update(env)
    import torch

    torch.set_num_threads(threads)
    from ringreduce.bench.rank_main import run_rank

    sys.exit(run_rank(cfg))


def spawn_local(cfg: BenchConfig, nproc: int) -> int:
    """Runs `nproc` ranks on this machine (gloo on 127.0.0.1; with NCCL, rank r on GPU r % GPUs, Note
    [Ranks sharing a GPU]); returns the exit code.

    Each rank gets cores // nproc torch threads. If a rank fails, the others are killed after a
    short grace period so a broken run never hangs.
    """
    port = free_port()
    threads = max(1, (os.cpu_count() or 1) // nproc)
    ctx = mp.get_context("spawn")
    procs = []
    for rank in range(nproc):
        env = {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": str(nproc),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(nproc),
            "GLOO_SOCKET_IFNAME": "lo",
        }
        proc = ctx.Process(target=_child, args=(cfg, env, threads), name=f"ringreduce.bench rank {rank}")
        proc.start()
        procs.append(proc)
    try:
        return _wait(procs)
    except KeyboardInterrupt:
        _kill(procs)
        return 130


def _wait(procs: list[mp.process.BaseProcess]) -> int:
    failed_at: float | None = None
    while True:
        codes = [p.exitcode for p in procs]
        if all(code is not None for code in codes):
            return max((abs(code) for code in codes if code is not None), default=0)
        bad = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
        if bad and failed_at is None:
            failed_at = time.monotonic()
            rank, code = bad[0]
            sys.stderr.write(f"ringreduce.bench: rank {rank} exited with code {code}; stopping the others\n")
        if failed_at is not None and time.monotonic() - failed_at > 10:
            _kill(procs)
            return max(abs(c) for c in (p.exitcode for p in procs) if c is not None) or 1
        time.sleep(0.1)


def _kill(procs: list[mp.process.BaseProcess]) -> None:
    for p in procs:
        if p.is_alive() and p.pid is not None:
            os.kill(p.pid, signal.SIGKILL)
    for p in procs:
        p.join(timeout=10)
