"""GradientAverager's buckets: which parameters share a flat buffer, and the gradient views into it.

Note [Buckets and launch order]
    Buckets are made from the parameter list alone (docs/hooks.md section 2, "Buckets"), so they are the
    same on every rank. Ready buckets are launched **strictly in bucket-index order**: hooks fire in
    different orders on different ranks, and an out-of-order launch would pair rank A's bucket 2 with
    rank B's bucket 1.
"""

from __future__ import annotations

import collections
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ringreduce._call import local_tensor
from ringreduce._groups import _is_device_mesh
from ringreduce.work import Work


@dataclass
class _Bucket:
    dtype: torch.dtype
    device: torch.device
    params: list[int]  # indices into GradientAverager._params
    offsets: list[int]
    numel: int  # gradient elements (the flags, if any, follow them)
    buffer: torch.Tensor | None = None
    pending: int = 0
    launched: bool = False
    work: Work | None = None
    flags: int = 0  # number of used-flag elements after the gradients (last bucket only)


def _collect_params(module_or_params: Any) -> list[torch.nn.Parameter]:
    if isinstance(module_or_params, torch.nn.Module):
        candidates: Iterable[Any] = module_or_params.parameters()
    elif isinstance(module_or_params, torch.Tensor):
        candidates = [module_or_params]
    else:
        try:
            candidates = list(module_or_params)
        except TypeError:
            raise TypeError(
                "ringreduce.GradientAverager: expected an nn.Module or an iterable of parameters, got "
                f"{type(module_or_params).__name__}"
            ) from None
    seen: set[int] = set()
    params = []
    for p in candidates:
        if isinstance(p, dict) and "params" in p:  # optimizer-style parameter groups
            raise TypeError(
                "ringreduce.GradientAverager: pass the module or a flat iterable of parameters, not "
                "optimizer parameter groups"
            )
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"ringreduce.GradientAverager: expected parameters (tensors), got {type(p).__name__}")
        if not p.requires_grad or id(p) in seen:  # tied parameters are averaged once
            continue
        if not p.is_leaf:
            raise ValueError(
                "ringreduce.GradientAverager: every parameter must be a leaf tensor (an nn.Parameter or "
                "a tensor created with requires_grad=True); got a non-leaf tensor"
            )
        if p.layout != torch.strided:
            raise ValueError(f"ringreduce.GradientAverager: only dense parameters are supported, got {p.layout}")
        seen.add(id(p))
        params.append(p)
    return params


def _assign_buckets(
    params: list[torch.Tensor], cap_bytes: int, first_cap_bytes: int
) -> list[tuple[torch.dtype, torch.device, list[int]]]:
    """Parameter indices grouped into buckets (reverse order, per dtype and device, capped in bytes),
    in launch order (by the reverse position of their first parameter)."""
    open_: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    size: collections.Counter[tuple[torch.dtype, torch.device]] = collections.Counter()
    closed: collections.Counter[tuple[torch.dtype, torch.device]] = collections.Counter()
    done: list[list[int]] = []
    for i in reversed(range(len(params))):
        p = params[i]
        key = (p.dtype, p.device)
        open_.setdefault(key, []).append(i)
        size[key] += p.numel() * p.element_size()
        if size[key] >= (cap_bytes if closed[key] else first_cap_bytes):
            done.append(open_.pop(key))
            size[key] = 0
            closed[key] += 1
    done += open_.values()
    done.sort(key=lambda members: -members[0])
    return [(params[m[0]].dtype, params[m[0]].device, m) for m in done]


def _slot_view(buffer: torch.Tensor, offset: int, like: torch.Tensor) -> torch.Tensor:
    """The bucket slot of a parameter, shaped like it and with its memory layout when it is dense."""
    strides = torch.empty_like(like, device="meta").stride()  # dense strides in like's dim order
    return buffer.as_strided(like.shape, strides, buffer.storage_offset() + offset)


def _is_view_of(grad: torch.Tensor, slot: torch.Tensor) -> bool:
    return (
        grad.data_ptr() == slot.data_ptr()
        and grad.shape == slot.shape
        and grad.stride() == slot.stride()
        and grad.dtype == slot.dtype
        and grad.device == slot.device
    )


def _is_dtensor(t: Any) -> bool:
    return t is not None and local_tensor(t) is not t


def _as_grad(local: torch.Tensor, param: torch.Tensor, like: torch.Tensor | None) -> torch.Tensor:
    """`local` as the gradient of `param`: itself, or for a DTensor parameter a DTensor over it with the
    placements of `like` (the gradient it replaces) or else of `param` (Note [DTensor gradients])."""
    if not _is_dtensor(param):
        return local
    from torch.distributed.tensor import DTensor

    src = like if _is_dtensor(like) else param
    with torch.no_grad():
        return DTensor.from_local(
            local, src.device_mesh, src.placements, run_check=False, shape=src.shape, stride=src.stride()
        )


def _compiled_autograd_active() -> bool:
    """Whether a backward runs under compiled autograd (no module lookup costs more than a dict probe)."""
    ca = sys.modules.get("torch._dynamo.compiled_autograd")
    return ca is not None and bool(ca.compiled_autograd_enabled or ca.in_compiled_autograd_region)


def _global_ranks(group: Any) -> frozenset[int]:
    """The global ranks `group` (None, a ProcessGroup or a DeviceMesh) averages over."""
    if group is None:
        return frozenset(range(dist.get_world_size()))
    if _is_device_mesh(group):
        return frozenset(int(r) for r in group.mesh.flatten().tolist())
    return frozenset(dist.get_process_group_ranks(group))
