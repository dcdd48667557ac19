"""The GPU path beyond one flat ring: reduce_scatter, all_gather, rings over rank lists (DeviceMesh
sub-meshes) and the hierarchical all-reduce, on CUDA tensors over ringreduce's NCCL communicator.
Needs a CUDA GPU; the hierarchical and strict sub-ring cases need a world of >= 4 ranks
(RINGREDUCE_GPU_WORLD=4 runs them on one GPU), skipped otherwise.

The ranks are processes (tests/gpu/gpu_ranks.py; ranks may share GPUs, Note [Ranks sharing a GPU]);
each test runs many cases. The checks mirror the CPU suite's: exact position-dependent data against
an all_gather reduced in float64 (bitwise; the case lists are tests/gpu/sweeps.py), random data
against the flat ring within tolerances, bitwise agreement across ranks, inputs left untouched,
CUDA-aware futures holding [output]. What only the GPU path has is checked too: every ring over a
rank list of a group uses the group's ONE communicator (no communicator is created for a sub-ring),
and the agreement frames of a sub-ring stay inside it.

What ran on a GPU so far is listed in docs/design.md (Status).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from refdata import bits_equal, exact_input, gather_inputs, reference, same_on_all_ranks

from gpu.gpu_ranks import device, need_gpus, need_world, run_gpu_ranks, world
from gpu.sweeps import all_gather_cases, all_reduce_cases, reduce_scatter_cases

pytestmark = [pytest.mark.gpu, need_gpus(1)]


def _set_env(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def _even_world() -> int:
    """The largest even world size up to the configured one (equal simulated nodes of 2, even/odd
    sub-rings)."""
    n = world()
    return n - n % 2


def _comm_keys() -> list[int]:
    from ringreduce._rings import cuda as _cuda

    with _cuda._lock:
        return sorted(_cuda._comms)


# ---- reduce_scatter ------------------------------------------------------------------------------


def _reduce_scatter_exact(rank: int, n: int) -> int:
    import ringreduce as rr

    dev = device(rank)
    cases = 0
    for case in reduce_scatter_cases(n):
        _set_env("RINGREDUCE_SEGMENT_BYTES", None if case.segment is None else str(case.segment))
        dtype, op, blk = case.dtype, case.op, case.numel
        x = exact_input(n * blk, rank, dtype, op).to(dev)
        keep = x.clone()
        want = reference(gather_inputs(x), op).view(n, blk)[rank]
        out = torch.full((blk,), 0, dtype=dtype, device=dev)
        rr.reduce_scatter(out, x, op=op)
        assert bits_equal(out, want), case
        assert bits_equal(x, keep), "reduce_scatter must leave its input untouched"
        cases += 1
    _set_env("RINGREDUCE_SEGMENT_BYTES", None)
    # 2-D blocks, a non-contiguous input (transposed) and a non-contiguous output (column slice)
    logical = exact_input(n * 6 * 5, rank, torch.float32, "sum").to(dev).view(n * 6, 5)
    want = reference(gather_inputs(logical), "sum").view(n, 6, 5)[rank]
    x = logical.t().contiguous().t()
    base = torch.zeros(6, 5, 3, device=dev)
    out = base[:, :, 1]
    rr.reduce_scatter(out, x)
    assert bits_equal(out, want)
    assert bits_equal(base[:, :, 0], torch.zeros(6, 5, device=dev)) and bits_equal(
        base[:, :, 2], torch.zeros(6, 5, device=dev)
    )
    # AVG divides by the ring's size once
    y = exact_input(n * 33, rank, torch.bfloat16, "avg").to(dev)
    want = reference(gather_inputs(y), "avg").view(n, 33)[rank]
    out = torch.empty(33, dtype=torch.bfloat16, device=dev)
    rr.reduce_scatter(out, y, op="avg")
    assert bits_equal(out, want)
    return cases


def test_reduce_scatter_exact_every_dtype_and_op():
    assert all(c > 0 for c in run_gpu_ranks(_reduce_scatter_exact))


def _reduce_scatter_async(rank: int, n: int) -> None:
    import ringreduce as rr

    dev = device(rank)
    blk = 3 * 2**18 + 1
    x = torch.zeros(n * blk, device=dev)
    torch.cuda._sleep(100_000_000)  # the producer is still running when the call is made
    x.copy_(exact_input(n * blk, rank, torch.float32, "sum").to(dev))
    want = reference(gather_inputs(x), "sum").view(n, blk)[rank]
    out = torch.empty(blk, device=dev)
    work = rr.reduce_scatter(out, x, async_op=True)
    value = work.get_future().wait()
    assert isinstance(value, list) and (value[0] is out or value[0].data_ptr() == out.data_ptr())
    assert work.wait() is True
    assert bits_equal(out, want)
    doubled = rr.reduce_scatter(out, x, async_op=True).get_future().then(lambda f: f.value()[0] * 2).wait()
    assert bits_equal(doubled, want * 2)


def test_reduce_scatter_async_future_and_stream_order():
    run_gpu_ranks(_reduce_scatter_async)


# ---- all_gather ----------------------------------------------------------------------------------


def _all_gather_exact(rank: int, n: int) -> int:
    import ringreduce as rr

    dev = device(rank)
    cases = 0
    for case in all_gather_cases(n):
        _set_env("RINGREDUCE_SEGMENT_BYTES", None if case.segment is None else str(case.segment))
        dtype, shape = case.dtype, case.shape
        x = exact_input(case.numel, rank, dtype, "sum").to(dev).view(shape)
        want = gather_inputs(x)  # [n, *shape]
        got = rr.all_gather(x)
        assert got.is_cuda and got.is_contiguous()
        assert got.shape == ((n,) if x.dim() == 0 else (n * shape[0], *shape[1:]))
        assert bits_equal(got.reshape(want.shape), want), case
        assert same_on_all_ranks(got)
        cases += 1
    _set_env("RINGREDUCE_SEGMENT_BYTES", None)
    # a non-contiguous input and a large one with the default segment size
    col = exact_input(40 * 7, rank, torch.float16, "sum").to(dev).view(40, 7)[:, 2]
    got = rr.all_gather(col)
    assert bits_equal(got.view(n, 40), gather_inputs(col))
    big = exact_input(2**20 + 3, rank, torch.float32, "sum").to(dev)
    work = rr.all_gather(big, async_op=True)
    work.wait()
    got = work.result()[0]
    assert work.get_future().wait()[0].data_ptr() == got.data_ptr()
    assert bits_equal(got.view(n, -1), gather_inputs(big))
    return cases


def test_all_gather_exact_every_dtype():
    assert all(c > 0 for c in run_gpu_ranks(_all_gather_exact))


def _halves_with_check(rank: int, n: int) -> None:
    import ringreduce as rr

    dev = device(rank)
    x = torch.ones(8 + (rank == 1), device=dev)
    with pytest.raises(RuntimeError):
        rr.all_gather(x)
    y = torch.ones(n * 4, device=dev)
    rr.reduce_scatter(torch.empty(4, device=dev), y)  # the group is still usable
    with pytest.raises(RuntimeError):
        rr.reduce_scatter(torch.empty(4, device=dev), torch.ones(n * 4, device=dev), op="max" if rank else "sum")


def test_halves_agreement_check():
    run_gpu_ranks(_halves_with_check, env={"RINGREDUCE_CHECK": "1"})


# ---- rings over rank lists: DeviceMesh and GroupInfo.members --------------------------------------


def _permuted_rings(rank: int, n: int) -> None:
    """A ring over WORLD's ranks in another order (ring index != rank) over the WORLD communicator."""
    import ringreduce as rr
    from ringreduce._groups import GroupInfo
    from ringreduce._rings import cuda as _cuda

    dev = device(rank)
    world = dist.group.WORLD
    rr.all_reduce(torch.ones(4, device=dev))  # WORLD's communicator
    keys = _comm_keys()
    # evens then odds (ring neighbours differ from WORLD's for n >= 3); reversed for two ranks
    order = [r for r in range(n) if r % 2 == 0] + [r for r in range(n) if r % 2 == 1]
    if n == 2:
        order = [1, 0]
    index = order.index(rank)
    info = GroupInfo(pg=world, rank=index, size=n, name=f"ring {order}", members=tuple(order))
    # all_gather concatenates in ring order
    x = exact_input(1031, rank, torch.int32, "sum").to(dev)
    stack = gather_inputs(x)
    out = torch.empty(n * 1031, dtype=torch.int32, device=dev)
    _cuda.cuda_ring_half(x, out, rr.ReduceOp.SUM, info, False, 4)
    assert bits_equal(out.view(n, -1), stack[torch.tensor(order)])
    # reduce_scatter: ring index i gets block i
    y = exact_input(n * 257, rank, torch.float32, "sum").to(dev)
    want = reference(gather_inputs(y), "sum").view(n, 257)[index]
    blk = torch.empty(257, device=dev)
    _cuda.cuda_ring_half(y, blk, rr.ReduceOp.SUM, info, False, 3)
    assert bits_equal(blk, want)
    # all-reduce, synchronous and asynchronous
    z = exact_input(4099, rank, torch.bfloat16, "avg").to(dev)
    want = reference(gather_inputs(z), "avg")
    w = _cuda.cuda_all_reduce(z, rr.ReduceOp.AVG, info, True, False, 1)
    w.wait()
    assert bits_equal(z, want)
    assert _comm_keys() == keys, "a ring over a rank list must not create a communicator"


def test_permuted_ring_over_world_communicator():
    run_gpu_ranks(_permuted_rings)


def _device_mesh_flattened(rank: int, n: int) -> None:
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    import ringreduce as rr

    dev = device(rank)
    rr.all_reduce(torch.ones(4, device=dev))  # WORLD's communicator
    keys = _comm_keys()
    # A 2-D mesh whose rows list the ranks backwards: its flattening is a ring over a rank list of
    # WORLD in another order than WORLD's own.
    mesh = DeviceMesh("cuda", torch.arange(n - 1, -1, -1).view(n, 1), mesh_dim_names=("a", "b"))
    flat_ranks = list(range(n - 1, -1, -1))
    x = exact_input(1000, rank, torch.float32, "sum").to(dev)
    want = reference(gather_inputs(x), "sum")
    rr.all_reduce(x, group=mesh)
    assert bits_equal(x, want)
    g = rr.all_gather(exact_input(33, rank, torch.float16, "sum").to(dev), group=mesh)
    stack = gather_inputs(exact_input(33, rank, torch.float16, "sum").to(dev))
    assert bits_equal(g.view(n, 33), stack[torch.tensor(flat_ranks)])
    blk = torch.empty(65, device=dev)
    y = exact_input(n * 65, rank, torch.float32, "avg").to(dev)
    want = reference(gather_inputs(y), "avg").view(n, 65)[flat_ranks.index(rank)]
    rr.reduce_scatter(blk, y, op="avg", group=mesh)
    assert bits_equal(blk, want)
    assert _comm_keys() == keys, "a flattened sub-mesh must run over WORLD's communicator"
    # A strict sub-mesh (4+ GPUs): mesh (2, 1, n/2) sliced on its first two dims is a ring of 2
    # ranks of WORLD per slice; the slices run side by side over the same communicator.
    if n >= 4 and n % 2 == 0:
        mesh3 = init_device_mesh("cuda", (2, 1, n // 2), mesh_dim_names=("dp", "cp", "tp"))
        sub = mesh3["dp", "cp"]
        ranks = [int(r) for r in sub.mesh.flatten().tolist()]
        assert rank in ranks and len(ranks) == 2
        x = exact_input(5000, rank, torch.float32, "sum").to(dev)
        stack = gather_inputs(x)
        want = reference(stack[torch.tensor(ranks)], "sum")
        rr.all_reduce(x, group=sub)
        assert bits_equal(x, want)
        assert _comm_keys() == keys, "a DeviceMesh sub-mesh must run over WORLD's communicator"


def test_device_mesh_flattened_sub_mesh():
    run_gpu_ranks(_device_mesh_flattened)


def _sub_ring_frames_stay_inside(rank: int, n: int) -> None:
    """RINGREDUCE_CHECK=1 on two disjoint sub-rings of WORLD: a mismatch inside one ring fails that
    ring only; the other ring, which shares the communicator, completes."""
    import ringreduce as rr
    from ringreduce._groups import GroupInfo
    from ringreduce._rings import cuda as _cuda

    dev = device(rank)
    evens = [r for r in range(n) if r % 2 == 0]
    odds = [r for r in range(n) if r % 2 == 1]
    mine = evens if rank % 2 == 0 else odds
    info = GroupInfo(pg=dist.group.WORLD, rank=mine.index(rank), size=len(mine), name=f"ring {mine}",
                     members=tuple(mine))
    bad = rank % 2 == 1 and rank == odds[-1]
    x = torch.ones(100 + int(bad), device=dev)
    if rank % 2 == 1:
        with pytest.raises(RuntimeError, match="numel|shape"):
            _cuda.cuda_all_reduce(x, rr.ReduceOp.SUM, info, False, False, 0)
        assert bool((x == 1).all())
    else:
        _cuda.cuda_all_reduce(x, rr.ReduceOp.SUM, info, False, False, 0)
        assert bool((x == len(evens)).all())
    # both rings, and WORLD, keep working
    y = torch.ones(64, device=dev)
    _cuda.cuda_all_reduce(y, rr.ReduceOp.SUM, info, False, False, 0)
    assert bool((y == len(mine)).all())
    z = torch.ones(64, device=dev)
    rr.all_reduce(z)
    assert bool((z == n).all())


@need_world(4)
def test_sub_ring_agreement_frames_stay_inside_the_ring():
    run_gpu_ranks(_sub_ring_frames_stay_inside, world_size=_even_world(), env={"RINGREDUCE_CHECK": "1"})


# ---- hierarchical all-reduce ------------------------------------------------------------------------


def _hierarchical(rank: int, n: int) -> None:
    import ringreduce as rr
    from ringreduce._groups import choose_algorithm, resolve

    dev = device(rank)
    gen = torch.Generator(device=dev).manual_seed(7 + rank)
    rr.all_reduce(torch.ones(4, device=dev))
    keys = _comm_keys()
    for local in [d for d in range(2, n) if n % d == 0]:
        os.environ["RINGREDUCE_LOCAL_SIZE"] = str(local)
        rr.reload_knobs()  # the rings read their knobs again (ringreduce/_config.py)
        assert choose_algorithm(resolve(None), "hierarchical")[0] == local
        # exact data: bitwise equal to the reference for every dtype and op
        for case in all_reduce_cases(n):
            if case.numel == 0:
                continue
            _set_env("RINGREDUCE_SEGMENT_BYTES", None if case.segment is None else str(case.segment))
            x = exact_input(case.numel, rank, case.dtype, case.op).to(dev)
            want = reference(gather_inputs(x), case.op)
            rr.all_reduce(x, op=case.op, accum_dtype=torch.float32 if case.accum else None, algorithm="hierarchical")
            assert bits_equal(x, want), (local, case)
        _set_env("RINGREDUCE_SEGMENT_BYTES", None)
        # random data: close to the flat ring, identical on every rank
        for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 2e-2), (torch.bfloat16, 5e-2)):
            for numel in (1000, 3 * 2**20 + 7):
                x = torch.randn(numel, generator=gen, device=dev).to(dtype)
                h, f = x.clone(), x.clone()
                rr.all_reduce_avg(h, algorithm="hierarchical")
                rr.all_reduce_avg(f, algorithm="ring")
                torch.testing.assert_close(h.float(), f.float(), rtol=tol, atol=tol)
                assert same_on_all_ranks(h)
        # accum_dtype=float32 on half types: reduced as one float32 copy, rounded once
        x = torch.randn(4097, generator=gen, device=dev).to(torch.bfloat16)
        truth = reference(gather_inputs(x), "avg").double()
        a = x.clone()
        rr.all_reduce_avg(a, accum_dtype=torch.float32, algorithm="hierarchical")
        assert same_on_all_ranks(a)
        assert (a.double() - truth).abs().max() <= truth.abs().max() * 2**-7 + 1e-6
        # non-contiguous tensors and async handles
        base = exact_input(64 * 5, rank, torch.float32, "sum").to(dev).view(64, 5)
        keep = base.clone()
        col = base[:, 1]
        want = reference(gather_inputs(col), "sum")
        work = rr.all_reduce(col, algorithm="hierarchical", async_op=True)
        assert work.get_future().wait()[0].data_ptr() == col.data_ptr()
        assert bits_equal(col, want)
        assert bits_equal(base[:, 0], keep[:, 0]) and bits_equal(base[:, 2:], keep[:, 2:])
    _set_env("RINGREDUCE_LOCAL_SIZE", None)
    assert _comm_keys() == keys, "the hierarchical rings must run over the group's communicator"


@need_world(4)
def test_hierarchical_simulated_nodes():
    run_gpu_ranks(_hierarchical, world_size=_even_world(), timeout=900)


def _hierarchical_checked(rank: int, n: int) -> None:
    import ringreduce as rr

    dev = device(rank)
    x = exact_input(1000, rank, torch.float32, "avg").to(dev)
    want = reference(gather_inputs(x), "avg")
    rr.all_reduce_avg(x, algorithm="hierarchical")
    assert bits_equal(x, want)
    y = torch.ones(100 + (rank == n - 1), device=dev)
    with pytest.raises(RuntimeError):
        rr.all_reduce(y, algorithm="hierarchical")
    with pytest.raises(TypeError):
        rr.all_reduce_avg(torch.ones(8, dtype=torch.int32, device=dev), algorithm="hierarchical")
    z = torch.ones(64, device=dev)
    rr.all_reduce(z, algorithm="hierarchical")
    assert bool((z == n).all())


@need_world(4)
def test_hierarchical_agreement_check():
    run_gpu_ranks(
        _hierarchical_checked, world_size=_even_world(), env={"RINGREDUCE_CHECK": "1", "RINGREDUCE_LOCAL_SIZE": "2"}
    )
