"""A call's options, from the public arguments to the native struct: AllreduceOptions (what an
all-reduce asks for, checked once by its maker, and the rule of which options apply to a buffer of
which dtype, written once) and native_options, the one place a native CallOptions
(csrc/core/call_options.h) is made (ringreduce/_call.py checks the rest against each tensor;
docs/design.md section 2.5)."""

from __future__ import annotations

import math
import threading
from typing import Any

import torch

from ringreduce._config import Knobs
from ringreduce._native import C
from ringreduce._types import NATIVE_OPS, ReduceOp

ALGORITHMS = ("auto", "ring", "hierarchical", "direct")
SUM_OR_AVG = (ReduceOp.SUM, ReduceOp.AVG)
HALF_TYPES = (torch.float16, torch.bfloat16)
WIRE_TYPES = (torch.bfloat16, torch.float16)
_AVG_OR_SUM = {"avg": ReduceOp.AVG, "sum": ReduceOp.SUM}


def scaling_error(wire_dtype: Any, predivide_factor: Any, who: str = "ringreduce") -> BaseException | None:
    """The exception (TypeError/ValueError, its message starting with `who`) for a `wire_dtype` that is
    not torch.bfloat16/torch.float16/None or a `predivide_factor` that is not a finite number > 0 or
    None; None when both are acceptable before any tensor is seen."""
    if wire_dtype is not None and wire_dtype not in WIRE_TYPES:
        if not isinstance(wire_dtype, torch.dtype):
            return TypeError(f"{who}: wire_dtype must be torch.bfloat16, torch.float16 or None, got "
                             f"{type(wire_dtype).__name__}")
        return ValueError(f"{who}: wire_dtype must be torch.bfloat16 or torch.float16 (a 16-bit wire for float32 "
                          f"tensors), got {wire_dtype}")
    if predivide_factor is not None:
        if isinstance(predivide_factor, bool) or not isinstance(predivide_factor, (int, float)):
            return TypeError(f"{who}: predivide_factor must be a number > 0 or None, got "
                             f"{type(predivide_factor).__name__}")
        if not math.isfinite(predivide_factor) or predivide_factor <= 0:
            return ValueError(f"{who}: predivide_factor must be a finite number > 0, got {predivide_factor!r}")
    return None


def avg_or_sum(op: Any, who: str) -> ReduceOp:
    """"avg"/"sum" (or ReduceOp.AVG/SUM) as a ReduceOp, for the hooks; anything else is a ValueError
    naming `who`."""
    if isinstance(op, str) and op.strip().lower() in _AVG_OR_SUM:
        return _AVG_OR_SUM[op.strip().lower()]
    if isinstance(op, ReduceOp) and op in (ReduceOp.AVG, ReduceOp.SUM):
        return op
    raise ValueError(f"{who}: op must be \"avg\" or \"sum\", got {op!r}")


class AllreduceOptions:
    """What one all-reduce asks for besides its tensor and group: ringreduce.all_reduce's arguments, plus
    `extra_divisor` (GradientAverager's accumulation steps) and `wire_gather` (BackendOptions': 16, 32 or
    None). Made once by a caller of many calls and never changed: its identity keys the plans of
    repeated calls (Note [Fast path of a repeated call])."""

    __slots__ = ("op", "accum_dtype", "algorithm", "wire_dtype", "predivide_factor", "extra_divisor", "wire_gather",
                 "_buffers")

    def __init__(self, op: Any = ReduceOp.SUM, accum_dtype: Any = None, algorithm: Any = "auto", wire_dtype: Any = None,
                 predivide_factor: Any = None, *, extra_divisor: int = 1, wire_gather: Any = None) -> None:
        self.op, self.accum_dtype, self.algorithm = op, accum_dtype, algorithm
        self.wire_dtype, self.predivide_factor = wire_dtype, predivide_factor
        self.extra_divisor, self.wire_gather = extra_divisor, wire_gather
        self._buffers: dict[torch.dtype, AllreduceOptions] = {}

    def check(self, who: str) -> None:
        """Raises scaling_error's exception, if any, naming `who` (a constructor that keeps these options)."""
        error = scaling_error(self.wire_dtype, self.predivide_factor, who)
        if error is not None:
            raise error

    # Note [Options of a buffer]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~
    # A bucket, a packed dtype buffer or one tensor of a "ringreduce" group's call holds tensors of one
    # dtype. wire_dtype applies to float32 buffers only and accum_dtype=torch.float32 to float16/bfloat16
    # ones, the others being reduced as they are; any other accum_dtype is passed on, for all_reduce to
    # check as for one tensor. (A group's BackendOptions also leave the wire off ops other than SUM and
    # AVG: group-wide options apply to the calls they fit, a call's own arguments are checked.)
    def for_buffer(self, dtype: torch.dtype) -> AllreduceOptions:
        """The options a buffer of `dtype` is reduced with (Note [Options of a buffer]); one object per dtype."""
        options = self._buffers.get(dtype)
        if options is None:
            accum = None if self.accum_dtype == torch.float32 and dtype not in HALF_TYPES else self.accum_dtype
            wire = self.wire_dtype if dtype == torch.float32 else None
            options = AllreduceOptions(self.op, accum, self.algorithm, wire, self.predivide_factor,
                                       extra_divisor=self.extra_divisor,
                                       wire_gather=self.wire_gather if wire is not None else None)
            self._buffers[dtype] = options
        return options


# Canonical options of recent argument sets, so that a repeated call finds its plan by the options'
# identity (Note [Fast path of a repeated call] in ringreduce/_call.py); an argument that cannot be a
# key (unhashable) gets options of its own.
_interned: dict[tuple[Any, ...], AllreduceOptions] = {}
_interned_lock = threading.Lock()


def options_of(op: Any, accum_dtype: Any = None, algorithm: Any = "auto", wire_dtype: Any = None,
               predivide_factor: Any = None) -> AllreduceOptions:
    """The AllreduceOptions of ringreduce.all_reduce's arguments: one object per argument set (types
    included, so that True never stands for 1)."""
    key = (type(op), op, accum_dtype, algorithm, wire_dtype, type(predivide_factor), predivide_factor)
    try:
        options = _interned.get(key)
    except TypeError:
        return AllreduceOptions(op, accum_dtype, algorithm, wire_dtype, predivide_factor)
    if options is None:
        options = AllreduceOptions(op, accum_dtype, algorithm, wire_dtype, predivide_factor)
        with _interned_lock:
            if len(_interned) >= 256:
                _interned.clear()
            options = _interned.setdefault(key, options)
    return options


def native_options(call: Any, knobs: Knobs, is_cuda: bool, one_node: bool = True) -> Any:
    """The native CallOptions of one call (`call`: ringreduce._call.Call, what the checks decided) on a
    ring whose knobs are `knobs`, on a CUDA ring or a CPU ring (`one_node`: every rank of the CPU ring
    is on one node). Note [Call options] in csrc/core/call_options.h says which runtime reads what."""
    o = C.CallOptions()
    o.kind, o.op, o.local_error, o.ntensors = call.kind, NATIVE_OPS[call.rop], call.local_error, call.ntensors
    o.layout_hash = call.layout
    o.accum_float32, o.accum_narrow = call.accum, call.narrow
    o.wire_dtype, o.predivide, o.extra_divisor = call.wire, call.factor, call.extra_divisor
    o.local_size, o.one_shot, o.direct = call.local_size, call.one_shot, call.direct
    o.check, o.segment_bytes, o.num_slots = knobs.check_enabled(is_cuda), knobs.segment_bytes, knobs.num_slots
    if is_cuda:
        o.lanes, o.one_shot_bytes = knobs.lanes, knobs.one_shot_bytes
    else:
        o.timeout_ms = knobs.timeout_ms
        o.one_node, o.shm = one_node, knobs.shm
        o.node_order = list(call.members) if call.local_size else []
        # "16" always, "auto" where the ring spans several nodes, "32" never (Note [16-bit all-gather])
        o.wire_gather16 = call.wire is not None and (call.gather == "16" or (call.gather == "auto" and not one_node))
    return o
