"""The CUDA backend: the collectives of CUDA tensors over ringreduce's own NCCL communicator, one per
process group and device (its ordering rules beside stock NCCL communicators: docs/design.md section 2.4).
"""

from __future__ import annotations

import atexit
import os
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from ringreduce import _config
from ringreduce._groups import GroupInfo, choose_algorithm, resolve
from ringreduce._interrupt import SLICE_MS, interrupt_reason
from ringreduce._options import ALGORITHMS
from ringreduce._types import KIND_NAMES, CallKind
from ringreduce.work import Work

ENQUEUES = True  # a synchronous call returns once its work is ordered on the current stream
WIRE_RING = "ring"  # a 16-bit wire runs on the flat ring

_UID_KEY = "ringreduce/nccl_uid/{group}/{generation}"
_COUNTER_KEY = "ringreduce/nccl_generation/{group}"

_lock = threading.Lock()  # guards the dicts below; never held while waiting for other ranks
# id(process group) -> (process group, device index, CudaRing). One device per group and process
# (Note [One GPU per group]); the group is held so that its id cannot be reused while it lives.
_comms: dict[int, tuple[Any, int, Any]] = {}
_creating: dict[int, threading.Lock] = {}  # id(process group) -> its creation lock
# id(process group) -> why its communicator will never exist: Ctrl-C interrupted its creation (Note
# [Interrupting a host wait on CUDA] in csrc/cuda/host_interrupt.h)
_interrupted: dict[int, str] = {}
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


def _rendezvous_uids(C: Any, pg: dist.ProcessGroup, pg_rank: int, pg_size: int, lanes: int,
                     store: Any) -> tuple[list[bytes], int]:
    """Rank 0's fresh NCCL unique ids (one per lane, Note [Lanes] in csrc/core/plan.h; rank 0's lane
    count decides), through the group's store, and their generation.

    Note [Communicator rendezvous keys]: the key is ``nccl_uid/<group name>/<generation>``; the
    generation is ``(store.add(counter, 1) - 1) // size``, equal on every rank since a group's
    creations are collective and in one order. The counter only grows, so a reused ``id(pg)`` or
    store never yields an old id; the last rank to read a key deletes it.
    """
    try:  # a name every rank shares and that a later group does not reuse by accident
        group = dist.distributed_c10d._get_process_group_name(pg)
    except Exception:  # noqa: BLE001 - a group torch does not know by name
        group = getattr(pg, "group_name", "")
    group = group or "default"
    generation = (int(store.add(_COUNTER_KEY.format(group=group), 1)) - 1) // pg_size
    uid_key = _UID_KEY.format(group=group, generation=generation)
    if pg_rank == 0:
        ids = [bytes(C.nccl_unique_id()) for _ in range(max(1, lanes))]
        store.set(uid_key, b"".join(len(i).to_bytes(4, "big") + i for i in ids))  # each after its length
    _wait_for_key(store, uid_key, f"rank 0 of {group} did not publish the NCCL unique ids")
    blob, ids, at = store.get(uid_key), [], 0
    while at < len(blob):
        n = int.from_bytes(blob[at:at + 4], "big")
        ids.append(blob[at + 4:at + 4 + n])
        at += 4 + n
    if int(store.add(uid_key + "/read", 1)) == pg_size:
        for k in (uid_key, uid_key + "/read"):
            try:
                store.delete_key(k)
            except Exception:  # noqa: BLE001 - a store without deletion: the key is never read again
                pass
    return ids, generation


def _wait_for_key(store: Any, key: str, what: str) -> None:
    """Waits until `key` is in `store` (DistStoreError saying `what` after the store's timeout), polling:
    ``store.get`` would block out of Ctrl-C's reach (Note [Ctrl-C] in ringreduce/_interrupt.py)."""
    limit_s = _store_timeout_s(store, 300.0)  # without one: torch's default
    deadline = time.monotonic() + limit_s
    pause = 0.001  # rank 0 usually published already: check again soon, then every half slice
    while not store.check([key]):
        if time.monotonic() > deadline:
            raise dist.DistStoreError(
                f"ringreduce: {what} within {limit_s:.0f} s (the store's timeout, key {key}): every rank of the "
                "group must make the group's first CUDA call (or init_communicator) together"
            )
        time.sleep(pause)
        pause = min(2 * pause, SLICE_MS / 2000.0)


def _store_timeout_s(store: Any, default: float) -> float:
    try:
        return store.timeout.total_seconds()
    except Exception:  # noqa: BLE001 - a store without a timeout
        return default


def communicator(info: GroupInfo, device: torch.device) -> Any:
    """The NCCL communicator of `info`'s process group on `device`, created on first use, collectively
    over every rank of ``info.pg`` (a ring over a rank list of the group uses it too).

    Note [One GPU per group]: a process uses one GPU per group; a tensor on another device raises
    ValueError (a second communicator created on one rank only would hang the others). Ctrl-C while
    the ranks meet leaves the group unusable for ringreduce on this rank (later calls: DistBackendError).
    """
    if device.type != "cuda" or device.index is None:
        raise ValueError(f"ringreduce: expected a CUDA device with an index, got {device}")
    key = id(info.pg)
    with _lock:
        if _shut_down:
            raise RuntimeError("ringreduce: the GPU path was shut down (interpreter exit)")
        creating = _creating.setdefault(key, threading.Lock())
    with creating:  # other groups' calls go on meanwhile; this group's wait for the first
        with _lock:
            entry = _comms.get(key)
            interrupted = _interrupted.get(key)
        if interrupted is not None:
            raise dist.DistBackendError(interrupted)
        if entry is not None:
            _, pinned, comm = entry
            if pinned != device.index:
                raise ValueError(
                    f"ringreduce: group {info.name} runs on cuda:{pinned} in this process, but got a tensor on "
                    f"{device}. Each rank uses one GPU per group (NCCL allows one device per rank): move the "
                    f"tensor to cuda:{pinned}, or use another process group for the other GPU."
                )
            return comm
        C = _native()
        # The group's ranks, not the ring's indices (info.rank/info.size describe the ring).
        if info.global_ranks:  # a "ringreduce" group's inner group: in no torch.distributed table
            pg_rank, pg_size = info.pg.rank(), info.pg.size()
        else:
            pg_rank, pg_size = dist.get_rank(info.pg), dist.get_world_size(info.pg)
        store = info.store
        try:
            ids, generation = _rendezvous_uids(C, info.pg, pg_rank, pg_size,
                                               _config.lanes() or _config.DEFAULT_LANES, store)
            label = info.name if not info.members else f"process group of {info.name}"
            timeout_ms = _config.timeout_ms()
            if timeout_ms <= 0:
                timeout_ms = int(C.cuda_group_timeout_ms(info.pg))
            comm = C.CudaRing(
                ids[0],
                pg_size,
                pg_rank,
                device.index,
                timeout_ms,
                f"ringreduce {label} on cuda:{device.index} (generation {generation})",
                0,  # staging: the default (kGpuStagingBytes)
                # init and first connections: at least the store's timeout (NCCL init of many GPUs can
                # take longer than a short RINGREDUCE_TIMEOUT)
                max(timeout_ms, int(_store_timeout_s(store, 0.0) * 1000)),
                lane_ids=ids[1:],
            )
        except KeyboardInterrupt:
            # The other ranks wait in init until their connect timeout; a second try here would not
            # meet them (the generation moved on): the group is done for ringreduce on this rank.
            with _lock:
                _interrupted[key] = interrupt_reason(info.name, None, "waited for its NCCL communicator")
            raise
        with _lock:
            _comms[key] = (info.pg, device.index, comm)
        return comm


def _default_device() -> torch.device:
    """The current CUDA device, unless that is surely not this rank's GPU (Note [One GPU per group])."""
    current = torch.cuda.current_device()
    local = os.environ.get("LOCAL_RANK")
    if local is not None and local.isdigit() and int(local) != current and torch.cuda.device_count() > int(local):
        raise ValueError(
            f"ringreduce.init_communicator: the current CUDA device is cuda:{current} but LOCAL_RANK is {local}; "
            f"call torch.cuda.set_device({local}) first or pass device=torch.device('cuda', {local}) (otherwise "
            "several ranks would use one GPU and NCCL refuses that)"
        )
    return torch.device("cuda", current)


def init_communicator(group: Any = None, device: torch.device | int | None = None) -> None:
    """Creates the NCCL communicator of `group` on `device` now (collective over the whole group).

    `group`: None (WORLD), a ProcessGroup or a DeviceMesh (a multi-dimensional sub-mesh uses
    WORLD's communicator); `device`: default the current CUDA device (ValueError if that is not
    ``cuda:$LOCAL_RANK`` where LOCAL_RANK is set and such a GPU exists). Optional: the first CUDA call
    on the group does the same. Useful before calls on DeviceMesh sub-meshes that only some ranks
    make. A rank outside `group` does nothing.
    """
    info = resolve(group)
    if info is None:
        return
    if device is None:
        device = _default_device()
    elif isinstance(device, int):
        device = torch.device("cuda", device)
    communicator(info, device)


def _check_on_comm(t: torch.Tensor, comm: Any, what: str) -> None:
    if not t.is_cuda:
        raise ValueError(f"ringreduce: the {what} must be a CUDA tensor, got one on {t.device}")
    if t.layout != torch.strided:
        raise ValueError(f"ringreduce: only dense (strided) tensors are supported, got {t.layout}")
    if t.device.index != comm.device:
        raise ValueError(
            f"ringreduce: the {what} is on {t.device} but this group's NCCL communicator is on cuda:{comm.device}"
        )


def _members(info: GroupInfo, members: Any) -> list[int]:
    return [int(m) for m in (info.members if members is None else members)]


def _options(C: Any, kind: int, op: Any, *, accum_float32: bool = False, local_size: int = 0, one_shot: bool = True,
             wire: Any = None, predivide: float = 0.0, extra_divisor: int = 1) -> Any:
    """The native CallOptions (csrc/core/call_options.h) of one CUDA call, with the knobs read now."""
    opts = C.CallOptions()
    opts.kind, opts.op, opts.accum_float32, opts.check = C.CallKind(int(kind)), C.RedOp(int(op)), accum_float32, \
        _config.check_enabled(True)
    opts.local_size, opts.one_shot = int(local_size), bool(one_shot)
    opts.wire_dtype, opts.predivide, opts.extra_divisor = wire, float(predivide), int(extra_divisor)
    opts.segment_bytes, opts.num_slots = _config.segment_bytes(0), _config.num_slots()
    opts.lanes, opts.one_shot_bytes = _config.lanes(), _config.one_shot_bytes()
    return opts


def cuda_all_reduce(
    tensor: torch.Tensor,
    op: Any,
    info: GroupInfo,
    async_op: bool,
    accum_float32: bool,
    kind: int,
    *,
    local_size: int = 0,
    members: Any = None,
    one_shot: bool = True,
    wire: Any = None,
    predivide: float = 0.0,
    extra_divisor: int = 1,
) -> Work | None:
    """All-reduce of a CUDA tensor in place, after ringreduce/_call.py's checks; a Work when `async_op`, else None.

    `members`: the ring's ranks in ``info.pg`` (default ``info.members``); `local_size` > 1: the
    hierarchical all-reduce over them, ordered node by node. `one_shot`: a small flat all-reduce may
    run in one shot (Note [GPU one-shot all-reduce]). `wire`, `predivide`, `extra_divisor`: Note
    [Reduction contract] in csrc/core/functors.h. Raises DistBackendError on NCCL failures and timeouts.
    """
    comm = communicator(info, tensor.device)
    _check_on_comm(tensor, comm, "tensor")
    C = _native()
    options = _options(C, kind, op, accum_float32=bool(accum_float32), local_size=local_size, one_shot=one_shot,
                       wire=wire, predivide=predivide, extra_divisor=extra_divisor)
    handle = C.cuda_all_reduce(comm, tensor, options, bool(async_op), info.name, _members(info, members))
    algo = f" hierarchical(local_size={local_size})" if local_size and local_size > 1 else ""
    return _work(handle, tensor, f"all_reduce {getattr(op, 'name', str(op))}{algo}", comm, info, async_op)


def _work(handle: Any, result: torch.Tensor, what: str, comm: Any, info: GroupInfo, async_op: bool) -> Work | None:
    """The Work of an async call (None for a synchronous one). Ctrl-C in its timed wait aborts this
    rank's communicator of the group (Note [Ctrl-C], ringreduce/_interrupt.py)."""
    if not async_op:
        return None
    if handle is None:
        return Work.completed([result])
    return Work(handle, [result], describe=f"{what} on {info.name} (cuda:{result.device.index})",
                on_interrupt=lambda: comm.abort(interrupt_reason(info.name, handle.seq)), stream_wait=True)


_HALF_NAMES = {int(k): KIND_NAMES[k] for k in (CallKind.REDUCE_SCATTER, CallKind.ALL_GATHER)}


def cuda_ring_half(
    tensor: torch.Tensor,
    output: torch.Tensor,
    op: Any,
    info: GroupInfo,
    async_op: bool,
    kind: int,
) -> Work | None:
    """reduce_scatter (kind 3: `output` gets block r of `tensor` reduced with `op`) or all_gather
    (kind 4: the contiguous `output` gets every rank's `tensor` in ring order) over ``info``'s ring."""
    if int(kind) not in _HALF_NAMES:
        raise ValueError(f"ringreduce: cuda_ring_half runs reduce_scatter (3) or all_gather (4), got kind {kind}")
    comm = communicator(info, tensor.device)
    _check_on_comm(tensor, comm, "input")
    _check_on_comm(output, comm, "output")
    if tensor.dtype != output.dtype:
        raise TypeError(f"ringreduce: output ({output.dtype}) and input ({tensor.dtype}) must have one dtype")
    if kind == 4 and not (output.is_contiguous() and not output.is_conj() and not output.is_neg()):
        raise ValueError("ringreduce.all_gather: the output must be a plain contiguous tensor")
    C = _native()
    handle = C.cuda_ring_half(comm, tensor, output, _options(C, kind, op), bool(async_op), info.name,
                              _members(info, None))
    what = f"{_HALF_NAMES[int(kind)]} {getattr(op, 'name', str(op))}" if kind == 3 else _HALF_NAMES[int(kind)]
    return _work(handle, output, what, comm, info, async_op)


def _ring_members(info: GroupInfo, algorithm: str) -> tuple[int, ...]:
    """The ring an all-reduce with `algorithm` runs on (the flat ring's where the layout refuses it)."""
    try:
        return choose_algorithm(info, algorithm)[1]
    except ValueError:
        return info.members


def cuda_refuse(info: GroupInfo, device: torch.device, kind: int, error: int, members: Any = None) -> None:
    """With RINGREDUCE_CHECK=1, sends this rank's frame marked with `error` around the ring the others
    run the call on (`members`; default: `info`'s ring for kinds 3-4, "auto"'s otherwise), so that they
    raise RuntimeError at once; the caller then raises its own exception."""
    if not _config.check_enabled(True) or info.size <= 1:
        return
    if members is None:
        members = info.members if int(kind) in _HALF_NAMES else _ring_members(info, "auto")
    comm = communicator(info, device)
    try:
        _native().cuda_refuse(comm, int(kind), int(error), 0, info.name, _members(info, members))
    except RuntimeError:
        pass  # every rank sees the refusal; ours is reported by the caller's own exception


def abort_all() -> None:
    """Aborts every ringreduce NCCL communicator of this process (idempotent). Called at exit."""
    global _shut_down
    with _lock:
        _shut_down = True
        entries = list(_comms.values())
        _comms.clear()
    for _, _, comm in entries:
        comm.abort("interpreter exit", at_exit=True)


def release_group(group: dist.ProcessGroup) -> None:
    """Aborts and forgets the communicators of `group` (e.g. before dist.destroy_process_group)."""
    with _lock:
        entry = _comms.pop(id(group), None)
        _creating.pop(id(group), None)
        _interrupted.pop(id(group), None)
    if entry is not None:
        entry[2].abort("the process group was released")


def check_enabled() -> bool:
    """Whether calls exchange agreement frames (RINGREDUCE_CHECK; off by default on GPUs)."""
    return _config.check_enabled(True)


def ring_parameters() -> str:
    """The GPU pipeline rule's overrides that are set (csrc/cuda/gpu_pipeline.h), for a DETAIL log line."""
    segment, slots = _config.segment_bytes(0), _config.num_slots()
    lanes, one_shot = _config.lanes(), _config.one_shot_bytes()
    return " ".join((
        f"segment_bytes<={segment}" if segment else "segment_bytes=gpu rule",  # a set value caps the rule's
        f"slots={slots} per lane" if slots else "slots=gpu rule",
        f"lanes<={lanes}" if lanes else "lanes=gpu rule",  # the communicator's lanes bound it too
        f"one_shot_bytes={one_shot}" if one_shot >= 0 else "one_shot_bytes=gpu rule",
    ))


def option_refusal(algorithm: str, gather: str) -> BaseException | None:
    """What of a 16-bit wire's options the GPU path cannot run (`gather`: the all-gather's width setting)."""
    if algorithm == "hierarchical":
        return ValueError(
            "ringreduce: on GPUs wire_dtype runs on the flat ring; use algorithm=\"auto\" or \"ring\" with it"
        )
    if gather == "16":
        return ValueError(
            "ringreduce: a 16-bit all-gather (RINGREDUCE_WIRE_GATHER=16, or BackendOptions(wire_gather=16)) "
            "runs on CPU rings only; on GPUs the all-gather of a 16-bit wire moves float32: unset it or set 32"
        )
    return None


def all_reduce(call: Any) -> tuple[Any, Work | None]:
    """Runs a checked all-reduce (`call`: ringreduce._call.Call); (native handle or None, Work or None)."""
    name = f"ringreduce.{KIND_NAMES[call.kind]}"
    with torch.profiler.record_function(name), torch.cuda.nvtx.range(name):
        work = cuda_all_reduce(
            call.tensor, call.rop, call.info, call.async_op, call.accum, int(call.kind), local_size=call.local_size,
            members=call.members, one_shot=call.one_shot, wire=call.wire, predivide=call.factor,
            extra_divisor=call.extra_divisor,
        )
    return getattr(work, "_handle", None), work


def ring_half(info: GroupInfo, tensor: torch.Tensor, output: torch.Tensor, rop: Any, kind: Any,
              async_op: bool) -> tuple[Any, Work | None]:
    """cuda_ring_half as the backend interface has it: (native handle or None, Work or None)."""
    work = cuda_ring_half(tensor, output, rop, info, async_op, int(kind))
    return getattr(work, "_handle", None), work


def refuse(info: GroupInfo, kind: Any, code: Any, algorithms: list[str], device: torch.device | None) -> list[int]:
    """One refusal frame around each ring the others run the call on (ordered node by node); the GPU
    path numbers no call for it."""
    assert device is not None
    for algo in algorithms:
        members = _ring_members(info, algo if algo in ALGORITHMS else "auto")
        cuda_refuse(info, device, int(kind), int(code), members=members)
    return []


atexit.register(abort_all)
