"""Environment knobs, read at call time so tests can change them per call."""

from __future__ import annotations

import os

DEFAULT_SEGMENT_BYTES = 1 << 20
DEFAULT_NUM_SLOTS = 4


def _int_env(name: str, default: int, minimum: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"ringreduce: {name}={raw!r} is not an integer") from None
    if value < minimum:
        raise ValueError(f"ringreduce: {name}={value} must be >= {minimum}")
    return value


def segment_bytes() -> int:
    """Largest segment the ring sends at once (RINGREDUCE_SEGMENT_BYTES, default 1 MiB)."""
    return _int_env("RINGREDUCE_SEGMENT_BYTES", DEFAULT_SEGMENT_BYTES, 16)


def num_slots() -> int:
    """Staging slots, i.e. segments in flight (RINGREDUCE_SLOTS, default 4)."""
    return _int_env("RINGREDUCE_SLOTS", DEFAULT_NUM_SLOTS, 1)


def check_enabled(is_cuda: bool) -> bool:
    """Cross-rank agreement check: on by default on CPU, opt-in on GPU (RINGREDUCE_CHECK)."""
    raw = os.environ.get("RINGREDUCE_CHECK")
    if raw is None or raw == "":
        return not is_cuda
    return raw not in ("0", "false", "False", "off")


def timeout_ms() -> int:
    """RINGREDUCE_TIMEOUT in seconds (float) overrides the group's timeout; -1 means the group's."""
    raw = os.environ.get("RINGREDUCE_TIMEOUT")
    if raw is None or raw == "":
        return -1
    try:
        seconds = float(raw)
    except ValueError:
        raise ValueError(f"ringreduce: RINGREDUCE_TIMEOUT={raw!r} is not a number of seconds") from None
    if seconds <= 0:
        raise ValueError(f"ringreduce: RINGREDUCE_TIMEOUT={raw!r} must be > 0")
    return max(1, int(seconds * 1000))


def run_inline() -> bool:
    """RINGREDUCE_INLINE=1: run a synchronous CPU call on the calling thread when nothing is queued
    before it (saves two thread handoffs). Off by default: on the 2-vCPU VMs this project measures on,
    the handoff to the group's worker gave steadier and, in the median, lower latency (see
    docs/algorithm.md, "Where the time goes")."""
    return os.environ.get("RINGREDUCE_INLINE", "") in ("1", "true", "True", "on")


def recv_only_waits() -> bool:
    """RINGREDUCE_RECV_ONLY_WAITS=0: CPU reduces wait for both halves of their exchange (diagnostic;
    default on: a reduce waits only for the receive it consumes, see plan.h)."""
    return os.environ.get("RINGREDUCE_RECV_ONLY_WAITS", "1") not in ("0", "false", "False", "off")
