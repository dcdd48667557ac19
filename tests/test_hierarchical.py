"""The hierarchical all-reduce on CPU ranks with simulated nodes (RINGREDUCE_LOCAL_SIZE).

Same semantics as the flat ring: exact data bitwise against a float64 reference, random data against
torch.distributed, bitwise agreement across ranks, accum_dtype rounding once; plus what only the
hierarchical ring does: which bytes cross a node boundary (the transport's counters).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from ranks import CPU_PLACES, SHM_ONLY, only_place, place_cases, run_ranks
from refdata import OPS, bits_equal, exact_input, gather_inputs, reference, same_on_all_ranks, supported, types_for

import ringreduce as rr
from ringreduce._native import C

PLACES = CPU_PLACES  # conftest.py: every test at each place (Note [Places] in ranks.py)


class _env:
    def __init__(self, **env: str) -> None:
        self.env = env
        self.old: dict[str, str | None] = {}

    def __enter__(self) -> None:
        for k, v in self.env.items():
            self.old[k] = os.environ.get(k)
            os.environ[k] = v
        rr.reload_knobs()  # the rings read their knobs again (ringreduce/_config.py)

    def __exit__(self, *exc: object) -> None:
        for k, v in self.old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        rr.reload_knobs()  # the rings read their knobs again (ringreduce/_config.py)


def _exact(rank: int, ws: int, local: int, tiny: bool, dtypes: list[torch.dtype]) -> list[str]:
    env = {"RINGREDUCE_LOCAL_SIZE": str(local)}
    if tiny:
        env.update(RINGREDUCE_SEGMENT_BYTES="16", RINGREDUCE_SLOTS="2")
    failures = []
    with _env(**env):
        for dtype in dtypes:
            for op in OPS:
                if not supported(dtype, op):
                    continue
                for numel in (1, 3, 5, 7, 13, 97, 1000):
                    t = exact_input(numel, rank, dtype, op)
                    want = reference(gather_inputs(t), op)
                    rr.all_reduce(t, op=op, algorithm="hierarchical")
                    if not bits_equal(t, want):
                        failures.append(f"{dtype} {op} numel={numel}: {t[:5].tolist()} != {want[:5].tolist()}")
                    elif not same_on_all_ranks(t):
                        failures.append(f"{dtype} {op} numel={numel}: ranks differ")
    return failures


# tcp: tiny segments (every stage pipelined); every dtype over shm (ranks.py's Note [Places])
@place_cases("local,tiny", [(2, False), (2, True)], tcp=[(2, True)])
def test_exact_every_dtype_and_op_two_nodes(local, tiny, place):
    for rank, failures in enumerate(run_ranks(4, _exact, local, tiny, types_for(place))):
        assert not failures, f"rank {rank}: {failures[:5]}"


def _random(rank: int, ws: int) -> dict:
    out = {}
    g = torch.Generator().manual_seed(99 + rank)
    with _env(RINGREDUCE_LOCAL_SIZE="2"):
        for dtype, tol in [(torch.float32, 1e-5), (torch.float64, 1e-12), (torch.bfloat16, 3e-2), (torch.float16, 3e-3)]:
            for numel in (4099, (1 << 18) + 3):
                x = torch.randn(numel, generator=g).to(dtype)
                ref = x.double().clone()  # .double() of a float64 tensor is the tensor itself
                dist.all_reduce(ref)
                h = x.clone()
                rr.all_reduce_avg(h)  # auto: two simulated nodes -> hierarchical
                out[f"{dtype} {numel} vs torch"] = torch.allclose(h.double(), ref / ws, rtol=tol, atol=tol)
                out[f"{dtype} {numel} same bits"] = same_on_all_ranks(h)
                f = x.clone()
                rr.all_reduce_avg(f, algorithm="ring")
                out[f"{dtype} {numel} vs flat"] = torch.allclose(h.double(), f.double(), rtol=tol, atol=tol)
        # accum_dtype=float32 rounds once: values whose float32 sums are exact give exactly the
        # float64 sum rounded to bfloat16 (the flat ring's accum mode gives the same)
        x = (torch.rand(5000, generator=g) * 3 + 0.5).to(torch.bfloat16)
        want = gather_inputs(x).double().sum(0).to(torch.bfloat16)
        h = x.clone()
        rr.all_reduce(h, accum_dtype=torch.float32, algorithm="hierarchical")
        out["accum rounds once"] = torch.equal(h, want)
        # non-contiguous and async
        base = torch.arange(60, dtype=torch.float32).reshape(6, 10) * (rank + 1)
        view = base[:, 1:9].t()
        rr.all_reduce(view, algorithm="hierarchical")
        out["view"] = torch.equal(view, (torch.arange(60, dtype=torch.float32).reshape(6, 10) * 10)[:, 1:9].t())
        out["outside view"] = torch.equal(base[:, 0], torch.arange(0, 60, 10, dtype=torch.float32) * (rank + 1))
        works = [rr.all_reduce(torch.full((1000,), float(i)), algorithm="hierarchical", async_op=True) for i in range(8)]
        out["async"] = all(w.wait() and torch.equal(w.result()[0], torch.full((1000,), float(i * ws)))
                           for i, w in enumerate(works))
    return out


def test_random_data_vs_torch_and_flat_ring():
    for rank, res in enumerate(run_ranks(4, _random)):
        assert all(res.values()), f"rank {rank}: {res}"


def _traffic(rank: int, ws: int) -> dict:
    pg = dist.group.WORLD
    size = 1 << 20  # bytes per rank (float32)
    out: dict = {}
    with _env(RINGREDUCE_LOCAL_SIZE="2"):
        for algo in ("ring", "hierarchical", "auto"):
            t = torch.ones(size // 4)
            C.bytes_sent(pg, True)
            rr.all_reduce(t, algorithm=algo)
            sent = C.bytes_sent(pg, True)
            out[algo] = {"sent": sent, "ok": bool(torch.all(t == ws))}
    with _env(RINGREDUCE_LOCAL_SIZE="4"):  # one node of 4: auto is the flat ring
        t = torch.ones(size // 4)
        C.bytes_sent(pg, True)
        rr.all_reduce(t)
        out["one node auto"] = {"sent": C.bytes_sent(pg, True), "ok": bool(torch.all(t == ws))}
    return out


@only_place("tcp")  # its ranks run over gloo point-to-point whatever the module's transport
def test_cross_node_bytes_flat_vs_hierarchical():
    """4 ranks = 2 nodes x 2, S = 1 MiB: the flat ring's boundary ranks send 2(n-1)/n S = 1.5 S across
    nodes, the others none; hierarchically every rank sends 2(M-1)/M S/L = 0.5 S across."""
    res = run_ranks(4, _traffic, transport="tcp")  # gloo point-to-point bytes (one node: no shared memory)
    S = 1 << 20
    node = [0, 0, 1, 1]
    for algo in ("ring", "hierarchical", "auto", "one node auto"):
        assert all(r[algo]["ok"] for r in res), algo
    cross = {algo: [sum(b for p, b in enumerate(r[algo]["sent"]) if node[p] != node[rank]) for rank, r in enumerate(res)]
             for algo in ("ring", "hierarchical", "auto", "one node auto")}
    total = {algo: [sum(r[algo]["sent"]) for r in res] for algo in ("ring", "hierarchical")}
    assert cross["ring"] == [0, 3 * S // 2, 0, 3 * S // 2], cross
    assert cross["hierarchical"] == [S // 2] * 4, cross
    assert cross["auto"] == cross["hierarchical"]
    assert cross["one node auto"] == cross["ring"]
    # both move 2(n-1)/n S per rank in total on this layout (1.5 S): only where they go differs
    assert total["ring"] == [3 * S // 2] * 4 and total["hierarchical"] == [3 * S // 2] * 4, total


def _uneven(rank: int, ws: int) -> dict:
    out = {}
    with _env(RINGREDUCE_LOCAL_SIZE="2"):  # 3 ranks: nodes of 2 and 1
        t = torch.ones(10)
        try:
            rr.all_reduce(t, algorithm="hierarchical")
            out["explicit"] = "did not raise"
        except ValueError as exc:
            out["explicit"] = "ok" if "same number of ranks" in str(exc) else str(exc)
        out["unchanged"] = bool(torch.all(t == 1))
        rr.all_reduce(t)  # auto falls back to the flat ring
        out["auto"] = bool(torch.all(t == ws))
    return out


def test_uneven_nodes_refused_clearly_auto_falls_back():
    for rank, res in enumerate(run_ranks(3, _uneven)):
        assert res == {"explicit": "ok", "unchanged": True, "auto": True}, f"rank {rank}: {res}"


def _disagree(rank: int, ws: int) -> str:
    with _env(RINGREDUCE_LOCAL_SIZE="2"):
        try:
            rr.all_reduce(torch.ones(8), algorithm="ring" if rank == 0 else "hierarchical")
        except RuntimeError as exc:
            ok = "algorithm" in str(exc)
        else:
            return "did not raise"
        t = torch.ones(8)
        rr.all_reduce(t)
        return "ok" if ok and bool(torch.all(t == ws)) else "bad"


def test_ranks_disagreeing_on_algorithm_all_raise():
    assert run_ranks(4, _disagree) == ["ok"] * 4


def _mesh_hier(rank: int, ws: int) -> dict:
    # two simulated nodes, and a DeviceMesh (2, 2): the flattened mesh is the whole world, so the
    # hierarchical layout is found for a rank list too
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    out = {}
    with _env(RINGREDUCE_LOCAL_SIZE="2"):
        t = torch.arange(100, dtype=torch.float64) * (rank + 1)
        rr.all_reduce(t, group=mesh, algorithm="hierarchical")
        out["mesh flattened"] = torch.equal(t, torch.arange(100, dtype=torch.float64) * 10)
        t = torch.arange(100, dtype=torch.float64) * (rank + 1)
        rr.all_reduce(t, group=mesh["a"])  # ranks {rank % 2, rank % 2 + 2}: one per node, flat
        other = (rank + 2) % 4
        out["mesh dim"] = torch.equal(t, torch.arange(100, dtype=torch.float64) * (rank + 1 + other + 1))
    return out


def test_device_mesh_groups():
    for rank, res in enumerate(run_ranks(4, _mesh_hier)):
        assert all(res.values()), f"rank {rank}: {res}"


@SHM_ONLY  # arithmetic, no ranks
def test_traffic_report_arithmetic():
    from ringreduce.bench.traffic import expected_cross_node_bytes

    S = 1 << 20
    # the example: 2 nodes x 4 ranks
    assert expected_cross_node_bytes("ring", 8, 4, S)["max"] == 1.75 * S
    assert expected_cross_node_bytes("hierarchical", 8, 4, S)["max"] == 0.25 * S
    assert expected_cross_node_bytes("ring", 4, 2, S) == {"max": 1.5 * S, "mean": 0.75 * S}
    assert expected_cross_node_bytes("hierarchical", 4, 4, S)["max"] == 0.0  # one node


def _interleaved_nodes(rank: int, ws: int) -> dict:
    # A launcher that numbers ranks across nodes: node = rank % 2 (torchrun would give rank // 2).
    # The node ids then come from the store, and the call runs on WORLD's own ring in node order.
    pg = dist.group.WORLD
    out: dict = {}
    with _env(GROUP_RANK=str(rank % 2), LOCAL_WORLD_SIZE="2", WORLD_SIZE=str(ws), LOCAL_RANK=str(rank // 2)):
        from ringreduce._groups import node_layout, resolve

        layout = node_layout(resolve(None))
        out["layout"] = (layout.members, layout.local_size, layout.node_of_member)
        for algo in ("ring", "hierarchical"):
            t = exact_input(4096, rank, torch.float32, "sum")
            want = reference(gather_inputs(t), "sum")
            C.bytes_sent(pg, True)
            rr.all_reduce(t, algorithm=algo)
            sent = C.bytes_sent(pg, True)
            out[algo] = (bits_equal(t, want), sum(b for p, b in enumerate(sent) if p % 2 != rank % 2))
    return out


def test_launcher_numbering_across_nodes():
    res = run_ranks(4, _interleaved_nodes)
    S = 4096 * 4
    for rank, r in enumerate(res):
        assert r["layout"] == ((0, 2, 1, 3), 2, (0, 1, 0, 1)), r
        # the flat ring crosses nodes at every hop here; the hierarchical one only in stage 2
        assert r["ring"] == (True, 3 * S // 2), (rank, r)
        assert r["hierarchical"] == (True, S // 2), (rank, r)
