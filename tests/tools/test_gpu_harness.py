"""The tests' harness (tests/ranks.py, with the GPU layer tests/gpu/gpu_ranks.py) and rank placement
(ringreduce/bench/gpu_map.py), without a GPU: the pure functions that map ranks onto GPUs and set
NCCL's environment, and the harness itself run over gloo (device="cpu", and the CPU suites' pools):
a rank that dies of a signal fails the test at once with its signal and what it printed, an expected
exit is allowed, a rank's exception is reported."""

from __future__ import annotations

import ctypes
import os
import time

import pytest
import ranks
import torch.distributed as dist
from gpu.gpu_ranks import GpuRank, run_gpu_ranks
from ranks import close_pools, describe_exit, run_ranks

from ringreduce.bench.gpu_map import gpu_world_size, nccl_rank_env, nccl_transport_label, rank_device, ranks_share_gpus

# ---- rank placement (Note [Ranks sharing a GPU]) -----------------------------------------------------


def test_world_size_from_env_else_gpus_else_two_on_one_gpu():
    assert gpu_world_size({}, 0) == 0
    assert gpu_world_size({}, 1) == 2
    assert gpu_world_size({}, 2) == 2
    assert gpu_world_size({}, 8) == 8
    assert gpu_world_size({"RINGREDUCE_GPU_WORLD": "3"}, 1) == 3
    assert gpu_world_size({"RINGREDUCE_GPU_WORLD": "4"}, 8) == 4
    assert gpu_world_size({"RINGREDUCE_GPU_WORLD": ""}, 4) == 4
    assert gpu_world_size({"RINGREDUCE_GPU_WORLD": "3"}, 0) == 0  # no GPU: nothing runs
    with pytest.raises(ValueError, match="RINGREDUCE_GPU_WORLD"):
        gpu_world_size({"RINGREDUCE_GPU_WORLD": "two"}, 1)
    with pytest.raises(ValueError, match=">= 1"):
        gpu_world_size({"RINGREDUCE_GPU_WORLD": "0"}, 1)


def test_ranks_map_onto_gpus_round_robin():
    assert [rank_device(r, 1) for r in range(3)] == [0, 0, 0]
    assert [rank_device(r, 2) for r in range(5)] == [0, 1, 0, 1, 0]
    assert [rank_device(r, 8) for r in range(8)] == list(range(8))
    with pytest.raises(ValueError, match="no CUDA GPU"):
        rank_device(0, 0)


def test_nccl_env_only_where_ranks_share_gpus():
    assert not ranks_share_gpus(2, 2) and not ranks_share_gpus(2, 8)
    assert nccl_rank_env(1, 2, 2, {}) == {}
    assert nccl_rank_env(0, 4, 8, {}) == {}
    envs = [nccl_rank_env(r, 3, 1, {}) for r in range(3)]
    assert len({e["NCCL_HOSTID"] for e in envs}) == 3  # every rank a "host" of its own
    assert all(e["NCCL_SOCKET_IFNAME"] == "lo" and e["NCCL_IB_DISABLE"] == "1" for e in envs)
    assert nccl_rank_env(0, 3, 2, {"NCCL_SOCKET_IFNAME": "eth0"})["NCCL_SOCKET_IFNAME"] == "eth0"


def test_skip_reasons_fold_into_one_line_only_without_a_gpu():
    """tests/conftest.py folds GPU-only skips into one -ra line on machines without a CUDA GPU; where a
    GPU exists each keeps its own reason (a world too small for the test, a GPU per rank needed), or
    the GPU run's summary would hide why a GPU test did not run."""
    from conftest import gpu_skip_summary

    too_small = "needs >= 4 ranks (world size 2 on 1 GPUs; set RINGREDUCE_GPU_WORLD=4)"
    assert gpu_skip_summary(True, too_small, 1) is None
    assert gpu_skip_summary(False, "needs >= 2 CUDA GPUs (found 1)", 1) is None
    assert "this machine has 0 CUDA GPUs" in gpu_skip_summary(True, too_small, 0)
    assert "this machine has 0 CUDA GPUs" in gpu_skip_summary(False, "needs >= 2 CUDA GPUs (found 0)", 0)
    assert gpu_skip_summary(False, "checks the no-GPU mode", 0) is None  # not a GPU test: its own reason


def test_transport_label_says_socket_or_one_gpu_per_rank():
    assert nccl_transport_label(2, 1) == "nccl-socket-lo (2 ranks share 1 GPU)"
    assert nccl_transport_label(3, 2) == "nccl-socket-lo (3 ranks share 2 GPUs)"
    assert nccl_transport_label(8, 8) == "nvlink/p2p (one GPU per rank)"


def test_transport_label_reaches_the_json_and_the_plot_title():
    from ringreduce.bench.machine import describe, short_title

    label = nccl_transport_label(2, 1)
    machine = describe("nccl", 2, ["host"], label)
    assert machine["transport"] == label  # the JSON's machine record
    machine.update(gpus=["NVIDIA H100 80GB HBM3"], nodes=1)
    assert short_title(machine) == "1x NVIDIA H100 80GB HBM3; 2 ranks (nccl, nccl-socket-lo (2 ranks share 1 GPU))"
    assert describe("gloo", 2, ["host"])["transport"] is None


def test_exit_descriptions():
    assert describe_exit(-11) == "SIGSEGV (exit code -11)"
    assert describe_exit(3) == "exit code 3"
    assert describe_exit(None) == "still running"


# ---- the harness over gloo --------------------------------------------------------------------------


def _segfault_on_rank1(rank: int, n: int) -> int:
    if rank == 1:
        print("rank 1: about to dereference NULL", flush=True)
        ctypes.string_at(0)  # SIGSEGV
    time.sleep(120)  # rank 0 would wait for its peer until the harness timeout
    return rank


def test_dead_rank_fails_at_once_with_signal_and_output(monkeypatch):
    monkeypatch.setattr(ranks, "GRACE_S", 1.0)  # how long the survivor may still report
    start = time.monotonic()
    with pytest.raises(pytest.fail.Exception) as info:
        run_gpu_ranks(_segfault_on_rank1, device="cpu", fresh=True, timeout=300)
    elapsed = time.monotonic() - start
    msg = str(info.value)
    assert "rank 1 died: SIGSEGV (exit code -11)" in msg, msg
    assert "rank 1: about to dereference NULL" in msg, msg  # what it printed
    assert "Segmentation fault" in msg, msg  # faulthandler's report of the crash
    assert "rank 0 still running after a rank failed" in msg, msg
    assert elapsed < 60, f"the harness took {elapsed:.0f} s to notice a dead rank"  # not the 300 s timeout


def _exit_or_answer(rank: int, n: int) -> str:
    if rank == 1:
        os._exit(3)
    return f"rank {rank} of {n}"


def test_expected_exit_is_allowed_and_others_report():
    assert run_gpu_ranks(_exit_or_answer, device="cpu", fresh=True, exits={1: 3}) == ["rank 0 of 2", None]


def _raise_on_rank0(rank: int, n: int) -> int:
    if rank == 0:
        print("rank 0 was here", flush=True)
        raise ValueError("rank 0 refuses")
    return rank


def _hang_on_rank1(rank: int, n: int) -> int:
    if rank == 1:
        time.sleep(600)
    return rank


def test_hung_rank_is_killed_at_the_timeout_with_its_stack():
    with pytest.raises(pytest.fail.Exception) as info:
        run_gpu_ranks(_hang_on_rank1, device="cpu", fresh=True, timeout=2)
    msg = str(info.value)
    assert "rank 1 did not finish within the timeout" in msg, msg
    assert "_hang_on_rank1" in msg and "time.sleep" not in msg.split("its output:")[0], msg
    assert 'in _hang_on_rank1' in msg, msg  # faulthandler's stack of the hung rank


def test_run_deadline_cuts_a_hang_short_with_its_stack_then_skips(monkeypatch):
    """RINGREDUCE_GPU_DEADLINE (scripts/gpu_check.sh sets it before its step's limit) shortens a job's
    timeout to what is left: the hang is reported with the rank's stack long before the job's own
    300 s; once the deadline has passed, the next test skips without starting a process."""
    import time as clock

    group = ranks.RankGroup(2, GpuRank(on_cuda=False, set_device=False))
    try:
        assert group.run(_sum_ranks, (), {}, {}, 120.0, {}) == [3, 3]  # started before the deadline is set
        monkeypatch.setenv(ranks.DEADLINE_VAR, str(clock.time() + 2))
        start = clock.monotonic()
        with pytest.raises(pytest.fail.Exception) as info:
            group.run(_hang_on_rank1, (), {}, {}, 300.0, {})
        elapsed = clock.monotonic() - start
    finally:
        group.kill()
    msg = str(info.value)
    assert "rank 1 did not finish within the timeout" in msg and ranks.DEADLINE_VAR in msg, msg
    assert "in _hang_on_rank1" in msg, msg  # faulthandler's stack of the hung rank
    assert elapsed < 60, f"{elapsed:.0f} s: the deadline did not cut the 300 s job timeout"
    monkeypatch.setenv(ranks.DEADLINE_VAR, str(clock.time() - 1))
    with pytest.raises(pytest.skip.Exception, match="deadline"):
        run_gpu_ranks(_sum_ranks, device="cpu", fresh=True)
    monkeypatch.setenv(ranks.DEADLINE_VAR, "soon")
    with pytest.raises(ValueError, match="Unix time"):
        run_gpu_ranks(_sum_ranks, device="cpu", fresh=True)


def _sum_ranks(rank: int, n: int) -> int:
    import torch

    t = torch.tensor([rank + 1])
    dist.all_reduce(t)
    return int(t.item())


def test_pool_reports_an_exception_then_starts_afresh():
    try:
        assert run_gpu_ranks(_sum_ranks, device="cpu") == [3, 3]
        with pytest.raises(pytest.fail.Exception) as info:
            run_gpu_ranks(_raise_on_rank0, device="cpu", timeout=60)
        msg = str(info.value)
        assert "rank 0 raised" in msg and "ValueError: rank 0 refuses" in msg and "rank 0 was here" in msg, msg
        assert run_gpu_ranks(_sum_ranks, device="cpu", env={"SOME_KNOB": "1"}) == [3, 3]  # a fresh pool
    finally:
        close_pools()


def _mixed_ends(rank: int, n: int) -> str:
    if rank == 1:
        raise ValueError("rank 1 refuses")
    if rank == 2:
        os._exit(3)
    return "done"


def test_cpu_pools_and_spawned_ranks_run_on_the_same_machinery(monkeypatch, tmp_path):
    """The CPU suites' run_ranks reports a failure as the GPU tests' pools do (traceback and output) and
    starts afresh; spawn_ranks reports every rank's status and exit code instead of failing; neither
    leaves a folder behind."""
    import tempfile

    from ranks import spawn_ranks

    close_pools()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    try:
        assert run_ranks(2, _sum_ranks) == [3, 3]
        with pytest.raises(pytest.fail.Exception) as info:
            run_ranks(2, _raise_on_rank0, timeout=60)
        msg = str(info.value)
        assert "rank 0 raised" in msg and "ValueError: rank 0 refuses" in msg and "rank 0 was here" in msg, msg
        assert run_ranks(2, _sum_ranks) == [3, 3]  # a fresh pool
    finally:
        close_pools()
    out = spawn_ranks(3, _mixed_ends, timeout=120)
    assert [(status, code) for status, _, code in out] == [("ok", 0), ("err", 0), ("died", 3)], out
    assert out[0][1] == "done" and "ValueError: rank 1 refuses" in out[1][1], out
    assert list(tmp_path.glob("rr_*")) == []


def test_no_rank_folder_is_left_behind(monkeypatch, tmp_path):
    """The harness's rr_gpu_ranks_* folders (init file, rank logs) go once their logs are read: after
    a fresh job, after a failure's report (which quotes the logs), and when a pool closes (issue 30:
    140 of them had piled up in /tmp on a developer machine)."""
    import tempfile

    close_pools()  # pools of earlier tests live in the real temporary folder
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

    def left() -> list[str]:
        return sorted(p.name for p in tmp_path.glob("rr_gpu_ranks_*"))

    assert run_gpu_ranks(_sum_ranks, device="cpu", fresh=True) == [3, 3]
    assert left() == []
    with pytest.raises(pytest.fail.Exception) as info:
        run_gpu_ranks(_raise_on_rank0, device="cpu", fresh=True, timeout=60)
    assert "rank 0 was here" in str(info.value)  # the report read the log before it went
    assert left() == []
    try:
        assert run_gpu_ranks(_sum_ranks, device="cpu") == [3, 3]
        assert len(left()) == 1  # a pool keeps its folder while it lives
        with pytest.raises(pytest.fail.Exception) as info:
            run_gpu_ranks(_raise_on_rank0, device="cpu", timeout=60)
        assert "rank 0 was here" in str(info.value) and left() == []
        assert run_gpu_ranks(_sum_ranks, device="cpu") == [3, 3]  # a fresh pool, a new folder
        assert len(left()) == 1
    finally:
        close_pools()
    assert left() == []
