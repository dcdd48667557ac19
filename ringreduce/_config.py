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
         "the cross-rank agreement check; `0`, `false`, `off` or `no` turns it off, `1`, `true`, `on` or `yes` "
         "turns it on (any case; anything else raises `ValueError`); set it alike on every rank (a ring's ranks "
         "compare it at its first call)"),
    Knob("RINGREDUCE_TIMEOUT", "the group's timeout",
         "seconds (> 0, at most 10^9) before a silent peer raises `DistBackendError`"),
    Knob("RINGREDUCE_DEBUG", "off",
         "`INFO` logs every call (rank, call #, op, dtype, numel, time); `DETAIL` adds the ring's parameters "
         "and where the time went"),
    Knob("RINGREDUCE_LOCAL_SIZE", "from torchrun",
         "simulate nodes of this many consecutive ranks (hierarchical all-reduce on one host); set it alike on "
         "every rank (a ring's ranks compare it, and the launcher's layout, at its first call)"),
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
         "`0` (or `false`, `off`, `no`; `1`, `true`, `on`, `yes`: on; any case): CPU ranks on one host use gloo "
         "point-to-point instead of shared memory (all of a ring's ranks do where any of them says 0)"),
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


# The spellings of a boolean knob (RINGREDUCE_CHECK, RINGREDUCE_SHM), compared stripped and lower-cased;
# unset or empty: the knob's default; anything else raises ValueError naming the knob.
_OFF = ("0", "false", "off", "no")
_ON = ("1", "true", "on", "yes")


def bool_value(name: str, raw: str | None) -> bool | None:
    """The boolean knob `name` set to `raw`: True (_ON), False (_OFF) or None (unset, empty or blank:
    the default); ValueError naming the knob and the spellings it takes otherwise."""
    if raw is None:
        return None
    word = raw.strip().lower()
    if not word:
        return None
    if word in _ON:
        return True
    if word in _OFF:
        return False
    raise ValueError(f"ringreduce: {name}={raw!r} is not a boolean: use one of {', '.join(_OFF)} (off) or "
                     f"{', '.join(_ON)} (on), in any case")


def _bool_env(name: str) -> bool | None:
    return bool_value(name, _env(name))


def check_enabled(is_cuda: bool) -> bool:
    """Cross-rank agreement check: on by default on CPU, opt-in on GPU (RINGREDUCE_CHECK)."""
    value = _bool_env("RINGREDUCE_CHECK")
    return not is_cuda if value is None else value


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
    """RINGREDUCE_SHM (KNOBS), read at a ring's first call (its ranks use gloo if any of them says 0:
    the native setup agrees on it, Note [Shared-memory segments] in csrc/cpu/shm_path.cpp)."""
    value = _bool_env("RINGREDUCE_SHM")
    return True if value is None else value


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
    check: str  # RINGREDUCE_CHECK as set, stripped ("" when unset), a valid spelling: check_enabled() decides per device
    timeout_ms: int  # RINGREDUCE_TIMEOUT in ms; -1: the group's timeout
    debug: int  # RINGREDUCE_DEBUG: 0 off, 1 INFO, 2 DETAIL
    local_size: int | None  # RINGREDUCE_LOCAL_SIZE
    wire_gather: str  # RINGREDUCE_WIRE_GATHER: "auto", "16" or "32"
    shm: bool  # RINGREDUCE_SHM
    # the launcher's node layout (torchrun's GROUP_RANK, LOCAL_WORLD_SIZE, WORLD_SIZE), read with the knobs
    launcher: tuple[str | None, str | None, str | None]
    # RINGREDUCE_NCCL_SIMPLE as set, stripped ("" when unset): the native side reads and checks it when a
    # GPU communicator is created (csrc/cuda/nccl_comm.cpp); read here for the ranks' agreement only
    nccl_simple: str = ""

    def check_enabled(self, is_cuda: bool) -> bool:
        """The cross-rank agreement check: on by default on CPU, opt-in on GPU."""
        value = bool_value("RINGREDUCE_CHECK", self.check)
        return not is_cuda if value is None else value

    def cpu_segment_bytes(self) -> int:
        return self.segment_bytes or DEFAULT_SEGMENT_BYTES


def read() -> Knobs:
    """Every knob from the environment now, checked (ValueError names a bad one)."""
    debug = debug_setting()
    check = (_env("RINGREDUCE_CHECK") or "").strip()
    bool_value("RINGREDUCE_CHECK", check)  # a bad spelling raises here, when the knobs are read
    return Knobs(
        segment_bytes=segment_bytes(0), num_slots=num_slots(), lanes=lanes(), one_shot_bytes=one_shot_bytes(),
        check=check, timeout_ms=timeout_ms(),
        debug=0 if debug in _DEBUG_OFF else 2 if debug == "DETAIL" else 1, local_size=local_size_override(),
        wire_gather=wire_gather(), shm=shm_enabled(),
        launcher=(_env("GROUP_RANK"), _env("LOCAL_WORLD_SIZE"), _env("WORLD_SIZE")),
        nccl_simple=(_env("RINGREDUCE_NCCL_SIMPLE") or "").strip(),
    )


# Note [The ranks of a ring agree on its knobs]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Some knobs change what a ring's ranks send one another, so a knob set on one rank only would leave
# the others waiting for a message that never comes until the timeout, which then blames a dead peer:
# RINGREDUCE_CHECK (whether an agreement frame precedes every call), RINGREDUCE_LOCAL_SIZE and the
# launcher's layout (GROUP_RANK, LOCAL_WORLD_SIZE, WORLD_SIZE: whether the ring is on one node, i.e.
# shared memory or gloo point-to-point, and the hierarchical all-reduce's split), on GPUs also
# RINGREDUCE_LANES, RINGREDUCE_SLOTS, RINGREDUCE_ONESHOT_BYTES and RINGREDUCE_NCCL_SIMPLE (the
# pipeline's segments and lanes, the one-shot threshold), and, where the check is off on every rank,
# RINGREDUCE_SEGMENT_BYTES and RINGREDUCE_WIRE_GATHER (with the check on, the frame compares them per
# call and names the call). So at a ring's first call, where its ranks meet through the group's store
# anyway (the shared-memory segments' names, gloo's pairs, the NCCL unique ids), they exchange these
# through that store (ringreduce/_rings/agree.py, read_knobs) and, where they differ, every rank raises
# the ValueError of disagreement() before anything is sent; the ring's next call compares again, until
# they agree. A call that waits for its peers anyway (a synchronous one; a GPU ring's first, whose
# communicator's rendezvous waits for every rank) waits for their knobs too; an asynchronous CPU call
# returns before its peers call (tests/test_errors.py), so it compares the knobs published by now and
# goes on, and the ring's next call compares again. The last rank to make its first call always sees
# every rank's knobs and raises before it sends, so no call completes on knobs that differ; a rank whose
# asynchronous first call went ahead sees that call fail at the ring's timeout (its peer never sends)
# and raises the ValueError at its next call. After that a ring compares nothing: ringreduce.
# reload_knobs() reads the knobs again without an exchange, since a store round trip on a running ring
# is not bounded by the ring's timeout (a TCP store's client waits out the store's own timeout for a
# peer behind a cut link: tests/tools/test_cluster.py), so a knob changed mid-run is changed alike on
# every rank. RINGREDUCE_SHM needs none of this: the native shared-memory setup agrees on it (gloo
# point-to-point where any rank says 0). RINGREDUCE_TIMEOUT and RINGREDUCE_DEBUG may differ between
# ranks. A repeated call exchanges nothing.
class AgreedKnob(NamedTuple):
    """One protocol knob as one rank read it (Note [The ranks of a ring agree on its knobs])."""

    name: str  # what the message names
    shown: str  # its value as this rank has it ("" when unset)
    meaning: str  # what that value means here ("" when shown says it all)
    value: str  # what the ranks compare
    framed: bool  # compared only where the check is off on every rank (the frame compares it otherwise)


LAUNCHER_LAYOUT = "the launcher's node layout (GROUP_RANK, LOCAL_WORLD_SIZE, WORLD_SIZE)"


def _layout_mode(knobs: Knobs) -> tuple[str, str]:
    """(compared value, meaning) of the launcher's node layout, as _groups._node_of_global_ranks reads it."""
    if knobs.local_size is not None:
        return "override", "RINGREDUCE_LOCAL_SIZE decides"
    group_rank, local_world, world = knobs.launcher
    if group_rank is None or local_world is None:
        return "none", "no launcher layout: one node"
    try:
        one = world is not None and int(world) == int(local_world)
    except ValueError:
        return f"unreadable {world!r}/{local_world!r}", "not a number"
    return ("one node", "one node") if one else ("nodes", "its node from GROUP_RANK")


def _shown_int(value: int, unset: int) -> str:
    return "" if value == unset else str(value)


def agreed_knobs(knobs: Knobs, is_cuda: bool) -> list[AgreedKnob]:
    """The knobs the ranks of a ring (on a GPU: `is_cuda`) must have alike, as `knobs` read them (Note
    [The ranks of a ring agree on its knobs])."""
    check = knobs.check_enabled(is_cuda)
    mode, layout_meaning = _layout_mode(knobs)
    group_rank, local_world, world = knobs.launcher
    local = "" if knobs.local_size is None else str(knobs.local_size)
    out = [
        AgreedKnob("RINGREDUCE_CHECK", knobs.check, "on" if check else "off", str(check), False),
        AgreedKnob("RINGREDUCE_LOCAL_SIZE", local, "" if local else "unset: the launcher's layout", local, False),
        AgreedKnob(LAUNCHER_LAYOUT, " ".join(f"{n}={'unset' if v is None else v}" for n, v in (
            ("GROUP_RANK", group_rank), ("LOCAL_WORLD_SIZE", local_world), ("WORLD_SIZE", world))), layout_meaning,
                   mode, False),
        AgreedKnob("RINGREDUCE_SEGMENT_BYTES", _shown_int(knobs.segment_bytes, 0), "", str(knobs.segment_bytes), True),
        AgreedKnob("RINGREDUCE_WIRE_GATHER", knobs.wire_gather, "", knobs.wire_gather, True),
    ]
    if is_cuda:
        simple = "1" if knobs.nccl_simple == "1" else "0"
        out += [
            AgreedKnob("RINGREDUCE_LANES", _shown_int(knobs.lanes, 0), "", str(knobs.lanes), False),
            AgreedKnob("RINGREDUCE_SLOTS", _shown_int(knobs.num_slots, AUTO_SLOTS), "", str(knobs.num_slots), False),
            AgreedKnob("RINGREDUCE_ONESHOT_BYTES", _shown_int(knobs.one_shot_bytes, -1), "",
                       str(knobs.one_shot_bytes), False),
            AgreedKnob("RINGREDUCE_NCCL_SIMPLE", knobs.nccl_simple, "", simple, False),
        ]
    return out


def rank_list(ranks: list[int]) -> str:
    """"rank 3", "ranks 0, 2" or "ranks 0-5, 7"."""
    parts, i = [], 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        parts.append(str(ranks[i]) if j == i else f"{ranks[i]}, {ranks[j]}" if j == i + 1 else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(parts)


def disagreement(group: str, ranks: list[int], read: list[list[AgreedKnob]]) -> str | None:
    """The message every rank raises (ValueError) where the ranks `ranks` of `group` read the agreed
    knobs differently (`read`: agreed_knobs() of each, in that order), or None where they agree."""
    if all(r.value == "False" for k in read for r in k if r.name == "RINGREDUCE_CHECK"):
        names = [k.name for k in read[0]]
    else:
        names = [k.name for k in read[0] if not k.framed]
    clauses = []
    for name in names:
        mine = [next((k for k in knobs if k.name == name), None) for knobs in read]
        if len({k.value if k is not None else None for k in mine}) <= 1:
            continue
        if name == LAUNCHER_LAYOUT and any(k is not None and k.value == "override" for k in mine):
            continue  # RINGREDUCE_LOCAL_SIZE is set on some rank: its own clause says where it differs
        groups: dict[tuple[str, str], list[int]] = {}
        for rank, k in zip(ranks, mine, strict=True):
            key = (k.shown, k.meaning) if k is not None else ("", "not read")
            groups.setdefault(key, []).append(rank)
        values = ", ".join(f"{rank_list(rs)} {'has' if len(rs) == 1 else 'have'} {shown!r}"
                           + (f" ({meaning})" if meaning else "") for (shown, meaning), rs in groups.items())
        clauses.append(f"{name}: {values}")
    if not clauses:
        return None
    return (f"ringreduce: ranks of {group} disagree on " + "; and on ".join(clauses)
            + f"; set {'it' if len(clauses) == 1 else 'each'} alike on every rank (the ring compares again at its "
            "next call; a knob set after import is read again after ringreduce.reload_knobs() on every rank)")


_epoch_lock = threading.Lock()
epoch = 0  # reload() starts a new one; a ring whose knobs are of an older epoch reads them again


def reload() -> Knobs:
    """ringreduce.reload_knobs(): starts a new epoch, so that every ring reads its knobs again at its
    next call, and reads (and checks) them now; a bad value raises here and at those calls."""
    global epoch
    with _epoch_lock:
        epoch += 1
    return read()
