"""Where single calls lose their time: barrier-aligned calls with RINGREDUCE_TRACE=1 (Note [Call traces]
in csrc/torch/cpu_group.cpp), summarized over ranks and calls, next to gloo's time for the same calls.

    python benchmarks/trace_calls.py --nproc 4 --size 1M --calls 30 [--check 0|1]

Each rank runs `calls` rounds of: barrier, ringreduce.all_reduce_avg (traced), barrier,
dist.all_reduce + div_ (gloo). Prints the median time per call of both, the median split of
ringreduce's ring time (posting exchanges, waiting, reducing, copying), and how often an op took a
scheduler-slice-sized time: posts and reduces over 0.5 ms (this rank was descheduled, or blocked on a
gloo pair lock), waits over 2 ms (a peer was). docs/algorithm.md quotes it.
"""
import argparse
import os
import re
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from averaging import gloo_average, ringreduce_average

from ringreduce.bench.sizes import parse_size

_LINE = re.compile(r"ring (\d+) us \(posting (\d+), waiting (\d+), reducing (\d+), copying (\d+)\); "
                   r"ops over \d+ us:(.*)$")


def job(rank: int, ws: int, numel: int, calls: int, check: str) -> dict:
    os.environ["RINGREDUCE_CHECK"] = check
    t = torch.ones(numel)
    for _ in range(5):
        ringreduce_average(t, ws)
        dist.all_reduce(t)
    rr_s, gloo_s = [], []
    from ranks import captured_stderr

    with captured_stderr() as log:
        os.environ["RINGREDUCE_TRACE"] = "1"
        try:
            for _ in range(calls):
                dist.barrier()
                t0 = time.perf_counter()
                ringreduce_average(t, ws)
                rr_s.append(time.perf_counter() - t0)
                dist.barrier()
                t0 = time.perf_counter()
                gloo_average(t, ws)
                gloo_s.append(time.perf_counter() - t0)
        finally:
            os.environ.pop("RINGREDUCE_TRACE", None)
    lines = [ln for ln in log if ln.startswith("[ringreduce trace]")]
    return {"rr": rr_s, "gloo": gloo_s, "lines": lines}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--size", default="1M", help="bytes of float32")
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--check", choices=("0", "1"), default="1", help="RINGREDUCE_CHECK")
    args = ap.parse_args()
    from ranks import close_pools, run_ranks

    numel = max(1, parse_size(args.size) // 4)
    results = run_ranks(args.nproc, job, numel, args.calls, args.check)
    close_pools()
    parts = {"ring": [], "posting": [], "waiting": [], "reducing": [], "copying": []}
    slow = {"post": 0, "reduce": 0, "copy": 0, "wait": 0}
    longest = {"post": 0.0, "reduce": 0.0, "copy": 0.0, "wait": 0.0}
    traced = 0
    for r in results:
        for ln in r["lines"]:
            m = _LINE.search(ln)
            if not m:
                continue
            traced += 1
            for key, value in zip(parts, m.groups()[:5], strict=True):
                parts[key].append(float(value))
            for kind, took in re.findall(r" (post|wait|reduce|copy|record)\d+@\d+:(\d+)", m.group(6)):
                if kind in longest:
                    longest[kind] = max(longest[kind], float(took))
                if kind == "wait" and float(took) <= 2000:
                    continue
                if kind in slow:
                    slow[kind] += 1
    med = {k: statistics.median(v) for k, v in parts.items() if v}
    rr_med = statistics.mean(statistics.median(r["rr"]) for r in results) * 1e6
    gloo_med = statistics.mean(statistics.median(r["gloo"]) for r in results) * 1e6
    print(f"{args.nproc} ranks, {args.size}B float32 AVG, {args.calls} barrier-aligned calls, check={args.check}: "
          f"ringreduce {rr_med:.0f} us, gloo {gloo_med:.0f} us per call (median, mean over ranks)", flush=True)
    print("  ringreduce's ring (medians over ranks and calls, us): " +
          ", ".join(f"{k} {v:.0f}" for k, v in med.items()), flush=True)
    per = max(1, traced)
    print(f"  per traced call and rank: posts over 0.5 ms {slow['post'] / per:.2f}, reduces over 0.5 ms "
          f"{slow['reduce'] / per:.2f}, copies over 0.5 ms {slow['copy'] / per:.2f}, waits over 2 ms "
          f"{slow['wait'] / per:.2f} ({traced} traced calls)", flush=True)
    print("  longest single op (us): " + ", ".join(f"{k} {v:.0f}" for k, v in longest.items()), flush=True)


if __name__ == "__main__":
    main()
