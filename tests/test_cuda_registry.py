"""The GPU path's communicator registry (ringreduce/_cuda.py), on the CPU: no GPU, no NCCL.

ringreduce._C is replaced by a recorder and the group's store by an in-process HashStore, so the
rendezvous of the NCCL unique id and the one-GPU-per-group rule run as they would on GPUs, with
ranks as threads. Guards issue 15's defects 7 (generation keys that let ranks disagree or read an
old id) and 15 (device mix-ups), and Ctrl-C while a communicator is created (docs/design.md 1.4).
"""

from __future__ import annotations

import datetime
import os
import signal
import threading
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from ringreduce import _cuda
from ringreduce._groups import GroupInfo


class FakeComm:
    def __init__(self, uid: bytes, nranks: int, rank: int, device: int, timeout_ms: int, name: str,
                 staging_bytes: int, connect_timeout_ms: int = 0, lane_ids: tuple = ()) -> None:
        self.uid = uid
        self.lane_ids = list(lane_ids)
        self.rank = rank
        self.device = device
        self.connect_timeout_ms = connect_timeout_ms
        self.aborted = False

    def abort(self, reason: str, at_exit: bool = False) -> None:
        self.aborted = True


class FakeC:
    native_info = {"cuda": True}
    counter = 0

    def nccl_unique_id(self) -> bytes:
        FakeC.counter += 1
        return f"uid-{FakeC.counter}".encode()

    def cuda_group_timeout_ms(self, pg: Any) -> int:
        return 1000

    def cuda_all_reduce(self, *args: Any) -> None:  # only its presence is checked
        return None

    CudaRing = FakeComm


class FakePG:
    pass


@pytest.fixture
def world(monkeypatch):
    """pg -> (rank, size, name) and one shared store, as the group's ranks would see them."""
    table: dict[int, tuple[int, int, str]] = {}
    store = dist.HashStore()
    store.set_timeout(datetime.timedelta(seconds=20))
    monkeypatch.setattr(_cuda, "_native", lambda: FakeC())
    monkeypatch.setattr(_cuda, "_comms", {})
    monkeypatch.setattr(_cuda, "_creating", {})
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

    monkeypatch.setattr(FakeC, "CudaRing", staticmethod(interrupted_init))
    with pytest.raises(KeyboardInterrupt):
        _cuda.communicator(info, torch.device("cuda", 0))
    monkeypatch.setattr(FakeC, "CudaRing", FakeComm)
    with pytest.raises(dist.DistBackendError, match="interrupted on this rank") as exc:
        _cuda.communicator(info, torch.device("cuda", 0))
    assert "unusable" in str(exc.value) and "waited for its NCCL communicator" in str(exc.value)
    _cuda.release_group(info.pg)  # a new process group object would do the same
    assert isinstance(_cuda.communicator(info, torch.device("cuda", 0)), FakeComm)
