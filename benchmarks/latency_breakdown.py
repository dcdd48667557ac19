"""Where ringreduce's CPU time goes at small sizes: `python benchmarks/latency_breakdown.py OUT.json`.

Each iteration runs every configuration once, in turn, each call preceded by a barrier (so no call
overlaps the previous one), on 2 and 4 local gloo ranks (tests/ranks.py), at 8 B and 1 MiB; prints
the median per call averaged over ranks: stock gloo all_reduce + div_, ringreduce with and without the
agreement check (RINGREDUCE_CHECK), with one segment per chunk instead of two
(RINGREDUCE_SEGMENT_BYTES), and with full waits instead of receive-only waits
(RINGREDUCE_RECV_ONLY_WAITS=0).
"""
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from averaging import average

CONFIGS = [
    ("gloo all_reduce+div_", None),
    ("rr check on (default)", {}),
    ("rr check off", {"RINGREDUCE_CHECK": "0"}),
    ("rr check off, 1 segment/chunk", {"RINGREDUCE_CHECK": "0", "RINGREDUCE_SEGMENT_BYTES": str(64 << 20)}),
    ("rr check on, full waits", {"RINGREDUCE_RECV_ONLY_WAITS": "0"}),
    ("rr check off, full waits", {"RINGREDUCE_CHECK": "0", "RINGREDUCE_RECV_ONLY_WAITS": "0"}),
]
KEYS = ("RINGREDUCE_CHECK", "RINGREDUCE_SEGMENT_BYTES", "RINGREDUCE_RECV_ONLY_WAITS")

def _set_env(env: dict | None) -> None:
    for k in KEYS:
        os.environ.pop(k, None)
    if env:
        os.environ.update(env)


def job(rank: int, ws: int, numel: int, iters: int) -> dict:
    t = torch.ones(numel)
    times: dict[str, list[float]] = {name: [] for name, _ in CONFIGS}
    for it in range(iters + 3):
        for name, env in CONFIGS:
            _set_env(env)
            dist.barrier()
            s = time.perf_counter()
            average("gloo" if env is None else "rr", t, ws)
            if it >= 3:
                times[name].append(time.perf_counter() - s)
    _set_env(None)
    return {k: statistics.median(v) * 1e6 for k, v in times.items()}


if __name__ == "__main__":
    from ranks import close_pools, run_ranks
    out = {}
    for n in (2, 4):
        for numel in (2, 262144):
            res = run_ranks(n, job, numel, 300)
            row = {k: sum(r[k] for r in res) / n for k in res[0]}
            out[f"{n} ranks {numel * 4} B"] = row
            print(f"{n} ranks, {numel * 4} B:", {k: round(v) for k, v in row.items()}, flush=True)
    with open(sys.argv[1], "w") as f:
        json.dump(out, f, indent=1)
    close_pools()
