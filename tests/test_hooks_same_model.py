"""GradientAverager's construction-time check (issue 35, Note [Same parameters on every rank] in
ringreduce/_param_check.py): ranks whose models differ in parameter count, shape or dtype get the
same ValueError on every rank, naming the first differing parameter, at construction instead of an
agreement error at the first backward; equal models cost one collective; an averager on a DDP
module warns that the gradients would be averaged twice."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
from ranks import CPU_PLACES, run_ranks
from torch.nn.parallel import DistributedDataParallel as DDP

import ringreduce as rr
import ringreduce.ops
import ringreduce.scatter_gather

PLACES = CPU_PLACES  # conftest.py: every test at each place (Note [Places] in ranks.py)


def _model(rank: int, case: str) -> nn.Module:
    torch.manual_seed(0)
    if case == "count":  # 25 parameters on rank 0, 19 on the others
        blocks = 5 if rank == 0 else 4
        return nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)) for _ in range(blocks)],
                             nn.Linear(4, 2, bias=False), nn.Linear(2, 2), nn.Linear(2, 2) if rank == 0 else nn.Identity())
    if case == "shape":
        return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3 if rank == 1 else 2))
    if case == "dtype":
        model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
        return model.double() if rank == 1 else model
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def _construct(rank: int, ws: int, case: str, as_list: bool) -> str:
    model = _model(rank, case)
    try:
        rr.GradientAverager(list(model.parameters()) if as_list else model)
    except ValueError as exc:
        return str(exc)
    return "constructed"


@pytest.mark.parametrize("ws", [2, 3])
def test_different_models_raise_on_every_rank_naming_the_first_difference(ws: int) -> None:
    shape = run_ranks(ws, _construct, "shape", False)
    assert len(set(shape)) == 1, shape  # the same message on every rank
    msg = shape[0]
    assert msg.startswith("ringreduce.GradientAverager: the ranks' models differ: parameter #2"), msg
    assert "rank 0: 2.weight: shape (2, 8), float32" in msg and "rank 1: 2.weight: shape (3, 8), float32" in msg
    assert "the ranks have" not in msg  # equal counts
    if ws == 3:
        assert "rank 2: 2.weight: shape (2, 8), float32" in msg

    dtype = run_ranks(ws, _construct, "dtype", False)
    assert len(set(dtype)) == 1 and "parameter #0" in dtype[0], dtype
    assert "rank 0: 0.weight: shape (8, 4), float32" in dtype[0] and "rank 1: 0.weight: shape (8, 4), float64" in dtype[0]

    listed = run_ranks(ws, _construct, "shape", True)  # no module: parameters are named by position
    assert len(set(listed)) == 1 and "rank 1: parameter 2: shape (3, 8), float32" in listed[0], listed


def test_different_parameter_counts_name_where_the_lists_part() -> None:
    msgs = run_ranks(2, _construct, "count", False)
    assert len(set(msgs)) == 1, msgs
    msg = msgs[0]
    assert "the ranks have 19 to 25 parameters; " in msg, msg
    # Where rank 0 has its fifth block (4 parameters each), rank 1 has its Linear(4, 2).
    assert "parameter #16 " in msg and "rank 0: 4.0.weight: shape (4, 4), float32" in msg, msg
    assert "rank 1: 4.weight: shape (2, 4), float32" in msg, msg


def _count_calls(rank: int, ws: int) -> tuple[int, int, str]:
    calls = {"all_reduce": 0, "all_gather": 0}
    reduce, gather = ringreduce.ops.all_reduce, ringreduce.scatter_gather.all_gather

    def counted(name, fn):
        def call(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return call

    ringreduce.ops.all_reduce = counted("all_reduce", reduce)
    ringreduce.scatter_gather.all_gather = counted("all_gather", gather)
    try:
        averager = rr.GradientAverager(_model(rank, "same"))
    finally:
        ringreduce.ops.all_reduce, ringreduce.scatter_gather.all_gather = reduce, gather
    averager.remove()
    return calls["all_reduce"], calls["all_gather"], "ok"


def test_equal_models_cost_one_collective() -> None:
    assert run_ranks(2, _count_calls) == [(1, 0, "ok")] * 2


def _ddp_warning(rank: int, ws: int) -> list[str]:
    model = _model(rank, "same")
    seen = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rr.GradientAverager(model).remove()
        seen.append(len([w for w in caught if "DistributedDataParallel" in str(w.message)]))
        rr.GradientAverager(DDP(model)).remove()
    ddp = [str(w.message) for w in caught if "DistributedDataParallel" in str(w.message)]
    return [str(seen[0]), *ddp]


def test_an_averager_on_a_ddp_module_warns() -> None:
    for lines in run_ranks(2, _ddp_warning):
        assert lines[0] == "0", lines  # a plain module: no warning
        assert len(lines) == 2 and "averaged twice" in lines[1] and "ddp_comm_hook" in lines[1], lines
