"""The torch.distributed backend "ringreduce": ``import ringreduce`` registers it (cpu and cuda).

    dist.init_process_group("ringreduce")       # or "cpu:ringreduce,cuda:ringreduce"
    g = dist.new_group(ranks, backend="ringreduce", pg_options=ringreduce.BackendOptions(...))

all_reduce (SUM, AVG, MAX, MIN, PRODUCT), all_reduce_coalesced, reduce_scatter_tensor,
all_gather_into_tensor and the list forms run ringreduce's ring (ringreduce/backend/process_group.py);
every other collective runs on an inner gloo (CPU) or NCCL (CUDA) group (ringreduce/backend/inner.py).

Note [A ProcessGroup, not a Backend]
    The creator returns RingreduceProcessGroup, a Python subclass of ``dist.ProcessGroup`` that torch
    uses as the group itself, not a c10d ``Backend``: why, and the torch versions it needs, are in
    docs/design.md section 1.7. ``python_process_groups_supported()`` checks the feature itself.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist

from ringreduce.backend.options import BackendOptions

NAME = "ringreduce"
# the oldest torch whose dist.monitored_barrier takes a group by its devices rather than its backend's name
MONITORED_BARRIER_TORCH = "2.14"
# the oldest torch seen with gloo's list all_to_all (absent from 2.11.0, present in 2.13.0; 2.12 not tried):
# older ones run it as one all_to_all_single (RingreduceProcessGroup.alltoall)
GLOO_ALLTOALL_TORCH = "2.13"


@functools.lru_cache(maxsize=1)
def python_process_groups_supported() -> bool:
    """Whether this torch calls a Python subclass's overrides of ``dist.ProcessGroup`` from C++
    (Note [A ProcessGroup, not a Backend])."""
    if not dist.is_available():
        return False

    class _Probe(dist.ProcessGroup):  # type: ignore[misc, valid-type]
        def getBackendName(self) -> str:  # noqa: N802 - torch's name
            return "ringreduce-probe"

    try:
        return _Probe(0, 1).name() == "ringreduce-probe"
    except Exception:  # noqa: BLE001 - any failure means no Python process groups
        return False


def torch_at_least(version: str) -> bool:
    """Whether the running torch is `version` ("2.14") or newer (local tags such as "+cpu" ignored)."""
    return torch.torch_version.TorchVersion(torch.__version__.split("+")[0]) >= version


def dist_monitored_barrier_supported() -> bool:
    """Whether ``dist.monitored_barrier(group=g)`` accepts a "ringreduce" group: torch 2.14 asks for a
    group with a CPU device, older torch for a group whose backend is named "gloo" (and raises its
    ValueError "monitored_barrier is only implemented for GLOO backend"); there ``g.monitored_barrier
    (timeout)``, the group's own method, runs the inner gloo's."""
    return torch_at_least(MONITORED_BARRIER_TORCH)


def _create(opts: Any, pg_options: Any) -> Any:
    """torch's creator call for a new "ringreduce" group (extended API: _DistributedBackendOptions)."""
    options = BackendOptions.from_pg_options(pg_options)
    if not python_process_groups_supported():
        raise RuntimeError(
            f'ringreduce: torch {torch.__version__} cannot host a process group written in Python (no Python '
            'trampoline for c10d::ProcessGroup), so backend "ringreduce" is unavailable on it; use backend "gloo" or '
            '"nccl" with ringreduce.GradientAverager, ringreduce.ddp_comm_hook or ringreduce.all_reduce'
        )
    from ringreduce.backend.process_group import RingreduceProcessGroup

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
