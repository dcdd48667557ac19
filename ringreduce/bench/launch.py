"""Starting the ranks: local processes spawned here (ringreduce/_launch.py, the harness the tests and
the GPU checks use too), or the current process under torchrun."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

from ringreduce._launch import RankProcesses, free_port, launcher_env

__all__ = ["free_port", "spawn", "under_launcher"]


def under_launcher() -> bool:
    """True when torchrun (or another launcher) set RANK, WORLD_SIZE and LOCAL_RANK."""
    return all(var in os.environ for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def _child(target: Callable[[Any], int], arg: Any, threads: int) -> int:
    import torch

    torch.set_num_threads(threads)
    return target(arg)


def spawn(target: Callable[[Any], int], arg: Any, nproc: int, name: str, threads: int | None = None,
          local_size: int | None = None) -> int:
    """Runs target(`arg`) in `nproc` spawned ranks of `threads` torch threads each (default: cores //
    `nproc`), on the env:// variables of a free port of 127.0.0.1 (with `local_size`, nodes of that
    many consecutive ranks simulated here: RINGREDUCE_LOCAL_SIZE); returns the worst exit code. If a
    rank fails, the others are killed 10 s later (their process groups whole), so that a broken run
    never hangs; Ctrl-C kills every rank."""
    port = free_port()
    threads = threads or max(1, (os.cpu_count() or 1) // nproc)

    def failed(rank: int, code: int) -> None:
        sys.stderr.write(f"{name}: rank {rank} exited with code {code}; stopping the others\n")

    ranks = RankProcesses(nproc, name=f"{name} rank", prefix="rr_bench_", log=False)
    ranks.start(_child, lambda r: (target, arg, threads), env=lambda r: launcher_env(r, nproc, port, local_size))
    try:
        codes = ranks.wait(None, grace=10.0, on_failure=failed)
    except KeyboardInterrupt:
        ranks.close()
        return 130
    ranks.close()
    worst = max((abs(c) for c in codes if c is not None), default=0)
    return worst or (1 if any(c is None for c in codes) else 0)
