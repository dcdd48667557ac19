"""ringreduce on CUDA tensors over its own NCCL communicator: needs >= 2 GPUs, skipped otherwise.

One process per GPU (tests/gpu/gpu_ranks.py). Each test spawns the ranks once and runs many cases
inside. Everything the CPU suite checks, on CUDA tensors: exact position-dependent data for every
dtype and op against an all_gather reduced in float64, random data against stock NCCL
dist.all_reduce, non-contiguous and per-rank-different layouts, subgroups, tiny counts, async
handles and futures; plus what only GPUs have: stream ordering with the caller's stream, overlap,
the caching allocator, CUDA graph capture, the watchdog, and RINGREDUCE_CHECK=1.

None of these has been run on the machine where ringreduce was written (it has no GPU).
"""

from __future__ import annotations

import datetime
import os

import pytest
import torch
import torch.distributed as dist
from refdata import ALL_TYPES, OPS, bits_equal, exact_input, gather_inputs, reference, same_on_all_ranks, supported

from gpu.gpu_ranks import need_gpus, run_gpu_ranks

pytestmark = [pytest.mark.gpu, need_gpus(2)]


def _set_segment(nbytes: int | None) -> None:
    if nbytes is None:
        os.environ.pop("RINGREDUCE_SEGMENT_BYTES", None)
    else:
        os.environ["RINGREDUCE_SEGMENT_BYTES"] = str(nbytes)


# ---- exact data, every dtype and op ------------------------------------------------------------


def _exact_sweep(rank: int, n: int) -> int:
    import ringreduce as rr

    dev = torch.device("cuda", rank)
    counts = sorted({1, max(1, n - 1), n + 1, 37, 1031, 65537})
    cases = 0
    for seg in (64, 4096, None):
        _set_segment(seg)
        for dtype in ALL_TYPES:
            for op in OPS:
                if not supported(dtype, op):
                    continue
                for numel in counts:
                    for accum in ((None, torch.float32) if dtype in (torch.float16, torch.bfloat16) else (None,)):
                        x = exact_input(numel, rank, dtype, op).to(dev)
                        want = reference(gather_inputs(x), op)
                        rr.all_reduce(x, op=op, accum_dtype=accum)
                        assert bits_equal(x, want), f"{op} {dtype} numel={numel} seg={seg} accum={accum}"
                        assert same_on_all_ranks(x)
                        cases += 1
    _set_segment(None)
    # one big tensor with the default segment size: many segments, every staging slot reused
    x = exact_input(2**20 + 3, rank, torch.float32, "avg").to(dev)
    want = reference(gather_inputs(x), "avg")
    rr.all_reduce_avg(x)
    assert bits_equal(x, want)
    return cases


def test_exact_every_dtype_and_op():
    counts = run_gpu_ranks(_exact_sweep)
    assert all(c > 0 for c in counts)


# ---- random data against stock NCCL --------------------------------------------------------------


def _random_vs_nccl(rank: int, n: int) -> None:
    import ringreduce as rr

    gen = torch.Generator(device="cuda").manual_seed(100 + rank)
    for dtype, tol in ((torch.float32, 1e-5), (torch.float64, 1e-12), (torch.float16, 2e-2), (torch.bfloat16, 5e-2)):
        for numel in (1000, 2**20 + 7, 3 * 2**20):
            x = torch.randn(numel, generator=gen, device="cuda").to(dtype)
            y = x.clone()
            rr.all_reduce_avg(x)
            dist.all_reduce(y)
            y /= n
            torch.testing.assert_close(x.float(), y.float(), rtol=tol, atol=tol * 4)
            assert same_on_all_ranks(x)
            z = torch.randn(numel, generator=gen, device="cuda").to(dtype)
            w = z.clone()
            rr.all_reduce(z, op="max")
            dist.all_reduce(w, op=dist.ReduceOp.MAX)
            assert bits_equal(z, w)
        # accum_dtype=float32: at least as close to the float64 truth as the per-hop rounding
        if dtype in (torch.float16, torch.bfloat16):
            x = torch.randn(4097, generator=gen, device="cuda").to(dtype)
            truth = reference(gather_inputs(x), "avg").double()
            a, b = x.clone(), x.clone()
            rr.all_reduce_avg(a, accum_dtype=torch.float32)
            rr.all_reduce_avg(b)
            assert (a.double() - truth).abs().mean() <= (b.double() - truth).abs().mean() + 1e-6


def test_random_data_matches_nccl():
    run_gpu_ranks(_random_vs_nccl)


# ---- layouts -----------------------------------------------------------------------------------


def _layouts(rank: int, n: int) -> None:
    import ringreduce as rr

    dev = torch.device("cuda", rank)
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

    dev = torch.device("cuda", rank)
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

    dev = torch.device("cuda", rank)
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

    dev = torch.device("cuda", rank)
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

    dev = torch.device("cuda", rank)
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


def _graph_capture(rank: int, n: int) -> None:
    import ringreduce as rr

    x = torch.ones(1024, device=torch.device("cuda", rank))
    rr.all_reduce(x)  # communicator created outside the capture
    g = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="CUDA graph"):
        with torch.cuda.graph(g):
            rr.all_reduce(x)


def test_cuda_graph_capture_raises_clearly():
    run_gpu_ranks(_graph_capture)


# ---- agreement check and failures ------------------------------------------------------------------


def _check_mismatch(rank: int, n: int) -> None:
    import ringreduce as rr

    dev = torch.device("cuda", rank)
    x = torch.ones(100 + (rank == 1), device=dev)
    with pytest.raises(RuntimeError) as info:
        rr.all_reduce(x)
    assert "numel" in str(info.value) or "shape" in str(info.value)
    assert bool((x == 1).all())  # nothing moved
    y = torch.ones(64, device=dev, dtype=torch.float32 if rank else torch.int32)
    with pytest.raises(RuntimeError):
        rr.all_reduce(y)
    # no payload moved: the group is still usable
    z = torch.ones(64, device=dev)
    rr.all_reduce(z)
    assert bool((z == n).all())


def test_check_detects_mismatch():
    run_gpu_ranks(_check_mismatch, env={"RINGREDUCE_CHECK": "1"})


def _dead_peer(rank: int, n: int) -> None:
    import ringreduce as rr

    dev = torch.device("cuda", rank)
    x = torch.ones(1 << 16, device=dev)
    rr.all_reduce(x)  # everyone creates the communicator
    if rank == n - 1:
        return  # never calls again
    work = rr.all_reduce(torch.ones(1 << 16, device=dev), async_op=True)
    with pytest.raises(dist.DistBackendError):
        work.wait(timeout=datetime.timedelta(seconds=120))
    with pytest.raises(dist.DistBackendError):
        rr.all_reduce(torch.ones(8, device=dev))


def test_peer_that_never_calls_raises_after_timeout():
    run_gpu_ranks(_dead_peer, env={"RINGREDUCE_TIMEOUT": "5"}, timeout=240)


def _build_info(rank: int, n: int) -> dict:
    import ringreduce as rr

    return rr.build_info()


def test_build_info_reports_cuda_and_nccl():
    info = run_gpu_ranks(_build_info)[0]
    assert info["cuda"] is True
    assert info["nccl_version"] and info["nccl_runtime_version"]
    assert info["cuda_archs"]
