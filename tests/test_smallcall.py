"""Small synchronous CPU all-reduces in shared memory: the handle-free native call (Note [Synchronous
calls without a handle] in csrc/torch/bindings.cpp) and the inline call on the caller's thread
(Note [Synchronous calls in shared memory] in csrc/cpu/group_runtime.h).

Exact, position-dependent data (small integers in float32: every sum is exact); back-to-back calls;
a disagreement at call k raises on every rank and the ring goes on; an async call queued before a
synchronous one keeps its place."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from ranks import expect_raises, run_ranks, spawn_ranks

import ringreduce as rr
from ringreduce._native import C

SIZES = (1, 7, 256, 1000, 4099)


class _CountedRing:
    """A plan's bound ring (C.CpuRing, Note [A bound ring] in csrc/torch/cpu_ops.h) that counts its
    handle-free calls."""

    count = 0

    def __init__(self, *args) -> None:  # noqa: ANN002
        self.ring = _NATIVE_RING(*args)

    def run(self, tensor: torch.Tensor, options: object) -> object:
        _CountedRing.count += 1
        return self.ring.run(tensor, options)

    def submit(self, *args) -> object:  # noqa: ANN002 - the full path's calls, not counted
        return self.ring.submit(*args)


_NATIVE_RING = C.CpuRing


def _forget_rings_and_plans() -> None:
    """Drops the plans and Python rings (not the native runtimes), so the next calls make them again."""
    from ringreduce import _call, _rings

    _call.forget_plans()
    _rings.forget_all()


def _back_to_back(rank: int, ws: int, rounds: int) -> dict:
    _forget_rings_and_plans()  # the rings made from here on bind counted native rings
    _CountedRing.count = 0
    C.CpuRing = _CountedRing
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
        return {"wrong": wrong, "native_runs": _CountedRing.count,
                "transport": C.transport_info(dist.group.WORLD, [])}
    finally:
        C.CpuRing = _NATIVE_RING
        _forget_rings_and_plans()


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
    from ringreduce import _call

    _forget_rings_and_plans()
    t = torch.full((256,), float(rank + 1))
    rr.all_reduce(t)  # its plan is now the only one kept
    (plan,) = _call._plans.values()
    native = plan.ring.native
    out = {"none": native.run(t, plan.options) is None, "bound": type(native) is C.CpuRing,
           "value": float(t[0]), "want": float(ws * (ws + 1) // 2 * ws)}
    # Queued behind an async call, a synchronous call does not run on this thread: run() hands back
    # its handle, which has no future.
    a = torch.full((1 << 16,), float(rank))
    work = rr.all_reduce(a, async_op=True)
    handle = native.run(t, plan.options)
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


def test_ring_run_returns_none_after_an_inline_call_and_a_handle_when_queued():
    for r in run_ranks(2, _returns_none_or_handle, transport="shm"):
        assert r["none"] is True and r["bound"] is True, r
        assert r["value"] == r["want"] == 6.0, r
        assert r["after"] == 12.0 and r["async"] == 1.0, r
        if "queued_ok" in r:  # the async call may have finished before run() looked
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


# ---------------------------------------------------------------------------------------------
# The ring a plan binds (Note [A bound ring] in csrc/torch/cpu_ops.h)


def _bound_ring_of_a_destroyed_group(rank: int, ws: int) -> dict:
    from ringreduce import _call

    out = {}
    for k in range(2):
        g = dist.new_group(backend="ringreduce")
        for i in range(4):
            t = torch.arange(300, dtype=torch.float32) * (rank + 1) + i + k
            rr.all_reduce(t, group=g)
            want = torch.arange(300, dtype=torch.float32) * (ws * (ws + 1) // 2) + ws * (i + k)
            out[f"exact {k} {i}"] = torch.equal(t, want)
        (plan,) = [p for p in _call._plans.values() if p.group is g]
        out[f"bound {k}"] = type(plan.ring.native) is C.CpuRing
        # a refusal on one rank raises on both through the bound ring
        if rank == 1:
            out[f"refused {k}"] = expect_raises(
                lambda g=g: rr.all_reduce_avg(torch.ones(300, dtype=torch.int32), group=g), TypeError, "AVG", "int32")
        else:
            out[f"refused {k}"] = expect_raises(lambda g=g: rr.all_reduce_avg(torch.ones(300), group=g), RuntimeError,
                                                "rank 1: all_reduce_avg refused locally")
        t = torch.full((300,), float(rank))
        rr.all_reduce(t, group=g)  # the ring goes on
        out[f"after refusal {k}"] = torch.equal(t, torch.full((300,), float(ws * (ws - 1) // 2)))
        inner = plan.info.pg
        dist.destroy_process_group(g)
        # the ring was released (the plan's ring holds its runtime weakly) and its plans dropped: the
        # next group's calls (k = 1) make a plan and a ring of their own
        out[f"released {k}"] = C.memory_bytes(inner) == 0 and C.transport_info(inner, []) == ""
        out[f"forgotten {k}"] = all(p.group is not g for p in _call._plans.values())
    return out


def test_a_bound_ring_is_exact_and_a_destroyed_groups_plan_is_not_used():
    for r in run_ranks(2, _bound_ring_of_a_destroyed_group, transport="shm"):
        assert {k: v for k, v in r.items() if v is not True and v != "ok"} == {}, r


def _bound_ring_peer_leaves(rank: int, ws: int) -> dict:
    from ringreduce import _call

    out = {}
    for i in range(3):
        t = torch.full((256,), float(rank + i))
        rr.all_reduce(t)
        out[f"exact {i}"] = torch.equal(t, torch.full((256,), float(1 + 2 * i)))
    (plan,) = _call._plans.values()
    out["bound"] = type(plan.ring.native) is C.CpuRing
    if rank == 1:
        os._exit(0)
    # the next repeated call runs on the bound ring: it raises as an unbound call does, then the
    # group is unusable
    out["first"] = expect_raises(lambda: rr.all_reduce(torch.ones(256)), dist.DistBackendError)
    out["second"] = expect_raises(lambda: rr.all_reduce(torch.ones(256)), dist.DistBackendError, "unusable")
    return out


def test_a_bound_ring_raises_when_its_peer_has_left():
    out = spawn_ranks(2, _bound_ring_peer_leaves, env={"RINGREDUCE_TIMEOUT": "3"}, timeout=120)
    assert out[1][0] == "died" and out[1][2] == 0, out[1]
    status, res, code = out[0]
    assert status == "ok" and code == 0, out
    assert {k: v for k, v in res.items() if v is not True and v != "ok"} == {}, res
