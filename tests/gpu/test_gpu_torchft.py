"""ringreduce.torchft's ProcessGroupRingreduce with CUDA tensors over real NCCL (issue 47's last item,
issue 48 item 5): configure/abort cycles that re-form the ring's NCCL communicator each time and leave
no thread, fd or device memory behind, and abort() of a call that waits for a silent peer.

The bodies are device-generic: tests/test_torchft.py runs them on CPU ranks through the same harness
(run_gpu_ranks(device="cpu")), so that their logic is rehearsed where no GPU is. Fresh processes
(every configure makes a communicator, every abort destroys one); the test process hosts the TCPStore
that every configure() connects to under a new prefix, as torchft's Manager does at every quorum.
Their time limits are tight (each body takes seconds): a hang on real NCCL costs the suite's later
tests at most that (scripts/gpu_check.sh runs the suite within its budget).
"""

from __future__ import annotations

import datetime
import importlib.util
import os
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from gpu.gpu_ranks import need_gpus, run_gpu_ranks

pytestmark = [pytest.mark.gpu, need_gpus(1)]

CYCLES = 3  # the base is taken after the second: the third shows a leak per cycle
BLOCKED_MS = 300  # how long a call must stay incomplete to count as blocked on its silent peer


needs_torchft = pytest.mark.skipif(importlib.util.find_spec("torchft") is None,
                                   reason="torchft is not installed (scripts/setup_env.sh installs it)")


def master_store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def _device(kind: str) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if kind == "cuda" else torch.device("cpu")


def _group(kind: str) -> Any:
    from ringreduce.torchft import ProcessGroupRingreduce

    # on a GPU the default connect devices, ("cpu", "cuda"): configure() forms both rings
    return ProcessGroupRingreduce(timeout=datetime.timedelta(seconds=30),
                                  connect_devices=None if kind == "cuda" else ("cpu",))


def _held(dev: torch.device) -> dict[str, Any]:
    """What the process holds that a ring could leak: threads (their names too, for the message), open
    fds, and on a GPU live device memory; sampled every 100 ms until three samples agree (at most 3 s),
    since an aborted ring's transport threads end shortly after abort() returns."""
    def sample() -> dict[str, Any]:
        names = []
        for task in sorted(os.listdir("/proc/self/task")):
            try:
                with open(f"/proc/self/task/{task}/comm") as f:
                    names.append(f.read().strip())
            except FileNotFoundError:  # it ended meanwhile
                pass
        held = {"threads": len(names), "fds": len(os.listdir("/proc/self/fd")), "names": sorted(names)}
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
            held["cuda_bytes"] = torch.cuda.memory_allocated(dev)
        return held

    samples = [sample()]
    deadline = time.monotonic() + 3.0
    while time.monotonic() < deadline and (len(samples) < 3 or any(s != samples[-1] for s in samples[-3:])):
        time.sleep(0.1)
        samples.append(sample())
    return samples[-1]


def configure_abort_cycles(rank: int, n: int, port: int, kind: str, cycles: int) -> dict:
    """`cycles` configure / all-reduce / abort cycles of one ProcessGroupRingreduce: float32 SUM and
    bfloat16 AVG (direct, rounded once) with exact data, errored() None after them, the time of each
    abort(), and what the process holds after the second cycle and after the last."""
    dev = _device(kind)
    pg = _group(kind)
    report: dict[str, Any] = {"wrong": [], "abort_s": []}
    for i in range(cycles):
        pg.configure(f"127.0.0.1:{port}/cycle{i}", "0", rank, n)
        x = torch.full((1 << 18,), float(rank + 1), device=dev)
        if not pg.allreduce([x], dist.AllreduceOptions()).wait() or not bool((x == n * (n + 1) / 2).all()):
            report["wrong"].append(f"cycle {i}: float32 sum {x[:2].tolist()}")
        h = torch.full((4001,), float(2 * rank + 1), dtype=torch.bfloat16, device=dev)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.AVG
        if not pg.allreduce([h], opts).wait() or not bool((h == float(n)).all()):  # (1 + 3 + ...) / n = n
            report["wrong"].append(f"cycle {i}: bfloat16 avg {h[:2].tolist()}")
        if pg.errored() is not None:
            report["wrong"].append(f"cycle {i}: errored() is {pg.errored()!r}")
        del x, h
        start = time.monotonic()
        pg.abort(errored=False)
        report["abort_s"].append(time.monotonic() - start)
        if i == 1:
            report["base"] = _held(dev)
    report["end"] = _held(dev)
    pg.shutdown()
    return report


def abort_while_waiting(rank: int, n: int, port: int, kind: str) -> dict:
    """Rank 0's call waits for rank 1, which is silent (alive, calling nothing); rank 0 aborts: abort()
    returns within a second, the Work fails quietly (wait() False, a DistBackendError, errored()), the
    tensor is unchanged. Then rank 1 aborts too, both configure again, and a call is exact."""
    store = dist.distributed_c10d._get_default_store()
    dev = _device(kind)
    pg = _group(kind)
    pg.configure(f"127.0.0.1:{port}/first", "0", rank, n)
    result: dict[str, Any] = {}
    if rank == 0:
        tensor = torch.arange(1 << 18, dtype=torch.float32, device=dev)
        original = tensor.clone()
        work = pg.allreduce([tensor], dist.AllreduceOptions())
        try:
            work.wait(datetime.timedelta(milliseconds=BLOCKED_MS))
            result["blocked"] = False
        except RuntimeError as exc:
            result["blocked"] = "did not complete" in str(exc)
        start = time.monotonic()
        pg.abort()
        result["abort_s"] = time.monotonic() - start
        result.update(wait=work.wait(), exception=repr(work.exception()), errored=repr(pg.errored()))
        del work
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        result["unchanged"] = bool(torch.equal(tensor, original))
        store.set("torchft-abort/aborted", "1")
    else:
        store.wait(["torchft-abort/aborted"])  # silent until rank 0 aborted
        pg.abort()
    pg.configure(f"127.0.0.1:{port}/again", "0", rank, n)
    t = torch.full((1 << 16,), float(rank + 1), device=dev)
    result["again_ok"] = pg.allreduce([t], dist.AllreduceOptions()).wait() and bool((t == n * (n + 1) / 2).all())
    pg.abort(errored=False)
    pg.shutdown()
    return result


def check_cycles(reports: list[dict]) -> None:
    for rank, r in enumerate(reports):
        assert r["wrong"] == [], (rank, r["wrong"])
        assert r["end"] == r["base"], f"rank {rank}: after {CYCLES} cycles {r['end']}, after the second {r['base']}"
        assert max(r["abort_s"]) < 1.0, (rank, r["abort_s"])


def check_abort(results: list[dict]) -> None:
    first = results[0]
    assert first["blocked"], first
    assert first["abort_s"] < 1.0, first
    assert first["wait"] is False and "DistBackendError" in first["exception"], first
    assert "DistBackendError" in first["errored"], first
    assert first["unchanged"], first
    assert all(r["again_ok"] for r in results), results


@needs_torchft
def test_torchft_configure_abort_cycles_over_nccl():
    store = master_store()
    check_cycles(run_gpu_ranks(configure_abort_cycles, store.port, "cuda", CYCLES, fresh=True, timeout=120))


@needs_torchft
def test_torchft_abort_while_a_call_waits_over_nccl():
    store = master_store()
    check_abort(run_gpu_ranks(abort_while_waiting, store.port, "cuda", fresh=True, timeout=60))
