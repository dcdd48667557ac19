"""The torch.distributed backend "ringreduce": ``import ringreduce`` registers it (cpu and cuda).

    dist.init_process_group("ringreduce")       # or "cpu:ringreduce,cuda:ringreduce"
    g = dist.new_group(ranks, backend="ringreduce", pg_options=ringreduce.BackendOptions(...))

all_reduce (SUM, AVG, MAX, MIN, PRODUCT), all_reduce_coalesced, reduce_scatter_tensor,
all_gather_into_tensor and the list forms run ringreduce's ring (ringreduce/backend/process_group.py);
every other collective runs on an inner gloo (CPU) or NCCL (CUDA) group (ringreduce/backend/inner.py).

Note [Which torch can host the backend]
    torch calls a Python Backend's methods only where its pybind trampoline for ``c10d::Backend``
    exists (PyBackend, torch/csrc/distributed/c10d/py/PyBackend.hpp); without it a Python subclass's
    collectives are never called. ``python_backends_supported()`` checks the feature itself, not a
    version string: a throwaway subclass overrides ``getBackendName`` and ``name()``, which C++
    answers through that virtual, must return the override's value. Where it is missing, the name is
    still registered, and creating a group raises a RuntimeError that says so (instead of a group
    whose collectives fail later); ringreduce's own API (GradientAverager, ddp_comm_hook,
    rr.all_reduce) works on any torch setup.py accepts.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist

from ringreduce.backend.options import BackendOptions

NAME = "ringreduce"


@functools.lru_cache(maxsize=1)
def python_backends_supported() -> bool:
    """Whether this torch calls a Python subclass's overrides of torch.distributed's Backend
    (Note [Which torch can host the backend])."""
    base = getattr(getattr(torch._C, "_distributed_c10d", None), "Backend", None)
    if base is None:
        return False

    class _Probe(base):  # type: ignore[misc, valid-type]
        def getBackendName(self) -> str:  # noqa: N802 - torch's name
            return "ringreduce-probe"

    try:
        return _Probe(0, 1).name() == "ringreduce-probe"
    except Exception:  # noqa: BLE001 - any failure means no Python backends
        return False


def _create(opts: Any, pg_options: Any) -> Any:
    """torch's creator call for a new "ringreduce" group (extended API: _DistributedBackendOptions)."""
    options = BackendOptions.from_pg_options(pg_options)
    if not python_backends_supported():
        raise RuntimeError(
            f'ringreduce: torch {torch.__version__} cannot host a backend written in Python (no Python '
            'trampoline for c10d::Backend), so backend "ringreduce" is unavailable on it; use backend "gloo" or '
            '"nccl" with ringreduce.GradientAverager, ringreduce.ddp_comm_hook or ringreduce.all_reduce, or a newer torch'
        )
    from ringreduce.backend.process_group import RingreduceBackend

    return RingreduceBackend(opts.store, opts.group_rank, opts.group_size, opts.timeout, str(opts.group_id),
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


__all__ = ["NAME", "BackendOptions", "python_backends_supported", "register"]
