"""Half types in shared memory (Note [Half types in shared memory], csrc/cpu/shm_ring.h; docs/design.md
section 1.5): float16/bfloat16 SUM and AVG accumulate in float32 and round once by default, so the
result is the float64 sum of the inputs rounded once wherever the float32 sum is exact, bitwise the
same on every rank; accum_dtype naming the tensor's own dtype keeps the ring's per-hop rounding. Over
gloo point-to-point (RINGREDUCE_SHM=0) the default is the same: "auto" takes the direct all-reduce
there (Note [Direct all-reduce], csrc/core/direct.h; tests/test_direct.py compares the bits).

The data is position-dependent and finer than the partial sums' precision: 1 + k / 2^(m+1) (m the
mantissa bits), rounded to the dtype, summed over up to 4 ranks: exact in float32, but a partial of
two of them already needs one bit more than the dtype has, so per-hop rounding differs from rounding
once on most elements of 3 and 4 ranks (checked below, so the test can tell them apart)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from ranks import run_ranks

import ringreduce as rr
from ringreduce._native import C

HALF = {"bfloat16": torch.bfloat16, "float16": torch.float16}
MANTISSA = {torch.bfloat16: 7, torch.float16: 10}
# Sizes: a one-shot-sized tensor, one of several 1 MiB pieces whose pieces are split between the
# ranks (n > 2), and fewer elements than ranks.
SIZES = (3, 1001, 600_001)


def _inputs(rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    i = torch.arange(numel, dtype=torch.float64)
    return (1.0 + ((i * 13 + rank * 7 + 5) % 251) / 2.0 ** (MANTISSA[dtype] + 1)).to(dtype)


def _everyone(ws: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.stack([_inputs(r, numel, dtype) for r in range(ws)])


def _once(stack: torch.Tensor, op: str) -> torch.Tensor:
    """The float64 result rounded once to the inputs' dtype."""
    total = stack.double().sum(0)
    return (total / stack.shape[0] if op == "avg" else total).to(stack.dtype)


def _per_hop(stack: torch.Tensor, rank: int, op: str) -> torch.Tensor:
    """The ring's per-hop rounding: chunk c starts at rank c, each later rank adds in float32 and the
    partial is rounded to the dtype; AVG divides the rounded sum by n in float32, rounded once."""
    ws, numel = stack.shape
    out = torch.empty(numel, dtype=stack.dtype)
    for c, (b, e) in enumerate(C.plan_summary(ws, rank, numel, C.dtype_code(stack.dtype))["chunks"]):
        if b == e:
            continue
        partial = stack[c, b:e]
        for k in range(1, ws):
            partial = (stack[(c + k) % ws, b:e].float() + partial.float()).to(stack.dtype)
        out[b:e] = (partial.float() / ws).to(stack.dtype) if op == "avg" else partial
    return out


def _same_on_all_ranks(t: torch.Tensor) -> bool:
    bits = t.view(torch.int16).to(torch.int32)  # gloo gathers no int16
    gathered = [torch.empty_like(bits) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, bits)
    return all(torch.equal(g, bits) for g in gathered)


def _reduce(t: torch.Tensor, op: str, accum: torch.dtype | None) -> None:
    if op == "avg":
        rr.all_reduce_avg(t, accum_dtype=accum)
    else:
        rr.all_reduce(t, op="sum", accum_dtype=accum)


def _half_results(rank: int, ws: int, narrow: bool) -> list[str]:
    """Failures of every (dtype, op, size): default (or narrow: accum_dtype = the tensor's dtype)
    against rounding once and against per-hop rounding, and bitwise agreement across ranks."""
    failures = []
    for name, dtype in HALF.items():
        for numel in SIZES:
            stack = _everyone(ws, numel, dtype)
            for op in ("sum", "avg"):
                t = _inputs(rank, numel, dtype)
                _reduce(t, op, dtype if narrow else None)
                once, hops = _once(stack, op), _per_hop(stack, rank, op)
                # "shm", or "shm; node stages: ..." once a hierarchical call ran on the group
                shm = C.transport_info(dist.group.WORLD, []).split(";")[0] == "shm"
                want = hops if narrow else once
                if not torch.equal(t.view(torch.int16), want.view(torch.int16)):
                    off = int((t != want).sum())
                    failures.append(f"{name} {op} numel={numel} transport={'shm' if shm else 'tcp'} narrow={narrow}: "
                                    f"{off} elements off the {'per-hop' if want is hops else 'rounded-once'} result")
                if not _same_on_all_ranks(t):
                    failures.append(f"{name} {op} numel={numel}: ranks differ")
                if ws > 2 and numel > 1000 and op == "sum" and int((once != hops).sum()) < numel // 10:
                    failures.append(f"{name} numel={numel}: the data does not tell rounding once from per hop")
    return failures


@pytest.mark.parametrize("ws", [2, 3, 4])
def test_half_types_round_once_in_shared_memory_by_default(ws):
    res = run_ranks(ws, _half_results, False, transport="shm", timeout=240)
    assert res[0] == [], "\n".join(res[0])


def test_accum_dtype_of_the_tensor_keeps_per_hop_rounding_in_shared_memory():
    res = run_ranks(3, _half_results, True, transport="shm", timeout=240)
    assert res[0] == [], "\n".join(res[0])


@pytest.mark.parametrize("ws", [3, 4])
def test_gloo_point_to_point_rounds_once_by_default(ws):
    res = run_ranks(ws, _half_results, False, transport="tcp", timeout=240)
    assert res[0] == [], "\n".join(res[0])


def _mixed_accumulation(rank: int, ws: int) -> str:
    t = _inputs(rank, 100, torch.bfloat16)
    try:
        rr.all_reduce(t, accum_dtype=torch.bfloat16 if rank == 0 else None)
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def test_ranks_that_disagree_on_narrow_accumulation_all_raise():
    """accum_dtype=<the tensor's dtype> on one rank and None on another would give different bits in
    shared memory: the agreement frame carries it, and every rank raises."""
    for msg in run_ranks(2, _mixed_accumulation, transport="shm"):
        assert "disagree" in msg and "accum_dtype=bfloat16" in msg, msg
