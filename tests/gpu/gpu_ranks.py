"""Ranks for the GPU tests: tests/ranks.py's harness with what is GPU-specific added, one process per
rank over an NCCL (+ gloo for CPU tensors) process group.

``run_gpu_ranks(fn, *args, world_size=None, env=None, timeout=300, set_device=True, fresh=False,
exits=None)`` runs ``fn(rank, world_size, *args)`` on every rank and returns the per-rank results.
``fn`` must be a module-level function.

* **World size and devices** (Note [Ranks sharing a GPU], ringreduce/bench/gpu_map.py): the world
  size is ``RINGREDUCE_GPU_WORLD``, else one rank per visible GPU, or 2 ranks on a single GPU. Rank
  r runs on GPU r % GPUs (``torch.cuda.set_device`` unless ``set_device=False``); tests take their
  device from ``device(rank)``, never ``cuda:rank``. Where ranks outnumber GPUs each rank gets its
  own ``NCCL_HOSTID`` and NCCL connects them with its socket transport over ``lo`` (``transport()``
  says which; ``need_distinct_gpus`` skips a test that needs a GPU per rank). Every job ends with a
  synchronize of the rank's GPU.
* **Processes**: by default a persistent pool per (world size, set_device) runs one test after
  another (``env`` is applied per job and restored); ``fresh=True`` spawns new processes for the
  one job and checks that every rank exits with code 0 after it (for tests that poison their group,
  read knobs at communicator creation such as ``RINGREDUCE_TIMEOUT``, or test process exit).
  ``exits={rank: code}`` (fresh only) lets those ranks die with that exit code without a result.
* **Failures, hangs and the run's deadline** (``RINGREDUCE_GPU_DEADLINE``, which scripts/gpu_check.sh
  sets): reported as tests/ranks.py says, with every failed rank's exit code, traceback, output and,
  for a hang, the Python stacks of its threads.

``device="cpu"`` runs the same machinery over gloo alone without touching CUDA (the harness's own
tests, tests/tools/test_gpu_harness.py, run it on machines without a GPU).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
from ranks import RankKind, pool, register_place, run_fresh, run_ranks, within_deadline

from ringreduce.bench.gpu_map import gpu_world_size, nccl_rank_env, nccl_transport_label, rank_device, ranks_share_gpus


def visible_gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def world() -> int:
    """The GPU tests' world size (RINGREDUCE_GPU_WORLD, else the GPU count, or 2 on one GPU)."""
    return gpu_world_size(os.environ, visible_gpus())


def device(rank: int) -> torch.device:
    """Rank `rank`'s GPU (round-robin over the visible GPUs)."""
    return torch.device("cuda", rank_device(rank, visible_gpus()))


def shared() -> bool:
    """Whether ranks of the configured world share GPUs (NCCL's socket transport over lo)."""
    return ranks_share_gpus(world(), visible_gpus())


def transport(world_size: int | None = None) -> str:
    return nccl_transport_label(world_size or world(), visible_gpus())


def need_gpus(n: int = 1):
    return pytest.mark.skipif(visible_gpus() < n, reason=f"needs >= {n} CUDA GPUs (found {visible_gpus()})")


def need_world(n: int):
    """Skips unless the configured world size (RINGREDUCE_GPU_WORLD; ranks may share GPUs) is >= n."""
    gpus = visible_gpus()
    return pytest.mark.skipif(
        gpus == 0 or world() < n,
        reason=f"needs >= {n} ranks (world size {world()} on {gpus} GPUs; set RINGREDUCE_GPU_WORLD={n})",
    )


def need_distinct_gpus(n: int = 2):
    """Skips unless every rank of the configured world has a GPU of its own (and there are >= n)."""
    gpus = visible_gpus()
    return pytest.mark.skipif(
        gpus < n or shared(),
        reason=f"needs a GPU per rank (>= {n}); {world()} ranks share {gpus} GPU(s) here",
    )


class GpuRank(RankKind):
    """A GPU test's rank: NCCL's environment for its place among the GPUs, its GPU, and a process group
    with NCCL for CUDA tensors (`on_cuda`; else gloo alone)."""

    name = "gpu rank"
    folder = "rr_gpu_ranks_"
    pg_timeout = 120.0

    def __init__(self, on_cuda: bool, set_device: bool) -> None:
        self.on_cuda = on_cuda
        self.set_device = set_device

    def start(self, rank: int, world_size: int) -> str:
        if self.on_cuda:
            gpus = torch.cuda.device_count()
            os.environ.update(nccl_rank_env(rank, world_size, gpus))
            if self.set_device:
                torch.cuda.set_device(rank_device(rank, gpus))
            backend = "cpu:gloo,cuda:nccl"
        else:
            backend = "gloo"
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        return backend

    def after_job(self, rank: int) -> None:
        if self.on_cuda:
            torch.cuda.synchronize(rank_device(rank, torch.cuda.device_count()))


def run_gpu_ranks(fn: Callable, *args: Any, world_size: int | None = None, env: dict | None = None,
                  timeout: float = 300.0, set_device: bool = True, fresh: bool = False,
                  exits: dict[int, int] | None = None, device: str = "cuda") -> list[Any]:
    """Runs fn(rank, world_size, *args) on every rank; returns the per-rank results (None for ranks
    that died as `exits` allowed). See the module docstring."""
    on_cuda = device == "cuda"
    n = world_size or (world() if on_cuda else 2)
    if on_cuda and visible_gpus() == 0:
        pytest.fail("run_gpu_ranks needs a CUDA GPU", pytrace=False)
    if exits and not fresh:
        raise ValueError("exits= needs fresh=True: a pool rank that exits is gone")
    within_deadline(timeout)  # past the run's deadline: skip before any process starts
    kind = GpuRank(on_cuda, set_device)
    if fresh:
        return run_fresh(n, kind, fn, args, env, timeout, exits)
    if on_cuda and set_device:  # the pool of the place "cuda", which the behavioural modules' cases use too
        return run_ranks(n, fn, *args, timeout=timeout, env=env, transport="cuda")
    return pool(("gpu", n, on_cuda, set_device), n, kind).run(fn, args, {}, dict(env or {}), timeout, {})


def _cuda_place() -> tuple[RankKind, dict]:
    """The place "cuda" (Note [Places] in tests/ranks.py): GPU ranks, each on its GPU, over NCCL."""
    return GpuRank(on_cuda=True, set_device=True), {}


register_place("cuda", _cuda_place)
