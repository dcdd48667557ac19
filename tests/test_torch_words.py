"""Errors in torch's words: where torch.distributed raises for the same input, ringreduce raises an
exception of the same type whose message starts with torch's (then says what ringreduce knows), so
that code and tests written against torch.distributed still match (issue 49). Each case asks torch
itself, in this process, what it says."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import ringreduce as rr


def _raised(fn) -> BaseException:  # noqa: ANN001
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - compared below
        return exc
    raise AssertionError("expected an exception")


def _same_start(ours: BaseException, theirs: BaseException) -> None:
    assert isinstance(ours, type(theirs)), (type(ours), type(theirs))
    words = " ".join(str(theirs).split())
    assert " ".join(str(ours).split()).startswith(words), (str(ours), words)


def test_not_initialized_and_not_a_tensor_before_any_group():
    assert not dist.is_initialized()
    _same_start(_raised(lambda: rr.all_reduce(torch.ones(3))), _raised(lambda: dist.all_reduce(torch.ones(3))))
    _same_start(_raised(lambda: rr.all_reduce_avg(torch.ones(3))), _raised(lambda: dist.all_reduce(torch.ones(3))))
    # torch checks the argument before the group: a non-tensor is a TypeError even without a group
    _same_start(_raised(lambda: rr.all_reduce([1.0])), _raised(lambda: dist.all_reduce([1.0])))
    for bad in ([1.0], [torch.ones(2), "x"]):
        _same_start(_raised(lambda bad=bad: rr.all_reduce_coalesced(bad)),
                    _raised(lambda bad=bad: dist.all_reduce_coalesced(bad)))
    # and ringreduce's own words follow
    assert "ringreduce: expected a torch.Tensor, got list" in str(_raised(lambda: rr.all_reduce([1.0])))
    # still a RuntimeError, as ringreduce raised it before
    assert isinstance(_raised(lambda: rr.all_reduce(torch.ones(3))), RuntimeError)


@pytest.fixture
def fake_world():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("this process already has a default process group")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("op", [dist.ReduceOp.MAX, dist.ReduceOp.MIN, dist.ReduceOp.PRODUCT])
def test_unsupported_op_on_a_complex_tensor(fake_world, op):
    """torch's DistributedTest asserts `assertRaisesRegex(ValueError, "all_reduce does not support")`."""
    t = torch.ones(4, dtype=torch.complex64)
    theirs = _raised(lambda: dist.all_reduce(t, op=op))
    _same_start(_raised(lambda: rr.all_reduce(t, op=op)), theirs)
    _same_start(_raised(lambda: rr.all_reduce_coalesced([t], op=op)),
                _raised(lambda: dist.all_reduce_coalesced([t], op=op)))
    ours = _raised(lambda: rr.all_reduce(t, op=op))
    assert isinstance(ours, rr.UnsupportedOpError) and isinstance(ours, TypeError)  # and ringreduce's types
    assert "is not supported for dtype complex64" in str(ours)
