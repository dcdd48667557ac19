"""ringreduce's collectives as torch.library custom ops, so that torch.compile keeps them in its graph.

Note [Collectives under torch.compile]
    Dynamo cannot trace what an eager call does before its ring runs (caches, a lock, knobs, the
    native handle). So the public collectives run eagerly as they are, and while Dynamo traces
    (``torch.compiler.is_compiling()``) as one custom op below, whose arguments are graph-friendly:
    the tensor, the op as a string, the group by *name* (as torch's ``_c10d_functional`` ops) and
    its size where the output shape depends on it. Each op has a fake implementation for tracing;
    the real one resolves the name to the process group and runs the eager path, so compiled and
    eager calls are the same call on the wire. The out-of-place ops carry autograd formulas (Note
    [Gradient convention] in ringreduce/nn.py); ``all_reduce_`` and ``all_reduce_avg_`` work in place.
"""

from __future__ import annotations

from typing import Any

import torch

from ringreduce import scatter_gather
from ringreduce._call import device_of, refuse, run_all_reduce
from ringreduce._groups import resolve
from ringreduce._options import options_of
from ringreduce._traced import group_of
from ringreduce._types import CallKind, FrameError, ReduceOp


def _block_shape(shape: torch.Size | tuple[int, ...], n: int, what: str) -> tuple[int, ...]:
    if len(shape) == 0 or shape[0] % n != 0:
        raise ValueError(
            f"ringreduce.{what}: input of shape {tuple(shape)} cannot be split into {n} blocks on dim 0; "
            f"pass shape ({n} * d0, ...)"
        )
    return (shape[0] // n, *shape[1:])


# ----------------------------------------------------------------------------------------- in place


@torch.library.custom_op("ringreduce::all_reduce_", mutates_args=("tensor",))
def all_reduce_(
    tensor: torch.Tensor, op: str, group_name: str, accum_dtype: torch.dtype | None = None, algorithm: str = "auto",
    wire_dtype: torch.dtype | None = None, predivide_factor: float = 0.0,
) -> None:
    """In-place all-reduce of `tensor` over the group named `group_name` (ringreduce.all_reduce): `op`,
    `accum_dtype`, `algorithm`, `wire_dtype` as there; `predivide_factor` 0.0 means none."""
    run_all_reduce(tensor, group_of(group_name), options_of(op, accum_dtype, algorithm, wire_dtype, predivide_factor or None),
                   False, CallKind.ALL_REDUCE)


@torch.library.custom_op("ringreduce::all_reduce_avg_", mutates_args=("tensor",))
def all_reduce_avg_(
    tensor: torch.Tensor, group_name: str, accum_dtype: torch.dtype | None = None, algorithm: str = "auto",
    wire_dtype: torch.dtype | None = None, predivide_factor: float = 0.0,
) -> None:
    """In-place average of `tensor` over the group named `group_name` (ringreduce.all_reduce_avg):
    `accum_dtype`, `algorithm`, `wire_dtype` as there; `predivide_factor` 0.0 means none."""
    run_all_reduce(tensor, group_of(group_name),
                   options_of(ReduceOp.AVG, accum_dtype, algorithm, wire_dtype, predivide_factor or None), False,
                   CallKind.ALL_REDUCE_AVG)


def _fake_in_place(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> None:
    return None


all_reduce_.register_fake(_fake_in_place)
all_reduce_avg_.register_fake(_fake_in_place)


# ------------------------------------------------------------------------------------- out of place


@torch.library.custom_op("ringreduce::all_reduce", mutates_args=())
def all_reduce(tensor: torch.Tensor, op: str, group_name: str) -> torch.Tensor:
    """Out-of-place all-reduce: a reduced copy of `tensor` (same shape and strides)."""
    out = tensor.clone()
    run_all_reduce(out, group_of(group_name), options_of(op), False, CallKind.ALL_REDUCE)
    return out


@torch.library.custom_op("ringreduce::all_reduce_avg", mutates_args=())
def all_reduce_avg(tensor: torch.Tensor, group_name: str) -> torch.Tensor:
    """Out-of-place average: an averaged copy of `tensor` (same shape and strides)."""
    out = tensor.clone()
    run_all_reduce(out, group_of(group_name), options_of(ReduceOp.AVG), False, CallKind.ALL_REDUCE_AVG)
    return out


def _fake_copy(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return torch.empty_like(tensor)


all_reduce.register_fake(_fake_copy)
all_reduce_avg.register_fake(_fake_copy)


def _not_a_member(what: str, name: str) -> ValueError:
    return ValueError(
        f"ringreduce.functional.{what}: this rank is not a member of group {name!r}; call it on the group's "
        "ranks only"
    )


@torch.library.custom_op("ringreduce::all_gather", mutates_args=())
def all_gather(tensor: torch.Tensor, group_size: int, group_name: str) -> torch.Tensor:
    """Every rank's `tensor` concatenated on dim 0 (shape (group_size * d0, ...))."""
    pg = group_of(group_name)
    info = resolve(pg)
    if info is not None and info.size != group_size:
        raise ValueError(f"ringreduce.all_gather: group {group_name!r} has {info.size} ranks, not {group_size}")
    out = scatter_gather.all_gather(tensor, pg)
    if out is None:
        raise _not_a_member("all_gather", group_name)
    return out


@all_gather.register_fake
def _(tensor: torch.Tensor, group_size: int, group_name: str) -> torch.Tensor:
    return tensor.new_empty(scatter_gather.gathered_shape(tensor.shape, group_size))


@torch.library.custom_op("ringreduce::reduce_scatter", mutates_args=())
def reduce_scatter(tensor: torch.Tensor, op: str, group_size: int, group_name: str) -> torch.Tensor:
    """Block r (of group_size blocks on dim 0) of the reduction of `tensor` over the ranks, on rank r."""
    pg = group_of(group_name)
    info = resolve(pg)
    if info is None:
        raise _not_a_member("reduce_scatter", group_name)
    exc: BaseException | None = None
    if not isinstance(tensor, torch.Tensor):
        exc = TypeError(f"ringreduce.reduce_scatter: expected a torch.Tensor, got {type(tensor).__name__}")
    elif info.size != group_size:
        exc = ValueError(f"ringreduce.reduce_scatter: group {group_name!r} has {info.size} ranks, not {group_size}")
    else:
        try:
            shape = _block_shape(tensor.shape, info.size, "reduce_scatter")
        except ValueError as bad:
            exc = bad
    if exc is not None:
        refuse(info, CallKind.REDUCE_SCATTER, FrameError.OTHER, exc, device_of(tensor))
    output = tensor.new_empty(shape)
    scatter_gather.reduce_scatter(output, tensor, op=op, group=pg)
    return output


@reduce_scatter.register_fake
def _(tensor: torch.Tensor, op: str, group_size: int, group_name: str) -> torch.Tensor:
    return tensor.new_empty(_block_shape(tensor.shape, group_size, "reduce_scatter"))


# ------------------------------------------------------------------------------------------ autograd
# Note [Gradient convention] in ringreduce/nn.py: the loss is the sum over ranks of each rank's loss.


def _keep_arguments(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    ctx.shape, ctx.args = inputs[0].shape, inputs[1:]  # the tensor's shape; op, group size, group name


def _backward_all_reduce(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
    # y = reduce_r(x_r) on every rank: dL/dx_r = sum_s dL_s/dy (SUM), that divided by n (AVG).
    op, group_name = ctx.args
    if op == "sum":
        return torch.ops.ringreduce.all_reduce(grad, "sum", group_name), None, None
    if op == "avg":
        return torch.ops.ringreduce.all_reduce_avg(grad, group_name), None, None
    raise RuntimeError(
        f"ringreduce.functional.all_reduce: op {op!r} has no gradient here; the differentiable reductions "
        "are 'sum' and 'avg'"
    )


def _backward_all_reduce_avg(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
    return torch.ops.ringreduce.all_reduce_avg(grad, *ctx.args), None


def _backward_all_gather(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
    # Rank r's input is block r of the gathered tensor: it gets the sum over ranks of block r's gradients.
    block = torch.ops.ringreduce.reduce_scatter(grad.contiguous(), "sum", *ctx.args)
    return block.reshape(ctx.shape), None, None


def _backward_reduce_scatter(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
    op, group_size, group_name = ctx.args
    if op not in ("sum", "avg"):
        raise RuntimeError(
            f"ringreduce.functional.reduce_scatter: op {op!r} has no gradient here; the differentiable "
            "reductions are 'sum' and 'avg'"
        )
    gathered = torch.ops.ringreduce.all_gather(grad.contiguous(), group_size, group_name).reshape(ctx.shape)
    if op == "avg":
        gathered = gathered / group_size
    return gathered, None, None, None


all_reduce.register_autograd(_backward_all_reduce, setup_context=_keep_arguments)
all_reduce_avg.register_autograd(_backward_all_reduce_avg, setup_context=_keep_arguments)
all_gather.register_autograd(_backward_all_gather, setup_context=_keep_arguments)
reduce_scatter.register_autograd(_backward_reduce_scatter, setup_context=_keep_arguments)
