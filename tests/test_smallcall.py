"""Small synchronous CPU all-reduces in shared memory: the handle-free native call (Note [Synchronous
calls without a handle] in csrc/torch/bindings.cpp) and the inline call on the caller's thread
(Note [Synchronous calls in shared memory] in csrc/cpu/group_runtime.h).

Exact, position-dependent data (small integers in float32: every sum is exact); back-to-back calls;
a disagreement at call k raises on every rank and the ring goes on; an async call queued before a
synchronous one keeps its place."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from ranks import run_ranks

import ringreduce as rr
from ringreduce._backend import cpu as _cpu
from ringreduce._native import C

SIZES = (1, 7, 256, 1000, 4099)


def _back_to_back(rank: int, ws: int, rounds: int) -> dict:
    count = [0]  # calls of the fast path's handle-free native call
    native = _cpu._NATIVE_RUN

    def counted(*args):  # noqa: ANN002, ANN202
        count[0] += 1
        return native(*args)

    _cpu._NATIVE_RUN = counted
    try:
        wrong = []
        for k in range(rounds):
            for numel in SIZES:
                base = torch.arange(numel, dtype=torch.float32) % 251
                t = base * (rank + 1) + k
                rr.all_reduce(t)
                want = base * (ws * (ws + 1) // 2) + ws * k
                if not torch.equal(t, want):
                    wrong.append((k, numel))
        return {"wrong": wrong, "native_runs": count[0], "transport": C.transport_info(dist.group.WORLD, [])}
    finally:
        _cpu._NATIVE_RUN = native


@pytest.mark.parametrize("ws", [2, 3, 4])
def test_back_to_back_calls_are_exact_on_every_rank(ws):
    rounds = 60
    for r in run_ranks(ws, _back_to_back, rounds, transport="shm"):
        # the ring's transport ("; node stages: ..." follows where an earlier job of the persistent
        # pool ran a hierarchical call on WORLD)
        assert r["transport"].split(";")[0] == "shm", r
        assert r["wrong"] == [], r
        # every repeated call of an argument set took the handle-free call (the first one per set
        # runs the checks and the full path)
        assert r["native_runs"] >= (rounds - 1) * len(SIZES), r


def _returns_none_or_handle(rank: int, ws: int) -> dict:
    from ringreduce import _fastpath

    _fastpath.forget()
    t = torch.full((256,), float(rank + 1))
    rr.all_reduce(t)  # its plan is now the only one kept
    (plan,) = _fastpath.plans.values()
    out = {"none": C.run_cpu(*plan.head, t, plan.options, plan.store) is None,
           "value": float(t[0]), "want": float(ws * (ws + 1) // 2 * ws)}
    # Queued behind an async call, a synchronous call does not run on this thread: run_cpu hands
    # back its handle, which has no future.
    a = torch.full((1 << 16,), float(rank))
    work = rr.all_reduce(a, async_op=True)
    handle = C.run_cpu(*plan.head, t, plan.options, plan.store)
    work.wait()
    if handle is not None:
        handle.wait(-1)
        out["queued_ok"] = handle.ok()
        try:
            handle.get_future()
            out["future"] = "returned"
        except ValueError as e:
            out["future"] = str(e)
    out["after"] = float(t[0])
    out["async"] = float(a[0])
    return out


def test_run_cpu_returns_none_after_an_inline_call_and_a_handle_when_queued():
    for r in run_ranks(2, _returns_none_or_handle, transport="shm"):
        assert r["none"] is True, r
        assert r["value"] == r["want"] == 6.0, r
        assert r["after"] == 12.0 and r["async"] == 1.0, r
        if "queued_ok" in r:  # the async call may have finished before run_cpu looked
            assert r["queued_ok"] is True, r
            assert "has no future" in r["future"], r


def _mismatch_at(rank: int, ws: int, ks: tuple[int, ...]) -> dict:
    out = {}
    for k in ks:
        for i in range(k):
            t = torch.arange(300, dtype=torch.float32) + rank + i
            rr.all_reduce(t)
            assert torch.equal(t, torch.arange(300, dtype=torch.float32) * ws + ws * i + ws * (ws - 1) // 2), (k, i)
        # call k: rank 1 passes one element more (same dtype and layout: the same kept plan)
        bad = torch.ones(300 + (1 if rank == 1 else 0))
        before = bad.clone()
        try:
            rr.all_reduce(bad)
            out[k] = "no error"
        except RuntimeError as e:
            out[k] = "disagree" in str(e) and torch.equal(bad, before)
        # the ring goes on
        t = torch.full((300,), float(rank))
        rr.all_reduce(t)
        out[f"{k} after"] = torch.equal(t, torch.full((300,), float(ws * (ws - 1) // 2)))
    return out


@pytest.mark.parametrize("ws", [2, 4])
def test_a_disagreement_at_call_k_raises_on_every_rank_and_the_ring_goes_on(ws):
    for r in run_ranks(ws, _mismatch_at, (1, 2, 5), transport="shm"):
        assert all(v is True for v in r.values()), r


def _async_then_sync(rank: int, ws: int, rounds: int) -> dict:
    wrong = []
    for k in range(rounds):
        # SUM then MAX differs from MAX then SUM: the synchronous call must not overtake the async one.
        x = torch.full((64 + k,), float(rank + 1))
        y = torch.arange(64 + k, dtype=torch.float32) * (rank + 1)
        work = rr.all_reduce(x, async_op=True)
        rr.all_reduce(x, op=rr.ReduceOp.MAX)
        rr.all_reduce(y)
        work.wait()
        if not torch.equal(x, torch.full((64 + k,), float(ws * (ws + 1) // 2))):
            wrong.append(("x", k, float(x[0])))
        if not torch.equal(y, torch.arange(64 + k, dtype=torch.float32) * (ws * (ws + 1) // 2)):
            wrong.append(("y", k))
    return {"wrong": wrong}


@pytest.mark.parametrize("ws", [2, 4])
def test_a_synchronous_call_never_overtakes_a_queued_async_call(ws):
    for r in run_ranks(ws, _async_then_sync, 40, transport="shm"):
        assert r["wrong"] == [], r
