"""The rings: one per (process group, rank list, device type), made at the group's first ringreduce
call on that device and kept until the group is released (docs/design.md section 2.5).

A ring is a ``cpu.CpuRing`` (the native CPU runtime: shared memory between ranks of one host, gloo
point-to-point between hosts) or a ``cuda.CudaRing`` (ringreduce's NCCL communicator and CUDA
kernels), each with the one interface below. It holds the knobs it read when it was made (Note [Knobs
are read when a ring is made] in ringreduce/_config.py) and reads them again at its first call after
``ringreduce.reload_knobs()``; at its first call its ranks agree on the knobs that change what they send
one another (ringreduce/_rings/agree.py: Note [The ranks of a ring agree on its knobs]). Each ring's Work
carries what Ctrl-C during its wait does (Note [Ctrl-C] in ringreduce/_interrupt.py).

The interface of a ring (tests/test_call_path.py holds both to it): ENQUEUES (a synchronous call
returns before the result exists: CUDA), WIRE_RING (the algorithm a 16-bit wire runs on, None: the
call's), PLANS (its calls leave plans for the next identical call), knobs, check_enabled(),
ring_parameters(), option_refusal(algorithm, gather), options(call), all_reduce(call, tensor, options,
async_op), ring_half(call, tensor, output, async_op), refuse(info, kind, code, algorithms).
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from ringreduce import _config
from ringreduce._groups import GroupInfo
from ringreduce._native import C
from ringreduce._rings import cpu, cuda

_TYPES = {"cpu": cpu.CpuRing, "cuda": cuda.CudaRing}
_lock = threading.Lock()
# (id(process group), rank list, device type) -> (the process group, its ring); the group is held so
# that its id cannot be reused while its ring lives.
_rings: dict[tuple[int, tuple[int, ...], str], tuple[Any, Any]] = {}


def ring_type(device: torch.device) -> type:
    """The ring class of tensors on `device`; ValueError for a device ringreduce does not run on, and
    RuntimeError for a CUDA device in a build without CUDA, each saying what to do."""
    ring = _TYPES.get(device.type)
    if ring is None:
        raise ValueError(f"ringreduce: tensors on {device.type} are not supported; use CPU or CUDA tensors")
    if ring is cuda.CudaRing and not C.native_info["cuda"]:
        raise RuntimeError(
            "ringreduce: got a CUDA tensor, but this ringreduce build has no CUDA support. Reinstall it "
            "where a CUDA toolkit is found (set CUDA_HOME) with a CUDA build of torch, or reduce a CPU tensor"
        )
    return ring


def ring_for(info: GroupInfo, device: torch.device, blocking: bool = True) -> Any:
    """The ring of `info` (a group this rank is in, and its rank list) for tensors on `device`, made at
    its first call (ring_type's errors for a device without one); its knobs are current. `blocking`:
    the call waits for its peers (not an asynchronous CPU call), so the first call's agreement on the
    knobs may too (agree.read_knobs)."""
    key = (id(info.pg), info.members, device.type)
    hit = _rings.get(key)
    if hit is not None and hit[0] is info.pg:
        ring = hit[1]
    else:
        make = ring_type(device)
        with _lock:
            hit = _rings.get(key)
            if hit is None or hit[0] is not info.pg:
                hit = _rings[key] = (info.pg, make(info))
        ring = hit[1]
    if ring.epoch != _config.epoch:  # a new ring (epoch -1) or a reload_knobs() since its last read
        ring.reload(info, blocking)  # reads them, and the ring's ranks agree on them (agree.read_knobs)
    return ring


def refusing_ring(info: GroupInfo, device: torch.device | None) -> Any | None:
    """The ring the other ranks run a call on that this rank refuses: the CUDA ring for a CUDA `device`
    (None in a build without CUDA: no communicator to tell), else the CPU ring (no tensor, or one on a
    device no ring runs on: the others hold CPU tensors there)."""
    if device is not None and device.type == "cuda":
        return ring_for(info, device) if C.native_info["cuda"] else None
    return ring_for(info, torch.device("cpu"))


def release_group(pg: object) -> None:
    """Releases the rings of the process group `pg`: its CPU runtimes (worker threads, shared memory)
    and its NCCL communicators; its next call makes new ones."""
    with _lock:
        for key in [k for k, (held, _) in _rings.items() if held is pg]:
            del _rings[key]
    C.release_cpu(pg)
    if C.native_info["cuda"]:
        cuda.release_group(pg)


def forget_all() -> None:
    """Drops every ring (the interpreter exits; their native parts are released by _C.shutdown)."""
    with _lock:
        _rings.clear()


__all__ = ["cpu", "cuda", "forget_all", "refusing_ring", "release_group", "ring_for", "ring_type"]
