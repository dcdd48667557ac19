"""The PNG: bus bandwidth against message size per implementation, and ringreduce/stock time ratio."""

from __future__ import annotations

import math
from typing import Any

from ringreduce.bench.impls import RINGREDUCE
from ringreduce.bench.machine import short_title
from ringreduce.bench.metrics import time_ratio
from ringreduce.bench.sizes import format_size

_STYLE = {
    "ringreduce": ("tab:red", "o", "-"),
    "rr-nocheck": ("tab:orange", "v", ":"),
    "gloo": ("tab:blue", "s", "--"),
    "nccl": ("tab:blue", "s", "--"),
    "nccl-ring": ("tab:green", "^", "-."),
}


def ratio_ticks(low: float, high: float) -> list[float]:
    """Tick values for a log-scale axis from `low` to `high` (both > 0): 1-2-5 steps of every decade
    in the range, finer steps (1, 1.5, 2, 3, 5, 7) when that gives fewer than 3 ticks, only the
    powers of ten when it gives more than 12. So the ticks label the range the data has (ratios of
    0.02-0.13 get 0.02, 0.05, 0.1), not a fixed list."""
    if not (0 < low < high) or not math.isfinite(high):
        raise ValueError(f"ratio_ticks: need 0 < low < high, got {low}, {high}")
    decades = range(math.floor(math.log10(low)), math.ceil(math.log10(high)) + 1)

    def steps(mantissas: tuple[float, ...]) -> list[float]:
        return [t for e in decades for m in mantissas if low <= (t := float(f"{m * 10.0 ** e:.6g}")) <= high]

    ticks = steps((1, 2, 5))
    if len(ticks) > 12:
        return steps((1,))
    return ticks if len(ticks) >= 3 else steps((1, 1.5, 2, 3, 5, 7))


def write_plot(doc: dict[str, Any], path: str) -> None:
    """Draws busbw (GB/s) against size (log x) and the time ratio, titled with machine and world size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    rows = doc["rows"]
    stock = doc["stock"]
    sizes = sorted({row["size"] for row in rows})
    impls = list(dict.fromkeys(row["impl"] for row in rows))
    fig, (ax_bw, ax_ratio) = plt.subplots(
        2, 1, figsize=(9, 7.5), sharex=True, gridspec_kw={"height_ratios": [3, 1.3]}
    )
    for name in impls:
        mine = sorted((row for row in rows if row["impl"] == name), key=lambda row: row["size"])
        color, marker, line = _STYLE.get(name, ("tab:gray", "x", "-"))
        label = f"{name} (stock torch.distributed)" if name == stock else name
        ax_bw.plot([row["size"] for row in mine], [row["busbw_gbs"] for row in mine],
                   color=color, marker=marker, linestyle=line, label=label, linewidth=1.8, markersize=5)
    ax_bw.set_xscale("log", base=2)
    positive = [row["busbw_gbs"] for row in rows if row["busbw_gbs"] > 0]
    if positive and max(positive) / min(positive) > 50:
        ax_bw.set_yscale("log")  # small messages would sit on the axis of a linear scale
    else:
        ax_bw.set_ylim(bottom=0)
    ax_bw.set_ylabel("bus bandwidth (GB/s)  [algbw x 2(n-1)/n]")
    ax_bw.grid(True, which="major", alpha=0.35)
    ax_bw.legend(loc="upper left")
    first = rows[0]
    ax_bw.set_title(
        f"all_reduce {first['type']} {first['redop']}: ringreduce vs {stock}\n{short_title(doc['machine'])}",
        fontsize=11,
    )
    ratio_sizes, ratios = [], []
    for size in sizes:
        value = time_ratio([row for row in rows if row["size"] == size], RINGREDUCE, stock)
        if value is not None:
            ratio_sizes.append(size)
            ratios.append(value)
    ax_ratio.plot(ratio_sizes, ratios, color="tab:red", marker="o", linewidth=1.5)
    ax_ratio.axhline(1.0, color="black", linewidth=0.8)
    ax_ratio.axhline(1.10, color="tab:gray", linestyle="--", linewidth=0.8, label="target 1.10")
    ax_ratio.set_ylabel(f"time ratio\nringreduce / {stock}")
    ax_ratio.set_xlabel("message size (bytes, log scale)")
    ax_ratio.grid(True, alpha=0.35)
    ax_ratio.legend(loc="upper right", fontsize=8)
    if ratios:
        low, high = min(min(ratios), 0.9) * 0.9, max(max(ratios), 1.15) * 1.25
        if high / low > 2:  # large small-message ratios would flatten the region around 1
            ax_ratio.set_yscale("log")
            ax_ratio.yaxis.set_major_locator(matplotlib.ticker.FixedLocator(ratio_ticks(low, high)))
            ax_ratio.yaxis.set_minor_locator(matplotlib.ticker.NullLocator())
            ax_ratio.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        ax_ratio.set_ylim(low, high)
        for size, value in zip(ratio_sizes, ratios, strict=True):
            ax_ratio.annotate(f"{value:.2f}", (size, value), textcoords="offset points", xytext=(0, 6),
                              ha="center", fontsize=8, color="tab:red")
    ax_ratio.set_xticks(sizes)
    ax_ratio.set_xticklabels([format_size(size) for size in sizes], rotation=45 if len(sizes) > 12 else 0)
    ax_ratio.minorticks_off()
    fig.text(0.01, 0.005, "cmd: " + " ".join(doc["command"])[:150], fontsize=7, color="dimgray")
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
