"""ringreduce.all_reduce_coalesced: exact results for lists of mixed tensors, async, errors."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
from ranks import run_ranks

import ringreduce as rr

BOTH_TRANSPORTS = True  # conftest.py: every test over shared memory and over gloo point-to-point


def _inputs(rank: int, with_base: bool = False) -> list[torch.Tensor]:
    """Position-dependent small integers (exact in every dtype), mixed dtypes, shapes and layouts."""

    def pat(n: int, k: int, dtype: torch.dtype) -> torch.Tensor:
        return ((torch.arange(n) * (k + 3) + 7 * rank + k) % 23 - 11).to(dtype)

    base = pat(6 * 5, 9, torch.float32).reshape(6, 5)
    return [
        pat(17, 0, torch.float32),
        pat(12, 1, torch.float64).reshape(3, 4).t(),  # transposed
        pat(7, 2, torch.int32),
        pat(0, 3, torch.float32),  # empty
        pat(33, 4, torch.bfloat16).reshape(3, 11),
        base[:, 1],  # column slice: neighbours must stay untouched
        pat(1, 5, torch.int64),
        pat(40, 6, torch.float32).reshape(2, 4, 5).permute(2, 0, 1),
        pat(5, 7, torch.float16),
    ] + ([base] if with_base else [])


def _expected(ws: int, op: str) -> list[torch.Tensor]:
    per_rank = [_inputs(r) for r in range(ws)]
    out = []
    for k in range(len(per_rank[0])):
        vals = torch.stack([per_rank[r][k].to(torch.float64) for r in range(ws)])
        if op == "sum":
            red = vals.sum(0)
        elif op == "avg":
            red = vals.sum(0) / ws
        elif op == "max":
            red = vals.max(0).values
        else:
            red = vals.min(0).values
        out.append(red)
    return out


def _exact(rank: int, ws: int, op: str, async_op: bool, segment: bool) -> None:
    tensors = _inputs(rank, with_base=True)
    base = tensors.pop()  # the column slice tensors[5] lives in it
    base_before = base.clone()
    if op == "avg":  # integer AVG is refused: use the floating tensors only
        keep = [k for k, t in enumerate(tensors) if t.is_floating_point()]
    else:
        keep = list(range(len(tensors)))
    chosen = [tensors[k] for k in keep]
    result = rr.all_reduce_coalesced(chosen, op=op, async_op=async_op)
    if async_op:
        assert isinstance(result, rr.Work)
        fut = result.get_future()
        assert result.wait(timeout=datetime.timedelta(seconds=60)) is True
        value = fut.wait()
        assert isinstance(value, list) and len(value) == len(chosen)
        assert all(v is t for v, t in zip(value, chosen, strict=True))
        assert result.is_completed()
    else:
        assert result is None
    expected = _expected(ws, op)
    for k, t in zip(keep, chosen, strict=True):
        exp = expected[k]
        if op == "avg" and t.dtype in (torch.float16, torch.bfloat16):
            exp = exp.to(t.dtype)  # sum/n rounded once to the half type
        assert torch.equal(t.to(torch.float64), exp.to(t.dtype).to(torch.float64)), (k, t, exp)
    untouched = torch.ones(base_before.shape[1], dtype=torch.bool)
    untouched[1] = False
    assert torch.equal(base[:, untouched], base_before[:, untouched]), "memory outside the slice changed"
    # Bitwise identical on every rank.
    for t in chosen:
        flat = t.reshape(-1).to(torch.float64)
        got = [torch.empty_like(flat) for _ in range(ws)]
        dist.all_gather(got, flat)
        assert all(torch.equal(g, flat) for g in got)


@pytest.mark.parametrize("ws", [2, 3])
def test_coalesced_exact(ws: int) -> None:
    for op, async_op in (("sum", False), ("avg", True), ("max", True), ("min", False)):
        run_ranks(ws, _exact, op, async_op, False)
    run_ranks(ws, _exact, "sum", True, True, env={"RINGREDUCE_SEGMENT_BYTES": 16})


def _random_against_loop(rank: int, ws: int) -> None:
    g = torch.Generator().manual_seed(rank)
    tensors = [torch.randn(n, generator=g) for n in (1, 100, 1000, 3)]
    loop = [t.clone() for t in tensors]
    for t in loop:
        rr.all_reduce(t, op=rr.ReduceOp.AVG)
    rr.all_reduce_coalesced(tensors, op=rr.ReduceOp.AVG)
    for a, b in zip(tensors, loop, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_coalesced_random_matches_per_tensor_calls() -> None:
    run_ranks(3, _random_against_loop)


def _trivial(rank: int, ws: int) -> None:
    assert rr.all_reduce_coalesced([]) is None
    w = rr.all_reduce_coalesced([torch.empty(0)], async_op=True)
    assert w.wait() and w.get_future().wait()[0].numel() == 0
    # A lone contiguous tensor is reduced in place without packing.
    t = torch.full((5,), float(rank))
    rr.all_reduce_coalesced((t,))
    assert torch.equal(t, torch.full((5,), float(sum(range(ws)))))


def test_coalesced_trivial_inputs() -> None:
    run_ranks(2, _trivial)


def _errors(rank: int, ws: int) -> None:
    good = torch.ones(4)
    with pytest.raises(TypeError, match="list or tuple"):
        rr.all_reduce_coalesced(good)
    with pytest.raises(TypeError, match="list or tuple"):
        rr.all_reduce_coalesced(None)
    with pytest.raises(ValueError, match="one device"):
        rr.all_reduce_coalesced([good, torch.ones(4, device="meta")])
    # Integer AVG: refused on every rank before any data moves, float tensors untouched too.
    f, i = torch.full((3,), float(rank)), torch.arange(3)
    with pytest.raises(TypeError, match="element 1"):
        rr.all_reduce_coalesced([f, i], op="avg")
    assert torch.equal(f, torch.full((3,), float(rank))) and torch.equal(i, torch.arange(3))
    # A non-tensor on one rank only: that rank raises TypeError, the others RuntimeError at once.
    bad = [good, "not a tensor"] if rank == 1 else [good, torch.ones(2)]
    with pytest.raises(TypeError if rank == 1 else RuntimeError, match="not a torch.Tensor" if rank == 1 else "refused"):
        rr.all_reduce_coalesced(bad)
    # Same dtype and total numel, different split: only the coalesced description differs.
    split = [torch.ones(3), torch.ones(5)] if rank == 0 else [torch.ones(8)]
    with pytest.raises(RuntimeError, match="disagree"):
        rr.all_reduce_coalesced(split)
    # Shapes differ: every rank raises, nothing hangs.
    shaped = [torch.ones(4), torch.ones(3 + rank)]
    with pytest.raises(RuntimeError, match="disagree"):
        rr.all_reduce_coalesced(shaped)
    # The group still works afterwards.
    t = [torch.ones(2), torch.ones(3, dtype=torch.float64)]
    rr.all_reduce_coalesced(t)
    assert torch.equal(t[0], torch.full((2,), float(ws))) and torch.equal(t[1], torch.full((3,), float(ws), dtype=torch.float64))


def test_coalesced_errors() -> None:
    run_ranks(3, _errors)


def _gpu_exact(rank: int, ws: int) -> None:
    torch.cuda.set_device(rank)
    tensors = [t.cuda() for t in _inputs(rank)]
    rr.all_reduce_coalesced(tensors)
    for t, exp in zip(tensors, _expected(ws, "sum"), strict=True):
        assert torch.equal(t.cpu().to(torch.float64), exp.to(t.dtype).to(torch.float64))


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs >= 2 CUDA GPUs")
def test_gpu_coalesced_exact() -> None:
    run_ranks(2, _gpu_exact)


def test_refused_cuda_call_tells_the_ranks_of_the_gpu_ring(monkeypatch) -> None:
    """A refused coalesced call of CUDA tensors sends its refusal frame on the GPU path (the ring the
    other ranks run it on), never on the CPU worker: on an NCCL-only group the CPU path has no
    transport (ValueError instead of the refusal), and on "cpu:gloo,cuda:nccl" the other ranks would
    wait for the refusal until the timeout. One process, the group and both paths faked: FakeTensor
    gives CUDA tensors without a GPU, and its subclass is refused locally."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ringreduce import _cuda, _dispatch, coalesced
    from ringreduce._groups import GroupInfo

    with FakeTensorMode():
        tensors = [torch.empty(4, device="cuda"), torch.empty(2, device="cuda")]
    info = GroupInfo(pg=None, rank=0, size=2, name="fake group")  # type: ignore[arg-type]
    seen: list[str] = []
    monkeypatch.setattr(coalesced, "resolve", lambda group: info)
    monkeypatch.setattr(_dispatch, "choose_algorithm", lambda info, algorithm: (0, ()))
    monkeypatch.setattr(_cuda, "cuda_refuse", lambda info, device, kind, error, members=None: seen.append(f"gpu {device}"))
    monkeypatch.setattr(_dispatch, "submit_cpu", lambda *a, **k: seen.append("cpu"))
    monkeypatch.setitem(_dispatch.C.native_info, "cuda", True)
    monkeypatch.setenv("RINGREDUCE_CHECK", "1")
    with pytest.raises(ValueError, match="tensor subclass FakeTensor"):
        rr.all_reduce_coalesced(tensors)
    assert seen == ["gpu cuda:0"], seen
