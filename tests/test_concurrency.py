"""Concurrency: several groups at once, ranks ordering their async calls differently, sync calls
queued behind async ones, completion order, the GIL, and futures of failed calls.

torch.distributed's guarantee, which ringreduce keeps: calls on one group run in the order they were
issued (every rank issues them in the same order); calls on different groups are independent (each
group has its own worker thread), so ranks may interleave groups differently without deadlocking.
"""

from __future__ import annotations

import datetime
import os
import threading
import time
import uuid

import pytest
import torch
import torch.distributed as dist
from ranks import CPU_PLACES, full_at, run_ranks, spawn_ranks
from refdata import bits_equal, exact_input, gather_inputs, reference

import ringreduce as rr

PLACES = CPU_PLACES  # conftest.py: every test at each place (Note [Places] in ranks.py)

SEGMENTS = {"RINGREDUCE_SEGMENT_BYTES": "4096"}  # many segments: calls stay in flight a while
_GROUPS: dict[str, list] = {}  # per pool process: created once (every rank runs the same jobs)


def _groups(ws: int, count: int, tag: str = "") -> list:
    key = f"{ws}x{count}{tag}"
    if key not in _GROUPS:
        _GROUPS[key] = [dist.new_group(list(range(ws))) for _ in range(count)]
    return _GROUPS[key]


# ---------------------------------------------------------------------------------------------
# Ranks order their async calls on different groups differently


def _opposite_orders(rank: int, ws: int) -> list[str]:
    failures = []
    groups = [None] + _groups(ws, 3)  # WORLD and three more groups with every rank
    order = list(range(len(groups)))
    order = order[rank % len(order):] + order[:rank % len(order)]  # rank r starts with group r
    if rank % 2:
        order.reverse()
    per_group = 3
    tensors: dict[tuple[int, int], torch.Tensor] = {}
    works = {}
    for g in order:
        for k in range(per_group):
            numel = 50_000 + 7919 * k + 13 * g
            t = exact_input(numel, rank, torch.float32, "sum")
            tensors[(g, k)] = t
            works[(g, k)] = rr.all_reduce(t, group=groups[g], async_op=True)
    for key in sorted(works, key=lambda gk: (-gk[1], gk[0])):  # wait in yet another order
        assert works[key].wait(timeout=datetime.timedelta(seconds=120)) is True
    for (g, k), t in sorted(tensors.items()):
        numel = t.numel()
        want = sum(exact_input(numel, r, torch.float32, "sum").double() for r in range(ws)).float()
        if not torch.equal(t, want):
            failures.append(f"group {g} call {k}: wrong values")
    return failures


@pytest.mark.parametrize("ws", [2, 3])
def test_ranks_ordering_async_calls_on_groups_differently_do_not_deadlock(ws):
    for rank, res in enumerate(run_ranks(ws, _opposite_orders, env=SEGMENTS, timeout=240)):
        assert res == [], f"rank {rank}: {res}"


# ---------------------------------------------------------------------------------------------
# A sync call issued while async ones are in flight on the same group queues behind them


def _sync_behind_async(rank: int, ws: int) -> dict:
    (g,) = _groups(ws, 1)
    out = {}
    s = float(sum(r + 1 for r in range(ws)))
    # the same tensor reduced 4 times async, then once sync: in order, t = s * ws**4
    t = torch.full((200_003,), float(rank + 1), dtype=torch.float64)
    works = [rr.all_reduce(t, group=g, async_op=True) for _ in range(4)]
    rr.all_reduce(t, group=g)  # must run after the four, not inline before them
    out["all_async_done_when_sync_returns"] = all(w.is_completed() for w in works)
    out["chained_value"] = bool(torch.equal(t, torch.full_like(t, s * ws**4)))
    # ranks mix sync and async differently for the same sequence of calls
    a = exact_input(100_001, rank, torch.float32, "sum")
    b = exact_input(333, rank, torch.int32, "max")
    c = exact_input(70_000, rank, torch.bfloat16, "avg")
    ea, eb, ec = (reference(gather_inputs(x, g), op) for x, op in ((a, "sum"), (b, "max"), (c, "avg")))
    if rank == 0:
        wa = rr.all_reduce(a, group=g, async_op=True)
        wb = rr.all_reduce(b, op="max", group=g, async_op=True)
        rr.all_reduce_avg(c, group=g)
        out["earlier_done"] = wa.is_completed() and wb.is_completed()
        wb.wait()
        wa.wait()
    else:
        rr.all_reduce(a, group=g)
        wb = rr.all_reduce(b, op="max", group=g, async_op=True)
        rr.all_reduce_avg(c, group=g, async_op=True).wait()
        out["earlier_done"] = wb.is_completed()
    out["mixed_values"] = bits_equal(a, ea) and bits_equal(b, eb) and bits_equal(c, ec)
    return out


@pytest.mark.parametrize("ws", [2, 3])
def test_sync_call_queues_behind_async_calls_on_the_same_group(ws):
    for rank, res in enumerate(run_ranks(ws, _sync_behind_async, env=SEGMENTS, timeout=180)):
        assert all(res.values()), f"rank {rank}: {res}"


# ---------------------------------------------------------------------------------------------
# Completion order per group == submission order (futures' callbacks and is_completed)


def _completion_order(rank: int, ws: int) -> dict:
    ga, gb = _groups(ws, 2)
    done: list[tuple[str, int]] = []
    lock = threading.Lock()
    works = {"A": [], "B": []}
    tensors = {"A": [], "B": []}
    n = 8
    for k in range(n):
        for name, g in (("A", ga), ("B", gb)):
            # big calls first, small later: a reordering executor would finish the small ones first
            numel = 300_000 // (k + 1) + (1 if name == "A" else 2)
            t = torch.full((numel,), float(rank + k))
            w = rr.all_reduce(t, group=g, async_op=True)

            def cb(fut, name=name, k=k):
                with lock:
                    done.append((name, k))

            w.get_future().add_done_callback(cb)
            works[name].append(w)
            tensors[name].append(t)
    out = {"prefix_completed": True}
    for name in ("A", "B"):
        for k in reversed(range(n)):
            works[name][k].wait()
            out["prefix_completed"] &= all(works[name][j].is_completed() for j in range(k))
    deadline = time.monotonic() + 30  # callbacks run on the worker just before wait() returns
    while len(done) < 2 * n and time.monotonic() < deadline:
        time.sleep(0.01)
    with lock:
        seen = list(done)
    for name in ("A", "B"):
        out[f"order_{name}"] = [k for gname, k in seen if gname == name] == list(range(n))
        out[f"values_{name}"] = all(
            torch.equal(t, torch.full_like(t, float(sum(r + k for r in range(ws)))))
            for k, t in enumerate(tensors[name])
        )
    return out


def test_completion_order_per_group_matches_submission_order():
    for rank, res in enumerate(run_ranks(2, _completion_order, env=SEGMENTS, timeout=180)):
        assert all(res.values()), f"rank {rank}: {res}"


# ---------------------------------------------------------------------------------------------
# The GIL is released while a call blocks (sync inline on the caller, and Work.wait)


def _gil_released(rank: int, ws: int, token: str) -> dict:
    store = dist.distributed_c10d._get_default_store()
    out = {}
    (g,) = _groups(ws, 1, "gil")  # its own group: a failure here must not poison the others' groups
    for mode in ("sync", "async"):
        key = f"rr_gil_{token}_{mode}"
        t = torch.ones(1000)
        if rank == 0:
            stop = threading.Event()
            entering = threading.Event()

            def ticker(key=key, entering=entering, stop=stop):
                entering.wait()
                time.sleep(0.2)  # let the main thread enter the blocking call first
                while not stop.is_set():
                    store.add(key, 1)  # needs the GIL: impossible while the caller holds it
                    time.sleep(0.01)

            th = threading.Thread(target=ticker, daemon=True)
            th.start()
            entering.set()
            try:
                if mode == "sync":
                    rr.all_reduce(t, group=g)
                else:
                    rr.all_reduce(t, group=g, async_op=True).wait()
                out[mode] = "ok" if torch.equal(t, torch.full((1000,), float(ws))) else f"wrong {t[:2]}"
            except Exception as exc:  # noqa: BLE001 - reported
                out[mode] = f"{type(exc).__name__}: {exc}"
            stop.set()
            th.join()
        else:
            # join only once rank 0's helper thread has run Python code while rank 0 was blocked
            deadline = time.monotonic() + 60
            while store.add(key, 0) < 5 and time.monotonic() < deadline:
                time.sleep(0.01)
            if store.add(key, 0) < 5:
                out[mode] = "rank 0's helper thread never ran: the GIL was held during the call"
                continue  # rank 0 then times out (RINGREDUCE_TIMEOUT) and reports it too
            rr.all_reduce(t, group=g)
            out[mode] = "ok"
    return out


def test_gil_is_released_while_a_call_blocks():
    res = run_ranks(2, _gil_released, uuid.uuid4().hex, env={"RINGREDUCE_TIMEOUT": "90"}, timeout=240)
    for rank, r in enumerate(res):
        assert r == {"sync": "ok", "async": "ok"}, f"rank {rank}: {r}"


# ---------------------------------------------------------------------------------------------
# Futures of failed calls raise; a mismatch between good calls does not disturb them


def _failed_futures(rank: int, ws: int) -> dict:
    (g,) = _groups(ws, 1)
    out = {}
    good1 = torch.full((10_000,), float(rank + 1))
    bad = torch.ones(500 + rank)  # numel differs per rank
    good2 = torch.full((777,), float(rank + 1))
    w1 = rr.all_reduce(good1, group=g, async_op=True)
    wbad = rr.all_reduce(bad, group=g, async_op=True)
    called = threading.Event()
    seen: list[str] = []

    def cb(fut):
        try:
            fut.wait()
            seen.append("no error")
        except RuntimeError as exc:
            seen.append(str(exc))
        called.set()

    fbad = wbad.get_future()
    fbad.add_done_callback(cb)
    chained = fbad.then(lambda f: f.value()[0] * 2)
    w2 = rr.all_reduce(good2, group=g, async_op=True)
    w2.wait()
    w1.wait()
    s = float(sum(r + 1 for r in range(ws)))
    out["good_before"] = bool(torch.equal(good1, torch.full_like(good1, s)))
    out["good_after"] = bool(torch.equal(good2, torch.full_like(good2, s)))
    try:
        wbad.wait()
        out["wait_raises"] = False
    except RuntimeError as exc:
        out["wait_raises"] = "numel" in str(exc) and "disagree" in str(exc)
    for name, fut in (("future", fbad), ("chained", chained)):
        try:
            fut.wait()
            out[f"{name}_raises"] = False
        except RuntimeError as exc:
            out[f"{name}_raises"] = "numel" in str(exc)
    out["callback_saw_error"] = called.wait(30) and len(seen) == 1 and "numel" in seen[0]
    exc = wbad.exception()
    out["exception()"] = isinstance(exc, RuntimeError) and "numel" in str(exc)
    out["flags"] = wbad.is_completed() and not wbad.is_success() and w1.is_success()
    out["bad_unchanged"] = bool(torch.equal(bad, torch.ones(500 + rank)))
    return out


@pytest.mark.parametrize("ws", [2, 3])
def test_futures_of_failed_calls_raise_and_neighbours_succeed(ws):
    for rank, res in enumerate(run_ranks(ws, _failed_futures, timeout=120)):
        assert all(res.values()), f"rank {rank}: {res}"


def _poisoned_group(rank: int, ws: int) -> dict:
    ga = dist.new_group([0, 1])
    gb = dist.new_group([0, 1])
    out = {}
    b1 = torch.full((50_000,), float(rank + 1))
    if rank == 0:
        # rank 1 never calls on group A: the first call times out, the queued ones fail at once
        wa = [rr.all_reduce(torch.ones(1000 + k), group=ga, async_op=True) for k in range(3)]
        fa = [w.get_future() for w in wa]
        wb = rr.all_reduce(b1, group=gb, async_op=True)  # group B is independent of A's trouble
        wb.wait()
        out["b_during"] = bool(torch.equal(b1, torch.full_like(b1, 3.0)))
        msgs = []
        for w in wa:
            try:
                w.wait()
                msgs.append("no error")
            except dist.DistBackendError as exc:
                msgs.append(str(exc))
        out["first_timed_out"] = "timed out" in msgs[0].lower() or "timeout" in msgs[0].lower()
        out["queued_unusable"] = all("unusable" in m for m in msgs[1:])
        out["futures_raise"] = True
        for f in fa:
            try:
                f.wait()
                out["futures_raise"] = False
            except RuntimeError:
                pass
        try:
            rr.all_reduce(torch.ones(3), group=ga)
            out["later_sync_raises"] = False
        except dist.DistBackendError as exc:
            out["later_sync_raises"] = "unusable" in str(exc)
    else:
        rr.all_reduce(b1, group=gb)
        out["b_during"] = bool(torch.equal(b1, torch.full_like(b1, 3.0)))
    dist.barrier()  # gloo's own barrier: WORLD is not ringreduce-poisoned
    b2 = torch.full((9,), float(rank))
    rr.all_reduce(b2, group=gb)
    out["b_after"] = bool(torch.equal(b2, torch.full((9,), 1.0)))
    return out


@full_at("tcp")
def test_poisoned_group_fails_its_queued_calls_and_spares_other_groups():
    out = spawn_ranks(2, _poisoned_group, env={"RINGREDUCE_TIMEOUT": "3"}, timeout=150)
    for rank, (status, res, code) in enumerate(out):
        # exit code 0: the interpreter shuts down cleanly with a poisoned group and its worker
        assert status == "ok" and code == 0, (rank, status, res, code)
        assert all(res.values()), f"rank {rank}: {res}"



# ---------------------------------------------------------------------------------------------
# Interpreter exit with pending async work; RINGREDUCE_CHECK=0 (documented: behaves like stock gloo)


def _exit_with_pending_work(rank: int, ws: int, outdir: str) -> str:
    t = torch.full((1 << 20,), float(rank + 1))
    works = [rr.all_reduce(t, async_op=True) for _ in range(3)]

    def record(fut, k):
        ok = fut.value()[0][0].item() == 3.0 * ws ** k
        with open(os.path.join(outdir, f"rank{rank}_call{k}"), "w") as f:
            f.write("ok" if ok else "wrong")

    for k, w in enumerate(works):
        w.get_future().add_done_callback(lambda fut, k=k: record(fut, k))
    if rank == 1:
        time.sleep(1.0)  # rank 0 returns (and starts exiting) long before the ring can finish
    return "returned"


@full_at("tcp")
def test_interpreter_exit_drains_pending_async_work(tmp_path):
    out = spawn_ranks(2, _exit_with_pending_work, str(tmp_path), timeout=120)
    for rank, (status, res, code) in enumerate(out):
        assert status == "ok" and code == 0, (rank, status, res, code)
        for k in range(3):
            # atexit joins the worker after its queue ran: every queued call completed before exit
            assert (tmp_path / f"rank{rank}_call{k}").read_text() == "ok", (rank, k)


def _unchecked_mismatch(rank: int, ws: int) -> dict:
    out = {}
    t = torch.ones(64, dtype=torch.float32 if rank == 0 else torch.int32)
    rr.all_reduce(t)  # same byte size, different dtypes: no check, so no error (garbage, as gloo)
    out["same_size_dtype_mismatch_returned"] = True
    dist.barrier()
    u = torch.ones(100 if rank == 0 else 300)
    try:
        rr.all_reduce(u)  # different sizes: gloo may abort the receiving process (SIGABRT)
        out["size_mismatch"] = "returned"
    except dist.DistBackendError:
        out["size_mismatch"] = "DistBackendError"
    return out


@full_at("tcp")
def test_check_disabled_mismatch_behaves_like_stock_gloo():
    # gloo point-to-point: in shared memory the frames are always compared (they cost nothing there)
    out = spawn_ranks(2, _unchecked_mismatch, env={"RINGREDUCE_CHECK": "0", "RINGREDUCE_TIMEOUT": "10",
                                                   "RINGREDUCE_SHM": "0"}, timeout=120)
    for status, res, _ in out:
        assert status == "died" or res["same_size_dtype_mismatch_returned"], out
    # the size mismatch is not diagnosed: some rank is aborted by gloo or sees a transport error
    outcomes = [("died", code) if status == "died" else res["size_mismatch"] for status, res, code in out]
    assert any(o == ("died", -6) or o == "DistBackendError" for o in outcomes), outcomes
