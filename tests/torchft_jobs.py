"""Rank jobs of tests/test_torchft.py (run by tests/ranks.py's spawn_ranks on fresh processes).

Each rank has the harness's default process group, used here only for its store (to meet the other
rank); the torchft group under test (ringreduce.torchft.ProcessGroupRingreduce) is configured over
the TCPStore that the test process hosts at `port`, under a new prefix each time, as torchft's
Manager does at every quorum.
"""

from __future__ import annotations

import datetime
import json
import os
import time
from typing import Any

import torch
import torch.distributed as dist
from ranks import job_environ

from ringreduce import _C

MODES = ("shm", "tcp", "alone", "blocked-shm", "blocked-tcp")
BLOCKED_MS = 300  # how long a call must stay incomplete to count as blocked on its silent peer


def _default_store() -> dist.Store:
    return dist.distributed_c10d._get_default_store()


def resources() -> dict[str, int]:
    """What rings hold in this process: threads, open fds, ringreduce's /dev/shm entries and mapped
    segments, CPU rings, failed calls' kept buffers (Note [Failed calls keep their buffers])."""
    try:
        shm = sum(1 for n in os.listdir("/dev/shm") if n.startswith("ringreduce"))
    except FileNotFoundError:
        shm = 0
    with open("/proc/self/maps") as f:  # segments stay mapped after their unlink from /dev/shm
        mapped = sum(1 for line in f if "/ringreduce-" in line)
    return {"threads": len(os.listdir("/proc/self/task")), "fds": len(os.listdir("/proc/self/fd")),
            "dev_shm": shm, "mapped_segments": mapped, "cpu_rings": _C.cpu_ring_count(),
            "retained_bytes": _C.retained_bytes()}


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _configure(pg: Any, port: int, prefix: str, rank: int, world_size: int) -> None:
    pg.configure(f"127.0.0.1:{port}/{prefix}", "0", rank, world_size)


def _blocked(work: Any) -> bool:
    """Whether `work` is still running BLOCKED_MS after it was submitted (its peer is silent)."""
    try:
        work.wait(datetime.timedelta(milliseconds=BLOCKED_MS))
    except RuntimeError as exc:
        return "did not complete" in str(exc)
    return False


def configure_abort_cycles(rank: int, world_size: int, port: int, cycles: int) -> dict:
    """`cycles` configure/abort cycles of one ProcessGroupRingreduce, MODES in turn: both ranks over
    shared memory, both over gloo point-to-point, each rank alone, and rank 0 aborting while its call
    waits for a silent rank 1 (both transports). First, one call that fails at its timeout, so that its
    ring holds a failed call's buffers until the abort releases them."""
    from ringreduce.torchft import ProcessGroupRingreduce

    store = _default_store()
    pg = ProcessGroupRingreduce(timeout=datetime.timedelta(seconds=60))
    opts = dist.AllreduceOptions()
    report: dict[str, Any] = {"aborts_s": [], "wrong": []}

    # A failed call's buffers: kept while its ring lives, freed by the abort that releases it.
    with job_environ({"RINGREDUCE_SHM": "0", "RINGREDUCE_TIMEOUT": "1"}):
        _configure(pg, port, "timeout", rank, 2)
        if rank == 0:
            work = pg.allreduce([torch.ones(1 << 20)], opts)  # 4 MiB: the ring, with staging (not the one-shot)
            report["timed_out_call_ok"] = work.wait()
            del work
            report["kept_while_poisoned"] = _C.retained_bytes()
            report["errored_after_failure"] = type(pg.errored()).__name__
        store.set("timeout_done", "1") if rank == 0 else store.wait(["timeout_done"])
        pg.abort()
        report["kept_after_abort"] = _C.retained_bytes()

    for i in range(cycles):
        mode = MODES[i % len(MODES)]
        with job_environ({"RINGREDUCE_SHM": "0" if mode.endswith("tcp") else "1"}):
            if mode == "alone":
                _configure(pg, port, f"c{i}/{rank}", 0, 1)
            else:
                _configure(pg, port, f"c{i}", rank, 2)
            inner = pg.parent.ring.pg
            t = torch.full((1 << 18,), float(rank + 1))
            if not mode.startswith("blocked"):
                work = pg.allreduce([t], opts)
                if not work.wait() or not torch.all(t == (rank + 1.0 if mode == "alone" else 3.0)):
                    report["wrong"].append((i, mode, t[:2].tolist()))
                del work
                pg.abort(errored=False)
            elif rank == 0:
                work = pg.allreduce([t], opts)
                if not _blocked(work):
                    report["wrong"].append((i, mode, "the call did not wait for its silent peer"))
                start = time.monotonic()
                pg.abort()
                report["aborts_s"].append(time.monotonic() - start)
                if work.wait() or not isinstance(work.exception(), dist.DistBackendError):
                    report["wrong"].append((i, mode, "the blocked call's Work did not fail"))
                del work
                store.set(f"aborted{i}", "1")
            else:
                store.wait([f"aborted{i}"])
                pg.abort()
            if _C.memory_bytes(inner) != 0:
                report["wrong"].append((i, mode, f"{_C.memory_bytes(inner)} bytes held after the abort"))
            del inner
        if i == len(MODES) - 1:  # one cycle of each mode: whatever torch starts lazily has started
            report["base"], report["base_rss"] = resources(), _rss_bytes()
    report["end"], report["end_rss"] = resources(), _rss_bytes()
    return report


ABORT_CASES = (("shm", "silent"), ("tcp", "silent"), ("shm", "dead"))  # the dead peer's case last: it exits


def abort_while_blocked(rank: int, world_size: int, port: int) -> list[dict]:
    """ABORT_CASES in turn (transport, peer), each on rings of its own: rank 0's call waits for rank 1,
    which is "silent" (alive; it calls only after rank 0 aborted, and the call must not reach rank 0's
    tensor) or "dead" (it exits). Rank 0 aborts; after a silent peer, both configure again and
    all-reduce correctly."""
    results = []
    for transport, peer in ABORT_CASES:
        with job_environ({"RINGREDUCE_SHM": "1" if transport == "shm" else "0"}):
            results.append(_abort_case(rank, port, f"{transport}-{peer}", peer))
    return results


def _abort_case(rank: int, port: int, case: str, peer: str) -> dict:
    from ringreduce.torchft import ProcessGroupRingreduce

    store = _default_store()
    pg = ProcessGroupRingreduce(timeout=datetime.timedelta(seconds=60))
    opts = dist.AllreduceOptions()
    _configure(pg, port, f"{case}/first", rank, 2)
    if rank == 1:
        if peer == "dead":
            store.wait([f"{case}/submitted"])
            os._exit(0)
        store.wait([f"{case}/aborted"])  # rank 0's call waited for this rank, which calls only now
        mine = torch.full((1 << 18,), 7.0)
        late = pg.allreduce([mine], opts)
        result = {"late_call_ok": late.wait(), "late_error": type(late.exception()).__name__,
                  "late_sum_right": bool(torch.equal(mine, torch.arange(1 << 18, dtype=torch.float32) + 7.0))}
        del late
        store.set(f"{case}/late_done", "1")
        pg.abort()
        _configure(pg, port, f"{case}/again", rank, 2)
        t = torch.full((1 << 16,), 2.0)
        result["again_ok"] = pg.allreduce([t], opts).wait() and bool(torch.all(t == 3.0))
        pg.abort(errored=False)
        store.set(f"{case}/peer", json.dumps(result))  # this rank exits in the last case: rank 0 reports it
        return result
    tensor = torch.arange(1 << 18, dtype=torch.float32)
    original = tensor.clone()
    work = pg.allreduce([tensor], opts)
    store.set(f"{case}/submitted", "1")
    blocked = _blocked(work) if peer == "silent" else False
    start = time.monotonic()
    pg.abort()
    abort_s = time.monotonic() - start
    after_abort = tensor.clone()
    result = {"case": case, "blocked": blocked, "abort_s": abort_s, "wait": work.wait(),
              "exception": repr(work.exception()), "errored": repr(pg.errored())}
    del work
    store.set(f"{case}/aborted", "1")
    if peer == "silent":
        store.wait([f"{case}/late_done"])
    result["unchanged"] = bool(torch.equal(after_abort, original) and torch.equal(tensor, original))
    if peer == "silent":
        _configure(pg, port, f"{case}/again", rank, 2)
        t = torch.full((1 << 16,), 1.0)
        result["again_ok"] = pg.allreduce([t], opts).wait() and bool(torch.all(t == 3.0))
        pg.abort(errored=False)
        result["peer"] = json.loads(store.get(f"{case}/peer"))
    return result
