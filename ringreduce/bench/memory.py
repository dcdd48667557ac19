"""Peak memory of one call: resident set size (Linux VmHWM, resettable) and CUDA allocations."""

from __future__ import annotations

import os
import resource
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def current_rss() -> int:
    """Resident set size of this process now, in bytes."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except OSError:
        return lifetime_peak_rss()


def lifetime_peak_rss() -> int:
    """Peak RSS of this process since it started (getrusage), in bytes."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def _read_hwm() -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def reset_peak_rss() -> bool:
    """Resets the kernel's peak-RSS mark (VmHWM) to the current RSS; False where unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


@dataclass
class CallMemory:
    """Memory of one call (bytes): peak RSS, its growth over the RSS before, torch's CUDA peak growth."""

    peak_rss: int
    rss_growth: int
    rss_exact: bool  # False: VmHWM could not be reset, peak is the process lifetime's
    cuda_growth: int | None = None


def measure_call(fn: Callable[[], None], device: torch.device) -> CallMemory:
    """Runs `fn` once and reports the memory it needed (see CallMemory)."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        cuda_before = torch.cuda.memory_allocated(device)
    exact = reset_peak_rss()
    before = current_rss()
    fn()
    if cuda:
        torch.cuda.synchronize(device)
    peak = _read_hwm() if exact else None
    if peak is None:
        peak = lifetime_peak_rss()
    cuda_growth = torch.cuda.max_memory_allocated(device) - cuda_before if cuda else None
    return CallMemory(peak_rss=peak, rss_growth=max(0, peak - before), rss_exact=exact, cuda_growth=cuda_growth)
