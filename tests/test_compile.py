"""torch.compile: the collectives as ringreduce:: custom ops (no graph break, fullgraph=True), the
out-of-place ringreduce.functional API, and compiled training equal to eager training.

Exact, position-dependent data (small integers, exact in float32) checked with exact equality;
compiled results are compared bitwise with the eager calls on the same ranks.
"""

from __future__ import annotations

import tempfile
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as tF
from ranks import FULL, RankKind, expect_raises, run_fresh, run_ranks
from test_hooks import assert_identical_across_ranks
from test_mesh import mesh_of
from test_nn import solo_group
from torch.nn.parallel import DistributedDataParallel as DDP

import ringreduce as rr
import ringreduce.functional as F

COMPILE_TIMEOUT = 600.0


class GraphRecorder:
    """A torch.compile backend that records the ops of every graph Dynamo hands it, then runs it."""

    def __init__(self) -> None:
        self.graphs: list[str] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> object:
        self.graphs.append(str(gm.graph))
        return gm.forward


def _data(rank: int, rows: int = 6, cols: int = 5) -> torch.Tensor:
    """Rank r's input: element (i, j) = (r + 1) * (cols * i + j) + r, small integers in float32."""
    base = torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols)
    return base * (rank + 1) + rank


def _expected_sum(ws: int, rows: int = 6, cols: int = 5) -> torch.Tensor:
    base = torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols)
    return base * sum(r + 1 for r in range(ws)) + sum(range(ws))


def _in_place_fn(x: torch.Tensor, group: object) -> tuple[torch.Tensor, ...]:
    a = x * 1.0
    rr.all_reduce(a, group=group)  # SUM
    b = x * 2.0
    rr.all_reduce_avg(b, group=group)
    c = x.clone()
    rr.all_reduce(c, op="max", group=group)
    g = rr.all_gather(x, group=group)
    out = torch.empty(x.shape[0] // dist.get_world_size(group), x.shape[1])
    rr.reduce_scatter(out, x, group=group)
    return a, b, c, g, out + 0


def _functional_fn(x: torch.Tensor, group: object) -> tuple[torch.Tensor, ...]:
    return (
        F.all_reduce(x, group=group),
        F.all_reduce_avg(x * 2.0, group=group),
        F.all_reduce(x, op=rr.ReduceOp.MIN, group=group),
        F.all_gather(x, group=group),
        F.reduce_scatter(x, group=group),
        F.reduce_scatter(x, op="avg", group=group) * 2.0,
    )


def _compiled_ops(rank: int, ws: int, which: str, backend: str) -> list[str]:
    torch._dynamo.reset()
    group = None if which == "world" else dist.new_group(list(range(ws)))
    x = _data(rank)
    x_before = x.clone()
    recorder = GraphRecorder() if backend == "record" else backend
    summed = _expected_sum(ws)
    gathered = torch.cat([_data(r) for r in range(ws)])
    per = x.shape[0] // ws
    block = summed.reshape(ws, per, -1)[rank]

    f_in = torch.compile(_in_place_fn, fullgraph=True, backend=recorder)
    a, b, c, g, out = f_in(x, group)
    assert torch.equal(a, summed)
    assert torch.equal(b, summed * 2.0 / ws)
    assert torch.equal(c, _data(ws - 1))  # the largest rank's values are the largest
    assert torch.equal(g, gathered)
    assert torch.equal(out, block)
    for got, want in zip((a, b, c, g, out), _in_place_fn(x, group), strict=True):
        assert torch.equal(got, want), "compiled in-place ops differ from the eager calls"

    f_fn = torch.compile(_functional_fn, fullgraph=True, backend=recorder)
    s, v, m, g2, blk, blk_avg = f_fn(x, group)
    assert torch.equal(x, x_before), "a functional collective changed its input"
    assert torch.equal(s, summed)
    assert torch.equal(v, summed * 2.0 / ws)
    assert torch.equal(m, _data(0))
    assert torch.equal(g2, gathered)
    assert torch.equal(blk, block)
    assert torch.equal(blk_avg, block / ws * 2.0)
    for got, want in zip((s, v, m, g2, blk, blk_avg), _functional_fn(x, group), strict=True):
        assert torch.equal(got, want), "compiled functional ops differ from the eager calls"
    for t in (s, v, m, g2):
        assert_identical_across_ranks(t, "functional result")
    return recorder.graphs if isinstance(recorder, GraphRecorder) else []


@pytest.mark.parametrize("ws", [2, 3])
def test_fullgraph_compile_exact_values(ws: int) -> None:
    graphs = run_ranks(ws, _compiled_ops, "group", "record", timeout=COMPILE_TIMEOUT)
    for rank_graphs in graphs:
        assert len(rank_graphs) == 2  # one graph per function: no graph break
        in_place, functional = rank_graphs
        for op in ("ringreduce.all_reduce_", "ringreduce.all_reduce_avg_", "ringreduce.all_gather",
                   "ringreduce.reduce_scatter"):
            assert op in in_place, f"{op} missing from the graph:\n{in_place}"
        for op in ("ringreduce.all_reduce", "ringreduce.all_reduce_avg", "ringreduce.all_gather",
                   "ringreduce.reduce_scatter"):
            assert op in functional, f"{op} missing from the graph:\n{functional}"


def _compiled_ops_in(rank: int, ws: int, folder: str) -> list:
    """_compiled_ops with inductor, whose precompiled headers go to `folder`: inductor places them under
    tempfile.gettempdir() (not TORCHINDUCTOR_CACHE_DIR, which tests/conftest.py sets) when
    torch._inductor.codecache is imported, here by a fresh rank's first compile."""
    tempfile.tempdir = folder
    return _compiled_ops(rank, ws, "world", "inductor")


@FULL
def test_fullgraph_compile_inductor_world(tmp_path) -> None:
    run_fresh(2, RankKind(), _compiled_ops_in, (str(tmp_path),), None, COMPILE_TIMEOUT, None)


# ----------------------------------------------------------------------- functional API, eager


def _functional_eager(rank: int, ws: int) -> None:
    x = _data(rank).t()  # a transposed view: matched by logical index
    for op in ("sum", "avg", "max", "min", "product"):
        want = x.clone()
        rr.all_reduce(want, op=op)
        got = F.all_reduce(x, op=op)
        assert torch.equal(got, want) and got.stride() == x.stride(), op
    want = x.clone()
    rr.all_reduce_avg(want)
    assert torch.equal(F.all_reduce_avg(x), want)
    y = _data(rank)
    assert torch.equal(F.all_gather(y), rr.all_gather(y))
    want = torch.empty(y.shape[0] // ws, y.shape[1])
    rr.reduce_scatter(want, y, op="max")
    assert torch.equal(F.reduce_scatter(y, op="max"), want)
    assert torch.equal(F.all_gather(torch.tensor(float(rank))), torch.arange(ws, dtype=torch.float32))
    assert torch.equal(x, _data(rank).t())
    # bad input: a clear error on this rank, RuntimeError (told) on the others, then the ranks go on
    bad = expect_raises(lambda: F.reduce_scatter(torch.ones(ws + 1, 2) if rank == 0 else torch.ones(ws, 2)),
                        ValueError if rank == 0 else RuntimeError, "")
    assert bad == "ok", bad
    bad = expect_raises(lambda: F.all_reduce_avg(torch.arange(4) if rank == 0 else torch.ones(4)),
                        TypeError if rank == 0 else RuntimeError, "")
    assert bad == "ok", bad
    bad = expect_raises(lambda: F.all_reduce("x" if rank == 0 else torch.ones(4)),
                        TypeError if rank == 0 else RuntimeError, "")
    assert bad == "ok", bad
    bad = expect_raises(lambda: F.all_reduce(torch.ones(4), op="bogus" if rank == 0 else "sum"),
                        ValueError if rank == 0 else RuntimeError, "")
    assert bad == "ok", bad
    assert torch.equal(F.all_reduce(torch.ones(3)), torch.full((3,), float(ws)))
    # a group of rank 0 alone: rank 0 reduces over itself; the others are outside it, where all_reduce
    # and all_reduce_avg return an unchanged copy and the gathers have no result (ValueError)
    solo = solo_group()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the outsiders' warning
        for fn in (F.all_reduce, F.all_reduce_avg):
            got = fn(x, group=solo)
            assert torch.equal(got, x) and got.stride() == x.stride() and got.data_ptr() != x.data_ptr()
        for fn in (F.all_gather, F.reduce_scatter):
            if rank == 0:
                assert torch.equal(fn(y, group=solo), y)
            else:
                assert expect_raises(lambda fn=fn: fn(y, group=solo), ValueError, "not in `group`") == "ok"
    # a 2-D DeviceMesh: the in-place collectives flatten it, the functional ones say to pass one dimension
    mesh = mesh_of((1, ws), ("dp", "cp"))  # cached per process: init_device_mesh is collective
    for fn in (F.all_reduce, F.all_reduce_avg, F.all_gather, F.reduce_scatter):
        bad = expect_raises(lambda fn=fn: fn(y, group=mesh), TypeError,
                            "ringreduce.functional: group must be", "in-place collectives")
        assert bad == "ok", bad
    assert torch.equal(F.all_reduce(y, group=mesh["cp"]), F.all_reduce(y))  # its one dimension of ws ranks


@pytest.mark.parametrize("ws", [2, 3])
def test_functional_eager_equals_in_place(ws: int) -> None:
    run_ranks(ws, _functional_eager)


def _functional_autograd(rank: int, ws: int) -> None:
    # y = sum_r x_r; every rank's loss is sum(w * y): dL/dx_r = sum over ranks of w = n * w (SUM)
    w = torch.arange(6, dtype=torch.float64) + 1
    x = (torch.arange(6, dtype=torch.float64) * (rank + 1)).requires_grad_()
    (F.all_reduce(x) * w).sum().backward()
    assert torch.equal(x.grad, w * ws)
    x.grad = None
    (F.all_reduce_avg(x) * w).sum().backward()
    assert torch.equal(x.grad, w)
    x.grad = None
    # all_gather: rank r's x is block r; every rank's loss weights block s by (s + 1) * w
    gathered = F.all_gather(x)
    weights = torch.cat([w * (s + 1) for s in range(ws)])
    (gathered * weights).sum().backward()
    assert torch.equal(x.grad, w * (rank + 1) * ws)
    x.grad = None
    # reduce_scatter: the input holds ws blocks of 2; rank r's output is block r of the sum
    xs = (torch.arange(2 * ws, dtype=torch.float64) + rank).requires_grad_()
    (F.reduce_scatter(xs) * (rank + 1)).sum().backward()
    assert torch.equal(xs.grad, torch.cat([torch.full((2,), float(s + 1), dtype=torch.float64) for s in range(ws)]))
    bad = expect_raises(lambda: F.all_reduce(x, op="max").sum().backward(), RuntimeError, "no gradient")
    assert bad == "ok", bad


def test_functional_autograd() -> None:
    run_ranks(2, _functional_autograd)


# ------------------------------------------------------------------------ compiled training


def _tiny(seed: int = 0, wide: bool = False) -> nn.Sequential:
    torch.manual_seed(seed)
    if wide:  # > 1 MiB of parameters: several DDP buckets of 1 MiB, so DDPOptimizer splits the graph
        return nn.Sequential(nn.Linear(4, 320), nn.Tanh(), nn.Linear(320, 1024), nn.Tanh(), nn.Linear(1024, 2))
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(6, 4, generator=g), torch.randn(6, 2, generator=g)


def _train(model: nn.Module, forward: object, rank: int, steps: int) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        x, y = _batch(step, rank)
        opt.zero_grad(set_to_none=True)
        tF.mse_loss(forward(x), y).backward()
        opt.step()


def _compiled_training(rank: int, ws: int, mode: str) -> int:
    torch._dynamo.reset()
    steps = 3
    calls = []
    model = _tiny(wide=mode == "ddp")
    if mode == "ddp":
        ddp = DDP(model, bucket_cap_mb=1)

        def hook(state, bucket):  # noqa: ANN001, ANN202 - counts, then delegates
            calls.append(bucket.index())
            return rr.ddp_comm_hook(state, bucket)

        ddp.register_comm_hook(None, hook)
        _train(model, torch.compile(ddp, backend="aot_eager"), rank, steps)
        reference = _tiny(wide=True)
        stock = DDP(reference, bucket_cap_mb=1)
        _train(reference, stock, rank, steps)
    else:
        eager = _tiny()
        rr.GradientAverager(eager)
        _train(eager, eager, rank, steps)
        averager = rr.GradientAverager(model)
        if mode == "compiled_autograd":
            # Compiled autograd traces every backward (the averager's hooks included) into a graph
            # that is compiled in turn: enabled around backward, as torch.compile does for a compiled
            # function that calls backward with torch._dynamo.config.compiled_autograd = True.
            from torch._dynamo import compiled_autograd

            torch._dynamo.utils.counters.clear()
            compiled = torch.compile(model, backend="aot_eager")
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            with torch._dynamo.config.patch(compiled_autograd=True):
                for step in range(steps):
                    x, y = _batch(step, rank)
                    opt.zero_grad(set_to_none=True)
                    loss = tF.mse_loss(compiled(x), y)
                    with compiled_autograd._enable(torch.compile(backend="aot_eager")):
                        loss.backward()
                    averager.synchronize()  # no end-of-backward callback under compiled autograd
                    opt.step()
            assert torch._dynamo.utils.counters["compiled_autograd"]["captures"] > 0, "compiled autograd did not run"
        else:
            _train(model, torch.compile(model, backend="aot_eager"), rank, steps)
        reference = eager
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-7)
        assert_identical_across_ranks(p.detach(), f"{mode} parameter")
    return len(calls)


@pytest.mark.parametrize("mode", ["compiled_model", pytest.param("compiled_autograd", marks=FULL), "ddp"])
def test_compiled_training_equals_eager(mode: str) -> None:
    calls = run_ranks(2, _compiled_training, mode, timeout=COMPILE_TIMEOUT)
    if mode == "ddp":
        assert calls[0] > 3, "expected several comm-hook buckets per step"


# ------------------------------------------------------------------------------- op registration


def _opcheck(rank: int, ws: int) -> None:
    # Schema, fake (meta) implementation, autograd registration and AOT dispatch of every op,
    # with real collectives underneath (every rank runs the same checks in the same order).
    name = dist.group.WORLD.group_name
    x = _data(rank).double()
    xg = _data(rank).double().requires_grad_()
    cases = [
        (torch.ops.ringreduce.all_reduce_.default, (x.clone(), "sum", name, None, "auto")),
        (torch.ops.ringreduce.all_reduce_avg_.default, (x.clone(), name, None, "auto")),
        (torch.ops.ringreduce.all_reduce_.default, (x.float(), "sum", name, None, "auto", torch.bfloat16, 2.0)),
        (torch.ops.ringreduce.all_reduce_avg_.default, (x.float(), name, None, "ring", torch.float16, 0.0)),
        (torch.ops.ringreduce.all_reduce.default, (xg, "sum", name)),
        (torch.ops.ringreduce.all_reduce_avg.default, (xg, name)),
        (torch.ops.ringreduce.all_gather.default, (xg, ws, name)),
        (torch.ops.ringreduce.reduce_scatter.default, (xg, "avg", ws, name)),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args)


def _wire_fn(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    a = x * 1.0
    rr.all_reduce_avg(a, wire_dtype=torch.bfloat16, predivide_factor=2.0)
    b = x * 1.0
    rr.all_reduce(b, op="sum", predivide_factor=4.0)
    return a, b


def _compiled_wire(rank: int, ws: int) -> None:
    recorder = GraphRecorder()
    f = torch.compile(_wire_fn, fullgraph=True, backend=recorder)
    x = _data(rank)
    a, b = f(x)
    ea, eb = _wire_fn(x)
    assert torch.equal(a, ea) and torch.equal(b, eb), "compiled and eager calls differ"
    assert torch.equal(b, _expected_sum(ws))
    assert any("ringreduce.all_reduce_avg_" in g for g in recorder.graphs), recorder.graphs


def test_fullgraph_compile_wire_and_predivide() -> None:
    run_ranks(2, _compiled_wire, timeout=COMPILE_TIMEOUT)


def test_opcheck_custom_ops() -> None:
    run_ranks(2, _opcheck, timeout=COMPILE_TIMEOUT)
