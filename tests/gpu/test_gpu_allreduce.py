"""ringreduce on CUDA tensors over its own NCCL communicator: needs a CUDA GPU, skipped otherwise.

The ranks are processes (tests/gpu/gpu_ranks.py): one per GPU, or where ranks outnumber the GPUs
(one GPU: 2 ranks by default, RINGREDUCE_GPU_WORLD sets the world size) several per GPU over NCCL's
socket transport (Note [Ranks sharing a GPU]); each test runs many cases inside. Everything the CPU
suite checks, on CUDA tensors: exact position-dependent data for every dtype and op against an
all_gather reduced in float64 (tests/gpu/sweeps.py, Note [Sizing the GPU sweeps]), random data
against stock NCCL dist.all_reduce, non-contiguous and per-rank-different layouts, subgroups, tiny
counts, async handles and futures; plus what only GPUs have: stream ordering with the caller's
stream, overlap, the caching allocator, CUDA graph capture, the watchdog, and RINGREDUCE_CHECK=1.
The error paths (mismatch, dead peer, silent peer, capture, Ctrl-C) run on fresh processes and
check a clear exception on every rank and exit code 0 everywhere.

What ran on a GPU so far is listed in docs/design.md (Status).
"""

from __future__ import annotations

import datetime
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist
from refdata import bits_equal, exact_input, gather_inputs, reference, ring_reference, same_on_all_ranks

from gpu.gpu_ranks import device, need_gpus, run_gpu_ranks, world
from gpu.sweeps import all_reduce_cases

pytestmark = [pytest.mark.gpu, need_gpus(1)]


def _set_segment(nbytes: int | None) -> None:
    import ringreduce as rr

    if nbytes is None:
        os.environ.pop("RINGREDUCE_SEGMENT_BYTES", None)
    else:
        os.environ["RINGREDUCE_SEGMENT_BYTES"] = str(nbytes)
    rr.reload_knobs()  # the rings read their knobs again (ringreduce/_config.py)


# ---- exact data, every dtype and op ------------------------------------------------------------


def _exact_sweep(rank: int, n: int) -> int:
    import ringreduce as rr

    dev = device(rank)
    cases = 0
    for case in all_reduce_cases(n):
        _set_segment(case.segment)
        x = exact_input(case.numel, rank, case.dtype, case.op).to(dev)
        want = reference(gather_inputs(x), case.op) if case.numel else x.clone()
        rr.all_reduce(x, op=case.op, accum_dtype=torch.float32 if case.accum else None)
        assert bits_equal(x, want), case
        assert same_on_all_ranks(x), case
        cases += 1
    _set_segment(None)
    return cases


def test_exact_every_dtype_and_op():
    counts = run_gpu_ranks(_exact_sweep)
    assert all(c > 0 for c in counts)


# ---- random data against stock NCCL --------------------------------------------------------------


def _random_vs_nccl(rank: int, n: int) -> None:
    import ringreduce as rr

    dev = device(rank)
    gen = torch.Generator(device=dev).manual_seed(100 + rank)
    for dtype, tol in ((torch.float32, 1e-5), (torch.float64, 1e-12), (torch.float16, 2e-2), (torch.bfloat16, 5e-2)):
        for numel in (1000, 2**20 + 7, 3 * 2**20):
            x = torch.randn(numel, generator=gen, device=dev).to(dtype)
            y = x.clone()
            rr.all_reduce_avg(x)
            dist.all_reduce(y)
            y /= n
            torch.testing.assert_close(x.float(), y.float(), rtol=tol, atol=tol * 4)
            assert same_on_all_ranks(x)
            z = torch.randn(numel, generator=gen, device=dev).to(dtype)
            w = z.clone()
            rr.all_reduce(z, op="max")
            dist.all_reduce(w, op=dist.ReduceOp.MAX)
            assert bits_equal(z, w)
        # accum_dtype=float32: at least as close to the float64 truth as the per-hop rounding
        if dtype in (torch.float16, torch.bfloat16):
            x = torch.randn(4097, generator=gen, device=dev).to(dtype)
            truth = reference(gather_inputs(x), "avg").double().to(dev)
            a, b = x.clone(), x.clone()
            rr.all_reduce_avg(a, accum_dtype=torch.float32)
            rr.all_reduce_avg(b)
            assert (a.double() - truth).abs().mean() <= (b.double() - truth).abs().mean() + 1e-6


def test_random_data_matches_nccl():
    run_gpu_ranks(_random_vs_nccl)


# ---- 16-bit wires and predivide factors: the ring's arithmetic on every path ---------------------


def _wire_and_scaling(rank: int, n: int, on_cuda: bool = True) -> int:
    """Bitwise the ring's arithmetic reproduced in torch (refdata.ring_reference), on every rank, for
    the one-shot (a small tensor with algorithm "auto"), the ring ("ring") and the ring in lanes (a
    16 MiB tensor: chunks of >= 4 MiB at <= 3 ranks give the default communicator's 2 lanes)."""
    import ringreduce as rr

    dev = device(rank) if on_cuda else torch.device("cpu")
    wires = {"bf16": torch.bfloat16, "fp16": torch.float16, None: None}
    cases = [(1009, "avg", "bf16", None), (1009, "sum", "fp16", 3.0), (1009, "avg", None, 4.0),
             (300_007, "avg", "fp16", 2.0), (4 * 2**20 + 3, "avg", "bf16", None),
             (4 * 2**20 + 3, "sum", "fp16", 3.0)]
    runs = 0
    for i, (numel, op, wire, factor) in enumerate(cases):
        gen = torch.Generator().manual_seed(900 + i)
        inputs = [torch.randn(numel, generator=gen) * (r + 1) for r in range(n)]
        want = ring_reference(inputs, op, wires[wire], factor)
        for algorithm in ("auto", "ring") if numel < 2**20 else ("auto",):
            t = inputs[rank].to(dev, copy=True)
            if op == "avg":
                rr.all_reduce_avg(t, algorithm=algorithm, wire_dtype=wires[wire], predivide_factor=factor)
            else:
                rr.all_reduce(t, op="sum", algorithm=algorithm, wire_dtype=wires[wire], predivide_factor=factor)
            label = f"numel={numel} {op} wire={wire} f={factor} {algorithm}"
            assert bits_equal(t.cpu(), want), f"{label}: {int((t.cpu() != want).sum())} elements differ"
            assert same_on_all_ranks(t), label
            runs += 1
    return runs


def test_wire_and_predivide_are_the_rings_arithmetic():
    counts = run_gpu_ranks(_wire_and_scaling)
    assert all(c == 10 for c in counts)


# ---- layouts -----------------------------------------------------------------------------------


def _layouts(rank: int, n: int) -> None:
    import ringreduce as rr

    dev = device(rank)
    _set_segment(256)
    for dtype in (torch.float32, torch.bfloat16, torch.int32, torch.complex64):
        op = "sum"
        # a column slice: neighbours must stay untouched
        base = exact_input(40 * 7, rank, dtype, op).to(dev).view(40, 7)
        keep = base.clone()
        col = base[:, 3]
        want = reference(gather_inputs(col), op)
        rr.all_reduce(col, op=op)
        assert bits_equal(col, want)
        assert bits_equal(base[:, :3], keep[:, :3]) and bits_equal(base[:, 4:], keep[:, 4:])
        # transposed, and a different layout on every rank with the same logical values
        logical = exact_input(33 * 9, rank, dtype, op).to(dev).view(33, 9)
        want = reference(gather_inputs(logical), op)
        t = logical.t().contiguous().t() if rank % 2 else logical.clone()
        rr.all_reduce(t, op=op)
        assert bits_equal(t.contiguous(), want)
        # storage offset (misaligned data pointer: scalar head, unaligned vectors)
        buf = torch.zeros(1 + 1031, dtype=dtype, device=dev)
        v = buf[1:]
        v.copy_(exact_input(1031, rank, dtype, op).to(dev))
        want = reference(gather_inputs(v), op)
        rr.all_reduce(v, op=op)
        assert bits_equal(v, want) and bits_equal(buf[:1], torch.zeros(1, dtype=dtype, device=dev))
    # channels_last
    x = exact_input(2 * 3 * 5 * 4, rank, torch.float32, "sum").to(dev).view(2, 3, 5, 4)
    want = reference(gather_inputs(x), "sum")
    y = x.to(memory_format=torch.channels_last)
    rr.all_reduce(y)
    assert bits_equal(y.contiguous(), want)
    _set_segment(None)


def test_noncontiguous_views_and_layouts():
    run_gpu_ranks(_layouts)


# ---- groups and tiny counts ----------------------------------------------------------------------


def _groups_and_counts(rank: int, n: int) -> None:
    import ringreduce as rr

    dev = device(rank)
    for numel in (0, 1, n - 1, n + 1):
        x = exact_input(numel, rank, torch.float32, "sum").to(dev)
        want = reference(gather_inputs(x), "sum") if numel else x.clone()
        rr.all_reduce(x)
        assert bits_equal(x, want)
    # subgroups (new_group is collective over WORLD: every rank creates every group)
    first = dist.new_group(list(range(n - 1))) if n > 2 else dist.new_group([0, 1])
    odd = dist.new_group([r for r in range(n) if r % 2 == 1])
    members = list(range(n - 1)) if n > 2 else [0, 1]
    for group, ranks in ((first, members), (odd, [r for r in range(n) if r % 2 == 1])):
        x = exact_input(513, rank, torch.float32, "sum").to(dev)
        before = x.clone()
        if rank in ranks:
            want = reference(gather_inputs(x, group), "sum")
            rr.all_reduce(x, group=group)
            assert bits_equal(x, want)
        else:
            rr.all_reduce(x, group=group)
            assert bits_equal(x, before)
    # alternate WORLD and a subgroup, asynchronously, several times
    works = []
    tensors = []
    for i in range(4):
        x = exact_input(1000 + i, rank, torch.float16, "sum").to(dev)
        tensors.append((x, reference(gather_inputs(x), "sum")))
        works.append(rr.all_reduce(x, async_op=True))
    for w, (x, want) in zip(works, tensors, strict=False):
        w.wait()
        assert bits_equal(x, want)


def test_subgroups_and_small_counts():
    run_gpu_ranks(_groups_and_counts)


# ---- async handles, futures, overlap --------------------------------------------------------------


def _async(rank: int, n: int) -> None:
    import ringreduce as rr

    dev = device(rank)
    x = exact_input(3 * 2**20 + 5, rank, torch.float32, "sum").to(dev)
    want = reference(gather_inputs(x), "sum")
    work = rr.all_reduce(x, async_op=True)
    # overlap: compute on the current stream while the ring runs on ringreduce's streams
    a = torch.randn(1024, 1024, device=dev)
    for _ in range(8):
        a = a @ a.t() / 1024
    assert work.wait() is True
    assert bits_equal(x, want)  # the current stream waited: reading x now is ordered
    fut = work.get_future()
    val = fut.wait()
    assert isinstance(val, list) and val[0] is x or bits_equal(val[0], x)
    torch.cuda.synchronize()
    assert work.is_completed()
    # then(): a CUDA-aware future chains without host synchronization
    y = exact_input(4099, rank, torch.float32, "sum").to(dev)
    want_y = reference(gather_inputs(y), "sum") * 2
    w2 = rr.all_reduce(y, async_op=True)
    doubled = w2.get_future().then(lambda f: f.value()[0] * 2).wait()
    assert bits_equal(doubled, want_y)
    # wait with a timeout blocks the host until done
    z = exact_input(1000, rank, torch.float64, "sum").to(dev)
    want_z = reference(gather_inputs(z), "sum")
    w3 = rr.all_reduce(z, async_op=True)
    assert w3.wait(timeout=datetime.timedelta(seconds=60)) is True
    assert w3.is_completed()
    assert bits_equal(z, want_z)


def test_async_handles_futures_and_overlap():
    run_gpu_ranks(_async)


# ---- stream semantics ------------------------------------------------------------------------------


def _streams(rank: int, n: int) -> None:
    import ringreduce as rr

    dev = device(rank)
    numel = 2**20
    # producer right before the call: a long sleep kernel then the write, both on the current
    # stream. If the ring did not wait for the current stream it would reduce stale zeros.
    x = torch.zeros(numel, device=dev)
    torch.cuda._sleep(200_000_000)
    x.fill_(rank + 1)
    rr.all_reduce(x)
    # consumer right after: reads on the current stream without any synchronization
    y = x * 1
    assert bool((y == n * (n + 1) / 2).all())
    # on a side stream: the call is ordered after that stream, and that stream waits for it
    s = torch.cuda.Stream(device=dev)
    with torch.cuda.stream(s):
        z = torch.zeros(numel, device=dev)
        torch.cuda._sleep(100_000_000)
        z.fill_(2.0)
        rr.all_reduce(z)
        zz = z + 0
    s.synchronize()
    assert bool((zz == 2.0 * n).all())
    # async: the current stream waits only at wait()
    w = torch.zeros(numel, device=dev)
    torch.cuda._sleep(100_000_000)
    w.fill_(1.0)
    work = rr.all_reduce(w, async_op=True)
    work.wait()
    assert bool(((w + 0) == n).all())


def test_stream_ordering():
    run_gpu_ranks(_streams)


def _freed(rank: int, n: int) -> None:
    import ringreduce as rr

    dev = device(rank)
    numel = 8 * 2**20
    for _ in range(3):
        t = torch.ones(numel, device=dev)
        torch.cuda._sleep(200_000_000)  # keep the ring pending while Python frees the tensor
        work = rr.all_reduce(t, async_op=True)
        del t, work
        # If the caching allocator handed t's block out again before the ring finished, the ring
        # would overwrite this tensor.
        guard = torch.full((numel,), 7.0, device=dev)
        torch.cuda.synchronize()
        assert bool((guard == 7.0).all())
        # the same with a synchronous call on a non-contiguous tensor (working copy + write back)
        base = torch.ones(numel // 4, 4, device=dev)
        rr.all_reduce(base[:, 1])
        del base
        guard2 = torch.full((numel // 4, 4), 5.0, device=dev)
        torch.cuda.synchronize()
        assert bool((guard2 == 5.0).all())


def test_tensor_freed_right_after_call():
    run_gpu_ranks(_freed)


# ---- error paths: the CUDA twins of tests/test_errors.py and tests/test_interrupt.py ----------------
# Fresh processes each (they poison their groups on purpose); run_gpu_ranks(fresh=True) also checks
# that every rank exits with code 0 afterwards.

_CALL_NUMBER = r"call #\d+ \("  # the number survives formatting (Note [One libstdc++ per process])


def _graph_capture(rank: int, n: int) -> dict:
    import ringreduce as rr

    dev = device(rank)
    x = torch.ones(1024, device=dev)
    rr.all_reduce(x)  # communicator created outside the capture
    g = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="cannot be captured in a CUDA graph") as info:
        with torch.cuda.graph(g):
            rr.all_reduce(x)
    # refused before anything ran: the group is still usable, on every rank alike
    y = torch.full((4096,), float(rank + 1), device=dev)
    rr.all_reduce(y)
    assert bool((y == n * (n + 1) / 2).all())
    return {"message": str(info.value)}


@pytest.mark.parametrize("check", ["0", "1"])
def test_cuda_graph_capture_raises_clearly(check):
    out = run_gpu_ranks(_graph_capture, env={"RINGREDUCE_CHECK": check}, fresh=True)
    assert all("torch.cuda.graph()" in r["message"] for r in out), out


def _check_mismatch(rank: int, n: int) -> None:
    import ringreduce as rr

    dev = device(rank)
    x = torch.ones(100 + (rank == 1), device=dev)
    with pytest.raises(RuntimeError, match=_CALL_NUMBER) as info:
        rr.all_reduce(x)
    msg = str(info.value)
    for needle in ("disagree", "numel", *(f"rank {r}: all_reduce" for r in range(n))):
        assert needle in msg, (needle, msg)
    assert bool((x == 1).all())  # nothing moved
    y = torch.ones(64, device=dev, dtype=torch.float32 if rank else torch.int32)
    with pytest.raises(RuntimeError, match="dtype"):
        rr.all_reduce(y)
    # no payload moved: the group is still usable
    z = torch.ones(64, device=dev)
    rr.all_reduce(z)
    assert bool((z == n).all())


def test_check_detects_mismatch():
    run_gpu_ranks(_check_mismatch, env={"RINGREDUCE_CHECK": "1"}, fresh=True)


def _silent_peer(rank: int, n: int) -> dict:
    import ringreduce as rr

    dev = device(rank)
    x = torch.ones(1 << 16, device=dev)
    rr.all_reduce(x)  # everyone creates the communicator
    torch.cuda.synchronize(dev)
    if rank == n - 1:
        return {}  # alive, but never calls again
    start = time.monotonic()
    work = rr.all_reduce(torch.ones(1 << 16, device=dev), async_op=True)
    with pytest.raises(dist.DistBackendError, match="did not finish within"):
        work.wait(timeout=datetime.timedelta(seconds=120))
    elapsed = time.monotonic() - start
    with pytest.raises(dist.DistBackendError, match="unusable"):
        rr.all_reduce(torch.ones(8, device=dev))
    return {"elapsed": elapsed}


def test_peer_that_never_calls_raises_after_timeout():
    out = run_gpu_ranks(_silent_peer, env={"RINGREDUCE_TIMEOUT": "5"}, timeout=240, fresh=True)
    for r in out[:-1]:
        assert 4 <= r["elapsed"] < 60, r  # the watchdog's timeout (5 s), not the 120 s of wait()


def _dead_peer(rank: int, n: int) -> dict:
    import ringreduce as rr

    dev = device(rank)
    rr.all_reduce(torch.ones(1 << 16, device=dev))  # everyone creates the communicator
    torch.cuda.synchronize(dev)
    store = dist.distributed_c10d._get_default_store()
    store.add("first_call_done", 1)  # a host-only barrier: no stock NCCL communicator in this test
    while int(store.add("first_call_done", 0)) < n:
        time.sleep(0.01)
    if rank == n - 1:
        os._exit(3)  # exits without calling again (the first GPU run: the survivor then died of SIGSEGV)
    start = time.monotonic()
    work = rr.all_reduce(torch.ones(1 << 16, device=dev), async_op=True)
    with pytest.raises(dist.DistBackendError) as info:
        work.wait(timeout=datetime.timedelta(seconds=120))
    elapsed = time.monotonic() - start
    with pytest.raises(dist.DistBackendError, match="unusable"):
        rr.all_reduce(torch.ones(8, device=dev))
    return {"elapsed": elapsed, "message": str(info.value)}


def test_peer_that_exits_raises_on_the_others():
    out = run_gpu_ranks(_dead_peer, env={"RINGREDUCE_TIMEOUT": "10"}, timeout=240, fresh=True,
                        exits={world() - 1: 3})
    assert out[-1] is None  # it died with exit code 3, as meant
    for r in out[:-1]:
        assert r["elapsed"] < 60, r
        assert "ringreduce" in r["message"], r


def _interrupted(rank: int, n: int, how: str) -> dict:
    """Rank 0 blocks on the host waiting for rank 1, which stays silent and then sends it SIGINT (the
    CUDA twins of tests/test_interrupt.py). `how`: "work_wait", a timed Work.wait() (the wait is in
    Python); "checked_call", a synchronous call with RINGREDUCE_CHECK=1 waiting for the agreement
    frames; "first_contact", a synchronous call whose first exchange connects to rank 1 inside NCCL
    (the communicator exists, no exchange ran yet). The last two wait in native code (Note
    [Interrupting a host wait on CUDA], csrc/cuda/host_interrupt.h)."""
    # SIGINT raises KeyboardInterrupt here whatever this process inherited: a suite started with a shell's
    # `&` (no job control) has SIGINT ignored, and Python then leaves it ignored in every rank.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    import ringreduce as rr
    from ringreduce._rings import cuda as _cuda

    store = dist.distributed_c10d._get_default_store()
    dev = device(rank)
    if how == "first_contact":
        _cuda.init_communicator(device=dev)  # every rank joins; no peer is connected yet
    else:
        rr.all_reduce(torch.ones(4, device=dev))  # the communicator exists and lane 0 is connected
    torch.cuda.synchronize(dev)
    if rank == 0:
        store.set("pid0", str(os.getpid()))
        t = torch.arange(1 << 18, dtype=torch.float32, device=dev)  # 1 MiB
        before = t.clone()
        caught = None
        try:
            if how == "work_wait":
                work = rr.all_reduce(t, async_op=True)
                work.wait(timeout=datetime.timedelta(seconds=60))
            else:
                rr.all_reduce(t)
        except KeyboardInterrupt:
            caught = time.time()
        sent = float(store.get("sigint_at").decode())
        result: dict = {"latency": None if caught is None else caught - sent}
        try:
            rr.all_reduce(torch.ones(4, device=dev))
            result["next_call"] = "returned"
        except dist.DistBackendError as exc:
            result["next_call"] = str(exc)
        torch.cuda.synchronize(dev)
        result["unchanged"] = bool(torch.equal(t, before))
        store.set("rank0_done", "1")
        return result
    if rank == 1:
        pid = int(store.get("pid0").decode())
        time.sleep(1.5)  # rank 0 is blocked in its wait by now
        store.set("sigint_at", repr(time.time()))
        os.kill(pid, signal.SIGINT)
        store.wait(["rank0_done"])
    errors = []
    for _ in range(2):  # the first call may still meet rank 0's interrupted one half way
        try:
            rr.all_reduce(torch.ones(1 << 18, device=dev), async_op=True).wait(timeout=datetime.timedelta(seconds=150))
        except dist.DistBackendError as exc:
            errors.append(str(exc))
            break
    return {"errors": errors}


@pytest.mark.parametrize("how", ["work_wait", "checked_call", "first_contact"])
def test_ctrl_c_interrupts_a_blocked_wait(how):
    # RINGREDUCE_TIMEOUT bounds the frames' wait (8 s); a first contact waits up to the connect
    # timeout (the store's, 120 s in gpu_ranks.py): without the interrupt rank 0 would wait that long.
    env = {"RINGREDUCE_TIMEOUT": "8", "RINGREDUCE_CHECK": "1" if how == "checked_call" else "0"}
    out = run_gpu_ranks(_interrupted, how, env=env, timeout=420, fresh=True)
    first = out[0]
    assert first["latency"] is not None, "no KeyboardInterrupt"
    assert 0 <= first["latency"] < 1.0, f"KeyboardInterrupt {first['latency']:.3f} s after SIGINT"
    assert "interrupted on this rank" in first["next_call"] and "unusable" in first["next_call"], first
    if how == "checked_call":
        assert first["unchanged"], "the interrupted call moved payload before its agreement check"
    for r in out[1:]:
        assert r["errors"], "a peer's calls did not fail"


def _build_info(rank: int, n: int) -> dict:
    import ringreduce as rr

    return rr.build_info()


def test_build_info_reports_cuda_and_nccl():
    info = run_gpu_ranks(_build_info)[0]
    assert info["cuda"] is True
    assert info["nccl_version"] and info["nccl_runtime_version"]
    assert info["cuda_archs"]


def _debug_lines(rank: int, n: int) -> list[str]:
    import logging

    import ringreduce as rr

    class Capture(logging.Handler):
        def __init__(self) -> None:
            super().__init__()
            self.lines: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.lines.append(record.getMessage())

    dev = device(rank)
    cap = Capture()
    log = logging.getLogger("ringreduce")
    log.addHandler(cap)
    knobs = ("RINGREDUCE_SEGMENT_BYTES", "RINGREDUCE_SLOTS", "RINGREDUCE_LANES", "RINGREDUCE_ONESHOT_BYTES")
    saved = {k: os.environ.pop(k) for k in knobs if k in os.environ}  # the pipeline rule itself
    os.environ["RINGREDUCE_DEBUG"] = "DETAIL"
    rr.reload_knobs()  # the rings read their knobs again (ringreduce/_config.py)
    try:
        x = torch.ones(4096, device=dev)
        rr.all_reduce(x)
        rr.all_reduce(x, async_op=True).wait()
    finally:
        os.environ.pop("RINGREDUCE_DEBUG")
        os.environ.update(saved)
        rr.reload_knobs()  # the rings read their knobs again (ringreduce/_config.py)
        log.removeHandler(cap)
    torch.cuda.synchronize(dev)
    assert bool((x == n * n).all())
    return cap.lines


def test_debug_log_of_gpu_calls_names_the_pipeline_rule():
    lines = run_gpu_ranks(_debug_lines)[0]
    assert len(lines) == 2, lines
    assert all("device=cuda" in ln and "segment_bytes=gpu rule" in ln for ln in lines), lines
    assert "enqueued in" in lines[0] and "call #" in lines[1] and "async" in lines[1], lines
