"""The benchmark lines of scripts/gpu_check.sh's summary, from the JSON ``python -m ringreduce.bench
--json`` writes (schema ringreduce.bench.allreduce/3: rows with size, impl, time_us, busbw_gbs, wrong;
summary.time_ratio_vs_stock; machine.transport on NCCL).

    python scripts/gpu_bench_summary.py bench.json    # prints the lines; exit code 1 if unreadable
"""

from __future__ import annotations

import json
import sys
from typing import Any

RINGREDUCE = "ringreduce"


def _size(nbytes: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift} {unit}"
    return f"{nbytes} B"


def summary_lines(doc: dict[str, Any]) -> list[str]:
    """One header line (ranks, backend, transport), then per size: each implementation's busbw and
    ringreduce's time over the stock backend's, then the wrong-element total."""
    rows = doc["rows"]
    stock = doc["stock"]
    machine = doc.get("machine", {})
    impls = list(dict.fromkeys(row["impl"] for row in rows))
    ratios = doc.get("summary", {}).get("time_ratio_vs_stock", {})
    transport = f" over {machine['transport']}" if machine.get("transport") else ""
    lines = [f"bench: {doc['world_size']} ranks, {stock}{transport}; busbw GB/s per implementation, "
             f"time ratio {RINGREDUCE}/{stock} (< 1: ringreduce faster)"]
    lines.append("  " + f"{'size':>9}" + "".join(f" {name:>11}" for name in impls) + f" {'ratio':>7}")
    by_size: dict[int, dict[str, dict[str, Any]]] = {}
    for row in rows:
        by_size.setdefault(row["size"], {})[row["impl"]] = row
    for size in sorted(by_size):
        cells = "".join(f" {by_size[size][name]['busbw_gbs']:11.4g}" if name in by_size[size] else f" {'-':>11}"
                        for name in impls)
        ratio = ratios.get(str(size))
        lines.append("  " + f"{_size(size):>9}" + cells + (f" {ratio:7.3f}" if ratio is not None else f" {'-':>7}"))
    wrong = sum(row["wrong"] for row in rows)
    lines.append(f"bench: wrong elements {wrong} ({'OK' if wrong == 0 else 'FAILED'})")
    return lines


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    try:
        with open(argv[0]) as f:
            doc = json.load(f)
        lines = summary_lines(doc)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"bench: could not read {argv[0]}: {type(exc).__name__}: {exc}")
        return 1
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
