"""ReduceOp and the native enums every collective's plumbing names (no C++ constant is copied here)."""

from __future__ import annotations

import enum
import numbers
from typing import Any

import torch.distributed as dist

from ringreduce._native import C

CallKind = C.CallKind  # the collective of an agreement frame (csrc/core/frame.h)
FrameError = C.FrameError  # why a rank refuses a call locally (csrc/core/frame.h)

KIND_NAMES: dict[Any, str] = {kind: name.lower() for name, kind in CallKind.__members__.items()}


class UnsupportedOpError(ValueError, TypeError):
    """An op the tensor's dtype does not support (complex MAX/MIN/PRODUCT, integer or bool AVG).

    A ValueError, as torch.distributed raises for an unsupported op on a complex tensor, and a
    TypeError, as ringreduce raised before: ``except ValueError`` and ``except TypeError`` both catch it.
    Constructed as any exception (args: the message; kwargs: none).
    """


class ReduceOp(enum.IntEnum):
    """Reduction operators. Functions also accept "sum"/"avg"/... and torch.distributed.ReduceOp, but
    no plain integer (TypeError: torch.distributed's numbering differs, its 2 is PRODUCT) nor bool."""

    SUM = int(C.RedOp.SUM)
    AVG = int(C.RedOp.AVG)
    MAX = int(C.RedOp.MAX)
    MIN = int(C.RedOp.MIN)
    PRODUCT = int(C.RedOp.PRODUCT)


NATIVE_OPS = {op: C.RedOp(int(op)) for op in ReduceOp}

_DIST_OPS = {
    dist.ReduceOp.SUM: ReduceOp.SUM,
    dist.ReduceOp.AVG: ReduceOp.AVG,
    dist.ReduceOp.MAX: ReduceOp.MAX,
    dist.ReduceOp.MIN: ReduceOp.MIN,
    dist.ReduceOp.PRODUCT: ReduceOp.PRODUCT,
}


def to_reduce_op(op: Any) -> ReduceOp:
    """Normalizes `op` (a ReduceOp, a name such as "sum" in any case, or a torch.distributed.ReduceOp);
    raises ValueError for unknown operators (BAND, PREMUL_SUM, "mean", ...) and TypeError for a bool
    or a plain integer: torch.distributed numbers its ops otherwise (2 is its PRODUCT, ReduceOp.MAX
    here), so an integer cannot say which op it means."""
    if isinstance(op, ReduceOp):
        return op
    if isinstance(op, str):
        try:
            return ReduceOp[op.strip().upper()]
        except KeyError:
            pass
    elif isinstance(op, (bool, numbers.Integral)):  # before the comparisons: dist.ReduceOp.AVG == 1 == True
        what = "a bool" if isinstance(op, bool) else "a plain integer"
        raise TypeError(
            f"ringreduce: op must be a string (\"sum\", \"avg\", \"max\", \"min\", \"product\"), a "
            f"ringreduce.ReduceOp or a torch.distributed.ReduceOp, got {what} {op!r}"
            + ("" if isinstance(op, bool) else
               " (torch.distributed and ringreduce.ReduceOp number the ops differently: pass "
               + (f"ringreduce.ReduceOp({int(op)}), {ReduceOp(int(op)).name}, if that is the one you mean, or "
                  if int(op) in ReduceOp._value2member_map_ else "")
               + "the op's name)")
        )
    else:
        for dist_op, ours in _DIST_OPS.items():
            try:
                if op == dist_op:
                    return ours
            except Exception:  # noqa: BLE001 - foreign comparison
                continue
    raise ValueError(
        f"ringreduce: unsupported reduce op {op!r}; use one of SUM, AVG, MAX, MIN, PRODUCT "
        "(ringreduce.ReduceOp, a string, or torch.distributed.ReduceOp)"
    )
