"""ringreduce's environment knobs: declared once in KNOBS (name, default, meaning), read here when a
ring is made (Note [Knobs are read when a ring is made]). README's "Knobs" table is KNOBS as markdown
(`ringreduce._config.knobs_markdown()`; tests/tools/test_knobs.py holds README and the sources to it).

Note [Knobs are read when a ring is made]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
As NCCL reads its NCCL_* parameters and c10d its TORCH_* variables when a communicator or a group is
created, a ring (ringreduce/_rings: one per process group, rank list and device) reads every knob once,
into a frozen Knobs, when it is made: at its group's first ringreduce call. A change of the environment
after that is seen by the rings made afterwards (a new group) and, for the rings that exist, after
``ringreduce.reload_knobs()``, which reads the environment again (raising ValueError for a bad value at
once) and starts a new epoch: each ring reads its knobs again at its next call. Nothing watches
os.environ; a call reads no environment variable.
"""

from __future__ import annotations

import math
import os
import threading
from dataclasses import dataclass
from typing import NamedTuple


class Knob(NamedTuple):
    """One RINGREDUCE_* environment variable the library reads."""

    name: str
    default: str  # as the docs state it
    meaning: str


KNOBS: tuple[Knob, ...] = (
    Knob("RINGREDUCE_SEGMENT_BYTES", "1048576 (CPU), the pipeline rule (GPU)",
         "largest message of the ring; on GPU it caps the rule's segment (as large as a staging slot, at most "
         "half a chunk)"),
    Knob("RINGREDUCE_SLOTS", "auto (CPU), 2 per lane (GPU)",
         "staging slots = receives posted ahead (memory: slots x segment); CPU auto: a slot per receive when "
         "they fit in 6 MiB, else 4"),
    Knob("RINGREDUCE_LANES", "2 (GPU)",
         "GPU rings side by side, each on its own NCCL communicator (1-4; read when a group's communicator is "
         "created, and per call); `1` turns lanes off; never changes a result bit"),
    Knob("RINGREDUCE_ONESHOT_BYTES", "1 MiB (<= 4 ranks), 256 KiB (<= 8), 64 KiB (GPU)",
         "largest GPU all-reduce sent whole to every peer in one NCCL group and reduced in the ring's order "
         "(same bits as the ring; at most a set `RINGREDUCE_SEGMENT_BYTES`); `0` turns it off"),
    Knob("RINGREDUCE_CHECK", "on (CPU), off (GPU)",
         "the cross-rank agreement check; `0` turns it off, `1` turns it on"),
    Knob("RINGREDUCE_TIMEOUT", "the group's timeout",
         "seconds (> 0, at most 10^9) before a silent peer raises `DistBackendError`"),
    Knob("RINGREDUCE_DEBUG", "off",
         "`INFO` logs every call (rank, call #, op, dtype, numel, time); `DETAIL` adds the ring's parameters "
         "and where the time went"),
    Knob("RINGREDUCE_LOCAL_SIZE", "from torchrun",
         "simulate nodes of this many consecutive ranks (hierarchical all-reduce on one host)"),
    Knob("RINGREDUCE_NCCL_SIMPLE", "0, or 1 where NCCL < 2.23 or NCCL_COMM_* overrides ask for it",
         "`1`: GPU groups take the simplest path (one lane, no one-shot, no split child; every exchange waited "
         "on the one non-blocking communicator), with one warning naming the NCCL version; set it on every "
         "rank (read when a communicator is created)"),
    Knob("RINGREDUCE_WIRE_GATHER", "auto",
         "the all-gather's width with `wire_dtype`: `16`: the owner rounds its finished shard once to the wire "
         "type and the all-gather moves those 16 bits (0.5 of float32's bytes; CPU rings only, a GPU call "
         "refuses it); `32`: it moves float32 (0.75); `auto`: 16 where the CPU ring spans several nodes, 32 on "
         "one node and on GPUs (docs/algorithm.md, \"A 16-bit all-gather\")"),
    Knob("RINGREDUCE_SHM", "on",
         "`0`: CPU ranks on one host use gloo point-to-point instead of shared memory"),
)


def knobs_markdown() -> str:
    """KNOBS as README's markdown table."""
    rows = ["| variable | default | meaning |", "|---|---|---|"]
    rows += [f"| `{k.name}` | {k.default} | {k.meaning} |" for k in KNOBS]
    return "\n".join(rows)


DEFAULT_SEGMENT_BYTES = 1 << 20
AUTO_SLOTS = 0  # CPU default: a staging slot per receive when they fit (Note [Staging slots], plan.h)
MAX_LANES = 4  # kGpuMaxLanes (csrc/cuda/gpu_pipeline.h)
DEFAULT_LANES = 2  # kGpuDefaultLanes: the lanes (communicators) a GPU group's communicator is created with


def _env(name: str, default: str | None = None) -> str | None:
    return os.environ.get(name, default)


# Upper bounds: the native field each knob ends in (csrc/core/call_options.h: int64_t segment_bytes and
# one_shot_bytes, int32_t num_slots and local_size), so that a value read here always reaches it.
INT32_MAX = (1 << 31) - 1
INT64_MAX = (1 << 63) - 1
# RINGREDUCE_TIMEOUT's largest value in seconds: the runtimes add the timeout to std::chrono's
# steady_clock, which counts nanoseconds in 64 bits (2^63 ns: 292 years); 10^9 s (31.7 years) keeps that
# sum far from overflowing.
MAX_TIMEOUT_S = 1e9


def _int_env(name: str, default: int, minimum: int, maximum: int) -> int:
    """The integer knob `name` (`default` when unset or empty), ValueError naming it unless
    minimum <= value <= maximum."""
    raw = _env(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"ringreduce: {name}={raw!r} is not an integer") from None
    if value < minimum:
        raise ValueError(f"ringreduce: {name}={value} must be >= {minimum}")
    if value > maximum:
        raise ValueError(f"ringreduce: {name}={value} must be <= {maximum}")
    return value


def segment_bytes(default: int = DEFAULT_SEGMENT_BYTES) -> int:
    """Largest segment the ring sends at once (RINGREDUCE_SEGMENT_BYTES), `default` when unset (GPUs: 0,
    the pipeline rule then picks the segment)."""
    return _int_env("RINGREDUCE_SEGMENT_BYTES", default, 16, INT64_MAX)


def lanes() -> int:
    """RINGREDUCE_LANES (KNOBS), 0 when unset (the pipeline rule's choice)."""
    return _int_env("RINGREDUCE_LANES", 0, 1, MAX_LANES)


def one_shot_bytes() -> int:
    """RINGREDUCE_ONESHOT_BYTES (KNOBS), -1 when unset (the pipeline rule's threshold)."""
    return _int_env("RINGREDUCE_ONESHOT_BYTES", -1, 0, INT64_MAX)


def num_slots() -> int:
    """RINGREDUCE_SLOTS (KNOBS), AUTO_SLOTS when unset (resolved per call by each path)."""
    return _int_env("RINGREDUCE_SLOTS", AUTO_SLOTS, 1, INT32_MAX)


_OFF = ("0", "false", "False", "off")


def check_enabled(is_cuda: bool) -> bool:
    """Cross-rank agreement check: on by default on CPU, opt-in on GPU (RINGREDUCE_CHECK)."""
    raw = _env("RINGREDUCE_CHECK")
    return raw not in _OFF if raw else not is_cuda


def timeout_ms() -> int:
    """RINGREDUCE_TIMEOUT in seconds (float, > 0 and at most MAX_TIMEOUT_S) overrides the group's
    timeout; -1 means the group's."""
    raw = _env("RINGREDUCE_TIMEOUT")
    if raw is None or raw == "":
        return -1
    try:
        seconds = float(raw)
    except ValueError:
        raise ValueError(f"ringreduce: RINGREDUCE_TIMEOUT={raw!r} is not a number of seconds") from None
    if not math.isfinite(seconds):
        raise ValueError(f"ringreduce: RINGREDUCE_TIMEOUT={raw!r} must be a finite number of seconds")
    if seconds <= 0:
        raise ValueError(f"ringreduce: RINGREDUCE_TIMEOUT={raw!r} must be > 0")
    if seconds > MAX_TIMEOUT_S:
        raise ValueError(f"ringreduce: RINGREDUCE_TIMEOUT={raw!r} must be <= {MAX_TIMEOUT_S:.0e} seconds (about 31 "
                         "years; unset it for the group's own timeout)")
    return max(1, int(seconds * 1000))


WIRE_GATHER_VALUES = ("auto", "16", "32")


def wire_gather() -> str:
    """RINGREDUCE_WIRE_GATHER: the all-gather's width of a 16-bit wire, "auto" (default), "16" or "32"."""
    raw = (_env("RINGREDUCE_WIRE_GATHER") or "auto").strip().lower()
    if raw not in WIRE_GATHER_VALUES:
        raise ValueError(f"ringreduce: RINGREDUCE_WIRE_GATHER={raw!r} must be one of {WIRE_GATHER_VALUES} "
                         "(the all-gather's width with wire_dtype)")
    return raw


def shm_enabled() -> bool:
    """RINGREDUCE_SHM (KNOBS), read at a ring's first call (its ranks use gloo if any of them says 0)."""
    return _env("RINGREDUCE_SHM") not in _OFF


def debug_setting() -> str:
    """RINGREDUCE_DEBUG, upper-cased ("" when unset)."""
    return (_env("RINGREDUCE_DEBUG") or "").upper()


def local_size_override() -> int | None:
    """RINGREDUCE_LOCAL_SIZE: simulate nodes of this many consecutive global ranks (tests, one host)."""
    raw = (_env("RINGREDUCE_LOCAL_SIZE") or "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if not 1 <= value <= INT32_MAX:
        raise ValueError(f"RINGREDUCE_LOCAL_SIZE must be a positive integer of at most {INT32_MAX}, got {raw!r}")
    return value



_DEBUG_OFF = ("", "0", "OFF", "WARN", "WARNING")


@dataclass(frozen=True)
class Knobs:
    """Every knob of KNOBS as one ring read it (Note [Knobs are read when a ring is made]); read() makes one."""

    segment_bytes: int  # RINGREDUCE_SEGMENT_BYTES; 0 when unset (CPU: DEFAULT_SEGMENT_BYTES, GPU: the rule's)
    num_slots: int  # RINGREDUCE_SLOTS; AUTO_SLOTS when unset
    lanes: int  # RINGREDUCE_LANES; 0 when unset
    one_shot_bytes: int  # RINGREDUCE_ONESHOT_BYTES; -1 when unset
    check: str  # RINGREDUCE_CHECK as set ("" when unset): check_enabled() decides per device
    timeout_ms: int  # RINGREDUCE_TIMEOUT in ms; -1: the group's timeout
    debug: int  # RINGREDUCE_DEBUG: 0 off, 1 INFO, 2 DETAIL
    local_size: int | None  # RINGREDUCE_LOCAL_SIZE
    wire_gather: str  # RINGREDUCE_WIRE_GATHER: "auto", "16" or "32"
    shm: bool  # RINGREDUCE_SHM
    # the launcher's node layout (torchrun's GROUP_RANK, LOCAL_WORLD_SIZE, WORLD_SIZE), read with the knobs
    launcher: tuple[str | None, str | None, str | None]

    def check_enabled(self, is_cuda: bool) -> bool:
        """The cross-rank agreement check: on by default on CPU, opt-in on GPU."""
        return self.check not in _OFF if self.check else not is_cuda

    def cpu_segment_bytes(self) -> int:
        return self.segment_bytes or DEFAULT_SEGMENT_BYTES


def read() -> Knobs:
    """Every knob from the environment now, checked (ValueError names a bad one)."""
    debug = debug_setting()
    return Knobs(
        segment_bytes=segment_bytes(0), num_slots=num_slots(), lanes=lanes(), one_shot_bytes=one_shot_bytes(),
        check=_env("RINGREDUCE_CHECK") or "", timeout_ms=timeout_ms(),
        debug=0 if debug in _DEBUG_OFF else 2 if debug == "DETAIL" else 1, local_size=local_size_override(),
        wire_gather=wire_gather(), shm=shm_enabled(),
        launcher=(_env("GROUP_RANK"), _env("LOCAL_WORLD_SIZE"), _env("WORLD_SIZE")),
    )


_epoch_lock = threading.Lock()
epoch = 0  # reload() starts a new one; a ring whose knobs are of an older epoch reads them again


def reload() -> Knobs:
    """ringreduce.reload_knobs(): starts a new epoch, so that every ring reads its knobs again at its
    next call, and reads (and checks) them now; a bad value raises here and at those calls."""
    global epoch
    with _epoch_lock:
        epoch += 1
    return read()
