"""The PNG: bus bandwidth against message size per implementation, and ringreduce/stock time ratio, with
the design's targets for the transport, the command and the provenance. What it drew is also written
into the PNG's metadata (key METADATA_KEY) for tests and tools (read_plot_metadata).
"""

from __future__ import annotations

import json
import math
import textwrap
from typing import Any

from ringreduce.bench.impls import RINGREDUCE
from ringreduce.bench.machine import devices
from ringreduce.bench.metrics import ratios_by_size
from ringreduce.bench.sizes import format_size
from ringreduce.bench.targets import SOURCE, provenance_line

METADATA_KEY = "ringreduce"

_STYLE = {
    "ringreduce": ("tab:red", "o", "-"),
    "rr-nocheck": ("tab:orange", "v", ":"),
    "gloo": ("tab:blue", "s", "--"),
    "nccl": ("tab:blue", "s", "--"),
    "nccl-ring": ("tab:green", "^", "-."),
}


def ratio_ticks(low: float, high: float) -> list[float]:
    """Tick values for a log-scale axis from `low` to `high` (both > 0): 1-2-5 steps of every decade in
    the range; finer steps (1, 1.5, 2, 3, 5, 7) when that gives fewer than 3, powers of ten above 12."""
    if not (0 < low < high) or not math.isfinite(high):
        raise ValueError(f"ratio_ticks: need 0 < low < high, got {low}, {high}")
    decades = range(math.floor(math.log10(low)), math.ceil(math.log10(high)) + 1)

    def steps(mantissas: tuple[float, ...]) -> list[float]:
        return [t for e in decades for m in mantissas if low <= (t := float(f"{m * 10.0 ** e:.6g}")) <= high]

    ticks = steps((1, 2, 5))
    if len(ticks) > 12:
        return steps((1,))
    return ticks if len(ticks) >= 3 else steps((1, 1.5, 2, 3, 5, 7))


def read_plot_metadata(path: str) -> dict[str, Any]:
    """What write_plot drew into the PNG at `path`, from its metadata (needs Pillow)."""
    from PIL import Image

    with Image.open(path) as image:
        return json.loads(image.text[METADATA_KEY])


def write_plot(doc: dict[str, Any], path: str) -> None:
    """Draws the report `doc` (build_report) to the PNG `path`."""
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
    ax_bw.set_ylabel("bus bandwidth (GB/s), higher is better\n[algbw x 2(n-1)/n]")
    ax_bw.grid(True, which="major", alpha=0.35)
    ax_bw.legend(loc="upper left")
    first = rows[0]
    how = doc["machine"].get("transport") if doc["ringreduce_transport"].startswith("nccl") else None
    title = (f"all_reduce {first['type']} {first['redop']}: ringreduce over {doc['ringreduce_transport_name']} "
             f"vs torch.distributed {stock}\n{devices(doc['machine'])}; {doc['world_size']} ranks"
             + (f" ({how})" if how else ""))
    ax_bw.set_title("\n".join(textwrap.fill(line, 100) for line in title.split("\n")), fontsize=10)
    by_size = ratios_by_size(rows, RINGREDUCE, stock)
    ratio_sizes = sorted(by_size)
    ratios = [by_size[size] for size in ratio_sizes]
    ax_ratio.plot(ratio_sizes, ratios, color="tab:red", marker="o", linewidth=1.5)
    ax_ratio.axhline(1.0, color="black", linewidth=0.8)
    targets = []
    for target in doc["targets"]:
        first_size, last_size = format_size(target["first_size"]), format_size(target["last_size"])
        missed = ", ".join(format_size(size) for size in target["missed"])
        where = first_size if first_size == last_size else f"{first_size}-{last_size}"
        label = f"target <= {target['max_time_ratio']:g} at {where} ({f'missed at {missed}' if missed else 'met'})"
        span = (target["first_size"] / 1.3, target["last_size"] * 1.3)  # visible even for a single size
        ax_ratio.plot(span, (target["max_time_ratio"],) * 2, color="tab:gray", linestyle="--", linewidth=1.2,
                      label=label)
        targets.append({"label": label, "max_time_ratio": target["max_time_ratio"], "sizes": list(span)})
    if not targets:
        ax_ratio.text(0.01, 0.04, f"no target in {SOURCE} for ringreduce over {doc['ringreduce_transport_name']} "
                      f"at {doc['world_size']} ranks", transform=ax_ratio.transAxes, fontsize=7, color="dimgray")
    ax_ratio.set_ylabel(f"time ratio\nringreduce / {stock}\nlower is better")
    ax_ratio.set_xlabel("message size (bytes, log scale)")
    ax_ratio.grid(True, alpha=0.35)
    if targets:
        ax_ratio.legend(loc="best", fontsize=7, title=SOURCE, title_fontsize=7)
    if ratios:
        bounds = [t["max_time_ratio"] for t in targets]
        low, high = min(*ratios, *bounds, 0.9) * 0.9, max(*ratios, *bounds, 1.15) * 1.25
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
    footer = textwrap.wrap("cmd: " + " ".join(doc["command"]), 150, break_long_words=True, break_on_hyphens=False)
    footer.append(provenance_line(doc["provenance"]))
    fig.text(0.01, 0.005, "\n".join(footer), fontsize=7, color="dimgray", va="bottom")
    fig.tight_layout(rect=(0, 0.017 * (len(footer) + 1), 1, 1))
    drawn = {"title": ax_bw.get_title(), "bandwidth_axis": ax_bw.get_ylabel(), "ratio_axis": ax_ratio.get_ylabel(),
             "targets": targets, "footer": footer, "transport": doc["ringreduce_transport"],
             "provenance": doc["provenance"]}
    fig.savefig(path, dpi=120, metadata={METADATA_KEY: json.dumps(drawn)})
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """python -m ringreduce.bench.plot IN.json OUT.png: draws a benchmark JSON (of any schema) again."""
    import sys

    from ringreduce.bench.report import upgrade_report

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        sys.stderr.write("usage: python -m ringreduce.bench.plot IN.json OUT.png\n")
        return 2
    with open(args[0]) as f:
        doc = upgrade_report(json.load(f))
    write_plot(doc, args[1])
    print(f"# plot written to {args[1]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
