"""Two builds of ringreduce side by side: medians over repeated runs of the same sweep.

    python benchmarks/compare.py DIR [--base old] [--head new]
    python benchmarks/compare.py DIR --results BUILD

DIR holds the JSON files `python -m ringreduce.bench --json` wrote, named `<build>-<N>r-<run>.json`
(benchmarks/compare_commits.sh names them so: `old-2r-1.json`, `new-2r-1.json`, ...). For every world
size N and message size it prints, as a Markdown table, the median over runs of each build's
ringreduce time, their ratio, and the median over runs of each build's ringreduce/stock ratio (the
stock collective ran in the same processes, so that ratio is the steadier one on a shared machine).
A size a run lacks is left out of that run's medians. Files `train-<build>-<run>.json` from
`python -m ringreduce.bench.train_step --json` give one more table: each variant's step time and its
ratio to DDP's step in the same run, medians over runs.

`--results BUILD` prints one build's runs as README's results table: per size, for each world size
side by side, the median over runs of each implementation's time (ringreduce first, then the others
in the order the JSON lists them: gloo, deepspeed with `--vs deepspeed`) and the median over runs of
ringreduce's time over each other implementation's.

A sweep of several element types (`-d float,bfloat16,half`) holds rows of each; `--dtype D` reads D's
(default: the first type of each file), and with `--results` a type other than float also gets the
median over runs of ringreduce's time over its own float32 time at the same bytes in the same run
(the bench's `/f32` column).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

_NAME = re.compile(r"^(?P<build>[A-Za-z0-9_.]+)-(?P<n>\d+)r-(?P<run>\d+)\.json$")
_TRAIN = re.compile(r"^train-(?P<build>[A-Za-z0-9_.]+)-(?P<run>\d+)\.json$")


def load(folder: Path, dtype: str | None = None) -> dict[tuple[str, int], list[dict[int, dict[str, float]]]]:
    """{(build, world size): [one run's {size: {impl: time_us}}, ...]} from the JSON files in `folder`:
    the rows of element type `dtype` (a bench type name: float, bfloat16, half), or of each file's
    first type. A run without rows of that type is left out."""
    runs: dict[tuple[str, int], list[dict[int, dict[str, float]]]] = {}
    for path in sorted(folder.glob("*.json")):
        m = _NAME.match(path.name)
        if not m:
            continue
        all_rows = json.loads(path.read_text())["rows"]
        want = dtype if dtype is not None else (all_rows[0].get("type", "float") if all_rows else None)
        rows: dict[int, dict[str, float]] = {}
        for row in all_rows:
            if row.get("type", "float") == want:
                rows.setdefault(int(row["size"]), {})[row["impl"]] = float(row["time_us"])
        if rows:
            runs.setdefault((m["build"], int(m["n"])), []).append(rows)
    return runs


def load_over_float(folder: Path, dtype: str) -> dict[tuple[str, int], list[dict[int, float]]]:
    """{(build, world size): [one run's {size: ringreduce's dtype time / its float time}, ...]}, both
    rows from the same file (a dtype sweep's run), for the files that have both."""
    over: dict[tuple[str, int], list[dict[int, float]]] = {}
    for path in sorted(folder.glob("*.json")):
        m = _NAME.match(path.name)
        if not m:
            continue
        t: dict[tuple[str, int], float] = {}
        for row in json.loads(path.read_text())["rows"]:
            if row["impl"] == "ringreduce":
                t[(row.get("type", "float"), int(row["size"]))] = float(row["time_us"])
        ratios = {size: v / t[("float", size)] for (ty, size), v in t.items() if ty == dtype and ("float", size) in t}
        if ratios:
            over.setdefault((m["build"], int(m["n"])), []).append(ratios)
    return over


def load_train(folder: Path) -> dict[str, list[dict[str, tuple[float, float]]]]:
    """{build: [one run's {variant: (step ms, step / DDP's step)}, ...]} from `train-<build>-<run>.json`."""
    runs: dict[str, list[dict[str, tuple[float, float]]]] = {}
    for path in sorted(folder.glob("train-*.json")):
        m = _TRAIN.match(path.name)
        if m:
            rows = json.loads(path.read_text())["rows"]
            runs.setdefault(m["build"], []).append({r["variant"]: (r["median_ms"], r["vs_ddp"]) for r in rows})
    return runs


def train_table(runs: dict[str, list[dict[str, tuple[float, float]]]], base: str, head: str) -> str:
    """The training step's Markdown table (empty when either build has no run)."""
    a, b = runs.get(base), runs.get(head)
    if not a or not b:
        return ""
    out = [f"train_step: {len(a)} runs of {base}, {len(b)} runs of {head}; medians over runs", "",
           f"| variant | {base} step (ms) | {head} step (ms) | {base} vs DDP | {head} vs DDP |", "|---|---|---|---|---|"]
    for variant in a[0]:
        cols = []
        for k in (0, 1):
            for runs_ in (a, b):
                cols.append(_median([r[variant][k] for r in runs_ if variant in r]))
        if None in cols:
            continue
        out.append(f"| {variant} | {cols[0]:.1f} | {cols[1]:.1f} | {cols[2]:.3f} | {cols[3]:.3f} |")
    return "\n".join(out + [""])


def _size(nbytes: int) -> str:
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def table(runs: dict[tuple[str, int], list[dict[int, dict[str, float]]]], base: str, head: str) -> str:
    """The Markdown tables, one per world size both builds ran."""
    out = []
    for n in sorted({n for (_, n) in runs}):
        a, b = runs.get((base, n)), runs.get((head, n))
        if not a or not b:
            continue
        stock = next(iter(impl for impl in next(iter(a[0].values())) if impl != "ringreduce"), None)
        out.append(f"{n} ranks: {len(a)} runs of {base}, {len(b)} runs of {head}; medians over runs")
        out.append("")
        out.append(f"| size | {base} (us) | {head} (us) | {head}/{base} | {base} / {stock} | {head} / {stock} |")
        out.append("|---|---|---|---|---|---|")
        for size in sorted(set().union(*a, *b)):
            ta = _median([r[size]["ringreduce"] for r in a if "ringreduce" in r.get(size, {})])
            tb = _median([r[size]["ringreduce"] for r in b if "ringreduce" in r.get(size, {})])
            ra = _median([r[size]["ringreduce"] / r[size][stock] for r in a if stock in r.get(size, {})])
            rb = _median([r[size]["ringreduce"] / r[size][stock] for r in b if stock in r.get(size, {})])
            if ta is None or tb is None:
                continue
            cells = [_size(size), f"{ta:.1f}", f"{tb:.1f}", f"{tb / ta:.2f}",
                     "-" if ra is None else f"{ra:.3f}", "-" if rb is None else f"{rb:.3f}"]
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def results(runs: dict[tuple[str, int], list[dict[int, dict[str, float]]]], build: str,
            over_float: dict[tuple[str, int], list[dict[int, float]]] | None = None) -> str:
    """One build's Markdown results table: the world sizes side by side (empty when it has no run).
    With `over_float` (load_over_float of a half type), one more column per world size: the median
    over runs of ringreduce's time over its float32 time in the same run."""
    sizes_n = sorted(n for (b, n) in runs if b == build)
    if not sizes_n:
        return ""
    impls = {n: [i for i in next(iter(runs[(build, n)][0].values())) if i != "ringreduce"] for n in sizes_n}
    names = {"gloo": "gloo", "deepspeed": "DeepSpeed"}
    head, rule = ["size"], ["---"]
    for n in sizes_n:
        head.append(f"{n} ranks: " + " / ".join(["ringreduce"] + [names.get(i, i) for i in impls[n]]) + " (us)")
        head += [f"/ {names.get(i, i)}" for i in impls[n]]
        rule += ["---"] * (1 + len(impls[n]))
        if over_float is not None:
            head.append("/ float32")
            rule.append("---")
    out = [f"{build}: " + ", ".join(f"{len(runs[(build, n)])} runs at {n} ranks" for n in sizes_n)
           + "; medians over runs", "", "| " + " | ".join(head) + " |", "|" + "|".join(rule) + "|"]
    for size in sorted(set().union(*(r for n in sizes_n for r in runs[(build, n)]))):
        cells = [_size(size)]
        for n in sizes_n:
            rs = [r[size] for r in runs[(build, n)] if "ringreduce" in r.get(size, {})]
            times = [_median([r[i] for r in rs if i in r]) for i in ["ringreduce"] + impls[n]]
            ratios = [_median([r["ringreduce"] / r[i] for r in rs if i in r]) for i in impls[n]]
            cells.append(" / ".join("-" if t is None else f"{t:.1f}" for t in times))
            cells += ["-" if q is None else f"{q:.3f}" for q in ratios]
            if over_float is not None:
                over = _median([r[size] for r in over_float.get((build, n), []) if size in r])
                cells.append("-" if over is None else f"{over:.2f}")
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out + [""])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folder", type=Path)
    p.add_argument("--base", default="old", help="the build compared against (file prefix, default old)")
    p.add_argument("--head", default="new", help="the build under test (file prefix, default new)")
    p.add_argument("--results", metavar="BUILD", help="one build's results table (README's) instead of a comparison")
    p.add_argument("--dtype", metavar="D", help="the element type's rows (float, bfloat16, half; default: each "
                   "file's first type); with --results, a half type also gets its time over float32's")
    args = p.parse_args(argv)
    if args.results:
        half = args.dtype is not None and args.dtype != "float"
        text = results(load(args.folder, args.dtype), args.results,
                       load_over_float(args.folder, args.dtype) if half else None)
        if not text:
            print(f"compare: no {args.results}-<N>r-<run>.json in {args.folder}", file=sys.stderr)
            return 1
        print(text)
        return 0
    text = table(load(args.folder, args.dtype), args.base, args.head) + train_table(load_train(args.folder), args.base, args.head)
    if not text:
        print(f"compare: no pairs of <{args.base}|{args.head}>-<N>r-<run>.json in {args.folder}", file=sys.stderr)
        return 1
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
