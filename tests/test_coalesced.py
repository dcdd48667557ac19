"""ringreduce.all_reduce_coalesced: exact results for lists of mixed tensors, async, errors, and
all_reduce's options (accum_dtype, algorithm, wire_dtype, predivide_factor) per packed buffer."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
from ranks import CPU_PLACES, full_at, run_ranks
from refdata import bits_equal, ring_reference, same_on_all_ranks

import ringreduce as rr

PLACES = CPU_PLACES  # conftest.py: every test at each place (Note [Places] in ranks.py)


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
@full_at("tcp", ws=3)
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


# ------------------------------------------------------------------------------------------------
# all_reduce's options, per packed buffer (Note [Options of a coalesced list], ringreduce/coalesced.py)


def _options_inputs(rank: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Random float32 tensors (a different scale per rank) and exact data of other dtypes: multiples
    of 4 below 64, so a factor of 2 or 4 divides them exactly. Returns the list and the tensor the
    column slice lives in."""
    g = torch.Generator().manual_seed(100 + rank)

    def exact(n: int, k: int, dtype: torch.dtype) -> torch.Tensor:
        return (((torch.arange(n) * (k + 3) + 7 * rank + k) % 17 - 8) * 4).to(dtype)

    base = torch.randn(6, 5, generator=g)
    return [
        torch.randn(17, generator=g) * (1 + rank),
        exact(12, 1, torch.float64).reshape(3, 4).t(),  # transposed
        torch.empty(0),
        exact(33, 2, torch.bfloat16).reshape(3, 11),
        base[:, 1],  # column slice: neighbours must stay untouched
        torch.complex(exact(9, 3, torch.float32), exact(9, 4, torch.float32)),
        torch.randn(8, 5, generator=g).t() * 3,  # transposed
        torch.randn(40_000, generator=g),  # the float32 buffer is large enough for the ring
        exact(5, 5, torch.float16),
    ], base


def _packed(tensors: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The flat buffer all_reduce_coalesced packs `dtype`'s tensors into (order of the list)."""
    return torch.cat([t.reshape(-1) for t in tensors if t.dtype == dtype])


def _options_case(rank: int, ws: int, op: str, async_op: bool, kwargs: dict) -> None:
    tensors, base = _options_inputs(rank)
    base_before = base.clone()
    wire, factor = kwargs.get("wire_dtype"), kwargs.get("predivide_factor")
    # What rr.all_reduce gives on each packed buffer, with the options that buffer takes.
    want: dict[torch.dtype, torch.Tensor] = {}
    for dtype in dict.fromkeys(t.dtype for t in tensors):
        flat = _packed(tensors, dtype)
        rr.all_reduce(flat, op=op, algorithm=kwargs.get("algorithm", "auto"),
                      accum_dtype=kwargs.get("accum_dtype") if dtype in (torch.float16, torch.bfloat16) else None,
                      wire_dtype=wire if dtype == torch.float32 else None, predivide_factor=factor)
        want[dtype] = flat
    # The float32 buffer, independently: the ring's arithmetic reproduced from every rank's inputs.
    reference = ring_reference([_packed(_options_inputs(r)[0], torch.float32) for r in range(ws)], op, wire, factor)
    assert bits_equal(want[torch.float32], reference), "rr.all_reduce of the packed buffer is not the ring's"

    result = rr.all_reduce_coalesced(tensors, op=op, async_op=async_op, **kwargs)
    if async_op:
        assert isinstance(result, rr.Work)
        value = result.get_future().wait()
        assert result.wait(timeout=datetime.timedelta(seconds=60)) is True
        assert isinstance(value, list) and all(v is t for v, t in zip(value, tensors, strict=True))
    else:
        assert result is None
    offsets: dict[torch.dtype, int] = {}
    for k, t in enumerate(tensors):
        at = offsets.get(t.dtype, 0)
        offsets[t.dtype] = at + t.numel()
        got = t.reshape(-1)
        assert bits_equal(got, want[t.dtype][at : at + t.numel()]), (k, t.dtype, kwargs)
        if t.dtype == torch.float64 and op == "sum":  # exact data: the float64 sum itself
            exact = sum(_options_inputs(r)[0][k].reshape(-1) for r in range(ws))
            assert torch.equal(got, exact)
        assert same_on_all_ranks(t), f"element {k} differs between ranks"
    untouched = torch.ones(base_before.shape[1], dtype=torch.bool)
    untouched[1] = False
    assert torch.equal(base[:, untouched], base_before[:, untouched]), "memory outside the slice changed"
    # A lone float32 tensor (reduced in place, not packed): rr.all_reduce's bits on it.
    lone = tensors[0].clone()
    rr.all_reduce(lone, op=op, wire_dtype=wire, predivide_factor=factor)
    alone = [tensors[0].clone()]
    rr.all_reduce_coalesced(alone, op=op, wire_dtype=wire, predivide_factor=factor)
    assert bits_equal(alone[0], lone)


OPTION_CASES = [
    # (op, async_op, keywords): every option on a mixed list, in two calls.
    ("sum", False, {"wire_dtype": torch.float16, "predivide_factor": 4.0, "accum_dtype": torch.float32}),
    ("avg", True, {"wire_dtype": torch.bfloat16, "predivide_factor": 2.0, "algorithm": "ring"}),
]


@pytest.mark.parametrize("ws", [2, 3])
def test_coalesced_options_are_all_reduce_on_each_packed_buffer(ws: int) -> None:
    for op, async_op, kwargs in OPTION_CASES:
        run_ranks(ws, _options_case, op, async_op, kwargs)
    # Tiny segments: the many-segment paths of the same calls.
    run_ranks(ws, _options_case, *OPTION_CASES[1], env={"RINGREDUCE_SEGMENT_BYTES": 64})


def _expect(fn, exc_type: type, *needles: str) -> None:
    with pytest.raises(exc_type) as info:
        fn()
    for needle in needles:
        assert needle in str(info.value), f"{needle!r} not in {info.value}"


f32, f64, bf16, f16, i32, i64 = torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int32, torch.int64
BAD_OPTIONS = [
    # (dtypes of the list, keywords, op, exception, words of the message)
    ((f32, f64), {"wire_dtype": f32}, "avg", ValueError, "bfloat16 or torch.float16"),
    ((f32,), {"wire_dtype": "bf16"}, "avg", TypeError, "wire_dtype must be"),
    ((i32, i64), {"wire_dtype": bf16}, "sum", TypeError, "needs a float32 tensor", "no float32 tensor"),
    ((f16, bf16), {"wire_dtype": bf16}, "sum", ValueError, "float32 tensors only", "no float32 tensor"),
    ((i64, f32), {"wire_dtype": bf16}, "max", ValueError, "SUM and AVG", "element 1"),
    ((f32, f64), {"algorithm": "tree"}, "sum", ValueError, "algorithm must be"),
    ((f32, f64), {"predivide_factor": 0}, "avg", ValueError, "> 0"),
    ((f32,), {"predivide_factor": float("nan")}, "avg", ValueError, "finite"),
    ((f32,), {"predivide_factor": "2"}, "avg", TypeError, "a number"),
    ((f32,), {"predivide_factor": True}, "sum", TypeError, "a number"),
    ((f32, f64), {"predivide_factor": 2.0}, "product", ValueError, "SUM and AVG"),
    ((f32, i64), {"predivide_factor": 2.0}, "sum", TypeError, "floating-point", "element 1"),
    ((bf16, f32), {"accum_dtype": f64}, "sum", TypeError, "accum_dtype", "element 0"),
    ((), {"wire_dtype": torch.float64}, "sum", ValueError, "bfloat16 or torch.float16"),
    ((), {"predivide_factor": -1.0}, "avg", ValueError, "> 0"),
]


def _bad_options(rank: int, ws: int) -> None:
    for dtypes, kwargs, op, exc, *words in BAD_OPTIONS:
        tensors = [(torch.arange(10) + rank + k).to(dtype) for k, dtype in enumerate(dtypes)]
        before = [t.clone() for t in tensors]
        _expect(lambda t=tensors, kw=kwargs, op=op: rr.all_reduce_coalesced(t, op=op, **kw), exc, *words)
        assert all(torch.equal(t, b) for t, b in zip(tensors, before, strict=True)), f"{kwargs} changed a tensor"
    # What the options leave alone: integer tensors beside a 16-bit wire, float32 and integer tensors
    # beside accum_dtype=float32 (reduced as they are, exactly).
    ints, floats = torch.arange(7) + rank, torch.full((5,), float(rank))
    halves = torch.full((3,), float(rank), dtype=bf16)
    rr.all_reduce_coalesced([ints, floats], op="sum", wire_dtype=bf16)
    rr.all_reduce_coalesced([ints, floats, halves], op="sum", accum_dtype=f32)
    total = ws * (ws - 1) // 2  # the sum of the ranks; the second call sums ws equal values
    assert torch.equal(ints, (torch.arange(7) * ws + total) * ws)
    assert torch.equal(floats, torch.full((5,), float(total * ws)))
    assert torch.equal(halves, torch.full((3,), float(total), dtype=bf16))
    # One rank refuses: it raises its own error, the others RuntimeError, at once; nothing changes.
    tensors = [torch.ones(4, dtype=f64), torch.ones(1000)]
    if rank == 1:
        _expect(lambda: rr.all_reduce_coalesced(tensors, op="avg", wire_dtype=torch.float64), ValueError, "bfloat16")
    else:
        _expect(lambda: rr.all_reduce_coalesced(tensors, op="avg", wire_dtype=bf16), RuntimeError,
                "rank 1: all_reduce_coalesced refused locally")
    # Ranks that disagree on the wire or the factor all raise; the float64 tensor ahead of the float32
    # one (which alone takes the wire) stays unchanged too.
    disagreements = [
        ({"wire_dtype": bf16} if rank == 0 else {}, "wire_dtype"),
        ({"predivide_factor": 2.0} if rank == ws - 1 else {}, "predivide_factor"),
        ({"predivide_factor": 2.0 if rank == 0 else 4.0}, "predivide_factor"),
    ]
    for kwargs, words in disagreements:
        _expect(lambda kw=kwargs: rr.all_reduce_coalesced(tensors, op="sum", **kw), RuntimeError, "disagree", words)
    assert torch.equal(tensors[0], torch.ones(4, dtype=f64)) and torch.equal(tensors[1], torch.ones(1000))
    # Agreed: fine afterwards.
    rr.all_reduce_coalesced(tensors, op="sum", wire_dtype=f16, predivide_factor=2.0)
    assert torch.equal(tensors[0], torch.full((4,), float(ws), dtype=f64))
    assert torch.equal(tensors[1], torch.full((1000,), float(ws)))


def test_coalesced_bad_options_raise_on_every_rank() -> None:
    run_ranks(3, _bad_options)


def _lists_that_differ(rank: int, ws: int) -> None:
    """Lists of the same total numel (one packed buffer of the same size on every rank) whose tensors
    differ in order, shape or dtype raise on every rank, naming the list, with every tensor unchanged;
    before, only the packed buffer was in the frame and unrelated elements were added."""

    def listed(*shapes: tuple[int, ...], dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
        return [torch.arange(float(torch.Size(s).numel())).reshape(s).to(dtype) + 100 * rank for s in shapes]

    cases = [
        # (this rank's list, rank 0's list) for rank 1; the others pass rank 0's
        (listed((5,), (3,)), listed((3,), (5,))),  # order
        (listed((2, 3), (4,)), listed((3, 2), (4,))),  # shape, same numel per tensor
        (listed((3,), (0,), (2,)), listed((3,), (2,), (0,))),  # where an empty tensor sits
        ([torch.ones(4), torch.ones(2, dtype=torch.float64)], [torch.ones(2, dtype=torch.float64), torch.ones(4)]),
    ]
    agreed = listed((3,), (5,))
    for _ in range(2):  # the same call twice: the second one takes the fast path's plan
        rr.all_reduce_coalesced(agreed)
    for mine, first in cases:
        tensors = mine if rank == 1 else first
        before = [t.clone() for t in tensors]
        _expect(lambda t=tensors: rr.all_reduce_coalesced(t), RuntimeError, "disagree", "all_reduce_coalesced",
                "list layout #")
        assert all(torch.equal(t, b) for t, b in zip(tensors, before, strict=True)), "a tensor changed"
    # a rank's plan of the agreed list is not the other list's
    other = listed((5,), (3,)) if rank == 1 else listed((3,), (5,))
    _expect(lambda: rr.all_reduce_coalesced(other), RuntimeError, "the list's dtypes, shapes or order")
    # Agreed lists still work, with the exact sums.
    for shapes in (((3,), (5,)), ((2, 3), (4,))):
        tensors = listed(*shapes)
        rr.all_reduce_coalesced(tensors)
        total = 100 * ws * (ws - 1) // 2
        for t, s in zip(tensors, shapes, strict=True):
            assert torch.equal(t, torch.arange(float(torch.Size(s).numel())).reshape(s) * ws + total)


def test_coalesced_lists_that_differ_raise_on_every_rank() -> None:
    run_ranks(3, _lists_that_differ)


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


def _agree_alone(monkeypatch) -> None:
    """The ranks' agreement on the knobs at a ring's first call (ringreduce/_rings/agree.py) of a faked
    group of one process: nothing published, the others' knobs taken as alike."""
    from types import SimpleNamespace

    from ringreduce._rings import agree

    monkeypatch.setattr(agree, "Agreement", lambda info, knobs, device: SimpleNamespace(compare=lambda timeout_s: True))
    monkeypatch.setattr(agree, "group_timeout_s", lambda *args: 1.0)  # the fake group has no store


def test_refused_cuda_call_tells_the_ranks_of_the_gpu_ring(monkeypatch) -> None:
    """A refused coalesced call of CUDA tensors sends its refusal frame on the GPU path (the ring the
    other ranks run it on), never on the CPU worker: on an NCCL-only group the CPU path has no
    transport (ValueError instead of the refusal), and on "cpu:gloo,cuda:nccl" the other ranks would
    wait for the refusal until the timeout. One process, the group and both paths faked: FakeTensor
    gives CUDA tensors without a GPU, and its subclass is refused locally."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ringreduce import _call, _rings, coalesced
    from ringreduce._groups import GroupInfo
    from ringreduce._rings import cpu as _cpu
    from ringreduce._rings import cuda as _cuda

    with FakeTensorMode():
        tensors = [torch.empty(4, device="cuda"), torch.empty(2, device="cuda")]
    info = GroupInfo(pg=None, rank=0, size=2, name="fake group")  # type: ignore[arg-type]
    seen: list[str] = []
    monkeypatch.setattr(_rings, "_rings", {})  # this test's rings only
    _agree_alone(monkeypatch)
    monkeypatch.setattr(coalesced, "resolve", lambda group: info)
    monkeypatch.setattr(_cuda.CudaRing, "refuse", lambda self, call, algorithms: seen.append(f"gpu {call.device}") or [])
    monkeypatch.setattr(_cpu.CpuRing, "refuse", lambda self, call, algorithms: seen.append("cpu") or [])
    monkeypatch.setitem(_call.C.native_info, "cuda", True)
    monkeypatch.setenv("RINGREDUCE_CHECK", "1")
    rr.reload_knobs()  # the rings read their knobs again (ringreduce/_config.py)
    for where in (torch.distributed, torch.distributed.distributed_c10d):  # else refused before the group
        monkeypatch.setattr(where, "is_initialized", lambda: True)
    with pytest.raises(ValueError, match="tensor subclass FakeTensor"):
        rr.all_reduce_coalesced(tensors)
    assert seen == ["gpu cuda:0"], seen


def test_refused_cuda_call_with_a_wire_tells_the_flat_ring(monkeypatch) -> None:
    """The other ranks run a 16-bit wire on the flat ring whatever `algorithm` says (hierarchical
    across nodes for "auto"): a refusing rank's frame for that call goes around the flat ring, and
    for a coalesced list one frame per dtype buffer in the order the others run them (the float32
    buffer's on the flat ring, the others' on `algorithm`'s). Faked as in the test above."""
    from types import SimpleNamespace

    from torch._subclasses.fake_tensor import FakeTensorMode

    from ringreduce import _call, _rings, coalesced
    from ringreduce._groups import GroupInfo
    from ringreduce._rings import cuda as _cuda

    with FakeTensorMode():
        f64, f32, f32b = (torch.empty(3, device="cuda", dtype=torch.float64), torch.empty(4, device="cuda"),
                          torch.empty(2, device="cuda"))
    info = GroupInfo(pg=None, rank=0, size=4, name="fake group")  # type: ignore[arg-type]
    algorithms: list[str] = []
    monkeypatch.setattr(_rings, "_rings", {})  # this test's rings only
    _agree_alone(monkeypatch)
    monkeypatch.setattr(coalesced, "resolve", lambda group: info)
    monkeypatch.setattr(_call, "resolve", lambda group: info)
    monkeypatch.setattr(_cuda, "choose_algorithm",
                        lambda info, algorithm, knobs=None: algorithms.append(algorithm) or (0, ()))
    monkeypatch.setattr(_cuda, "communicator", lambda info, device, knobs=None: None)
    monkeypatch.setattr(_cuda, "_native", lambda: SimpleNamespace(cuda_refuse=lambda *args: None))
    monkeypatch.setitem(_call.C.native_info, "cuda", True)
    monkeypatch.setenv("RINGREDUCE_CHECK", "1")
    rr.reload_knobs()  # the rings read their knobs again (ringreduce/_config.py)
    for where in (torch.distributed, torch.distributed.distributed_c10d):  # else refused before the group
        monkeypatch.setattr(where, "is_initialized", lambda: True)
    with pytest.raises(ValueError, match="tensor subclass FakeTensor"):
        rr.all_reduce_coalesced([f64, f32, f32b], op="avg", wire_dtype=torch.bfloat16)
    assert algorithms == ["auto", "ring"], algorithms
    algorithms.clear()
    with pytest.raises(ValueError, match="tensor subclass FakeTensor"):
        rr.all_reduce_coalesced([f64, f32], op="avg", algorithm="hierarchical")
    assert algorithms == ["hierarchical", "hierarchical"], algorithms
    algorithms.clear()
    with pytest.raises(ValueError, match="tensor subclass FakeTensor"):
        rr.all_reduce_avg(f32, wire_dtype=torch.bfloat16)
    assert algorithms == ["ring"], algorithms
    algorithms.clear()
    with pytest.raises(ValueError, match="tensor subclass FakeTensor"):
        rr.all_reduce_avg(f32)
    assert algorithms == ["auto"], algorithms
