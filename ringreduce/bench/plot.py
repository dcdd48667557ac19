"""The PNG: bus bandwidth against message size per implementation, and ringreduce/stock time ratio, with
the design's targets for the transport, the command and the provenance. A sweep of several element
types draws a line per implementation and type (the implementation's colour, the type's marker and
dashes), a ratio line per type and, with float among them, a third panel: each other type's ringreduce
time over float32's at the same bytes. What it drew is also written into the PNG's metadata (key
METADATA_KEY) for tests and tools (read_plot_metadata).
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


_TYPE_STYLE = (("o", "-"), ("s", "--"), ("^", ":"), ("D", "-."))  # marker, dashes per type of a sweep of several
_TYPE_COLORS = ("tab:red", "tab:purple", "tab:brown", "tab:olive")  # ratio lines per type


def _target_label(group: list[dict[str, Any]], several: bool) -> str:
    """'target <= 0.4 at 16M-64M (met)' for one type; with several, what each type met or missed."""
    first = group[0]
    first_size, last_size = format_size(first["first_size"]), format_size(first["last_size"])
    where = first_size if first_size == last_size else f"{first_size}-{last_size}"

    def outcome(target: dict[str, Any]) -> str:
        missed = ", ".join(format_size(size) for size in target["missed"])
        return f"missed at {missed}" if missed else "met"

    told = "; ".join(f"{t.get('dtype')}: {outcome(t)}" for t in group) if several else outcome(first)
    return f"target <= {first['max_time_ratio']:g} at {where} ({told})"


def _annotate(ax: Any, xs: list[int], ys: list[float], color: str) -> None:
    for x, y in zip(xs, ys, strict=True):
        ax.annotate(f"{y:.2f}", (x, y), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=7, color=color)


def _log_ratio_axis(ax: Any, values: list[float], bounds: list[float]) -> None:
    """Limits (and, over a wide range, log ticks) that show `values` and the target `bounds`."""
    import matplotlib.ticker

    low, high = min(*values, *bounds, 0.9) * 0.9, max(*values, *bounds, 1.15) * 1.25
    if high / low > 2:  # large small-message ratios would flatten the region around 1
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(matplotlib.ticker.FixedLocator(ratio_ticks(low, high)))
        ax.yaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ax.set_ylim(low, high)


def write_plot(doc: dict[str, Any], path: str) -> None:
    """Draws the report `doc` (build_report) to the PNG `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = doc["rows"]
    stock = doc["stock"]
    sizes = sorted({row["size"] for row in rows})
    impls = list(dict.fromkeys(row["impl"] for row in rows))
    types = list(dict.fromkeys(row["type"] for row in rows))
    several = len(types) > 1
    others = [t for t in types if t != "float"] if "float" in types and several else []
    heights = [3, 1.3] + ([1.3] if others else [])
    fig, axes = plt.subplots(len(heights), 1, figsize=(9, 7.5 + (2.2 if others else 0)), sharex=True,
                             gridspec_kw={"height_ratios": heights})
    ax_bw, ax_ratio = axes[0], axes[1]
    drawn_lines = []
    for index, kind in enumerate(types):
        for name in impls:
            mine = sorted((row for row in rows if row["impl"] == name and row["type"] == kind), key=lambda r: r["size"])
            if not mine:
                continue
            color, marker, line = _STYLE.get(name, ("tab:gray", "x", "-"))
            if several:
                marker, line = _TYPE_STYLE[index % len(_TYPE_STYLE)]
            label = f"{name} (stock torch.distributed)" if name == stock else name
            label += f", {kind}" if several else ""
            ax_bw.plot([row["size"] for row in mine], [row["busbw_gbs"] for row in mine],
                       color=color, marker=marker, linestyle=line, label=label, linewidth=1.8, markersize=5)
            drawn_lines.append(label)
    ax_bw.set_xscale("log", base=2)
    positive = [row["busbw_gbs"] for row in rows if row["busbw_gbs"] > 0]
    if positive and max(positive) / min(positive) > 50:
        ax_bw.set_yscale("log")  # small messages would sit on the axis of a linear scale
    else:
        ax_bw.set_ylim(bottom=0)
    ax_bw.set_ylabel("bus bandwidth (GB/s), higher is better\n[algbw x 2(n-1)/n]")
    ax_bw.grid(True, which="major", alpha=0.35)
    ax_bw.legend(loc="upper left", fontsize=8 if several else None)
    first = rows[0]
    how = doc["machine"].get("transport") if doc["ringreduce_transport"].startswith("nccl") else None
    title = (f"all_reduce {', '.join(types)} {first['redop']}: ringreduce over {doc['ringreduce_transport_name']} "
             f"vs torch.distributed {stock}\n{devices(doc['machine'])}; {doc['world_size']} ranks"
             + (f" ({how})" if how else ""))
    ax_bw.set_title("\n".join(textwrap.fill(line, 100) for line in title.split("\n")), fontsize=10)
    ratios: list[float] = []
    for index, kind in enumerate(types):
        by_size = ratios_by_size([row for row in rows if row["type"] == kind], RINGREDUCE, stock)
        xs = sorted(by_size)
        ys = [by_size[size] for size in xs]
        color = _TYPE_COLORS[index % len(_TYPE_COLORS)]
        ax_ratio.plot(xs, ys, color=color, marker=_TYPE_STYLE[index % len(_TYPE_STYLE)][0], linewidth=1.5,
                      label=kind if several else None)
        _annotate(ax_ratio, xs, ys, color)
        ratios += ys
    ax_ratio.axhline(1.0, color="black", linewidth=0.8)
    groups: dict[tuple[float, int, int], list[dict[str, Any]]] = {}
    for target in doc["targets"]:  # one per type: the same bound drawn once, with each type's outcome
        groups.setdefault((target["max_time_ratio"], target["first_size"], target["last_size"]), []).append(target)
    targets = []
    for (bound, first_size, last_size), group in groups.items():
        label = _target_label(group, several)
        span = (first_size / 1.3, last_size * 1.3)  # visible even for a single size
        ax_ratio.plot(span, (bound,) * 2, color="tab:gray", linestyle="--", linewidth=1.2, label=label)
        targets.append({"label": label, "max_time_ratio": bound, "sizes": list(span)})
    if not targets:
        ax_ratio.text(0.01, 0.04, f"no target in {SOURCE} for ringreduce over {doc['ringreduce_transport_name']} "
                      f"at {doc['world_size']} ranks", transform=ax_ratio.transAxes, fontsize=7, color="dimgray")
    ax_ratio.set_ylabel(f"time ratio\nringreduce / {stock}\nlower is better")
    ax_ratio.grid(True, alpha=0.35)
    if targets or several:
        ax_ratio.legend(loc="best", fontsize=7, title=SOURCE if targets else None, title_fontsize=7)
    if ratios:
        _log_ratio_axis(ax_ratio, ratios, [t["max_time_ratio"] for t in targets])
    vs_float_axis = None
    vs_float_lines = []
    if others:
        ax_f32 = axes[2]
        values: list[float] = []
        for kind in others:
            index = types.index(kind)
            mine = sorted((row for row in rows if row["type"] == kind and row["impl"] == RINGREDUCE and "vs_float" in row),
                          key=lambda r: r["size"])
            xs, ys = [row["size"] for row in mine], [row["vs_float"] for row in mine]
            color = _TYPE_COLORS[index % len(_TYPE_COLORS)]
            ax_f32.plot(xs, ys, color=color, marker=_TYPE_STYLE[index % len(_TYPE_STYLE)][0], linewidth=1.5,
                        label=f"{kind} / float")
            _annotate(ax_f32, xs, ys, color)
            vs_float_lines.append(f"{kind} / float")
            values += ys
        ax_f32.axhline(1.0, color="black", linewidth=0.8)
        vs_float_axis = "time ratio\nringreduce type / float32\n(same bytes), lower is better"
        ax_f32.set_ylabel(vs_float_axis)
        ax_f32.grid(True, alpha=0.35)
        ax_f32.legend(loc="best", fontsize=7)
        if values:
            _log_ratio_axis(ax_f32, values, [])
    ax_last = axes[-1]
    ax_last.set_xlabel("message size (bytes, log scale)")
    ax_last.set_xticks(sizes)
    ax_last.set_xticklabels([format_size(size) for size in sizes], rotation=45 if len(sizes) > 12 else 0)
    ax_last.minorticks_off()
    footer = textwrap.wrap("cmd: " + " ".join(doc["command"]), 150, break_long_words=True, break_on_hyphens=False)
    footer.append(provenance_line(doc["provenance"]))
    fig.text(0.01, 0.005, "\n".join(footer), fontsize=7, color="dimgray", va="bottom")
    fig.tight_layout(rect=(0, 0.017 * (len(footer) + 1) * 7.5 / fig.get_figheight(), 1, 1))
    drawn = {"title": ax_bw.get_title(), "bandwidth_axis": ax_bw.get_ylabel(), "ratio_axis": ax_ratio.get_ylabel(),
             "targets": targets, "footer": footer, "transport": doc["ringreduce_transport"],
             "provenance": doc["provenance"], "dtypes": types, "lines": drawn_lines,
             "vs_float_axis": vs_float_axis, "vs_float_lines": vs_float_lines}
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
