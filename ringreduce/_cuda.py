"""ringreduce's GPU path: the ring all-reduce of CUDA tensors over ringreduce's own NCCL communicator.

``ringreduce.all_reduce`` calls :func:`cuda_all_reduce` for CUDA tensors after its local checks
(dtype/op, group membership; numel 0 and world size 1 return before). What happens here:

* **One NCCL communicator per (process group, device)**, created lazily by the first CUDA call on
  the group, on the tensor's device: rank 0 of the group draws an NCCL unique id and publishes it
  through the group's own c10d store (``_get_process_group_store(group)``) under
  ``ringreduce/nccl_uid/<generation>``, where the generation counts the communicators this process
  created for the group (the same on every rank, since creation is collective and in call order).
  The communicator is non-blocking (``config.blocking = 0``), has its own communication and reduce
  streams, <= 8 MiB of staging, and a watchdog thread that aborts it on an NCCL error or when a
  started call exceeds the timeout (``RINGREDUCE_TIMEOUT`` seconds, else the group's timeout).
  After an abort every later call on the group raises ``torch.distributed.DistBackendError``;
  create a new group to continue. Communicators are aborted at interpreter exit (atexit), never
  from static destructors.
* **Stream semantics, as torch.distributed's NCCL backend**: the ring is ordered after everything
  already enqueued on the current CUDA stream; a synchronous call makes the current stream wait
  for the result (the host does not block); ``async_op=True`` returns a :class:`~ringreduce.Work`
  whose ``wait()`` makes the *current* stream wait (``wait(timeout=...)`` also blocks the host up
  to the timeout) and whose ``get_future()`` is CUDA-aware (completed with events, no host sync;
  its value is ``[tensor]``). Tensors are protected from the caching allocator while the internal
  streams use them, so freeing one right after the call is safe. CUDA graph capture is refused with
  a RuntimeError.
* ``RINGREDUCE_CHECK=1`` turns on the cross-rank agreement check (one fixed-size frame around the
  ring before the payload; it synchronizes the host once per call). Without it, ranks that disagree
  behave as NCCL does until the watchdog timeout aborts the communicator.
* ``RINGREDUCE_SEGMENT_BYTES`` (default 1 MiB, capped at the staging slot) and ``RINGREDUCE_SLOTS``
  (default 4) tune the pipeline.

Running beside stock NCCL communicators (DDP, FSDP, tensor parallel)
--------------------------------------------------------------------
ringreduce's communicator is one more NCCL communicator on the GPU, with its own streams. NCCL
kernels of different communicators wait for their peers while occupying the GPU, so two
communicators whose operations are enqueued in a different order on different ranks can deadlock
(NCCL's rule for "multiple communicators concurrently"). Keep these orders:

1. Issue ringreduce calls and stock collectives (``dist.all_reduce``, DDP's buckets, TP's
   all-gathers) in the **same program order on every rank** of the groups involved.
2. A **synchronous** ringreduce call is always safe: the current stream waits for the ring, and
   every later stock collective is ordered after the current stream.
3. With ``async_op=True``, call ``work.wait()`` (a stream wait, cheap) **before** issuing a stock
   collective that shares GPUs with the pending ring, unless (1) holds on every rank. This is
   mandatory under ``CUDA_DEVICE_MAX_CONNECTIONS=1`` (Megatron-style TP), where all streams share
   one hardware queue and no NCCL kernels of two communicators can overlap.
4. Do not mix ringreduce and a DDP model's own reduction of the same gradients: use
   ``GradientAverager`` or ``ddp_comm_hook``, not both.
5. Each rank uses one GPU per group (NCCL does not support two ranks of one communicator on one
   device).
"""

from __future__ import annotations

import atexit
import threading
from typing import Any

import torch
import torch.distributed as dist

from ringreduce import _config
from ringreduce._groups import GroupInfo
from ringreduce.work import Work

_UID_KEY = "ringreduce/nccl_uid/{generation}"

_lock = threading.Lock()
# (id(process group), device index) -> (process group, NcclComm). The group is held so that its id
# cannot be reused by a new group while the communicator lives.
_comms: dict[tuple[int, int], tuple[Any, Any]] = {}
_generations: dict[int, int] = {}
_shut_down = False


def _native() -> Any:
    """ringreduce._C, checked to have been built with CUDA and NCCL."""
    from ringreduce._native import C

    if not C.native_info["cuda"] or not hasattr(C, "cuda_all_reduce"):
        raise RuntimeError(
            "ringreduce: got a CUDA tensor, but this ringreduce build has no CUDA/NCCL support. Reinstall it "
            "where a CUDA toolkit is found (set CUDA_HOME) with a CUDA build of torch: "
            "`pip install --no-build-isolation --force-reinstall --no-deps .`"
        )
    return C


def _timeout_ms(pg: dist.ProcessGroup) -> int:
    ms = _config.timeout_ms()
    return ms if ms > 0 else int(_native().cuda_group_timeout_ms(pg))


def communicator(info: GroupInfo, device: torch.device) -> Any:
    """The NCCL communicator of `info`'s group on `device`, created on first use (collective)."""
    if device.type != "cuda" or device.index is None:
        raise ValueError(f"ringreduce: expected a CUDA device with an index, got {device}")
    key = (id(info.pg), device.index)
    with _lock:
        if _shut_down:
            raise RuntimeError("ringreduce: the GPU path was shut down (interpreter exit)")
        entry = _comms.get(key)
        if entry is not None:
            return entry[1]
        C = _native()
        generation = _generations.get(id(info.pg), 0)
        _generations[id(info.pg)] = generation + 1
        store = dist.distributed_c10d._get_process_group_store(info.pg)
        uid_key = _UID_KEY.format(generation=generation)
        if info.rank == 0:
            store.set(uid_key, C.nccl_unique_id())
        uid = store.get(uid_key)  # blocks until rank 0 published it (store timeout)
        comm = C.NcclComm(
            uid,
            info.size,
            info.rank,
            device.index,
            _timeout_ms(info.pg),
            f"ringreduce {info.name} on cuda:{device.index} (generation {generation})",
            _config.num_slots(),
        )
        _comms[key] = (info.pg, comm)
        return comm


def cuda_all_reduce(
    tensor: torch.Tensor,
    op: Any,
    info: GroupInfo,
    async_op: bool,
    accum_float32: bool,
    kind: int,
) -> Work | None:
    """Ring all-reduce of a CUDA tensor in place (see the module docstring for stream semantics).

    `op` is a ringreduce.ReduceOp (an int 0-4), `info` the resolved group, `accum_float32` carries
    half-type partials in float32, `kind` the call kind of the agreement frame. Returns a Work when
    `async_op`, else None. Raises TypeError/ValueError for bad input, RuntimeError when ranks
    disagree (RINGREDUCE_CHECK=1) or under CUDA graph capture, DistBackendError on NCCL failures,
    timeouts and groups whose communicator was aborted.
    """
    if not tensor.is_cuda:
        raise ValueError(f"ringreduce: cuda_all_reduce needs a CUDA tensor, got one on {tensor.device}")
    comm = communicator(info, tensor.device)
    handle = _native().cuda_all_reduce(
        comm,
        tensor,
        int(op),
        bool(accum_float32),
        _config.segment_bytes(),
        bool(async_op),
        _config.check_enabled(True),
        int(kind),
        info.name,
    )
    if not async_op:
        return None
    name = getattr(op, "name", str(op))
    return Work(handle, [tensor], describe=f"all_reduce {name} on {info.name} (cuda:{tensor.device.index})")


def cuda_refuse(info: GroupInfo, device: torch.device, kind: int, error: int) -> None:
    """With RINGREDUCE_CHECK=1: tell the other ranks that this rank refused the call locally.

    Sends this rank's frame marked with `error` (csrc/core/frame.h FrameError) so that the others
    raise RuntimeError at once instead of at the timeout. Returns normally; the caller then raises
    its own, more precise exception. Does nothing when the check is off.
    """
    if not _config.check_enabled(True) or info.size <= 1:
        return
    comm = communicator(info, device)
    try:
        _native().cuda_refuse(comm, int(kind), int(error), 0, info.name)
    except RuntimeError:
        pass  # every rank sees the refusal; ours is reported by the caller's own exception


def abort_all(reason: str = "interpreter exit") -> None:
    """Aborts every ringreduce NCCL communicator of this process (idempotent). Called at exit."""
    global _shut_down
    with _lock:
        _shut_down = True
        entries = list(_comms.values())
        _comms.clear()
    for _, comm in entries:
        comm.abort(reason)


def release_group(group: dist.ProcessGroup) -> None:
    """Aborts and forgets the communicators of `group` (e.g. before dist.destroy_process_group)."""
    with _lock:
        keys = [k for k in _comms if k[0] == id(group)]
        entries = [_comms.pop(k) for k in keys]
    for _, comm in entries:
        comm.abort("the process group was released")


atexit.register(abort_all)
