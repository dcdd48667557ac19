"""Hypothesis fuzzing of ringreduce.all_reduce against exact float64 references and torch.distributed.

Each example is a short batch of cases drawn in the parent (deterministic: ``derandomize=True``) and
run as ONE job on the persistent pool of the world size, so every rank sees the same list. A case
draws dtype, op, shape (0-d, empty dims, up to 4-D, or a long 1-D tensor), a memory layout per rank
(contiguous, transposed, permuted, stepped slice, storage offset, channels_last: ranks may differ),
the segment size (16 B .. 1 MiB, ``RINGREDUCE_SEGMENT_BYTES``), the number of staging slots,
``accum_dtype`` for half types and sync/async. Checked per case:

* exact, position-dependent data (refdata.exact_input) reduced bitwise equal to the float64 /
  wrapping-int64 reference built from an all_gather of the inputs;
* memory of the base tensor outside the view's elements untouched;
* bitwise agreement of the result across ranks;
* float32/float64 SUM/MAX/MIN/AVG on random data: equal to ``torch.distributed.all_reduce`` (gloo, on a
  contiguous copy) within the dtype's tolerance (MAX/MIN exactly).

The rank function reports failures as strings (it never raises for a wrong value), so the pool
stays usable while hypothesis shrinks a failing batch.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, Phase, example, given, note, settings
from hypothesis import strategies as st
from ranks import CPU_PLACES, run_ranks
from refdata import ALL_TYPES, OPS, bits_equal, exact_input, gather_inputs, reference, same_on_all_ranks, supported

import ringreduce as rr

PLACES = CPU_PLACES  # conftest.py: every test at each place (Note [Places] in ranks.py)

DTYPE_NAMES = [str(d).replace("torch.", "") for d in ALL_TYPES]
LAYOUTS = ["contiguous", "transpose", "permute", "step", "offset", "channels_last"]
MAX_SEGMENTS_PER_CHUNK = 48  # keeps tiny-segment cases on big tensors from dominating the run time
SEGMENT_CHOICES = [16, 32, 48, 64, 128, 512, 4096, 65536, 1 << 20]

# ---------------------------------------------------------------------------------------------
# Strategies (parent side)


@st.composite
def layout_specs(draw):
    return (draw(st.sampled_from(LAYOUTS)), draw(st.integers(0, 7)), draw(st.integers(0, 7)))


@st.composite
def fuzz_cases(draw):
    dname = draw(st.sampled_from(DTYPE_NAMES))
    dtype = getattr(torch, dname)
    op = draw(st.sampled_from([o for o in OPS if supported(dtype, o)]))
    if draw(st.integers(0, 7)) == 0:
        shape = [draw(st.integers(1000, 150_000))]  # long 1-D: uneven chunks, many segments
    else:
        shape = draw(st.lists(st.integers(0, 9), min_size=0, max_size=4))
    if draw(st.integers(0, 5)) == 0 and len(shape) < 4:
        shape = shape + [draw(st.integers(1, 3))] * (4 - len(shape))  # make channels_last possible
    seg = draw(st.one_of(st.sampled_from(SEGMENT_CHOICES), st.integers(16, 1 << 20)))
    case = {
        "dtype": dname,
        "op": op,
        "shape": shape,
        "layouts": draw(st.lists(layout_specs(), min_size=4, max_size=4)),  # one per rank (<= 4 ranks)
        "segment_bytes": seg,
        "slots": draw(st.integers(1, 5)),
        "accum_f32": dtype in (torch.float16, torch.bfloat16) and draw(st.booleans()),
        "async": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**31 - 1)),
    }
    return case


def _bound_segments(case: dict, ws: int) -> dict:
    """Raises the segment size where it would cut one chunk into too many segments (run time only)."""
    numel = math.prod(case["shape"])
    esize = torch.empty(0, dtype=getattr(torch, case["dtype"])).element_size()
    chunk_bytes = -(-numel * esize // ws)
    floor = -(-chunk_bytes // MAX_SEGMENTS_PER_CHUNK)
    if case["segment_bytes"] < floor:
        case = dict(case, segment_bytes=max(16, floor))
    return case


# ---------------------------------------------------------------------------------------------
# Rank side


SENTINEL = {torch.bool: True}


def _make_view(x: torch.Tensor, spec: tuple) -> tuple[torch.Tensor, torch.Tensor, str]:
    """A tensor with x's logical values in another memory layout; also its base (whole storage)."""
    kind, a, b = spec
    nd = x.dim()
    if kind == "transpose" and nd >= 2:
        d0, d1 = a % nd, b % nd
        if d0 == d1:
            d1 = (d0 + 1) % nd
        base = x.transpose(d0, d1).contiguous()
        return base.transpose(d0, d1), base, f"transpose({d0},{d1})"
    if kind == "permute" and nd >= 2:
        perm = list(range(nd))
        g = torch.Generator().manual_seed(a * 8 + b)
        perm = torch.randperm(nd, generator=g).tolist()
        inv = [perm.index(i) for i in range(nd)]
        base = x.permute(perm).contiguous()
        return base.permute(inv), base, f"permute{perm}"
    if kind == "channels_last" and nd == 4:
        v = x.contiguous(memory_format=torch.channels_last)
        return v, v, "channels_last"
    sentinel = SENTINEL.get(x.dtype, 77)
    if kind == "step" and nd >= 1:
        d = a % nd
        step = 2 + b % 3
        start = b % step
        big = list(x.shape)
        big[d] = x.shape[d] * step + start
        base = torch.full(big, sentinel, dtype=x.dtype)
        v = base.narrow(d, start, big[d] - start)[(slice(None),) * d + (slice(None, None, step),)]
        v = v.narrow(d, 0, x.shape[d])
        v.copy_(x)
        return v, base, f"step(dim={d},step={step},start={start})"
    if kind == "offset":
        off = 1 + a * 3 + b
        n = x.numel()
        base = torch.full((off + n + 5,), sentinel, dtype=x.dtype)
        v = base[off:off + n].view(x.shape)
        v.copy_(x)
        return v, base, f"offset({off})"
    v = x.clone()
    return v, v, "contiguous"


def _outside_mask(v: torch.Tensor, base: torch.Tensor) -> torch.Tensor | None:
    """Flat mask of base's elements that v does not cover (None when v covers all of base)."""
    if base.numel() == v.numel():
        return None
    cover = torch.zeros(base.numel(), dtype=torch.bool)
    torch.as_strided(cover, v.shape, v.stride(), v.storage_offset() - base.storage_offset()).fill_(True)
    return ~cover


def _call(v: torch.Tensor, case: dict) -> None:
    accum = torch.float32 if case["accum_f32"] else None
    if case["async"]:
        w = rr.all_reduce(v, op=case["op"], async_op=True, accum_dtype=accum)
        if case["seed"] % 2:
            assert w.wait() is True
        else:
            got = w.get_future().wait()
            assert isinstance(got, list) and got[0] is v, "future value is not [tensor]"
    else:
        assert rr.all_reduce(v, op=case["op"], accum_dtype=accum) is None


_TORCH_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
              "avg": dist.ReduceOp.SUM}


def _dense(t: torch.Tensor) -> torch.Tensor:
    """A fresh row-major copy. (t.contiguous() may return t itself with a size-1 dim of stride != 1,
    which refdata.bits_equal's byte view rejects.)"""
    return torch.empty(t.shape, dtype=t.dtype).copy_(t)


def _local(what: str, check) -> list[str]:
    """Runs a purely local check; an exception becomes a failure, so the ranks stay in step."""
    try:
        msg = check()
    except Exception as exc:  # noqa: BLE001
        return [f"{what}: check raised {type(exc).__name__}: {exc}"]
    return [f"{what}: {msg}"] if msg else []


def _one_case(rank: int, ws: int, case: dict) -> list[str]:
    """One case. Every rank makes the same collective calls in the same order whatever fails locally."""
    failures: list[str] = []
    dtype = getattr(torch, case["dtype"])
    op = case["op"]
    shape = case["shape"]
    numel = math.prod(shape)

    # exact data in this rank's layout
    x = exact_input(numel, rank, dtype, op).reshape(shape)
    v, base, desc = _make_view(x, case["layouts"][rank])
    expected = reference(gather_inputs(x), op)
    before = base.clone()
    mask = _outside_mask(v, base)
    _call(v, case)
    got = _dense(v)

    def wrong_values():
        if bits_equal(got, expected):
            return None
        bad = (got != expected).reshape(-1).nonzero()[:4].flatten().tolist()
        return f"wrong values at flat positions {bad}: got {got.reshape(-1)[bad].tolist()}, " \
               f"expected {expected.reshape(-1)[bad].tolist()}"

    def outside_touched():
        if mask is not None and not bits_equal(base.reshape(-1)[mask], before.reshape(-1)[mask]):
            return "memory outside the view modified"
        return None

    failures += _local(f"exact {desc}", wrong_values)
    failures += _local(f"exact {desc}", outside_touched)
    if not same_on_all_ranks(got):
        failures.append(f"exact {desc}: ranks differ")

    # random data against torch.distributed (gloo) for float32/float64
    if dtype in (torch.float32, torch.float64) and op in _TORCH_OPS:
        g = torch.Generator().manual_seed(case["seed"] * 8 + rank)
        r = (torch.randn(shape, generator=g, dtype=torch.float64) * 10).to(dtype)
        rv, _, rdesc = _make_view(r, case["layouts"][(rank + 1) % 4])
        # The reference's input is taken before the call: a layout may be a view of r itself (a
        # permutation that is the identity), which the call then reduces in place.
        ref = _dense(r)
        _call(rv, case)
        dist.all_reduce(ref, op=_TORCH_OPS[op])
        if op == "avg":
            ref /= ws
        rgot = _dense(rv)

        def vs_torch():
            if op in ("max", "min"):
                return None if torch.equal(rgot, ref) else "differs from dist.all_reduce"
            tol = (1e-5 if dtype == torch.float32 else 1e-12) * ws
            if numel and not torch.allclose(rgot, ref, rtol=tol, atol=tol * 10):
                return f"max err vs dist.all_reduce {(rgot - ref).abs().max().item()}"
            return None

        failures += _local(f"random {op} {rdesc}", vs_torch)
        if not same_on_all_ranks(rgot):
            failures.append(f"random {op} {rdesc}: ranks differ")
    return failures


def _run_batch(rank: int, ws: int, cases: list[dict]) -> list[str]:
    failures = []
    saved = {k: os.environ.get(k) for k in ("RINGREDUCE_SEGMENT_BYTES", "RINGREDUCE_SLOTS")}
    try:
        for i, case in enumerate(cases):
            os.environ["RINGREDUCE_SEGMENT_BYTES"] = str(case["segment_bytes"])
            os.environ["RINGREDUCE_SLOTS"] = str(case["slots"])
            rr.reload_knobs()  # the rings read their knobs again (ringreduce/_config.py)
            try:
                msgs = _one_case(rank, ws, case)
            except Exception as exc:  # noqa: BLE001 - reported, the batch goes on (ranks stay in step)
                msgs = [f"raised {type(exc).__name__}: {exc}"]
            failures += [f"case {i} {case}: {m}" for m in msgs]
    finally:
        for k, val in saved.items():
            if val is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = val
        rr.reload_knobs()  # the rings read their knobs again (ringreduce/_config.py)
    # the group is still healthy after the batch
    t = torch.full((33,), float(rank + 1))
    rr.all_reduce(t)
    if not torch.equal(t, torch.full((33,), float(ws * (ws + 1) // 2))):
        failures.append("WORLD gives wrong values after the batch")
    return failures


# ---------------------------------------------------------------------------------------------
# The test. Without shrinking by default (a failing batch is printed whole; each rerun is a pool job,
# so shrinking takes minutes): RR_FUZZ_SHRINK=1 turns it on when investigating.

# numel 1 < world size, a size-1 dim with stride 4 on rank 2 (is_contiguous() is True), offset on rank 0
EDGE_SIZE1_STRIDED = {"dtype": "int64", "op": "min", "shape": [1], "segment_bytes": 16, "slots": 2,
                      "layouts": [("offset", 7, 0), ("contiguous", 1, 5), ("step", 0, 5), ("contiguous", 3, 2)],
                      "accum_f32": False, "async": False, "seed": 297}
# bf16 AVG with float32 partials, channels_last on some ranks, odd segment size, one slot
EDGE_BF16_ACCUM = {"dtype": "bfloat16", "op": "avg", "shape": [3, 5, 4, 2], "segment_bytes": 48, "slots": 1,
                   "layouts": [("channels_last", 0, 0), ("transpose", 0, 3), ("channels_last", 0, 0),
                               ("step", 2, 1)], "accum_f32": True, "async": True, "seed": 11}


@pytest.mark.parametrize("ws", [2, 3, 4])
@settings(
    max_examples=int(os.environ.get("RR_FUZZ_EXAMPLES", "30")),
    derandomize=True,  # the same examples on every run (CI); RR_FUZZ_EXAMPLES=500 for a longer hunt
    deadline=None,
    database=None,
    print_blob=True,
    phases=[Phase.explicit, Phase.generate] + ([Phase.shrink] if os.environ.get("RR_FUZZ_SHRINK") else []),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(batch=st.lists(fuzz_cases(), min_size=1, max_size=3))
@example(batch=[EDGE_SIZE1_STRIDED, EDGE_BF16_ACCUM])
def test_fuzz_all_reduce_against_references(ws, batch):
    cases = [_bound_segments(c, ws) for c in batch]
    note(f"world size {ws}, cases {cases}")
    results = run_ranks(ws, _run_batch, cases, timeout=120)
    failures = sorted({f"rank {r}: {m}" for r, res in enumerate(results) for m in res})
    assert not failures, "\n".join(failures[:20])


def test_fuzz_catches_a_wrong_result():
    """The checks of _one_case are live: a reduction that is off by one element is reported."""
    res = run_ranks(2, _sabotaged_case)
    assert all(r for r in res), res


def _sabotaged_case(rank: int, ws: int) -> list[str]:
    real = rr.all_reduce

    def off_by_one(t, op="sum", **kw):
        out = real(t, op=op, **kw)
        if t.numel() > 3 and rank == 1:
            t[(1,) * t.dim()] += 1
        return out

    rr.all_reduce = off_by_one
    try:
        case = {"dtype": "float32", "op": "sum", "shape": [5, 7], "layouts": [("transpose", 0, 1)] * 4,
                "segment_bytes": 16, "slots": 2, "accum_f32": False, "async": False, "seed": 3}
        return _one_case(rank, ws, case)
    finally:
        rr.all_reduce = real
