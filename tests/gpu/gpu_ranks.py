"""One process per GPU over an NCCL (+ gloo for CPU tensors) process group, for the GPU tests.

``run_gpu_ranks(fn, *args, world_size=None, env=None, timeout=300, set_device=True)`` spawns
``world_size`` processes (default: every visible GPU), rank r on cuda:r (``torch.cuda.set_device(r)``
unless ``set_device=False``), runs ``fn(rank, world_size, *args)``
and returns the per-rank results; any rank's exception fails the test with its traceback, and a
run that exceeds ``timeout`` is killed. ``fn`` must be a module-level function.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import sys
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch

_CTX = mp.get_context("spawn")


def need_gpus(n: int = 2):
    return pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < n,
        reason=f"needs >= {n} CUDA GPUs (found {torch.cuda.device_count() if torch.cuda.is_available() else 0})",
    )


def _worker(rank: int, world_size: int, init_file: str, fn: Callable, args: tuple, env: dict, queue: Any,
            sys_path: list[str], set_device: bool = True) -> None:
    sys.path[:] = sys_path
    os.environ.update(env)
    try:
        import torch.distributed as dist

        if set_device:
            torch.cuda.set_device(rank)
        dist.init_process_group(
            "cpu:gloo,cuda:nccl",
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=120),
        )
        result = fn(rank, world_size, *args)
        torch.cuda.synchronize(rank)
        queue.put((rank, True, result))
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent
        queue.put((rank, False, traceback.format_exc()))


def run_gpu_ranks(fn: Callable, *args: Any, world_size: int | None = None, env: dict | None = None,
                  timeout: float = 300.0, set_device: bool = True) -> list[Any]:
    n = world_size or torch.cuda.device_count()
    fd, init_file = tempfile.mkstemp(prefix="rr_gpu_init_")
    os.close(fd)
    os.unlink(init_file)
    queue = _CTX.Queue()
    procs = [
        _CTX.Process(target=_worker, args=(r, n, init_file, fn, args, dict(env or {}), queue, list(sys.path), set_device))
        for r in range(n)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    try:
        for _ in range(n):
            rank, ok, payload = queue.get(timeout=timeout)
            if ok:
                results[rank] = payload
            else:
                errors.append(f"--- rank {rank} ---\n{payload}")
    except Exception:  # noqa: BLE001 - queue.Empty: a hang
        errors.append(f"ranks did not finish within {timeout} s (finished: {sorted(results)})")
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        pytest.fail("\n".join(errors), pytrace=False)
    bad = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (0, None)]
    assert not bad, f"rank processes exited with {bad}"
    return [results[r] for r in range(n)]
