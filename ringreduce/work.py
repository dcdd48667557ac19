"""Work: the handle of an asynchronous ringreduce call, shaped like torch.distributed's Work.

One class for every call: a Work waits for one native call handle (a CPU call, a CUDA work), or for
several Works of its own (all_reduce_coalesced's buffers, a backend call's parts) and then runs what
is left (copying results back) once. The torch.distributed backend's adapter (BackendWork,
ringreduce/distributed/work.py) wraps one.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ringreduce._interrupt import wait_sliced


def _milliseconds(timeout: datetime.timedelta | None) -> int:
    """A wait's bound in ms (-1: none); TypeError for anything but None or a timedelta."""
    if timeout is None:
        return -1
    if isinstance(timeout, datetime.timedelta):
        return max(0, int(timeout.total_seconds() * 1000))
    raise TypeError(f"timeout must be a datetime.timedelta or None, got {type(timeout).__name__}")


class Work:
    """Handle of an ``async_op=True`` call, shaped like torch.distributed's Work.

    CPU tensors: ``wait()`` blocks the host until the result is in the tensor; Ctrl-C interrupts a
    blocked wait and leaves the group unusable on this rank (Note [Ctrl-C] in ringreduce/_interrupt.py).
    CUDA tensors, as torch.distributed's NCCL Work: ``wait()`` makes the *current stream* wait for the
    call (the host blocks only with a ``timeout``), ``is_completed()`` polls the GPU, and
    ``get_future()`` completes when the call is *enqueued*: a host timestamp taken in its callback is the
    launch time; to know the call finished on the GPU, use ``wait(timeout=...)`` or
    ``torch.cuda.synchronize()``. A call that failed later (watchdog timeout, dead peer) raises on the
    next ``wait``/``is_success``/call on its group.
    """

    def __init__(
        self,
        handle: Any | None,
        result: list[torch.Tensor],
        *,
        describe: str = "ringreduce call",
        on_interrupt: Callable[[], None] | None = None,
        stream_wait: bool = False,
    ) -> None:
        self._handle = handle
        self._result = result
        self._describe = describe
        self._future: torch.futures.Future | None = None
        # What Ctrl-C during wait() does (Note [Ctrl-C] in ringreduce/_interrupt.py); its presence
        # makes host waits wait in slices. stream_wait (CUDA): wait() without a timeout only orders
        # the current stream and never blocks the host, so only a timed wait is sliced.
        self._on_interrupt = on_interrupt
        self._stream_wait = stream_wait
        self._parts: list[Work] | None = None  # a Work of several Works (of_parts)

    @classmethod
    def completed(cls, result: list[torch.Tensor]) -> Work:
        """A Work that is already done, holding `result` (a list of tensors): what a call returns with
        ``async_op=True`` when nothing needs to move (numel 0, a group of one rank, a rank outside the
        group, or a call traced by torch.compile)."""
        return cls(None, result)

    @classmethod
    def of_parts(cls, parts: Sequence[Work], result: list[torch.Tensor], finish: Callable[[], None] | None = None,
                 describe: str = "ringreduce call") -> Work:
        """A Work that waits for every one of `parts`, then runs `finish` (what is left once they
        completed, such as copying results back) exactly once; its future's value is `result`, and
        `describe` names it in messages."""
        work = cls(None, result, describe=describe)
        work._parts = list(parts)
        work._finish = finish
        work._finish_lock = threading.Lock()
        return work

    def _run_finish(self) -> None:
        with self._finish_lock:
            finish, self._finish = self._finish, None
        if finish is not None:
            finish()

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        """Waits for the call and returns True, as torch.distributed's ``Work.wait``.

        Args:
            timeout: None waits as long as the call runs (a dead or silent peer ends it with
                DistBackendError after the group's timeout); a ``datetime.timedelta`` bounds this
                wait only.

        CPU tensors: the host blocks until the result is in the tensor. CUDA tensors: the *current
        stream* waits for the call; the host does not block, unless `timeout` is given, which
        blocks the host up to `timeout`.

        Raises:
            RuntimeError: the ranks disagreed (the agreement check), or `timeout` passed before the
                call completed (the call goes on in the background).
            torch.distributed.DistBackendError: a peer died or the group's timeout passed.
            TypeError: `timeout` is neither None nor a ``datetime.timedelta``.
            KeyboardInterrupt: Ctrl-C during a blocked host wait (CPU, or CUDA with `timeout`; the
                group is unusable afterwards).
        """
        ms = _milliseconds(timeout)
        if self._parts is not None:
            deadline = None if ms < 0 else time.monotonic() + ms / 1000.0
            for part in self._parts:
                left = None if deadline is None else datetime.timedelta(seconds=max(0.0, deadline - time.monotonic()))
                part.wait(left)
            self._run_finish()
            return True
        if self._handle is not None:
            # host waits go in slices (Ctrl-C); a CUDA handle's wait(-1) is a stream wait, not a host one
            sliced = self._on_interrupt is not None and not (self._stream_wait and ms < 0)
            done = wait_sliced(self._handle, ms, self._on_interrupt) if sliced else self._handle.wait(ms)
            if not done:
                raise RuntimeError(
                    f"ringreduce: {self._describe} (call #{self._handle.seq}) did not complete within "
                    f"{timeout}; the ring is still running in the background"
                )
            if not self._handle.ok():
                self._handle.raise_error()
        return True

    def is_completed(self) -> bool:
        """True once the call finished, successfully or not (CUDA: polls the GPU; never blocks)."""
        if self._parts is not None:
            return all(p.is_completed() for p in self._parts)
        return self._handle is None or self._handle.is_completed()

    def is_success(self) -> bool:
        """True once the call finished without error; False while it runs or after it failed."""
        if self._parts is not None:
            return all(p.is_success() for p in self._parts)
        return self.is_completed() and (self._handle is None or self._handle.ok())

    def exception(self) -> BaseException | None:
        """The exception a failed call raises in ``wait()``, or None (still running, or succeeded)."""
        if self._parts is not None:
            return next((e for e in (p.exception() for p in self._parts) if e is not None), None)
        if self._handle is None or not self._handle.is_completed() or self._handle.ok():
            return None
        try:
            self._handle.raise_error()
        except BaseException as exc:  # noqa: BLE001 - returned, not swallowed
            return exc
        return None

    def get_future(self) -> torch.futures.Future:
        """A ``torch.futures.Future`` completed with the call: its value is ``[tensor]`` (a list, as
        torch.distributed's), its ``wait()`` raises the call's error.

        CPU: completed by ringreduce's worker thread when the result is in the tensor. CUDA: the
        future is CUDA-aware and completes when the call is *enqueued*; its ``wait()``/``then()``
        order the current stream after the call. A Work of several calls: completed once every call
        is, after its results were copied back.
        """
        if self._future is None:
            if self._parts is not None:
                self._future = self._future_of_parts()
            elif self._handle is None:
                fut: torch.futures.Future = torch.futures.Future()
                fut.set_result(self._result)
                self._future = fut
            else:
                self._future = self._handle.get_future()
        return self._future

    def _future_of_parts(self) -> torch.futures.Future:
        """A future of every part's future: raises the first error, else runs `finish`, then holds the
        result (the parts' own future when there is one part and nothing to finish)."""
        assert self._parts is not None
        if len(self._parts) == 1 and self._finish is None:
            return self._parts[0].get_future()

        def done(all_done: torch.futures.Future) -> list[torch.Tensor]:
            for f in all_done.value():
                f.value()  # raises the call's error
            self._run_finish()
            return self._result

        return torch.futures.collect_all([p.get_future() for p in self._parts]).then(done)

    def result(self) -> list[torch.Tensor]:
        """The call's output tensors as a list (``[tensor]``; all_gather: ``[gathered]``); read them
        after ``wait()``."""
        return self._result

    def __repr__(self) -> str:
        state = "completed" if self.is_completed() else "pending"
        return f"<ringreduce.{type(self).__name__} {self._describe} {state}>"
