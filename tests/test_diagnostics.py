"""What a user reaches for when debugging: RINGREDUCE_DEBUG logs, profiler ranges, named errors."""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist
from ranks import run_ranks, spawn_ranks

import ringreduce as rr


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _debug_log(rank: int, ws: int) -> dict:
    cap = _Capture()
    log = logging.getLogger("ringreduce")
    log.addHandler(cap)
    try:
        os.environ["RINGREDUCE_DEBUG"] = "INFO"
        rr.reload_knobs()
        rr.all_reduce_avg(torch.ones(10, dtype=torch.bfloat16), accum_dtype=torch.float32)
        w = rr.all_reduce(torch.ones(3), op="max", async_op=True)
        w.wait()
        os.environ["RINGREDUCE_DEBUG"] = "DETAIL"
        rr.reload_knobs()
        rr.all_reduce(torch.ones(5))
        os.environ.pop("RINGREDUCE_DEBUG")
        rr.reload_knobs()
        rr.all_reduce(torch.ones(5))  # not logged
        with torch.profiler.profile() as prof:
            rr.all_reduce(torch.ones(7))
        names = [e.name for e in prof.events()]
    finally:
        log.removeHandler(cap)
    return {"lines": cap.lines, "profiled": any(n == "ringreduce.all_reduce" for n in names)}


def test_debug_logging_and_profiler_ranges():
    for rank, res in enumerate(run_ranks(2, _debug_log)):
        lines = res["lines"]
        assert len(lines) == 3, lines
        assert f"rank {rank}/2" in lines[0] and "all_reduce_avg" in lines[0] and "dtype=bfloat16" in lines[0]
        assert "accum=float32" in lines[0] and "numel=10" in lines[0] and "time=" in lines[0]
        assert "call #" in lines[1] and "op=MAX" in lines[1] and "async" in lines[1]
        assert "segment_bytes=" in lines[2] and "slots=" in lines[2] and "check=True" in lines[2]
        assert res["profiled"]


def _detail_calls(rank: int, ws: int) -> list[str]:
    cap = _Capture()
    log = logging.getLogger("ringreduce")
    log.addHandler(cap)
    try:
        rr.all_reduce(torch.ones(3))  # not logged
        os.environ["RINGREDUCE_DEBUG"] = "DETAIL"
        rr.reload_knobs()
        t = torch.ones(300_000)
        rr.all_reduce_avg(t)  # logged, several segments
        rr.all_reduce(torch.ones(5), op="max")  # logged
        os.environ["RINGREDUCE_CHECK"] = "0"
        rr.reload_knobs()
        rr.all_reduce(torch.ones(5))  # logged, no check
        os.environ.pop("RINGREDUCE_DEBUG")
        rr.reload_knobs()
        rr.all_reduce(torch.ones(3))  # not logged
    finally:
        os.environ.pop("RINGREDUCE_DEBUG", None)
        os.environ.pop("RINGREDUCE_CHECK", None)
        rr.reload_knobs()
        log.removeHandler(cap)
    assert torch.equal(t, torch.ones(300_000))
    return cap.lines


def test_detail_lines_split_each_call_into_check_and_ring():
    import re

    for rank, lines in enumerate(run_ranks(2, _detail_calls, transport="tcp")):  # the gloo path's check and ring
        assert len(lines) == 3, lines
        assert f"rank {rank}/2" in lines[0] and "numel=300000" in lines[0] and "numel=5" in lines[1]
        parts = []
        for ln in lines:
            m = re.search(r"time=(\d+)us .* check=(\d+)us ring=(\d+)us", ln)
            assert m, ln
            total, check, ring = (int(x) for x in m.groups())
            assert check + ring <= total + 5, ln  # disjoint spans of the call's time
            parts.append((check, ring))
        assert parts[0][1] > 0 and parts[2][0] == 0, lines  # a ring ran; the unchecked call has no check
        seq = [int(re.search(r"call #(\d+)", ln).group(1)) for ln in lines]
        assert seq[1] == seq[0] + 1 and seq[2] == seq[1] + 1, lines


def _dead_peer_error(rank: int, ws: int) -> str:
    rr.all_reduce(torch.ones(4))  # call #0 succeeds
    if rank == 1:
        os._exit(0)
    try:
        rr.all_reduce(torch.ones(4))
    except dist.DistBackendError as exc:
        return str(exc)
    return "no error"


def test_transport_errors_name_the_call_and_group():
    out = spawn_ranks(2, _dead_peer_error, env={"RINGREDUCE_TIMEOUT": "10"}, timeout=120)
    status, msg, code = out[0]
    assert status == "ok" and code == 0, out
    assert "call #1 (all_reduce)" in msg and "WORLD" in msg and "unusable" in msg, msg


class _CudaTensorStub:
    """What log_call reads of a CUDA tensor (no GPU here)."""

    is_cuda = True
    device = torch.device("cuda", 0)
    dtype = torch.float32

    def numel(self) -> int:
        return 1000

    def is_contiguous(self) -> bool:
        return True


_GPU_KNOBS = ("RINGREDUCE_SEGMENT_BYTES", "RINGREDUCE_SLOTS", "RINGREDUCE_LANES", "RINGREDUCE_ONESHOT_BYTES")


def test_gpu_detail_line_names_the_pipeline_rule_not_the_cpu_segment(monkeypatch):
    from ringreduce._call import Call, debug_level, log_call
    from ringreduce._groups import GroupInfo
    from ringreduce._rings import cpu, cuda
    from ringreduce._types import CallKind

    monkeypatch.setitem(rr._C.native_info, "cuda", True)  # the CUDA ring's line in a CPU-only build too
    for k in _GPU_KNOBS:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("RINGREDUCE_DEBUG", "DETAIL")
    info = GroupInfo(pg=None, rank=0, size=2, name="WORLD (size 2)")  # type: ignore[arg-type]
    gpu, host = cuda.CudaRing(info), cpu.CpuRing.__new__(cpu.CpuRing)
    host.reload()  # its knobs, without a native ring
    assert debug_level(gpu.knobs) == 2  # also sets the logger's level, as a call does
    rule = "segment_bytes=gpu rule slots=gpu rule lanes=gpu rule one_shot_bytes=gpu rule"
    assert gpu.ring_parameters() == rule
    assert host.ring_parameters() == "segment_bytes=1048576 slots=auto"  # the CPU ring's defaults
    cap = _Capture()
    log = logging.getLogger("ringreduce")
    log.addHandler(cap)
    call = Call(info, CallKind.ALL_REDUCE, rr.ReduceOp.SUM)
    try:
        log_call(gpu, call, None, _CudaTensorStub(), False, 2e-5)
        monkeypatch.setenv("RINGREDUCE_SEGMENT_BYTES", "65536")
        monkeypatch.setenv("RINGREDUCE_SLOTS", "3")
        monkeypatch.setenv("RINGREDUCE_LANES", "1")
        monkeypatch.setenv("RINGREDUCE_ONESHOT_BYTES", "0")
        gpu.reload()  # as ring_for does at the first call after reload_knobs()
        log_call(gpu, call, None, _CudaTensorStub(), False, 2e-5)
    finally:
        log.removeHandler(cap)
    first, second = cap.lines
    assert rule in first and "1048576" not in first and "call #" not in first, first
    assert "all_reduce op=SUM" in first and "device=cuda" in first and "enqueued in 20us" in first, first
    assert "check=False" in first, first  # the GPU default
    assert "segment_bytes<=65536 slots=3 per lane lanes<=1 one_shot_bytes=0" in second, second
