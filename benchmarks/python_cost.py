"""The Python part of one small all-reduce: ringreduce's per-call cost with the native submit stubbed out.

One process: a "fake" process group (torch's FakeStore) of world size 2, rank 0; the native submit
(ringreduce._C.submit_cpu, and the ring a repeated call's plan binds, ringreduce._C.CpuRing) is replaced
by a stub whose call is already done, so what is timed is
everything ringreduce does in Python around it (ops, _call, _rings.cpu, _groups, the knobs, the Work/wait
path). CPU time (time.process_time) per call over --calls calls, --repeats times; the median and the
fastest repeat are printed. Pin it to one core (`taskset -c 0 python benchmarks/python_cost.py`).

With --tree (twice or more), each tree's ringreduce is timed in its own child process, the trees
alternating --rounds times, and the medians are printed side by side with the load average: e.g. a
base commit's worktree against this one (Python-only changes need no rebuild there, only a copy of
this tree's ringreduce/_C*.so)::

    taskset -c 0 python benchmarks/python_cost.py --tree /tmp/rr-base --tree .
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def _load() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def measure(calls: int, repeats: int, numel: int, op: str, async_op: bool, profile: bool, dtype: str = "float32") -> dict:
    """Times `calls` calls of the all-reduce `op` ("avg": all_reduce_avg, else all_reduce with that op)
    of a tensor of `numel` elements of `dtype` (a torch dtype's name), `repeats` times; microseconds per call."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import ringreduce as rr
    from ringreduce import _native

    class Done:  # the handle of a call that already finished
        seq = 0

        def wait(self, ms: int) -> bool:
            return True

        def ok(self) -> bool:
            return True

        def is_completed(self) -> bool:
            return True

    class Ring:  # a plan's bound ring (Note [A bound ring] in csrc/torch/cpu_ops.h)
        def __init__(self, *args: object) -> None:
            pass

        def run(self, tensor: object, options: object) -> None:
            return None  # a synchronous call: done, no handle

        def submit(self, *args: object) -> Done:
            return done

    done = Done()
    _native.C.submit_cpu = lambda *args, **kwargs: done
    _native.C.CpuRing = Ring  # a tree whose plans bind a ring
    import importlib

    submitter = None  # the CPU path's module: ringreduce/_rings/cpu.py; _backend/cpu.py, _dispatch.py in older trees
    for name in ("ringreduce._rings.cpu", "ringreduce._backend.cpu", "ringreduce._dispatch"):
        try:
            submitter = importlib.import_module(name)
            break
        except ImportError:
            continue

    if hasattr(submitter, "_NATIVE_SUBMIT"):  # a tree whose fast path calls the extension directly
        submitter._NATIVE_SUBMIT = _native.C.submit_cpu  # the stub stands for the extension's submit
    if hasattr(submitter, "_NATIVE_RUN"):  # an older tree whose fast path calls run_cpu
        submitter._NATIVE_RUN = lambda *args: None
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    tensor = torch.ones(numel, dtype=getattr(torch, dtype))
    if op == "avg":
        def call() -> object:
            return rr.all_reduce_avg(tensor, async_op=async_op)
    else:
        def call() -> object:
            return rr.all_reduce(tensor, op=op, async_op=async_op)
    for _ in range(min(calls, 2000)):
        call()
    per_call = []
    for _ in range(repeats):
        start = time.process_time()
        for _ in range(calls):
            call()
        per_call.append((time.process_time() - start) / calls * 1e6)
    if profile:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.runcall(lambda: [call() for _ in range(calls)])
        pstats.Stats(prof, stream=sys.stderr).sort_stats("tottime").print_stats(15)
    dist.destroy_process_group()
    return {"ringreduce": os.path.dirname(rr.__file__), "median_us": statistics.median(per_call),
            "min_us": min(per_call), "repeats_us": per_call}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=20000, help="calls per timed repeat (default 20000)")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats per process (default 5)")
    parser.add_argument("--numel", type=int, default=256, help="elements (default 256 = 1 KiB of float32)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16", "float64"),
                        help="the tensor's dtype (default float32)")
    parser.add_argument("--op", default="avg", help="avg (all_reduce_avg, default) or an op of all_reduce")
    parser.add_argument("--async-op", action="store_true", help="async_op=True (the Work path)")
    parser.add_argument("--profile", action="store_true", help="print a cProfile of one more repeat (stderr)")
    parser.add_argument("--tree", action="append", default=[],
                        help="a source tree whose ringreduce to time (repeat it to compare trees side by side)")
    parser.add_argument("--rounds", type=int, default=3, help="with --tree: child processes per tree (default 3)")
    parser.add_argument("--json", action="store_true", help="print one JSON line (the children's format)")
    args = parser.parse_args(argv)
    if not args.tree:
        result = measure(args.calls, args.repeats, args.numel, args.op, args.async_op, args.profile, args.dtype)
        result["load"] = _load()
        if args.json:
            print(json.dumps(result))
        else:
            print(f"{result['ringreduce']}: {result['median_us']:.2f} us per call (median of {args.repeats}), "
                  f"fastest {result['min_us']:.2f} us; load average {result['load']}")
        return 0
    trees = [os.path.abspath(t) for t in args.tree]
    child = [sys.executable, os.path.abspath(__file__), "--json", "--calls", str(args.calls), "--repeats",
             str(args.repeats), "--numel", str(args.numel), "--op", args.op, "--dtype", args.dtype] + (["--async-op"] if args.async_op else [])
    medians: dict[str, list[float]] = {t: [] for t in trees}
    loads = [_load()]
    for _ in range(args.rounds):
        for tree in trees:  # alternating, so that a change of load hits every tree alike
            env = dict(os.environ, PYTHONPATH=tree)
            out = subprocess.run(child, env=env, cwd=tree, capture_output=True, text=True, timeout=600)
            if out.returncode != 0:
                print(out.stderr, file=sys.stderr)
                return out.returncode
            result = json.loads(out.stdout.strip().splitlines()[-1])
            if os.path.realpath(result["ringreduce"]) != os.path.realpath(os.path.join(tree, "ringreduce")):
                print(f"python_cost: {tree} imported ringreduce from {result['ringreduce']}", file=sys.stderr)
                return 1
            medians[tree].append(result["median_us"])
            loads.append(result["load"])
    itemsize = {"float64": 8, "float32": 4}.get(args.dtype, 2)
    what = f"{'all_reduce_avg' if args.op == 'avg' else f'all_reduce op={args.op}'} of {args.numel * itemsize} bytes " \
        f"of {args.dtype}" + (
        ", async_op=True" if args.async_op else "")
    print(f"Python per call ({what}), us: median of {args.rounds} processes x {args.repeats} repeats of "
          f"{args.calls} calls")
    print(f"{'tree':<40} {'median':>8} {'per process':>30}")
    for tree in trees:
        per = " ".join(f"{m:.2f}" for m in medians[tree])
        print(f"{tree:<40} {statistics.median(medians[tree]):8.2f} {per:>30}")
    print(f"load average (1/5/15 min) at start and after each process: {'; '.join(loads)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
