"""A tight loop of one implementation on local gloo ranks, optionally under `perf`, for profiling.

    python benchmarks/profile_loop.py --impl rr --nproc 4 --size 1M --iters 300 \
        --perf "stat -e task-clock,syscalls:sys_enter_sched_yield,syscalls:sys_enter_epoll_wait"
    python benchmarks/profile_loop.py --impl gloo --nproc 4 --size 1M --iters 300 --perf "record -g -o gloo.data"

Runs `iters` back-to-back calls (float32 AVG: ringreduce's all_reduce_avg, or gloo's all_reduce +
div_) on every rank after a warm-up, and prints the wall time per call (total / iters: calls may
overlap across ranks, so this is throughput, not the benchmark's per-call median). With --perf, the
given `perf` subcommand is attached to the rank processes for exactly the timed loop (needs perf and
the right to trace them). docs/algorithm.md, "Where the time goes", quotes what it measured.
"""
import argparse
import os
import signal
import subprocess
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import ringreduce as rr
from ringreduce.bench.sizes import parse_size


def job(rank: int, ws: int, numel: int, iters: int, impl: str, check: str) -> int:
    t = torch.ones(numel)
    os.environ["RINGREDUCE_CHECK"] = check
    for _ in range(iters):
        if impl == "gloo":
            dist.all_reduce(t)
            t.div_(ws)
        else:
            rr.all_reduce_avg(t)
    return os.getpid()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--impl", choices=("rr", "gloo"), default="rr")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--size", default="1M", help="bytes of float32, e.g. 8, 1M, 16M")
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--check", choices=("0", "1"), default="1", help="RINGREDUCE_CHECK for ringreduce")
    ap.add_argument("--perf", default="", help='perf subcommand and options, e.g. "stat -e task-clock"')
    args = ap.parse_args()
    from ranks import close_pools, run_ranks

    numel = max(1, parse_size(args.size) // 4)
    pids = run_ranks(args.nproc, job, numel, 10, args.impl, args.check)
    perf = None
    if args.perf:
        perf = subprocess.Popen(["perf", *args.perf.split(), "-p", ",".join(map(str, pids))])
        time.sleep(1.0)  # perf attaches
    start = time.perf_counter()
    run_ranks(args.nproc, job, numel, args.iters, args.impl, args.check)
    per_call = (time.perf_counter() - start) / args.iters
    if perf is not None:
        perf.send_signal(signal.SIGINT)
        perf.wait()
    print(f"{args.impl} {args.nproc} ranks {args.size}B check={args.check}: {per_call * 1e6:.0f} us per call "
          f"({args.iters} back-to-back calls)", flush=True)
    close_pools()


if __name__ == "__main__":
    main()
