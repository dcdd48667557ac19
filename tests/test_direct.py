"""algorithm="direct" (Note [Direct all-reduce], csrc/core/direct.h; docs/algorithm.md, "The direct
all-reduce"), over both CPU transports and ringreduce's NCCL ring: the reduce-scatter by direct exchange, each element's n
contributions added in rank order 0..n-1 (float16/bfloat16 SUM and AVG in float32, rounded once; a
float32 tensor's 16-bit wire rounding each contribution once), then the all-gather.

* Exact, position-dependent data: every dtype and op, 2-5 ranks, tiny segments (many rounds, few in
  flight), the one-shot's sizes, strided views: the float64 reference, bitwise, on every rank.
* Random data: bitwise the rank order reproduced in torch (refdata-style references below), the same
  bits over shared memory and gloo point-to-point and with "auto" for half types; against float64 in
  addition.
* The call path: "auto" picks direct for half-type SUM/AVG on a flat group; ranks that disagree on
  the algorithm raise on every rank; BackendOptions(algorithm="direct"); all_reduce_coalesced; the
  staging stays within the ring's bound.
* On real NCCL (marked gpu; skipped without a CUDA GPU): the exact sweep, the half types' rank order
  and the float32 wire, test_direct_on_nccl.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from gpu.gpu_ranks import world as gpu_world
from ranks import CPU_PLACES, SHM_ONLY, device, full_at, only_place, run_ranks
from refdata import bits_equal, exact_input, gather_inputs, reference, same_on_all_ranks, supported, types_for

import ringreduce as rr
from ringreduce._call import direct_chosen
from ringreduce._native import C
from ringreduce._types import ReduceOp

PLACES = CPU_PLACES  # conftest.py: every test at each place (Note [Places] in ranks.py)

HALF = (torch.float16, torch.bfloat16)
WIRES = {"bf16": torch.bfloat16, "fp16": torch.float16}


# ------------------------------------------------------------------------------------------------
# The reference: Note [Direct all-reduce] with torch ops


def rank_order(inputs: list[torch.Tensor], op: str, *, wire: torch.dtype | None = None, factor: float | None = None,
               narrow: bool = False, gather16: bool = False) -> torch.Tensor:
    """What the direct all-reduce computes from rank r's `inputs[r]` (floating dtypes, SUM/AVG): each
    contribution divided by `factor` (rounded to the tensor's dtype; with a 16-bit `wire`, then rounded
    to it), added in rank order in float32 (float64 for float64; the dtype itself with `narrow`), the sum
    divided once by n / factor (AVG) or multiplied by factor (SUM), rounded once; `gather16`: the result
    rounded once more through the wire."""
    dtype = inputs[0].dtype
    n = len(inputs)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    f = torch.tensor(factor, dtype=acc) if factor else None

    def contribution(x: torch.Tensor) -> torch.Tensor:
        c = (x.to(acc) / f).to(dtype) if f is not None else x
        return c.to(wire).to(acc) if wire is not None else c.to(acc)

    p = contribution(inputs[0])
    for x in inputs[1:]:
        p = contribution(x) + p
        if narrow:
            p = p.to(dtype).to(acc)
    if op == "avg":
        d = torch.tensor(n, dtype=acc) / f if f is not None else torch.tensor(n, dtype=acc)
        p = p / d
    elif f is not None:
        p = p * f
    out = p.to(dtype)
    if gather16:
        out = out.to(wire).to(dtype)
    return out


def random_inputs(n: int, numel: int, seed: int, dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(numel, generator=g) * (1 + r)).to(dtype) for r in range(n)]


def _reduce(t: torch.Tensor, op: str, **kwargs) -> None:
    if op == "avg":
        rr.all_reduce_avg(t, **kwargs)
    else:
        rr.all_reduce(t, op=op, **kwargs)


# ------------------------------------------------------------------------------------------------
# Exact data: every dtype and op


def _exact_sweep(rank: int, ws: int, transport: str, large: int) -> list[str]:
    failures = []
    for dtype in types_for(transport):
        for op in ("sum", "avg", "max", "min", "product"):
            if not supported(dtype, op):
                continue
            for numel in (1, ws - 1, ws + 1, 1003, large):
                if numel <= 0:
                    continue
                x = exact_input(numel, rank, dtype, op).to(device(rank))
                want = reference(gather_inputs(x), op)
                _reduce(x, op, algorithm="direct")
                if not bits_equal(x, want):
                    failures.append(f"{dtype} {op} numel={numel}: {int((x.cpu() != want).sum())} elements off")
                if not same_on_all_ranks(x):
                    failures.append(f"{dtype} {op} numel={numel}: ranks differ")
    return failures


@pytest.mark.parametrize("ws", [2, 3, 4, 5])
@pytest.mark.parametrize("segment", ["64", "default"])
@full_at("shm", ws=5)
@full_at("tcp", ws=4)
@full_at("tcp", ws=5)
def test_exact_every_dtype_and_op(ws, segment, place):
    """Tiny segments: many rounds of n - 1 pieces each, a few in flight; the default: the one-shot for
    the small counts, few rounds for the large."""
    env = {"RINGREDUCE_SEGMENT_BYTES": segment} if segment != "default" else {}
    res = run_ranks(ws, _exact_sweep, place, 2003 if env else 200_003, env=env, timeout=400)
    assert res[0] == [], "\n".join(res[0])


_VIEWS = {"transposed": lambda b: b.t(), "columns": lambda b: b[:, ::3], "offset": lambda b: b.view(-1)[5:3000]}


def _strided(rank: int, ws: int) -> list[str]:
    failures = []
    where = torch.arange(97 * 38).view(97, 38)
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        base = exact_input(97 * 38, rank, dtype, "sum").view(97, 38)
        for name, view in _VIEWS.items():
            before = base.clone()
            v = view(base)
            want = reference(gather_inputs(v.contiguous()), "sum")
            rr.all_reduce(v, op="sum", algorithm="direct")
            if not bits_equal(v.contiguous(), want):
                failures.append(f"{dtype} {name}: not the exact sum")
            outside = torch.ones(base.numel(), dtype=torch.bool)
            outside[view(where).reshape(-1)] = False
            if not bits_equal(base.reshape(-1)[outside], before.reshape(-1)[outside]):
                failures.append(f"{dtype} {name}: memory outside the view changed")
            base.copy_(before)
    return failures


@pytest.mark.parametrize("ws", [3])
def test_strided_views(ws):
    res = run_ranks(ws, _strided, env={"RINGREDUCE_SEGMENT_BYTES": "128"})
    assert res[0] == [], "\n".join(res[0])


# ------------------------------------------------------------------------------------------------
# Random data: the rank order, bitwise, on every transport


def _half_bits(rank: int, ws: int, large: int) -> list[str]:
    failures = []
    dev = device(rank)
    for dtype in HALF:
        for numel in (3, 1001, large):
            inputs = random_inputs(ws, numel, 11 + numel, dtype)
            for op in ("sum", "avg"):
                for algorithm, kwargs in (("direct", {}), ("auto", {}), ("auto", {"accum_dtype": torch.float32}),
                                          ("direct", {"accum_dtype": torch.float32}), ("direct", {"predivide_factor": 2.0})):
                    t = inputs[rank].to(dev, copy=True)
                    _reduce(t, op, algorithm=algorithm, **kwargs)
                    want = rank_order(inputs, op, factor=kwargs.get("predivide_factor"))
                    label = f"{dtype} {op} numel={numel} {algorithm} {kwargs}"
                    if not bits_equal(t, want):
                        failures.append(f"{label}: {int((t.cpu() != want).sum())} elements off the rank order")
                    if not same_on_all_ranks(t):
                        failures.append(f"{label}: ranks differ")
                # accum_dtype naming the tensor's own dtype: direct rounds every partial; auto keeps the ring
                t = inputs[rank].to(dev, copy=True)
                _reduce(t, op, algorithm="direct", accum_dtype=dtype)
                if not bits_equal(t, rank_order(inputs, op, narrow=True)):
                    failures.append(f"{dtype} {op} numel={numel}: narrow direct is not rounded per step")
            # the float32 sums of these inputs are exact: rounded once, the float64 sum's rounding
            exact = torch.stack([x.double() for x in inputs]).sum(0)
            if bool((exact.float().double() == exact).all()):
                t = inputs[rank].to(dev, copy=True)
                rr.all_reduce(t, op="sum")
                if not bits_equal(t, exact.to(dtype)):
                    failures.append(f"{dtype} numel={numel}: the default sum is not the correctly rounded one")
    return failures


@pytest.mark.parametrize("ws", [2, 3, 5])
@pytest.mark.parametrize("segment", ["96", "default"])
def test_half_types_add_in_rank_order_on_every_transport(ws, segment, place):
    """The same reference over shared memory and gloo point-to-point: the transport never changes a bit."""
    env = {"RINGREDUCE_SEGMENT_BYTES": segment} if segment != "default" else {}
    # 96-byte segments: 20,001 elements are hundreds of segments a piece (600,001 took 30-100 s over tcp)
    res = run_ranks(ws, _half_bits, 20_001 if env else 600_001, env=env, timeout=400)
    assert res[0] == [], "\n".join(res[0])


def _wire_bits(rank: int, ws: int, gather: str) -> list[str]:
    failures = []
    dev = device(rank)
    for numel in (5, 1009, 300_007):
        inputs = random_inputs(ws, numel, 7 + numel, torch.float32)
        for wire_name, wire in WIRES.items():
            for op, factor in (("avg", None), ("sum", 3.0), ("avg", 2.0)):
                t = inputs[rank].to(dev, copy=True)
                _reduce(t, op, algorithm="direct", wire_dtype=wire, predivide_factor=factor)
                want = rank_order(inputs, op, wire=wire, factor=factor, gather16=gather == "16")
                label = f"numel={numel} {op} {wire_name} f={factor} gather={gather}"
                if not bits_equal(t, want):
                    failures.append(f"{label}: {int((t.cpu() != want).sum())} elements off")
                if not same_on_all_ranks(t):
                    failures.append(f"{label}: ranks differ")
    return failures


@pytest.mark.parametrize("ws", [2, 4])
@pytest.mark.parametrize("gather", ["32", "16"])
def test_float32_wire_rounds_each_contribution_once(ws, gather, place):
    env = {"RINGREDUCE_WIRE_GATHER": gather, "RINGREDUCE_SEGMENT_BYTES": "4096"}
    res = run_ranks(ws, _wire_bits, gather, env=env, timeout=400)
    assert res[0] == [], "\n".join(res[0])


# On real NCCL, the place "cuda": the bodies above on ringreduce's NCCL ring (one group of sends and
# receives to every peer per round, then the in-order kernel: Note [Direct rounds on streams] in
# csrc/cuda/direct_executor.h) at the GPU suite's world size, with the default segments (an exchange
# costs milliseconds where ranks share a GPU: Note [Sizing the GPU sweeps] in tests/gpu/sweeps.py).
# Without a GPU the same code runs on the simulated device and the fake NCCL (tests/test_cuda_logic.py,
# test_cuda_ring_fake).
_ON_NCCL = {
    "exact": (_exact_sweep, ("cuda", 200_003), {}),
    "half-rank-order": (_half_bits, (600_001,), {}),
    "wire": (_wire_bits, ("32",), {"RINGREDUCE_WIRE_GATHER": "32"}),  # a GPU call has no 16-bit all-gather
}


@only_place("cuda")
@pytest.mark.parametrize("body", list(_ON_NCCL))
def test_direct_on_nccl(body, place):
    """Correct (exact data, every dtype of the sweep and op, bitwise) and rounded once (half types:
    the rank order in float32, rounded once, with auto, accum_dtype and predivide_factor; float32 with
    a 16-bit wire: each contribution rounded once), the same bits on every rank."""
    fn, args, env = _ON_NCCL[body]
    res = run_ranks(gpu_world(), fn, *args, env=env, timeout=240)
    assert res[0] == [], "\n".join(res[0])


def _random_float64(rank: int, ws: int) -> list[str]:
    """Within one rounding of the result (its dtype) plus the float32 (float64) sum's n - 1, relative to
    the magnitudes summed."""
    failures = []
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        inputs = random_inputs(ws, 50_001, 3, dtype)
        stack = torch.stack([t.double() for t in inputs])
        x = inputs[rank].clone()
        rr.all_reduce_avg(x, algorithm="direct")
        acc = torch.float64 if dtype == torch.float64 else torch.float32
        bound = (ws * torch.finfo(acc).eps + torch.finfo(dtype).eps) * stack.abs().sum(0) / ws
        worst = ((x.double() - stack.mean(0)).abs() / bound).max().item()
        if worst > 1.0:
            failures.append(f"{dtype}: an error {worst:.2f}x the bound")
    return failures


@pytest.mark.parametrize("ws", [3, 4])
def test_random_data_against_float64(ws):
    res = run_ranks(ws, _random_float64)
    assert res[0] == [], "\n".join(res[0])


# ------------------------------------------------------------------------------------------------
# The call path


@SHM_ONLY
def test_auto_picks_direct_for_half_sums_on_flat_groups():
    assert direct_chosen("auto", 8, 0, torch.bfloat16, ReduceOp.AVG, False)
    assert direct_chosen("auto", 8, 0, torch.float16, ReduceOp.SUM, False)
    assert not direct_chosen("auto", 8, 2, torch.bfloat16, ReduceOp.AVG, False)  # across nodes: hierarchical
    assert not direct_chosen("auto", 8, 0, torch.bfloat16, ReduceOp.AVG, True)  # accum_dtype=bfloat16: the ring
    assert not direct_chosen("auto", 8, 0, torch.bfloat16, ReduceOp.MAX, False)
    assert not direct_chosen("auto", 8, 0, torch.float32, ReduceOp.AVG, False)
    assert not direct_chosen("ring", 8, 0, torch.bfloat16, ReduceOp.AVG, False)
    assert direct_chosen("direct", 8, 0, torch.int8, ReduceOp.PRODUCT, False)
    assert not direct_chosen("auto", 65, 0, torch.bfloat16, ReduceOp.AVG, False)  # beyond the GPU kernel's 64 inputs
    assert direct_chosen("direct", 65, 0, torch.bfloat16, ReduceOp.AVG, False)


def _mismatch(rank: int, ws: int, dtype: torch.dtype, numel: int) -> str:
    t = torch.ones(numel, dtype=dtype)
    try:
        rr.all_reduce(t, algorithm="direct" if rank == 0 else "ring")
    except RuntimeError as exc:
        ok = torch.equal(t, torch.ones(numel, dtype=dtype))
        return str(exc) if ok else "tensor changed"
    return "no error"


@pytest.mark.parametrize("numel", [100, 300_000])
def test_ranks_that_disagree_on_the_algorithm_all_raise(numel, place):
    """One shot or not, shared memory or gloo: the frame tells direct from ring on every rank."""
    for msg in run_ranks(3, _mismatch, torch.float32, numel):
        assert "disagree" in msg and "algorithm" in msg and "algorithm=direct" in msg, msg
    for msg in run_ranks(3, _mismatch, torch.bfloat16, numel):  # "ring" vs "direct"; "auto" would be direct
        assert "disagree" in msg and "algorithm" in msg, msg


def _disagree_then_agree(rank: int, ws: int, how: str, numel: int) -> tuple[str, bool]:
    """Round 0 of a checked direct call leaves before the frames (Note [Direct before the verdict]):
    ranks that disagree on the size, or on the algorithm, still all raise with their tensors unchanged,
    and the next call is exact."""
    if how == "size":
        n, algorithm = (numel if rank != 1 else numel * 2 // 3), "direct"
    else:
        n, algorithm = numel, ("direct" if rank != 2 else "ring")
    t = torch.ones(n, dtype=torch.bfloat16)
    try:
        rr.all_reduce(t, algorithm=algorithm)
        first = "no error"
    except RuntimeError as exc:
        first = str(exc) if torch.equal(t, torch.ones(n, dtype=torch.bfloat16)) else "tensor changed"
    inputs = random_inputs(ws, numel + 7, 31, torch.bfloat16)
    x = inputs[rank].clone()
    rr.all_reduce(x, op="avg", algorithm="direct")
    return first, bits_equal(x, rank_order(inputs, "avg"))


@pytest.mark.parametrize("how", ["size", "algorithm"])
@pytest.mark.parametrize("numel", [300_000, 3_000_000])  # round 0 within directLeadRoom(3), and split (beyond it)
def test_leading_round_survives_a_disagreement(how, numel, place):
    for rank, (first, exact) in enumerate(run_ranks(3, _disagree_then_agree, how, numel)):
        assert "disagree" in first, (rank, first)
        assert exact, rank


def _backend_and_coalesced(rank: int, ws: int) -> dict:
    out = {}
    g = dist.new_group(backend="ringreduce", pg_options=rr.BackendOptions(algorithm="direct"))
    inputs = random_inputs(ws, 4001, 21, torch.bfloat16)
    x = inputs[rank].clone()
    dist.all_reduce(x, op=dist.ReduceOp.AVG, group=g)
    out["backend_direct"] = bits_equal(x, rank_order(inputs, "avg"))
    f = random_inputs(ws, 3001, 22, torch.float32)
    y = f[rank].clone()
    dist.all_reduce(y, group=g)
    out["backend_float32_direct"] = bits_equal(y, rank_order(f, "sum"))
    dist.destroy_process_group(g)
    a, b = inputs[rank].clone(), f[rank].clone()
    rr.all_reduce_coalesced([a, b], op="avg", algorithm="direct")
    out["coalesced"] = bits_equal(a, rank_order(inputs, "avg")) and bits_equal(b, rank_order(f, "avg"))
    return out


def test_backend_options_and_coalesced_take_direct(place):
    for rank, out in enumerate(run_ranks(3, _backend_and_coalesced)):
        assert all(out.values()), (rank, out)


def _staging(rank: int, ws: int) -> int:
    t = torch.ones(8 << 20, dtype=torch.bfloat16)  # 16 MiB
    rr.all_reduce(t, op="sum", algorithm="direct")
    assert bool((t == ws).all())
    return C.staging_bytes(dist.group.WORLD)


@pytest.mark.parametrize("ws", [2, 5])
def test_staging_stays_within_the_rings_bound(ws, place):
    for held in run_ranks(ws, _staging):
        assert held <= 8 << 20, held
