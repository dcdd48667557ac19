"""Peak memory of one call: resident set size (Linux VmHWM, resettable) and CUDA allocations."""

from __future__ import annotations

import resource
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class CallMemory:
    """Memory of one call (bytes): peak RSS, its growth over the RSS before, torch's CUDA peak growth."""

    peak_rss: int
    rss_growth: int
    rss_exact: bool  # False: VmHWM could not be reset, peak is the process lifetime's
    cuda_growth: int | None = None


def _status_bytes(key: str) -> int | None:
    """The /proc/self/status line `key` ("VmRSS:", "VmHWM:") in bytes; None where unreadable."""
    try:
        with open("/proc/self/status") as f:
            return next((int(line.split()[1]) * 1024 for line in f if line.startswith(key)), None)
    except OSError:
        return None


def _lifetime_peak_rss() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def measure_call(fn: Callable[[], None], device: torch.device) -> CallMemory:
    """Runs `fn` once and reports the memory it needed (see CallMemory)."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        cuda_before = torch.cuda.memory_allocated(device)
    try:  # resets the kernel's peak-RSS mark (VmHWM) to the current RSS
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        exact = True
    except OSError:
        exact = False
    before = _status_bytes("VmRSS:") or _lifetime_peak_rss()
    fn()
    if cuda:
        torch.cuda.synchronize(device)
    peak = (_status_bytes("VmHWM:") if exact else None) or _lifetime_peak_rss()
    cuda_growth = torch.cuda.max_memory_allocated(device) - cuda_before if cuda else None
    return CallMemory(peak_rss=peak, rss_growth=max(0, peak - before), rss_exact=exact, cuda_growth=cuda_growth)
