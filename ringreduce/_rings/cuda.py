"""CudaRing: the calls of CUDA tensors over ringreduce's own NCCL communicator, one per process group
and device, and its rendezvous through the group's store (its ordering rules beside stock NCCL
communicators: docs/design.md section 2.4).
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
from ringreduce._interrupt import interrupt_reason
from ringreduce._options import ALGORITHMS, native_options
from ringreduce._rings.agree import poll_until, read_knobs, store_timeout_s
from ringreduce._types import KIND_NAMES, CallKind
from ringreduce.work import Work

_UID_KEY = "ringreduce/nccl_uid/{group}/{generation}"
_COUNTER_KEY = "ringreduce/nccl_generation/{group}"

_lock = threading.Lock()  # guards the dicts below; never held while waiting for other ranks
# id(process group) -> (process group, device index, native _C.CudaRing: the communicator). One device per group and process
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
    limit_s = store_timeout_s(store, 300.0)  # without one: torch's default
    if not poll_until(store, [key], time.monotonic() + limit_s):
        raise dist.DistStoreError(
            f"ringreduce: {what} within {limit_s:.0f} s (the store's timeout, key {key}): every rank of the "
            "group must make the group's first CUDA call (or init_communicator) together"
        )


def communicator(info: GroupInfo, device: torch.device, knobs: _config.Knobs | None = None) -> Any:
    """The NCCL communicator of `info`'s process group on `device`, created on first use (with the
    lanes and timeout of `knobs`, default: the environment's now), collectively over every rank of
    ``info.pg`` (a ring over a rank list of the group uses it too).

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
        knobs = knobs if knobs is not None else _config.read()
        # The group's ranks, not the ring's indices (info.rank/info.size describe the ring).
        if info.global_ranks:  # a "ringreduce" group's inner group: in no torch.distributed table
            pg_rank, pg_size = info.pg.rank(), info.pg.size()
        else:
            pg_rank, pg_size = dist.get_rank(info.pg), dist.get_world_size(info.pg)
        store = info.store
        try:
            ids, generation = _rendezvous_uids(C, info.pg, pg_rank, pg_size,
                                               knobs.lanes or _config.DEFAULT_LANES, store)
            label = info.name if not info.members else f"process group of {info.name}"
            timeout_ms = knobs.timeout_ms
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
                max(timeout_ms, int(store_timeout_s(store, 0.0) * 1000)),
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


_HALF_KINDS = (CallKind.REDUCE_SCATTER, CallKind.ALL_GATHER)


class CudaRing:
    """The ring of one process group and rank list for CUDA tensors (ringreduce/_rings/__init__.py has
    the interface): its calls run on the group's NCCL communicator (``communicator``), created at the
    group's first CUDA call, collectively over every rank of the group."""

    ENQUEUES = True  # a synchronous call returns once its work is ordered on the current stream
    WIRE_RING = "ring"  # a 16-bit wire runs on the flat ring
    PLANS = False
    agreed: bool = False  # the ranks' agreement on the knobs, as the CPU ring's (agree.read_knobs)
    pending: Any = None
    interrupted: str | None = None

    def __init__(self, info: GroupInfo) -> None:
        self.pg, self.members, self.name = info.pg, info.members, info.name
        # read now; ring_for reads them again at the first call, where the ranks agree on them (epoch -1)
        self.knobs, self.epoch = _config.read(), -1

    def reload(self, info: GroupInfo | None = None, blocking: bool = True) -> None:
        """Reads the knobs (Note [Knobs are read when a ring is made]); with the ring's `info` (ring_for)
        at its first call its ranks agree on them first, as the CPU ring's do (agree.read_knobs; on GPUs
        the pipeline's knobs too), waiting at least the store's timeout, as the communicator's rendezvous
        does, whether or not the call is `blocking` (the rendezvous waits for every rank anyway)."""
        read_knobs(self, info, "cuda", True, store_timeout=True)

    def check_enabled(self) -> bool:
        """Whether calls exchange agreement frames (RINGREDUCE_CHECK; off by default on GPUs)."""
        return self.knobs.check_enabled(True)

    def ring_parameters(self) -> str:
        """The GPU pipeline rule's overrides that are set (csrc/cuda/gpu_pipeline.h), for a DETAIL log line."""
        k = self.knobs
        return " ".join((
            f"segment_bytes<={k.segment_bytes}" if k.segment_bytes else "segment_bytes=gpu rule",  # a cap on the rule's
            f"slots={k.num_slots} per lane" if k.num_slots else "slots=gpu rule",
            f"lanes<={k.lanes}" if k.lanes else "lanes=gpu rule",  # the communicator's lanes bound it too
            f"one_shot_bytes={k.one_shot_bytes}" if k.one_shot_bytes >= 0 else "one_shot_bytes=gpu rule",
        ))

    def option_refusal(self, algorithm: str, gather: str) -> BaseException | None:
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

    def options(self, call: Any) -> Any:
        """The native CallOptions of `call` on this ring."""
        return native_options(call, self.knobs, True)

    def all_reduce(self, call: Any, tensor: torch.Tensor, options: Any, async_op: bool) -> tuple[Any, Work | None]:
        """All-reduce of a CUDA tensor in place, after ringreduce/_call.py's checks, on the ring's members
        (``call.members``; ordered node by node for the hierarchical all-reduce, ``call.local_size`` > 1);
        (native handle or None, Work when `async_op`). Raises DistBackendError on NCCL failures and timeouts."""
        name = f"ringreduce.{KIND_NAMES[call.kind]}"
        with torch.profiler.record_function(name), torch.cuda.nvtx.range(name):
            comm = communicator(call.info, tensor.device, self.knobs)
            _check_on_comm(tensor, comm, "tensor")
            handle = _native().cuda_all_reduce(comm, tensor, options, bool(async_op), call.info.name,
                                               [int(m) for m in call.members])
            algo = " direct" if call.direct else f" hierarchical(local_size={call.local_size})" if call.local_size > 1 else ""
            return handle, _work(handle, tensor, f"all_reduce {call.rop.name}{algo}", comm, call.info, async_op)

    def ring_half(self, call: Any, tensor: torch.Tensor, output: torch.Tensor,
                  async_op: bool) -> tuple[Any, Work | None]:
        """reduce_scatter (`output` gets block r of `tensor` reduced with the call's op) or all_gather
        (the contiguous `output` gets every rank's `tensor` in ring order) over the ring."""
        if call.kind not in _HALF_KINDS:
            raise ValueError(f"ringreduce: ring_half runs reduce_scatter or all_gather, got {call.kind}")
        comm = communicator(call.info, tensor.device, self.knobs)
        _check_on_comm(tensor, comm, "input")
        _check_on_comm(output, comm, "output")
        if tensor.dtype != output.dtype:
            raise TypeError(f"ringreduce: output ({output.dtype}) and input ({tensor.dtype}) must have one dtype")
        if call.kind == CallKind.ALL_GATHER and not (output.is_contiguous() and not output.is_conj()
                                                     and not output.is_neg()):
            raise ValueError("ringreduce.all_gather: the output must be a plain contiguous tensor")
        handle = _native().cuda_ring_half(comm, tensor, output, self.options(call), bool(async_op), call.info.name,
                                          [int(m) for m in call.info.members])
        name = KIND_NAMES[call.kind]
        what = f"{name} {call.rop.name}" if call.kind == CallKind.REDUCE_SCATTER else name
        return handle, _work(handle, output, what, comm, call.info, async_op)

    def refuse(self, call: Any, algorithms: list[str]) -> list[int]:
        """With RINGREDUCE_CHECK=1, one refusal frame (`call`: its kind and local error) around each ring
        the others run the call on (ordered node by node), so that they raise RuntimeError at once; the
        GPU path numbers no call for it."""
        info = call.info
        if not self.check_enabled() or info.size <= 1:
            return []
        comm = communicator(info, torch.device("cuda", torch.cuda.current_device()) if call.device is None
                            else call.device, self.knobs)
        for algo in algorithms:
            members = info.members if call.kind in _HALF_KINDS else _ring_members(info, algo, self.knobs)
            try:
                _native().cuda_refuse(comm, int(call.kind), int(call.local_error), 0, info.name,
                                      [int(m) for m in members])
            except RuntimeError:
                pass  # every rank sees the refusal; ours is reported by the caller's own exception
        return []


def _work(handle: Any, result: torch.Tensor, what: str, comm: Any, info: GroupInfo, async_op: bool) -> Work | None:
    """The Work of an async call (None for a synchronous one). Ctrl-C in its timed wait aborts this
    rank's communicator of the group (Note [Ctrl-C], ringreduce/_interrupt.py)."""
    if not async_op:
        return None
    if handle is None:
        return Work.completed([result])
    return Work(handle, [result], describe=f"{what} on {info.name} (cuda:{result.device.index})",
                on_interrupt=lambda: comm.abort(interrupt_reason(info.name, handle.seq)), stream_wait=True)


def _ring_members(info: GroupInfo, algorithm: str, knobs: Any) -> tuple[int, ...]:
    """The ring an all-reduce with `algorithm` runs on (the flat ring's where the layout refuses it)."""
    try:
        return choose_algorithm(info, algorithm if algorithm in ALGORITHMS else "auto", knobs)[1]
    except ValueError:
        return info.members


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


atexit.register(abort_all)
