"""The GPU suite's exact sweeps as data: which (dtype, op, count, segment size) cases each runs.

Note [Sizing the GPU sweeps]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
On a GPU every exchange of the ring is one grouped ncclSend/ncclRecv launched from the host, so a
sweep costs about (exchanges x per-exchange latency). The sweeps first written for the GPU copied
the CPU suite's habit of a 64-byte segment at every count: 230 588 exchanges per rank for the
all-reduce sweep at 2 ranks (337 428 at 3), 13 156 for reduce_scatter, 3 774 for all_gather. On one
GPU shared by the ranks (NCCL's socket transport, GPU time-slicing between processes) the first GPU
run's own timings imply about 2 ms per exchange at 2 ranks and 4.5 ms at 3 (docs/performance.md),
so that sweep alone would have taken minutes; it did not finish in 90 s. Coverage does not need
that: every dtype x op x count runs at the default segment size (few segments per call), the
counts {0, 1, n-1, n+1, primes, 2**20+3} included; tiny segments (many segments, every staging slot
reused many times, chunk bounds that do not align with segments) run on a few dtypes of each
element size and on counts that give dozens of segments, not thousands. tests/test_gpu_sweeps.py
checks both the coverage and the exchange budget of these lists (plan_summary counts exchanges), so
a later edit cannot silently make the suite minutes longer again.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from refdata import ALL_TYPES, OPS, supported

HALF = (torch.float16, torch.bfloat16)
TINY_SEGMENT = 64  # bytes: many segments per call
SMALL_SEGMENT = 4096
# One dtype per element size (1, 2, 4, 8, 16 bytes) and bool: the tiny-segment cases.
TINY_DTYPES = (torch.int8, torch.bool, torch.bfloat16, torch.float32, torch.int64, torch.complex128)
BIG = 2**20 + 3  # several 1 MiB segments per chunk for the wide dtypes


def counts(n: int) -> list[int]:
    """{0, 1, n-1, n+1, primes, 2**20+3} for a ring of n."""
    return sorted({0, 1, max(1, n - 1), n + 1, 37, 1031, 65537, BIG})


@dataclass(frozen=True)
class Case:
    dtype: torch.dtype
    op: str
    numel: int  # all-reduce: elements; reduce_scatter: elements per block; all_gather: elements per rank
    segment: int | None  # RINGREDUCE_SEGMENT_BYTES; None: the default (1 MiB)
    accum: bool = False  # accum_dtype=torch.float32 (half types)
    shape: tuple[int, ...] | None = None  # all_gather: the input's shape


def _accums(dtype: torch.dtype) -> tuple[bool, ...]:
    return (False, True) if dtype in HALF else (False,)


def all_reduce_cases(n: int) -> list[Case]:
    cases = []
    for dtype in ALL_TYPES:
        for op in OPS:
            if not supported(dtype, op):
                continue
            for accum in _accums(dtype):
                cases += [Case(dtype, op, numel, None, accum) for numel in counts(n)]
                if dtype in TINY_DTYPES:
                    cases += [Case(dtype, op, numel, TINY_SEGMENT, accum) for numel in (n + 1, 37, 131)]
    # many segments of a mid size: the staging slots are reused dozens of times within one call
    cases += [Case(torch.float64, op, 65537, SMALL_SEGMENT) for op in ("sum", "avg")]
    cases.append(Case(torch.bfloat16, "avg", 65537, SMALL_SEGMENT, True))
    return cases


def reduce_scatter_cases(n: int) -> list[Case]:
    cases = []
    for dtype in ALL_TYPES:
        for op in OPS:
            if not supported(dtype, op):
                continue
            cases += [Case(dtype, op, blk, None) for blk in (1, 3, 37, 4099)]
            if dtype in TINY_DTYPES:
                cases += [Case(dtype, op, blk, TINY_SEGMENT) for blk in (3, 37)]
    cases.append(Case(torch.float32, "sum", 4099, TINY_SEGMENT))
    return cases


SHAPES = ((), (1,), (37,), (5, 7), (4099,))


def _numel(shape: tuple[int, ...]) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


def all_gather_cases(n: int) -> list[Case]:
    cases = []
    for dtype in ALL_TYPES:
        for shape in SHAPES:
            cases.append(Case(dtype, "sum", _numel(shape), None, shape=shape))
        if dtype in TINY_DTYPES:
            cases += [Case(dtype, "sum", _numel(s), TINY_SEGMENT, shape=s) for s in ((37,), (5, 7))]
    return cases
