"""What a sweep is measured against: the transport ringreduce ran over, the targets of docs/design.md
section 5 for it (written as data; tests/tools/test_bench_truth.py holds the two against each other;
none where section 5 names none), and where the run came from (commit, UTC time, load average).
"""

from __future__ import annotations

import datetime
import os
import subprocess
from typing import Any

KIB, MIB = 1 << 10, 1 << 20
SOURCE = "docs/design.md section 5"

# transport -> world size -> [(max time ratio, first size, last size)]
_TARGETS: dict[str, dict[int, list[tuple[float, int, int]]]] = {
    "shm": {
        2: [(0.10, 1 * KIB, 64 * KIB), (0.40, 16 * MIB, 64 * MIB)],
        4: [(0.25, 1 * KIB, 64 * KIB), (0.50, 16 * MIB, 64 * MIB)],
    },
    "tcp": {n: [(1.10, 1 * KIB, 64 * MIB)] for n in (2, 4)},
    "nccl-socket": {
        n: [(1.2, 1 * KIB, 256 * KIB), (1.5, 1 * MIB, 1 * MIB), (1.15, 16 * MIB, 256 * MIB)] for n in (2, 3)
    },
}

TRANSPORT_NAMES = {
    "shm": "shared memory",
    "tcp": "gloo point-to-point",
    "nccl-socket": "NCCL send/recv, ranks sharing GPUs over NCCL's socket transport",
    "nccl": "NCCL send/recv",
}


def ringreduce_transport(doc: dict[str, Any]) -> str:
    """The transport ringreduce ran over in the run `doc` describes: "nccl-socket" (ranks sharing GPUs),
    "nccl", "shm" or "tcp" (gloo point-to-point)."""
    machine = doc["machine"]
    if doc["config"].get("backend") == "nccl":
        return "nccl-socket" if str(machine.get("transport") or "").startswith("nccl-socket") else "nccl"
    chosen = doc["config"].get("transport", "default")
    if chosen in ("shm", "tcp"):
        return chosen
    shm_on = (machine.get("env") or {}).get("RINGREDUCE_SHM", "1") != "0"
    built = bool((machine.get("ringreduce") or {}).get("shm", True))
    return "shm" if shm_on and built and int(machine.get("nodes", 1)) <= 1 else "tcp"


def targets_for(transport: str, world_size: int, ratios: dict[str, float]) -> list[dict[str, Any]]:
    """The targets of `transport` at `world_size` that `ratios`' sizes reach, with those met and missed."""
    out = []
    sizes = sorted(int(s) for s in ratios)
    for bound, first, last in _TARGETS.get(transport, {}).get(world_size, []):
        covered = [s for s in sizes if first <= s <= last]
        if not covered:
            continue
        out.append({
            "max_time_ratio": bound, "first_size": first, "last_size": last, "source": SOURCE,
            "met": [s for s in covered if ratios[str(s)] <= bound],
            "missed": [s for s in covered if ratios[str(s)] > bound],
        })
    return out


def _git(*args: str) -> str | None:
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        proc = subprocess.run(["git", "-C", here, *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


def load_average() -> list[float] | None:
    """The 1, 5 and 15 minute load averages (None where the system has none)."""
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except (OSError, AttributeError):
        return None


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def provenance(started_utc: str | None = None, load_start: list[float] | None = None) -> dict[str, Any]:
    """Where a result comes from: the checkout's commit ("+dirty" with changed tracked files; None outside
    git), the start and end UTC time, load average at both and the cores."""
    commit = _git("rev-parse", "--short=12", "HEAD")
    if commit and _git("status", "--porcelain", "--untracked-files=no"):
        commit += "+dirty"
    return {"commit": commit, "started_utc": started_utc, "finished_utc": utc_now(),
            "load_average_start": load_start, "load_average_end": load_average(), "cpu_cores": os.cpu_count()}


def provenance_line(prov: dict[str, Any]) -> str:
    """One line for plots and tables."""
    if prov.get("note"):
        return f"commit, time and load average {prov['note']}"
    def load(value: list[float] | None) -> str:
        return "?" if not value else f"{value[0]:.2f}"

    return (f"commit {prov.get('commit') or 'unknown'} | {prov.get('started_utc') or '?'} | load average "
            f"{load(prov.get('load_average_start'))} at start, {load(prov.get('load_average_end'))} at end "
            f"({prov.get('cpu_cores')} cores)")


def target_lines(doc: dict[str, Any]) -> str:
    """The table's lines on the run's targets (with the sizes that missed each) and its provenance."""
    from ringreduce.bench.sizes import format_size

    head = f"# ringreduce ran over {doc['ringreduce_transport_name']}; targets ({SOURCE}, time ratio, lower is better):"
    lines = [head]
    several = len(doc["summary"].get("dtypes", ())) > 1
    for t in doc["targets"]:
        missed = ", ".join(format_size(s) for s in t["missed"]) or "none"
        kind = f"{t['dtype']}: " if several and t.get("dtype") else ""
        lines.append(f"#   {kind}<= {t['max_time_ratio']:g}x {doc['stock']} at {format_size(t['first_size'])}-"
                     f"{format_size(t['last_size'])}: missed at {missed}")
    if not doc["targets"]:
        lines[0] = (f"# ringreduce ran over {doc['ringreduce_transport_name']}; {SOURCE} names no target for it "
                    f"at {doc['world_size']} ranks and these sizes")
    lines.append(f"# {provenance_line(doc['provenance'])}")
    return "\n".join(lines)
