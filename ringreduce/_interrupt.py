"""Waiting for a native call in slices, so that Ctrl-C (SIGINT) interrupts it within a slice.

Note [Ctrl-C]
    CPython runs its SIGINT handler only between bytecodes of the main thread, so a native wait on a
    silent peer would last until the group's timeout. Every wait of the CPU path is therefore a loop
    of native waits of at most SLICE_MS; on KeyboardInterrupt between two, the thread makes the ring
    unusable on this rank (``_C.interrupt_cpu`` aborts its pending transfers, its worker exits and
    later calls say why), lets the worker release the call's tensors, and re-raises. The peers fail
    with DistBackendError when this process exits or at their timeout. A completed call costs one
    native wait. On CUDA, ``Work.wait(timeout=...)`` waits in the same slices and an interrupt aborts
    the group's communicator on this rank; the GPU path's native host waits run Python's signal
    handlers themselves (Note [Interrupting a host wait on CUDA] in csrc/cuda/host_interrupt.h), and
    the unique ids' rendezvous polls the store (``_rings.cuda._wait_for_key``).
"""

from __future__ import annotations

import time
from typing import Any

from ringreduce._native import C

SLICE_MS = 100  # worst-case extra latency of Ctrl-C; a finished call returns at once
_SETTLE_MS = 500  # how long an interrupted wait lets the worker finish failing the call


def interrupt_reason(ring_name: str, seq: int | None, waited: str = "waited") -> str:
    """Why a ring is unusable after Ctrl-C while call `seq` (None: a call not numbered yet) `waited`."""
    call = "a call" if seq is None else f"call #{seq}"
    return (
        f"ringreduce: {ring_name} was interrupted on this rank (KeyboardInterrupt while {call} {waited}); "
        "the group is unusable for ringreduce on this rank: destroy the process group "
        "(torch.distributed.destroy_process_group()) and create a new one to go on"
    )


def interrupt_ring(pg: Any, members: tuple[int, ...], ring_name: str, handle: Any) -> None:
    """Makes the CPU ring of (pg, members) unusable on this rank and waits briefly for `handle`."""
    try:
        C.interrupt_cpu(pg, list(members), interrupt_reason(ring_name, handle.seq))
        handle.wait(_SETTLE_MS)
    except Exception:  # noqa: BLE001 - already unwinding a KeyboardInterrupt; nothing better to do
        pass


def wait_sliced(handle: Any, timeout_ms: int = -1, on_interrupt: Any = None) -> bool:
    """Waits for a native call handle (``handle.wait(ms) -> bool``) in slices of SLICE_MS.

    Returns True once completed, False when `timeout_ms` (>= 0) passed first. On KeyboardInterrupt
    calls ``on_interrupt()`` (if given) and re-raises.
    """
    try:
        if timeout_ms < 0:
            while not handle.wait(SLICE_MS):
                pass
            return True
        deadline = time.monotonic() + timeout_ms / 1000.0
        while True:
            left_ms = max(0, int((deadline - time.monotonic()) * 1000.0))
            if handle.wait(min(SLICE_MS, left_ms)):
                return True
            if left_ms == 0:
                return False
    except KeyboardInterrupt:
        if on_interrupt is not None:
            on_interrupt()
        raise
