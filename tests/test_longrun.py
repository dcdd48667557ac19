"""Long run: 10,000 mixed calls on 2 ranks with RSS, open file descriptors and threads bounded.

One pool job runs a deterministic schedule (the same on both ranks: a shared seed) of 10,000
ringreduce calls, sync and async (up to 8 in flight), on WORLD and two subgroups (each group has its
own worker), of 1 element to 256 KiB in float32/bfloat16/int32/float64, with SUM/AVG/MAX. Every
call's result is checked (constant data, cheap) and every 97th call uses position-dependent exact
data checked against the float64 reference. RSS, /proc/self/fd and thread counts (Python and
/proc/self/task) are measured after a warm-up that reaches every size, dtype and group, and again at
the end.
"""

from __future__ import annotations

import gc
import math
import os
import random
import threading
import time

import torch
import torch.distributed as dist
from ranks import CPU_PLACES, run_ranks
from refdata import bits_equal, exact_input, gather_inputs, reference

import ringreduce as rr

PLACES = CPU_PLACES  # conftest.py: every test at each place (Note [Places] in ranks.py)

CALLS = 10_000
WARMUP = 400
MAX_BYTES = 256 << 10
MAX_IN_FLIGHT = 8
RSS_BOUND = 32 << 20
DTYPES = [torch.float32, torch.float32, torch.bfloat16, torch.int32, torch.float64]


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _tasks() -> int:
    return len(os.listdir("/proc/self/task"))


def _snapshot() -> dict:
    gc.collect()
    return {"rss": _rss(), "fds": _fds(), "tasks": _tasks(), "py_threads": threading.active_count()}


def _schedule(seed: int, n: int) -> list[tuple]:
    """(group index, async?, numel, dtype index, op, exact?) per call; log-uniform sizes."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        d = rng.randrange(len(DTYPES))
        esize = torch.empty(0, dtype=DTYPES[d]).element_size()
        nbytes = int(math.exp(rng.uniform(math.log(esize), math.log(MAX_BYTES))))
        numel = max(1, nbytes // esize)
        if i < len(DTYPES) * 3:  # the warm-up reaches the largest size in every dtype and group
            d, numel = i % len(DTYPES), MAX_BYTES // torch.empty(0, dtype=DTYPES[i % len(DTYPES)]).element_size()
        op = rng.choice(["sum", "sum", "avg", "max"])
        if DTYPES[d] == torch.int32 and op == "avg":
            op = "sum"
        out.append((i % 3 if i < 15 else rng.randrange(3), rng.random() < 0.5, numel, d, op, i % 97 == 0))
    return out


def _expected_const(vals: list[float], op: str, dtype: torch.dtype) -> float:
    if op == "sum":
        return float(sum(vals))
    if op == "avg":
        return float(sum(vals)) / len(vals)
    return float(max(vals))


def _long_run(rank: int, ws: int, seed: int) -> dict:
    groups = [None, dist.new_group([0, 1]), dist.new_group([0, 1])]
    plan = _schedule(seed, WARMUP + CALLS)
    failures: list[str] = []
    pending: list[tuple] = []  # (work, tensor, check)

    def settle(limit: int) -> None:
        while len(pending) > limit:
            work, t, check = pending.pop(0)
            work.wait()
            check(t)

    def run(calls: list[tuple], base: int) -> None:
        for j, (g, is_async, numel, d, op, exact) in enumerate(calls):
            i = base + j
            dtype = DTYPES[d]
            if exact:
                t = exact_input(numel, rank, dtype, op)
                expected = reference(gather_inputs(t, groups[g]), op)

                def check(out, expected=expected, i=i, dtype=dtype, op=op):
                    if not bits_equal(out, expected):
                        failures.append(f"call {i} ({dtype} {op}, exact): wrong values")
            else:
                vals = [float((i + r) % 5 + 1) for r in range(ws)]
                t = torch.full((numel,), vals[rank], dtype=dtype)
                want = _expected_const(vals, op, dtype)

                def check(out, want=want, i=i, dtype=dtype, op=op):
                    ref = torch.full_like(out, want)  # rounded to dtype exactly as the reduction
                    if not torch.equal(out, ref):
                        failures.append(f"call {i} ({dtype} {op}, numel {out.numel()}): {out[:2].tolist()} != {want}")
            if is_async:
                pending.append((rr.all_reduce(t, op=op, group=groups[g], async_op=True), t, check))
                settle(MAX_IN_FLIGHT)
            else:
                rr.all_reduce(t, op=op, group=groups[g])
                check(t)
            if len(failures) > 20:
                raise AssertionError("\n".join(failures))
        settle(0)

    run(plan[:WARMUP], 0)
    dist.barrier()
    before = _snapshot()
    start = time.monotonic()
    run(plan[WARMUP:], WARMUP)
    elapsed = time.monotonic() - start
    dist.barrier()
    after = _snapshot()
    return {"before": before, "after": after, "failures": failures, "elapsed": elapsed,
            "calls": CALLS, "sync": sum(not c[1] for c in plan[WARMUP:])}


def test_ten_thousand_mixed_calls_keep_rss_fds_threads_stable():
    results = run_ranks(2, _long_run, 20240611, timeout=300)
    for rank, res in enumerate(results):
        assert res["failures"] == [], f"rank {rank}:\n" + "\n".join(res["failures"])
        b, a = res["before"], res["after"]
        assert 2000 < res["sync"] < 8000  # both kinds really happen
        growth = a["rss"] - b["rss"]
        assert growth < RSS_BOUND, f"rank {rank}: RSS grew by {growth / 2**20:.1f} MiB over {CALLS} calls"
        assert abs(a["fds"] - b["fds"]) <= 2, f"rank {rank}: open fds {b['fds']} -> {a['fds']}"
        assert a["py_threads"] == b["py_threads"], f"rank {rank}: Python threads {b['py_threads']} -> {a['py_threads']}"
        assert abs(a["tasks"] - b["tasks"]) <= 2, f"rank {rank}: OS threads {b['tasks']} -> {a['tasks']}"
        print(f"rank {rank}: {CALLS} calls in {res['elapsed']:.1f} s; RSS {b['rss'] / 2**20:.1f} -> "
              f"{a['rss'] / 2**20:.1f} MiB, fds {b['fds']} -> {a['fds']}, threads {b['tasks']} -> {a['tasks']}")
