"""Out-of-place collectives (``import ringreduce.functional as F``), traceable by torch.compile.

Each function returns a new tensor and leaves its input unchanged, eagerly and under
``torch.compile(fullgraph=True)`` (where each call is one ``ringreduce::`` custom op in the graph:
Note [Collectives under torch.compile] in ringreduce/_library.py). Results are bitwise equal to the
in-place versions (:func:`ringreduce.all_reduce` on a copy, ...), identical on every rank. They are
differentiable with the convention of :mod:`ringreduce.nn` (Note [Gradient convention] there: the
loss is the sum of every rank's loss): the gradient of ``all_reduce(x, "sum")`` is the SUM
all-reduce of the incoming gradients, of ``all_reduce_avg`` their average, of ``all_gather`` a SUM
reduce-scatter, of ``reduce_scatter`` an all-gather (divided by n for "avg"). MAX, MIN and PRODUCT
have no gradient (backward raises RuntimeError).

`group`: None (WORLD), a ProcessGroup or a 1-D DeviceMesh (a multi-dimensional one only in the
in-place collectives, eagerly). Every rank of the group must make the
same calls in the same order with the same shapes and dtypes; ranks that disagree raise
RuntimeError on every rank, a dead or silent peer DistBackendError after the group's timeout.
A rank outside `group` gets an unchanged copy from all_reduce and all_reduce_avg (with a warning),
and ValueError from all_gather and reduce_scatter; every function raises RuntimeError (also a
ValueError, as torch's) before torch.distributed is initialized.

Example (a compiled data-parallel step without hooks)::

    import ringreduce.functional as F

    @torch.compile(fullgraph=True)
    def averaged_grads(grads):
        return [F.all_reduce_avg(g) for g in grads]
"""

from __future__ import annotations

from typing import Any

import torch

from ringreduce import (
    _library,  # noqa: F401 - registers the ringreduce:: ops
    _traced,
)
from ringreduce._call import device_of, refuse
from ringreduce._groups import resolve
from ringreduce._rings import ring_type
from ringreduce._types import CallKind, FrameError, ReduceOp

_NO_OP = object()  # _takes_part of a collective without an op


def _takes_part(tensor: Any, what: str, kind: Any, group: Any, op: Any = _NO_OP) -> bool:
    """Whether this rank runs the call. Eagerly: NotInitializedError (a RuntimeError and a ValueError)
    before init_process_group, False on a rank outside `group` (resolve warns once); what the custom op
    would not see refuses here while the other ranks are told (they raise RuntimeError): a non-tensor
    (TypeError), a tensor on a device no ring runs on (ValueError; a meta tensor would otherwise get
    the op's fake result) and an `op` that is not an op at all (None, a bool...: op_name's error; an
    unknown name is the op's to refuse). Under torch.compile the op itself resolves the group; a
    non-tensor raises TypeError."""
    if torch.compiler.is_compiling():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"ringreduce.functional.{what}: expected a torch.Tensor, got {type(tensor).__name__}")
        return True
    info = resolve(group)
    code, exc = FrameError.NONE, None
    if not isinstance(tensor, torch.Tensor):
        code = FrameError.NOT_A_TENSOR
        exc = TypeError(f"ringreduce.functional.{what}: expected a torch.Tensor, got {type(tensor).__name__}")
    else:
        try:
            ring_type(tensor.device)
        except (ValueError, RuntimeError) as error:
            code, exc = FrameError.DEVICE, error
        if exc is None and op is not _NO_OP:
            try:
                _traced.op_name(op)
            except (TypeError, ValueError) as error:
                code, exc = FrameError.UNSUPPORTED, error
    if exc is not None:
        refuse(info, kind, code, exc, device_of(tensor))
    return info is not None


def _no_result(what: str) -> ValueError:
    return ValueError(
        f"ringreduce.functional.{what}: this rank is not in `group`, and a rank outside the group has no "
        f"{what} to return; call it on the group's ranks only (ringreduce.{what} returns None there)"
    )


def all_reduce(tensor: torch.Tensor, op: Any = "sum", group: Any = None) -> torch.Tensor:
    """Returns the reduction of `tensor` over the ranks of `group` (a new tensor; `tensor` unchanged).

    `op`: "sum", "avg", "max", "min" or "product" (also :class:`ringreduce.ReduceOp` or
    ``torch.distributed.ReduceOp``). The result has `tensor`'s shape, dtype and strides and equals
    ``t = tensor.clone(); ringreduce.all_reduce(t, op, group)`` bitwise. Raises TypeError for a
    non-tensor or an unsupported dtype/op pair (integer "avg" included), ValueError for an unknown
    op or a tensor on a device other than CPU and CUDA (a meta tensor included) - each before any
    data moves, the other ranks told (they raise RuntimeError) - RuntimeError when the ranks
    disagree, DistBackendError when a peer dies or times out.
    """
    if not _takes_part(tensor, "all_reduce", CallKind.ALL_REDUCE, group, op):
        return tensor.clone()
    name = _traced.op_name(op)  # an unknown name is refused by the op, on every rank
    return torch.ops.ringreduce.all_reduce(tensor, name, _traced.group_name(group))


def all_reduce_avg(tensor: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Returns the average of `tensor` over the ranks of `group` (a new tensor; `tensor` unchanged).

    Equals ``t = tensor.clone(); ringreduce.all_reduce_avg(t, group)`` bitwise (sum, then one
    division by the group's size). Integer and bool tensors raise TypeError on every rank.
    """
    if not _takes_part(tensor, "all_reduce_avg", CallKind.ALL_REDUCE_AVG, group):
        return tensor.clone()
    return torch.ops.ringreduce.all_reduce_avg(tensor, _traced.group_name(group))


def all_gather(tensor: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Returns every rank's `tensor` concatenated on dim 0, in rank order (a new tensor).

    Shape ``(n * d0, ...)`` for a `tensor` of shape ``(d0, ...)`` (``(n,)`` for a 0-d tensor),
    identical on every rank and bitwise equal to :func:`ringreduce.all_gather`. Every rank must pass
    the same shape and dtype (RuntimeError on every rank otherwise). `group`: None (the default
    process group), a ProcessGroup or a 1-D DeviceMesh. Raises TypeError for a non-tensor,
    ValueError for a tensor on a device other than CPU and CUDA (meta included; the other ranks
    raise RuntimeError), DistBackendError when a peer dies or times out.
    """
    if not _takes_part(tensor, "all_gather", CallKind.ALL_GATHER, group):
        raise _no_result("all_gather")
    return torch.ops.ringreduce.all_gather(tensor, _traced.group_size(group), _traced.group_name(group))


def reduce_scatter(tensor: torch.Tensor, op: Any = "sum", group: Any = None) -> torch.Tensor:
    """Returns block r of the reduction of `tensor` over the ranks, on rank r (a new tensor).

    `tensor` has shape ``(n * d0, ...)`` on every rank (n = the group's size); the result has shape
    ``(d0, ...)`` and equals :func:`ringreduce.reduce_scatter` into a fresh output bitwise. A first
    dimension that is not a multiple of n raises ValueError (the other ranks raise RuntimeError);
    `op` as in :func:`all_reduce`.
    """
    if not _takes_part(tensor, "reduce_scatter", CallKind.REDUCE_SCATTER, group, op):
        raise _no_result("reduce_scatter")
    name = _traced.op_name(op)  # an unknown name is refused by the op, on every rank
    return torch.ops.ringreduce.reduce_scatter(tensor, name, _traced.group_size(group), _traced.group_name(group))


__all__ = ["ReduceOp", "all_gather", "all_reduce", "all_reduce_avg", "reduce_scatter"]
