"""16-bit wires and predivide factors of rr.all_reduce / rr.all_reduce_avg (Note [Reduction contract],
csrc/core/functors.h; Note [First hop], csrc/core/plan.h), over both CPU transports.

* Exact data (small integers, dyadic factors): the float64 reference rounded once per division.
* Random data: bitwise the ring's order reproduced here in torch (the first hop rounded to the wire,
  every later hop adding the widened partial and the local float32 value in float32, rounding once
  to 16 bits as it sends; the owner's final sum float32), on every rank, for the ring, the one-shot
  and the shared-memory paths alike (tiny and default segment sizes).
* Errors: refused before anything runs, on every rank alike; ranks that disagree on the wire or
  the factor raise on every rank.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from ranks import CPU_PLACES, SHM_ONLY, place_cases, run_ranks
from refdata import ring_reference

import ringreduce as rr
from ringreduce._call import scaling_refusal

PLACES = CPU_PLACES  # conftest.py: every test at each place (Note [Places] in ranks.py)

WIRES = {"bf16": torch.bfloat16, "fp16": torch.float16}


# ------------------------------------------------------------------------------------------------
# The reference: the ring's arithmetic, reproduced with torch float32 ops (refdata.ring_reference)


def random_inputs(n: int, numel: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(numel, generator=g) * (1 + r) for r in range(n)]


def gather(t: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return out


def same_bits(x: torch.Tensor, y: torch.Tensor) -> bool:
    return x.dtype == y.dtype and x.shape == y.shape and bool((x.view(torch.int32) == y.view(torch.int32)).all())


# ------------------------------------------------------------------------------------------------
# Random data: bitwise the reference, on every path


def _random_case(rank, n, numel, seed, op, wire, factor, segment):
    inputs = random_inputs(n, numel, seed)
    t = inputs[rank].clone()
    wire_dtype = WIRES.get(wire)
    if op == "avg":
        rr.all_reduce_avg(t, wire_dtype=wire_dtype, predivide_factor=factor)
    else:
        rr.all_reduce(t, op="sum", wire_dtype=wire_dtype, predivide_factor=factor)
    want = ring_reference(inputs, op, wire_dtype, factor)
    assert same_bits(t, want), (
        f"n={n} numel={numel} op={op} wire={wire} factor={factor} segment={segment}: "
        f"{int((t != want).sum())} elements differ, first {t[t != want][:4]} vs {want[t != want][:4]}"
    )
    assert all(same_bits(x, t) for x in gather(t)), "ranks differ"
    return True


CASES = [
    # (numel, op, wire, factor): small tensors take the one-shot (CPU, gloo) or shared memory;
    # larger ones the ring; primes and numel < n cover uneven chunks.
    (1, "avg", "bf16", None),
    (5, "sum", "fp16", 4.0),
    (1009, "avg", "bf16", None),
    (1009, "sum", "bf16", 3.0),
    (1009, "avg", None, 3.0),
    (40_000, "avg", "fp16", None),
    (300_007, "avg", "bf16", 2.0),
    (1_300_001, "sum", "fp16", 3.0),  # shared memory: the ring in the segment, several rounds
]


# Over tcp (ranks.py's Note [Places]) tiny segments on 3 ranks; the default on both sizes.
@place_cases("segment,n", [(s, n) for s in ("64", "default") for n in (2, 3)],
                 tcp=[("64", 3), ("default", 2), ("default", 3)])
def test_random_data_is_the_rings_arithmetic(n, segment):
    env = {"RINGREDUCE_SEGMENT_BYTES": segment} if segment != "default" else {}
    for i, (numel, op, wire, factor) in enumerate(CASES):
        if segment == "64" and numel > 50_000:
            continue  # tiny segments: the many-segment paths, on small tensors
        run_ranks(n, _random_case, numel, 17 * i + n, op, wire, factor, segment, env=env)


def _ring_only_case(rank, n):
    # algorithm="ring" keeps small tensors off the one-shot: the plan's convert and 16-bit hops.
    inputs = random_inputs(n, 777, 5)
    t = inputs[rank].clone()
    rr.all_reduce_avg(t, algorithm="ring", wire_dtype=torch.bfloat16, predivide_factor=8.0)
    assert same_bits(t, ring_reference(inputs, "avg", torch.bfloat16, 8.0))
    return True


def test_ring_algorithm_small_tensor():
    run_ranks(4, _ring_only_case, env={"RINGREDUCE_SEGMENT_BYTES": "48"})


# ------------------------------------------------------------------------------------------------
# Exact data: the float64 reference rounded once per division


def _exact_case(rank, n, factor, dtype):
    numel = 1031
    i = torch.arange(numel, dtype=torch.float64)
    vals = [((i * 7 + r * 5) % 17 - 6) * 4 for r in range(n)]  # multiples of 4: x / f exact for f | 4
    t = vals[rank].to(dtype, copy=True)
    s = torch.stack(vals).sum(0)  # exact in every dtype used here
    rr.all_reduce(t, op="sum", predivide_factor=factor)
    assert torch.equal(t, (s / factor * factor).to(dtype)), "SUM with a predivide factor"
    t = vals[rank].to(dtype, copy=True)
    rr.all_reduce_avg(t, predivide_factor=factor)
    # (sum of x / f) / (n / f), each division rounded once: the f64 value rounded to the dtype
    want = ((s / factor) / (n / factor)).to(dtype)
    assert torch.equal(t, want), f"AVG with predivide_factor={factor} ({dtype})"
    t = vals[rank].to(dtype, copy=True)
    rr.all_reduce_avg(t)
    assert torch.equal(t, want), "the factor changed the result"
    return True


@pytest.mark.parametrize("factor", [2.0, 4.0, 0.5])
def test_predivide_exact_data(factor):
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        run_ranks(3, _exact_case, factor, dtype)


def _exact_wire_case(rank, n, wire):
    # Integers whose partial sums stay below 256: exact in bfloat16 and float16, so the 16-bit wire
    # changes nothing.
    i = torch.arange(4099)
    vals = [((i * 7 + r * 5) % 17 - 6).float() for r in range(n)]
    t = vals[rank].clone()
    rr.all_reduce(t, op="sum", wire_dtype=WIRES[wire], algorithm="ring")
    assert torch.equal(t, torch.stack(vals).sum(0))
    t = vals[rank].clone()
    rr.all_reduce_avg(t, wire_dtype=WIRES[wire])
    assert torch.equal(t, (torch.stack(vals).double().sum(0) / n).float())
    return True


@pytest.mark.parametrize("wire", sorted(WIRES))
def test_wire_exact_data(wire):
    run_ranks(4, _exact_wire_case, wire, env={"RINGREDUCE_SEGMENT_BYTES": "256"})


# ------------------------------------------------------------------------------------------------
# Errors: before anything runs, on every rank alike


def _expect(fn, exc_type, *needles):
    try:
        fn()
    except exc_type as exc:
        msg = str(exc)
        for needle in needles:
            assert needle in msg, f"{needle!r} not in {msg!r}"
        return msg
    raise AssertionError(f"expected {exc_type.__name__} ({needles})")


BAD_CALLS = [
    # (tensor dtype, keywords, op, exception, words of the message)
    (torch.float32, {"wire_dtype": torch.float32}, "avg", ValueError, "bfloat16 or torch.float16"),
    (torch.float32, {"wire_dtype": "bf16"}, "avg", TypeError, "wire_dtype must be"),
    (torch.int32, {"wire_dtype": torch.bfloat16}, "sum", TypeError, "needs a float32 tensor"),
    (torch.bfloat16, {"wire_dtype": torch.bfloat16}, "avg", ValueError, "narrower than the tensor"),
    (torch.float16, {"wire_dtype": torch.bfloat16}, "sum", ValueError, "float32 tensors only"),
    (torch.float64, {"wire_dtype": torch.float16}, "avg", ValueError, "float32 tensors only"),
    (torch.float32, {"wire_dtype": torch.bfloat16}, "max", ValueError, "SUM and AVG"),
    (torch.float32, {"predivide_factor": 0}, "avg", ValueError, "> 0"),
    (torch.float32, {"predivide_factor": -2.0}, "sum", ValueError, "> 0"),
    (torch.float32, {"predivide_factor": float("nan")}, "avg", ValueError, "finite"),
    (torch.float32, {"predivide_factor": float("inf")}, "avg", ValueError, "finite"),
    (torch.float32, {"predivide_factor": "2"}, "avg", TypeError, "a number"),
    (torch.float32, {"predivide_factor": True}, "avg", TypeError, "a number"),
    (torch.float32, {"predivide_factor": 2.0}, "product", ValueError, "SUM and AVG"),
    (torch.float32, {"predivide_factor": 2.0}, "min", ValueError, "SUM and AVG"),
    (torch.int64, {"predivide_factor": 2.0}, "sum", TypeError, "floating-point"),
]


def _bad_calls(rank, n):
    for dtype, kwargs, op, exc, words in BAD_CALLS:
        t = (torch.arange(10) + rank).to(dtype)
        before = t.clone()
        _expect(lambda t=t, kwargs=kwargs, op=op: rr.all_reduce(t, op=op, **kwargs), exc, words)
        assert torch.equal(t, before), f"{kwargs} modified the tensor"
    # the group is fine afterwards
    t = torch.full((10,), float(rank))
    rr.all_reduce_avg(t, wire_dtype=torch.bfloat16)
    assert torch.equal(t, torch.full((10,), (n - 1) / 2))
    return True


def test_bad_arguments_raise_on_every_rank():
    run_ranks(3, _bad_calls)


def _one_rank_refuses(rank, n):
    t = torch.ones(1000)
    if rank == 1:
        _expect(lambda: rr.all_reduce_avg(t, wire_dtype=torch.float64), ValueError, "bfloat16")
    else:
        _expect(lambda: rr.all_reduce_avg(t, wire_dtype=torch.bfloat16), RuntimeError,
                "rank 1: all_reduce_avg refused locally")
    assert torch.equal(t, torch.ones(1000))
    return True


def test_a_refusing_rank_makes_every_rank_raise():
    run_ranks(3, _one_rank_refuses)


def _disagree(rank, n, numel):
    t = torch.ones(numel)
    # one rank with a 16-bit wire, the others without: every rank raises, no tensor changes
    wire = torch.bfloat16 if rank == 0 else None
    _expect(lambda: rr.all_reduce_avg(t, wire_dtype=wire), RuntimeError, "wire_dtype", "rank 0")
    factor = 2.0 if rank == n - 1 else None
    _expect(lambda: rr.all_reduce(t, op="sum", predivide_factor=factor), RuntimeError, "predivide_factor")
    factor = 2.0 if rank == 0 else 4.0
    _expect(lambda: rr.all_reduce_avg(t, predivide_factor=factor), RuntimeError, "predivide_factor")
    assert torch.equal(t, torch.ones(numel))
    rr.all_reduce(t, op="sum", wire_dtype=torch.float16, predivide_factor=2.0)  # agreed: fine
    assert torch.equal(t, torch.full((numel,), float(n)))
    return True


@pytest.mark.parametrize("numel", [16, 100_000])
def test_ranks_disagreeing_on_wire_or_factor_all_raise(numel):
    run_ranks(3, _disagree, numel)


# ------------------------------------------------------------------------------------------------
# Accuracy against DDP's 16-bit compress hooks (cast to 16 bits, divide, all-reduce in 16 bits)


def _error_vs_compress_hook(rank, n, numel, wire_name):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    wire = WIRES[wire_name]
    hook = default_hooks.bf16_compress_hook if wire == torch.bfloat16 else default_hooks.fp16_compress_hook
    # Gradient-like data: normal values, a different scale per rank.
    inputs = random_inputs(n, numel, 1234 + n)
    ref = torch.stack([t.double() for t in inputs]).mean(0)
    ours = inputs[rank].clone()
    rr.all_reduce_avg(ours, wire_dtype=wire)
    theirs = inputs[rank].clone()
    hook(None, (theirs,)).wait()  # DDP's hook on a bucket tuple, over gloo

    def rel(x):
        return float((x.double() - ref).norm() / ref.norm())

    assert all(same_bits(x, ours) for x in gather(ours)), "16-bit wire results differ between ranks"
    return rel(ours), rel(theirs)


# (ranks, elements): 16 Mi elements at one world size, smaller ones elsewhere (CI time).
ACCURACY_CASES = [(2, 16 << 20), (2, 4099), (3, 1 << 20), (3, 65537), (4, 1 << 20), (4, 333)]
# Ours must be at most this fraction of the compress hook's relative error (measured about 0.5x:
# docs/performance.md).
ACCURACY_MARGIN = 0.8


# the large cases over shm only (CI time); the small ones over both
@place_cases("n,numel", ACCURACY_CASES, tcp=[(n, m) for n, m in ACCURACY_CASES if m <= 100_000],
                 ids=lambda c: f"{c[0]}ranks-{c[1]}")
def test_error_below_ddp_bf16_compress_hook(n, numel):
    errors = run_ranks(n, _error_vs_compress_hook, numel, "bf16", timeout=600)
    ours, theirs = errors[0]
    assert ours <= ACCURACY_MARGIN * theirs, f"relative error {ours:.3e} vs bf16_compress_hook {theirs:.3e}"


def test_error_below_ddp_fp16_compress_hook():
    ours, theirs = run_ranks(3, _error_vs_compress_hook, 100_003, "fp16")[0]
    assert ours <= ACCURACY_MARGIN * theirs, f"relative error {ours:.3e} vs fp16_compress_hook {theirs:.3e}"


# ------------------------------------------------------------------------------------------------
# The hierarchical all-reduce (simulated nodes): a predivide factor divides in the node rings and
# scales once in the cross-node ring; a 16-bit wire (also with algorithm="auto", which picks the
# hierarchy) rounds on the cross-node ring only (Note [Hierarchical 16-bit wire] in
# csrc/core/collectives.cpp).


def hierarchical_reference(inputs: list[torch.Tensor], local: int, op: str, wire: torch.dtype | None,
                           factor: float | None = None) -> torch.Tensor:
    """What the hierarchical all-reduce computes from `inputs` (nodes of `local` = 2 consecutive
    ranks): each node ring sums its two ranks' values in float32 (each entering divided by `factor`;
    two values sum alike in either order), then within every node chunk the cross-node ring runs the
    flat ring's arithmetic (ring_reference: its first hop rounded to `wire`) on the node sums, and
    AVG divides by n / factor (SUM multiplies by `factor`)."""
    from refdata import chunk_bounds

    assert local == 2, "the node ring's order of more than two values is not modelled here"
    n = len(inputs)
    f = torch.tensor(factor, dtype=torch.float32) if factor else None
    entered = [x / f if f is not None else x for x in inputs]
    out = torch.empty_like(inputs[0])
    for b, e in chunk_bounds(local, inputs[0].numel()):
        if b >= e:
            continue
        sums = [entered[k * local][b:e] + entered[k * local + 1][b:e] for k in range(n // local)]
        p = ring_reference(sums, "sum", wire)
        if op == "avg":
            p = p / torch.tensor(float(n) / (factor or 1.0), dtype=torch.float32)
        elif f is not None:
            p = p * f
        out[b:e] = p
    return out


def _hierarchical(rank, n):
    import os

    os.environ["RINGREDUCE_LOCAL_SIZE"] = "2"
    rr.reload_knobs()  # the rings read their knobs again (ringreduce/_config.py)
    try:
        i = torch.arange(999, dtype=torch.float32)
        vals = [((i * 7 + r * 5) % 17 - 6) * 4 for r in range(n)]
        plain = vals[rank].clone()
        rr.all_reduce_avg(plain, algorithm="hierarchical")
        for f in (2.0, 0.5):
            t = vals[rank].clone()
            rr.all_reduce_avg(t, algorithm="hierarchical", predivide_factor=f)
            assert torch.equal(t, plain), f"hierarchical AVG with predivide_factor={f}"
            t = vals[rank].clone()
            rr.all_reduce(t, op="sum", algorithm="hierarchical", predivide_factor=f)
            assert torch.equal(t, torch.stack(vals).sum(0)), f"hierarchical SUM with predivide_factor={f}"
        # exact data: every node sum and total is exact in bfloat16, so the wire changes nothing
        for algo in ("hierarchical", "auto"):
            for op in ("avg", "sum"):
                t = vals[rank].clone()
                if op == "avg":
                    rr.all_reduce_avg(t, algorithm=algo, wire_dtype=torch.bfloat16)
                else:
                    rr.all_reduce(t, op="sum", algorithm=algo, wire_dtype=torch.bfloat16)
                want = plain if op == "avg" else torch.stack(vals).sum(0)
                assert torch.equal(t, want), f"hierarchical {op} with a bf16 wire ({algo})"
                assert all(same_bits(x, t) for x in gather(t)), "ranks differ"
        # random data: bitwise the hierarchical reference, the same bits on every rank
        for numel, wire, op, factor in ((5000, torch.bfloat16, "avg", None), (300_007, torch.float16, "sum", 2.0),
                                        (3, torch.bfloat16, "avg", None)):
            inputs = random_inputs(n, numel, 9)
            for algo in ("hierarchical", "auto"):
                t = inputs[rank].clone()
                if op == "avg":
                    rr.all_reduce_avg(t, algorithm=algo, wire_dtype=wire, predivide_factor=factor)
                else:
                    rr.all_reduce(t, op="sum", algorithm=algo, wire_dtype=wire, predivide_factor=factor)
                want = hierarchical_reference(inputs, 2, op, wire, factor)
                assert same_bits(t, want), (numel, algo, int((t != want).sum()))
                assert all(same_bits(x, t) for x in gather(t)), "ranks differ"
            flat = ring_reference(inputs, op, wire, factor)
            assert numel < 10 or not same_bits(want, flat)  # the reference tells the two apart
    finally:
        del os.environ["RINGREDUCE_LOCAL_SIZE"]
        rr.reload_knobs()  # the rings read their knobs again (ringreduce/_config.py)
    return True


def test_hierarchical_predivide_and_auto_wire():
    # the float32 all-gather (RINGREDUCE_WIRE_GATHER=auto would pick 16 bits across simulated nodes)
    run_ranks(4, _hierarchical, env={"RINGREDUCE_WIRE_GATHER": "32"})


# ------------------------------------------------------------------------------------------------
# A 16-bit all-gather (RINGREDUCE_WIRE_GATHER=16; Note [16-bit all-gather] in csrc/core/plan.h): the
# owner rounds its finished shard (after AVG's division) once to the wire type and the all-gather
# moves those 16 bits. The result is the float32 all-gather's result rounded once to the wire type,
# the same bits on every rank.


def round_to(x: torch.Tensor, wire: torch.dtype) -> torch.Tensor:
    return x.to(wire).float()


def _gather16_exact(rank, n):
    # Small integers (every partial sum exact in 16 bits), plus on each chunk's owner, whose value
    # enters last and in float32, a fraction of 2^-12 that 16 bits cannot hold next to the integer:
    # the float64 reference rounded to float32 (AVG's division) and once more to the wire type (the
    # owner's rounding).
    from refdata import chunk_bounds

    numel = 4099
    i = torch.arange(numel, dtype=torch.float64)
    vals = [(i * 7 + r * 5) % 17 - 6 for r in range(n)]
    for c, (b, e) in enumerate(chunk_bounds(n, numel)):
        vals[(c - 1) % n][b:e] += (i[b:e] % 7 + 1) * 2.0**-12  # rank c - 1 owns chunk c
    s = torch.stack(vals).sum(0)
    for wire in WIRES.values():
        for algo in ("ring", "auto"):
            t = vals[rank].float()
            rr.all_reduce_avg(t, wire_dtype=wire, algorithm=algo)
            want = round_to((s / n).float(), wire)
            assert torch.equal(t, want), (wire, algo, int((t != want).sum()))
            assert not torch.equal(want, (s / n).float()), "the data must tell the two widths apart"
            assert all(same_bits(x, t) for x in gather(t)), "ranks differ"
            t = vals[rank].float()
            rr.all_reduce(t, op="sum", wire_dtype=wire, algorithm=algo, predivide_factor=2.0)
            assert torch.equal(t, round_to(s.float(), wire)), (wire, algo, "SUM")
    # without wire_dtype the knob changes nothing
    t = vals[rank].float()
    rr.all_reduce_avg(t)
    assert torch.equal(t, (s / n).float())
    return True


@pytest.mark.parametrize("n", [2, 3, 4])
def test_sixteen_bit_all_gather_exact_data(n):
    run_ranks(n, _gather16_exact, env={"RINGREDUCE_WIRE_GATHER": "16", "RINGREDUCE_SEGMENT_BYTES": "256"})


def _gather16_random(rank, n, numel, seed, op, wire, factor):
    inputs = random_inputs(n, numel, seed)
    wire_dtype = WIRES[wire]
    t = inputs[rank].clone()
    if op == "avg":
        rr.all_reduce_avg(t, wire_dtype=wire_dtype, predivide_factor=factor)
    else:
        rr.all_reduce(t, op="sum", wire_dtype=wire_dtype, predivide_factor=factor)
    want = round_to(ring_reference(inputs, op, wire_dtype, factor), wire_dtype)
    assert same_bits(t, want), (
        f"n={n} numel={numel} op={op} wire={wire}: {int((t != want).sum())} elements differ, "
        f"first {t[t != want][:4]} vs {want[t != want][:4]}"
    )
    assert all(same_bits(x, t) for x in gather(t)), "ranks differ"
    return True


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("segment", ["64", "default"])
def test_sixteen_bit_all_gather_random_data(n, segment):
    # one-shot (small), the ring (plan), and in shared memory the direct reduction and the ring in the
    # segment (1.3 M elements): the same arithmetic and rounding everywhere
    env = {"RINGREDUCE_WIRE_GATHER": "16"}
    if segment != "default":
        env["RINGREDUCE_SEGMENT_BYTES"] = segment
    cases = [(5, "sum", "fp16", 4.0), (1009, "avg", "bf16", None), (40_000, "avg", "fp16", 2.0),
             (1_300_001, "sum", "bf16", None)]
    for i, (numel, op, wire, factor) in enumerate(cases):
        if segment == "64" and numel > 50_000:
            continue
        run_ranks(n, _gather16_random, numel, 31 * i + n, op, wire, factor, env=env)


def _gather16_hierarchical(rank, n):
    import os

    os.environ["RINGREDUCE_LOCAL_SIZE"] = "2"
    rr.reload_knobs()  # the rings read their knobs again (ringreduce/_config.py)
    try:
        i = torch.arange(999, dtype=torch.float64)
        vals = [(i * 7 + r * 5) % 17 - 6 for r in range(n)]
        s = torch.stack(vals).sum(0)
        for algo in ("hierarchical", "auto"):
            # exact data: node sums and totals exact in 16 bits; the owner's rounding of the average
            t = vals[rank].float()
            rr.all_reduce_avg(t, algorithm=algo, wire_dtype=torch.bfloat16)
            assert torch.equal(t, round_to((s / n).float(), torch.bfloat16)), algo
            for numel, wire, op, factor in ((5000, torch.bfloat16, "avg", None), (300_007, torch.float16, "sum", 2.0),
                                            (3, torch.bfloat16, "avg", None)):
                inputs = random_inputs(n, numel, 9)
                t = inputs[rank].clone()
                if op == "avg":
                    rr.all_reduce_avg(t, algorithm=algo, wire_dtype=wire, predivide_factor=factor)
                else:
                    rr.all_reduce(t, op="sum", algorithm=algo, wire_dtype=wire, predivide_factor=factor)
                want = round_to(hierarchical_reference(inputs, 2, op, wire, factor), wire)
                assert same_bits(t, want), (numel, algo, int((t != want).sum()))
                assert all(same_bits(x, t) for x in gather(t)), "ranks differ"
        # RINGREDUCE_WIRE_GATHER=32 on the same data: the float32 all-gather's result, unrounded
        os.environ["RINGREDUCE_WIRE_GATHER"] = "32"
        rr.reload_knobs()  # the rings read their knobs again (ringreduce/_config.py)
        t = vals[rank].float()
        rr.all_reduce_avg(t, algorithm="hierarchical", wire_dtype=torch.bfloat16)
        assert torch.equal(t, (s / n).float())
    finally:
        del os.environ["RINGREDUCE_LOCAL_SIZE"]
        os.environ.pop("RINGREDUCE_WIRE_GATHER", None)
        rr.reload_knobs()  # the rings read their knobs again (ringreduce/_config.py)
    return True


@pytest.mark.parametrize("knob", ["16", "auto"])
def test_sixteen_bit_all_gather_hierarchical(knob):
    # "auto" picks 16 bits where the ring spans nodes (here: simulated ones)
    run_ranks(4, _gather16_hierarchical, env={"RINGREDUCE_WIRE_GATHER": knob})


def _gather16_error(rank, n, numel):
    import os

    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    inputs = random_inputs(n, numel, 4321 + n)
    ref = torch.stack([t.double() for t in inputs]).mean(0)
    ours = inputs[rank].clone()
    os.environ["RINGREDUCE_WIRE_GATHER"] = "16"
    rr.reload_knobs()  # the rings read their knobs again (ringreduce/_config.py)
    try:
        rr.all_reduce_avg(ours, wire_dtype=torch.bfloat16)
    finally:
        del os.environ["RINGREDUCE_WIRE_GATHER"]
        rr.reload_knobs()  # the rings read their knobs again (ringreduce/_config.py)
    theirs = inputs[rank].clone()
    default_hooks.bf16_compress_hook(None, (theirs,)).wait()
    assert all(same_bits(x, ours) for x in gather(ours)), "ranks differ"

    def rel(x):
        return float((x.double() - ref).norm() / ref.norm())

    return rel(ours), rel(theirs)


@pytest.mark.parametrize("n,numel", [(2, 1 << 20), (3, 65537), (4, 1 << 20)])
def test_sixteen_bit_all_gather_error_no_larger_than_bf16_hook(n, numel):
    ours, theirs = run_ranks(n, _gather16_error, numel, timeout=600)[0]
    assert ours <= theirs, f"relative error {ours:.3e} vs bf16_compress_hook {theirs:.3e}"


def _gather16_bytes(rank, n, local):
    import os

    from ringreduce._native import C

    pg = dist.group.WORLD
    numel = 1 << 20  # S = 4 MiB, n equal chunks
    if local:
        os.environ["RINGREDUCE_LOCAL_SIZE"] = str(local)
        rr.reload_knobs()  # the rings read their knobs again (ringreduce/_config.py)
    sent = {}
    try:
        for width in ("32", "16"):
            os.environ["RINGREDUCE_WIRE_GATHER"] = width
            rr.reload_knobs()  # the rings read their knobs again (ringreduce/_config.py)
            t = torch.full((numel,), float(rank))
            C.bytes_sent(pg, True)
            rr.all_reduce_avg(t, wire_dtype=torch.bfloat16)
            sent[width] = sum(C.bytes_sent(pg, True))
            assert torch.equal(t, torch.full((numel,), (n - 1) / 2)), width
    finally:
        os.environ.pop("RINGREDUCE_WIRE_GATHER", None)
        os.environ.pop("RINGREDUCE_LOCAL_SIZE", None)
        rr.reload_knobs()  # the rings read their knobs again (ringreduce/_config.py)
    return sent


# the transport is part of each case: the gloo bytes of flat rings, and of the cross-node ring when
# the node rings run in shared memory
@pytest.mark.parametrize("place,n,local", [("tcp", 2, 0), ("tcp", 4, 0), ("shm", 4, 2)], indirect=["place"])
def test_sixteen_bit_all_gather_halves_the_bytes(n, local, place):
    # Payload bytes each rank sends: the flat ring's (n - 1) / n x S per half, 16-bit partials in the
    # reduce-scatter and float32 (32) or 16 bits (16) in the all-gather; on 2 simulated nodes x 2 in
    # shared memory only the cross-node ring uses gloo: (M - 1) / M x S / L per half.
    S = 4 << 20
    per_half = S * (n - 1) // n if not local else S // 2 // local
    for rank, sent in enumerate(run_ranks(n, _gather16_bytes, local, transport=place)):
        assert sent == {"32": per_half // 2 + per_half, "16": per_half}, (rank, sent)


def _gather16_refusals(rank, n):
    import os

    t = torch.ones(100)
    os.environ["RINGREDUCE_WIRE_GATHER"] = "8"
    # a bad knob raises where the rings read it: at reload_knobs() and at the next call
    _expect(rr.reload_knobs, ValueError, "RINGREDUCE_WIRE_GATHER")
    try:
        _expect(lambda: rr.all_reduce_avg(t, wire_dtype=torch.bfloat16), ValueError, "RINGREDUCE_WIRE_GATHER")
    finally:
        del os.environ["RINGREDUCE_WIRE_GATHER"]
        rr.reload_knobs()  # the rings read their knobs again (ringreduce/_config.py)
    # ranks that disagree on the width: every rank raises, naming it, and no tensor changes
    os.environ["RINGREDUCE_WIRE_GATHER"] = "16" if rank == 0 else "32"
    rr.reload_knobs()  # the rings read their knobs again (ringreduce/_config.py)
    try:
        _expect(lambda: rr.all_reduce_avg(t, wire_dtype=torch.bfloat16), RuntimeError, "RINGREDUCE_WIRE_GATHER",
                "wire_gather=16")
    finally:
        del os.environ["RINGREDUCE_WIRE_GATHER"]
        rr.reload_knobs()  # the rings read their knobs again (ringreduce/_config.py)
    assert torch.equal(t, torch.ones(100))
    rr.all_reduce_avg(t, wire_dtype=torch.bfloat16)  # the group is fine afterwards
    assert torch.equal(t, torch.ones(100))
    return True


def test_sixteen_bit_all_gather_refusals():
    run_ranks(3, _gather16_refusals)


def _backend_wire_gather(rank, n):
    import os

    g16 = dist.new_group(backend="ringreduce",
                         pg_options=rr.BackendOptions(wire_dtype=torch.bfloat16, wire_gather=16))
    g32 = dist.new_group(backend="ringreduce",
                         pg_options=rr.BackendOptions(wire_dtype=torch.bfloat16, wire_gather=32))
    inputs = random_inputs(n, 5000, 3)
    want32 = ring_reference(inputs, "avg", torch.bfloat16)
    os.environ["RINGREDUCE_WIRE_GATHER"] = "32"  # the group's option wins over the knob
    rr.reload_knobs()  # the rings read their knobs again (ringreduce/_config.py)
    try:
        x = inputs[rank].clone()
        dist.all_reduce(x, op=dist.ReduceOp.AVG, group=g16)
        assert same_bits(x, round_to(want32, torch.bfloat16)), "BackendOptions(wire_gather=16)"
        os.environ["RINGREDUCE_WIRE_GATHER"] = "16"
        rr.reload_knobs()  # the rings read their knobs again (ringreduce/_config.py)
        x = inputs[rank].clone()
        dist.all_reduce(x, op=dist.ReduceOp.AVG, group=g32)
        assert same_bits(x, want32), "BackendOptions(wire_gather=32)"
    finally:
        del os.environ["RINGREDUCE_WIRE_GATHER"]
        rr.reload_knobs()  # the rings read their knobs again (ringreduce/_config.py)
    dist.destroy_process_group(g16)
    dist.destroy_process_group(g32)
    return True


def test_backend_options_wire_gather():
    run_ranks(3, _backend_wire_gather)


@SHM_ONLY  # Python only, no ranks
def test_sixteen_bit_all_gather_refused_on_gpus_and_bad_backend_options():
    from types import SimpleNamespace

    from ringreduce import _config
    from ringreduce._call import wire_gather_setting
    from ringreduce._rings.cuda import CudaRing
    from ringreduce._types import ReduceOp

    fake_cuda = SimpleNamespace(is_floating_point=lambda: True, is_complex=lambda: False, dtype=torch.float32,
                                is_cuda=True, device=torch.device("cuda", 0))
    _, exc, wire, _ = scaling_refusal(fake_cuda, ReduceOp.AVG, torch.bfloat16, None)
    assert exc is None and wire == rr._C.DType.BFLOAT16  # the device decides the rest: its ring's option_refusal
    gpu = CudaRing.__new__(CudaRing)  # its refusals need no communicator
    exc = gpu.option_refusal("auto", "16")
    assert isinstance(exc, ValueError) and "CPU rings only" in str(exc)
    assert gpu.option_refusal("auto", "auto") is None  # "auto" means 32 bits on GPUs
    knobs = _config.read()
    for bad in (8, True, "16"):
        with pytest.raises(ValueError, match="wire_gather"):
            rr.BackendOptions(wire_gather=bad)
        with pytest.raises(ValueError, match="wire_gather"):
            wire_gather_setting(bad, knobs)
    assert rr.BackendOptions(wire_gather=16).wire_gather == 16
