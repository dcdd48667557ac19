"""DeepSpeed's CPU shared-memory all-reduce as a column of the sweep (``--vs deepspeed``).

DeepSpeed is an optional benchmark dependency. Its shm path (``deepspeed.comm.inference_all_reduce``)
needs ``DS_ACCELERATOR=cpu``, ``LOCAL_SIZE`` = this host's ranks (it sets its buffers up only when every
rank is local) and a JIT build of its op. Where the op is unusable (not built, a dtype it lacks, a CPU
without AVX-512BW for its 16-bit kernels) DeepSpeed silently falls back to ``torch.distributed.all_reduce``,
so the column counts those calls and profiles one call. Its /dev/shm segments outlive the processes:
every rank removes its own (``remove_segment``).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

NAME = "deepspeed"
_SEGMENT_PREFIX = "/dev/shm/deepspeed_allreduce_buffer"


class DeepSpeedColumn:
    """DeepSpeed's shm all-reduce in this rank, counting its fallback calls; collective. `op`: "sum" or
    "avg" (DeepSpeed sums; avg then divides by n, as the gloo column does); `local_size`: this host's ranks."""

    def __init__(self, op: str, local_size: int) -> None:
        os.environ["DS_ACCELERATOR"] = "cpu"
        os.environ["LOCAL_SIZE"] = str(local_size)
        import deepspeed.comm as dscomm

        dscomm.init_distributed(dist_backend="gloo", verbose=False)
        self._reduce = dscomm.inference_all_reduce
        self.world_size = dist.get_world_size()
        self.divide = op == "avg"
        self.calls = 0
        self.fallback_calls = 0
        self._inside = False
        original = dist.all_reduce

        def counted(*args: Any, **kwargs: Any) -> Any:
            if self._inside:  # DeepSpeed's fallback: its shm op did not run for this call
                self.fallback_calls += 1
            return original(*args, **kwargs)

        dist.all_reduce = counted  # DeepSpeed looks it up at every call

    def run(self, t: torch.Tensor) -> None:
        """One all-reduce of `t` in place."""
        self._inside = True
        self._reduce(t)
        self._inside = False
        self.calls += 1
        if self.divide:
            t.div_(self.world_size)

    def counts(self) -> tuple[int, int]:
        """(calls, fallback calls) since the last counts(), then both restart at 0."""
        out = (self.calls, self.fallback_calls)
        self.calls = self.fallback_calls = 0
        return out

    def profiled_ops(self, t: torch.Tensor) -> list[str]:
        """The names of the deepspeed and all_reduce ops one call on `t` ran (collective)."""
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            self.run(t)
        names = {e.name for e in prof.events() if "deepspeed" in e.name or "all_reduce" in e.name}
        return sorted(names)


def remove_segment(rank: int) -> None:
    """Removes this rank's DeepSpeed segment of this run (its name has the store's address and port)."""
    name = (f"{_SEGMENT_PREFIX}_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_"
            f"{os.environ.get('MASTER_PORT', '')}_{rank}")
    try:
        os.unlink(name)
    except FileNotFoundError:
        pass

