"""nccl-tests arithmetic and the reduction of per-rank measurements to one row per implementation."""

from __future__ import annotations

import statistics
from typing import Any


def algbw_gbs(size_bytes: int, time_us: float) -> float:
    """Algorithm bandwidth in GB/s (1e9 bytes/s, as nccl-tests): message bytes / time."""
    if time_us <= 0:
        return 0.0
    return size_bytes / (time_us * 1e-6) / 1e9


def busbw_factor(world_size: int) -> float:
    """All-reduce bus-bandwidth factor 2(n-1)/n: bytes each rank sends per message byte in a ring."""
    if world_size <= 1:
        return 0.0
    return 2.0 * (world_size - 1) / world_size


def busbw_gbs(size_bytes: int, time_us: float, world_size: int) -> float:
    """Bus bandwidth in GB/s: algbw * 2(n-1)/n, comparable with the link rate at any world size."""
    return algbw_gbs(size_bytes, time_us) * busbw_factor(world_size)


# Note [Loopback ideal]: the one-GPU loopback driver (csrc/cuda/loopback_ring.h) runs a ring of n
# ranks on one GPU, every byte through HBM. Per rank and ring step the reduce-scatter copies a chunk
# into staging (2 chunk bytes) and reduces it (read two, write one: 3), the all-gather copies a chunk
# into the output (2): 7 (n - 1) x size bytes per call (chunk = size / n). A copy of the buffer moves
# 2 x size bytes, so the ideal time is 7 (n - 1) / 2 copies; loop-eff = ideal / measured (<= 1).
LOOPBACK_HBM_BYTES_PER_SIZE = 7  # times (n - 1)


def loopback_hbm_bytes(world_size: int, size_bytes: int) -> int:
    """HBM bytes one loopback all-reduce of `size_bytes` over `world_size` simulated ranks moves."""
    return LOOPBACK_HBM_BYTES_PER_SIZE * max(0, world_size - 1) * size_bytes


def loopback_ideal_us(world_size: int, copy_us: float) -> float:
    """The loopback all-reduce's time at the HBM rate of a copy of the same buffer taking `copy_us`."""
    return loopback_hbm_bytes(world_size, 1) / 2.0 * copy_us


def loopback_efficiency(loopback_us: float, ideal_us: float) -> float:
    """ideal / measured (1.0: the loopback ring runs at the copy's HBM rate)."""
    return ideal_us / loopback_us if loopback_us > 0 else 0.0


def aggregate_size(
    size: int, count: int, type_name: str, op: str, world_size: int, per_rank: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """One row per implementation from every rank's measurements of one size (`size` bytes, `count`
    elements of `type_name`, `op`, on `world_size` ranks); `per_rank[r]`: rank r's measurements of that
    type (sweep.measure_size's iters, rounds, warmup and the type's impls, each with its own iters).
    Times are averaged over ranks (as nccl-tests), #wrong summed, memory the maximum."""
    rows = []
    for name in per_rank[0]["impls"]:
        stats = [rank["impls"][name] for rank in per_rank]
        medians = [s["median_us"] for s in stats]
        time_us = statistics.fmean(medians)
        cuda = [s["cuda_growth"] for s in stats if s.get("cuda_growth") is not None]
        rows.append({
            "size": size,
            "count": count,
            "type": type_name,
            "redop": op,
            "impl": name,
            **{key: per_rank[0][key] for key in ("rounds", "warmup")},
            "iters": stats[0].get("iters", per_rank[0]["iters"]),  # Note [Calls per round] in sweep.py
            "time_us": time_us,
            "time_us_max": max(medians),
            "mean_us": statistics.fmean(s["mean_us"] for s in stats),
            "min_us": min(s["min_us"] for s in stats),
            "floor_us": statistics.fmean(s["floor_us"] for s in stats),
            "per_rank_median_us": medians,
            "algbw_gbs": algbw_gbs(size, time_us),
            "busbw_gbs": busbw_gbs(size, time_us, world_size),
            "wrong": sum(int(s["wrong"]) for s in stats),
            "peak_rss_bytes": max(int(s["peak_rss"]) for s in stats),
            "rss_growth_bytes": max(int(s["rss_growth"]) for s in stats),
            "rss_exact": all(bool(s["rss_exact"]) for s in stats),
            "cuda_growth_bytes": max(cuda) if cuda else None,
            "rel_error": stats[0].get("rel_error"),
        })
        if "off" in stats[0]:  # --vs, --algorithms direct
            rows[-1]["off"] = int(stats[0]["off"])
            if "off_exact" in stats[0]:
                rows[-1]["off_exact"] = int(stats[0]["off_exact"])
        if "fallback_calls" in stats[0]:  # summed over ranks
            rows[-1].update(calls=sum(int(s["calls"]) for s in stats),
                            fallback_calls=sum(int(s["fallback_calls"]) for s in stats),
                            profiled_ops=stats[0]["profiled_ops"])
        lb = stats[0].get("loopback_us")
        if lb is not None:
            copy_us = float(stats[0]["loopback_copy_us"])
            rows[-1].update(loopback_us=float(lb), loopback_copy_us=copy_us,
                            loopback_ideal_us=loopback_ideal_us(world_size, copy_us))
    return rows


def add_vs_float(rows: list[dict[str, Any]]) -> None:
    """Gives every row of another type than float32 whose implementation also ran float32 at its size
    `vs_float`: its time over that float32 time (the same bytes; Note [Several element types in one sweep])."""
    floats = {(row["size"], row["impl"]): row["time_us"] for row in rows if row["type"] == "float"}
    for row in rows:
        base = floats.get((row["size"], row["impl"]))
        if row["type"] != "float" and base:
            row["vs_float"] = row["time_us"] / base


def time_ratio(rows: list[dict[str, Any]], numerator: str, denominator: str) -> float | None:
    """time(numerator) / time(denominator) among the rows of one size, or None if either is absent."""
    by_impl = {row["impl"]: row for row in rows}
    if numerator not in by_impl or denominator not in by_impl or by_impl[denominator]["time_us"] <= 0:
        return None
    return by_impl[numerator]["time_us"] / by_impl[denominator]["time_us"]


def ratios_by_size(rows: list[dict[str, Any]], numerator: str, denominator: str) -> dict[int, float]:
    """time(numerator) / time(denominator) at each size of `rows` (in their order) where both ran."""
    ratios = {size: time_ratio([row for row in rows if row["size"] == size], numerator, denominator)
              for size in dict.fromkeys(row["size"] for row in rows)}
    return {size: value for size, value in ratios.items() if value is not None}


def average_busbw(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Average busbw over the sweep, per implementation (the nccl-tests footer)."""
    out: dict[str, list[float]] = {}
    for row in rows:
        out.setdefault(row["impl"], []).append(row["busbw_gbs"])
    return {name: statistics.fmean(values) for name, values in out.items()}
