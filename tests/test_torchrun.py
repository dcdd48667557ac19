"""A real `torchrun --nnodes 2 --nproc-per-node 2` job: two nodes.

Two torchrun agents (node ranks 0 and 1) rendezvous; ringreduce must take the node layout from the
launcher's environment and run the hierarchical all-reduce across the nodes. Where the machine allows
it (root, network namespaces, tbf) each agent runs on a simulated host of its own (its network stack,
hostname and 1 Gbit/s link: ringreduce/bench/netns.py), else both on 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from ranks import free_port

from ringreduce._launch import stop_session
from ringreduce.bench.netns import MASTER_PORT, Cluster, ClusterRefused, preflight

HERE = os.path.dirname(os.path.abspath(__file__))


def _simulated_hosts() -> bool:
    try:
        preflight()
        with Cluster(1, "1gbit", prefix=f"rrc-{os.getpid()}-probe"):
            return True
    except ClusterRefused:
        return False


@pytest.mark.parametrize("where", ["simulated-hosts" if _simulated_hosts() else "loopback"])
def test_torchrun_two_nodes_two_ranks_each(tmp_path, where):
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")]))
    env.pop("RINGREDUCE_LOCAL_SIZE", None)
    (tmp_path / "tmp").mkdir()
    env["TMPDIR"] = str(tmp_path / "tmp")  # torchrun's agents leave their log folders there
    cluster = Cluster(2, "1gbit", prefix=f"rrc-{os.getpid()}-torchrun") if where == "simulated-hosts" else None
    addr, port = (cluster.addr(0), MASTER_PORT) if cluster else ("127.0.0.1", free_port())
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
           "--master-addr", addr, "--master-port", str(port)]
    if cluster:
        cluster.__enter__()  # removes what it built if building fails
    procs = [
        (cluster.popen if cluster else (lambda _node, argv, **kw: subprocess.Popen(argv, start_new_session=True, **kw)))(
            node, cmd + ["--node-rank", str(node), os.path.join(HERE, "torchrun_job.py"), str(tmp_path)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for node in (0, 1)
    ]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=600)[0])  # 11 s idle; minutes at load 10 (new interpreters)
    finally:
        for p in procs:
            stop_session(p, grace=45)  # torchrun stops its workers (each in a session of its own) on SIGTERM
        if cluster:
            cluster.down()
    for node, (p, text) in enumerate(zip(procs, outputs, strict=True)):
        assert p.returncode == 0, f"torchrun node {node} exited {p.returncode}:\n{text[-4000:]}"
    reports = [json.load(open(tmp_path / f"rank{r}.json")) for r in range(4)]
    S = 1 << 20
    for r in reports:
        assert not r["failures"], r
        assert r["group_rank"] == r["rank"] // 2 and r["local_rank"] == r["rank"] % 2
        assert r["layout"] == {"local_size": 2, "nodes": 2, "node_of": [0, 0, 1, 1]}
        if cluster:  # each node's ranks on their own host
            assert r["host"] == cluster.hostname(r["rank"] // 2)
    node = [0, 0, 1, 1]

    def cross(algo: str) -> list[int]:
        return [sum(b for p, b in enumerate(r[algo]) if node[p] != node[r["rank"]]) for r in reports]

    # flat ring: ranks 1 and 3 sit at a node boundary and send 2(n-1)/n S = 1.5 S across;
    # hierarchical (and auto, which picks it): every rank sends 2(M-1)/M S/L = 0.5 S across
    assert cross("ring") == [0, 3 * S // 2, 0, 3 * S // 2]
    assert cross("hierarchical") == [S // 2] * 4
    assert cross("auto") == [S // 2] * 4
