"""The shared-memory transport itself: chosen by default for ranks of one host, turned off by
RINGREDUCE_SHM=0 (on any rank), a fallback with one warning when /dev/shm cannot hold a segment, and
random data equal to torch.distributed's. Exact values, subgroups, async, dead peers and the
10,000-call soak run at both CPU places in the other modules (PLACES, Note [Places]); conftest.py checks
after every test that nothing is left in /dev/shm."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
import torch.distributed as dist
from ranks import FULL, free_port, run_ranks, spawn_ranks
from refdata import bits_equal, exact_input, gather_inputs, reference, same_on_all_ranks

import ringreduce as rr
from ringreduce._native import C


def _info(group: object, members: list[int] | None = None) -> str:
    return C.transport_info(group, members or [])


def _transports(rank: int, ws: int) -> dict:
    out = {}
    t = torch.arange(1000, dtype=torch.float32) + rank
    rr.all_reduce(t)
    out["world"] = _info(dist.group.WORLD)
    out["value"] = bool(torch.equal(t, ws * torch.arange(1000, dtype=torch.float32) + sum(range(ws))))
    sub = dist.new_group([0, 2])
    if rank in (0, 2):
        u = torch.full((5,), float(rank + 1))
        rr.all_reduce_avg(u, group=sub)
        out["sub"] = _info(sub)
        out["sub_value"] = bool(torch.equal(u, torch.full((5,), 2.0)))
    return out


def test_rings_of_one_host_use_shared_memory_by_default():
    for rank, r in enumerate(run_ranks(3, _transports, transport="shm")):
        assert r["world"] == "shm" and r["value"], r
        if rank in (0, 2):
            assert r["sub"] == "shm" and r["sub_value"], r


def test_rings_use_gloo_point_to_point_when_turned_off():
    for r in run_ranks(3, _transports, transport="tcp"):
        assert r["world"].startswith("tcp (RINGREDUCE_SHM=0 on ring rank 0") and r["value"], r


def _random_against_gloo(rank: int, ws: int) -> dict:
    out = {}
    for dtype, size, tol in ((torch.float32, 3 << 20, 1e-5), (torch.bfloat16, 300001, 2e-2), (torch.float64, 77, 1e-12)):
        g = torch.Generator().manual_seed(1000 + rank)
        x = torch.randn(size, generator=g, dtype=torch.float64).to(dtype)
        ref = x.clone().double()
        dist.all_reduce(ref)
        ref /= ws
        rr.all_reduce_avg(x)
        out[str(dtype)] = float((x.double() - ref).abs().max()) <= tol * max(1.0, float(ref.abs().max()))
        gathered = [torch.empty_like(x) for _ in range(ws)]
        dist.all_gather(gathered, x)
        out[str(dtype) + " same bits"] = all(torch.equal(gg.view(torch.uint8) if gg.dtype != torch.bfloat16
                                                         else gg.view(torch.int16),
                                                         x.view(torch.uint8) if x.dtype != torch.bfloat16
                                                         else x.view(torch.int16)) for gg in gathered)
    return out


@pytest.mark.parametrize("ws", [2, 4])
def test_random_data_matches_gloo_and_is_identical_on_every_rank(ws):
    for r in run_ranks(ws, _random_against_gloo, transport="shm"):
        assert all(r.values()), r


_FALLBACK_JOB = textwrap.dedent(
    """
    import os, sys, datetime
    import torch, torch.distributed as dist
    rank, port = int(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    import ringreduce as rr
    from ringreduce._native import C
    t = torch.arange(10, dtype=torch.float32) * (rank + 1)
    rr.all_reduce(t)
    rr.all_reduce(t)
    assert torch.equal(t, torch.arange(10, dtype=torch.float32) * 6), t
    with open(sys.argv[3] + f".{rank}", "w") as f:  # a file per rank: two processes share stdout
        f.write(C.transport_info(dist.group.WORLD, []))
    dist.destroy_process_group()
    """
)


def test_fallback_with_one_warning_when_dev_shm_is_too_small(tmp_path):
    """Two ranks in a mount namespace whose /dev/shm is a 1 MiB tmpfs (a container's small /dev/shm):
    the ring runs over gloo point-to-point, every rank says why once, and the values are right."""
    unshare = shutil.which("unshare")
    if unshare is None or os.geteuid() != 0:
        pytest.skip("needs root and unshare(1) to give the ranks a small /dev/shm")
    job = tmp_path / "job.py"
    job.write_text(_FALLBACK_JOB)
    port = free_port()
    env = {**os.environ, "RINGREDUCE_SHM": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    info = tmp_path / "transport"
    script = (f"mount -t tmpfs -o size=1m tmpfs /dev/shm && "
              f"({sys.executable} {job} 0 {port} {info} & {sys.executable} {job} 1 {port} {info}; wait)")
    proc = subprocess.run([unshare, "-m", "--propagation", "private", "sh", "-c", script], env=env,
                          capture_output=True, text=True, timeout=120)
    if proc.returncode != 0 and "unshare failed" in proc.stderr:
        pytest.skip(f"no mount namespace here: {proc.stderr.strip()}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    infos = [(tmp_path / f"transport.{rank}").read_text() for rank in range(2)]
    assert all(i.startswith("tcp (") and "/dev/shm has" in i for i in infos), infos
    assert proc.stderr.count("instead of shared memory") == 2, proc.stderr  # one per rank, not one per call


def _hierarchical_in_shm(rank: int, ws: int) -> dict:
    from refdata import bits_equal, exact_input, gather_inputs, reference

    pg = dist.group.WORLD
    S = 1 << 20
    out: dict = {}
    os.environ["RINGREDUCE_LOCAL_SIZE"] = "2"
    rr.reload_knobs()  # the rings read their knobs again (ringreduce/_config.py)
    try:
        exact = []
        for dtype in (torch.float32, torch.bfloat16, torch.int32):
            for numel in (1, 5, 1000, (3 << 20) // 4 + 3):  # the last: several 1 MiB pieces per node stage
                t = exact_input(numel, rank, dtype, "sum")
                want = reference(gather_inputs(t), "sum")
                rr.all_reduce(t, algorithm="hierarchical")
                exact.append(bits_equal(t, want))
        out["exact"] = all(exact)
        t = torch.ones(S // 4)
        C.bytes_sent(pg, True)
        rr.all_reduce_avg(t, algorithm="hierarchical")
        out["sent"] = C.bytes_sent(pg, True)
        out["avg"] = bool(torch.all(t == 1))
        out["info"] = _info(pg)
    finally:
        del os.environ["RINGREDUCE_LOCAL_SIZE"]
        rr.reload_knobs()  # the rings read their knobs again (ringreduce/_config.py)
    return out


def test_hierarchical_node_stages_run_in_shared_memory():
    """4 ranks = 2 simulated nodes x 2: the node stages run in each node's segment, so the only bytes
    on gloo are the cross-node ring's, 2(M-1)/M S/L = 0.5 S per rank (as over gloo alone), and none
    go to the rank's own node."""
    S = 1 << 20
    node = [0, 0, 1, 1]
    for rank, r in enumerate(run_ranks(4, _hierarchical_in_shm, transport="shm")):
        assert r["exact"] and r["avg"], r
        assert "node stages: shm" in r["info"], r["info"]
        cross = sum(b for p, b in enumerate(r["sent"]) if node[p] != node[rank])
        local = sum(b for p, b in enumerate(r["sent"]) if node[p] == node[rank])
        assert cross == S // 2 and local == 0, (rank, r["sent"])


# ---- Note [Pipelined hierarchical all-reduce]: node stages in shared memory, cut into pieces ----------
# A piece is at least 4 MiB (kNodePieceBytes), at most 8 pieces a call, whatever the segment size: an
# 8 MiB call is 2 pieces, a 12 MiB one 3, and a 4 MiB one is not cut.

MIB = 1 << 20


def _pieces(rank: int, ws: int) -> dict:
    pg = dist.group.WORLD
    out: dict = {}
    node = [0, 0, 1, 1]
    os.environ["RINGREDUCE_LOCAL_SIZE"] = "2"
    rr.reload_knobs()  # the rings read their knobs again (ringreduce/_config.py)
    try:
        cases = [(torch.float32, op, 2 * MIB + 5) for op in ("sum", "avg", "max")]
        cases += [(torch.float32, "sum", 3 * MIB + 1), (torch.float32, "sum", MIB), (torch.bfloat16, "sum", 4 * MIB + 3),
                  (torch.int32, "sum", 2 * MIB + 5), (torch.float64, "avg", MIB + 5)]
        for dtype, op, numel in cases:
            t = exact_input(numel, rank, dtype, op)
            want = reference(gather_inputs(t), op)
            rr.all_reduce(t, op=op, algorithm="hierarchical")
            out[f"{dtype} {op} {numel}"] = bits_equal(t, want) and same_on_all_ranks(t)
        g = torch.Generator().manual_seed(7 + rank)
        x = torch.randn(2 * MIB + 3, generator=g)
        for kwargs in ({}, {"predivide_factor": 2.0}, {"wire_dtype": torch.bfloat16}):
            h, f = x.clone(), x.clone()
            rr.all_reduce_avg(h, algorithm="hierarchical", **kwargs)
            rr.all_reduce_avg(f, algorithm="ring", **kwargs)
            tol = 2e-2 if kwargs.get("wire_dtype") is not None else 1e-5
            out[f"random {kwargs} vs flat"] = torch.allclose(h, f, rtol=tol, atol=tol) and same_on_all_ranks(h)
        for seg in (str(64 << 10), None):  # the segment size never changes a bit of the result
            if seg is not None:
                os.environ["RINGREDUCE_SEGMENT_BYTES"] = seg
                rr.reload_knobs()  # the rings read their knobs again (ringreduce/_config.py)
            y = x.clone()
            rr.all_reduce_avg(y, algorithm="hierarchical")
            os.environ.pop("RINGREDUCE_SEGMENT_BYTES", None)
            rr.reload_knobs()  # the rings read their knobs again (ringreduce/_config.py)
            out[f"segment {seg}"] = y
        out["same bits whatever the segment"] = torch.equal(out.pop(f"segment {64 << 10}"), out.pop("segment None"))
        works = [rr.all_reduce(torch.full((2 * MIB,), float(i)), algorithm="hierarchical", async_op=True)
                 for i in range(3)]
        out["async in order"] = all(w.wait() and torch.equal(w.result()[0], torch.full((2 * MIB,), float(i * ws)))
                                    for i, w in enumerate(works))
        t = torch.ones(2 * MIB)  # 8 MiB: 2 pieces; every rank sends 0.5 S across nodes, as unpipelined
        C.bytes_sent(pg, True)
        rr.all_reduce(t, algorithm="hierarchical")
        sent = C.bytes_sent(pg, True)
        out["cross bytes"] = sum(b for p, b in enumerate(sent) if node[p] != node[rank])
        out["node bytes"] = sum(b for p, b in enumerate(sent) if node[p] == node[rank])
        out["bytes call exact"] = bool(torch.all(t == ws))
    finally:
        os.environ.pop("RINGREDUCE_LOCAL_SIZE", None)
        rr.reload_knobs()  # the rings read their knobs again (ringreduce/_config.py)
    return out


def test_pipelined_node_stages_exact_and_same_bytes():
    for rank, res in enumerate(run_ranks(4, _pieces, transport="shm")):
        cross, node = res.pop("cross bytes"), res.pop("node bytes")
        assert all(res.values()), f"rank {rank}: {[k for k, v in res.items() if not v]}"
        assert cross == 8 * MIB // 2 and node == 0, (rank, cross, node)


def _pieces_whatever_the_segment(rank: int, ws: int) -> bool:
    # 3 nodes x 2 ranks: the cross-node ring's sum of three floats depends on its order, which the
    # pieces' chunk owners set; the pieces depend on (numel, dtype) only, so the segment size changes
    # no bit
    os.environ["RINGREDUCE_LOCAL_SIZE"] = "2"
    rr.reload_knobs()  # the rings read their knobs again (ringreduce/_config.py)
    try:
        x = torch.randn(3 * MIB + 7, generator=torch.Generator().manual_seed(rank))
        got = []
        for seg in (str(64 << 10), str(1 << 20)):
            os.environ["RINGREDUCE_SEGMENT_BYTES"] = seg
            rr.reload_knobs()  # the rings read their knobs again (ringreduce/_config.py)
            y = x.clone()
            rr.all_reduce(y, algorithm="hierarchical")
            got.append(y)
        return torch.equal(got[0], got[1]) and same_on_all_ranks(got[0])
    finally:
        os.environ.pop("RINGREDUCE_LOCAL_SIZE", None)
        os.environ.pop("RINGREDUCE_SEGMENT_BYTES", None)
        rr.reload_knobs()  # the rings read their knobs again (ringreduce/_config.py)


@FULL
def test_pipelined_pieces_do_not_depend_on_the_segment_size():
    assert run_ranks(6, _pieces_whatever_the_segment, transport="shm") == [True] * 6


def _pieces_peer_killed(rank: int, ws: int) -> dict:
    t = torch.ones(4 * MIB)  # 16 MiB: 4 pieces
    rr.all_reduce(t, algorithm="hierarchical")  # warm-up: the node segment exists
    dist.barrier()
    if rank == 3:
        threading.Timer(0.05, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
    res: dict = {}
    start = time.monotonic()
    try:
        for _ in range(100):
            rr.all_reduce(t, algorithm="hierarchical")
        res["err"] = "none"
    except dist.DistBackendError:
        res["err"] = "DistBackendError"
    except RuntimeError as exc:
        res["err"] = f"RuntimeError: {exc}"
    res["elapsed"] = time.monotonic() - start
    return res


def test_pipelined_node_stages_peer_killed():
    """A rank killed while pipelined calls run: the other three raise DistBackendError (its node
    partner through the node ring's timeout, the other node through the cross-node ring) and exit."""
    env = {"RINGREDUCE_LOCAL_SIZE": "2", "RINGREDUCE_TIMEOUT": "10", "RINGREDUCE_SHM": "1"}
    out = spawn_ranks(4, _pieces_peer_killed, env=env, timeout=180)
    assert out[3][0] == "died" and out[3][2] == -signal.SIGKILL, out[3]
    for r in (0, 1, 2):
        status, res, code = out[r]
        assert status == "ok" and code == 0, (r, status, res, code)
        assert res["err"] == "DistBackendError", (r, res)
        assert res["elapsed"] < 60, (r, res)


def _memory_after_sizes(rank: int, ws: int) -> dict:
    group = dist.new_group(list(range(ws)))  # a fresh group: only this test's calls count
    out = {}
    for numel in (1, 1 << 18, 1 << 24):  # 4 B, 1 MiB, 64 MiB
        t = torch.ones(numel)
        rr.all_reduce_avg(t, group=group)
        out[numel] = (C.memory_bytes(group), bool(torch.all(t == 1)))
    return out


@pytest.mark.parametrize("ws", [2, 4])
def test_memory_per_group_is_bounded_whatever_the_size(ws):
    """A ring in shared memory holds its segment (2 x n x 1 MiB and a page of flags and frames), the
    in-order reduce's 256 KiB of scratch and the frame buffers, independent of the tensor's size:
    at most 2 n MiB + 4.5 MiB, and the same after a 64 MiB call as after a 4 B one."""
    for r in run_ranks(ws, _memory_after_sizes, transport="shm"):
        sizes = list(r.values())
        assert all(ok for _, ok in sizes), r
        assert sizes[0][0] == sizes[-1][0], r
        assert sizes[-1][0] <= (2 * ws << 20) + (9 << 19), r

