#!/usr/bin/env python3
"""The checks of the GPU review that need a GPU (docs/reliability.md, "What is guarded against real
NCCL"): one subcommand per risk, each at most ~60 s on one GPU, each printing one verdict line
``<check> PASS|FAIL|INFO: ...``. scripts/gpu_check.sh may call it; it runs alone too:

    python scripts/gpu_review_checks.py --list        # the checks and their time budgets
    python scripts/gpu_review_checks.py lanes-stop    # one check
    python scripts/gpu_review_checks.py all           # every check, in the order of --list

Every check runs 2 ranks as fresh processes (ringreduce/_launch.py, the launcher of the tests and the
bench), on GPU ``rank % GPUs``; ranks that share a GPU get their own ``NCCL_HOSTID`` and NCCL's socket
transport over ``lo`` (ringreduce/bench/gpu_map.py, Note [Ranks sharing a GPU]). Results are compared with
``torch.distributed.all_reduce`` of the same integer-valued data (exact in float32 whatever the
order). Without a CUDA GPU every check prints that it needs one and the script exits 0. Exit code:
1 when a check failed, else 0.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORLD = 2
MIB = 1 << 20


# ---- the rank side (runs in each rank process) ----------------------------------------------------

def _setup(rank: int, init_file: str):
    import torch
    import torch.distributed as dist

    gpus = torch.cuda.device_count()
    torch.cuda.set_device(rank % gpus)
    dist.init_process_group("cpu:gloo,cuda:nccl", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    return torch, dist, torch.device("cuda", rank % gpus)


def _exact_calls(torch, dist, dev, rank: int, sizes: list[int], calls: int = 2) -> str:
    """All-reduces of integer-valued float32 data of each byte size against dist.all_reduce: '' or
    what differed."""
    import ringreduce

    for nbytes in sizes:
        for call in range(calls):
            gen = torch.Generator().manual_seed(1000 * call + nbytes % 997 + rank)
            x = torch.randint(-64, 64, (nbytes // 4,), generator=gen).float().to(dev)
            want = x.clone()
            dist.all_reduce(want)
            ringreduce.all_reduce(x)
            torch.cuda.synchronize()
            if not torch.equal(x, want):
                bad = int((x != want).sum())
                return f"{bad} of {x.numel()} elements differ at {nbytes} bytes, call {call}"
    return ""


def _ring_comm():
    from ringreduce._rings import cuda as _cuda

    return next(iter(_cuda._comms.values()))[2]


def rank_main(check: str, rank: int, init_file: str) -> dict:
    torch, dist, dev = _setup(rank, init_file)
    import ringreduce

    out: dict = {"rank": rank}
    if check == "lanes-stop":
        # Rank 0 queues 3 async calls; rank 1 makes only the first, then goes silent.
        x = [torch.ones(64 * MIB // 4, device=dev) for _ in range(3)]
        t0 = time.monotonic()
        try:
            if rank == 0:
                works = [ringreduce.all_reduce(t, async_op=True) for t in x]
                for w in works:
                    w.wait(timeout=datetime.timedelta(seconds=40))  # blocks the host: raises on failure
                out["error"] = "no error"
            else:
                ringreduce.all_reduce(x[0])
                torch.cuda.synchronize()
                time.sleep(40)
        except Exception as e:  # noqa: BLE001 - the verdict names the exception
            out["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        out["seconds"] = round(time.monotonic() - t0, 1)
        return out  # no teardown: the peer is silent (main leaves with os._exit)
    elif check == "fallback":
        out["mismatch"] = _exact_calls(torch, dist, dev, rank, [4096, 64 * MIB])
        out["lanes"] = _ring_comm().lanes
    elif check == "hand-offs":
        x = torch.ones(1024, device=dev)
        ringreduce.all_reduce(x)
        comm = _ring_comm()
        before = comm.hand_offs
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(200):
            ringreduce.all_reduce(x)
        torch.cuda.synchronize()
        out["ringreduce_us"] = (time.perf_counter() - t0) / 200 * 1e6
        out["hand_offs_per_call"] = (comm.hand_offs - before) / 200
        t0 = time.perf_counter()
        for _ in range(200):
            dist.all_reduce(x)
        torch.cuda.synchronize()
        out["nccl_us"] = (time.perf_counter() - t0) / 200 * 1e6
    else:  # nccl-version, env-blocking, child-connections, launch-order: exact calls
        try:
            out["mismatch"] = _exact_calls(torch, dist, dev, rank, [4096, 64 * MIB])
        except Exception as e:  # noqa: BLE001 - the verdict names the exception
            out["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        out["nccl"] = ".".join(str(v) for v in torch.cuda.nccl.version())
    dist.destroy_process_group()
    return out


# ---- the driver ---------------------------------------------------------------------------------------

# name -> (what it checks, extra environment of every rank, time budget in seconds)
CHECKS: dict[str, tuple[str, dict[str, str], int]] = {
    "nccl-version": ("risk 2: the runtime NCCL; calls after the first work (< 2.23: the simplest path)", {}, 45),
    "lanes-stop": ("risk 1: a silent peer with 3 queued 2-lane calls raises, never hangs",
                   {"RINGREDUCE_LANES": "2", "RINGREDUCE_TIMEOUT": "10"}, 60),
    "env-blocking": ("risk 3: NCCL_COMM_BLOCKING=1 is refused with ValueError at communicator creation",
                     {"NCCL_COMM_BLOCKING": "1"}, 45),
    "env-split-share": ("risk 3: NCCL_COMM_SPLIT_SHARE_RESOURCES=0 takes the simplest path, exact",
                        {"NCCL_COMM_SPLIT_SHARE_RESOURCES": "0"}, 45),
    "child-connections": ("risk 4: the split child opens no connections of its own (NCCL_DEBUG=INFO)",
                          {"RINGREDUCE_LANES": "1", "NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET,P2P"}, 45),
    "launch-order": ("risk 5: 2 lanes under NCCL_LAUNCH_ORDER_IMPLICIT=1 and CUDA_DEVICE_MAX_CONNECTIONS=1",
                     {"RINGREDUCE_LANES": "2", "NCCL_LAUNCH_ORDER_IMPLICIT": "1", "CUDA_DEVICE_MAX_CONNECTIONS": "1"},
                     45),
    "hand-offs": ("risk 6: hand-offs per 4 KiB call and its time beside dist.all_reduce (a figure, not a test)",
                  {}, 45),
    "fallback": ("issue 30: RINGREDUCE_NCCL_SIMPLE=1 runs one lane, exact", {"RINGREDUCE_NCCL_SIMPLE": "1"}, 45),
}


def _rank_env(rank: int, extra: dict[str, str], gpus: int) -> dict[str, str]:
    """What a rank's environment adds to this process's: NCCL's for its place among the GPUs, the
    check's own, and this checkout first on PYTHONPATH (for any process the rank starts)."""
    sys.path.insert(0, str(ROOT))
    from ringreduce.bench.gpu_map import nccl_rank_env

    env = dict(nccl_rank_env(rank, WORLD, gpus))
    env.update(extra)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def _rank_entry(check: str, rank: int, init_file: str, result: str) -> int:
    out = rank_main(check, rank, init_file)
    with open(result, "w") as f:
        json.dump(out, f)
    if check == "lanes-stop":
        os._exit(0)  # exit handlers would meet the silent peer's dead communicators
    return 0


def run_ranks(check: str, gpus: int, budget: int) -> tuple[list[dict | None], list[str], float]:
    """Runs `check` on WORLD fresh rank processes (ringreduce/_launch.py, the tests' and the bench's
    launcher); kills them, process groups whole, at `budget` s. Returns each rank's result (None when
    it gave none), each rank's output, and the seconds taken."""
    sys.path.insert(0, str(ROOT))
    from ringreduce._launch import RankProcesses

    extra = CHECKS[check][1]
    ranks = RankProcesses(WORLD, name=f"{check} rank", prefix="rr_review_")
    try:
        paths = [os.path.join(ranks.folder, f"result{r}.json") for r in range(WORLD)]
        ranks.start(_rank_entry, lambda r: (check, r, ranks.init_file, paths[r]),
                    env=lambda r: _rank_env(r, extra, gpus))
        t0 = time.monotonic()
        while time.monotonic() - t0 < budget and any(code is None for code in ranks.exit_codes()):
            if check == "lanes-stop" and ranks.exit_codes()[0] is not None:
                break  # rank 0 reported; rank 1 is silent on purpose
            time.sleep(0.2)
        took = time.monotonic() - t0
        ranks.kill()
        results: list[dict | None] = []
        for path in paths:
            if os.path.exists(path):
                with open(path) as f:
                    results.append(json.load(f))
            else:
                results.append(None)
        outputs = [ranks.output(r) for r in range(WORLD)]
    finally:
        ranks.close()
    return results, outputs, took


def verdict(check: str, results: list[dict | None], outputs: list[str], took: float, budget: int) -> tuple[str, str]:
    """(PASS|FAIL|INFO, what was seen) of one check's run."""
    r0 = results[0]
    if check == "lanes-stop":
        if r0 is None:
            return "FAIL", f"rank 0 still waiting after {took:.0f} s (a hang: Note [Stopping every lane at once])"
        ok = r0["error"].startswith("DistBackendError")
        return ("PASS" if ok else "FAIL"), f"rank 0 after {r0['seconds']} s: {r0['error']}"
    if any(r is None for r in results):
        tail = outputs[0][-300:].replace("\n", " | ")
        return "FAIL", f"a rank gave no result within {budget} s ({took:.0f} s); rank 0 said: {tail}"
    if check == "env-blocking":
        err = r0.get("error", "")
        ok = err.startswith("ValueError") and "NCCL_COMM_BLOCKING" in err
        return ("PASS" if ok else "FAIL"), err or "no error: NCCL_COMM_BLOCKING=1 was not refused"
    if check == "hand-offs":
        return "INFO", (f"{r0['hand_offs_per_call']:.2f} hand-offs per 4 KiB call; {r0['ringreduce_us']:.0f} us "
                        f"per call vs dist.all_reduce {r0['nccl_us']:.0f} us (rank 0, 200 calls each)")
    bad = [f"rank {r['rank']}: {r.get('error') or r.get('mismatch')}" for r in results
           if r.get("error") or r.get("mismatch")]
    if bad:
        return "FAIL", "; ".join(bad)
    seen = f"exact against dist.all_reduce at 4 KiB and 64 MiB (NCCL {r0.get('nccl', '?')})"
    if check == "fallback":
        ok = all(r["lanes"] == 1 for r in results)
        return ("PASS" if ok else "FAIL"), f"{seen}; lanes {[r['lanes'] for r in results]}"
    if check == "nccl-version":
        simple = "simplest path" in outputs[0]
        return "PASS", f"{seen}; {'simplest path (NCCL < 2.23)' if simple else 'full path'}"
    if check == "child-connections":
        net = len(re.findall(r"Channel \S+ : .*\[send\] via NET", outputs[0]))
        splits = len(re.findall(r"ncclCommSplit.*Init COMPLETE", outputs[0]))
        return "INFO", f"{seen}; rank 0: {net} send channels via NET, {splits} split child(ren) initialised"
    return "PASS", seen


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("check", nargs="?", choices=[*CHECKS, "all"], help="the check to run (or all)")
    parser.add_argument("--list", action="store_true", help="print the checks and their budgets")
    args = parser.parse_args(argv)
    if args.list or args.check is None:
        for name, (what, _, budget) in CHECKS.items():
            print(f"{name:18s} <= {budget:2d} s  {what}")
        return 0
    names = list(CHECKS) if args.check == "all" else [args.check]
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    failed = False
    for name in names:
        if gpus == 0:
            print(f"{name} SKIP: needs a CUDA GPU (none here)", flush=True)
            continue
        budget = CHECKS[name][2]
        results, outputs, took = run_ranks(name, gpus, budget)
        status, seen = verdict(name, results, outputs, took, budget)
        failed = failed or status == "FAIL"
        print(f"{name} {status}: {seen} [{took:.0f} s]", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
