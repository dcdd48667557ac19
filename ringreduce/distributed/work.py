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

    ``failing_quietly(report)`` makes a failed call end as an aborted torch Work ends, for torchft
    (Note [Failed steps, not exceptions] in ringreduce/torchft.py): ``wait()`` returns False and the
    future completes with `result` as the failure left it, while `report` gets the error (the
    group's ``errored()``); ``is_success()`` and ``exception()`` still tell the failure.
    """

    def __init__(self, parts: Sequence[Any], result: list[torch.Tensor],
                 finish: Callable[[], None] | None = None) -> None:
        super().__init__()
        works = [p if isinstance(p, Work) else Work(TorchHandle(p), result) for p in parts if p is not None]
        self._work = Work.of_parts(works, result, finish)
        self._report: Callable[[BaseException], None] | None = None
        self._quiet_future: torch.futures.Future | None = None

    def failing_quietly(self, report: Callable[[BaseException], None]) -> BackendWork:
        """This Work, its failure handed to `report` instead of raised (see the class); returns self."""
        self._report = report
        return self

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        if timeout is not None and timeout <= datetime.timedelta(0):
            timeout = None  # torch's kNoTimeout (0 ms): the C++ side passes it when none was given
        if self._report is None:
            return self._work.wait(timeout)
        try:
            return self._work.wait(timeout)
        except Exception as exc:
            if not self._work.is_completed():
                raise  # a `timeout` that passed first: the call goes on
            # without its traceback, whose frames hold this Work and so its group (a cycle)
            self._report(exc.with_traceback(None))
            return False

    def synchronize(self) -> None:
        self.wait()

    def block_current_stream(self) -> None:
        """torchft's _ManagedWork on CUDA: wait() of a CUDA call orders the current stream after it
        (ringreduce.Work); a CPU call waits on the host."""
        self.wait()

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def is_success(self) -> bool:
        return self._work.is_success()

    def exception(self) -> BaseException | None:
        exc = self._work.exception()
        if exc is None or self._report is None:
            return exc
        return exc.with_traceback(None)  # its frames hold this Work: a cycle only the collector frees

    def result(self) -> list[torch.Tensor]:
        return self._work.result()

    def get_future(self) -> torch.futures.Future:
        if self._report is None:
            return self._work.get_future()
        if self._quiet_future is None:
            work, report = self._work, self._report

            def settle(fut: torch.futures.Future) -> list[torch.Tensor]:
                try:
                    return fut.value()
                except Exception as exc:  # noqa: BLE001 - handed to report (failing_quietly)
                    report(exc.with_traceback(None))
                    return work.result()

            self._quiet_future = work.get_future().then(settle)
        return self._quiet_future
