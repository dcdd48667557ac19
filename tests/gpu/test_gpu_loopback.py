"""The GPU driver on ONE GPU: ranks as threads with their own streams, NCCL replaced by
cudaMemcpyAsync + events (csrc/cuda/loopback_ring.h). Needs >= 1 GPU; skipped otherwise.

Runs the real kernels, both streams per rank, the events, double-buffered staging and the call
framing, leaving only the NCCL calls to the multi-rank tests. Ran on one H100 at commit 963a10d:
31/31 passed in 138 s (benchmarks/results/h100-2026-11-25).
"""

from __future__ import annotations

import pytest
import torch
from refdata import ALL_TYPES, OPS, bits_equal, exact_input, reference, supported

from gpu.gpu_ranks import need_gpus

pytestmark = [pytest.mark.gpu, need_gpus(1)]

OP_CODES = {"sum": 0, "avg": 1, "max": 2, "min": 3, "product": 4}


def _loopback(tensors, op, accum=False, segment_bytes=0, num_slots=4, phases=3, local_size=0, order=()):
    from ringreduce._native import C

    if not hasattr(C, "_cuda_loopback_all_reduce"):
        pytest.fail("ringreduce was built without CUDA; the GPU tests need the CUDA build")
    C._cuda_loopback_all_reduce(tensors, OP_CODES[op], accum, segment_bytes, num_slots, phases, local_size, list(order))


@pytest.mark.parametrize("nranks", [2, 3, 5, 8])
def test_loopback_exact_every_dtype_and_op(nranks):
    dev = torch.device("cuda", 0)
    for dtype in ALL_TYPES:
        for op in OPS:
            if not supported(dtype, op):
                continue
            for numel in sorted({1, nranks - 1 or 1, nranks + 1, 37, 4099}):
                for seg, slots in ((16, 1), (64, 2), (0, 4)):
                    for accum in ((False, True) if dtype in (torch.float16, torch.bfloat16) else (False,)):
                        ins = [exact_input(numel, r, dtype, op) for r in range(nranks)]
                        want = reference(torch.stack(ins), op)
                        ts = [t.to(dev) for t in ins]
                        _loopback(ts, op, accum, seg, slots)
                        for r, t in enumerate(ts):
                            assert bits_equal(t.cpu(), want), f"{op} {dtype} n={nranks} numel={numel} rank {r}"


def test_loopback_large_default_segments():
    dev = torch.device("cuda", 0)
    n, numel = 4, 3 * 2**20 + 11
    ins = [exact_input(numel, r, torch.bfloat16, "avg") for r in range(n)]
    want = reference(torch.stack(ins), "avg")
    ts = [t.to(dev) for t in ins]
    _loopback(ts, "avg", accum=True)
    for t in ts:
        assert bits_equal(t.cpu(), want)


def test_loopback_orders_after_current_stream():
    dev = torch.device("cuda", 0)
    ts = [torch.zeros(2**20, device=dev) for _ in range(3)]
    torch.cuda._sleep(100_000_000)
    for r, t in enumerate(ts):
        t.fill_(r + 1)
    _loopback(ts, "sum")
    for t in ts:
        assert bool((t == 6).all())


# ---- the stages of the other collectives (ring_executor.h), with the real kernels -------------------


@pytest.mark.parametrize("order", [(0, 1, 2, 3), (2, 0, 3, 1)], ids=["in-order", "permuted"])
def test_loopback_ring_halves(order):
    """Reduce-scatter only and all-gather only (ring index i owns block i) over a ring of 4 ranks."""
    dev = torch.device("cuda", 0)
    n = len(order)
    for dtype in ALL_TYPES:
        for op in OPS:
            if not supported(dtype, op):
                continue
            for blk in (1, 37, 4099):
                ins = [exact_input(n * blk, r, dtype, op) for r in range(n)]
                want = reference(torch.stack(ins), op).view(n, blk)
                ts = [t.to(dev) for t in ins]
                _loopback(ts, op, segment_bytes=64, num_slots=2, phases=1, order=order)
                for r, t in enumerate(ts):
                    i = order.index(r)
                    assert bits_equal(t.cpu().view(n, blk)[i], want[i]), f"rs {op} {dtype} blk={blk} rank {r}"
        own = [exact_input(37, r, dtype, "sum") for r in range(n)]
        ts = []
        for r in range(n):
            t = torch.zeros(n * 37, dtype=dtype)
            t.view(n, 37)[order.index(r)] = own[r]
            ts.append(t.to(dev))
        _loopback(ts, "sum", segment_bytes=64, num_slots=2, phases=2, order=order)
        want = torch.cat([own[r] for r in order])
        for t in ts:
            assert bits_equal(t.cpu(), want), f"ag {dtype}"


@pytest.mark.parametrize("n,local,order", [(4, 2, (0, 1, 2, 3)), (6, 3, (3, 0, 5, 1, 4, 2)), (8, 2, tuple(range(8)))])
def test_loopback_hierarchical(n, local, order):
    """The hierarchical all-reduce's three stages equal the flat reduction on exact data."""
    dev = torch.device("cuda", 0)
    for dtype in ALL_TYPES:
        for op in OPS:
            if not supported(dtype, op):
                continue
            for numel in (1, n + 1, 4099):
                ins = [exact_input(numel, r, dtype, op) for r in range(n)]
                want = reference(torch.stack(ins), op)
                ts = [t.to(dev) for t in ins]
                _loopback(ts, op, segment_bytes=64, num_slots=2, local_size=local, order=order)
                for r, t in enumerate(ts):
                    assert bits_equal(t.cpu(), want), f"{op} {dtype} n={n} L={local} numel={numel} rank {r}"


# ---- issue 15: every ring size on one GPU, where direction and peer mapping are visible ---------
# With 2 GPUs next == prev, so a swapped direction or a wrong peer mapping passes unnoticed; a
# ring of n >= 3 ranks as threads on one GPU shows both.


def _permuted(n: int) -> tuple[int, ...]:
    return tuple((3 * i + 1) % n for i in range(n)) if n % 3 else tuple(reversed(range(n)))


@pytest.mark.parametrize("nranks", [3, 4, 5, 6, 7, 8])
def test_loopback_ring_of_n_flat_halves_and_mapped(nranks):
    """Flat all-reduce, reduce-scatter only and all-gather only over a permuted (mapped) ring of n."""
    dev = torch.device("cuda", 0)
    order = _permuted(nranks)
    assert sorted(order) == list(range(nranks))
    for dtype in (torch.float32, torch.bfloat16, torch.int32):
        for numel in (nranks - 1, nranks * 37 + 5):
            ins = [exact_input(numel, r, dtype, "sum") for r in range(nranks)]
            want = reference(torch.stack(ins), "sum")
            ts = [t.to(dev) for t in ins]
            _loopback(ts, "sum", segment_bytes=64, num_slots=2, order=order)
            for r, t in enumerate(ts):
                assert bits_equal(t.cpu(), want), f"flat {dtype} n={nranks} numel={numel} rank {r}"
        blk = 41
        ins = [exact_input(nranks * blk, r, dtype, "sum") for r in range(nranks)]
        want = reference(torch.stack(ins), "sum").view(nranks, blk)
        ts = [t.to(dev) for t in ins]
        _loopback(ts, "sum", segment_bytes=64, num_slots=2, phases=1, order=order)
        for r, t in enumerate(ts):
            i = order.index(r)
            assert bits_equal(t.cpu().view(nranks, blk)[i], want[i]), f"rs {dtype} n={nranks} rank {r}"


@pytest.mark.parametrize("n,local", [(6, 2), (8, 4), (9, 3)])
def test_loopback_hierarchical_permuted_nodes(n, local):
    """The three hierarchical stages (intra-node reduce-scatter, inter-node ring, intra-node
    all-gather) over a ring whose nodes are permuted: AVG divides once by n."""
    dev = torch.device("cuda", 0)
    order = _permuted(n)
    for op in ("sum", "avg", "max"):
        ins = [exact_input(4099, r, torch.float32, op) for r in range(n)]
        want = reference(torch.stack(ins), op)
        ts = [t.to(dev) for t in ins]
        _loopback(ts, op, segment_bytes=128, num_slots=2, local_size=local, order=order)
        for r, t in enumerate(ts):
            assert bits_equal(t.cpu(), want), f"{op} n={n} L={local} rank {r}"


KERNEL_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.int16,
                 torch.int32, torch.int64, torch.uint8, torch.complex64, torch.complex128]


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_reduce_kernel_matches_torch(dtype):
    """The ring's reduce kernel (out = op(a, b), AVG's division) against torch, misaligned too."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    import gpu_kernels

    from ringreduce._native import C

    if not hasattr(C, "_cuda_reduce"):
        pytest.fail("ringreduce was built without CUDA; the GPU tests need the CUDA build")
    dev = torch.device("cuda", 0)
    bad = gpu_kernels.check_all(C, dev, [dtype])
    assert not bad, bad
