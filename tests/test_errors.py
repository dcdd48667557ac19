"""Bad input, cross-rank disagreement, dead and silent peers: clear exceptions, never a crash or hang."""

from __future__ import annotations

import datetime
import os
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist
from ranks import CPU_PLACES, full_at, run_ranks, spawn_ranks
from ranks import expect_raises as _expect

import ringreduce as rr

PLACES = CPU_PLACES  # conftest.py: every test at each place (Note [Places] in ranks.py)


def every_rank_ok(*args, **kwargs) -> None:
    """run_ranks(*args, **kwargs) of a job returning {check: "ok" or what happened}: every check "ok"
    on every rank."""
    for r in run_ranks(*args, **kwargs):
        bad = {k: v for k, v in r.items() if v != "ok"}
        assert not bad, bad

# ---------------------------------------------------------------------------------------------
# Local refusals: raised before any payload moves; the others are told through the frame


def _local_refusals(rank: int, ws: int) -> dict:
    out = {}
    # every rank: integer AVG -> TypeError, tensor unchanged
    t = torch.arange(10, dtype=torch.int32)
    out["int_avg"] = _expect(lambda: rr.all_reduce_avg(t), TypeError, "AVG", "int32")
    out["int_avg_unchanged"] = "ok" if torch.equal(t, torch.arange(10, dtype=torch.int32)) else "changed"
    b = torch.ones(4, dtype=torch.bool)
    out["bool_avg"] = _expect(lambda: rr.all_reduce(b, op="avg"), TypeError, "AVG", "bool")
    out["complex_max"] = _expect(lambda: rr.all_reduce(torch.ones(3, dtype=torch.complex64), op="max"),
                                 TypeError, "MAX", "complex64")
    out["not_a_tensor"] = _expect(lambda: rr.all_reduce([1.0, 2.0]), TypeError, "torch.Tensor", "list")
    out["unsupported_dtype"] = _expect(lambda: rr.all_reduce(torch.ones(3, dtype=torch.uint16)), TypeError,
                                       "uint16")
    out["sparse"] = _expect(lambda: rr.all_reduce(torch.eye(3).to_sparse()), ValueError, "dense")
    out["bad_op"] = _expect(lambda: rr.all_reduce(torch.ones(3), op="band"), ValueError, "unsupported reduce op")
    # an int would run torch's numbering (2: PRODUCT) though int(rr.ReduceOp.MAX) is 2; op=True ran AVG
    out["int_op"] = _expect(lambda: rr.all_reduce(torch.ones(3), op=int(rr.ReduceOp.MAX)), TypeError,
                            "got a plain integer 2", "ringreduce.ReduceOp(2), MAX")
    out["bool_op"] = _expect(lambda: rr.all_reduce_coalesced([torch.ones(3)], op=True), TypeError, "got a bool True")
    out["bad_accum"] = _expect(lambda: rr.all_reduce(torch.ones(3), accum_dtype=torch.float16), TypeError,
                               "accum_dtype")
    out["bad_algorithm"] = _expect(lambda: rr.all_reduce(torch.ones(3), algorithm="tree"), ValueError, "algorithm")
    out["bad_group"] = _expect(lambda: rr.all_reduce(torch.ones(3), group=3), TypeError, "ProcessGroup")
    # after all that, the group still works
    x = torch.ones(5)
    rr.all_reduce(x)
    out["still_works"] = "ok" if torch.equal(x, torch.full((5,), float(ws))) else f"got {x}"
    return out


@pytest.mark.parametrize("ws", [2, 3])
def test_local_refusals_on_every_rank(ws):
    every_rank_ok(ws, _local_refusals)


def _one_rank_refuses(rank: int, ws: int) -> dict:
    out = {}
    t = torch.arange(6, dtype=torch.int64) if rank == 1 else torch.arange(6, dtype=torch.float32)
    if rank == 1:
        out["avg"] = _expect(lambda: rr.all_reduce_avg(t), TypeError, "AVG")
        out["unchanged"] = "ok" if torch.equal(t, torch.arange(6)) else "changed"
    else:
        # the refusal is all that differs: the others' op, numel and shape agree
        out["avg"] = _expect(lambda: rr.all_reduce_avg(t), RuntimeError, "rank 1: all_reduce_avg refused locally",
                             "[differs: a rank refused the call]")
        out["unchanged"] = "ok" if torch.equal(t, torch.arange(6, dtype=torch.float32)) else "changed"
    # a non-tensor on rank 0 only
    u = torch.ones(3)
    if rank == 0:
        out["nontensor"] = _expect(lambda: rr.all_reduce("grad"), TypeError, "torch.Tensor")
    else:
        out["nontensor"] = _expect(lambda: rr.all_reduce(u), RuntimeError, "rank 0: all_reduce refused locally", "not a tensor",
                                   "[differs: a rank refused the call]")
    x = torch.ones(5)
    rr.all_reduce(x)
    out["still_works"] = "ok" if torch.equal(x, torch.full((5,), float(ws))) else f"got {x}"
    return out


def test_one_rank_refusing_makes_all_raise():
    every_rank_ok(3, _one_rank_refuses)


def _overlapping_views(rank: int, ws: int) -> dict:
    """Written-to tensors whose elements share memory: refused
    before anything moves, on every rank, also once the argument set has a plan (Note [Fast path of a
    repeated call]); legitimate strided views and read-only overlapping inputs still work."""
    from ringreduce import scatter_gather

    out = {}
    share = "share memory"
    warm = torch.ones(8)
    rr.all_reduce(warm)
    rr.all_reduce(warm)  # the default argument set now has a plan, which must not serve the views below
    out["warm"] = "ok" if torch.equal(warm, torch.full((8,), float(ws * ws))) else f"got {warm}"

    def one_rank(name: str, bad_rank: int, make_bad, call=rr.all_reduce, what: str = "all_reduce") -> None:  # noqa: ANN001
        t = make_bad() if rank == bad_rank else torch.arange(20.0).view(5, 4)
        before = t.clone()
        if rank == bad_rank:
            out[name] = _expect(lambda: call(t), ValueError, share, ".clone()", "the other ranks were told")
        else:
            out[name] = _expect(lambda: call(t), RuntimeError, f"rank {bad_rank}: {what} refused locally")
        out[name + "_unchanged"] = "ok" if torch.equal(t, before) else f"changed to {t}"

    one_rank("expand", 0, lambda: torch.ones(1).expand(20).view(5, 4))
    one_rank("expand_row", ws - 1, lambda: torch.arange(4.0).expand(5, 4))
    # an overlapping view: element (i, j) is storage[i + j], 20 elements on 8 floats
    one_rank("as_strided", 1, lambda: torch.arange(10.0).as_strided((5, 4), (1, 1)))
    one_rank("avg", 0, lambda: torch.ones(1).expand(5, 4), rr.all_reduce_avg, "all_reduce_avg")
    # every rank's tensor overlaps: every rank raises ValueError
    t = torch.ones(1).expand(6)
    out["every_rank"] = _expect(lambda: rr.all_reduce(t, op="max"), ValueError, share, "sizes (6,), strides (0,)")
    # coalesced: checked per element
    parts = [torch.ones(1).expand(4) if rank == 0 else torch.ones(4), torch.ones(3)]
    if rank == 0:
        out["coalesced"] = _expect(lambda: rr.all_reduce_coalesced(parts), ValueError, share, "element 0")
    else:
        out["coalesced"] = _expect(lambda: rr.all_reduce_coalesced(parts), RuntimeError, "rank 0: all_reduce_coalesced")
    out["coalesced_unchanged"] = "ok" if all(torch.equal(p, torch.ones(p.shape)) for p in parts) else "changed"
    # reduce_scatter's output is written: refused; its input is only read: an expanded one works
    output = torch.zeros(1).expand(3) if rank == 1 else torch.zeros(3)
    want_msg = (ValueError, share, "`output`") if rank == 1 else (RuntimeError, "rank 1: reduce_scatter refused locally")
    out["rs_output"] = _expect(lambda: scatter_gather.reduce_scatter(output, torch.ones(3 * ws)), *want_msg)
    block = torch.empty(2)
    scatter_gather.reduce_scatter(block, torch.tensor([float(rank + 1)]).expand(2 * ws))
    out["rs_input"] = "ok" if torch.equal(block, torch.full((2,), float(sum(range(1, ws + 1))))) else f"got {block}"
    gathered = scatter_gather.all_gather(torch.tensor([float(rank)]).expand(2))
    want = torch.arange(ws, dtype=torch.float32).repeat_interleave(2)
    out["ag_input"] = "ok" if torch.equal(gathered, want) else f"got {gathered}"
    # the "ringreduce" backend reaches the same refusal
    g = dist.new_group(backend="ringreduce")
    t = torch.ones(1).expand(8) if rank == 0 else torch.ones(8)
    if rank == 0:
        out["backend"] = _expect(lambda: dist.all_reduce(t, group=g), ValueError, share)
    else:
        out["backend"] = _expect(lambda: dist.all_reduce(t, group=g), RuntimeError, "rank 0: all_reduce refused locally")
    gather_out = torch.zeros(1).expand(2 * ws) if rank == 0 else torch.zeros(2 * ws)
    want_msg = (ValueError, share, "all_gather_into_tensor's output") if rank == 0 else (RuntimeError, "rank 0")
    out["backend_gather_output"] = _expect(
        lambda: dist.all_gather_into_tensor(gather_out, torch.ones(2), group=g), *want_msg)
    b = torch.arange(6.0) + rank
    dist.all_reduce(b, group=g)
    out["backend_after"] = "ok" if torch.equal(b, torch.arange(6.0) * ws + sum(range(ws))) else f"got {b}"
    dist.destroy_process_group(g)
    # legitimate views, also on the plan of the default argument set: exact per-element sums
    base = torch.arange(60.0) + rank
    views = {
        "transposed": lambda x: x.view(6, 10).t(),
        "stepped": lambda x: x[::3],
        "sliced": lambda x: x.view(6, 10)[1:5, 2:9],
        "channels_last": lambda x: x.view(1, 3, 4, 5).contiguous(memory_format=torch.channels_last),
        "size1_stride0": lambda x: x.as_strided((4, 1), (1, 0)),  # stride 0 on a dim of size 1
        "gapped_as_strided": lambda x: x.as_strided((4, 3), (7, 2)),  # rows 7 apart, 3 elements 2 apart
        "permuted": lambda x: x.view(3, 4, 5).permute(2, 0, 1),
    }
    for name, view in views.items():
        mine = view(base.clone())
        want = sum(view(torch.arange(60.0) + r) for r in range(ws))
        for _ in range(2):  # the full path, then the plan
            rr.all_reduce(mine)
            if not torch.equal(mine, want):
                out[f"view_{name}"] = f"got {mine.flatten()[:4]}, want {want.flatten()[:4]}"
                break
            want = want * ws
    x = torch.ones(5)
    rr.all_reduce(x)
    out["still_works"] = "ok" if torch.equal(x, torch.full((5,), float(ws))) else f"got {x}"
    return out


@pytest.mark.parametrize("ws", [2, 3])
def test_overlapping_views_are_refused_on_every_rank(ws):
    every_rank_ok(ws, _overlapping_views)


def _refusals_that_crashed_or_stayed_local(rank: int, ws: int) -> dict:
    """These refusals once raised before their frame was sent (or
    returned a meta tensor), so the others' call met the refuser's next one. Each now tells the
    others; the next call then pairs with the next call on every rank and reduces exact data."""
    import ringreduce.functional as F

    out = {}
    bad_rank = ws - 1
    accepted = "('auto', 'ring', 'hierarchical', 'direct')"
    cases = {
        "algorithm_none": (lambda: rr.all_reduce(torch.ones(4), algorithm=None), lambda: rr.all_reduce(torch.ones(4)),
                           TypeError, ("algorithm must be a string", accepted, "NoneType"), "all_reduce"),
        "algorithm_int": (lambda: rr.all_reduce(torch.ones(4), algorithm=5),
                          lambda: rr.all_reduce(torch.ones(4), algorithm="ring"),
                          TypeError, ("algorithm must be a string", accepted, "int 5"), "all_reduce"),
        # a list stands for one call, not one per element
        "algorithm_list": (lambda: rr.all_reduce_avg(torch.ones(4), algorithm=["ring", "ring"]),
                           lambda: rr.all_reduce_avg(torch.ones(4)), TypeError, ("algorithm", "list"), "all_reduce_avg"),
        "algorithm_coalesced": (lambda: rr.all_reduce_coalesced([torch.ones(4)], algorithm=None),
                                lambda: rr.all_reduce_coalesced([torch.ones(4)]), TypeError, ("algorithm",),
                                "all_reduce_coalesced"),
        "F_op_none": (lambda: F.all_reduce(torch.ones(4), op=None), lambda: F.all_reduce(torch.ones(4)),
                      ValueError, ("unsupported reduce op None",), "all_reduce"),
        "op_true": (lambda: rr.all_reduce(torch.ones(4), op=True), lambda: rr.all_reduce(torch.ones(4), op="avg"),
                    TypeError, ("got a bool True",), "all_reduce"),
        "F_op_int": (lambda: F.all_reduce(torch.ones(4), op=2), lambda: F.all_reduce(torch.ones(4), op="max"),
                     TypeError, ("got a plain integer 2",), "all_reduce"),
        "nn_op_int": (lambda: rr.nn.reduce_scatter(torch.ones(2 * ws), op=0), lambda: rr.nn.reduce_scatter(torch.ones(2 * ws)),
                      TypeError, ("got a plain integer 0",), "reduce_scatter"),
        "F_reduce_scatter_op_none": (lambda: F.reduce_scatter(torch.ones(2 * ws), op=None),
                                     lambda: F.reduce_scatter(torch.ones(2 * ws)), ValueError,
                                     ("unsupported reduce op None",), "reduce_scatter"),
        "F_meta": (lambda: F.all_reduce(torch.ones(4, device="meta")), lambda: F.all_reduce(torch.ones(4)),
                   ValueError, ("tensors on meta are not supported",), "all_reduce"),
        "F_avg_meta": (lambda: F.all_reduce_avg(torch.ones(4, device="meta")), lambda: F.all_reduce_avg(torch.ones(4)),
                       ValueError, ("meta",), "all_reduce_avg"),
        "F_gather_meta": (lambda: F.all_gather(torch.ones(2, device="meta")), lambda: F.all_gather(torch.ones(2)),
                          ValueError, ("meta",), "all_gather"),
    }
    for name, (bad, good, exc, needles, kind) in cases.items():
        if rank == bad_rank:
            out[name] = _expect(bad, exc, *needles, "the other ranks were told")
        else:
            out[name] = _expect(good, RuntimeError, f"rank {bad_rank}: {kind} refused locally")
        # the next identical call on every rank is the same call everywhere
        x = torch.arange(7.0) + rank
        rr.all_reduce(x)
        want = torch.arange(7.0) * ws + sum(range(ws))
        out[name + "_next"] = "ok" if torch.equal(x, want) else f"got {x}"
    got = F.all_reduce(torch.full((3,), float(rank)), op="max")
    out["F_after"] = "ok" if torch.equal(got, torch.full((3,), float(ws - 1))) else f"got {got}"
    return out


@pytest.mark.parametrize("ws", [2, 3])
def test_refusals_of_bad_arguments_tell_the_other_ranks(ws):
    every_rank_ok(ws, _refusals_that_crashed_or_stayed_local)


def _predivide_ranges(rank: int, ws: int) -> dict:
    """A predivide factor whose scalings the accumulation type cannot
    hold (1e308 gave NaN) is refused, naming the range; factors at the range's far ends still give the
    exact result (powers of two: every scaling is exact)."""
    out = {}
    refused = {
        "f32_huge": (torch.float32, "sum", 1e308, "in [1.1754943508222875e-38, 8.507059173023462e+37]"),  # 1/f too
        "f32_tiny_avg": (torch.float32, "avg", 1e-308, "float32"),
        "f32_avg_scaling": (torch.float32, "avg", 2.0**127 * 1.9, f"{ws}/predivide_factor"),  # f fits, n / f does not
        "bf16_tiny": (torch.bfloat16, "sum", 2.0**-130, "normal float32 numbers"),
        "c64_huge": (torch.complex64, "avg", 1e39, "float32"),
        "f64_huge_avg": (torch.float64, "avg", 1.7e308, "normal float64 numbers"),  # n / f: subnormal
        "c128_tiny": (torch.complex128, "sum", 1e-310, "float64"),
    }
    for name, (dtype, op, f, needle) in refused.items():
        t = torch.ones(4, dtype=dtype)
        out[name] = _expect(lambda t=t, op=op, f=f: rr.all_reduce(t, op=op, predivide_factor=f), ValueError,
                            f"predivide_factor={f!r} is out of range", needle, "the other ranks were told")
        out[name + "_unchanged"] = "ok" if torch.equal(t, torch.ones(4, dtype=dtype)) else f"changed to {t}"
    parts = [torch.ones(3), torch.ones(2, dtype=torch.float64)]
    out["coalesced"] = _expect(lambda: rr.all_reduce_coalesced(parts, predivide_factor=1e-300), ValueError,
                               "out of range")
    # a factor the float64 buffer takes and the float32 one does not: refused before either ring, naming it
    mixed = [torch.ones(3, dtype=torch.float64), torch.ones(2)]
    out["coalesced_mixed"] = _expect(lambda: rr.all_reduce_coalesced(mixed, predivide_factor=1e300), ValueError,
                                     "out of range for a float32 SUM", "all_reduce_coalesced, element 1")
    out["coalesced_mixed_unchanged"] = "ok" if all(torch.equal(t, torch.ones_like(t)) for t in mixed) else "changed"
    # one rank's factor only: the others are told
    t = torch.ones(4)
    if rank == 0:
        out["one_rank"] = _expect(lambda: rr.all_reduce_avg(t, predivide_factor=1e300), ValueError, "out of range")
    else:
        out["one_rank"] = _expect(lambda: rr.all_reduce_avg(t, predivide_factor=2.0), RuntimeError,
                                  "rank 0: all_reduce_avg refused locally")
    # the far ends of the range: exact results
    x = torch.arange(8.0) + rank
    total = torch.arange(8.0) * ws + sum(range(ws))
    accepted = {
        "f32_sum_2^100": (x.clone(), "sum", 2.0**100, total),
        "f32_avg_2^-100": (x.clone(), "avg", 2.0**-100, total / ws),
        "f32_sum_2^-126": (x / 64, "sum", 2.0**-126, total / 64),  # contributions x * 2^126: small x
        "f64_avg_2^1000": (x.double(), "avg", 2.0**1000, total.double() / ws),
    }
    for name, (t, op, f, want) in accepted.items():
        rr.all_reduce(t, op=op, predivide_factor=f)
        out[name] = "ok" if torch.equal(t, want) else f"got {t}, want {want}"
    return out


@pytest.mark.parametrize("ws", [2, 3])
def test_predivide_factors_out_of_range_are_refused(ws):
    every_rank_ok(ws, _predivide_ranges)


# ---------------------------------------------------------------------------------------------
# Cross-rank mismatches on 3 ranks: every rank raises RuntimeError naming what differs


def _mismatches(rank: int, ws: int) -> dict:
    out = {}
    cases = {
        "numel": (lambda: torch.ones(100 if rank != 2 else 200), "sum", "numel"),
        "dtype_same_size": (lambda: torch.ones(64, dtype=torch.float32 if rank != 1 else torch.int32), "sum", "dtype"),
        "dtype_size": (lambda: torch.ones(64, dtype=torch.float32 if rank != 0 else torch.float64), "sum", "dtype"),
        "shape_same_numel": (lambda: torch.ones(6, 4) if rank != 2 else torch.ones(4, 6), "sum", "shape"),
        "op": (lambda: torch.ones(8), "max" if rank == 1 else "sum", "op"),
    }
    for name, (make, op, field) in cases.items():
        t = make()
        before = t.clone()
        out[name] = _expect(lambda t=t, op=op: rr.all_reduce(t, op=op), RuntimeError, "disagree", field, "call #",
                            "rank 0", "rank 1", "rank 2")
        if not torch.equal(t, before):
            out[name + "_unchanged"] = "tensor was modified"
    # all_reduce_avg on rank 2 vs all_reduce SUM elsewhere: the message names both calls
    t = torch.ones(8)
    fn = (lambda: rr.all_reduce_avg(t)) if rank == 2 else (lambda: rr.all_reduce(t, op="sum"))
    out["avg_vs_sum"] = _expect(fn, RuntimeError, "all_reduce_avg", "all_reduce(op=SUM")
    # async: the error surfaces from wait() and from the future
    w = rr.all_reduce(torch.ones(10 + rank), async_op=True)
    out["async_wait"] = _expect(w.wait, RuntimeError, "numel")
    out["async_future"] = _expect(lambda: rr.all_reduce(torch.ones(10 + rank), async_op=True).get_future().wait(),
                                  RuntimeError, "numel")
    # the group remains usable: no payload moved
    x = torch.full((1000,), float(rank))
    rr.all_reduce(x)
    out["still_works"] = "ok" if torch.equal(x, torch.full((1000,), float(sum(range(ws))))) else f"got {x[:3]}"
    return out


def test_mismatches_raise_on_every_rank():
    every_rank_ok(3, _mismatches)


def _lead_mismatches_then_wrap(rank: int, ws: int) -> dict:
    # Note [Receives before the verdict] / [Retired tag groups]: a checked all-reduce posts its
    # first receive (and sends its first segment) before the frames are compared. Each mismatch
    # below leaves such messages posted on the failed call's tags; they must never meet a later
    # call, also after the ring's tag groups wrap around (1365 calls per group) - without the
    # retirement a later call's receive would lose its message to a stale one (timeout) or take a
    # stale segment (wrong result).
    from ringreduce import scatter_gather

    out = {}
    g = dist.new_group(backend="gloo")  # a fresh runtime: tag groups from the first
    big = 1 << 18  # 1 MiB of float32: the first segment (<= 1 MiB) goes before the verdict
    cases = {
        "numel": (lambda: rr.all_reduce_avg(torch.ones(big + 4 * rank), group=g), "numel"),
        "dtype": (lambda: rr.all_reduce(torch.ones(big, dtype=torch.float64 if rank == 1 else torch.float32),
                                        group=g), "dtype"),
        # rank 0 posts nothing before the verdict (reduce_scatter); the others' first segments to it stay unmatched
        "kind": (lambda: (scatter_gather.reduce_scatter(torch.empty(big // ws), torch.ones(big // ws * ws), group=g)
                          if rank == 0 else rr.all_reduce(torch.ones(big), group=g)), "collective"),
        # rank 0's tensor is small enough for the one-shot (Note [One-shot all-reduce]): its payload
        # rides in the frame message while the others post their ring's leading messages
        "one-shot vs ring": (lambda: rr.all_reduce(torch.ones(5 if rank == 0 else big), group=g), "numel"),
        # a rank refusing locally posts nothing either
        "refusal": (lambda: rr.all_reduce_avg(torch.ones(big, dtype=torch.int32) if rank == ws - 1
                                              else torch.ones(big), group=g), "refused"),
    }
    for name, (fn, field) in cases.items():
        exc = TypeError if name == "refusal" and rank == ws - 1 else RuntimeError
        out[name] = _expect(fn, exc, field if exc is RuntimeError else "AVG")
    # a payload whose first segment must not be lost to what the mismatches left posted, many times
    # around the tag groups; every 100th call a large one
    bad = 0
    for i in range(1500):  # past the wrap (1365 groups), with a large call after it (i = 1400)
        n = big if i % 100 == 0 else 5
        x = torch.arange(n, dtype=torch.float32) + rank * i
        rr.all_reduce(x, group=g)
        want = torch.arange(n, dtype=torch.float32) * ws + i * sum(range(ws))
        if not torch.equal(x, want):
            bad += 1
    out["after_wrap"] = "ok" if bad == 0 else f"{bad} wrong calls"
    return out


def test_leading_messages_of_failed_calls_never_meet_later_calls():
    env = {"RINGREDUCE_TIMEOUT": "30"}
    every_rank_ok(3, _lead_mismatches_then_wrap, env=env, timeout=240)


def _segment_mismatch(rank: int, ws: int) -> dict:
    out = {}
    os.environ["RINGREDUCE_SEGMENT_BYTES"] = str(65536 if rank == 1 else 1 << 20)
    rr.reload_knobs()  # the rings read their knobs again (ringreduce/_config.py)
    t = torch.ones(1 << 18)
    out["segment"] = _expect(lambda: rr.all_reduce(t), RuntimeError, "disagree", "RINGREDUCE_SEGMENT_BYTES",
                             "segment_bytes=65536")
    out["unchanged"] = "ok" if torch.equal(t, torch.ones(1 << 18)) else "changed"
    del os.environ["RINGREDUCE_SEGMENT_BYTES"]
    rr.reload_knobs()  # the rings read their knobs again (ringreduce/_config.py)
    rr.all_reduce(t)
    out["still_works"] = "ok" if torch.equal(t, torch.full_like(t, float(ws))) else f"got {t[:3]}"
    return out


def test_ranks_disagreeing_on_segment_size_all_raise():
    # Segment sizes decide the exchanges' sizes: ranks that disagree would otherwise feed gloo a
    # message larger than its receive. The frame carries the size, so all raise instead.
    every_rank_ok(2, _segment_mismatch)


def test_not_initialized():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        rr.all_reduce(torch.ones(3))


# ---------------------------------------------------------------------------------------------
# Dead, silent and slow peers (fresh processes: these poison their groups on purpose)


def _os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _check_toggled(rank: int, ws: int) -> dict:
    # Note [Pre-posted frame receives]: the whole-group ring posts the receives of its next frame
    # exchange at the end of each call; calls with the check off must leave them for the next call
    # with the check on, and a mismatch must not disturb them. The pool restores RINGREDUCE_CHECK.
    out = {}
    for i, check in enumerate(["1", "0", "0", "1", "0", "1", "1"]):
        os.environ["RINGREDUCE_CHECK"] = check
        rr.reload_knobs()  # the rings read their knobs again (ringreduce/_config.py)
        x = torch.full((1000 + i,), float(rank + i))
        rr.all_reduce(x)
        want = float(sum(range(ws)) + ws * i)
        if not torch.equal(x, torch.full_like(x, want)):
            out[f"call{i}"] = f"got {x[:3]}"
    os.environ["RINGREDUCE_CHECK"] = "1"
    rr.reload_knobs()  # the rings read their knobs again (ringreduce/_config.py)
    out["mismatch"] = _expect(lambda: rr.all_reduce(torch.ones(10 + rank)), RuntimeError, "numel")
    os.environ["RINGREDUCE_CHECK"] = "0"
    rr.reload_knobs()  # the rings read their knobs again (ringreduce/_config.py)
    y = torch.full((77,), float(rank))
    rr.all_reduce(y)
    os.environ["RINGREDUCE_CHECK"] = "1"
    rr.reload_knobs()  # the rings read their knobs again (ringreduce/_config.py)
    works = [rr.all_reduce(torch.full((50,), float(rank * k)), async_op=True) for k in range(4)]
    for k, w in enumerate(works):
        w.wait()
        got = w.result()[0]
        if not torch.equal(got, torch.full((50,), float(k * sum(range(ws))))):
            out[f"async{k}"] = f"got {got[:3]}"
    if not torch.equal(y, torch.full((77,), float(sum(range(ws))))):
        out["after_mismatch"] = f"got {y[:3]}"
    return out


@pytest.mark.parametrize("ws", [2, 3])
def test_check_toggled_between_calls(ws):
    for r in run_ranks(ws, _check_toggled, env={"RINGREDUCE_CHECK": "1"}):
        assert r == {"mismatch": "ok"}, r


def _peer_exits_before_calling(rank: int, ws: int) -> dict:
    if rank == ws - 1:
        os._exit(3)
    threads_before = _os_threads()  # before ringreduce's worker for WORLD exists
    start = time.monotonic()
    t = torch.ones(1 << 16)
    res = {}
    try:
        rr.all_reduce(t)
        res["first"] = "no error"
    except dist.DistBackendError as exc:
        res["first"] = "DistBackendError"
        res["msg"] = str(exc)
    res["elapsed"] = time.monotonic() - start
    try:
        rr.all_reduce(torch.ones(4))
        res["second"] = "no error"
    except dist.DistBackendError as exc:
        res["second"] = "unusable" if "unusable" in str(exc) else str(exc)
    w = rr.all_reduce(torch.ones(4), async_op=True)
    try:
        w.wait()
        res["async"] = "no error"
    except dist.DistBackendError:
        res["async"] = "raised"
    time.sleep(0.5)
    res["threads_left"] = _os_threads() - threads_before
    return res


def test_peer_that_exits_before_calling():
    out = spawn_ranks(3, _peer_exits_before_calling, env={"RINGREDUCE_TIMEOUT": "10"}, timeout=120)
    assert out[2][0] == "died" and out[2][2] == 3
    for status, res, code in out[:2]:
        assert status == "ok" and code == 0, (status, res, code)
        assert res["first"] == "DistBackendError", res
        assert res["elapsed"] < 60, res
        assert res["second"] == "unusable" and res["async"] == "raised", res
        assert res["threads_left"] <= 0, res  # the failed group's worker has exited


def _peer_leaves_after_last_call(rank: int, ws: int) -> dict:
    # Rank 0 leaves right after its last call; rank 1 is still finishing the same call (copying the
    # result of a large non-contiguous tensor back). That call's result is final and must be
    # returned (nothing of the next call, such as frame receives, is posted at its end: Note
    # [Pre-posted frame receives]); only the next call fails, at once, with the reason.
    n = 4096
    if rank == 0:
        t = torch.ones(n, n)
        rr.all_reduce(t)
        os._exit(0 if bool(torch.all(t == ws)) else 4)
    t = torch.ones(n, n).t()  # non-contiguous: reduced through a copy, copied back at the end
    res = {}
    try:
        rr.all_reduce(t)
        res["last"] = "ok" if bool(torch.all(t == ws)) else "wrong"
    except Exception as exc:  # noqa: BLE001 - reported
        res["last"] = f"raised {type(exc).__name__}: {exc}"
    start = time.monotonic()
    res["next"] = _expect(lambda: rr.all_reduce(torch.ones(4)), dist.DistBackendError, "unusable")
    res["next_s"] = time.monotonic() - start
    return res


@full_at("tcp")
def test_peer_leaving_after_the_last_call_does_not_fail_it():
    out = spawn_ranks(2, _peer_leaves_after_last_call, env={"RINGREDUCE_TIMEOUT": "10"}, timeout=120)
    assert out[0][0] == "died" and out[0][2] == 0, out[0]
    status, res, code = out[1]
    assert status == "ok" and code == 0, (status, res, code)
    assert res["last"] == "ok", res
    assert res["next"] == "ok" and res["next_s"] < 30, res


def _peer_never_calls(rank: int, ws: int) -> dict:
    res = {}
    store = dist.distributed_c10d._get_default_store()
    if rank == 1:  # alive and silent until rank 0's call has timed out (however loaded the machine)
        store.wait(["rank0_done"], datetime.timedelta(seconds=100))
        return {"silent": True}
    start = time.monotonic()
    try:
        rr.all_reduce(torch.ones(1000))
        res["err"] = "none"
    except dist.DistBackendError as exc:
        res["err"] = "DistBackendError" if "timeout" in str(exc).lower() or "timed out" in str(exc).lower() else str(exc)
    res["elapsed"] = time.monotonic() - start
    store.set("rank0_done", "1")
    return res


def test_peer_that_never_calls_times_out():
    out = spawn_ranks(2, _peer_never_calls, env={"RINGREDUCE_TIMEOUT": "2"}, timeout=120)
    status, res, code = out[0]
    assert status == "ok" and code == 0, out
    assert res["err"] == "DistBackendError", res
    assert 1.5 <= res["elapsed"] < 7, res


def _killed_mid_ring(rank: int, ws: int) -> dict:
    t = torch.ones(16 << 20)  # 64 MiB: many segments in flight
    rr.all_reduce(t)  # warm-up, completes
    dist.barrier()
    if rank == 1:
        threading.Timer(0.02, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
    res = {}
    start = time.monotonic()
    try:
        for _ in range(50):
            rr.all_reduce(t)
        res["err"] = "none"
    except dist.DistBackendError:
        res["err"] = "DistBackendError"
    except RuntimeError as exc:
        res["err"] = f"RuntimeError: {exc}"
    res["elapsed"] = time.monotonic() - start
    w = rr.all_reduce(torch.ones(3), async_op=True)
    try:
        w.wait()
        res["async"] = "none"
    except dist.DistBackendError:
        res["async"] = "DistBackendError"
    try:
        rr.all_reduce(torch.ones(3), async_op=True).get_future().wait()
        res["future"] = "none"
    except RuntimeError:
        res["future"] = "raised"
    return res


def test_peer_killed_mid_ring():
    out = spawn_ranks(3, _killed_mid_ring, env={"RINGREDUCE_TIMEOUT": "15"}, timeout=180)
    assert out[1][0] == "died" and out[1][2] == -signal.SIGKILL, out[1]
    for r in (0, 2):
        status, res, code = out[r]
        assert status == "ok" and code == 0, (r, status, res, code)
        assert res["err"] == "DistBackendError", res
        assert res["async"] == "DistBackendError" and res["future"] == "raised", res


def _wait_timeout(rank: int, ws: int) -> dict:
    res = {}
    store = dist.distributed_c10d._get_default_store()
    if rank == 1:  # the slow peer: calls only once rank 0's short wait has given up
        store.wait(["short_done"], datetime.timedelta(seconds=100))
    t = torch.ones(100)
    w = rr.all_reduce(t, async_op=True)
    if rank == 0:
        res["short"] = _expect(lambda: w.wait(timeout=datetime.timedelta(milliseconds=200)), RuntimeError,
                               "did not complete")
        store.set("short_done", "1")
    w.wait()
    res["value"] = bool(torch.equal(t, torch.full((100,), 2.0)))
    return res


@full_at("tcp")
def test_wait_with_timeout_raises_then_completes():
    out = spawn_ranks(2, _wait_timeout, timeout=120)
    assert out[0][0] == "ok" and out[0][1]["short"] == "ok" and out[0][1]["value"], out
    assert out[1][0] == "ok" and out[1][1]["value"], out
