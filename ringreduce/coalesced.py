"""all_reduce_coalesced: one ring for a list of tensors (flattened into one buffer per dtype)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ringreduce._call import (
    local_refusal,
    local_tensor,
    predivide_refusal,
    refuse,
    run_all_reduce,
    scaling_refusal,
    torch_words,
)
from ringreduce._groups import resolve
from ringreduce._options import AllreduceOptions, options_of
from ringreduce._types import CallKind, FrameError, ReduceOp
from ringreduce.work import Work


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


def _in_torch_words(tensors: Any, ours: str) -> str:
    """`ours`, after what torch.distributed's all_reduce_coalesced says of the same list."""
    words = torch_words("_check_tensor_list", tensors, "tensor")
    return f"{words} ({ours})" if words else ours


def _validate(tensors: Any) -> tuple[list[torch.Tensor] | None, Any, BaseException | None]:
    """(tensor list, frame error code, exception) from purely local checks of the argument."""
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, Sequence):
        return None, FrameError.NOT_A_TENSOR, TypeError(_in_torch_words(
            tensors, "ringreduce.all_reduce_coalesced: expected a list or tuple of tensors, got "
            f"{type(tensors).__name__} (use ringreduce.all_reduce for a single tensor)"))
    tensors = [local_tensor(t) for t in tensors]  # DTensors: their local shards, in place
    for k, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            return None, FrameError.NOT_A_TENSOR, TypeError(_in_torch_words(
                list(tensors), f"ringreduce.all_reduce_coalesced: element {k} is a {type(t).__name__}, not a torch.Tensor"))
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
# _options.py; docs/design.md section 1.1). Every tensor is checked before any ring (its predivide factor
# too, against the group's size), and each buffer's frame carries its wire and factor and the list's
# layout_hash() (Frame::layout_hash), so ranks that disagree on an option or on the list (dtypes, shapes,
# order: lists of one total size would otherwise add unrelated elements) raise with no tensor changed; a
# refusing rank sends one refusal frame per ring the others run (_rings).


def layout_hash(tensors: Sequence[torch.Tensor]) -> int:
    """A 64-bit hash of the list's dtypes and shapes in order, the same in every process (never 0)."""
    text = ";".join(f"{t.dtype}{tuple(t.shape)}" for t in tensors)
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") or 1


def _refusal(listed: list[torch.Tensor], options: AllreduceOptions) -> tuple[Any, BaseException | None]:
    """(frame error code, exception) from local checks of every tensor with its buffer's options (Note
    [Options of a coalesced list])."""
    o = options
    if not listed:
        # No tensor: the options alone, as all_reduce checks them (on an empty float32 stand-in).
        probe = torch.empty(0)
        code, exc, rop, _ = local_refusal(probe, o.op, None, o.algorithm)
        if exc is None:
            code, exc, _, _ = scaling_refusal(probe, rop, o.wire_dtype, o.predivide_factor)
        return code, exc
    rop = None
    for k, t in enumerate(listed):
        b = o.for_buffer(t.dtype)  # what the buffer of t's dtype is reduced with
        code, exc, rop, _ = local_refusal(t, b.op, b.accum_dtype, b.algorithm)
        if exc is None:
            code, exc, _, _ = scaling_refusal(t, rop, b.wire_dtype, b.predivide_factor)
        if exc is not None:
            return code, type(exc)(f"{exc} (in ringreduce.all_reduce_coalesced, element {k})")
    if o.wire_dtype is not None and not any(t.dtype == torch.float32 for t in listed):
        code, exc, _, _ = scaling_refusal(listed[0], rop, o.wire_dtype, o.predivide_factor)
        assert exc is not None  # a wire for a tensor that is not float32
        return code, type(exc)(f"{exc} (in ringreduce.all_reduce_coalesced, whose list has no float32 tensor)")
    return FrameError.NONE, None


def _size_refusal(listed: list[torch.Tensor], options: AllreduceOptions, size: int) -> tuple[Any, BaseException | None]:
    """(frame error code, exception) of the predivide factor of each tensor's buffer in a group of `size`
    ranks (predivide_refusal), for a list _refusal accepted: checked before any buffer's ring runs."""
    for k, t in enumerate(listed):
        b = options.for_buffer(t.dtype)
        if b.predivide_factor is None:
            continue
        _, _, rop, _ = local_refusal(t, b.op, b.accum_dtype, b.algorithm)
        assert rop is not None
        exc = predivide_refusal(float(b.predivide_factor), t.dtype, rop, size, max(1, b.extra_divisor))
        if exc is not None:
            return FrameError.OTHER, ValueError(f"{exc} (in ringreduce.all_reduce_coalesced, element {k})")
    return FrameError.NONE, None


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
    same options: the agreement frame describes the call as coalesced with its number of tensors
    and a hash of their dtypes and shapes in order, and each buffer's frame its wire and factor, so a
    mismatch raises on every rank (lists of one total size included).

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
        algorithm: "auto" (default), "ring", "hierarchical" or "direct", for every dtype's ring, as in
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
    options = options_of(op, accum_dtype, algorithm, wire_dtype, predivide_factor)
    listed, code, exc = _validate(tensors)
    if exc is None:
        assert listed is not None
        code, exc = _refusal(listed, options)
    if exc is not None and not dist.is_initialized():
        raise exc  # as torch.distributed checks its arguments before the group
    info = resolve(group)
    if exc is None and info is not None and listed:
        code, exc = _size_refusal(listed, options, info.size)
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
    layout = layout_hash(listed)
    for g in groups:
        w = run_all_reduce(g.flat, group, options.for_buffer(g.flat.dtype), True, CallKind.ALL_REDUCE_COALESCED,
                           ntensors=len(listed), layout=layout)
        assert w is not None
        works.append(w)

    def copy_back() -> None:  # once every buffer's ring completed
        for g in groups:
            g.copy_back()

    work = Work.of_parts(works, listed, copy_back, f"all_reduce_coalesced of {len(listed)} tensors on {info.name}")
    if async_op:
        return work
    work.wait()
    return None
