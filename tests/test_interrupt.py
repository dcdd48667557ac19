"""Ctrl-C (SIGINT) on a rank blocked in a call whose peer is silent: KeyboardInterrupt within 1 s,
the group unusable on that rank with a clear message, DistBackendError on the peer, exit code 0.

Fresh processes per case (spawn_ranks). Rank 1 is the silent peer: it waits until rank 0 is
blocked, sends SIGINT to rank 0 and writes the time it did into the store; rank 0 measures the
latency from there to its KeyboardInterrupt (one host, one clock).
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist
from ranks import CPU_PLACES, full_at, spawn_ranks

import ringreduce as rr

PLACES = CPU_PLACES  # conftest.py: every test at each place (Note [Places] in ranks.py)

LATENCY_BOUND_S = 1.0
PEER_TIMEOUT_S = 8  # RINGREDUCE_TIMEOUT of both ranks


def _store() -> dist.Store:
    return dist.distributed_c10d._get_default_store()


def _interrupted(rank: int, ws: int, how: str) -> dict:
    # SIGINT raises KeyboardInterrupt here whatever this process inherited: a suite started with a shell's
    # `&` (no job control) has SIGINT ignored, and Python then leaves it ignored in every rank.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    store = _store()
    if how == "sync_warm":  # a first call together: the ring is set up, the next sync call runs inline
        rr.all_reduce(torch.ones(4))
    if rank == 0:
        store.set("pid0", str(os.getpid()))
        tensor = torch.arange(1 << 18, dtype=torch.float32)  # 1 MiB: the ring, not the one-shot
        before = tensor.clone()
        caught = None
        try:
            if how in ("sync", "sync_warm"):
                rr.all_reduce(tensor)
            else:
                work = rr.all_reduce_avg(tensor, async_op=True)
                work.wait()
        except KeyboardInterrupt:
            caught = time.time()
        sent = float(store.get("sigint_at").decode())
        result: dict = {"latency": None if caught is None else caught - sent}
        try:
            rr.all_reduce(torch.ones(4))
            result["next_call"] = "returned"
        except dist.DistBackendError as exc:
            result["next_call"] = str(exc)
        result["unchanged"] = bool(torch.equal(tensor, before))
        store.set("rank0_done", "1")
        return result
    # rank 1: silent until rank 0 waits, then SIGINT to rank 0
    pid = int(store.get("pid0").decode())
    time.sleep(1.5)  # rank 0 is blocked in its call by now
    store.set("sigint_at", repr(time.time()))
    os.kill(pid, signal.SIGINT)
    store.wait(["rank0_done"])
    start = time.monotonic()
    errors = []
    for _ in range(2):  # the first call may still meet rank 0's interrupted one half way
        try:
            if how in ("sync", "sync_warm"):  # the same call as rank 0's
                rr.all_reduce(torch.ones(1 << 18))
            else:
                rr.all_reduce_avg(torch.ones(1 << 18), async_op=True).wait()
        except dist.DistBackendError as exc:
            errors.append(str(exc))
            break
    return {"errors": errors, "seconds": time.monotonic() - start}


@pytest.mark.parametrize("how", ["sync", "work_wait", "sync_warm"])
@full_at("shm", how="work_wait")
@full_at("shm", how="sync_warm")
@full_at("tcp", how="sync")
@full_at("tcp", how="sync_warm")
def test_ctrl_c_interrupts_a_blocked_call(how: str) -> None:
    env = {"RINGREDUCE_TIMEOUT": str(PEER_TIMEOUT_S)}
    out = spawn_ranks(2, _interrupted, how, env=env, timeout=120, pg_timeout=60)
    (status0, result0, code0), (status1, result1, code1) = out
    assert status0 == "ok", result0
    assert status1 == "ok", result1
    assert code0 == 0, f"the interrupted rank exited with {code0}"
    assert code1 == 0
    assert result0["latency"] is not None, "no KeyboardInterrupt"
    assert 0 <= result0["latency"] < LATENCY_BOUND_S, f"KeyboardInterrupt {result0['latency']:.3f} s after SIGINT"
    assert "interrupted on this rank" in result0["next_call"], result0["next_call"]
    assert "unusable" in result0["next_call"], result0["next_call"]
    assert result0["unchanged"], "the interrupted call wrote into the tensor"
    assert result1["errors"], "the peer's calls did not fail"
    assert result1["seconds"] < 2 * PEER_TIMEOUT_S + 10, result1
