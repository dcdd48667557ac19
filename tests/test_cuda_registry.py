"""The Python glue of the GPU path (ringreduce/_rings/cuda.py), on the CPU: no GPU, no NCCL.

ringreduce._C is replaced by one recorder (FakeC: the rings it creates, the calls and the
CallOptions it receives) and the group's store by an in-process HashStore, so the rendezvous of
the NCCL unique id and the one-GPU-per-group rule run as they would on GPUs, with ranks as threads.
Guards the communicator registry against issue 15's defects 7 (generation keys that let ranks
disagree or read an old id) and 15 (device mix-ups), and Ctrl-C while a communicator is created
(docs/design.md 1.4); and what the calls hand to _C: the group's rank and size (not the ring's),
one communicator per group, the ring's rank list and local size, refusal frames, and the pipeline
knobs read when the ring is made.
"""

from __future__ import annotations

import datetime
import itertools
import os
import signal
import threading
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from ringreduce._groups import GroupInfo
from ringreduce._rings import cuda as _cuda
from ringreduce.work import Work


class FakeComm:
    """A CudaRing as FakeC.CudaRing created it: its arguments, and whether it was aborted."""

    def __init__(self, uid: bytes, nranks: int, rank: int, device: int, timeout_ms: int, name: str,
                 staging_bytes: int, connect_timeout_ms: int = 0, lane_ids: tuple = ()) -> None:
        self.uid = uid
        self.lane_ids = list(lane_ids)
        self.nranks = nranks
        self.rank = rank
        self.device = device
        self.name = name
        self.connect_timeout_ms = connect_timeout_ms
        self.aborted = False

    def abort(self, reason: str, at_exit: bool = False) -> None:
        self.aborted = True


class FakeC:
    """ringreduce._C as ringreduce._rings.cuda uses it, recording what it is handed: the rings it creates
    (`comms`), the calls (`calls`) and their options (`options`, the real native CallOptions of
    csrc/core/call_options.h, the struct the CPU path takes too). A fresh unique id per call."""

    native_info = {"cuda": True}

    def __init__(self) -> None:
        self.comms: list[FakeComm] = []
        self.calls: list[tuple] = []
        self.options: list[Any] = []
        self._ids = itertools.count(1)

    def __getattr__(self, name: str) -> Any:
        # CallOptions, CallKind, RedOp: the real bindings (looked up only by the calls, so that the
        # registry's tests do not need the native build)
        if name in ("CallOptions", "CallKind", "RedOp"):
            from ringreduce._native import C

            return getattr(C, name)
        raise AttributeError(name)

    def nccl_unique_id(self) -> bytes:
        return f"uid-{next(self._ids)}".encode()

    def cuda_group_timeout_ms(self, pg: Any) -> int:
        return 1000

    def CudaRing(self, *args: Any, **kwargs: Any) -> FakeComm:  # noqa: N802 - the binding's name
        comm = FakeComm(*args, **kwargs)
        self.comms.append(comm)
        return comm

    def cuda_all_reduce(self, comm, tensor, options, async_op, name, members):
        self.calls.append(("all_reduce", comm, int(options.kind), list(members), options.local_size, async_op))
        self.options.append(options)
        return self if async_op else None

    def cuda_ring_half(self, comm, tensor, output, options, async_op, name, members):
        self.calls.append(("ring_half", comm, int(options.kind), list(members), async_op))
        self.options.append(options)
        return self if async_op else None

    def cuda_refuse(self, comm, kind, error, op, name, members):
        self.calls.append(("refuse", comm, kind, list(members)))


class FakePG:
    pass


class FakeCudaTensor:
    is_cuda = True
    device = torch.device("cuda", 0)
    layout = torch.strided
    dtype = torch.float32

    def is_contiguous(self):
        return True

    def is_conj(self):
        return False

    def is_neg(self):
        return False


@pytest.fixture
def native(monkeypatch):
    """The FakeC that ringreduce._rings.cuda uses as _C, with an empty communicator registry."""
    fake = FakeC()
    monkeypatch.setattr(_cuda, "_native", lambda: fake)
    monkeypatch.setattr(_cuda, "_comms", {})
    monkeypatch.setattr(_cuda, "_creating", {})
    return fake


@pytest.fixture
def world(monkeypatch, native):
    """pg -> (rank, size, name) and one shared store, as the group's ranks would see them; the GPU
    path's cross-rank check on (RINGREDUCE_CHECK=1: refusal frames are sent, options.check is set)."""
    table: dict[int, tuple[int, int, str]] = {}
    store = dist.HashStore()
    store.set_timeout(datetime.timedelta(seconds=20))
    monkeypatch.setenv("RINGREDUCE_CHECK", "1")
    monkeypatch.setattr(dist, "get_rank", lambda pg: table[id(pg)][0])
    monkeypatch.setattr(dist, "get_world_size", lambda pg: table[id(pg)][1])
    monkeypatch.setattr(dist.distributed_c10d, "_get_process_group_store", lambda pg: store)
    monkeypatch.setattr(dist.distributed_c10d, "_get_process_group_name", lambda pg: table[id(pg)][2])

    def make(rank: int, size: int, name: str, pg: Any = None) -> GroupInfo:
        pg = pg if pg is not None else FakePG()
        table[id(pg)] = (rank, size, name)
        return GroupInfo(pg=pg, rank=rank, size=size, name=name)

    return make, store


def _create_on_ranks(infos: list[GroupInfo], delays: list[float]) -> list[Any]:
    out: list[Any] = [None] * len(infos)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            time.sleep(delays[i])
            out[i] = _cuda.communicator(infos[i], torch.device("cuda", i))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(infos))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors, errors
    return out


def test_ranks_agree_on_the_unique_id_after_release_and_recreate(world):
    make, _ = world
    a = [make(r, 2, "g") for r in range(2)]
    first = _create_on_ranks(a, [0.0, 0.0])
    assert first[0].uid == first[1].uid
    for info in a:
        _cuda.release_group(info.pg)
    again = _create_on_ranks(a, [0.0, 0.0])
    assert again[0].uid == again[1].uid
    assert again[0].uid != first[0].uid
    assert first[0].aborted and first[1].aborted


def test_reused_group_object_on_one_rank_only(world):
    # Rank 0's new group happens to be the same Python object (same id) as its released one;
    # rank 1's is a new object. Keys by id(pg) made rank 0 use generation 1 and rank 1 generation 0.
    make, _ = world
    a = [make(r, 2, "A") for r in range(2)]
    first = _create_on_ranks(a, [0.0, 0.0])
    for info in a:
        _cuda.release_group(info.pg)
    b = [make(0, 2, "B", pg=a[0].pg), make(1, 2, "B")]
    second = _create_on_ranks(b, [0.2, 0.0])
    assert second[0].uid == second[1].uid
    assert second[0].uid != first[0].uid


def test_a_reused_store_never_serves_an_old_id(world, monkeypatch):
    make, store = world
    a = [make(r, 2, "g") for r in range(2)]
    first = _create_on_ranks(a, [0.0, 0.0])
    # A new job (fresh module state) on the same store: rank 1 arrives long before rank 0.
    monkeypatch.setattr(_cuda, "_comms", {})
    monkeypatch.setattr(_cuda, "_creating", {})
    b = [make(r, 2, "g") for r in range(2)]
    second = _create_on_ranks(b, [0.3, 0.0])
    assert second[0].uid == second[1].uid != first[0].uid
    # Every lane's id reaches every rank (Note [Lanes]: a communicator per lane, 2 by default).
    assert second[0].lane_ids == second[1].lane_ids and len(second[0].lane_ids) == 1
    assert second[0].lane_ids[0] not in (second[0].uid, first[0].uid)
    # The ids are deleted once every rank read them.
    assert not store.check(["ringreduce/nccl_uid/g/0"])


def test_one_gpu_per_group(world):
    make, _ = world
    info = make(0, 1, "solo")
    comm = _cuda.communicator(info, torch.device("cuda", 0))
    assert _cuda.communicator(info, torch.device("cuda", 0)) is comm
    with pytest.raises(ValueError, match="one GPU per group"):
        _cuda.communicator(info, torch.device("cuda", 1))


def test_connect_timeout_is_at_least_the_store_timeout(world):
    make, store = world
    info = make(0, 1, "solo")
    comm = _cuda.communicator(info, torch.device("cuda", 0))
    assert comm.connect_timeout_ms == 20000


def test_default_device_refuses_gpu0_for_another_local_rank(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setenv("LOCAL_RANK", "2")
    with pytest.raises(ValueError, match=r"set_device\(2\)"):
        _cuda._default_device()
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert _cuda._default_device() == torch.device("cuda", 0)


# ---- Ctrl-C while a group's communicator is created (docs/design.md 1.4) ---------------------------


def test_ctrl_c_while_rank_0_never_publishes_the_ids(world):
    # store.get would block with the GIL released for the store's timeout (20 s here), out of reach
    # of Python's SIGINT handler; the rendezvous waits in slices instead.
    make, _ = world
    info = make(1, 2, "silent-rank-0")
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT))
    start = time.monotonic()
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            _cuda.communicator(info, torch.device("cuda", 0))
        elapsed = time.monotonic() - start
    finally:
        timer.cancel()
        timer.join()
        signal.signal(signal.SIGINT, previous)
    assert elapsed < 5.0, f"KeyboardInterrupt after {elapsed:.1f} s (the store's timeout is 20 s)"
    # The group is unusable for ringreduce on this rank, and says so.
    with pytest.raises(dist.DistBackendError, match="interrupted on this rank") as exc:
        _cuda.communicator(info, torch.device("cuda", 0))
    assert "unusable" in str(exc.value)
    _cuda.release_group(info.pg)
    assert id(info.pg) not in _cuda._interrupted


def test_rank_0_that_never_publishes_the_ids_raises_at_the_store_timeout(world):
    make, store = world
    store.set_timeout(datetime.timedelta(seconds=0.3))
    with pytest.raises(dist.DistStoreError, match="rank 0 of late did not publish the NCCL unique ids"):
        _cuda.communicator(make(1, 2, "late"), torch.device("cuda", 0))


def test_ctrl_c_during_native_creation_leaves_the_group_unusable(world, monkeypatch):
    make, _ = world
    info = make(0, 1, "solo")

    def interrupted_init(*args: Any, **kwargs: Any) -> Any:
        raise KeyboardInterrupt  # what C.CudaRing raises when Ctrl-C ends its wait for the other ranks

    with monkeypatch.context() as m:
        m.setattr(FakeC, "CudaRing", staticmethod(interrupted_init))
        with pytest.raises(KeyboardInterrupt):
            _cuda.communicator(info, torch.device("cuda", 0))
    with pytest.raises(dist.DistBackendError, match="interrupted on this rank") as exc:
        _cuda.communicator(info, torch.device("cuda", 0))
    assert "unusable" in str(exc.value) and "waited for its NCCL communicator" in str(exc.value)
    _cuda.release_group(info.pg)  # a new process group object would do the same
    assert isinstance(_cuda.communicator(info, torch.device("cuda", 0)), FakeComm)


# ---- What the calls hand to _C ---------------------------------------------------------------------


def _call(info: GroupInfo, kind: Any, rop: Any = None, **decided: Any) -> Any:
    """A checked call (ringreduce._call.Call) of `kind` on `info` with CUDA tensors."""
    from ringreduce._call import Call
    from ringreduce._types import ReduceOp

    return Call(info, kind, rop if rop is not None else ReduceOp.SUM, device=torch.device("cuda", 0), **decided)


def test_cuda_glue_one_communicator_per_group_with_group_ranks(world, native):
    """A ring over a rank list joins the group's communicator with the GROUP's rank and size (not
    the ring index/size), creates it once, and passes the rank list and local size to _C."""
    from ringreduce._types import CallKind, ReduceOp

    make, _ = world
    flat = make(0, 1, "world")
    t = FakeCudaTensor()
    # a made-up ring description whose index/size differ from the group's rank/size; a glue that
    # waited for a unique id under the ring index (not the group's rank 0) fails at the store timeout
    sub = GroupInfo(pg=flat.pg, rank=5, size=9, name="sub", members=(0,))
    ring = _cuda.CudaRing(sub)
    call = _call(sub, CallKind.ALL_REDUCE, members=(0,))
    assert ring.all_reduce(call, t, ring.options(call), False) == (None, None)
    call = _call(flat, CallKind.ALL_REDUCE_AVG, ReduceOp.AVG, local_size=2, members=(0,))
    handle, work = _cuda.CudaRing(flat).all_reduce(call, t, ring.options(call), True)
    assert handle is native and isinstance(work, Work) and work.result() == [t]
    out = FakeCudaTensor()
    _, half = ring.ring_half(_call(sub, CallKind.ALL_GATHER), t, out, True)
    assert isinstance(half, Work) and half.result() == [out]
    assert ring.ring_half(_call(sub, CallKind.REDUCE_SCATTER), t, out, False) == (None, None)
    with pytest.raises(ValueError):
        ring.ring_half(_call(sub, CallKind.ALL_REDUCE), t, out, False)
    assert len(native.comms) == 1, "one communicator per (group, device), shared by every ring"
    comm = native.comms[0]
    assert (comm.nranks, comm.rank, comm.device) == (1, 0, 0)
    assert [c[0] for c in native.calls] == ["all_reduce", "all_reduce", "ring_half", "ring_half"]
    assert native.calls[0][3:5] == ([0], 0)
    assert native.calls[1][3:5] == ([0], 2)
    assert native.calls[2][2:4] == (int(CallKind.ALL_GATHER), [0])


def test_cuda_glue_refusal_frames_go_around_the_call_ring(world, native):
    from ringreduce._types import CallKind

    make, _ = world
    info = GroupInfo(pg=make(0, 1, "world").pg, rank=0, size=2, name="sub", members=(0,))
    ring = _cuda.CudaRing(info)
    assert ring.refuse(_call(info, CallKind.REDUCE_SCATTER, local_error=5), ["ring"]) == []
    assert ring.refuse(_call(info, CallKind.ALL_REDUCE, local_error=5), ["auto"]) == []
    assert native.calls == [("refuse", native.comms[0], int(CallKind.REDUCE_SCATTER), [0]),
                            ("refuse", native.comms[0], int(CallKind.ALL_REDUCE), [0])]


def test_cuda_glue_passes_the_pipeline_knobs_the_ring_read(world, native, monkeypatch):
    """RINGREDUCE_SEGMENT_BYTES/_SLOTS/_LANES/_ONESHOT_BYTES reach the native call as overrides, read
    when the ring is made and at reload_knobs() (Note [Knobs are read when a ring is made]); unset,
    they leave the choice to the pipeline rule (0, 0, 0, -1); bad values raise ValueError before
    anything is sent."""
    import ringreduce as rr
    from ringreduce._types import CallKind

    make, _ = world
    info = make(0, 1, "world")
    t = FakeCudaTensor()
    for var in ("RINGREDUCE_SEGMENT_BYTES", "RINGREDUCE_SLOTS", "RINGREDUCE_LANES", "RINGREDUCE_ONESHOT_BYTES"):
        monkeypatch.delenv(var, raising=False)
    ring = _cuda.CudaRing(info)
    call = _call(info, CallKind.ALL_REDUCE)
    ring.all_reduce(call, t, ring.options(call), False)
    k = native.options[-1]
    assert (k.segment_bytes, k.num_slots, k.lanes, k.one_shot_bytes) == (0, 0, 0, -1)
    monkeypatch.setenv("RINGREDUCE_SEGMENT_BYTES", "4096")
    monkeypatch.setenv("RINGREDUCE_SLOTS", "3")
    monkeypatch.setenv("RINGREDUCE_LANES", "2")
    monkeypatch.setenv("RINGREDUCE_ONESHOT_BYTES", "0")
    ring.ring_half(_call(info, CallKind.REDUCE_SCATTER), t, FakeCudaTensor(), False)
    assert native.options[-1].segment_bytes == 0  # not reloaded: the ring keeps what it read
    rr.reload_knobs()
    ring.reload()  # what ring_for does at the ring's next call
    ring.ring_half(_call(info, CallKind.REDUCE_SCATTER), t, FakeCudaTensor(), False)
    k = native.options[-1]
    assert (k.segment_bytes, k.num_slots, k.lanes, k.one_shot_bytes) == (4096, 3, 2, 0)
    assert int(k.kind) == int(CallKind.REDUCE_SCATTER) and k.check, "a reduce-scatter, checked (RINGREDUCE_CHECK=1)"
    calls = len(native.calls)
    for var, bad in (("RINGREDUCE_LANES", "5"), ("RINGREDUCE_SEGMENT_BYTES", "8"), ("RINGREDUCE_ONESHOT_BYTES", "-2")):
        monkeypatch.setenv(var, bad)
        with pytest.raises(ValueError, match=var):
            _cuda.CudaRing(info)  # a ring made now reads it
        monkeypatch.delenv(var)
    assert len(native.calls) == calls
