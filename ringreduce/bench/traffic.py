"""Cross-node traffic of the flat and the hierarchical ring: ``python -m ringreduce.bench.traffic``.

The payload bytes each rank sent across a node boundary (the CPU transport's counters) next to the
analytic counts of docs/algorithm.md; nodes from the launcher or ``--local-size``, and with ``--link-dev``
what each node's link carried (docs/design.md section 6).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from ringreduce.bench.sizes import parse_size


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ringreduce.bench.traffic", description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=4, help="local ranks to spawn (ignored under torchrun)")
    p.add_argument("--local-size", type=int, default=2,
                   help="simulated ranks per node when spawning locally (RINGREDUCE_LOCAL_SIZE)")
    p.add_argument("--size", type=parse_size, default=parse_size("16M"), help="message size in bytes")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--iters", type=int, default=5, help="timed iterations per algorithm")
    p.add_argument("--json", default=None, help="write the report here")
    p.add_argument("--link-dev", default=None,
                   help="network device whose tc qdisc counters are this node's link (rr0 on simulated hosts)")
    return p


def expected_cross_node_bytes(algorithm: str, n: int, local: int, size: int) -> dict[str, float]:
    """Analytic cross-node payload bytes sent per rank (max and mean over ranks) for S = size bytes: flat
    ring, only each node's last rank sends across, 2(n-1)/n S; hierarchical, every rank 2(M-1)/M * S/L."""
    nodes = n // local
    if algorithm == "ring":
        per_boundary = 2 * (n - 1) / n * size
        return {"max": per_boundary if nodes > 1 else 0.0, "mean": per_boundary * nodes / n if nodes > 1 else 0.0}
    per_rank = 2 * (nodes - 1) / nodes * size / local
    return {"max": per_rank, "mean": per_rank}


# A link carries headers, ACKs, barriers and the store beyond the payload: [1, 1 + this] x the model.
MODEL_TOLERANCE = 0.15


def link_bytes(dev: str) -> int:
    """Bytes sent through `dev`'s tbf/htb qdiscs so far (tc -s -j qdisc show dev DEV)."""
    import subprocess

    out = subprocess.run(["tc", "-s", "-j", "qdisc", "show", "dev", dev], capture_output=True, text=True,
                         check=True, timeout=30).stdout
    return sum(int(q.get("bytes", 0)) for q in json.loads(out) if q.get("kind") in ("tbf", "htb"))


def run_rank(args: argparse.Namespace) -> dict[str, Any] | None:
    import ringreduce as rr
    from ringreduce._groups import node_layout, resolve
    from ringreduce._native import C

    info = resolve(None)
    assert info is not None
    rank, n = info.rank, info.size
    layout = node_layout(info)
    nodes = list(layout.node_of_member)
    dtype = getattr(torch, args.dtype)
    numel = max(1, args.size // torch.empty((), dtype=dtype).element_size())
    out: dict[str, Any] = {"rank": rank, "node": nodes[rank], "algorithms": {}}
    pg = dist.group.WORLD
    reads_link = args.link_dev is not None and os.environ.get("LOCAL_RANK", "0") == "0"
    for algo in ("ring", "hierarchical"):
        t = torch.ones(numel, dtype=dtype) * (rank + 1)
        dist.barrier()
        link_before = link_bytes(args.link_dev) if reads_link else 0
        C.bytes_sent(pg, True)
        rr.all_reduce(t, algorithm=algo)
        sent = C.bytes_sent(pg, True)
        ok = bool(torch.all(t == n * (n + 1) / 2))
        times = []
        for _ in range(args.iters):
            dist.barrier()
            start = time.perf_counter()
            rr.all_reduce(t, algorithm=algo)
            times.append(time.perf_counter() - start)
        dist.barrier()
        link_after = link_bytes(args.link_dev) if reads_link else 0
        C.bytes_sent(pg, True)
        cross = sum(b for peer, b in enumerate(sent) if nodes[peer] != nodes[rank])
        out["algorithms"][algo] = {
            "sent_bytes": int(sum(sent)),
            "cross_node_bytes": int(cross),
            "median_us": statistics.median(times) * 1e6,
            "correct": ok,
            "calls": 1 + args.iters,
            "link_sent_bytes": link_after - link_before if reads_link else None,
        }
    gathered: list[Any] = [None] * n
    dist.all_gather_object(gathered, out)
    return {"ranks": gathered, "nodes": nodes, "local_size": layout.local_size, "numel": numel} if rank == 0 else None


def report(res: dict[str, Any], args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    ranks, size = res["ranks"], args.size
    n = len(ranks)
    local = res["local_size"] or n
    nodes = sorted(set(res["nodes"]))
    lines = [
        f"# ringreduce cross-node traffic: {n} ranks on {len(nodes)} node(s) x {local}, {args.dtype}, "
        f"{size} B per rank, payload bytes sent (frames excluded)",
        f"# {'algorithm':<13}{'rank':>5}{'node':>5}{'sent (B)':>14}{'cross-node (B)':>16}{'cross / S':>11}"
        f"{'time (us)':>12}{'ok':>4}",
    ]
    summary: dict[str, Any] = {}
    for algo in ("ring", "hierarchical"):
        for r in ranks:
            a = r["algorithms"][algo]
            lines.append(
                f"  {algo:<13}{r['rank']:>5}{r['node']:>5}{a['sent_bytes']:>14}{a['cross_node_bytes']:>16}"
                f"{a['cross_node_bytes'] / size:>11.3f}{a['median_us']:>12.0f}{'yes' if a['correct'] else 'NO':>4}"
            )
        per_node = {nd: sum(r["algorithms"][algo]["cross_node_bytes"] for r in ranks if r["node"] == nd) for nd in nodes}
        cross = [r["algorithms"][algo]["cross_node_bytes"] for r in ranks]
        expect = expected_cross_node_bytes(algo, n, local, size) if res["local_size"] else {"max": 0.0, "mean": 0.0}
        link = {r["node"]: r["algorithms"][algo]["link_sent_bytes"] for r in ranks
                if r["algorithms"][algo].get("link_sent_bytes") is not None}
        calls = ranks[0]["algorithms"][algo]["calls"]
        model_node = expect["mean"] * local * calls  # every node sends the same cross-node payload
        summary[algo] = {
            "model_node_bytes": model_node,
            "link_sent_bytes_per_node": link,
            "link_over_model": {nd: b / model_node for nd, b in link.items()} if model_node > 0 else {},
            "cross_node_bytes_max_rank": max(cross),
            "cross_node_bytes_per_node": per_node,
            "expected_max_rank": expect["max"],
            "median_us": statistics.median(r["algorithms"][algo]["median_us"] for r in ranks),
            "correct": all(r["algorithms"][algo]["correct"] for r in ranks),
        }
        lines.append(
            f"# {algo}: max per rank {max(cross)} B = {max(cross) / size:.3f} S (expected {expect['max'] / size:.3f} S); "
            "per node " + ", ".join(f"node {nd} {b} B" for nd, b in per_node.items())
        )
        if link and model_node > 0:
            lines.append(f"# {algo}: link bytes out of each node over {calls} calls vs the model's payload "
                         f"{model_node:.0f} B: " + ", ".join(f"node {nd} {b} B ({b / model_node:.3f}x)"
                                                            for nd, b in sorted(link.items())))
    return "\n".join(lines), summary


def _in_group(args: argparse.Namespace) -> int:
    """Runs this rank; rank 0 prints the report (and writes the JSON). Returns 1 if a result was wrong."""
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    try:
        res = run_rank(args)
    finally:
        dist.destroy_process_group()
    if res is None:
        return 0  # not rank 0
    text, summary = report(res, args)
    print(text, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": " ".join(sys.argv), "result": res, "summary": summary}, f, indent=1, default=str)
    return 0 if all(s["correct"] for s in summary.values()) else 1


def main(argv: list[str] | None = None) -> int:
    from ringreduce.bench.launch import spawn, under_launcher

    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    if under_launcher():
        return _in_group(args)
    if args.nproc % args.local_size != 0:
        print(f"--nproc {args.nproc} is not a multiple of --local-size {args.local_size}", file=sys.stderr)
        return 2
    return spawn(_in_group, args, args.nproc, "ringreduce.bench.traffic", 1, local_size=args.local_size)

if __name__ == "__main__":
    sys.exit(main())
