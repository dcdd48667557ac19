"""The Python part of one CPU call: ``ringreduce.all_reduce_avg`` with the native submit replaced by a
stub that returns a completed handle, so that nothing but the Python path (argument checks, group
resolution, knobs, profiler range) is timed. Two gloo ranks on loopback (the calls need an initialized
group of size > 1); best of 5 loops of 20000 calls, microseconds per call, per rank.

    python benchmarks/python_overhead.py

Compare: ``python -c "import torch; ..."`` timings of ``dist.all_reduce`` include gloo's own work, so
this is ringreduce's overhead alone, not a side-by-side ratio.
"""
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))


class _Done:
    """A completed native call handle."""

    seq = 0

    def wait(self, timeout_ms: int) -> bool:
        return True

    def ok(self) -> bool:
        return True


def job(rank: int, ws: int, calls: int) -> float:
    import ringreduce as rr
    from ringreduce._native import C

    t = torch.ones(2)
    for _ in range(50):  # warm caches with real calls first
        rr.all_reduce_avg(t)
    real = C.submit_cpu
    done = _Done()
    C.submit_cpu = lambda *args, **kwargs: done
    try:
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(calls):
                rr.all_reduce_avg(t)
            best = min(best, (time.perf_counter() - start) / calls)
    finally:
        C.submit_cpu = real
    return best * 1e6


def main() -> None:
    from ranks import close_pools, run_ranks

    per_rank = run_ranks(2, job, 20000)
    print("ringreduce.all_reduce_avg, Python path only (native submit stubbed), us per call: "
          + "  ".join(f"rank {r} {us:.1f}" for r, us in enumerate(per_rank)), flush=True)
    close_pools()


if __name__ == "__main__":
    main()
