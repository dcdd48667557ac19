"""ringreduce and gloo calls interleaved A B B A ... without barriers, each call's time split by the
implementation of the call before it, and the total time of the stream.

    python benchmarks/interleave_split.py --nproc 4 --size 1M --rounds 400

Ranks finish a call at different times, so with more ranks than CPUs the tail of one call on some
ranks runs beside the next call on others. This shows how much one implementation's calls slow the
other's: "gloo after rr" against "gloo after gloo", and the total per round (one call of each), which
no such shift changes. It is why `python -m ringreduce.bench` puts a barrier between calls of
different implementations (ringreduce/bench/sweep.py). Medians per call, mean over ranks.
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


def job(rank: int, ws: int, numel: int, rounds: int) -> dict:
    a = torch.ones(numel)
    b = torch.ones(numel)
    order = []
    for r in range(rounds):
        order += ["rr", "gloo"] if r % 2 == 0 else ["gloo", "rr"]
    times: dict[str, list[float]] = {}
    prev = None
    dist.barrier()
    start = time.perf_counter()
    for i, name in enumerate(order):
        s = time.perf_counter()
        average(name, a if name == "rr" else b, ws)
        if i >= 10:
            times.setdefault(f"{name} after {prev}", []).append(time.perf_counter() - s)
        prev = name
    out = {k: statistics.median(v) * 1e6 for k, v in times.items()}
    out["total per round"] = (time.perf_counter() - start) / rounds * 1e6
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--size", default="1M", help="bytes of float32")
    ap.add_argument("--rounds", type=int, default=400)
    args = ap.parse_args()
    from ranks import close_pools, run_ranks

    res = run_ranks(args.nproc, job, max(1, parse_size(args.size) // 4), args.rounds, timeout=1800)
    keys = ["rr after rr", "rr after gloo", "gloo after gloo", "gloo after rr", "total per round"]
    print(f"{args.nproc} ranks {args.size}B: " + "  ".join(f"{k} {sum(r[k] for r in res) / args.nproc:.0f}"
                                                          for k in keys) + " (us)", flush=True)
    close_pools()


if __name__ == "__main__":
    main()
