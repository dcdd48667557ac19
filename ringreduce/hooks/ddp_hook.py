"""ringreduce as a DDP communication hook: ``ddp.register_comm_hook(state, ringreduce.ddp_comm_hook)``."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ringreduce._call import predivide_refusal, run_all_reduce
from ringreduce._options import AllreduceOptions, avg_or_sum
from ringreduce._types import CallKind
from ringreduce.ops import ReduceOp

_NO_GROUP = object()
_AVERAGE = AllreduceOptions(ReduceOp.AVG)  # a state that is not a CommHookState


class CommHookState:
    """What ringreduce.ddp_comm_hook does with each bucket:
    ``ddp.register_comm_hook(rr.CommHookState(...), rr.ddp_comm_hook)``.

    `op`: "avg" (DDP's average, the default) or "sum" (DataParallel's sum); `wire_dtype`:
    torch.bfloat16 or torch.float16 carries float32 buckets as 16-bit partials with float32 sums per
    hop (ringreduce.all_reduce's ``wire_dtype``; buckets of other dtypes are reduced as they are);
    `predivide_factor`: ringreduce.all_reduce's (divide by f before the ring, scale once after; the
    result is the same); `process_group`: the group DDP was built with (None: the default group).
    Invalid values raise ValueError/TypeError here.
    """

    def __init__(self, wire_dtype: torch.dtype | None = None, op: str = "avg", predivide_factor: float | None = None,
                 process_group: dist.ProcessGroup | None = None) -> None:
        """Validates and keeps `wire_dtype`, `op`, `predivide_factor` and `process_group` (see the class)."""
        self.op = avg_or_sum(op, "ringreduce.CommHookState")
        self._options = AllreduceOptions(self.op, None, "auto", wire_dtype, predivide_factor)
        self._options.check("ringreduce.CommHookState")
        if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
            raise TypeError(
                f"ringreduce.CommHookState: process_group must be a ProcessGroup or None, got {type(process_group).__name__}"
            )
        if predivide_factor is not None and dist.is_initialized():
            # a factor that no bucket could take, float64 ones included (float32 buckets' narrower range:
            # the first bucket's check, as DDP's buckets' dtypes are not known here)
            size = dist.get_world_size(process_group)
            error = predivide_refusal(float(predivide_factor), torch.float64, self.op, size)
            if error is not None:
                raise ValueError(f"{error} (ringreduce.CommHookState)")
        self.wire_dtype = wire_dtype
        self.predivide_factor = predivide_factor
        self.process_group = process_group

    def __repr__(self) -> str:
        return (f"CommHookState(wire_dtype={self.wire_dtype}, op={self.op.name.lower()!r}, "
                f"predivide_factor={self.predivide_factor}, process_group={self.process_group})")


def ddp_comm_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future:
    """DDP communication hook that averages (or sums) each gradient bucket with ringreduce's ring.

    Register it with ``ddp.register_comm_hook(state, ringreduce.ddp_comm_hook)`` where `state` is
    None (the default group), a ``ProcessGroup``, a ringreduce.CommHookState (op, wire_dtype,
    predivide_factor, process_group), or another object with a ``process_group`` attribute (use the
    group DDP was built with). `bucket` is DDP's GradBucket: its buffer is reduced in place
    asynchronously (AVG: sum, then one division by the world size: no fp16 pre-division unless a
    predivide_factor asks for it) and the returned Future's value is the bucket tensor itself, as
    DDP requires. On CPU the Future is completed by ringreduce's worker thread; on GPUs the
    reduction runs on ringreduce's streams.
    """
    options = state if isinstance(state, CommHookState) else None
    group = state
    if options is not None:
        group = options.process_group
    elif state is not None and not isinstance(state, dist.ProcessGroup):
        group = getattr(state, "process_group", _NO_GROUP)
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            "ringreduce.ddp_comm_hook: state must be None, a torch.distributed.ProcessGroup, a "
            f"ringreduce.CommHookState or an object with a process_group attribute, got {type(state).__name__}"
        )
    buffer = bucket.buffer()
    o = _AVERAGE if options is None else options._options.for_buffer(buffer.dtype)
    work = run_all_reduce(buffer, group, o, True, CallKind.ALL_REDUCE)
    assert work is not None
    return work.get_future().then(lambda fut: fut.value()[0])


# DDP's register_comm_hook compares the annotations as objects; this module's postponed (string)
# annotations would be rejected ("bucket annotation should be dist.GradBucket").
ddp_comm_hook.__annotations__ = {
    "state": Any,
    "bucket": dist.GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}
