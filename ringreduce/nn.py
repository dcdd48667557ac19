"""Autograd-aware collectives: all_gather whose backward is reduce_scatter, and the reverse.

``all_gather(tensor)`` returns every rank's tensor concatenated on dim 0 and lets gradients flow
back to each rank's own input; ``reduce_scatter(input, op)`` returns this rank's block of the
reduced input and sends gradients back to every rank's input. Both run ringreduce's ring
(:func:`ringreduce.all_gather`, :func:`ringreduce.reduce_scatter`) in forward and the other half
of the ring in backward.

Note [Gradient convention]
    The loss being differentiated is the *sum over ranks* of the losses each rank backpropagates, as
    in torch.distributed.nn. So the backward of ``all_gather`` is a SUM reduce-scatter: rank r's input
    (block r) receives the sum over ranks of the gradients of block r. The backward of
    ``reduce_scatter`` is an all-gather of the output gradients (divided by n for ``op="avg"``).

    When every rank computes *the same* loss L over the gathered outputs, averaging the parameter
    gradients over ranks (GradientAverager, all_reduce_avg) leaves exactly dL/dtheta on every rank, as
    one process computing L on the whole batch: no loss rescaling needed (with a loss L_r per rank,
    that of mean_r L_r). A contrastive (InfoNCE / CLIP) loss over the global batch: docs/hooks.md
    section 5.

Rules, as for every collective: every rank calls the same collectives in the same order, in
forward *and* in backward (so every rank must backpropagate through each all_gather or
reduce_scatter it ran, with inputs that require grad on every rank or on none). Shapes must be
equal on every rank; uneven first dimensions raise RuntimeError on every rank (the agreement
frame): pad to the largest and mask the padding. `group` is None (WORLD), a ProcessGroup or a
DeviceMesh (flattened when multi-dimensional); a rank outside the group gets None.
"""

from __future__ import annotations

from typing import Any

import torch

from ringreduce import scatter_gather
from ringreduce._call import device_of, refuse
from ringreduce._groups import resolve
from ringreduce._types import CallKind, FrameError, ReduceOp, to_reduce_op

_DIFFERENTIABLE_OPS = (ReduceOp.SUM, ReduceOp.AVG)
_UNEVEN_HINT = (
    "ringreduce.nn.all_gather: every rank must pass a tensor of the same shape and dtype (uneven "
    "first dimensions are not supported: pad to the largest and mask the padding). "
)


def _gather(tensor: Any, group: Any) -> torch.Tensor:
    try:
        return scatter_gather.all_gather(tensor, group)
    except RuntimeError as exc:
        # Only the agreement frame's verdict gets the hint; a dead peer (DistBackendError) or a
        # local refusal is passed on untouched.
        head = str(exc).split("\n", 1)[0]
        differs = head.partition("[differs:")[2]
        if exc.args and any(field in differs for field in ("shape", "numel", "dtype")):
            exc.args = (_UNEVEN_HINT + str(exc.args[0]), *exc.args[1:])
        raise


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: Any, size: int) -> torch.Tensor:
        ctx.group, ctx.size, ctx.shape = group, size, tensor.shape
        return _gather(tensor, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        # Note [Gradient convention]: rank r gets the sum over ranks of the gradients of block r.
        # Through the autograd function itself, so that double backward works too.
        block = _ReduceScatter.apply(grad, ReduceOp.SUM, ctx.group, ctx.size)
        return block.reshape(ctx.shape), None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, input: torch.Tensor, op: ReduceOp, group: Any, size: int) -> torch.Tensor:  # noqa: A002
        ctx.group, ctx.size, ctx.op, ctx.shape = group, size, op, input.shape
        output = input.new_empty((input.shape[0] // size, *input.shape[1:]))
        scatter_gather.reduce_scatter(output, input, op=op, group=group)
        return output

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        # d(block r)/d(input of rank s, block r) is 1 for SUM and 1/n for AVG.
        gathered = _AllGather.apply(grad, ctx.group, ctx.size).reshape(ctx.shape)
        if ctx.op == ReduceOp.AVG:
            gathered = gathered / ctx.size
        return gathered, None, None, None


def all_gather(tensor: torch.Tensor, group: Any = None) -> torch.Tensor | None:
    """Differentiable :func:`ringreduce.all_gather`: every rank's `tensor`, concatenated on dim 0.

    Returns a new tensor of shape ``(n * d0, ...)`` for a `tensor` of shape ``(d0, ...)`` (``(n,)``
    for a 0-d tensor), identical on every rank. Backward: a SUM reduce-scatter of the incoming
    gradient, so rank r's input receives the sum over ranks of the gradient of block r (see Note
    [Gradient convention] in this module: with the same loss on every rank, average the parameter
    gradients afterwards). A tensor that does not require grad works too (no backward then).

    Raises RuntimeError on every rank when the ranks' shapes or dtypes differ (uneven first
    dimensions included), TypeError for a non-tensor (the other ranks raise RuntimeError), and
    torch.distributed.DistBackendError when a peer dies or times out. A rank outside `group`
    gets None.
    """
    info = resolve(group)
    if info is None:
        return None
    return _AllGather.apply(tensor, group, info.size)


def reduce_scatter(input: torch.Tensor, op: Any = "sum", group: Any = None) -> torch.Tensor | None:  # noqa: A002
    """Differentiable :func:`ringreduce.reduce_scatter`: returns this rank's block of the reduced input.

    `input` has shape ``(n * d0, ...)`` on every rank (n = the group's size); rank r gets the
    ``(d0, ...)`` block ``r`` of the elementwise reduction over ranks: the sum for ``op="sum"``,
    the sum divided once by n for ``op="avg"`` (also ``ringreduce.ReduceOp`` or
    ``torch.distributed.ReduceOp``). Backward: an all-gather of the output gradients (divided by
    n for AVG), so every rank's input gets the gradient of every rank's block. `input` is not
    modified.

    Raises ValueError for other ops (MAX, MIN and PRODUCT have no gradient here) and for inputs
    whose first dimension is not a multiple of n; the other ranks are told and raise
    RuntimeError. Ranks that disagree on shape or dtype raise RuntimeError on every rank. A rank
    outside `group` gets None.
    """
    info = resolve(group)
    kind = CallKind.REDUCE_SCATTER
    try:
        rop = to_reduce_op(op)
    except (TypeError, ValueError) as exc:  # TypeError: a bool or a plain integer
        rop, error = None, (FrameError.UNSUPPORTED, exc)
    else:
        error = None
    if error is None and rop not in _DIFFERENTIABLE_OPS:
        error = (FrameError.UNSUPPORTED, ValueError(
            f"ringreduce.nn.reduce_scatter: op {rop.name} is not supported; the differentiable reductions are "
            "SUM and AVG (use ringreduce.reduce_scatter without autograd for MAX, MIN and PRODUCT)"
        ))
    if error is None and not isinstance(input, torch.Tensor):
        error = (FrameError.NOT_A_TENSOR, TypeError(
            f"ringreduce.nn.reduce_scatter: expected a torch.Tensor, got {type(input).__name__}"
        ))
    if error is None and info is not None and (input.dim() == 0 or input.shape[0] % info.size != 0):
        error = (FrameError.OTHER, ValueError(
            f"ringreduce.nn.reduce_scatter: input of shape {tuple(input.shape)} cannot be split into "
            f"{info.size} blocks on dim 0; pass shape ({info.size} * d0, ...)"
        ))
    if error is not None:
        refuse(info, kind, *error, device_of(input))
    if info is None:
        return None
    return _ReduceScatter.apply(input, rop, group, info.size)


__all__ = ["all_gather", "reduce_scatter"]
