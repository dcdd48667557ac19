"""Knobs read when a ring is made, and the plans of repeated identical CPU all-reduce calls (Note [Fast
path of a repeated call] in ringreduce/_call.py), which never serve a stale plan: a knob changed and
reloaded between two calls, a group destroyed and created again, another dtype or op, and every
refusal, on the first call and on the next ones. Nothing patches os.environ.

Most tests run in this process on a "fake" process group of world size 2 (torch's FakeStore), with the
native ring replaced by a recorder: what a call hands to the native side is then visible per call.
The last ones run real ranks (tests/ranks.py)."""

from __future__ import annotations

import logging
import os
import warnings

import pytest
import torch
import torch.distributed as dist
from ranks import expect_raises, run_ranks

import ringreduce as rr
import ringreduce.functional as F
from ringreduce import _call, _config, _native, _rings


class _Done:
    """The native handle of a call that finished at once."""

    seq = 7

    def wait(self, ms: int) -> bool:
        return True

    def ok(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class _Recorder:
    """Stands for ringreduce._C.CpuRing: each ring it makes records (pg, tensor, options, synchronous)
    of every call into `calls`."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.rings: list[object] = []

    def __call__(self, pg, name, members, store):  # noqa: ANN001, ANN204 - the binding's constructor
        recorder = self

        class Ring:
            def submit(self, tensor, output, options, synchronous=False):  # noqa: ANN001, ANN202
                recorder.calls.append((pg, tensor, options, synchronous))
                return _Done()

            def run(self, tensor, options):  # noqa: ANN001, ANN202 - a synchronous call that ran inline
                recorder.calls.append((pg, tensor, options, True))

        ring = Ring()
        self.rings.append(ring)
        return ring

    def last(self) -> tuple:
        return self.calls[-1]


def _init_fake() -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)


@pytest.fixture
def fake(monkeypatch):
    """A fake WORLD of 2 ranks (this process is rank 0), recording native rings and no rings or plans
    made before; no knob set."""
    if dist.is_initialized():
        pytest.skip("this process already has a default process group")
    for name in [knob.name for knob in _config.KNOBS] + ["GROUP_RANK", "LOCAL_WORLD_SIZE", "WORLD_SIZE"]:
        monkeypatch.delenv(name, raising=False)
    recorder = _Recorder()
    monkeypatch.setattr(_native.C, "CpuRing", recorder)
    monkeypatch.setattr(_rings, "_rings", {})
    monkeypatch.setattr(_call, "_plans", {})
    _init_fake()
    yield recorder
    if dist.is_initialized():
        dist.destroy_process_group()


def test_os_environ_is_the_standard_librarys():
    """A library never patches its user's globals: os.environ keeps its own class."""
    assert type(os.environ) is os._Environ  # type: ignore[attr-defined]


def test_a_knob_is_read_when_the_ring_is_made_and_at_reload(fake, monkeypatch):
    """Note [Knobs are read when a ring is made]: a change reaches an existing ring through
    ringreduce.reload_knobs(), and a new group reads the environment when its ring is made."""
    t = torch.ones(256)
    rr.all_reduce_avg(t)
    default = fake.last()[2].segment_bytes
    monkeypatch.setenv("RINGREDUCE_SEGMENT_BYTES", "4096")
    rr.all_reduce_avg(t)
    assert fake.last()[2].segment_bytes == default  # not reloaded: the ring keeps what it read
    g = dist.new_group([0, 1])
    rr.all_reduce_avg(t, group=g)
    assert fake.last()[2].segment_bytes == 4096  # a new group's ring reads the environment
    rr.reload_knobs()
    rr.all_reduce_avg(t)
    assert fake.last()[2].segment_bytes == 4096
    monkeypatch.delenv("RINGREDUCE_SEGMENT_BYTES")
    rr.reload_knobs()
    rr.all_reduce_avg(t)
    rr.all_reduce_avg(t, group=g)
    assert [c[2].segment_bytes for c in fake.calls[-2:]] == [default, default]


def test_a_repeated_call_takes_the_plan(fake, monkeypatch):
    t = torch.ones(256)
    rr.all_reduce_avg(t)
    assert len(_call._plans) == 1
    plan = next(iter(_call._plans.values()))

    def checked(*args):  # noqa: ANN002, ANN202
        raise AssertionError("a repeated call ran the checks")

    monkeypatch.setattr(_call, "resolve", checked)
    monkeypatch.setattr(_call, "local_refusal", checked)
    rr.all_reduce_avg(t)
    rr.all_reduce_avg(torch.ones(3, 5).t())  # another shape and strides: the same plan
    assert len(fake.calls) == 3 and all(c[2] is plan.options for c in fake.calls)
    assert fake.last()[0] is dist.group.WORLD and fake.last()[3] is True
    assert len(_call._plans) == 1 and len(fake.rings) == 1


@pytest.mark.parametrize(("knob", "values", "field", "expected"), [
    ("RINGREDUCE_SEGMENT_BYTES", ("4096", "8192"), "segment_bytes", (4096, 8192)),
    ("RINGREDUCE_CHECK", ("0", "1"), "check", (False, True)),
    ("RINGREDUCE_TIMEOUT", ("2", "3"), "timeout_ms", (2000, 3000)),
    ("RINGREDUCE_SLOTS", ("3", "5"), "num_slots", (3, 5)),
    ("RINGREDUCE_SHM", ("0", "1"), "shm", (False, True)),
])
def test_a_knob_reloaded_between_two_identical_calls_takes_effect(fake, monkeypatch, knob, values, field, expected):
    t = torch.ones(256)
    seen = []
    for value in (None, values[0], values[0], values[1], None):
        if value is None:
            monkeypatch.delenv(knob, raising=False)
        else:
            monkeypatch.setenv(knob, value)
        rr.reload_knobs()
        rr.all_reduce_avg(t)
        seen.append(getattr(fake.last()[2], field))
    default = seen[0]
    assert seen == [default, expected[0], expected[0], expected[1], default], seen


def test_a_bad_knob_raises_at_reload_and_at_every_call_until_fixed(fake, monkeypatch):
    t = torch.ones(256)
    rr.all_reduce_avg(t)
    rr.all_reduce_avg(t)
    monkeypatch.setenv("RINGREDUCE_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="RINGREDUCE_TIMEOUT='soon' is not a number"):
        rr.reload_knobs()
    for _ in range(2):
        with pytest.raises(ValueError, match="RINGREDUCE_TIMEOUT='soon' is not a number"):
            rr.all_reduce_avg(t)
    monkeypatch.setenv("RINGREDUCE_SEGMENT_BYTES", "8")
    monkeypatch.delenv("RINGREDUCE_TIMEOUT")
    with pytest.raises(ValueError, match="RINGREDUCE_SEGMENT_BYTES=8 must be >= 16"):
        rr.all_reduce_avg(t)
    assert len(fake.calls) == 2
    monkeypatch.delenv("RINGREDUCE_SEGMENT_BYTES")
    # beyond the native field's range (int32): by name too, never pybind's TypeError about CallOptions
    monkeypatch.setenv("RINGREDUCE_SLOTS", str(1 << 31))
    with pytest.raises(ValueError, match="RINGREDUCE_SLOTS=2147483648 must be <= 2147483647"):
        rr.reload_knobs()
    with pytest.raises(ValueError, match="RINGREDUCE_SLOTS=2147483648 must be <= 2147483647"):
        rr.all_reduce_avg(t)
    assert len(fake.calls) == 2
    monkeypatch.delenv("RINGREDUCE_SLOTS")
    rr.all_reduce_avg(t)  # fixed: the ring reads its knobs at this call
    assert len(fake.calls) == 3


def test_debug_reloaded_between_two_identical_calls_logs(fake, monkeypatch, caplog):
    t = torch.ones(256)
    rr.all_reduce_avg(t)
    rr.all_reduce_avg(t)
    monkeypatch.setenv("RINGREDUCE_DEBUG", "INFO")
    rr.reload_knobs()
    logger = logging.getLogger("ringreduce")
    with caplog.at_level(logging.INFO, logger="ringreduce"):
        rr.all_reduce_avg(t)
        rr.all_reduce_avg(t)
    lines = [r.getMessage() for r in caplog.records if r.name == "ringreduce"]
    assert len(lines) == 2 and all("call #7 all_reduce_avg op=AVG dtype=float32 numel=256" in x for x in lines), lines
    logger.handlers.clear()


def test_a_profiler_sees_a_repeated_call(fake):
    t = torch.ones(256)
    rr.all_reduce_avg(t)
    rr.all_reduce_avg(t)
    with torch.autograd.profiler.profile() as prof:
        rr.all_reduce_avg(t)
    assert [e.name for e in prof.function_events].count("ringreduce.all_reduce_avg") == 1


def test_a_destroyed_world_and_a_new_one(fake):
    t = torch.ones(256)
    rr.all_reduce_avg(t)
    rr.all_reduce_avg(t)
    first = dist.group.WORLD
    assert fake.last()[0] is first
    dist.destroy_process_group()
    for _ in range(2):
        with pytest.raises(RuntimeError, match="default process group is not initialized"):
            rr.all_reduce_avg(t)
        with pytest.raises(ValueError, match="^Default process group has not been initialized"):  # torch's words
            rr.all_reduce_avg(t)
        for fn in (F.all_reduce, F.all_reduce_avg, F.all_gather, F.reduce_scatter):  # the same error
            with pytest.raises(RuntimeError, match="default process group is not initialized"):
                fn(t)
    _init_fake()
    second = dist.group.WORLD
    assert second is not first
    rr.all_reduce_avg(t)
    rr.all_reduce_avg(t)
    assert [c[0] for c in fake.calls] == [first, first, second, second]


def test_a_destroyed_group_and_a_new_one(fake):
    t = torch.ones(256)
    one = dist.new_group([0, 1])
    rr.all_reduce(t, group=one)
    rr.all_reduce(t, group=one)
    dist.destroy_process_group(one)
    two = dist.new_group([0, 1])
    rr.all_reduce(t, group=two)
    rr.all_reduce(t, group=two)
    assert [c[0] for c in fake.calls] == [one, one, two, two]
    # a group this rank is not a member of: the call returns at once, every time
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rr.all_reduce(t, group=dist.GroupMember.NON_GROUP_MEMBER)
        rr.all_reduce(t, group=dist.GroupMember.NON_GROUP_MEMBER)
    assert len(fake.calls) == 4


def test_forget_plans_drops_the_plans_of_a_group(fake):
    from ringreduce._groups import resolve

    g = dist.new_group([0, 1])
    rr.all_reduce_avg(torch.ones(4))
    rr.all_reduce_avg(torch.ones(4), group=g)
    assert len(_call._plans) == 2
    _call.forget_plans(resolve(None).pg)
    assert [p.group for p in _call._plans.values()] == [g]
    _call.forget_plans()
    assert not _call._plans

def test_another_dtype_or_option_is_checked_again(fake):
    half, single = torch.ones(8, dtype=torch.float16), torch.ones(8)
    for _ in range(2):
        rr.all_reduce_avg(half, accum_dtype=torch.float32)
        assert fake.last()[2].accum_float32 is True
        rr.all_reduce_avg(single, accum_dtype=torch.float32)  # float32 accumulates as itself
        assert fake.last()[2].accum_float32 is False
        rr.all_reduce_avg(half, accum_dtype=torch.float16)
        assert fake.last()[2].accum_narrow is True
        rr.all_reduce_avg(single, wire_dtype=torch.bfloat16)
        assert fake.last()[2].wire_dtype == _native.C.DType.BFLOAT16
        rr.all_reduce(single, op="max")
        assert fake.last()[2].op == _native.C.RedOp.MAX
        rr.all_reduce(single, op=rr.ReduceOp.AVG, predivide_factor=2.0)
        assert fake.last()[2].predivide == 2.0
    assert len(fake.calls) == 12
    for _ in range(2):  # after those plans, the same arguments with a tensor they do not fit
        with pytest.raises(TypeError, match="int32"):
            rr.all_reduce_avg(torch.ones(8, dtype=torch.int32), accum_dtype=torch.float32)
        with pytest.raises(TypeError, match="accum_dtype"):
            rr.all_reduce_avg(torch.ones(8, dtype=torch.float64), accum_dtype=torch.float32)
        with pytest.raises(ValueError, match="wire_dtype=torch.bfloat16 applies to float32 tensors only"):
            rr.all_reduce_avg(torch.ones(8, dtype=torch.float64), wire_dtype=torch.bfloat16)
        with pytest.raises(TypeError, match="MAX is not supported for dtype complex64"):
            rr.all_reduce(torch.ones(8, dtype=torch.complex64), op="max")
        with pytest.raises(ValueError, match="predivide_factor applies to SUM and AVG, not MAX"):
            rr.all_reduce(single, op=rr.ReduceOp.MAX, predivide_factor=2.0)
    # every refusal sent its refusal frame (the native submit without a tensor) and raised
    refusals = fake.calls[12:]
    assert len(refusals) == 10 and all(c[1] is None for c in refusals)


def test_an_equal_argument_of_another_type_is_checked_again(fake):
    """True == 1 and hash(True) == hash(1), but predivide_factor=True is refused where 1 is not."""
    t = torch.ones(8)
    for _ in range(2):
        rr.all_reduce(t, op=rr.ReduceOp.AVG, predivide_factor=1)
        assert fake.last()[2].predivide == 0.0  # a factor of 1 is no factor
        with pytest.raises(TypeError, match="predivide_factor must be a number > 0 or None, got bool"):
            rr.all_reduce(t, op=rr.ReduceOp.AVG, predivide_factor=True)


def test_tensors_the_plan_does_not_cover_take_the_full_path(fake):
    t = torch.ones(8)
    rr.all_reduce_avg(t)
    rr.all_reduce_avg(t)
    count = len(fake.calls)
    rr.all_reduce_avg(torch.ones(0))  # nothing to move: no native call
    assert len(fake.calls) == count
    for _ in range(2):
        with pytest.raises(ValueError, match="dense"):
            rr.all_reduce_avg(torch.eye(3).to_sparse())
        with pytest.raises(ValueError, match="tensors on meta are not supported"):
            rr.all_reduce_avg(torch.ones(8, device="meta"))
        with pytest.raises(TypeError, match="expected a torch.Tensor, got list"):
            rr.all_reduce_avg([1.0])
        with pytest.raises(ValueError, match="unsupported reduce op"):
            rr.all_reduce(t, op=["sum"])  # unhashable
    param = torch.nn.Parameter(torch.ones(8))
    rr.all_reduce_avg(param)
    rr.all_reduce_avg(param)
    assert fake.last()[1] is param


def test_async_repeated_calls(fake):
    t = torch.ones(8)
    works = [rr.all_reduce_avg(t, async_op=True) for _ in range(3)]
    assert all(w.wait() is True for w in works)
    assert [c[3] for c in fake.calls] == [False, False, False]
    assert "all_reduce_avg AVG on WORLD (size 2)" in repr(works[-1])


def test_callers_of_many_calls_reuse_one_options_object_and_take_their_plans(fake, monkeypatch):
    """all_reduce_coalesced and the "ringreduce" backend's options make one AllreduceOptions per argument
    set and dtype, so that their repeated buffers skip the checks as a repeated all_reduce does."""
    from ringreduce.distributed.options import BackendOptions

    floats, halves = [torch.ones(4), torch.ones(3)], [torch.ones(5, dtype=torch.float16)]
    rr.all_reduce_coalesced([*floats, *halves], op="avg", accum_dtype=torch.float32, wire_dtype=torch.bfloat16)
    first = fake.calls[-2:]
    assert [c[2].wire_dtype for c in first] == [_native.C.DType.BFLOAT16, None]  # the wire: float32's buffer only
    assert [c[2].accum_float32 for c in first] == [False, True]  # float32 accumulation: the half buffer only
    plans = len(_call._plans)

    def checked(*args):  # noqa: ANN002, ANN202
        raise AssertionError("a repeated buffer ran the checks")

    monkeypatch.setattr(_call, "resolve", checked)
    monkeypatch.setattr(_call, "local_refusal", checked)
    rr.all_reduce_coalesced([*floats, *halves], op="avg", accum_dtype=torch.float32, wire_dtype=torch.bfloat16)
    assert len(_call._plans) == plans and [c[2] for c in fake.calls[-2:]] == [c[2] for c in first]
    o = BackendOptions(wire_dtype=torch.float16)
    avg = o.allreduce_options(rr.ReduceOp.AVG, torch.float32)
    assert avg is o.allreduce_options(rr.ReduceOp.AVG, torch.float32) and avg.wire_dtype == torch.float16
    assert o.allreduce_options(rr.ReduceOp.MAX, torch.float32).wire_dtype is None  # a wire applies to SUM/AVG
    assert o.allreduce_options(rr.ReduceOp.AVG, torch.float64).wire_dtype is None


def test_a_replaced_native_ring_is_called_on_the_fast_path(fake):
    """A stub put over ringreduce._C.CpuRing before the ring is made (as measurements and tests do)
    serves the repeated calls too."""
    t = torch.ones(8)
    for _ in range(3):
        rr.all_reduce_avg(t)
    assert [c[1] for c in fake.calls] == [t, t, t] and len(fake.rings) == 1


# ---------------------------------------------------------------------------------------------
# Real ranks


def _repeated_real_calls(rank: int, ws: int) -> dict:
    out = {}
    for _ in range(3):  # dtype changes between identical calls
        a = torch.full((300,), float(rank + 1))
        rr.all_reduce_avg(a)
        b = torch.full((300,), float(rank + 1), dtype=torch.float64)
        rr.all_reduce_avg(b)
        out["float32"] = bool(torch.equal(a, torch.full((300,), 1.5)))
        out["float64"] = bool(torch.equal(b, torch.full((300,), 1.5, dtype=torch.float64)))
    # a group destroyed and a new one over the same ranks
    for k in range(2):
        g = dist.new_group([0, 1])
        for _ in range(2):
            c = torch.full((10,), float(rank + k))
            rr.all_reduce(c, group=g)
            out[f"group{k}"] = bool(torch.equal(c, torch.full((10,), float(1 + 2 * k))))
        dist.destroy_process_group(g)
    # rank 1 refuses (an int AVG) twice where rank 0's call has a plan: both raise, both times
    for i in range(2):
        if rank == 1:
            out[f"refused{i}"] = expect_raises(lambda: rr.all_reduce_avg(torch.ones(300, dtype=torch.int32)),
                                               TypeError, "AVG", "int32")
        else:
            out[f"refused{i}"] = expect_raises(lambda: rr.all_reduce_avg(torch.ones(300)), RuntimeError,
                                               "rank 1: all_reduce_avg refused locally")
    d = torch.full((300,), float(rank + 1))
    rr.all_reduce_avg(d)  # the group goes on
    out["after"] = bool(torch.equal(d, torch.full((300,), 1.5)))
    return out


def test_repeated_real_calls():
    for r in run_ranks(2, _repeated_real_calls):
        assert all(v is True or v == "ok" for v in r.values()), r


def test_python_cost_tool_times_a_tree(tmp_path):
    """benchmarks/python_cost.py runs (a child per tree) and names the ringreduce it timed."""
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    tool = os.path.join(root, "benchmarks", "python_cost.py")
    env = dict(os.environ, PYTHONPATH=root)
    one = subprocess.run([sys.executable, tool, "--json", "--calls", "300", "--repeats", "2"], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert one.returncode == 0, one.stderr
    result = json.loads(one.stdout.strip().splitlines()[-1])
    assert os.path.realpath(result["ringreduce"]) == os.path.realpath(os.path.join(root, "ringreduce"))
    assert len(result["repeats_us"]) == 2 and 0 < result["min_us"] <= result["median_us"]
    side = subprocess.run([sys.executable, tool, "--tree", root, "--rounds", "1", "--calls", "300", "--repeats", "1",
                           "--dtype", "bfloat16"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert side.returncode == 0, side.stderr
    assert any(line.startswith(root) for line in side.stdout.splitlines()), side.stdout
    assert "load average" in side.stdout and "of 512 bytes of bfloat16" in side.stdout, side.stdout
