"""Where the machine's CPU goes during single, barrier-aligned all-reduce calls.

    python benchmarks/cpu_split.py --nproc 4 --size 1M --iters 150
    python benchmarks/cpu_split.py --nproc 4 --size 1M --variant 'slots4=RINGREDUCE_SLOTS=4,RINGREDUCE_CHECK=0'

Every iteration runs each variant once, in turn, each call preceded by a barrier (no call overlaps
another): gloo's all_reduce + div_, ringreduce with its defaults, ringreduce with RINGREDUCE_CHECK=0,
and any --variant NAME=VAR=VALUE,... (ringreduce under those environment variables). For each it
prints the median time per call (mean over ranks) and, summed over the call's duration, the machine's
busy and idle CPU time (from /proc/stat, so on a machine with nothing else running, all of it is the
ranks'), each thread's CPU time per call and rank by thread name (from /proc/self/task/*/schedstat:
the Python thread, ringreduce's rr_cpu_worker, gloo's gloo_tcp_loop and pt_gloo_runloop), and the
TCP segments sent (/proc/net/snmp). With more ranks than CPUs, time per call follows CPU per call:
docs/algorithm.md, "Where the time goes", quotes what it measured.
"""
import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from averaging import average

from ringreduce.bench.sizes import parse_size


def machine() -> dict[str, float]:
    """Busy and idle CPU time (10 ms ticks) of the whole machine and TCP segments sent so far."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    with open("/proc/net/snmp") as f:
        rows = [line.split() for line in f if line.startswith("Tcp:")]
    tcp = dict(zip(rows[0][1:], rows[1][1:], strict=True))
    # user nice system idle iowait irq softirq steal
    return {"busy": v[0] + v[1] + v[2] + v[5] + v[6], "idle": v[3] + v[4], "steal": v[7],
            "segs": int(tcp["OutSegs"])}


def threads() -> dict[str, int]:
    """CPU nanoseconds of this process's threads, summed by thread name."""
    out: dict[str, int] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                ns = int(f.read().split()[0])
        except OSError:  # the thread exited
            continue
        out[name] = out.get(name, 0) + ns
    return out


def job(rank: int, ws: int, numel: int, iters: int, variants: list) -> dict:
    t = torch.ones(numel)
    keys = {k for _, env in variants if env for k in env}
    times: dict[str, list[float]] = {name: [] for name, _ in variants}
    mach = {name: {"busy": 0, "idle": 0, "steal": 0, "segs": 0} for name, _ in variants}
    thr: dict[str, dict[str, int]] = {name: {} for name, _ in variants}
    for it in range(iters + 3):
        for name, env in variants:
            for k in keys:
                os.environ.pop(k, None)
            if env:
                os.environ.update(env)
            dist.barrier()
            m0 = machine() if rank == 0 else None
            th0 = threads()
            s = time.perf_counter()
            average("gloo" if env is None else "rr", t, ws)
            e = time.perf_counter()
            m1 = machine() if rank == 0 else None
            th1 = threads()
            if it < 3:
                continue
            times[name].append(e - s)
            for k, v in th1.items():
                thr[name][k] = thr[name].get(k, 0) + v - th0.get(k, 0)
            if rank == 0:
                for k in mach[name]:
                    mach[name][k] += m1[k] - m0[k]
    for k in keys:
        os.environ.pop(k, None)
    tick_us = 1e6 / os.sysconf("SC_CLK_TCK")
    return {name: {"median_us": statistics.median(times[name]) * 1e6,
                   "threads_us": {k: v / 1e3 / iters for k, v in thr[name].items()},
                   **{k: mach[name][k] * (1 if k == "segs" else tick_us) / iters for k in mach[name]}}
            for name, _ in variants}


def parse_variant(text: str) -> tuple[str, dict[str, str]]:
    name, _, assignments = text.partition("=")
    env = dict(a.split("=", 1) for a in assignments.split(",") if a)
    return name, env


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--size", default="1M", help="bytes of float32, e.g. 8, 1M, 16M")
    ap.add_argument("--iters", type=int, default=150)
    ap.add_argument("--variant", action="append", default=[],
                    help="NAME=VAR=VALUE[,VAR=VALUE...]: ringreduce under these environment variables")
    args = ap.parse_args()
    from ranks import close_pools, run_ranks

    variants = [("gloo", None), ("rr", {}), ("rr-nocheck", {"RINGREDUCE_CHECK": "0"})]
    variants += [parse_variant(v) for v in args.variant]
    numel = max(1, parse_size(args.size) // 4)
    res = run_ranks(args.nproc, job, numel, args.iters, variants, timeout=1800)
    print(f"# {args.nproc} ranks, {args.size}B float32 AVG, {args.iters} barrier-aligned calls per variant; "
          f"CPU time in us per call (machine: summed over its CPUs; threads: per rank)", flush=True)
    for name, _ in variants:
        median = sum(r[name]["median_us"] for r in res) / args.nproc
        r0 = res[0][name]
        names = sorted({k for r in res for k in r[name]["threads_us"]})
        per_thread = {k: sum(r[name]["threads_us"].get(k, 0) for r in res) / args.nproc for k in names}
        cells = "  ".join(f"{k} {v:.0f}" for k, v in per_thread.items() if v >= 5)
        print(f"{name:14s} median {median:8.0f} us | machine busy {r0['busy']:7.0f} idle {r0['idle']:6.0f} "
              f"steal {r0['steal']:5.0f} | tcp segments {r0['segs']:5.0f} | threads: {cells}", flush=True)
    close_pools()


if __name__ == "__main__":
    main()
