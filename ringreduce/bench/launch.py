"""Starting the ranks: local processes spawned here, or the current process under torchrun."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from typing import Any


def under_launcher() -> bool:
    """True when torchrun (or another launcher) set RANK, WORLD_SIZE and LOCAL_RANK."""
    return all(var in os.environ for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _child(target: Callable[[Any], int], arg: Any, threads: int, env: dict[str, str]) -> None:
    os.environ.update(env)
    import torch

    torch.set_num_threads(threads)
    sys.exit(target(arg))


def spawn(target: Callable[[Any], int], arg: Any, nproc: int, name: str, threads: int | None = None,
          local_size: int | None = None) -> int:
    """Runs target(`arg`) in `nproc` spawned ranks of `threads` torch threads each (default: cores //
    `nproc`), on the env:// variables of a free port of 127.0.0.1 (with `local_size`, nodes of that
    many consecutive ranks simulated here: RINGREDUCE_LOCAL_SIZE); returns the worst exit code. If a
    rank fails, the others are killed 10 s later, so that a broken run never hangs."""
    port = free_port()
    local = local_size or nproc
    threads = threads or max(1, (os.cpu_count() or 1) // nproc)
    ctx = mp.get_context("spawn")
    procs = []
    for rank in range(nproc):
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": str(nproc),
               "LOCAL_RANK": str(rank % local), "LOCAL_WORLD_SIZE": str(local), "GLOO_SOCKET_IFNAME": "lo"}
        if local_size is not None:
            env.update(GROUP_RANK=str(rank // local_size), RINGREDUCE_LOCAL_SIZE=str(local_size))
        procs.append(ctx.Process(target=_child, args=(target, arg, threads, env), name=f"{name} rank {rank}"))
        procs[-1].start()
    try:
        return _wait(procs, name)
    except KeyboardInterrupt:
        _kill(procs)
        return 130


def _wait(procs: list[mp.process.BaseProcess], name: str) -> int:
    failed_at: float | None = None
    while True:
        codes = [p.exitcode for p in procs]
        if all(code is not None for code in codes):
            return max((abs(code) for code in codes if code is not None), default=0)
        bad = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
        if bad and failed_at is None:
            failed_at = time.monotonic()
            rank, code = bad[0]
            sys.stderr.write(f"{name}: rank {rank} exited with code {code}; stopping the others\n")
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
