"""Starting the ranks: local processes spawned here, or the current process under torchrun. Which GPU
each rank uses is ringreduce.bench.gpu_map's job (Note [Ranks sharing a GPU]).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import socket
import sys
import time

from ringreduce.bench.config import BenchConfig

LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


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
