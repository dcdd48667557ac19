"""gloo's own all_reduce time before and after a run of ringreduce calls on the same process group.

    python benchmarks/gloo_mode.py --nproc 4 --size 1M --calls 600 [--between gloo]

ringreduce's CPU path sends over the group's own gloo connections, so whatever state its traffic
leaves on those sockets is what gloo's next calls run on. Prints the median of 60 barrier-aligned
gloo all_reduce + div_ calls (mean over ranks): first, after `calls` ringreduce all_reduce_avg calls
(with --between gloo: after `calls` gloo calls instead, so gloo alone), and after `calls` more gloo
calls. On this project's 2-vCPU VMs gloo runs at 4 ranks and 1 MiB in one
of two modes, ~2.6-3.5 ms or ~5-6 ms, and which one follows depends on the traffic before
(docs/algorithm.md, "Where the time goes").
"""
import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from averaging import gloo_average, ringreduce_average

from ringreduce.bench.sizes import parse_size


def gloo_median(t: torch.Tensor, ws: int, k: int) -> float:
    out = []
    for _ in range(k):
        dist.barrier()
        s = time.perf_counter()
        gloo_average(t, ws)
        out.append(time.perf_counter() - s)
    return statistics.median(out) * 1e6


def job(rank: int, ws: int, numel: int, calls: int, between: str) -> dict:
    t = torch.ones(numel)
    res = {"gloo first": gloo_median(t, ws, 60)}
    for _ in range(calls):
        if between == "ringreduce":
            ringreduce_average(t, ws)
        else:
            dist.all_reduce(t)
    res[f"gloo after {between}"] = gloo_median(t, ws, 60)
    for _ in range(calls):
        dist.all_reduce(t)
    res[f"then after {calls} gloo calls"] = gloo_median(t, ws, 60)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--size", default="1M", help="bytes of float32")
    ap.add_argument("--calls", type=int, default=600)
    ap.add_argument("--between", choices=("ringreduce", "gloo"), default="ringreduce")
    args = ap.parse_args()
    from ranks import close_pools, run_ranks

    res = run_ranks(args.nproc, job, max(1, parse_size(args.size) // 4), args.calls, args.between, timeout=1800)
    print(f"{args.nproc} ranks {args.size}B, {args.calls} calls: "
          + "  ".join(f"{k} {sum(r[k] for r in res) / args.nproc:.0f}" for k in res[0]) + " (us)", flush=True)
    close_pools()


if __name__ == "__main__":
    main()
