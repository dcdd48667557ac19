"""The backend "ringreduce" on CUDA tensors: the ring collectives (ringreduce's NCCL ring) against
exact values and against ``rr.all_reduce`` on the pool's own group, the delegated collectives on the
inner NCCL group, async Works, and DDP without a hook against DDP over NCCL. Needs a CUDA GPU (ranks
may share it, Note [Ranks sharing a GPU]). The bodies take `on_cuda` so that tests/test_backend.py
runs them on CPU ranks too (test_gpu_backend_bodies_hold_on_cpu): what they assert holds there, and a
GPU run finds a ringreduce bug, not a test bug.

What ran on a GPU so far is listed in docs/design.md (Status).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from gpu.gpu_ranks import device, need_gpus, run_gpu_ranks

pytestmark = [pytest.mark.gpu, need_gpus(1)]


def _exact(rank: int, n: int, dev: torch.device) -> torch.Tensor:
    return ((torch.arange(n) * 7 + rank * 3) % 5 - 2).float().to(dev)


def _ring_collectives(rank: int, n: int, on_cuda: bool = True) -> int:
    """Every ring collective of a "ringreduce" group on this rank's device: exact values, random
    data bitwise equal to rr.all_reduce on the pool's group, async Works. Returns the checks passed."""
    import ringreduce as rr

    dev = device(rank) if on_cuda else torch.device("cpu")
    g = dist.new_group(backend="ringreduce")
    checks = 0
    everyone = [_exact(r, 1000, dev) for r in range(n)]
    for op, ref in ((dist.ReduceOp.SUM, sum(everyone)), (dist.ReduceOp.AVG, sum(everyone) / n),
                    (dist.ReduceOp.MAX, torch.stack(everyone).amax(0)), (dist.ReduceOp.MIN, torch.stack(everyone).amin(0))):
        t = _exact(rank, 1000, dev)
        dist.all_reduce(t, op=op, group=g)
        assert torch.equal(t, ref), op
        checks += 1
    gen = torch.Generator().manual_seed(rank)
    for size in (7, 1 << 16, 3 << 20):
        x = torch.randn(size, generator=gen).to(dev)
        ref = x.clone()
        dist.all_reduce(x, group=g)
        rr.all_reduce(ref)
        assert torch.equal(x, ref), size
        checks += 1
    block = torch.empty(8, device=dev)
    dist.reduce_scatter_tensor(block, _exact(rank, 8 * n, dev), group=g)
    assert torch.equal(block, sum(_exact(r, 8 * n, dev) for r in range(n))[rank * 8:(rank + 1) * 8])
    gathered = torch.empty(4 * n, device=dev)
    work = dist.all_gather_into_tensor(gathered, _exact(rank, 4, dev), group=g, async_op=True)
    work.wait()
    assert torch.equal(gathered, torch.cat([_exact(r, 4, dev) for r in range(n)]))
    blocks = [torch.empty(5, device=dev) for _ in range(n)]
    dist.all_gather(blocks, _exact(rank, 5, dev), group=g)
    assert all(torch.equal(blocks[r], _exact(r, 5, dev)) for r in range(n))
    t = _exact(rank, 64, dev)
    fut = dist.all_reduce(t, group=g, async_op=True).get_future()
    assert torch.equal(fut.wait()[0], sum(_exact(r, 64, dev) for r in range(n)))
    checks += 4
    assert g.calls.get("ring:all_reduce", 0) == 8 and not any(k.startswith("inner:") for k in g.calls), g.calls
    dist.destroy_process_group(g)
    return checks + 1


def _delegated(rank: int, n: int, on_cuda: bool = True) -> int:
    """broadcast, all_to_all_single, send/recv and barrier on the inner group (NCCL for CUDA tensors)."""
    dev = device(rank) if on_cuda else torch.device("cpu")
    g = dist.new_group(backend="ringreduce")
    t = _exact(rank, 16, dev)
    dist.broadcast(t, src=0, group=g)
    assert torch.equal(t, _exact(0, 16, dev))
    out = torch.empty(n, device=dev)
    dist.all_to_all_single(out, torch.arange(n, dtype=torch.float32, device=dev) + 10 * rank, group=g)
    assert torch.equal(out, torch.tensor([10.0 * j + rank for j in range(n)], device=dev))
    if rank == 0:
        dist.send(_exact(0, 9, dev), dst=1, group=g)
    elif rank == 1:
        buf = torch.empty(9, device=dev)
        dist.recv(buf, src=0, group=g)
        assert torch.equal(buf, _exact(0, 9, dev))
    dist.barrier(group=g)
    assert g.calls["inner:broadcast"] == 1 and g.calls["inner:all_to_all"] == 1, g.calls
    dist.destroy_process_group(g)
    return 4


def _ddp_matches(rank: int, n: int, on_cuda: bool = True) -> int:
    """DDP without a hook over "ringreduce" against DDP over the pool's group (NCCL on CUDA, gloo on
    CPU): within rounding, and bitwise at 2 ranks (Note [What bitwise-equal DDP needs] in
    tests/test_backend_train.py)."""
    dev = device(rank) if on_cuda else torch.device("cpu")
    g = dist.new_group(backend="ringreduce")
    ids = [dev.index] if dev.type == "cuda" else None
    models = []
    for group in (g, None):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)).to(dev)
        models.append(torch.nn.parallel.DistributedDataParallel(model, device_ids=ids, process_group=group))
    gen = torch.Generator().manual_seed(1234 + rank)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    for _ in range(3):
        x, y = torch.randn(16, 32, generator=gen).to(dev), torch.randn(16, 8, generator=gen).to(dev)
        for m, opt in zip(models, opts, strict=True):
            opt.zero_grad()
            torch.nn.functional.mse_loss(m(x), y).backward()
            opt.step()
    ours, theirs = (list(m.parameters()) for m in models)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        if n == 2:
            assert torch.equal(a, b)
    assert g.calls["ring:all_reduce"] >= 3, g.calls
    dist.destroy_process_group(g)
    return len(ours)


def test_ring_collectives_on_cuda():
    assert all(c == 12 for c in run_gpu_ranks(_ring_collectives))


def test_delegated_collectives_on_cuda():
    assert all(c == 4 for c in run_gpu_ranks(_delegated))


def test_ddp_without_a_hook_over_ringreduce_on_cuda():
    assert all(c == 4 for c in run_gpu_ranks(_ddp_matches))
