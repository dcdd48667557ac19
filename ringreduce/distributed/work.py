"""BackendWork: torch.distributed's Work for a ring call of the "ringreduce" backend."""

from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ringreduce.work import Work, Works

_TorchWork = dist._Work if hasattr(dist, "_Work") else torch._C._distributed_c10d.Work


class BackendWork(Works, _TorchWork):  # type: ignore[misc, valid-type]
    """What ``dist.all_reduce(t, group=g, async_op=True)`` returns on a "ringreduce" group.

    Wraps ringreduce's own :class:`ringreduce.Work` calls (several for a coalesced list of
    reduce-scatters or all-gathers) and `finish`, what is left to do once they completed (copying a
    list form's blocks into the caller's tensors). ``wait(timeout)`` as torch's: a zero or absent
    timeout waits as long as the call runs; errors raise as ringreduce's (DistBackendError for a
    dead or silent peer, RuntimeError for ranks that disagree or a timeout that passed).
    ``get_future()`` completes with `result`, the list of output tensors (DDP reads it).
    """

    def __init__(self, works: Sequence[Work | TorchWorkCall | None], result: list[torch.Tensor],
                 finish: Callable[[], None] | None = None) -> None:
        super().__init__()
        self._hold([w for w in works if w is not None], result, finish)

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        if timeout is not None and timeout <= datetime.timedelta(0):
            timeout = None  # torch's kNoTimeout (0 ms): the C++ side passes it when none was given
        for work in self._works:
            work.wait(timeout)
        self._run_finish()
        return True

    def result(self) -> list[torch.Tensor]:
        return self._result

    def get_future(self) -> torch.futures.Future:
        if self._all_future is None and len(self._works) == 1 and self._finish is None:
            self._all_future = self._works[0].get_future()  # its value is already [tensor] (CUDA: CUDA-aware)
        return self._future_of_all()  # no works: completed at once, `finish` run


class TorchWorkCall:
    """A torch c10d Work (an inner backend's) as BackendWork waits on it, like one of ringreduce's Works."""

    def __init__(self, work: Any) -> None:
        self._work = work
        self._error: BaseException | None = None

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        try:
            # torch's Work.wait takes a timedelta; zero (kNoTimeout) waits as long as the call runs
            return self._work.wait(timeout if timeout is not None else datetime.timedelta(0))
        except Exception as exc:
            self._error = exc
            raise

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def is_success(self) -> bool:
        return self._work.is_completed() and self.exception() is None

    def exception(self) -> BaseException | None:
        """The call's error once it completed (its future's), else None."""
        if self._error is None and self._work.is_completed():
            try:
                self._work.get_future().value()
            except Exception as exc:  # noqa: BLE001 - the call's own error, handed back as torch's Work does
                self._error = exc
        return self._error

    def get_future(self) -> torch.futures.Future:
        return self._work.get_future()
