"""The collectives: all_reduce, all_reduce_avg and ReduceOp."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ringreduce import _traced
from ringreduce._call import run_all_reduce
from ringreduce._options import options_of
from ringreduce._types import CallKind, ReduceOp, to_reduce_op
from ringreduce.work import Work


def all_reduce(
    tensor: torch.Tensor,
    op: Any = ReduceOp.SUM,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
    accum_dtype: torch.dtype | None = None,
    algorithm: str = "auto",
    wire_dtype: torch.dtype | None = None,
    predivide_factor: float | None = None,
) -> Work | None:
    """Reduces `tensor` across the ranks of `group` in place with ringreduce's ring.

    The counterpart of ``torch.distributed.all_reduce``: every rank must call it with a tensor of
    the same shape and dtype and the same arguments, in the same order as its other collectives.
    Every rank ends with bitwise-identical values, whatever the segment size. AVG divides the
    fully reduced sum once by the group's size (in float32 for half types, float64 for
    float64/complex128, per component), so for real dtypes it equals ``all_reduce(SUM)`` then
    ``div_(world_size)`` (torch's complex ``div_`` multiplies by 1/n instead).

    Args:
        tensor: the input and output, a dense CPU or CUDA tensor of float32, float64, float16,
            bfloat16, int8/16/32/64, uint8, bool or complex64/128 (complex: SUM and AVG only). Any
            strides, views, transposed or channels_last layouts work (elements are matched by
            logical index; memory outside the tensor's elements is untouched), except views whose
            elements share memory (``expand()``, an overlapping ``as_strided``: ValueError; reduce
            a ``.clone()`` and copy it back). A DTensor is reduced through its local shard,
            keeping its placements.
        op: ``ReduceOp.SUM`` (default), ``AVG``, ``MAX``, ``MIN`` or ``PRODUCT``; also the strings
            "sum", "avg", ... and ``torch.distributed.ReduceOp.*``, but no plain integer or bool
            (TypeError: torch.distributed's numbering differs from ReduceOp's). Integer and bool
            tensors take no AVG.
        group: None (the default process group), a ``ProcessGroup`` from ``dist.new_group``, or a
            ``DeviceMesh`` (1-D, or a sub-mesh such as ``mesh["dp", "cp"]``, flattened into one
            ring). A rank outside the group returns at once.
        async_op: False: return when this rank's result is in `tensor` (CPU) or ordered on the
            current stream (CUDA). True: return a :class:`Work` at once; ``work.wait()`` before
            reading `tensor`.
        accum_dtype: None, ``torch.float32`` or the tensor's own dtype, for float16/bfloat16
            tensors with SUM or AVG. None (and ``torch.float32``, which adds nothing there): with
            "auto" on a flat group the direct all-reduce sums in float32 in rank order and rounds
            once, on every transport, at 16-bit bytes; with "ring", in shared memory (ranks of one
            host) partial sums are added in float32 and over gloo point-to-point and NCCL they travel
            in the tensor's dtype, rounded at every hop (``torch.float32``: float32 partials, 1.5x
            the bytes, rounded once). The tensor's dtype: rounded at every hop everywhere ("auto"
            takes the ring). An fp16 *sum* can overflow (65504) where a pre-divided average would not.
        algorithm: "auto" (default): the hierarchical all-reduce when the group spans several
            nodes with equally many of its ranks on each (torchrun's GROUP_RANK and
            LOCAL_WORLD_SIZE, or RINGREDUCE_LOCAL_SIZE); else "direct" for float16/bfloat16 SUM and
            AVG (up to 64 ranks) and the flat ring otherwise, both sending small tensors in one
            shot. "ring": always the flat ring. "hierarchical": reduce-scatter inside each node,
            all-reduce across nodes among ranks of the same local rank, all-gather inside each
            node (the flat ring when the group is on one node). "direct": the reduce-scatter by
            direct exchange, each element's contributions added in rank order 0..n-1 (half types
            in float32, rounded once; with `wire_dtype` each contribution rounded once to it), then
            the all-gather: the ring's bytes, the same bits on every transport, every dtype and op.
        wire_dtype: None, or ``torch.bfloat16`` / ``torch.float16`` for float32 tensors with SUM
            or AVG: the reduce-scatter's partial sums travel as 16-bit values (0.75x the bytes of
            a float32 ring), but every hop adds the received partial, widened, to the local
            float32 value in float32 and rounds once, to 16 bits, as it sends; the owner's final
            sum (and AVG's division) is float32 and the all-gather carries float32, so the result
            is the float32 the ring computed, bitwise identical on every rank (more accurate than
            DDP's bf16/fp16 compress hooks, which sum in 16 bits). On CPUs the hierarchical
            all-reduce carries it on its cross-node ring only (the node stages move float32); on
            GPUs the flat ring only ("auto" picks it; "hierarchical" raises ValueError).
        predivide_factor: None, or f > 0 (SUM and AVG on floating or complex tensors): never
            changes what is computed, only where it is scaled: every contribution is divided by f
            as it enters the ring (rounded to the tensor's dtype), then the finished sum is divided
            by n/f (AVG) or multiplied by f (SUM), once, in the accumulation precision (Horovod's
            gradient_predivide_factor: it keeps fp16 sums in range). f = n pre-divides fully, as
            DDP's default hook does. f and m/f (m: n for AVG, 1 for SUM) must be normal numbers of
            the accumulation type, float32 (about 1.2e-38 to 3.4e38) for float32, float16,
            bfloat16 and complex64 tensors and float64 for float64 and complex128 ones, else
            ValueError naming the range (docs/design.md, "Predivide factor").

    Returns:
        None, or with ``async_op=True`` a :class:`Work` whose ``wait()`` returns True and whose
        future's value is ``[tensor]``.

    Raises:
        TypeError: `tensor` is not a tensor, `op` is a bool or a plain integer, or the tensor's
            dtype does not support `op` (integer or bool AVG, complex MAX...) or
            `wire_dtype`/`predivide_factor` (an integer tensor), raised
            before any data moves, `tensor` unchanged; the other ranks raise RuntimeError naming
            this rank.
        ValueError: an unknown `op` or `algorithm`, a sparse tensor, an unsupported device,
            "hierarchical" for a group with unequal nodes or (GPU) with a `wire_dtype`, a `wire_dtype`
            other than bfloat16/float16 or not narrower than the tensor, a `predivide_factor` <= 0 or
            out of the accumulation type's range, or either of them with MAX, MIN or PRODUCT; every
            rank raises alike. Also a tensor whose
            elements share memory (an ``expand()``-ed or overlapping ``as_strided`` view), before any
            data moves, `tensor` unchanged; the other ranks raise RuntimeError naming this rank.
        RuntimeError: the ranks disagree (shape, dtype, op, call order...): every rank raises,
            naming each rank's call (the agreement check, on by default on CPU, RINGREDUCE_CHECK).
        torch.distributed.DistBackendError: a peer died or stayed silent past the group's timeout
            (RINGREDUCE_TIMEOUT overrides it); the group is unusable for ringreduce afterwards.
        KeyboardInterrupt: Ctrl-C while the call waits on a peer (the group is then unusable on
            this rank).

    CUDA tensors: the call is ordered after the caller's current stream and runs on ringreduce's
    own streams (its NCCL communicator and reduce kernels); when it returns (or after
    ``work.wait()``) the *current stream* waits for the result, the host does not block, as with
    NCCL in torch.distributed. CPU tensors: the host blocks (``async_op=True``: the group's worker
    thread runs the ring). Under ``torch.compile`` the call is one ``ringreduce::all_reduce_`` op
    (no graph break; `group` must then be None, a ProcessGroup or a 1-D DeviceMesh, and
    ``async_op=True`` gives an already completed Work).

    Example::

        rr.all_reduce(t, op=rr.ReduceOp.MAX)
        work = rr.all_reduce(grad, op="avg", async_op=True)
        ...  # overlap other work
        work.wait()
    """
    if torch.compiler.is_compiling():  # Note [Collectives under torch.compile] (ringreduce/_library.py)
        torch.ops.ringreduce.all_reduce_(tensor, _traced.op_name(op), _traced.group_name(group), accum_dtype, algorithm,
                                         wire_dtype, _traced.factor(predivide_factor))
        return Work.completed([tensor]) if async_op else None
    return run_all_reduce(tensor, group, options_of(op, accum_dtype, algorithm, wire_dtype, predivide_factor), async_op,
                          CallKind.ALL_REDUCE)


def all_reduce_avg(
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
    accum_dtype: torch.dtype | None = None,
    algorithm: str = "auto",
    wire_dtype: torch.dtype | None = None,
    predivide_factor: float | None = None,
) -> Work | None:
    """Averages `tensor` across the ranks of `group` in place: ``all_reduce(tensor, op=ReduceOp.AVG)``.

    The drop-in for ``dist.all_reduce(t); t /= dist.get_world_size()``: the complete sum divided
    once by the group's size (float32 for half types, float64 for float64/complex128), bitwise
    identical on every rank.

    Args:
        tensor: the input and output, a dense floating-point or complex CPU or CUDA tensor (any
            strides and views whose elements do not share memory; a DTensor through its local
            shard).
        group: None (the default process group), a ``ProcessGroup`` or a ``DeviceMesh`` (1-D or a
            flattened sub-mesh). A rank outside the group returns at once.
        async_op: True returns a :class:`Work` at once; call ``work.wait()`` before reading
            `tensor`.
        accum_dtype: None or ``torch.float32``: float16/bfloat16 sums in float32, rounded once
            (with "auto" on a flat group: the direct all-reduce, on every transport; "ring": float32
            partials with ``torch.float32``); the tensor's own dtype: rounded at every hop
            everywhere (as in :func:`all_reduce`).
        algorithm: "auto" (default; hierarchical when the group spans several equal nodes, else
            direct for float16/bfloat16 and the flat ring otherwise), "ring", "hierarchical" or
            "direct", as in :func:`all_reduce`.
        wire_dtype: None, or ``torch.bfloat16`` / ``torch.float16`` for a float32 tensor: a 16-bit
            wire with float32 sums per hop, as in :func:`all_reduce` (on GPUs the flat ring only).
        predivide_factor: None, or f > 0: divide every contribution by f before the ring and the
            finished sum by n/f after it, as in :func:`all_reduce` (f and n/f must be normal numbers
            of the accumulation type: float32's, float64's for float64 and complex128).

    Returns:
        None, or with ``async_op=True`` a :class:`Work` (``wait()`` returns True; future value
        ``[tensor]``).

    Raises:
        TypeError: an integer or bool tensor (no average) or a non-tensor, before any payload
            moves, `tensor` unchanged; the other ranks raise RuntimeError naming this rank.
        ValueError: an unknown `algorithm`, a sparse tensor, an unsupported device, a `wire_dtype`
            other than bfloat16/float16 or not narrower than the tensor, a `predivide_factor`
            <= 0 or out of range, or a 16-bit wire with "hierarchical" on GPUs; every rank raises
            alike. Also a
            tensor whose elements share memory (the other ranks raise RuntimeError).
        RuntimeError: the ranks disagree on shape, dtype or call: every rank raises.
        torch.distributed.DistBackendError: a peer died or the group's timeout passed.

    CUDA tensors run on ringreduce's streams, ordered after the current stream, which waits for the
    result (the host does not block), as in :func:`all_reduce`. Under ``torch.compile`` it is one
    ``ringreduce::all_reduce_avg_`` op in the graph.
    """
    if torch.compiler.is_compiling():
        torch.ops.ringreduce.all_reduce_avg_(tensor, _traced.group_name(group), accum_dtype, algorithm, wire_dtype,
                                             _traced.factor(predivide_factor))
        return Work.completed([tensor]) if async_op else None
    return run_all_reduce(tensor, group, options_of(ReduceOp.AVG, accum_dtype, algorithm, wire_dtype, predivide_factor),
                          async_op, CallKind.ALL_REDUCE_AVG)


__all__ = ["ReduceOp", "all_reduce", "all_reduce_avg", "to_reduce_op"]
