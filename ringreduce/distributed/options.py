"""BackendOptions: the ring options of every call on one "ringreduce" process group (its pg_options)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from ringreduce._options import ALGORITHMS, SUM_OR_AVG, WIRE_TYPES, AllreduceOptions
from ringreduce._types import ReduceOp


@dataclass(frozen=True)
class BackendOptions:
    """Options of a process group created with backend "ringreduce", passed as its ``pg_options``.

    ``dist.new_group(ranks, backend="ringreduce", pg_options=ringreduce.BackendOptions(...))`` (or
    ``init_process_group("ringreduce", pg_options=...)``) applies them to every ring call of that
    group, as if each ``ringreduce.all_reduce`` had been given them. They are checked once, here;
    each applies to the calls it fits and the others run without it:

    Args:
        accum_dtype: None, or ``torch.float32``: float16/bfloat16 tensors' partial sums travel and
            add in float32 and round once (all_reduce, all_reduce_coalesced); other dtypes ignore it.
        wire_dtype: None, ``torch.bfloat16`` or ``torch.float16``: float32 SUM/AVG all-reduces send
            their reduce-scatter partials as 16-bit values, each hop adding in float32 (see
            ``ringreduce.all_reduce``); other dtypes, ops and the reduce-scatter/all-gather
            collectives ignore it. With "hierarchical", CUDA calls refuse it as ``ringreduce.all_reduce``
            does (GPUs carry the wire on the flat ring only).
        wire_gather: None (default: the ``RINGREDUCE_WIRE_GATHER`` knob), 16 or 32: the width of the
            all-gather of a 16-bit wire in this group's all_reduce calls (16: the owner rounds its
            finished shard once to the wire type and the all-gather moves those 16 bits; CPU only,
            CUDA calls refuse it; all_reduce_coalesced follows the knob).
        algorithm: "auto" (default), "ring", "hierarchical" or "direct", as ``ringreduce.all_reduce``'s.

    Raises:
        TypeError: a field of the wrong type (a dtype that is not a ``torch.dtype``).
        ValueError: an accum_dtype other than float32, a wire_dtype other than bfloat16/float16, a
            wire_gather other than 16/32/None, or an unknown algorithm.
    """

    accum_dtype: torch.dtype | None = None
    wire_dtype: torch.dtype | None = None
    algorithm: str = "auto"
    wire_gather: int | None = None

    def __post_init__(self) -> None:
        for name in ("accum_dtype", "wire_dtype"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, torch.dtype):
                raise TypeError(f"ringreduce.BackendOptions: {name} must be a torch.dtype or None, got {value!r}")
        if self.accum_dtype is not None and self.accum_dtype != torch.float32:
            raise ValueError(
                f"ringreduce.BackendOptions: accum_dtype must be torch.float32 or None, got {self.accum_dtype} "
                "(float16/bfloat16 partial sums then travel in float32)"
            )
        if self.wire_dtype is not None and self.wire_dtype not in WIRE_TYPES:
            raise ValueError(
                f"ringreduce.BackendOptions: wire_dtype must be torch.bfloat16, torch.float16 or None, got "
                f"{self.wire_dtype}"
            )
        if self.wire_gather is not None and (isinstance(self.wire_gather, bool) or self.wire_gather not in (16, 32)):
            raise ValueError(
                f"ringreduce.BackendOptions: wire_gather must be 16, 32 or None, got {self.wire_gather!r}"
            )
        if self.algorithm not in ALGORITHMS:
            raise ValueError(
                f"ringreduce.BackendOptions: algorithm must be one of {ALGORITHMS}, got {self.algorithm!r}"
            )

    @functools.lru_cache(maxsize=8)  # noqa: B019 - the options are frozen and live as long as their group
    def coalesced_options(self, op: ReduceOp) -> AllreduceOptions:
        """The group's options of a call with `op`: one object per op (repeated calls take their plans),
        the wire left off ops other than SUM and AVG (group-wide options apply to the calls they fit);
        each dtype's buffer then takes what fits it (AllreduceOptions.for_buffer, Note [Options of a
        buffer] in ringreduce/_options.py)."""
        wire = self.wire_dtype if op in SUM_OR_AVG else None
        return AllreduceOptions(op, self.accum_dtype, self.algorithm, wire,
                                wire_gather=self.wire_gather if wire is not None else None)

    def allreduce_options(self, op: ReduceOp, dtype: torch.dtype) -> AllreduceOptions:
        """The options of the group's all-reduce of one `dtype` tensor with `op` (one object per op and
        dtype): coalesced_options(op).for_buffer(dtype)."""
        return self.coalesced_options(op).for_buffer(dtype)

    @classmethod
    def from_pg_options(cls, pg_options: Any) -> BackendOptions:
        """The options of a group created with `pg_options`: None gives the defaults; a BackendOptions is
        used as is; anything else raises TypeError."""
        if pg_options is None:
            return cls()
        if isinstance(pg_options, cls):
            return pg_options
        raise TypeError(
            'ringreduce: pg_options of a "ringreduce" group must be a ringreduce.BackendOptions or None, got '
            f"{type(pg_options).__name__}"
        )
