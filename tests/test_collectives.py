"""Correctness of ringreduce.all_reduce on CPU ranks over gloo (world sizes 1-5)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.distributed as dist
from ranks import CPU_PLACES, SHM_ONLY, full_at, place_cases, run_ranks, spawn_ranks
from refdata import (
    OPS,
    bits_equal,
    exact_input,
    gather_inputs,
    reference,
    same_on_all_ranks,
    supported,
    types_for,
)

import ringreduce as rr

PLACES = CPU_PLACES  # conftest.py: every test at each place (Note [Places] in ranks.py)

TINY_SEGMENTS = {"RINGREDUCE_SEGMENT_BYTES": "16", "RINGREDUCE_SLOTS": "2"}


def counts_for(n: int) -> list[int]:
    return sorted({0, 1, max(n - 1, 0), n + 1, 7, 13, 31, 97})


# ---------------------------------------------------------------------------------------------
# Exact data, every dtype x op x count, tiny segments


def _exact_sweep(rank: int, ws: int, counts: list[int], dtypes: list[str]) -> list[str]:
    failures = []
    for dname in dtypes:
        dtype = getattr(torch, dname)
        for op in OPS:
            if not supported(dtype, op):
                continue
            for numel in counts:
                t = exact_input(numel, rank, dtype, op)
                expected = reference(gather_inputs(t), op)
                rr.all_reduce(t, op=op)
                if not bits_equal(t, expected):
                    bad = (t != expected).nonzero()[:3].flatten().tolist() if t.numel() else []
                    failures.append(f"{dname} {op} numel={numel}: first bad positions {bad}")
                elif not same_on_all_ranks(t):
                    failures.append(f"{dname} {op} numel={numel}: ranks differ")
    return failures


# Every dtype and world size over shm; over tcp (ranks.py's Note [Places]) 2 ranks (one peer
# on both sides), 3 and 5, refdata.TCP_TYPES. 1 rank never uses a transport (shared memory needs 2).
@place_cases("ws", [1, 2, 3, 4, 5], tcp=[2, 3, 5], full=[("shm", 4), ("shm", 5), ("tcp", 5)])
def test_exact_every_dtype_op_count(ws, place):
    dtypes = [str(d).replace("torch.", "") for d in types_for(place)]
    results = run_ranks(ws, _exact_sweep, counts_for(ws), dtypes, env=TINY_SEGMENTS)
    assert results[0] == [], "\n".join(results[0])
    results = run_ranks(ws, _exact_sweep, [1000, 4099], dtypes, env={"RINGREDUCE_SEGMENT_BYTES": "512"})
    assert results[0] == [], "\n".join(results[0])


@place_cases("ws", [2, 3], tcp=[3], full=[("shm", 2), ("tcp", 3)])  # tcp with 2 ranks, many segments: test_exact_every_dtype_op_count
def test_exact_large_uneven(ws):
    # 2**20 + 3 elements: uneven chunks, many segments at the default segment size and at 4 KiB
    for env in ({}, {"RINGREDUCE_SEGMENT_BYTES": "4096"}):
        res = run_ranks(ws, _exact_sweep, [2**20 + 3], ["float32", "bfloat16", "int8", "complex128"], env=env)
        assert res[0] == [], "\n".join(res[0])


# ---------------------------------------------------------------------------------------------
# Random data against torch.distributed.all_reduce, with tolerances


def _random_vs_torch(rank: int, ws: int, numel: int) -> list[str]:
    failures = []
    gen = torch.Generator().manual_seed(1234 + rank)
    for dtype in (torch.float32, torch.float64):
        for op, dop in (("sum", dist.ReduceOp.SUM), ("max", dist.ReduceOp.MAX), ("min", dist.ReduceOp.MIN),
                        ("product", dist.ReduceOp.PRODUCT), ("avg", None)):
            x = torch.rand(numel, generator=gen, dtype=torch.float64).to(dtype) + 0.5
            ours = x.clone()
            rr.all_reduce(ours, op=op)
            ref = x.clone()
            dist.all_reduce(ref, op=dop if dop is not None else dist.ReduceOp.SUM)
            if op == "avg":
                ref /= ws
            tol = 1e-5 if dtype == torch.float32 else 1e-12
            if not torch.allclose(ours, ref, rtol=tol, atol=tol):
                failures.append(f"{dtype} {op}: max err {(ours - ref).abs().max().item()}")
            if not same_on_all_ranks(ours):
                failures.append(f"{dtype} {op}: ranks differ")
    return failures


@pytest.mark.parametrize("ws", [2, 3, 4])
@full_at("tcp", ws=4)
def test_random_matches_torch_distributed(ws):
    for numel in (1, 1001, 300_007):
        res = run_ranks(ws, _random_vs_torch, numel)
        assert res[0] == [], "\n".join(res[0])


def _half_random(rank: int, ws: int) -> list[str]:
    failures = []
    gen = torch.Generator().manual_seed(99 + rank)
    for dtype in (torch.float16, torch.bfloat16):
        x = (torch.randn(5003, generator=gen) * 3).to(dtype)
        stack = gather_inputs(x).double()
        for accum in (None, torch.float32):
            t = x.clone()
            rr.all_reduce_avg(t, accum_dtype=accum)
            exact = stack.sum(0) / ws
            err = (t.double() - exact).abs().max().item()
            # one rounding per hop at most: n ulps of the largest partial
            bound = ws * (2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11) * (stack.abs().sum(0).max().item())
            if err > bound:
                failures.append(f"{dtype} accum={accum}: err {err} > {bound}")
            if not same_on_all_ranks(t):
                failures.append(f"{dtype} accum={accum}: ranks differ")
    return failures


@pytest.mark.parametrize("ws", [3, 4])
def test_half_types_random_within_rounding(ws):
    res = run_ranks(ws, _half_random)
    assert res[0] == [], "\n".join(res[0])


# ---------------------------------------------------------------------------------------------
# Rounding semantics: hop-by-hop rounding vs accum_dtype=float32, AVG == SUM then div_


def _ring_rounding(rank: int, ws: int) -> list[str]:
    failures = []
    numel = 257
    # values chosen so that bf16 partial sums round: 1 + small fractions
    i = torch.arange(numel, dtype=torch.float64)
    x64 = 1.0 + ((i * 13 + rank * 7) % 64) / 512.0
    x = x64.to(torch.bfloat16)
    stack = gather_inputs(x)
    summary = rr._C.plan_summary(ws, rank, numel, rr._C.dtype_code(torch.bfloat16))
    chunks = summary["chunks"]
    # Expected without accum: chunk c starts at rank c and each later rank adds in bf16 (rounded).
    expected = torch.empty(numel, dtype=torch.bfloat16)
    for c, (b, e) in enumerate(chunks):
        if b == e:
            continue
        partial = stack[c, b:e]
        for k in range(1, ws):
            partial = (stack[(c + k) % ws, b:e].float() + partial.float()).to(torch.bfloat16)
        expected[b:e] = partial
    # By default it accumulates in float32 and rounds once on both transports (in shared memory, Note
    # [Half types in shared memory]; over gloo point-to-point the direct all-reduce "auto" takes, Note
    # [Direct all-reduce]: its rank order gives the same bits where the float32 sum is exact, as
    # here); accum_dtype=bfloat16 asks for every hop.
    once = torch.empty(numel, dtype=torch.bfloat16)
    once32 = torch.empty(numel, dtype=torch.float32)
    for c, (b, e) in enumerate(chunks):
        if b == e:
            continue
        acc = stack[c, b:e].float()
        for k in range(1, ws):
            acc = stack[(c + k) % ws, b:e].float() + acc
        once[b:e] = acc.to(torch.bfloat16)
        once32[b:e] = acc
    t = x.clone()
    rr.all_reduce(t, op="sum")
    if not bits_equal(t, once):
        failures.append("bf16 SUM is not the rounded-once sum")
    t1 = x.clone()
    rr.all_reduce(t1, op="sum", accum_dtype=torch.bfloat16)
    if not bits_equal(t1, expected):
        failures.append("bf16 SUM with accum_dtype=bfloat16 is not the hop-by-hop rounded ring sum")
    # With float32 partials the sum is rounded once: the correctly rounded float32 sum.
    t2 = x.clone()
    rr.all_reduce(t2, op="sum", accum_dtype=torch.float32)
    if not bits_equal(t2, once):
        failures.append("bf16 SUM with accum_dtype=float32 is not rounded once")
    # AVG == SUM then div_ (no pre-multiplication bias) where the sum is rounded to bf16; the float32
    # sum divided once where it is not.
    t3 = x.clone()
    rr.all_reduce_avg(t3)
    if not bits_equal(t3, (once32 / ws).to(torch.bfloat16)):
        failures.append("bf16 AVG != all_reduce(SUM).div_(n)")
    t5 = x.clone()
    rr.all_reduce_avg(t5, accum_dtype=torch.bfloat16)
    if not bits_equal(t5, expected.clone().div_(ws)):
        failures.append("bf16 AVG with accum_dtype=bfloat16 != all_reduce(SUM).div_(n)")
    t4 = x.to(torch.float32)
    s4 = t4.clone()
    rr.all_reduce_avg(t4)
    rr.all_reduce(s4)
    if not bits_equal(t4, s4.div_(ws)):
        failures.append("fp32 AVG != all_reduce(SUM).div_(n)")
    return failures


@pytest.mark.parametrize("ws", [3, 5])
def test_rounding_semantics(ws):
    res = run_ranks(ws, _ring_rounding, env={"RINGREDUCE_SEGMENT_BYTES": "64"})
    assert res[0] == [], "\n".join(res[0])


def _segment_independence(rank: int, ws: int) -> bool:
    import os

    gen = torch.Generator().manual_seed(7 + rank)
    x = torch.randn(10_007, generator=gen)
    results = []
    for seg in ("16", "128", "4096", str(1 << 20)):
        os.environ["RINGREDUCE_SEGMENT_BYTES"] = seg
        rr.reload_knobs()  # the rings read their knobs again (ringreduce/_config.py)
        t = x.clone()
        rr.all_reduce(t)
        results.append(t)
    os.environ.pop("RINGREDUCE_SEGMENT_BYTES")
    rr.reload_knobs()  # the rings read their knobs again (ringreduce/_config.py)
    return all(bits_equal(results[0], r) for r in results[1:]) and same_on_all_ranks(results[0])


def test_result_independent_of_segment_size():
    assert all(run_ranks(3, _segment_independence))


# ---------------------------------------------------------------------------------------------
# Layouts: strides, views, offsets, transposes, channels_last; ranks may differ in layout


def _layouts(rank: int, ws: int) -> list[str]:
    failures = []
    # column slice of a row-major base: neighbours must stay untouched
    base = torch.arange(60, dtype=torch.float32).reshape(6, 10) + rank * 100
    before = base.clone()
    col = base[:, 1]
    expected = reference(gather_inputs(col.contiguous()), "sum")
    rr.all_reduce(col)
    if not torch.equal(col, expected):
        failures.append("column slice: wrong values")
    mask = torch.ones_like(base, dtype=torch.bool)
    mask[:, 1] = False
    if not torch.equal(base[mask], before[mask]):
        failures.append("column slice: memory outside the view was modified")
    # transposed, storage offset, channels_last, stepped slices
    x = exact_input(4 * 6 * 5 * 3, rank, torch.float32, "sum").reshape(4, 6, 5, 3)
    cases = {
        "transposed": lambda t: t.reshape(24, 15).t(),
        "offset": lambda t: t.reshape(-1)[7:200],
        "channels_last": lambda t: t.contiguous(memory_format=torch.channels_last),
        "stepped": lambda t: t[:, ::2, 1:, ::2],
        "permuted": lambda t: t.permute(3, 1, 0, 2),
    }
    for name, make in cases.items():
        v = make(x.clone())
        expected = reference(gather_inputs(v.contiguous()), "sum")
        rr.all_reduce(v)
        if not torch.equal(v, expected):
            failures.append(f"{name}: wrong values")
    # ranks differ in layout: even ranks contiguous, odd ranks a transposed view of the same values
    logical = exact_input(8 * 9, rank, torch.float64, "sum").reshape(8, 9)
    v = logical.clone() if rank % 2 == 0 else logical.t().contiguous().t()
    expected = reference(gather_inputs(logical), "sum")
    rr.all_reduce(v)
    if not torch.equal(v, expected):
        failures.append("mixed layouts across ranks: wrong values")
    # conj view (complex)
    z = exact_input(33, rank, torch.complex64, "sum")
    zc = z.conj()
    expected = reference(gather_inputs(zc.resolve_conj()), "sum")
    rr.all_reduce(zc)
    if not torch.equal(zc.resolve_conj(), expected):
        failures.append("conj view: wrong values")
    return failures


@pytest.mark.parametrize("ws", [2, 3])
def test_non_contiguous_layouts(ws):
    res = run_ranks(ws, _layouts, env={"RINGREDUCE_SEGMENT_BYTES": "32"})
    assert res[0] == [] and res[-1] == [], "\n".join(res[0] + res[-1])


# ---------------------------------------------------------------------------------------------
# Groups: subgroups, non-members, disjoint groups concurrently


def _subgroups(rank: int, ws: int) -> dict:
    out = {}
    g02 = dist.new_group([0, 2])
    g13 = dist.new_group([1, 3])
    odd_even = g02 if rank in (0, 2) else g13
    t = torch.full((1001,), float(rank + 1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        other = g13 if rank in (0, 2) else g02
        u = torch.full((5,), 7.0)
        res = rr.all_reduce(u, group=other)
        out["non_member_unchanged"] = bool(torch.equal(u, torch.full((5,), 7.0))) and res is None
        out["non_member_warned"] = any("not a member" in str(w.message) for w in caught)
    # disjoint groups at the same time, asynchronously
    w1 = rr.all_reduce(t, group=odd_even, async_op=True)
    t2 = torch.full((77,), float(rank))
    w2 = rr.all_reduce(t2, async_op=True)  # WORLD, concurrently
    w1.wait()
    w2.wait()
    members = [0, 2] if rank in (0, 2) else [1, 3]
    out["subgroup_sum"] = bool(torch.equal(t, torch.full((1001,), float(sum(m + 1 for m in members)))))
    out["world_sum"] = bool(torch.equal(t2, torch.full((77,), float(sum(range(ws))))))
    # a subgroup average
    a = torch.full((10,), float(rank))
    rr.all_reduce_avg(a, group=odd_even)
    out["subgroup_avg"] = bool(torch.equal(a, torch.full((10,), sum(members) / 2.0)))
    return out


def test_subgroups_and_non_members():
    for r in run_ranks(4, _subgroups):
        assert all(r.values()), r


def _reinitialized_world(rank: int, ws: int, second_init_file: str) -> list[float]:
    # ringreduce keeps each process group's GroupInfo (and runtime): a new world after
    # destroy_process_group must get its own, never the destroyed group's.
    t = torch.full((1000,), float(rank + 1))
    rr.all_reduce_avg(t)
    first = float(t[0])
    dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"file://{second_init_file}", rank=rank, world_size=ws)
    t = torch.full((1000,), float(10 * (rank + 1)))
    rr.all_reduce_avg(t)
    pair = dist.new_group([0, 1])
    u = torch.full((10,), float(rank + 1))
    rr.all_reduce(u, group=pair)
    out = [first, float(t[0]), float(u[0])]
    dist.destroy_process_group()
    return out


@full_at("tcp")
def test_a_new_world_after_destroy_process_group(tmp_path):
    ws = 3
    out = spawn_ranks(ws, _reinitialized_world, str(tmp_path / "second_init"), timeout=120)
    mean = sum(range(1, ws + 1)) / ws
    for rank, (status, result, code) in enumerate(out):
        assert status == "ok" and code == 0, (rank, status, code, result)
        assert result[0] == mean and result[1] == 10 * mean, (rank, result)
        assert result[2] == (3.0 if rank < 2 else rank + 1), (rank, result)


def _async_reverse(rank: int, ws: int) -> bool:
    tensors = [torch.full((100 + 37 * k,), float(rank + k)) for k in range(16)]
    works = [rr.all_reduce(t, async_op=True) for t in tensors]
    ok = True
    for k in reversed(range(16)):
        assert works[k].wait() is True
        ok &= works[k].is_completed()
        expected = float(sum(r + k for r in range(ws)))
        ok &= bool(torch.equal(tensors[k], torch.full_like(tensors[k], expected)))
    # futures hold [tensor], like torch.distributed's
    t = torch.ones(10)
    fut = rr.all_reduce(t, async_op=True).get_future()
    value = fut.wait()
    ok &= isinstance(value, list) and value[0] is t and bool(torch.equal(t, torch.full((10,), float(ws))))
    chained = rr.all_reduce(torch.ones(3), async_op=True).get_future().then(lambda f: f.value()[0] * 2)
    ok &= bool(torch.equal(chained.wait(), torch.full((3,), 2.0 * ws)))
    return ok


def test_sixteen_async_handles_waited_in_reverse():
    assert all(run_ranks(3, _async_reverse))


def _interleaved(rank: int, ws: int, calls: int) -> bool:
    ok = True
    for i in range(calls):
        t = torch.full((1 + i % 17,), float(rank + i))
        if i % 3 == 0:
            w = rr.all_reduce(t, async_op=True)
            s = torch.tensor([float(i)])
            dist.all_reduce(s)
            w.wait()
            ok &= s.item() == i * ws
        else:
            rr.all_reduce(t)
        if i % 10 == 0:
            dist.barrier()
        ok &= bool(torch.equal(t, torch.full_like(t, float(sum(r + i for r in range(ws))))))
    return ok


def test_thousand_small_calls_interleaved_with_torch_collectives():
    assert all(run_ranks(2, _interleaved, 1000))


def _trivial_cases(rank: int, ws: int) -> bool:
    e = torch.empty(0)
    assert rr.all_reduce(e) is None
    w = rr.all_reduce(torch.empty(0, 3), async_op=True)
    assert w.wait() and w.is_completed()
    t = torch.arange(5.0)
    rr.all_reduce_avg(t)
    return bool(torch.equal(t, torch.arange(5.0))) if ws == 1 else True


def test_world_size_one_and_empty():
    assert all(run_ranks(1, _trivial_cases))
    assert all(run_ranks(2, _trivial_cases))


@SHM_ONLY  # Python only, no ranks
def test_reduce_op_spellings():
    assert rr.ops.to_reduce_op("avg") is rr.ReduceOp.AVG
    assert rr.ops.to_reduce_op("Sum") is rr.ReduceOp.SUM
    assert rr.ops.to_reduce_op(dist.ReduceOp.MAX) is rr.ReduceOp.MAX
    assert rr.ops.to_reduce_op(dist.ReduceOp.PRODUCT) is rr.ReduceOp.PRODUCT
    with pytest.raises(ValueError, match="unsupported reduce op"):
        rr.ops.to_reduce_op("band")
    with pytest.raises(ValueError):
        rr.ops.to_reduce_op(dist.ReduceOp.BAND)
    # no bools, no plain integers: torch's 2 is PRODUCT, int(rr.ReduceOp.MAX) is 2
    assert int(rr.ReduceOp.MAX) == 2 and dist.ReduceOp.PRODUCT == 2
    for value in (True, False, 1, int(rr.ReduceOp.MAX), 0, 99):
        with pytest.raises(TypeError, match="op must be a string") as info:
            rr.ops.to_reduce_op(value)
        assert ("got a bool" if isinstance(value, bool) else "got a plain integer") in str(info.value)
    with pytest.raises(TypeError, match=r"pass ringreduce.ReduceOp\(2\), MAX, if that is the one you mean"):
        rr.ops.to_reduce_op(2)


@SHM_ONLY  # plan arithmetic, no ranks
def test_plan_summary_ownership_is_16_byte_aligned():
    for n in (2, 3, 5, 7):
        for numel in (1, n - 1, n + 1, 1000, 2**20 + 3):
            for code, size in ((0, 4), (1, 8), (3, 2), (4, 1), (11, 16)):
                s = rr._C.plan_summary(n, 0, numel, code)
                bounds = s["chunks"]
                assert bounds[0][0] == 0 and bounds[-1][1] == numel
                for (b, e), (b2, _) in zip(bounds, bounds[1:], strict=False):
                    assert e == b2
                    assert (b * size) % 16 == 0 or b == numel
                # ownership never depends on the segment size
                for seg in (16 if numel < 5000 else 4096, 1 << 22):
                    assert rr._C.plan_summary(n, 0, numel, code, segment_bytes=seg)["chunks"] == bounds
                assert math.ceil(numel / n) <= s["chunk"] or numel == 0
