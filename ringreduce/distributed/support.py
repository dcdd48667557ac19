"""The name backend "ringreduce" registers under, and what the running torch lets it do (Note [A
ProcessGroup, not a Backend] in ringreduce/distributed/__init__.py).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

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
