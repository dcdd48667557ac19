"""One call path: ring_type(device) picks the ring of a device, both rings have one interface, and
AllreduceOptions carries one call's options, checked once by its maker and applied per buffer (Note
[Options of a buffer]); native_options is the one place a native CallOptions is made."""

import ast
import pathlib

import pytest
import torch

import ringreduce as rr
from ringreduce import _config, _rings
from ringreduce._call import Call
from ringreduce._groups import GroupInfo
from ringreduce._options import AllreduceOptions, native_options, options_of
from ringreduce._rings import cpu, cuda, refusing_ring, ring_type

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_ring_type_of_each_device(monkeypatch):
    assert ring_type(torch.device("cpu")) is cpu.CpuRing
    with pytest.raises(ValueError, match="tensors on meta are not supported; use CPU or CUDA tensors"):
        ring_type(torch.device("meta"))
    monkeypatch.setitem(rr._C.native_info, "cuda", True)
    assert ring_type(torch.device("cuda", 1)) is cuda.CudaRing
    monkeypatch.setitem(rr._C.native_info, "cuda", False)
    with pytest.raises(RuntimeError, match="no CUDA support.*set CUDA_HOME"):
        ring_type(torch.device("cuda", 0))
    info = GroupInfo(pg=None, rank=0, size=2, name="fake")  # type: ignore[arg-type]
    assert refusing_ring(info, torch.device("cuda", 0)) is None  # no communicator to tell


def test_every_ring_has_the_one_interface():
    for ring in (cpu.CpuRing, cuda.CudaRing):
        for name in ("all_reduce", "ring_half", "refuse", "check_enabled", "ring_parameters", "option_refusal",
                     "options", "reload"):
            assert callable(getattr(ring, name)), (ring.__name__, name)
        assert isinstance(ring.ENQUEUES, bool) and isinstance(ring.PLANS, bool)
    assert cpu.CpuRing.WIRE_RING is None and cuda.CudaRing.WIRE_RING == "ring"
    gpu, host = cuda.CudaRing.__new__(cuda.CudaRing), cpu.CpuRing.__new__(cpu.CpuRing)
    assert host.option_refusal("hierarchical", "16") is None
    assert "flat ring" in str(gpu.option_refusal("hierarchical", "auto"))
    assert "CPU rings only" in str(gpu.option_refusal("auto", "16"))
    assert gpu.option_refusal("ring", "32") is None
    assert _rings.__all__ and "ring_for" in _rings.__all__


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


def test_backend_options_apply_the_buffer_rule_where_the_op_fits():
    """A group's BackendOptions go through the same per-dtype rule; the wire is left off other ops."""
    o = rr.BackendOptions(accum_dtype=torch.float32, wire_dtype=torch.float16)
    avg = o.allreduce_options(rr.ReduceOp.AVG, torch.float32)
    assert avg is o.allreduce_options(rr.ReduceOp.AVG, torch.float32) and avg.wire_dtype == torch.float16
    assert avg is o.coalesced_options(rr.ReduceOp.AVG).for_buffer(torch.float32)
    assert o.allreduce_options(rr.ReduceOp.MAX, torch.float32).wire_dtype is None  # a wire applies to SUM/AVG
    half = o.allreduce_options(rr.ReduceOp.SUM, torch.bfloat16)
    assert (half.accum_dtype, half.wire_dtype) == (torch.float32, None)
    assert o.allreduce_options(rr.ReduceOp.SUM, torch.float64).accum_dtype is None


def test_options_of_an_argument_set_are_one_object():
    a = options_of(rr.ReduceOp.AVG, None, "auto", torch.bfloat16, 2.0)
    assert options_of(rr.ReduceOp.AVG, None, "auto", torch.bfloat16, 2.0) is a
    assert options_of(rr.ReduceOp.AVG, None, "auto", torch.bfloat16, 2) is not a  # 2 is not 2.0: types count
    assert options_of(1) is not options_of(True)
    assert options_of([1]) is not options_of([1])  # unhashable: options of its own (checked as any other)


def test_options_checked_once_by_their_maker():
    AllreduceOptions(wire_dtype=torch.float16, predivide_factor=4).check("maker")
    with pytest.raises(ValueError, match="^maker: wire_dtype must be torch.bfloat16 or torch.float16"):
        AllreduceOptions(wire_dtype=torch.float32).check("maker")
    with pytest.raises(TypeError, match="^maker: predivide_factor must be a number > 0 or None, got str"):
        AllreduceOptions(predivide_factor="2").check("maker")
    with pytest.raises(ValueError, match="^ringreduce.GradientAverager: predivide_factor must be a finite number"):
        rr.GradientAverager(torch.nn.Linear(2, 2), predivide_factor=float("inf"))


def test_native_options_carry_the_call_and_the_rings_knobs(monkeypatch):
    """Every field of the native CallOptions comes from the checked Call or from the ring's knobs."""
    for name in ("RINGREDUCE_SEGMENT_BYTES", "RINGREDUCE_SLOTS", "RINGREDUCE_LANES", "RINGREDUCE_ONESHOT_BYTES",
                 "RINGREDUCE_TIMEOUT", "RINGREDUCE_CHECK", "RINGREDUCE_SHM"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RINGREDUCE_SEGMENT_BYTES", "4096")
    monkeypatch.setenv("RINGREDUCE_SLOTS", "3")
    monkeypatch.setenv("RINGREDUCE_LANES", "2")
    monkeypatch.setenv("RINGREDUCE_ONESHOT_BYTES", "0")
    monkeypatch.setenv("RINGREDUCE_TIMEOUT", "2.5")
    monkeypatch.setenv("RINGREDUCE_SHM", "0")
    knobs = _config.read()
    info = GroupInfo(pg=None, rank=0, size=4, name="fake")  # type: ignore[arg-type]
    call = Call(info, rr._C.CallKind.ALL_REDUCE_COALESCED, rr.ReduceOp.AVG, ntensors=3, accum=True, factor=2.0,
                extra_divisor=4, local_size=2, members=(0, 2, 1, 3), one_shot=False, wire=rr._C.DType.BFLOAT16,
                gather="auto")
    host = native_options(call, knobs, False, one_node=False)
    assert (host.kind, host.op, host.ntensors, host.accum_float32) == (call.kind, rr._C.RedOp.AVG, 3, True)
    assert (host.predivide, host.extra_divisor, host.local_size, host.one_shot) == (2.0, 4, 2, False)
    assert host.node_order == [0, 2, 1, 3] and host.wire_dtype == rr._C.DType.BFLOAT16
    assert host.wire_gather16  # "auto" on a ring of several nodes
    assert (host.segment_bytes, host.num_slots, host.timeout_ms, host.shm, host.one_node) == (4096, 3, 2500, False,
                                                                                              False)
    assert host.check  # on by default on CPU
    gpu = native_options(call, knobs, True)
    assert (gpu.segment_bytes, gpu.num_slots, gpu.lanes, gpu.one_shot_bytes) == (4096, 3, 2, 0)
    assert not gpu.check and not gpu.wire_gather16 and gpu.node_order == []  # off by default on GPU


def _functions(path: pathlib.Path) -> list[tuple[str, int, int]]:
    """(qualified name, line, parameter count without self/cls) of every function in `path`."""
    out = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = child.args
                count = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) + bool(a.vararg) + bool(a.kwarg)
                count -= bool(a.args and a.args[0].arg in ("self", "cls"))
                out.append((f"{prefix}{child.name}", child.lineno, count))
                visit(child, f"{prefix}{child.name}.")

    visit(ast.parse(path.read_text()), "")
    return out


def test_no_internal_function_takes_more_than_nine_parameters():
    """An options object belongs where a function would take more (issue 46); the public functions
    keep torch.distributed's and the contract's signatures (docs/design.md section 1)."""
    public = {"GradientAverager.__init__"}  # the contract's constructor (docs/design.md sections 1 and 8)
    over = []
    for path in sorted((ROOT / "ringreduce").rglob("*.py")):
        for name, line, count in _functions(path):
            if count > 9 and name not in public:
                over.append(f"{path.relative_to(ROOT)}:{line} {name} ({count})")
    assert not over, over


def test_native_call_options_are_made_in_one_place():
    """C.CallOptions() is constructed only by _options.native_options (issue 46)."""
    makers = []
    for path in sorted((ROOT / "ringreduce").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "CallOptions":
                makers.append(str(path.relative_to(ROOT)))
    assert makers == ["ringreduce/_options.py"], makers


def test_at_most_two_work_classes():
    """ringreduce.Work and the c10d adapter BackendWork (issue 46)."""
    works = []
    for path in sorted((ROOT / "ringreduce").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and "Work" in node.name:
                works.append(node.name)
    assert sorted(works) == ["BackendWork", "Work"], works


def test_a_work_of_parts_waits_for_each_then_finishes_once():
    """Work.of_parts (a coalesced call's, a backend collective's copy back): wait(), the future and
    is_completed() see every part; `finish` runs once whichever of wait() and the future comes first;
    a failed part's error is the Work's, and `finish` does not run then."""
    a, b = torch.ones(2), torch.zeros(3)
    finished: list[int] = []
    work = rr.Work.of_parts([rr.Work.completed([a]), rr.Work.completed([b])], [a, b],
                            lambda: finished.append(1), describe="two parts")
    assert work.is_completed() and work.is_success() and work.exception() is None
    assert finished == [] and "two parts" in repr(work)
    assert work.get_future().wait() == [a, b] and finished == [1]
    assert work.wait() and work.result() == [a, b] and finished == [1]  # once only

    class Failed(rr.Work):
        def exception(self):
            return RuntimeError("part failed")

        def get_future(self):
            fut = torch.futures.Future()
            fut.set_exception(RuntimeError("part failed"))
            return fut

    failed = rr.Work.of_parts([rr.Work.completed([a]), Failed(None, [b])], [a, b], lambda: finished.append(2))
    assert isinstance(failed.exception(), RuntimeError)
    with pytest.raises(RuntimeError, match="part failed"):
        failed.get_future().wait()
    assert finished == [1]
