"""The benchmark lines of scripts/gpu_check.sh's summary, from the JSON ``python -m ringreduce.bench
--json`` writes (rows with size, type, impl, time_us, busbw_gbs, wrong, and vs_float / off_exact where
the sweep had several types / --algorithms direct; summary.by_dtype's time_ratio_vs_stock; machine.transport
on NCCL).

    python scripts/gpu_bench_summary.py bench.json    # prints the lines; exit code 1 if unreadable
"""

from __future__ import annotations

import json
import sys
from typing import Any

RINGREDUCE = "ringreduce"
RING, DIRECT = "rr-ring", "rr-direct"  # --algorithms ring,direct


def _size(nbytes: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift} {unit}"
    return f"{nbytes} B"


def _ratio_cells(by_impl: dict[str, dict[str, Any]], names: tuple[str, str]) -> str:
    num, den = (by_impl.get(name) for name in names)
    if num is None or den is None or den["time_us"] <= 0:
        return f" {'-':>11}"
    return f" {num['time_us'] / den['time_us']:11.3f}"


def _type_lines(rows: list[dict[str, Any]], ratios: dict[str, float]) -> list[str]:
    """One element type's table: busbw per implementation and ringreduce/stock per size; for a half
    type in a sweep with float32, ringreduce's time over float32's at the same bytes (vs-float32);
    with --algorithms ring,direct, rr-direct's time over rr-ring's and the elements each left off the
    correctly rounded sum where the float32 sum is exact (rounded once: 0)."""
    impls = list(dict.fromkeys(row["impl"] for row in rows))
    vs_float = any("vs_float" in row for row in rows)
    direct = DIRECT in impls and RING in impls
    extras = ["ratio"] + (["vs-float32"] if vs_float else []) + (["direct/ring", "off-ring", "off-direct"] if direct else [])
    lines = ["  " + f"{'size':>9}" + "".join(f" {name:>11}" for name in impls + extras)]
    by_size: dict[int, dict[str, dict[str, Any]]] = {}
    for row in rows:
        by_size.setdefault(row["size"], {})[row["impl"]] = row
    for size in sorted(by_size):
        cells = by_size[size]
        line = "  " + f"{_size(size):>9}" + "".join(f" {cells[name]['busbw_gbs']:11.4g}" if name in cells else f" {'-':>11}"
                                                    for name in impls)
        ratio = ratios.get(str(size))
        line += f" {ratio:11.3f}" if ratio is not None else f" {'-':>11}"
        if vs_float:
            value = cells.get(RINGREDUCE, {}).get("vs_float")
            line += f" {value:11.3f}" if value is not None else f" {'-':>11}"
        if direct:
            line += _ratio_cells(cells, (DIRECT, RING))
            line += "".join(f" {cells[name].get('off_exact', '-'):>11}" for name in (RING, DIRECT))
        lines.append(line)
    return lines


def summary_lines(doc: dict[str, Any]) -> list[str]:
    """One header line (ranks, backend, transport), then per element type (a line naming it when the
    sweep had several) and size: each implementation's busbw and ringreduce's time over the stock
    backend's (_type_lines), then the wrong-element total."""
    rows = doc["rows"]
    stock = doc["stock"]
    machine = doc.get("machine", {})
    summary = doc.get("summary", {})
    types = list(dict.fromkeys(row.get("type", "float") for row in rows))
    transport = f" over {machine['transport']}" if machine.get("transport") else ""
    lines = [f"bench: {doc['world_size']} ranks, {stock}{transport}; busbw GB/s per implementation, "
             f"time ratio {RINGREDUCE}/{stock} (< 1: ringreduce faster)"]
    for name in types:
        mine = [row for row in rows if row.get("type", "float") == name]
        if len(types) > 1:
            lines.append(f"  {name}, {doc.get('config', {}).get('op', 'avg')}:")
            ratios = summary.get("by_dtype", {}).get(name, {}).get("time_ratio_vs_stock", {})
        else:
            ratios = summary.get("time_ratio_vs_stock", {})
        lines += _type_lines(mine, ratios)
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
