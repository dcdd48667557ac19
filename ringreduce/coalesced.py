"""all_reduce_coalesced: one ring for a list of tensors (flattened into one buffer per dtype)."""

from __future__ import annotations

import datetime
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ringreduce._call import local_refusal, local_tensor, refuse, run_all_reduce_with, scaling_refusal
from ringreduce._groups import resolve
from ringreduce._options import AllreduceOptions
from ringreduce._types import CallKind, FrameError, ReduceOp
from ringreduce.work import Work, Works


def copy_blocks(flat: torch.Tensor, blocks: Sequence[torch.Tensor]) -> None:
    """Copies the consecutive pieces of the flat `flat` into `blocks` (each of its own numel and shape)."""
    for block, piece in zip(blocks, flat.split([b.numel() for b in blocks]), strict=True):
        block.copy_(piece.view(block.shape))


class _FlatGroup:
    """Tensors of one dtype packed into one flat buffer, or reduced directly when `alone` (the call's
    only buffer) and one dense tensor. With several buffers every one is packed, so that a later
    buffer's error leaves every tensor unchanged (nothing is copied back)."""

    def __init__(self, tensors: list[torch.Tensor], alone: bool) -> None:
        self.tensors = tensors
        single = tensors[0]
        if alone and len(tensors) == 1 and single.is_contiguous() and not single.is_conj() and not single.is_neg():
            self.flat = single
            self.packed = False
            return
        total = sum(t.numel() for t in tensors)
        self.flat = torch.empty(total, dtype=single.dtype, device=single.device)
        self.packed = True
        offset = 0
        with torch.no_grad():
            for t in tensors:
                n = t.numel()
                self.flat[offset : offset + n].view(t.shape).copy_(t)
                offset += n

    def copy_back(self) -> None:
        if not self.packed:
            return
        with torch.no_grad():
            copy_blocks(self.flat, self.tensors)


class CoalescedWork(Works, Work):
    """Work of ``all_reduce_coalesced``: waits for every dtype's ring, then copies the results back
    (``get_future()``'s value: the list of input tensors, after the copy)."""

    def __init__(self, works: list[Work], groups: list[_FlatGroup], tensors: list[torch.Tensor], describe: str):
        super().__init__(None, list(tensors), describe=describe)

        def copy_back() -> None:
            for g in groups:
                g.copy_back()

        self._hold(works, self._result, copy_back)

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        if timeout is not None and not isinstance(timeout, datetime.timedelta):
            raise TypeError(f"timeout must be a datetime.timedelta or None, got {type(timeout).__name__}")
        deadline = None if timeout is None else time.monotonic() + timeout.total_seconds()
        for w in self._works:
            left = None if deadline is None else datetime.timedelta(seconds=max(0.0, deadline - time.monotonic()))
            w.wait(left)
        self._run_finish()
        return True

    def get_future(self) -> torch.futures.Future:
        return self._future_of_all()


def _validate(tensors: Any) -> tuple[list[torch.Tensor] | None, Any, BaseException | None]:
    """(tensor list, frame error code, exception) from purely local checks of the argument."""
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, Sequence):
        return None, FrameError.NOT_A_TENSOR, TypeError(
            "ringreduce.all_reduce_coalesced: expected a list or tuple of tensors, got "
            f"{type(tensors).__name__} (use ringreduce.all_reduce for a single tensor)"
        )
    tensors = [local_tensor(t) for t in tensors]  # DTensors: their local shards, in place
    for k, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            return None, FrameError.NOT_A_TENSOR, TypeError(
                f"ringreduce.all_reduce_coalesced: element {k} is a {type(t).__name__}, not a torch.Tensor"
            )
    if tensors:
        first = tensors[0].device
        for k, t in enumerate(tensors):
            if t.device != first:
                return None, FrameError.DEVICE, ValueError(
                    f"ringreduce.all_reduce_coalesced: all tensors must be on one device; element 0 is on "
                    f"{first} but element {k} is on {t.device}. Call it once per device"
                )
    return tensors, FrameError.NONE, None


# Note [Options of a coalesced list]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Each dtype's buffer takes the options as all_reduce applies them to it (Note [Options of a buffer] in
# _options.py; docs/design.md section 1.1). Every tensor is checked before any ring, and each buffer's
# frame carries its wire and factor, so ranks that disagree raise with no tensor changed; a refusing
# rank sends one refusal frame per ring the others run (_rings).


def _refusal(listed: list[torch.Tensor], options: AllreduceOptions) -> tuple[Any, BaseException | None]:
    """(frame error code, exception) from local checks of every tensor with its buffer's options (Note
    [Options of a coalesced list])."""
    o = options
    if not listed:
        # No tensor: the options alone, as all_reduce checks them (on an empty float32 stand-in).
        probe = torch.empty(0)
        code, exc, rop, _ = local_refusal(probe, o.op, None, o.algorithm)
        if exc is None:
            code, exc, _, _ = scaling_refusal(probe, rop, o.algorithm, o.wire_dtype, o.predivide_factor)
        return code, exc
    rop = None
    for k, t in enumerate(listed):
        b = o.for_buffer(t.dtype)  # what the buffer of t's dtype is reduced with
        code, exc, rop, _ = local_refusal(t, b.op, b.accum_dtype, b.algorithm)
        if exc is None:
            code, exc, _, _ = scaling_refusal(t, rop, b.algorithm, b.wire_dtype, b.predivide_factor)
        if exc is not None:
            return code, type(exc)(f"{exc} (in ringreduce.all_reduce_coalesced, element {k})")
    if o.wire_dtype is not None and not any(t.dtype == torch.float32 for t in listed):
        code, exc, _, _ = scaling_refusal(listed[0], rop, o.algorithm, o.wire_dtype, o.predivide_factor)
        assert exc is not None  # a wire for a tensor that is not float32
        return code, type(exc)(f"{exc} (in ringreduce.all_reduce_coalesced, whose list has no float32 tensor)")
    return FrameError.NONE, None


# The options of recent coalesced calls, so that a repeated call's buffers take their plans (Note [Fast
# path of a repeated call]); an argument that cannot be a key (unhashable) gets options of its own.
_recent_options: dict[tuple[Any, ...], AllreduceOptions] = {}


def _options_of(op: Any, accum_dtype: Any, algorithm: Any, wire_dtype: Any, predivide_factor: Any) -> AllreduceOptions:
    key = (type(op), op, accum_dtype, algorithm, wire_dtype, type(predivide_factor), predivide_factor)
    try:
        options = _recent_options.get(key)
    except TypeError:
        return AllreduceOptions(op, accum_dtype, algorithm, wire_dtype, predivide_factor)
    if options is None:
        if len(_recent_options) >= 64:
            _recent_options.clear()
        options = _recent_options[key] = AllreduceOptions(op, accum_dtype, algorithm, wire_dtype, predivide_factor)
    return options


def _rings(tensors: Any, algorithm: Any, wire_dtype: Any) -> list[Any]:
    """The algorithm of each ring a rank passing the same list runs: one per dtype of its non-empty
    tensors (a 16-bit wire's float32 buffer on the flat ring); at least one for a list that is not
    one or holds a non-tensor (a guess: the others hold a tensor there)."""
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, Sequence):
        return [algorithm]
    elements = [local_tensor(t) for t in tensors]
    dtypes = list(dict.fromkeys(t.dtype for t in elements if isinstance(t, torch.Tensor) and t.numel() > 0))
    rings = ["ring" if wire_dtype is not None and d == torch.float32 else algorithm for d in dtypes]
    if all(isinstance(t, torch.Tensor) for t in elements):
        return rings
    return rings or [algorithm]


def all_reduce_coalesced(
    tensors: Sequence[torch.Tensor],
    op: Any = ReduceOp.SUM,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
    accum_dtype: torch.dtype | None = None,
    algorithm: str = "auto",
    wire_dtype: torch.dtype | None = None,
    predivide_factor: float | None = None,
) -> Work | None:
    """Reduces every tensor of `tensors` in place with one ring per dtype instead of one per tensor.

    The tensors are packed into one flat buffer per dtype (in order of first appearance), each
    buffer is all-reduced as :func:`all_reduce` reduces a tensor, with `op` and the options below,
    and the results are copied back once every buffer is reduced (one extra copy each way; none
    for a list of one contiguous tensor, empty tensors aside): a tensor gets the bits of its
    elements in ``all_reduce`` of its dtype's packed buffer, and a call refused or disagreed on
    leaves every tensor unchanged. Every rank must pass the same list (same dtypes, shapes and order) and the
    same options: the agreement frame describes the call as coalesced with its number of tensors,
    and each buffer's frame its wire and factor, so a mismatch raises on every rank.

    Args:
        tensors: a list or tuple of tensors, any shapes, strides and dtypes, all on one device
            (CPU or CUDA); DTensors through their local shards.
        op: SUM (default), AVG, MAX, MIN or PRODUCT; also a string or
            ``torch.distributed.ReduceOp``.
        group: None (the default process group), a ``ProcessGroup`` or a ``DeviceMesh``. A rank
            outside the group returns at once.
        async_op: True returns a :class:`Work` at once; its ``wait()`` copies the results back into
            `tensors`, and its future's value is the list of tensors.
        accum_dtype: None, or ``torch.float32``: the float16/bfloat16 tensors' partial sums travel
            and are added in float32 and are rounded once, as in :func:`all_reduce`; tensors of
            other dtypes are reduced as they are. Any other value is checked for every tensor as
            :func:`all_reduce` checks it.
        algorithm: "auto" (default), "ring" or "hierarchical", for every dtype's ring, as in
            :func:`all_reduce`.
        wire_dtype: None, or ``torch.bfloat16`` / ``torch.float16``: the float32 tensors travel on
            a 16-bit wire with float32 sums per hop, as in :func:`all_reduce`;
            tensors of other dtypes are reduced as they are, as ``GradientAverager(wire_dtype=...)``
            treats buckets of other dtypes. A non-empty list without a float32 tensor is refused as
            :func:`all_reduce` refuses its first tensor.
        predivide_factor: None, or f > 0 (SUM and AVG): every buffer's contributions are divided
            by f before its ring and its finished sum scaled once after it, as in
            :func:`all_reduce`; every tensor must then be floating-point or complex.

    Returns:
        None, or with ``async_op=True`` a :class:`Work`.

    Raises:
        TypeError: not a list, an element that is not a tensor, a dtype that does not support
            `op` (integer AVG included), `accum_dtype` or `predivide_factor` (an integer tensor),
            a `wire_dtype` for a list without float32 tensors whose first tensor is an integer
            one, or a `wire_dtype` or `predivide_factor` that is not a dtype or a number; checked
            for every tensor before any data moves, the tensors unchanged; the other ranks raise
            RuntimeError naming the refusing rank.
        ValueError: tensors on different devices, sparse tensors, an unknown `op` or `algorithm`,
            a `wire_dtype` other than bfloat16/float16, a 16-bit wire for a list with no float32
            tensor or with "hierarchical", a `predivide_factor` <= 0, or either of them with MAX,
            MIN or PRODUCT; every rank raises alike.
        RuntimeError: the ranks disagree on the list or on the options (every rank raises).
        torch.distributed.DistBackendError: a peer died or the group's timeout passed.

    CUDA tensors run on ringreduce's streams, ordered after the current stream, which waits for
    the results (the host does not block), as in :func:`all_reduce`.
    """
    info = resolve(group)
    options = _options_of(op, accum_dtype, algorithm, wire_dtype, predivide_factor)
    listed, code, exc = _validate(tensors)
    if exc is None:
        assert listed is not None
        code, exc = _refusal(listed, options)
    if exc is not None:
        # The device the other ranks run this call on: the list's (CPU for a list that is not one).
        device = listed[0].device if listed else None
        refuse(info, CallKind.ALL_REDUCE_COALESCED, code, exc, device, _rings(tensors, algorithm, wire_dtype))
    assert listed is not None
    live = [t for t in listed if t.numel() > 0]
    if info is None or info.size == 1 or not live:
        return Work.completed(listed) if async_op else None
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in live:
        by_dtype.setdefault(t.dtype, []).append(t)
    groups = [_FlatGroup(ts, alone=len(by_dtype) == 1) for ts in by_dtype.values()]
    works: list[Work] = []
    for g in groups:
        w = run_all_reduce_with(g.flat, group, options.for_buffer(g.flat.dtype), True,
                                CallKind.ALL_REDUCE_COALESCED, ntensors=len(listed))
        assert w is not None
        works.append(w)
    work = CoalescedWork(works, groups, listed, describe=f"all_reduce_coalesced of {len(listed)} tensors on {info.name}")
    if async_op:
        return work
    work.wait()
    return None
