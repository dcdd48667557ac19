"""A tight loop of one implementation on local gloo ranks, optionally under `perf`, for profiling.

    python benchmarks/profile_loop.py --impl rr --nproc 4 --size 1M --iters 300 \
        --perf "stat -e task-clock,syscalls:sys_enter_sched_yield,syscalls:sys_enter_epoll_wait"
    python benchmarks/profile_loop.py --impl gloo --nproc 4 --size 1M --iters 300 --perf "record -g -o gloo.data"

Runs `iters` back-to-back calls (float32 AVG: ringreduce's all_reduce_avg, or gloo's all_reduce +
div_; with --barrier, each after a barrier) on every rank after a warm-up, and prints the wall time per call (total / iters: calls may
overlap across ranks, so this is throughput, not the benchmark's per-call median). With --perf, the
given `perf` subcommand is attached to the rank processes for exactly the timed loop (needs perf and
the right to trace them). With --cpu-by-thread, prints the CPU time each thread (main `python`,
ringreduce's `rr_cpu_worker`, gloo's `gloo_tcp_loop` and `pt_gloo_runloop`) spent per call: with more
ranks than CPUs, ranks x CPU per call / CPUs is a floor under the time per call. docs/algorithm.md,
"Where the time goes", quotes what it measured.
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
from averaging import average

from ringreduce.bench.sizes import parse_size


def thread_cpu() -> dict[str, tuple[float, float]]:
    """User and system CPU seconds of each thread of this process, summed by thread name."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, tuple[float, float]] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:  # the thread exited
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        user, system = out.get(name, (0.0, 0.0))
        out[name] = (user + int(fields[11]) / tick, system + int(fields[12]) / tick)
    return out


def job(rank: int, ws: int, numel: int, iters: int, impl: str, check: str,
        barrier: bool = False) -> tuple[int, dict[str, list[float]]]:
    t = torch.ones(numel)
    os.environ["RINGREDUCE_CHECK"] = check
    before = thread_cpu()
    for _ in range(iters):
        if barrier:
            dist.barrier()
        average(impl, t, ws)
    after = thread_cpu()
    per_call = {}
    for name, (user, system) in after.items():
        u0, s0 = before.get(name, (0.0, 0.0))
        per_call[name] = [(user - u0) / iters * 1e6, (system - s0) / iters * 1e6]
    return os.getpid(), per_call


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--impl", choices=("rr", "gloo"), default="rr")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--size", default="1M", help="bytes of float32, e.g. 8, 1M, 16M")
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--check", choices=("0", "1"), default="1", help="RINGREDUCE_CHECK for ringreduce")
    ap.add_argument("--perf", default="", help='perf subcommand and options, e.g. "stat -e task-clock"')
    ap.add_argument("--barrier", action="store_true",
                    help="a barrier before every call (single calls that never overlap, as in benchmarks/cpu_split.py)")
    ap.add_argument("--cpu-by-thread", action="store_true",
                    help="also print each thread's CPU time per call (from /proc, by thread name)")
    args = ap.parse_args()
    from ranks import close_pools, run_ranks

    numel = max(1, parse_size(args.size) // 4)
    pids = [pid for pid, _ in run_ranks(args.nproc, job, numel, 10, args.impl, args.check)]
    perf = None
    if args.perf:
        perf = subprocess.Popen(["perf", *args.perf.split(), "-p", ",".join(map(str, pids))])
        time.sleep(1.0)  # perf attaches
    start = time.perf_counter()
    results = run_ranks(args.nproc, job, numel, args.iters, args.impl, args.check, args.barrier)
    per_call = (time.perf_counter() - start) / args.iters
    if perf is not None:
        perf.send_signal(signal.SIGINT)
        perf.wait()
    print(f"{args.impl} {args.nproc} ranks {args.size}B check={args.check}: {per_call * 1e6:.0f} us per call "
          f"({args.iters} back-to-back calls)", flush=True)
    if args.cpu_by_thread:
        # CPU per call and rank, by thread name, averaged over ranks (clock ticks: 10 ms / iters)
        names = sorted({n for _, cpu in results for n in cpu})
        rows = []
        for n in names:
            user = sum(cpu.get(n, [0, 0])[0] for _, cpu in results) / len(results)
            system = sum(cpu.get(n, [0, 0])[1] for _, cpu in results) / len(results)
            if user + system >= 1.0:
                rows.append((n, user, system))
        total = sum(u + s for _, u, s in rows)
        cells = "  ".join(f"{n} {u:.0f}+{s:.0f}" for n, u, s in rows)
        print(f"  CPU us per call and rank (user+sys, mean over ranks): {cells}  total {total:.0f}; "
              f"{args.nproc} ranks x total / {os.cpu_count()} CPUs = {args.nproc * total / os.cpu_count():.0f} us",
              flush=True)
    close_pools()


if __name__ == "__main__":
    main()
