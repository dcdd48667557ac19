"""rr.reduce_scatter and rr.all_gather on CPU ranks: exact data, random data, layouts, errors."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from ranks import CPU_PLACES, SHM_ONLY, place_cases, run_ranks
from ranks import expect_raises as _expect
from refdata import OPS, bits_equal, exact_input, gather_inputs, reference, same_on_all_ranks, supported, types_for

import ringreduce as rr

PLACES = CPU_PLACES  # conftest.py: every test at each place (Note [Places] in ranks.py)

BLOCKS = [1, 3, 7, 33, 1000]
# plan_summary's options of the ring halves' plans with 16-byte segments and 2 slots (Note [Ring halves])
_TINY = {"segment_bytes": 16, "num_slots": 2, "owner_shift": -1, "exact_chunks": True}


def _with_env(env: dict[str, str], fn, *args):
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    rr.reload_knobs()  # the rings read their knobs again (ringreduce/_config.py)
    try:
        return fn(*args)
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        rr.reload_knobs()  # the rings read their knobs again (ringreduce/_config.py)


def _rs_exact(rank: int, ws: int, tiny: bool, dtypes: list[torch.dtype]) -> list[str]:
    def body() -> list[str]:
        failures = []
        for dtype in dtypes:
            for op in OPS:
                if not supported(dtype, op):
                    continue
                for m in BLOCKS:
                    inp = exact_input(ws * m, rank, dtype, op).reshape(ws * m)
                    before = inp.clone()
                    out = torch.empty(m, dtype=dtype)
                    rr.reduce_scatter(out, inp, op=op)
                    want = reference(gather_inputs(inp), op)[rank * m:(rank + 1) * m]
                    if not bits_equal(out, want):
                        failures.append(f"{dtype} {op} m={m}: {out[:6].tolist()} != {want[:6].tolist()}")
                    if not bits_equal(inp, before):
                        failures.append(f"{dtype} {op} m={m}: input modified")
        return failures

    return _with_env({"RINGREDUCE_SEGMENT_BYTES": "16", "RINGREDUCE_SLOTS": "2"}, body) if tiny else body()


# tcp: 2 ranks and 3 (tiny segments); every dtype over shm (ranks.py's Note [Places])
@place_cases("ws", [2, 3, 4], tcp=[2, 3])
def test_reduce_scatter_exact_every_dtype_and_op(ws, place):
    for rank, failures in enumerate(run_ranks(ws, _rs_exact, ws == 3, types_for(place))):
        assert not failures, f"rank {rank}: {failures[:5]}"


def _ag_exact(rank: int, ws: int, tiny: bool, dtypes: list[torch.dtype]) -> list[str]:
    def body() -> list[str]:
        failures = []
        for dtype in dtypes:
            for shape in [(), (1,), (5,), (7, 3), (33, 2, 2), (1000,)]:
                numel = 1
                for s in shape:
                    numel *= s
                t = exact_input(numel, rank, dtype, "sum").reshape(shape)
                got = rr.all_gather(t)
                stack = gather_inputs(t)
                want = stack.reshape((ws,)) if shape == () else stack.reshape((ws * shape[0], *shape[1:]))
                if not bits_equal(got, want):
                    failures.append(f"{dtype} {shape}: shape {tuple(got.shape)} values differ")
                if not same_on_all_ranks(got):
                    failures.append(f"{dtype} {shape}: ranks differ")
        return failures

    return _with_env({"RINGREDUCE_SEGMENT_BYTES": "16", "RINGREDUCE_SLOTS": "2"}, body) if tiny else body()


# tcp: 2 ranks and 3 (tiny segments); 1 rank never uses a transport (shared memory needs 2)
@place_cases("ws", [1, 2, 3, 4], tcp=[2, 3])
def test_all_gather_exact_every_dtype(ws, place):
    for rank, failures in enumerate(run_ranks(ws, _ag_exact, ws == 3, types_for(place))):
        assert not failures, f"rank {rank}: {failures[:5]}"


def _random_vs_torch(rank: int, ws: int) -> dict:
    out = {}
    g = torch.Generator().manual_seed(1234 + rank)
    for dtype, tol in [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float64, 1e-12)]:
        m = 4099
        inp = torch.randn(ws * m, 3, generator=g).to(dtype)
        res = torch.empty(m, 3, dtype=dtype)
        ref = inp.clone()
        dist.all_reduce(ref)  # stock: the whole sum, then our block
        rr.reduce_scatter(res, inp)
        out[f"rs {dtype}"] = torch.allclose(res.double(), ref[rank * m:(rank + 1) * m].double(), rtol=tol, atol=tol)
        res_avg = torch.empty(m, 3, dtype=dtype)
        rr.reduce_scatter(res_avg, inp, op=rr.ReduceOp.AVG)
        out[f"rs avg {dtype}"] = torch.allclose(res_avg.double(), ref[rank * m:(rank + 1) * m].double() / ws,
                                                rtol=tol, atol=tol)
        parts = [torch.empty(m, 3, dtype=dtype) for _ in range(ws)]
        dist.all_gather(parts, inp[:m].contiguous())
        out[f"ag {dtype}"] = torch.equal(rr.all_gather(inp[:m]), torch.cat(parts))
    return out


@place_cases("ws", [2, 4], tcp=[4])  # tcp with 2 ranks: the exact sweeps
def test_random_data_matches_torch_distributed(ws):
    for rank, res in enumerate(run_ranks(ws, _random_vs_torch)):
        assert all(res.values()), f"rank {rank}: {res}"


def _layouts_async(rank: int, ws: int) -> dict:
    out = {}
    # transposed input and output views; memory around the output untouched
    base = (torch.arange(ws * 4 * 6, dtype=torch.float32).reshape(6, ws * 4) + 100 * rank)
    inp = base.t()  # (ws*4, 6), not contiguous
    store = torch.full((6, 10), -7.0)
    outv = store[:, 2:6].t()  # (4, 6) view, not contiguous
    out["sync returns None"] = rr.reduce_scatter(outv, inp) is None  # as torch.distributed's (a Work before)
    want = reference(gather_inputs(inp.contiguous()), "sum")[rank * 4:(rank + 1) * 4]
    out["views"] = torch.equal(outv, want)
    out["outside_untouched"] = bool((store[:, :2] == -7).all() and (store[:, 6:] == -7).all())
    # async reduce_scatter: Work, future value [output]
    inp2 = torch.ones(ws * 5) * (rank + 1)
    res = torch.empty(5)
    work = rr.reduce_scatter(res, inp2, async_op=True)
    fut = work.get_future()
    work.wait()
    out["async_rs"] = torch.equal(res, torch.full((5,), ws * (ws + 1) / 2)) and fut.value()[0] is res
    # async all_gather: result()[0] is the gathered tensor
    w2 = rr.all_gather(torch.full((2, 2), float(rank)), async_op=True)
    w2.wait()
    got = w2.result()[0]
    out["async_ag"] = torch.equal(got, torch.arange(ws, dtype=torch.float32).repeat_interleave(2)[:, None].expand(-1, 2))
    out["async_ag_future"] = torch.equal(w2.get_future().wait()[0], got)
    # a subgroup: ranks 0 and 1 only; block index = rank in the group
    sub = dist.new_group([0, 1])
    if rank < 2:
        r = torch.empty(3)
        rr.reduce_scatter(r, torch.arange(6, dtype=torch.float32) * (rank + 1), group=sub)
        out["subgroup"] = torch.equal(r, (torch.arange(6, dtype=torch.float32) * 3)[rank * 3:(rank + 1) * 3])
        out["subgroup_ag"] = torch.equal(rr.all_gather(torch.tensor([float(rank)]), group=sub), torch.tensor([0.0, 1.0]))
    # interleaved with all_reduce on the same group: sequence numbers stay in step
    for i in range(20):
        x = torch.full((ws * 2,), float(i))
        y = torch.empty(2)
        rr.reduce_scatter(y, x)
        rr.all_reduce(x)
        out.setdefault("interleaved", True)
        out["interleaved"] = out["interleaved"] and torch.equal(y, torch.full((2,), float(i * ws)))
    return out


@place_cases("ws", [2, 3], tcp=[3])  # views are copied above the transport; 3 ranks hold a pair subgroup
def test_layouts_async_subgroups(ws):
    for rank, res in enumerate(run_ranks(ws, _layouts_async)):
        assert all(res.values()), f"rank {rank}: {res}"




def _errors(rank: int, ws: int) -> dict:
    out = {}
    out["wrong_numel"] = _expect(lambda: rr.reduce_scatter(torch.empty(3), torch.ones(ws * 3 + 1)), ValueError,
                                 "reduce_scatter", "blocks")
    out["wrong_dtype"] = _expect(lambda: rr.reduce_scatter(torch.empty(3, dtype=torch.float64), torch.ones(ws * 3)),
                                 TypeError, "dtype")
    out["int_avg"] = _expect(lambda: rr.reduce_scatter(torch.empty(2, dtype=torch.int32),
                                                       torch.ones(ws * 2, dtype=torch.int32), op="avg"),
                             TypeError, "AVG")
    out["ag_not_tensor"] = _expect(lambda: rr.all_gather([1, 2]), TypeError, "torch.Tensor")
    # uneven first dimensions: every rank raises RuntimeError naming the shapes
    out["uneven"] = _expect(lambda: rr.all_gather(torch.ones(rank + 1, 2)), RuntimeError, "shape")
    # only rank 0 passes a wrong output: it raises ValueError, the others RuntimeError naming it
    if rank == 0:
        out["one_rank"] = _expect(lambda: rr.reduce_scatter(torch.empty(5), torch.ones(ws * 4)), ValueError, "blocks")
    else:
        out["one_rank"] = _expect(lambda: rr.reduce_scatter(torch.empty(4), torch.ones(ws * 4)), RuntimeError,
                                  "rank 0")
    y = torch.empty(2)
    rr.reduce_scatter(y, torch.ones(ws * 2))
    out["still_works"] = "ok" if torch.equal(y, torch.full((2,), float(ws))) else f"got {y}"
    return out


@place_cases("ws", [2, 3], tcp=[3])
def test_errors_are_clear_on_every_rank(ws):
    for rank, res in enumerate(run_ranks(ws, _errors)):
        bad = {k: v for k, v in res.items() if v != "ok"}
        assert not bad, f"rank {rank}: {bad}"


@SHM_ONLY  # plan arithmetic, no ranks
def test_plan_of_a_half_is_what_the_issue_says():
    from ringreduce._native import C

    # rank r owns block r, blocks are exactly numel / n, and a half sends (n-1) segments per chunk
    for n in (2, 3, 5):
        for r in range(n):
            s = C.plan_summary(n, r, 7 * n, 0, phases=1, **_TINY)
            assert s["owned_chunk"] == r
            assert s["chunks"] == [(7 * c, 7 * (c + 1)) for c in range(n)]
            assert s["num_exchanges"] == (n - 1) * s["nsegs"]
            full = C.plan_summary(n, r, 7 * n, 0, phases=3, **_TINY)
            assert full["num_exchanges"] == 2 * s["num_exchanges"]
    with pytest.raises(ValueError, match="equal blocks"):
        C.plan_summary(3, 0, 10, 0, phases=1, **_TINY)
