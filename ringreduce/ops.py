"""The collectives: all_reduce, all_reduce_avg and ReduceOp."""

from __future__ import annotations

import contextlib
import enum
import logging
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from ringreduce import _config
from ringreduce._groups import GroupInfo, node_layout, resolve
from ringreduce._native import C
from ringreduce.work import Work

# Call kinds and local-refusal codes of the agreement frame (csrc/core/frame.h).
KIND_ALL_REDUCE = 0
KIND_ALL_REDUCE_AVG = 1
KIND_ALL_REDUCE_COALESCED = 2
KIND_REDUCE_SCATTER = 3
KIND_ALL_GATHER = 4

_ERR_UNSUPPORTED = 1
_ERR_NOT_A_TENSOR = 2
_ERR_SPARSE = 3
_ERR_DEVICE = 4
_ERR_OTHER = 5

ALGORITHMS = ("auto", "ring", "hierarchical")
_KIND_NAMES = {
    KIND_ALL_REDUCE: "all_reduce",
    KIND_ALL_REDUCE_AVG: "all_reduce_avg",
    KIND_ALL_REDUCE_COALESCED: "all_reduce_coalesced",
    KIND_REDUCE_SCATTER: "reduce_scatter",
    KIND_ALL_GATHER: "all_gather",
}

logger = logging.getLogger("ringreduce")


def _debug_level() -> int:
    """RINGREDUCE_DEBUG=INFO logs every call; DETAIL adds the ring's parameters. 0 when unset."""
    raw = (_config._env("RINGREDUCE_DEBUG") or "").upper()
    if raw in ("", "0", "OFF", "WARN", "WARNING"):
        return 0
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[ringreduce %(process)d] %(message)s"))
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    return 2 if raw == "DETAIL" else 1


def _log_call(info: GroupInfo, handle: Any, tensor: torch.Tensor, op: ReduceOp, kind: int, level: int,
              async_op: bool, accum: bool, seconds: float | None, local_size: int = 0) -> None:
    algo = f"hierarchical(local_size={local_size})" if local_size else "ring"
    msg = (
        f"rank {info.rank}/{info.size} {info.name} call #{handle.seq} {_KIND_NAMES.get(kind, kind)} "
        f"op={op.name} dtype={str(tensor.dtype).replace('torch.', '')} numel={tensor.numel()} "
        f"algorithm={algo} device={tensor.device.type}{' accum=float32' if accum else ''}"
    )
    msg += " async (submitted)" if seconds is None else f" time={seconds * 1e6:.0f}us"
    if level >= 2:
        msg += (
            f" segment_bytes={_config.segment_bytes()} slots={_config.num_slots() or 'auto'} "
            f"check={_config.check_enabled(tensor.is_cuda)} contiguous={tensor.is_contiguous()}"
        )
    logger.info(msg)


class ReduceOp(enum.IntEnum):
    """Reduction operators. Functions also accept "sum"/"avg"/... and torch.distributed.ReduceOp."""

    SUM = 0
    AVG = 1
    MAX = 2
    MIN = 3
    PRODUCT = 4


_DIST_OPS = {
    dist.ReduceOp.SUM: ReduceOp.SUM,
    dist.ReduceOp.AVG: ReduceOp.AVG,
    dist.ReduceOp.MAX: ReduceOp.MAX,
    dist.ReduceOp.MIN: ReduceOp.MIN,
    dist.ReduceOp.PRODUCT: ReduceOp.PRODUCT,
}


def to_reduce_op(op: Any) -> ReduceOp:
    """Normalizes `op`; raises ValueError for unknown operators (BAND, PREMUL_SUM, ...)."""
    if isinstance(op, ReduceOp):
        return op
    if isinstance(op, str):
        try:
            return ReduceOp[op.strip().upper()]
        except KeyError:
            pass
    else:
        for dist_op, ours in _DIST_OPS.items():
            try:
                if op == dist_op:
                    return ours
            except Exception:  # noqa: BLE001 - foreign comparison
                continue
        if isinstance(op, int) and not isinstance(op, bool) and 0 <= op < len(ReduceOp):
            return ReduceOp(op)
    raise ValueError(
        f"ringreduce: unsupported reduce op {op!r}; use one of SUM, AVG, MAX, MIN, PRODUCT "
        "(ringreduce.ReduceOp, a string, or torch.distributed.ReduceOp)"
    )


def _local_refusal(
    tensor: Any, op: Any, accum_dtype: torch.dtype | None, algorithm: str
) -> tuple[int, BaseException | None, ReduceOp | None, bool]:
    """(frame error code, exception to raise, op, accum_float32) from purely local checks."""
    if not isinstance(tensor, torch.Tensor):
        return _ERR_NOT_A_TENSOR, TypeError(
            f"ringreduce: expected a torch.Tensor, got {type(tensor).__name__}"
        ), None, False
    try:
        rop = to_reduce_op(op)
    except ValueError as exc:
        return _ERR_UNSUPPORTED, exc, None, False
    if algorithm not in ALGORITHMS:
        return _ERR_OTHER, ValueError(
            f"ringreduce: algorithm must be one of {ALGORITHMS}, got {algorithm!r}"
        ), rop, False
    if getattr(type(tensor), "__torch_dispatch__", None) is not torch.Tensor.__torch_dispatch__:
        # Wrapper subclasses (DTensor is unwrapped before, FakeTensor, functional tensors...) may have
        # no storage of their own: never hand them to the transport.
        return _ERR_OTHER, ValueError(
            f"ringreduce: tensor subclass {type(tensor).__name__} is not supported; pass a plain tensor "
            "(e.g. its local shard or .to_local())"
        ), rop, False
    if tensor.is_sparse or tensor.layout != torch.strided:
        return _ERR_SPARSE, ValueError(
            f"ringreduce: only dense (strided) tensors are supported, got layout {tensor.layout}; "
            "call .to_dense() first"
        ), rop, False
    if tensor.device.type not in ("cpu", "cuda"):
        return _ERR_DEVICE, ValueError(
            f"ringreduce: tensors on {tensor.device.type} are not supported; use CPU or CUDA tensors"
        ), rop, False
    if tensor.is_cuda and not C.native_info["cuda"]:
        return _ERR_DEVICE, RuntimeError(
            "ringreduce: got a CUDA tensor, but this ringreduce build has no CUDA support. Reinstall it "
            "where a CUDA toolkit is found (set CUDA_HOME) with a CUDA build of torch, or reduce a CPU tensor"
        ), rop, False
    try:
        code = C.dtype_code(tensor.dtype)
    except TypeError:
        return _ERR_UNSUPPORTED, TypeError(
            f"ringreduce: dtype {str(tensor.dtype).replace('torch.', '')} is not supported (op {rop.name}); "
            "supported: float32, float64, float16, bfloat16, int8, int16, int32, int64, uint8, bool, "
            "complex64, complex128 - convert the tensor first"
        ), rop, False
    why = C.unsupported_reason(code, int(rop))
    if why is not None:
        return _ERR_UNSUPPORTED, TypeError(
            f"ringreduce: op {rop.name} is not supported for dtype {str(tensor.dtype).replace('torch.', '')}: {why}"
        ), rop, False
    accum = False
    if accum_dtype is not None and accum_dtype != tensor.dtype:
        if accum_dtype == torch.float32 and tensor.dtype in (torch.float16, torch.bfloat16):
            accum = True
        else:
            return _ERR_UNSUPPORTED, TypeError(
                f"ringreduce: accum_dtype={accum_dtype} is not supported for {tensor.dtype} tensors; "
                "accum_dtype=torch.float32 applies to float16/bfloat16 (partial sums then travel in float32)"
            ), rop, False
    return 0, None, rop, accum


def _submit_cpu(
    info: GroupInfo,
    tensor: torch.Tensor | None,
    op: ReduceOp,
    accum: bool,
    kind: int,
    local_error: int,
    ntensors: int,
    check: bool,
    run_inline: bool = False,
    *,
    members: tuple[int, ...] | None = None,
    output: torch.Tensor | None = None,
    local_size: int = 0,
    phases: int = 3,
    owner_shift: int = 0,
    exact_chunks: bool = False,
    node_order: tuple[int, ...] = (),
) -> Any:
    """Submits one CPU call; with run_inline a call with nothing queued before it runs right here.

    members: the ring's ranks in info.pg (default info.members); local_size > 0: hierarchical, with
    node_order the ring's ranks node by node (empty: the ring's own order); phases/owner_shift/
    exact_chunks: reduce_scatter and all_gather.
    """
    return C.submit_cpu(
        info.pg,
        info.name,
        tensor,
        int(op),
        accum,
        kind,
        local_error,
        ntensors,
        check,
        _config.segment_bytes(),
        _config.num_slots(),
        _config.timeout_ms(),
        run_inline,
        list(info.members if members is None else members),
        output,
        local_size,
        phases,
        owner_shift,
        exact_chunks,
        list(node_order),
        _config.recv_only_waits(),
    )


def _refuse(
    info: GroupInfo | None, kind: int, code: int, exc: BaseException, tensor: Any, algorithm: str = "ring"
) -> None:
    """Tells the other ranks (agreement frame marked as an error) before raising locally."""
    is_cuda = isinstance(tensor, torch.Tensor) and tensor.is_cuda
    if info is not None and info.size > 1 and _config.check_enabled(is_cuda):
        if is_cuda and C.native_info["cuda"]:
            from ringreduce import _cuda

            # GPU: the frame goes around the ring the other ranks run this call on (the
            # hierarchical call's rank list is ordered node by node)
            try:
                _, members = choose_algorithm(info, algorithm if algorithm in ALGORITHMS else "auto")
            except ValueError:
                members = info.members
            _cuda.cuda_refuse(info, tensor.device, kind, code, members=members)
        elif not is_cuda:
            # CPU: every call of a ring (hierarchical ones too) runs on the ring's own runtime
            handle = _submit_cpu(info, None, ReduceOp.SUM, False, kind, code, 1, True, run_inline=True)
            handle.wait(-1)  # the others raise "rank r refused"; we raise our own, clearer error
            exc.args = (f"{exc.args[0]} (call #{handle.seq} on {info.name}; the other ranks were told)",)
    raise exc


def choose_algorithm(info: GroupInfo, algorithm: str) -> tuple[int, tuple[int, ...]]:
    """(local_size, members) of a call: local_size 0 is the flat ring over info.members; L > 0 the
    hierarchical all-reduce over `members` ordered node by node, L ranks per node.

    "auto" picks hierarchical when the ring spans several nodes with the same number of its ranks on
    each and more than one per node; "hierarchical" on one node (or one rank per node) is the flat
    ring, since the node ring (or the cross-node ring) would be the whole ring.
    """
    if algorithm == "ring" or info.size <= 2:
        return 0, info.members
    layout = node_layout(info)
    if algorithm == "hierarchical" and not layout.uniform:
        raise ValueError(
            f"ringreduce: algorithm='hierarchical' needs the same number of ranks of {info.name} on every "
            f"node, got node ids {list(layout.node_of_member)} (from GROUP_RANK/LOCAL_WORLD_SIZE or "
            "RINGREDUCE_LOCAL_SIZE); use algorithm='ring' or 'auto'"
        )
    if layout.uniform and layout.nodes > 1 and layout.local_size > 1:
        return layout.local_size, layout.members
    return 0, info.members


def local_tensor(tensor: Any) -> Any:
    """A DTensor's local shard (a collective reduces it in place; placements stay as they are).

    Anything else is returned as is. No DTensor can exist before torch.distributed.tensor is imported,
    so plain tensors cost one dictionary lookup.
    """
    module = sys.modules.get("torch.distributed.tensor")
    dtensor = getattr(module, "DTensor", None) if module is not None else None
    if dtensor is not None and isinstance(tensor, dtensor):
        return tensor._local_tensor
    return tensor


def _run(
    tensor: Any,
    op: Any,
    group: dist.ProcessGroup | None,
    async_op: bool,
    accum_dtype: torch.dtype | None,
    algorithm: str,
    kind: int,
    ntensors: int = 1,
) -> Work | None:
    tensor = local_tensor(tensor)
    info = resolve(group)
    code, exc, rop, accum = _local_refusal(tensor, op, accum_dtype, algorithm)
    if exc is not None:
        if info is None:
            raise exc
        _refuse(info, kind, code, exc, tensor, algorithm)
    assert rop is not None
    if info is None or tensor.numel() == 0 or info.size == 1:
        return Work.completed([tensor]) if async_op else None
    local_size, members = choose_algorithm(info, algorithm)
    if tensor.is_cuda:
        from ringreduce import _cuda

        name = f"ringreduce.{_KIND_NAMES.get(kind, 'call')}"
        with torch.profiler.record_function(name), torch.cuda.nvtx.range(name):
            return _cuda.cuda_all_reduce(
                tensor, rop, info, async_op, accum, kind, local_size=local_size, members=members
            )
    check = _config.check_enabled(False)
    level = _debug_level()
    start = time.perf_counter()
    # The profiler range only when a profiler listens: entering one costs ~10 us per call otherwise.
    scope = (torch.profiler.record_function(f"ringreduce.{_KIND_NAMES.get(kind, 'call')}")
             if torch.autograd._profiler_enabled() else contextlib.nullcontext())
    work = None
    with scope:
        handle = _submit_cpu(
            info, tensor, rop, accum, kind, 0, ntensors, check, run_inline=not async_op and _config.run_inline(),
            local_size=local_size, node_order=members if local_size else (),
        )
        if async_op:
            work = Work(handle, [tensor], describe=f"{_KIND_NAMES.get(kind, 'call')} {rop.name} on {info.name}")
        else:
            handle.wait(-1)
            if not handle.ok():
                handle.raise_error()
    if level:
        _log_call(info, handle, tensor, rop, kind, level, async_op, accum,
                  None if async_op else time.perf_counter() - start, local_size)
    return work


def all_reduce(
    tensor: torch.Tensor,
    op: Any = ReduceOp.SUM,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
    accum_dtype: torch.dtype | None = None,
    algorithm: str = "auto",
) -> Work | None:
    """Reduces `tensor` across the ranks of `group` in place with ringreduce's ring.

    Every rank ends with bitwise-identical values. `op` is SUM, AVG, MAX, MIN or PRODUCT (also as a
    string or torch.distributed.ReduceOp). AVG divides the fully reduced sum once by the world size
    (float32 for half types, float64 for float64/complex128), so it equals all_reduce(SUM) then
    div_(world_size). Half-type partial sums are rounded at every hop unless
    ``accum_dtype=torch.float32``, which carries them in float32 (1.5x the bytes) and rounds once;
    note that fp16 sums can overflow (65504) where a pre-divided average would not: use
    accum_dtype for such data.

    Any strides, views, transposed or channels_last tensors work (matched by logical index; memory
    outside the tensor's elements is untouched). With ``async_op=True`` returns a :class:`Work` at
    once (CPU: the ring runs on the group's worker thread; CUDA: on ringreduce's streams, ordered
    after the current stream). Raises TypeError for non-tensors and unsupported dtype/op pairs
    (integer AVG included, before any data moves), ValueError for sparse tensors and bad
    arguments, RuntimeError when ranks disagree (every rank raises, naming what differs) and
    torch.distributed.DistBackendError when a peer dies or the group's timeout
    (RINGREDUCE_TIMEOUT) passes. A rank outside `group` returns at once. A DTensor is reduced
    through its local shard, in place (its placements are not changed).
    """
    return _run(tensor, op, group, async_op, accum_dtype, algorithm, KIND_ALL_REDUCE)


def all_reduce_avg(
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
    accum_dtype: torch.dtype | None = None,
    algorithm: str = "auto",
) -> Work | None:
    """Averages `tensor` across `group` in place: ``all_reduce(tensor, op=ReduceOp.AVG, ...)``.

    The drop-in for ``dist.all_reduce(t); t /= world_size``. Integer and bool tensors raise
    TypeError before any payload moves, leaving the tensor unchanged.
    """
    return _run(tensor, ReduceOp.AVG, group, async_op, accum_dtype, algorithm, KIND_ALL_REDUCE_AVG)
