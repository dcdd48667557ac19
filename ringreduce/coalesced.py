"""all_reduce_coalesced: one ring for a list of tensors (flattened into one buffer per dtype)."""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ringreduce._dispatch import local_refusal, local_tensor, refuse, run_all_reduce
from ringreduce._groups import resolve
from ringreduce._types import CallKind, FrameError, ReduceOp
from ringreduce.work import Work


class _FlatGroup:
    """Tensors of one dtype packed into one flat buffer (or reduced directly when alone and dense)."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.tensors = tensors
        single = tensors[0]
        if len(tensors) == 1 and single.is_contiguous() and not single.is_conj() and not single.is_neg():
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
        offset = 0
        with torch.no_grad():
            for t in self.tensors:
                n = t.numel()
                t.copy_(self.flat[offset : offset + n].view(t.shape))
                offset += n


class CoalescedWork(Work):
    """Work of ``all_reduce_coalesced``: waits for every dtype's ring, then copies results back.

    ``wait()`` returns True once every input tensor holds its result; ``get_future()`` resolves to
    the list of input tensors (after the copy back), completed by ringreduce's worker thread.
    """

    def __init__(self, works: list[Work], groups: list[_FlatGroup], tensors: list[torch.Tensor], describe: str):
        super().__init__(None, list(tensors), describe=describe)
        self._works = works
        self._groups = groups
        self._copied = False
        self._copy_lock = threading.Lock()
        self._all_future: torch.futures.Future | None = None

    def _copy_back_once(self) -> None:
        with self._copy_lock:
            if not self._copied:
                for g in self._groups:
                    g.copy_back()
                self._copied = True

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        if timeout is not None and not isinstance(timeout, datetime.timedelta):
            raise TypeError(f"timeout must be a datetime.timedelta or None, got {type(timeout).__name__}")
        deadline = None if timeout is None else time.monotonic() + timeout.total_seconds()
        for w in self._works:
            left = None if deadline is None else datetime.timedelta(seconds=max(0.0, deadline - time.monotonic()))
            w.wait(left)
        self._copy_back_once()
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)

    def is_success(self) -> bool:
        return all(w.is_success() for w in self._works)

    def exception(self) -> BaseException | None:
        for w in self._works:
            exc = w.exception()
            if exc is not None:
                return exc
        return None

    def get_future(self) -> torch.futures.Future:
        if self._all_future is None:
            futures = [w.get_future() for w in self._works]

            def finish(fut: torch.futures.Future) -> list[torch.Tensor]:
                for f in fut.value():
                    f.value()  # raises the ring's error, if any
                self._copy_back_once()
                return self._result

            self._all_future = torch.futures.collect_all(futures).then(finish)
        return self._all_future

    def __repr__(self) -> str:
        state = "completed" if self.is_completed() else "pending"
        return f"<ringreduce.CoalescedWork {self._describe} {state}>"


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


def all_reduce_coalesced(
    tensors: Sequence[torch.Tensor],
    op: Any = ReduceOp.SUM,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """Reduces every tensor of `tensors` in place with one ring per dtype instead of one per tensor.

    The tensors are packed into one flat buffer per dtype (in order of first appearance), each
    buffer is all-reduced with `op` and the results are copied back (one extra copy each way; none
    for a lone contiguous tensor). Every rank must pass the same list (same dtypes, shapes and
    order): the agreement frame describes the call as coalesced with its number of tensors, so a
    mismatch raises on every rank.

    Args:
        tensors: a list or tuple of tensors, any shapes, strides and dtypes, all on one device
            (CPU or CUDA); DTensors through their local shards.
        op: SUM (default), AVG, MAX, MIN or PRODUCT; also a string or
            ``torch.distributed.ReduceOp``.
        group: None (the default process group), a ``ProcessGroup`` or a ``DeviceMesh``. A rank
            outside the group returns at once.
        async_op: True returns a :class:`Work` at once; its ``wait()`` copies the results back into
            `tensors`, and its future's value is the list of tensors.

    Returns:
        None, or with ``async_op=True`` a :class:`Work`.

    Raises:
        TypeError: not a list, an element that is not a tensor, or a dtype that does not support
            `op` (integer AVG included), checked for every tensor before any data moves; the other
            ranks raise RuntimeError naming the refusing rank.
        ValueError: tensors on different devices, sparse tensors, an unknown `op`.
        RuntimeError: the ranks disagree on the list (every rank raises).
        torch.distributed.DistBackendError: a peer died or the group's timeout passed.

    CUDA tensors run on ringreduce's streams, ordered after the current stream, which waits for
    the results (the host does not block), as in :func:`all_reduce`.
    """
    info = resolve(group)
    listed, code, exc = _validate(tensors)
    if exc is None:
        assert listed is not None
        for k, t in enumerate(listed):
            code, exc, _, _ = local_refusal(t, op, None, "auto")
            if exc is not None:
                exc = type(exc)(f"{exc} (in ringreduce.all_reduce_coalesced, element {k})")
                break
    if exc is not None:
        if info is None:
            raise exc
        # The device the other ranks run this call on: the list's (CPU for a list that is not one).
        device = listed[0].device if listed else None
        refuse(info, CallKind.ALL_REDUCE_COALESCED, code, exc, device, "auto")
    assert listed is not None
    live = [t for t in listed if t.numel() > 0]
    if info is None or info.size == 1 or not live:
        return Work.completed(listed) if async_op else None
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in live:
        by_dtype.setdefault(t.dtype, []).append(t)
    groups = [_FlatGroup(ts) for ts in by_dtype.values()]
    works: list[Work] = []
    for g in groups:
        w = run_all_reduce(g.flat, op, group, True, None, "auto", CallKind.ALL_REDUCE_COALESCED, ntensors=len(listed))
        assert w is not None
        works.append(w)
    work = CoalescedWork(works, groups, listed, describe=f"all_reduce_coalesced of {len(listed)} tensors on {info.name}")
    if async_op:
        return work
    work.wait()
    return None
