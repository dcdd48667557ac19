"""What the public collectives do while Dynamo traces them: name the group and the op as constants.

See Note [Collectives under torch.compile] in ringreduce/_library.py. Everything here is plain
attribute reads and dictionary lookups that Dynamo folds at trace time; no lock, no native call.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ringreduce._options import scaling_error
from ringreduce._types import ReduceOp, to_reduce_op

_OP_NAMES = {op: op.name.lower() for op in ReduceOp}

_pg_by_name: dict[str, dist.ProcessGroup] = {}


def group_name(group: Any) -> str:
    """The name a custom op gets for `group` (None = WORLD, a ProcessGroup or a 1-D DeviceMesh).

    Traceable by Dynamo (attribute reads only). Raises TypeError for anything else (a
    multi-dimensional DeviceMesh cannot be named: pass ``mesh[dim].get_group()`` or call eagerly).
    """
    if group is None:
        return dist.group.WORLD.group_name
    if isinstance(group, dist.ProcessGroup):
        return group.group_name
    if hasattr(group, "get_group") and hasattr(group, "mesh_dim_names"):
        if group.ndim != 1:
            where, only = (("ringreduce under torch.compile", "only eagerly") if torch.compiler.is_compiling() else
                           ("ringreduce.functional", "only by the in-place collectives (ringreduce.all_reduce, ...)"))
            raise TypeError(
                f"{where}: group must be None, a ProcessGroup or a 1-D DeviceMesh; a {group.ndim}-D DeviceMesh "
                f"is flattened {only}: pass the process group of one dimension (mesh[dim].get_group())"
            )
        return group.get_group().group_name
    raise TypeError(
        f"ringreduce: group must be a torch.distributed.ProcessGroup, a DeviceMesh or None, got {type(group).__name__}"
    )


def group_of(name: str) -> dist.ProcessGroup:
    """The process group registered under `name` (cached; torch's registry resolves it the first time)."""
    pg = _pg_by_name.get(name)
    if pg is None:
        if not dist.is_initialized():
            raise RuntimeError(
                "ringreduce: the default process group is not initialized; call "
                "torch.distributed.init_process_group(backend=...) first"
            )
        try:
            pg = dist.distributed_c10d._resolve_process_group(name)
        except Exception as exc:  # noqa: BLE001 - rewritten with what to do
            raise ValueError(f"ringreduce: no process group is named {name!r} ({exc})") from None
        _pg_by_name[name] = pg
    return pg


def op_name(op: Any) -> str:
    """`op` as the string the custom ops take ("sum", "avg", "max", "min", "product")."""
    if isinstance(op, str):
        return op.strip().lower()
    if isinstance(op, ReduceOp):
        return _OP_NAMES[op]
    return _OP_NAMES[to_reduce_op(op)]


def group_size(group: Any) -> int:
    """The number of ranks of `group` (None = WORLD, a ProcessGroup or a 1-D DeviceMesh)."""
    if group is None:
        return dist.get_world_size()
    if isinstance(group, dist.ProcessGroup):
        return dist.get_world_size(group)
    return group.size()


def factor(predivide_factor: Any) -> float:
    """`predivide_factor` as the custom ops take it: None is 0.0 ("no factor"); anything else is
    passed through as a float and validated by the op (a factor of 0 is refused here, since 0.0
    means none there). Raises TypeError for a non-number."""
    if predivide_factor is None:
        return 0.0
    error = scaling_error(None, predivide_factor)
    if error is not None and (isinstance(error, TypeError) or predivide_factor == 0):
        raise error
    return float(predivide_factor)
