"""Run by tests/test_torchrun.py under `torchrun --nnodes 2 --nproc-per-node 2` (two simulated nodes).

Checks, on every rank, that ringreduce reads the node layout from the launcher (GROUP_RANK,
LOCAL_WORLD_SIZE; no RINGREDUCE_LOCAL_SIZE), that algorithm="auto" then runs the hierarchical
all-reduce (its cross-node bytes), and that results are exact; writes a JSON report per rank.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from refdata import OPS, bits_equal, exact_input, gather_inputs, reference, supported  # noqa: E402

import ringreduce as rr  # noqa: E402
from ringreduce._groups import node_layout, resolve  # noqa: E402
from ringreduce._native import C  # noqa: E402


def main() -> int:
    out_dir = sys.argv[1]
    assert "RINGREDUCE_LOCAL_SIZE" not in os.environ
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank, ws = dist.get_rank(), dist.get_world_size()
    report: dict = {"rank": rank, "group_rank": int(os.environ["GROUP_RANK"]),
                    "local_rank": int(os.environ["LOCAL_RANK"]), "host": socket.gethostname()}
    layout = node_layout(resolve(None))
    report["layout"] = {"local_size": layout.local_size, "nodes": layout.nodes, "node_of": list(layout.node_of_member)}
    failures = []
    for dtype in (torch.float32, torch.bfloat16, torch.int32, torch.float64):
        for op in OPS:
            if not supported(dtype, op):
                continue
            for numel in (1, 5, 1000, 65537):
                t = exact_input(numel, rank, dtype, op)
                want = reference(gather_inputs(t), op)
                rr.all_reduce(t, op=op)
                if not bits_equal(t, want):
                    failures.append(f"auto {dtype} {op} {numel}")
    pg = dist.group.WORLD
    S = 1 << 20
    for algo in ("ring", "hierarchical", "auto"):
        t = torch.ones(S // 4)
        C.bytes_sent(pg, True)
        rr.all_reduce_avg(t, algorithm=algo)
        sent = C.bytes_sent(pg, True)
        if not bool(torch.all(t == 1)):
            failures.append(f"{algo} avg")
        report[algo] = sent
    # reduce_scatter / all_gather across the two nodes
    y = torch.empty(3)
    rr.reduce_scatter(y, torch.arange(3 * ws, dtype=torch.float32) * (rank + 1))
    if not torch.equal(y, (torch.arange(3 * ws, dtype=torch.float32) * (ws * (ws + 1) // 2))[3 * rank:3 * rank + 3]):
        failures.append("reduce_scatter")
    if not torch.equal(rr.all_gather(torch.tensor([rank])), torch.arange(ws)):
        failures.append("all_gather")
    report["failures"] = failures
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
