"""The GPU suite's exact sweeps (tests/gpu/sweeps.py), checked without a GPU: they cover every
dtype x op, the counts {0, 1, n-1, n+1, primes, 2**20+3} and tiny segments, and stay within an
exchange budget (Note [Sizing the GPU sweeps]): the GPU plans they enqueue, counted by
plan_summary, not timed."""

from __future__ import annotations

import pytest
import torch
from gpu.sweeps import (
    BIG,
    TINY_DTYPES,
    TINY_SEGMENT,
    all_gather_cases,
    all_reduce_cases,
    counts,
    reduce_scatter_cases,
)
from refdata import ALL_TYPES, OPS, supported

from ringreduce._native import C

# The plans are counted under the GPU rule before issue 24 (1 MiB segments, 2 MiB slots). The pipeline
# rule now (Note [GPU pipeline rule], csrc/cuda/gpu_pipeline.h) makes every lane's segments at least as
# large, and small calls one-shot, so these counts bound the exchanges each lane makes in turn.
SLOT_BYTES = 2 << 20
DEFAULT_SEGMENT = 1 << 20
# Exchanges per rank and test, at most (Note [Sizing the GPU sweeps]; the first sweeps had 230 588).
BUDGET = {"all_reduce": 6000, "reduce_scatter": 2500, "all_gather": 1000}


def _exchanges(n: int, numel: int, dtype: torch.dtype, segment: int | None, accum: bool = False,
               phases: int = 3) -> int:
    if numel == 0:
        return 0
    seg = min(segment or DEFAULT_SEGMENT, SLOT_BYTES)
    return max(C.plan_summary(n, r, numel, C.dtype_code(dtype), segment_bytes=seg, num_slots=4, accum_float32=accum,
                               gather_into_data=True, phases=phases)["num_exchanges"]
               for r in range(n))


def _pairs() -> set[tuple[torch.dtype, str]]:
    return {(d, op) for d in ALL_TYPES for op in OPS if supported(d, op)}


@pytest.mark.parametrize("n", [2, 3, 4])
def test_all_reduce_sweep_covers_and_fits(n):
    cases = all_reduce_cases(n)
    assert set(counts(n)) == {0, 1, n - 1, n + 1, 37, 1031, 65537, BIG}
    for dtype, op in _pairs():
        mine = {c.numel for c in cases if c.dtype == dtype and c.op == op and c.segment is None}
        assert set(counts(n)) <= mine, (dtype, op)
    for dtype in (torch.float16, torch.bfloat16):
        assert any(c.accum and c.dtype == dtype for c in cases)
    tiny = {(c.dtype, c.op) for c in cases if c.segment == TINY_SEGMENT}
    assert {(d, op) for d, op in _pairs() if d in TINY_DTYPES} <= tiny
    total = sum(_exchanges(n, c.numel, c.dtype, c.segment, c.accum) for c in cases)
    assert total <= BUDGET["all_reduce"], total


@pytest.mark.parametrize("n", [2, 3])
def test_halves_sweeps_cover_and_fit(n):
    rs = reduce_scatter_cases(n)
    assert {(c.dtype, c.op) for c in rs} == _pairs()
    assert any(c.segment == TINY_SEGMENT for c in rs)
    total = sum(_exchanges(n, n * c.numel, c.dtype, c.segment, phases=1) for c in rs)
    assert total <= BUDGET["reduce_scatter"], total
    ag = all_gather_cases(n)
    assert {c.dtype for c in ag} == set(ALL_TYPES)
    assert any(c.segment == TINY_SEGMENT for c in ag)
    total = sum(_exchanges(n, n * c.numel, c.dtype, c.segment, phases=2) for c in ag)
    assert total <= BUDGET["all_gather"], total
