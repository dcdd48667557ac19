"""The collectives: all_reduce, all_reduce_avg and ReduceOp."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ringreduce import _traced
from ringreduce._dispatch import run_all_reduce
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

    Every rank ends with bitwise-identical values. `op` is SUM, AVG, MAX, MIN or PRODUCT (also as a
    string or torch.distributed.ReduceOp). AVG divides the fully reduced sum once by the world size
    (float32 for half types, float64 for float64/complex128), so it equals all_reduce(SUM) then
    div_(world_size). Half-type partial sums are rounded at every hop unless
    ``accum_dtype=torch.float32``, which carries them in float32 (1.5x the bytes) and rounds once;
    note that fp16 sums can overflow (65504) where a pre-divided average would not: use
    accum_dtype for such data.

    ``wire_dtype=torch.bfloat16`` (or ``torch.float16``), for float32 tensors with SUM or AVG: the
    reduce-scatter's partial sums travel as 16-bit values, but every hop adds the received partial,
    widened, to the local float32 value in float32 and rounds once, to 16 bits, as it sends; the
    owner's final sum (and AVG's division) is float32 and the all-gather carries float32, so the
    result is the float32 the ring computed, bitwise identical on every rank (more accurate than
    DDP's bf16/fp16 compress hooks, which sum in 16 bits). 0.75x the bytes of a float32 ring. It
    runs on the flat ring (``algorithm="auto"`` picks it; "hierarchical" raises ValueError).
    ``predivide_factor=f`` (SUM and AVG on floating or complex tensors) never changes what is
    computed, only where it is scaled: every contribution is divided by f as it enters the ring
    (rounded to the tensor's dtype), then the finished sum is divided by n/f (AVG) or multiplied by
    f (SUM), once, in the accumulation precision (Horovod's gradient_predivide_factor: it keeps fp16
    sums in range). f = n pre-divides fully, as DDP's default hook does.

    Any strides, views, transposed or channels_last tensors work (matched by logical index; memory
    outside the tensor's elements is untouched). `group`: None (WORLD), a ProcessGroup or a
    DeviceMesh; `algorithm`: "auto", "ring" or "hierarchical". With ``async_op=True`` returns a
    :class:`Work` at once (CPU: the ring runs on the group's worker thread; CUDA: on ringreduce's
    streams, ordered after the current stream). Raises TypeError for non-tensors and unsupported
    dtype/op pairs (integer AVG, a 16-bit wire or predivide factor for an integer tensor included,
    before any data moves), ValueError for sparse tensors and bad arguments (a wire_dtype other than
    bfloat16/float16 or not narrower than the tensor, a predivide_factor <= 0, either with MAX, MIN
    or PRODUCT); every rank raises alike (a rank that refuses tells the others), RuntimeError when ranks disagree (every rank raises, naming what differs) and
    torch.distributed.DistBackendError when a peer dies or the group's timeout
    (RINGREDUCE_TIMEOUT) passes. A rank outside `group` returns at once. A DTensor is reduced
    through its local shard, in place (its placements are not changed).

    Under ``torch.compile`` the call is one ``ringreduce::all_reduce_`` op in the graph (no graph
    break; `group` must then be None, a ProcessGroup or a 1-D DeviceMesh, and ``async_op=True``
    gives an already completed Work). Ctrl-C interrupts a call blocked on a silent peer
    (KeyboardInterrupt; the group is then unusable on this rank).
    """
    if torch.compiler.is_compiling():  # Note [Collectives under torch.compile] (ringreduce/_library.py)
        torch.ops.ringreduce.all_reduce_(tensor, _traced.op_name(op), _traced.group_name(group), accum_dtype, algorithm,
                                         wire_dtype, _traced.factor(predivide_factor))
        return Work.completed([tensor]) if async_op else None
    return run_all_reduce(tensor, op, group, async_op, accum_dtype, algorithm, CallKind.ALL_REDUCE,
                          wire_dtype=wire_dtype, predivide_factor=predivide_factor)


def all_reduce_avg(
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
    accum_dtype: torch.dtype | None = None,
    algorithm: str = "auto",
    wire_dtype: torch.dtype | None = None,
    predivide_factor: float | None = None,
) -> Work | None:
    """Averages `tensor` across `group` in place: ``all_reduce(tensor, op=ReduceOp.AVG, ...)``.

    The drop-in for ``dist.all_reduce(t); t /= world_size``. `group`, `async_op`, `accum_dtype`,
    `algorithm`, `wire_dtype` (a 16-bit wire for float32 tensors) and `predivide_factor` (divide by
    f before the ring, by n/f after) are all_reduce's. Integer and bool tensors raise TypeError
    before any payload moves, leaving the tensor unchanged. Under ``torch.compile`` it is one
    ``ringreduce::all_reduce_avg_`` op in the graph.
    """
    if torch.compiler.is_compiling():
        torch.ops.ringreduce.all_reduce_avg_(tensor, _traced.group_name(group), accum_dtype, algorithm, wire_dtype,
                                             _traced.factor(predivide_factor))
        return Work.completed([tensor]) if async_op else None
    return run_all_reduce(tensor, ReduceOp.AVG, group, async_op, accum_dtype, algorithm, CallKind.ALL_REDUCE_AVG,
                          wire_dtype=wire_dtype, predivide_factor=predivide_factor)


__all__ = ["ReduceOp", "all_reduce", "all_reduce_avg", "to_reduce_op"]
