"""Timers: rounds of back-to-back calls timed as a whole (nccl-tests), and single calls. The host clock
on CPU, where calls are synchronous; an event pair on the current stream on CUDA, where collectives
return once queued.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch


class CallTimer:
    """Collects the duration of each call to ``time(fn)``; ``seconds()`` returns them in order."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._spans: list[Any] = []  # seconds on the host clock, or (start, end) CUDA events

    def time(self, fn: Callable[[], None]) -> None:
        """Runs fn once and records its duration."""
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            self._spans.append((start, end))
        else:
            t0 = time.perf_counter()
            fn()
            self._spans.append(time.perf_counter() - t0)

    def seconds(self) -> list[float]:
        """Durations in seconds of every timed call so far (synchronizes the device on CUDA)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return [s.elapsed_time(e) / 1e3 for s, e in self._spans]
        return list(self._spans)


def time_round(fn: Callable[[], None], iters: int, device: torch.device) -> float:
    """Seconds per call of `iters` back-to-back calls of fn, timed together."""
    def calls() -> None:
        for _ in range(iters):
            fn()

    timer = CallTimer(device)
    timer.time(calls)
    return timer.seconds()[0] / iters


def summarize(seconds: list[float]) -> dict[str, float]:
    """median/mean/min of per-call durations, in microseconds."""
    us = [s * 1e6 for s in seconds]
    return {
        "median_us": statistics.median(us),
        "mean_us": statistics.fmean(us),
        "min_us": min(us),
    }


def auto_iters(estimate_s: float, seconds_per_size: float, min_iters: int, max_iters: int) -> int:
    """Iterations so that one implementation spends about `seconds_per_size` on a size."""
    if estimate_s <= 0:
        return max_iters
    return int(max(min_iters, min(max_iters, round(seconds_per_size / estimate_s))))
