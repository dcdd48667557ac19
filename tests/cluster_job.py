"""One rank of tests/tools/test_cluster.py, run on a simulated host (ringreduce/bench/netns.py).

    python cluster_job.py OUT_DIR CALLS NUMEL

Environment as torchrun sets it (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK,
MASTER_ADDR, MASTER_PORT), plus CLUSTER_JOIN_TIMEOUT (seconds: the roll call's and the group's, so that a
rank slow to start on a loaded machine still joins, and the ring's first call: RINGREDUCE_TIMEOUT),
CLUSTER_CALL_TIMEOUT (RINGREDUCE_TIMEOUT from the second call on) and, if set,
CLUSTER_GO (a path: the rank writes OUT_DIR/started<rank> and joins once the path exists). Joins the
default (gloo) group after a roll call (ringreduce/bench/rollcall.py), then runs CALLS all-reduces of
NUMEL exact elements (after the first,
OUT_DIR/ready<rank> exists), checks every result, and writes OUT_DIR/rank<rank>.json: the calls done,
the hostname, and the exception that stopped it (type, the DistBackendError check, message,
seconds from the failing call's start). Exits 0 after all calls, 3 after an exception. SIGUSR1 writes
every thread's Python stack to stderr (faulthandler).
"""

from __future__ import annotations

import datetime
import faulthandler
import json
import os
import signal
import socket
import sys
import time

import torch
import torch.distributed as dist

import ringreduce
from ringreduce.bench.rollcall import init_process_group


def main() -> int:
    out_dir, calls, numel = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    rank = int(os.environ["RANK"])
    faulthandler.register(signal.SIGUSR1, file=sys.stderr)  # the test asks a rank past its limit where it waits
    report: dict = {"rank": rank, "host": socket.gethostname(), "calls": 0, "error": None}
    timeout = datetime.timedelta(seconds=float(os.environ["CLUSTER_JOIN_TIMEOUT"]))
    started = time.monotonic()
    code = 0
    try:
        go = os.environ.get("CLUSTER_GO")
        if go:  # the test starts the ranks' joins together: new interpreters start slowly on a loaded machine
            open(os.path.join(out_dir, f"started{rank}"), "w").close()
            deadline = time.monotonic() + 600
            while not os.path.exists(go):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{go} did not appear within 600 s")
                time.sleep(0.05)
        init_process_group("gloo", timeout)
        n = dist.get_world_size()
        want = torch.arange(numel, dtype=torch.float32) * n + n * (n - 1) / 2
        for i in range(calls):
            t = torch.arange(numel, dtype=torch.float32) + rank
            started = time.monotonic()
            ringreduce.all_reduce(t)
            if not torch.equal(t, want):
                raise AssertionError(f"call {i}: wrong result")
            report["calls"] = i + 1
            if i == 0:
                # The first call made the ring (segments, connections) under the join's timeout; the
                # faults are measured against the calls' (the knob's documented change mid-run).
                os.environ["RINGREDUCE_TIMEOUT"] = os.environ["CLUSTER_CALL_TIMEOUT"]
                ringreduce.reload_knobs()
                open(os.path.join(out_dir, f"ready{rank}"), "w").close()
    except Exception as e:  # noqa: BLE001 - the report says what it was
        report["error"] = {"type": type(e).__name__, "dist_backend_error": isinstance(e, dist.DistBackendError),
                           "message": str(e)[:2000], "seconds": time.monotonic() - started}
        code = 3
    with open(os.path.join(out_dir, f"rank{rank}.json.tmp"), "w") as f:
        json.dump(report, f)
    os.replace(os.path.join(out_dir, f"rank{rank}.json.tmp"), os.path.join(out_dir, f"rank{rank}.json"))
    sys.stdout.flush()
    os._exit(code)  # a failed group must not hang the exit in its destructors


if __name__ == "__main__":
    sys.exit(main())
