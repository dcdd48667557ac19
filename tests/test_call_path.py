"""One call path: backend_for(device) picks the backend of a device, and AllreduceOptions carries one
call's options, checked once by its maker and applied per buffer (Note [Options of a buffer])."""

import pytest
import torch

import ringreduce as rr
from ringreduce import _rings
from ringreduce._options import AllreduceOptions
from ringreduce._rings import backend_for, cpu, cuda, refusing_backend


def test_backend_for_each_device(monkeypatch):
    assert backend_for(torch.device("cpu")) is cpu
    with pytest.raises(ValueError, match="tensors on meta are not supported; use CPU or CUDA tensors"):
        backend_for(torch.device("meta"))
    monkeypatch.setitem(rr._C.native_info, "cuda", True)
    assert backend_for(torch.device("cuda", 1)) is cuda
    assert refusing_backend(torch.device("cuda", 0)) is cuda
    monkeypatch.setitem(rr._C.native_info, "cuda", False)
    with pytest.raises(RuntimeError, match="no CUDA support.*set CUDA_HOME"):
        backend_for(torch.device("cuda", 0))
    assert refusing_backend(torch.device("cuda", 0)) is None  # no communicator to tell
    # a refusal without a tensor, or of one on a device no backend runs: the others run the CPU ring
    assert refusing_backend(None) is cpu and refusing_backend(torch.device("meta")) is cpu


def test_every_backend_has_the_one_interface():
    for backend in (cpu, cuda):
        for name in ("all_reduce", "ring_half", "refuse", "check_enabled", "ring_parameters", "option_refusal"):
            assert callable(getattr(backend, name)), (backend.__name__, name)
        assert isinstance(backend.ENQUEUES, bool)
    assert cpu.WIRE_RING is None and cuda.WIRE_RING == "ring"
    assert cpu.option_refusal("hierarchical", "16") is None
    assert "flat ring" in str(cuda.option_refusal("hierarchical", "auto"))
    assert "CPU rings only" in str(cuda.option_refusal("auto", "16"))
    assert cuda.option_refusal("ring", "32") is None
    assert _rings.__all__ and "backend_for" in _rings.__all__


def test_options_per_buffer_are_one_object_per_dtype():
    o = AllreduceOptions(rr.ReduceOp.AVG, torch.float32, "ring", torch.bfloat16, 2.0, extra_divisor=3, wire_gather=16)
    f32, f16, i64 = o.for_buffer(torch.float32), o.for_buffer(torch.float16), o.for_buffer(torch.int64)
    assert o.for_buffer(torch.float32) is f32 and o.for_buffer(torch.float16) is f16
    assert (f32.wire_dtype, f32.accum_dtype, f32.wire_gather) == (torch.bfloat16, None, 16)
    assert (f16.wire_dtype, f16.accum_dtype, f16.wire_gather) == (None, torch.float32, None)
    assert (i64.wire_dtype, i64.accum_dtype) == (None, None)
    for b in (f32, f16, i64):  # what every buffer keeps
        assert (b.op, b.algorithm, b.predivide_factor, b.extra_divisor) == (rr.ReduceOp.AVG, "ring", 2.0, 3)
    other = AllreduceOptions(accum_dtype=torch.float64)  # not float32: left for all_reduce to check
    assert other.for_buffer(torch.float16).accum_dtype == torch.float64


def test_options_checked_once_by_their_maker():
    AllreduceOptions(wire_dtype=torch.float16, predivide_factor=4).check("maker")
    with pytest.raises(ValueError, match="^maker: wire_dtype must be torch.bfloat16 or torch.float16"):
        AllreduceOptions(wire_dtype=torch.float32).check("maker")
    with pytest.raises(TypeError, match="^maker: predivide_factor must be a number > 0 or None, got str"):
        AllreduceOptions(predivide_factor="2").check("maker")
    with pytest.raises(ValueError, match="^ringreduce.GradientAverager: predivide_factor must be a finite number"):
        rr.GradientAverager(torch.nn.Linear(2, 2), predivide_factor=float("inf"))
