"""BackendWork: torch.distributed's Work for a call of the "ringreduce" backend, over one ringreduce.Work."""

from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ringreduce.work import Work

_TorchWork = dist._Work if hasattr(dist, "_Work") else torch._C._distributed_c10d.Work


class TorchHandle:
    """An inner backend's torch Work as the native handle a ringreduce.Work waits on (wait(ms) -> bool,
    ok(), raise_error(), is_completed(), get_future(), seq)."""

    seq = None

    def __init__(self, work: Any) -> None:
        self._work = work
        self._error: BaseException | None = None

    def wait(self, ms: int) -> bool:
        try:
            # torch's Work.wait takes a timedelta; zero (kNoTimeout) waits as long as the call runs
            self._work.wait(datetime.timedelta(milliseconds=max(ms, 0)))
        except Exception as exc:  # noqa: BLE001 - the call's own error, raised by raise_error()
            self._error = exc
        return True

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def ok(self) -> bool:
        if self._error is None and self._work.is_completed():
            try:
                self._work.get_future().value()
            except Exception as exc:  # noqa: BLE001 - kept, as torch's Work keeps it
                self._error = exc
        return self._error is None

    def raise_error(self) -> None:
        if self._error is not None:
            raise self._error

    def get_future(self) -> torch.futures.Future:
        return self._work.get_future()


class BackendWork(_TorchWork):  # type: ignore[misc, valid-type]
    """What ``dist.all_reduce(t, group=g, async_op=True)`` returns on a "ringreduce" group.

    Adapts one :class:`ringreduce.Work` made of the call's parts (ringreduce Works, and torch Works of
    the inner backend) and `finish`, what is left once they completed (copying a list form's blocks
    into the caller's tensors), to torch's Work. ``wait(timeout)`` as torch's: a zero or absent timeout
    waits as long as the call runs; errors raise as ringreduce's (DistBackendError for a dead or
    silent peer, RuntimeError for ranks that disagree or a timeout that passed). ``get_future()``
    completes with `result`, the list of output tensors (DDP reads it).
    """

    def __init__(self, parts: Sequence[Any], result: list[torch.Tensor],
                 finish: Callable[[], None] | None = None) -> None:
        super().__init__()
        works = [p if isinstance(p, Work) else Work(TorchHandle(p), result) for p in parts if p is not None]
        self._work = Work.of_parts(works, result, finish)

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        if timeout is not None and timeout <= datetime.timedelta(0):
            timeout = None  # torch's kNoTimeout (0 ms): the C++ side passes it when none was given
        return self._work.wait(timeout)

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def is_success(self) -> bool:
        return self._work.is_success()

    def exception(self) -> BaseException | None:
        return self._work.exception()

    def result(self) -> list[torch.Tensor]:
        return self._work.result()

    def get_future(self) -> torch.futures.Future:
        return self._work.get_future()
