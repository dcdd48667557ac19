"""The torch.distributed backend "ringreduce": ``import ringreduce`` registers it (cpu and cuda).

    dist.init_process_group("ringreduce")       # or "cpu:ringreduce,cuda:ringreduce"
    g = dist.new_group(ranks, backend="ringreduce", pg_options=ringreduce.BackendOptions(...))

all_reduce (SUM, AVG, MAX, MIN, PRODUCT), all_reduce_coalesced, reduce_scatter_tensor,
all_gather_into_tensor and the list forms run ringreduce's ring (ringreduce/distributed/process_group.py);
every other collective runs on an inner gloo (CPU) or NCCL (CUDA) group (ringreduce/distributed/inner.py).

Note [A ProcessGroup, not a Backend]
    The creator returns RingreduceProcessGroup, a Python subclass of ``dist.ProcessGroup`` that torch
    uses as the group itself, not a c10d ``Backend``: why, and the torch versions it needs, are in
    docs/design.md section 1.7. ``python_process_groups_supported()`` checks the feature itself.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ringreduce.distributed.options import BackendOptions
from ringreduce.distributed.support import (
    GLOO_ALLTOALL_TORCH,
    MONITORED_BARRIER_TORCH,
    NAME,
    dist_monitored_barrier_supported,
    python_process_groups_supported,
    torch_at_least,
)


def _create(opts: Any, pg_options: Any) -> Any:
    """torch's creator call for a new "ringreduce" group (extended API: _DistributedBackendOptions)."""
    options = BackendOptions.from_pg_options(pg_options)
    if not python_process_groups_supported():
        raise RuntimeError(
            f'ringreduce: torch {torch.__version__} cannot host a process group written in Python (no Python '
            'trampoline for c10d::ProcessGroup), so backend "ringreduce" is unavailable on it; use backend "gloo" or '
            '"nccl" with ringreduce.GradientAverager, ringreduce.ddp_comm_hook or ringreduce.all_reduce'
        )
    from ringreduce.distributed.process_group import RingreduceProcessGroup

    return RingreduceProcessGroup(opts.store, opts.group_rank, opts.group_size, opts.timeout, str(opts.group_id),
                             list(opts.global_ranks_in_group), options)


def register() -> None:
    """Registers the backend "ringreduce" for cpu and cuda with torch.distributed (idempotent: torch
    keeps backend names process-wide, and a second registration would replace the first)."""
    if not dist.is_available():
        return
    plugins = getattr(dist.Backend, "_plugins", {})
    if NAME.upper() in plugins:
        return
    dist.Backend.register_backend(NAME, _create, extended_api=True, devices=["cpu", "cuda"])


__all__ = ["GLOO_ALLTOALL_TORCH", "MONITORED_BARRIER_TORCH", "NAME", "BackendOptions", "dist_monitored_barrier_supported",
           "python_process_groups_supported", "register", "torch_at_least"]
