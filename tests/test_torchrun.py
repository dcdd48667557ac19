"""A real `torchrun --nnodes 2 --nproc-per-node 2` job on localhost: two simulated nodes.

Two torchrun agents (node ranks 0 and 1) rendezvous on 127.0.0.1; ringreduce must take the node
layout from the launcher's environment and run the hierarchical all-reduce across the "nodes".
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from ranks import free_port

HERE = os.path.dirname(os.path.abspath(__file__))


def test_torchrun_two_nodes_two_ranks_each(tmp_path):
    port = free_port()
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    env.pop("RINGREDUCE_LOCAL_SIZE", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(port)]
    procs = [
        subprocess.Popen(cmd + ["--node-rank", str(node), os.path.join(HERE, "torchrun_job.py"), str(tmp_path)],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for node in (0, 1)
    ]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=240)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for node, (p, text) in enumerate(zip(procs, outputs, strict=True)):
        assert p.returncode == 0, f"torchrun node {node} exited {p.returncode}:\n{text[-4000:]}"
    reports = [json.load(open(tmp_path / f"rank{r}.json")) for r in range(4)]
    S = 1 << 20
    for r in reports:
        assert not r["failures"], r
        assert r["group_rank"] == r["rank"] // 2 and r["local_rank"] == r["rank"] % 2
        assert r["layout"] == {"local_size": 2, "nodes": 2, "node_of": [0, 0, 1, 1]}
    node = [0, 0, 1, 1]

    def cross(algo: str) -> list[int]:
        return [sum(b for p, b in enumerate(r[algo]) if node[p] != node[r["rank"]]) for r in reports]

    # flat ring: ranks 1 and 3 sit at a node boundary and send 2(n-1)/n S = 1.5 S across;
    # hierarchical (and auto, which picks it): every rank sends 2(M-1)/M S/L = 0.5 S across
    assert cross("ring") == [0, 3 * S // 2, 0, 3 * S // 2]
    assert cross("hierarchical") == [S // 2] * 4
    assert cross("auto") == [S // 2] * 4
