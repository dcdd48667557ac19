"""The printed table: nccl-tests columns per implementation side by side, derived columns, footer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ringreduce.bench.deepspeed_shm import NAME as DEEPSPEED
from ringreduce.bench.impls import (
    ALGORITHM_NAMES,
    NCCL_RING,
    RINGREDUCE,
    RINGREDUCE_NOCHECK,
    algorithm_ratio_name,
    direct_wire_name,
    wire_names,
)
from ringreduce.bench.metrics import average_busbw, loopback_efficiency, ratios_by_size, time_ratio
from ringreduce.bench.sizes import format_size

_KEY = "{:>12} {:>12} {:>8} {:>6}"
_GROUP = " {:>10} {:>8} {:>8} {:>6}"
_GROUP_WIDTH = 36
MIB = 1 << 20
_NA = f"{'n/a':>9}"


@dataclass(frozen=True)
class Layout:
    """The implementations the table shows (`impls`, in order), the stock baseline (`stock`), whether
    the one-GPU loopback driver was timed (`loopback`), the --wire-dtype (`wire`: "bf16"/"fp16"/None) and
    whether the rows have ringreduce's time over its float32 time at the same bytes (`vs_float`: a
    table of another type in a sweep with float, Note [Several element types in one sweep])."""

    impls: tuple[str, ...]
    stock: str
    loopback: bool = False
    wire: str | None = None
    vs_float: bool = False

    @property
    def extras(self) -> tuple[str, ...]:
        """The derived columns, in order (their meaning: the CLI's epilog and option help)."""
        cols = []
        if RINGREDUCE in self.impls and self.stock in self.impls:
            cols.append("ratio")
        cols += ["floor(us)", "/floor"]
        if self.vs_float:
            cols.append("/f32")
        if RINGREDUCE_NOCHECK in self.impls:
            cols.append("check(us)")
        if NCCL_RING in self.impls:
            cols.append("%ring")
        if self.loopback:
            cols += ["loop(us)", "loop-eff"]
        if self.wire is not None:
            cols += ["wire/f32", "err-f32", "err-wire", "err-ddp"]
        cols += [algorithm_ratio_name(name, self.stock) for name in self.algorithm_impls]
        if _DIRECT in self.impls:
            cols += list(_DIRECT_COLUMNS) if _RING in self.impls else []
            if self.wire is not None and direct_wire_name(self.wire) in self.impls:
                cols += ["dwire/wire", "err-dwire"]
        if DEEPSPEED in self.impls:
            cols += list(_VS_COLUMNS)
        return tuple(cols)

    @property
    def algorithm_impls(self) -> tuple[str, ...]:
        """The --algorithms columns present (rr-ring, rr-hier), with a time ratio vs stock each."""
        return tuple(name for name in self.impls if name in ALGORITHM_NAMES.values())


_VS_COLUMNS = ("rr/ds", "err-rr", "err-ds", "off-rr", "off-ds", "ds-fb")
_RING, _DIRECT = ALGORITHM_NAMES["ring"], ALGORITHM_NAMES["direct"]
# --algorithms ring,direct: direct's time over the ring's; errors and elements off where the float32 sum is exact
_DIRECT_COLUMNS = ("direct/ring", "err-ring", "err-direct", "off-ring", "off-direct")


def header(layout: Layout) -> list[str]:
    """Three '#' lines: implementation names over their groups, column names, units."""
    names = "#" + " " * 41 + "".join(f"{name:>{_GROUP_WIDTH}}" for name in layout.impls)
    cols = "#" + _KEY.format("size", "count", "type", "redop")
    units = "#" + _KEY.format("(B)", "(elements)", "", "")
    for _ in layout.impls:
        cols += _GROUP.format("time", "algbw", "busbw", "#wrong")
        units += _GROUP.format("(us)", "(GB/s)", "(GB/s)", "")
    for extra in layout.extras:
        cols += f" {extra:>9}"
        units += " " * 10
    return [names, cols, units.rstrip()]


def _ratio(value: float | None) -> str:
    return f"{value:9.3f}" if value is not None else _NA


def _extra_value(extra: str, rows: list[dict[str, Any]], layout: Layout) -> str:
    by_impl = {row["impl"]: row for row in rows}
    rr = by_impl.get(RINGREDUCE, {})
    rr_wire, ddp_wire = wire_names(layout.wire) if layout.wire is not None else ("", "")
    dwire = direct_wire_name(layout.wire) if layout.wire is not None else ""
    ratios = {"ratio": (RINGREDUCE, layout.stock), "wire/f32": (rr_wire, RINGREDUCE), "rr/ds": (RINGREDUCE, DEEPSPEED),
              "direct/ring": (_DIRECT, _RING), "dwire/wire": (dwire, rr_wire)}
    ratios.update({algorithm_ratio_name(name, layout.stock): (name, layout.stock) for name in layout.algorithm_impls})
    if extra in ratios:
        return _ratio(time_ratio(rows, *ratios[extra]))
    errors = {"err-f32": RINGREDUCE, "err-wire": rr_wire, "err-ddp": ddp_wire,
              "err-rr": RINGREDUCE, "err-ds": DEEPSPEED, "err-ring": _RING, "err-direct": _DIRECT, "err-dwire": dwire}
    if extra in errors:
        value = by_impl.get(errors[extra], {}).get("rel_error")
        return f"{value:9.2e}" if value is not None else _NA
    if extra == "/f32":
        return _ratio(rr.get("vs_float"))
    if extra in ("off-ring", "off-direct"):
        value = by_impl.get(_RING if extra == "off-ring" else _DIRECT, {}).get("off_exact")
        return f"{value:>9}" if value is not None else _NA
    if extra in ("off-rr", "off-ds", "ds-fb"):
        value = by_impl.get(DEEPSPEED if extra != "off-rr" else RINGREDUCE, {}).get(
            "fallback_calls" if extra == "ds-fb" else "off")
        return f"{value:>9}" if value is not None else _NA
    floor = rows[0]["floor_us"]
    if extra == "floor(us)":
        return f"{floor:9.1f}"
    if extra == "/floor":
        return f"{rr['time_us'] / floor:9.2f}" if floor > 0 and rr else _NA
    if extra == "check(us)":
        return f"{rr['time_us'] - by_impl[RINGREDUCE_NOCHECK]['time_us']:9.1f}"
    if extra in ("loop(us)", "loop-eff"):
        if rr.get("loopback_us") is None:
            return _NA
        if extra == "loop(us)":
            return f"{rr['loopback_us']:9.1f}"
        return f"{loopback_efficiency(rr['loopback_us'], rr['loopback_ideal_us']):9.2f}"
    ring = by_impl[NCCL_RING]["busbw_gbs"]
    return f"{100.0 * rr['busbw_gbs'] / ring:8.1f}%" if ring > 0 else _NA


def format_row(rows: list[dict[str, Any]], layout: Layout) -> str:
    """The table line of one size from its rows (one per implementation)."""
    first = rows[0]
    by_impl = {row["impl"]: row for row in rows}
    line = " " + _KEY.format(first["size"], first["count"], first["type"], first["redop"])
    for name in layout.impls:
        row = by_impl[name]
        line += _GROUP.format(
            f"{row['time_us']:.1f}", f"{row['algbw_gbs']:.3f}", f"{row['busbw_gbs']:.3f}", row["wrong"]
        )
    for extra in layout.extras:
        line += " " + _extra_value(extra, rows, layout)
    return line


def footer(rows: list[dict[str, Any]], layout: Layout, highlight: tuple[int, ...] = (1 << 20, 16 << 20, 64 << 20)) -> list[str]:
    """nccl-tests' closing lines (#wrong total, average busbw) plus the ratios at the highlighted sizes."""
    wrong = sum(row["wrong"] for row in rows)
    avg = average_busbw(rows)
    lines = [
        f"# Out of bounds values : {wrong} {'OK' if wrong == 0 else 'FAILED'}",
        "# Avg bus bandwidth    : " + "  ".join(f"{name} {avg[name]:.4g}" for name in layout.impls if name in avg)
        + "  (GB/s)",
    ]
    rr = ratios_by_size(rows, RINGREDUCE, layout.stock)
    kind = f"{rows[0]['type']} " if layout.vs_float else ""
    if any(size in rr for size in highlight):
        lines.append(f"# Time ratio {RINGREDUCE}/{layout.stock}: "
                     + "  ".join(f"{format_size(size)} {rr[size]:.3f}" for size in highlight if size in rr)
                     + "  (docs/design.md section 5 targets)")
    if layout.vs_float:
        lines.append(f"# Time ratio {RINGREDUCE} {kind.strip()}/float (same bytes): "
                     + "  ".join(f"{format_size(row['size'])} {row['vs_float']:.3f}" for row in rows
                                 if row["impl"] == RINGREDUCE and row.get("vs_float") is not None))
    wired = (*wire_names(layout.wire), direct_wire_name(layout.wire)) if layout.wire else ()
    for name in (*layout.algorithm_impls, *(w for w in wired if w in layout.impls)):
        per_size = ratios_by_size(rows, name, layout.stock)
        if per_size:
            lines.append(f"# Time ratio {name}/{layout.stock}: "
                         + "  ".join(f"{format_size(s)} {v:.3f}" for s, v in per_size.items()))
    ds = [row for row in rows if row["impl"] == DEEPSPEED and "fallback_calls" in row]
    if ds:
        fell = sum(row["fallback_calls"] for row in ds)
        ops = sorted({op for row in ds for op in row["profiled_ops"]})
        lines.append(f"# {DEEPSPEED}: {sum(row['calls'] for row in ds)} calls, {fell} fell back to "
                     f"torch.distributed.all_reduce{' (its shm op did not run for them)' if fell else ''}; "
                     f"profiled calls ran: {', '.join(ops) or 'nothing'}")
    loops = [row for row in rows if row["impl"] == RINGREDUCE and row.get("loopback_us") is not None]
    if loops:
        lines.append("# Loopback driver on one GPU, ideal/time (HBM traffic at a copy's rate, Note [Loopback ideal]): "
                     + "  ".join(f"{format_size(row['size'])} "
                                 f"{loopback_efficiency(row['loopback_us'], row['loopback_ideal_us']):.2f}"
                                 for row in loops))
    return lines


def table_lines(rows: list[dict[str, Any]], layout: Layout) -> list[str]:
    """The header and a line per size of `rows` (one element type), in the order of their sizes."""
    sizes = list(dict.fromkeys(row["size"] for row in rows))
    return header(layout) + [format_row([row for row in rows if row["size"] == size], layout) for size in sizes]


def memory_lines(rows: list[dict[str, Any]], layout: Layout, bound_bytes: int) -> list[str]:
    """Peak memory per rank of each of `rows`' implementations in `layout`; ringreduce's vs `bound_bytes`."""
    lines = ["#", "# Peak memory per rank (max over ranks and sizes; growth = peak during the first call of a size"
             " minus RSS before it)"]
    for name in layout.impls:
        mine = [row for row in rows if row["impl"] == name]
        if not mine:
            continue
        peak = max(row["peak_rss_bytes"] for row in mine) / MIB
        worst = max(mine, key=lambda row: row["rss_growth_bytes"])
        text = (f"#   {name:<12} peak RSS {peak:8.1f} MiB   growth {worst['rss_growth_bytes'] / MIB:7.2f} MiB"
                f" (at {format_size(worst['size'])})")
        cuda = [row["cuda_growth_bytes"] for row in mine if row.get("cuda_growth_bytes") is not None]
        if cuda:
            text += f"   CUDA alloc growth {max(cuda) / MIB:7.2f} MiB"
        if name in (RINGREDUCE, RINGREDUCE_NOCHECK):
            ok = worst["rss_growth_bytes"] <= bound_bytes + MIB
            text += f"   bound {bound_bytes / MIB:.0f} MiB: {'OK' if ok else 'OVER'}"
        if not all(row["rss_exact"] for row in mine):
            text += "   (VmHWM not resettable: lifetime peaks)"
        lines.append(text)
    return lines
