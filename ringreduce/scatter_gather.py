"""The ring's two halves as collectives: reduce_scatter and all_gather.

Both run the same plan as the all-reduce (csrc/core/plan.cpp), one half of it, with the owner map
rotated so that rank r owns block r and blocks of exactly ``numel / n`` elements (Note [Ring
halves] in csrc/core/plan.h). Autograd-aware versions are in :mod:`ringreduce.nn`.
"""

from __future__ import annotations

from typing import Any

import torch

from ringreduce import _traced
from ringreduce._call import device_of, local_refusal, local_tensor, overlap_error, overlaps, refuse, run_ring_half
from ringreduce._groups import resolve
from ringreduce._types import CallKind, FrameError, ReduceOp
from ringreduce.work import Work


def gathered_shape(shape: torch.Size | tuple[int, ...], n: int) -> tuple[int, ...]:
    """The shape of `n` blocks of `shape` concatenated on dim 0 (``(n,)`` for 0-d blocks)."""
    return (n,) if len(shape) == 0 else (n * shape[0], *shape[1:])


def reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,  # noqa: A002 - torch.distributed's name
    op: Any = ReduceOp.SUM,
    group: Any = None,
    async_op: bool = False,
) -> Work | None:
    """Reduces `input` across the ranks of `group` and leaves block r of the result on rank r.

    The counterpart of ``torch.distributed.reduce_scatter_tensor`` and the first half of the ring
    all-reduce (each rank sends (n-1)/n of `input`, n = the group's size). Results are bitwise
    identical to the corresponding block of :func:`all_reduce`'s.

    Args:
        output: receives block r on rank r: ``output.numel()`` elements, `input`'s dtype and
            device, any shape and strides (typically ``(d0, ...)``) whose elements do not share
            memory (an ``expand()``-ed or overlapping ``as_strided`` view raises ValueError).
        input: n blocks of ``output.numel()`` elements back to back in row-major order (typically
            shape ``(n * d0, ...)``); not modified. Any strides and views.
        op: SUM (default), AVG (divides once by n, as all_reduce's), MAX, MIN or PRODUCT; also a
            string or ``torch.distributed.ReduceOp``.
        group: None (the default process group), a ``ProcessGroup`` or a ``DeviceMesh``. A rank
            outside the group returns at once, `output` unchanged.
        async_op: True returns a :class:`Work` at once (``result()[0]`` is `output`); call
            ``wait()`` before reading `output`.

    Returns:
        None, or with ``async_op=True`` a :class:`Work`.

    Raises:
        TypeError: a non-tensor, an `output` whose dtype or device differs from `input`'s, or a
            dtype that does not support `op`; the other ranks raise RuntimeError.
        ValueError: `input` is not n blocks of `output`'s size, a sparse tensor, an unknown `op`,
            an `output` whose elements share memory; the other ranks raise RuntimeError.
        RuntimeError: the ranks disagree on shape, dtype or op (every rank raises).
        torch.distributed.DistBackendError: a peer died or the group's timeout passed.

    CUDA tensors run on ringreduce's streams, ordered after the current stream, which waits for
    the result (the host does not block). Autograd: :func:`ringreduce.nn.reduce_scatter`. Under
    ``torch.compile`` it is one ``ringreduce::reduce_scatter`` op (and a copy into `output`).
    """
    if torch.compiler.is_compiling():  # Note [Collectives under torch.compile] (ringreduce/_library.py)
        block = torch.ops.ringreduce.reduce_scatter(
            input, _traced.op_name(op), _traced.group_size(group), _traced.group_name(group)
        )
        output.copy_(block.view(output.shape))
        return Work.completed([output]) if async_op else None
    kind = CallKind.REDUCE_SCATTER
    input, output = local_tensor(input), local_tensor(output)  # DTensors: their local shards
    info = resolve(group)
    code, exc, rop, _ = local_refusal(input, op, None, "ring", written=False)  # only read: it may overlap
    if exc is None:
        if not isinstance(output, torch.Tensor):
            code, exc = FrameError.NOT_A_TENSOR, TypeError(
                f"ringreduce.reduce_scatter: output must be a torch.Tensor, got {type(output).__name__}"
            )
        elif output.dtype != input.dtype or output.device != input.device:
            code, exc = FrameError.OTHER, TypeError(
                f"ringreduce.reduce_scatter: output ({output.dtype}, {output.device}) must have the input's "
                f"dtype and device ({input.dtype}, {input.device})"
            )
        elif info is not None and input.numel() != output.numel() * info.size:
            code, exc = FrameError.OTHER, ValueError(
                f"ringreduce.reduce_scatter: input has {input.numel()} elements, but {info.size} ranks x "
                f"output's {output.numel()} = {output.numel() * info.size}; input must be the {info.size} "
                f"output blocks back to back (shape ({info.size} * d0, ...) for output (d0, ...))"
            )
        elif output.layout != torch.strided:
            code, exc = FrameError.SPARSE, ValueError("ringreduce.reduce_scatter: output must be a dense tensor")
        elif not output.is_contiguous() and overlaps(output):
            code, exc = FrameError.OTHER, overlap_error(output, "`output`", "pass an output made by torch.empty",
                                                        "ringreduce.reduce_scatter")
    if exc is not None:
        refuse(info, kind, code, exc, device_of(input))
    assert rop is not None
    if info is None:
        return Work.completed([output]) if async_op else None
    return run_ring_half(info, input, output, rop, kind, async_op)


def all_gather(tensor: torch.Tensor, group: Any = None, async_op: bool = False) -> Any:
    """Gathers `tensor` from every rank of `group`, concatenated on dim 0 in rank order.

    The counterpart of ``torch.distributed.all_gather_into_tensor`` and the second half of the ring
    all-reduce; the result is bitwise identical on every rank.

    Args:
        tensor: this rank's block, any shape and strides; every rank must pass the same shape and
            dtype (pad uneven first dimensions to the largest, or use
            ``torch.distributed.all_gather`` with a list).
        group: None (the default process group), a ``ProcessGroup`` or a ``DeviceMesh``.
        async_op: True returns a :class:`Work` at once whose ``result()[0]`` (and future value) is
            the gathered tensor, valid after ``wait()``.

    Returns:
        A new tensor of shape ``(n * d0, ...)`` for a `tensor` of shape ``(d0, ...)`` (``(n,)`` for
        a 0-d tensor); with ``async_op=True`` a :class:`Work`; None on a rank outside `group`.

    Raises:
        TypeError: a non-tensor or an unsupported dtype; the other ranks raise RuntimeError.
        ValueError: a sparse tensor or an unsupported device.
        RuntimeError: the ranks' shapes or dtypes differ (every rank raises, naming the shapes).
        torch.distributed.DistBackendError: a peer died or the group's timeout passed.

    CUDA tensors run on ringreduce's streams, ordered after the current stream, which waits for
    the result (the host does not block). Autograd: :func:`ringreduce.nn.all_gather`. Under
    ``torch.compile`` it is one ``ringreduce::all_gather`` op in the graph.
    """
    if torch.compiler.is_compiling():  # Note [Collectives under torch.compile] (ringreduce/_library.py)
        out = torch.ops.ringreduce.all_gather(tensor, _traced.group_size(group), _traced.group_name(group))
        return Work.completed([out]) if async_op else out
    kind = CallKind.ALL_GATHER
    tensor = local_tensor(tensor)  # a DTensor: its local shard (the result is a plain tensor)
    info = resolve(group)
    code, exc, _, _ = local_refusal(tensor, ReduceOp.SUM, None, "ring", written=False)  # only read: it may overlap
    if exc is not None:
        refuse(info, kind, code, exc, device_of(tensor))
    if info is None:
        return None
    out = torch.empty(gathered_shape(tensor.shape, info.size), dtype=tensor.dtype, device=tensor.device)
    work = gather_into(info, out, tensor, async_op)
    return work if async_op else out


def gather_into(info: Any, out: torch.Tensor, tensor: torch.Tensor, async_op: bool) -> Work | None:
    """The ring's all-gather of `tensor` (already accepted by local_refusal) into `out`, a dense
    row-major tensor of ``info.size * tensor.numel()`` elements of its dtype and device, on the ring of
    `info` (a GroupInfo this rank is a member of)."""
    return run_ring_half(info, tensor, out, ReduceOp.SUM, CallKind.ALL_GATHER, async_op)
