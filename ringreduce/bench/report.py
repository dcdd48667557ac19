"""The JSON record of a sweep: machine, command, settings, every row; and its schema check."""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any

from ringreduce.bench.config import BenchConfig
from ringreduce.bench.impls import RINGREDUCE
from ringreduce.bench.metrics import average_busbw, ratios_by_size
from ringreduce.bench.targets import TRANSPORT_NAMES, provenance, ringreduce_transport, targets_for

SCHEMA = "ringreduce.bench.allreduce/4"

ROW_FIELDS: dict[str, type | tuple[type, ...]] = {
    "size": int,
    "count": int,
    "type": str,
    "redop": str,
    "impl": str,
    "iters": int,
    "rounds": int,
    "warmup": int,
    "time_us": float,
    "time_us_max": float,
    "mean_us": float,
    "min_us": float,
    "floor_us": float,
    "per_rank_median_us": list,
    "algbw_gbs": float,
    "busbw_gbs": float,
    "wrong": int,
    "peak_rss_bytes": int,
    "rss_growth_bytes": int,
    "rss_exact": bool,
    "cuda_growth_bytes": (int, type(None)),
    "rel_error": (float, type(None)),
}
TOP_FIELDS: dict[str, type | tuple[type, ...]] = {
    "schema": str,
    "command": list,
    "config": dict,
    "machine": dict,
    "world_size": int,
    "stock": str,
    "rows": list,
    "summary": dict,
    "elapsed_s": float,
    "ringreduce_transport": str,
    "ringreduce_transport_name": str,
    "targets": list,
    "provenance": dict,
}
MACHINE_FIELDS = ("cpu_model", "cpu_cores", "gpus", "torch", "nccl", "world_size", "ringreduce")


def build_report(
    cfg: BenchConfig, machine: dict[str, Any], rows: list[dict[str, Any]], stock: str, elapsed_s: float
) -> dict[str, Any]:
    """The JSON document: every row (each names its element type), the summary (_summary), ringreduce's
    transport with the design's targets for it per element type (ringreduce.bench.targets) and the
    provenance."""
    doc = {
        "schema": SCHEMA,
        "command": list(cfg.command),
        "config": asdict(cfg),
        "machine": machine,
        "world_size": int(machine["world_size"]),
        "stock": stock,
        "rows": rows,
        "summary": _summary(rows, stock),
        "elapsed_s": float(elapsed_s),
    }
    _add_targets(doc)
    doc["provenance"] = provenance(machine.get("started_utc"), machine.get("load_average_start"))
    return doc


def _ratios(rows: list[dict[str, Any]], numerator: str, denominator: str) -> dict[str, float]:
    return {str(size): value for size, value in sorted(ratios_by_size(rows, numerator, denominator).items())}


def _summary(rows: list[dict[str, Any]], stock: str) -> dict[str, Any]:
    """Per element type (`by_dtype`, in the rows' order): average busbw per implementation, ringreduce's
    time over the stock one's per size, wrong elements, and for a type other than float32 in a sweep with
    it ringreduce's time over its float32 time per size (`time_ratio_vs_float`). The first type's figures
    stand at the top too (what a sweep of one type wrote before several existed), with every type's wrong total."""
    by_dtype: dict[str, dict[str, Any]] = {}
    for name in dict.fromkeys(row["type"] for row in rows):
        mine = [row for row in rows if row["type"] == name]
        entry = {"avg_busbw_gbs": average_busbw(mine), "time_ratio_vs_stock": _ratios(mine, RINGREDUCE, stock),
                 "wrong_total": sum(row["wrong"] for row in mine)}
        vs_float = {str(row["size"]): row["vs_float"] for row in mine if row["impl"] == RINGREDUCE and "vs_float" in row}
        if vs_float:
            entry["time_ratio_vs_float"] = vs_float
        by_dtype[name] = entry
    first = next(iter(by_dtype.values()), {"avg_busbw_gbs": {}, "time_ratio_vs_stock": {}})
    return {"avg_busbw_gbs": first["avg_busbw_gbs"], "time_ratio_vs_stock": first["time_ratio_vs_stock"],
            "wrong_total": sum(row["wrong"] for row in rows), "dtypes": list(by_dtype), "by_dtype": by_dtype}


def _add_targets(doc: dict[str, Any]) -> None:
    """ringreduce's transport, and the design's targets for it per element type (each names its type)."""
    transport = ringreduce_transport(doc)
    doc["ringreduce_transport"] = transport
    doc["ringreduce_transport_name"] = TRANSPORT_NAMES[transport]
    targets = []
    if doc["stock"] in ("gloo", "nccl"):
        for name, entry in doc["summary"]["by_dtype"].items():
            targets += [{**t, "dtype": name} for t in targets_for(transport, doc["world_size"], entry["time_ratio_vs_stock"])]
    doc["targets"] = targets


def upgrade_report(doc: dict[str, Any]) -> dict[str, Any]:
    """An older document `doc` (/2, /3: one element type) with the summary per type, transport and
    targets, and (/2) an unrecorded provenance added."""
    if doc.get("schema") == SCHEMA:
        return doc
    doc = dict(doc)
    doc["summary"] = _summary(doc["rows"], doc["stock"])
    _add_targets(doc)
    if "provenance" not in doc:
        doc["provenance"] = {"commit": None, "started_utc": None, "finished_utc": None, "load_average_start": None,
                             "load_average_end": None, "cpu_cores": doc["machine"].get("cpu_cores"),
                             "note": f"not recorded: written by the benchmark's schema {doc.get('schema')}"}
    doc["schema"] = SCHEMA
    return doc


def _type_ok(value: Any, expected: type | tuple[type, ...]) -> bool:
    if expected is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if expected is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, expected)


def validate_report(doc: Any) -> list[str]:
    """Problems with a JSON document against the schema (an empty list means valid)."""
    if not isinstance(doc, dict):
        return ["document is not an object"]
    problems = []
    for key, expected in TOP_FIELDS.items():
        if key not in doc:
            problems.append(f"missing top-level field {key!r}")
        elif not _type_ok(doc[key], expected):
            problems.append(f"field {key!r} has type {type(doc[key]).__name__}")
    if doc.get("schema") not in (None, SCHEMA):
        problems.append(f"schema is {doc.get('schema')!r}, expected {SCHEMA!r}")
    machine = doc.get("machine") if isinstance(doc.get("machine"), dict) else {}
    problems += [f"machine lacks {key!r}" for key in MACHINE_FIELDS if key not in machine]
    for i, row in enumerate(doc.get("rows") or []):
        if not isinstance(row, dict):
            problems.append(f"row {i} is not an object")
            continue
        for key, expected in ROW_FIELDS.items():
            if key not in row:
                problems.append(f"row {i} lacks {key!r}")
            elif not _type_ok(row[key], expected):
                problems.append(f"row {i} field {key!r} has type {type(row[key]).__name__}")
    return problems


def write_json(doc: dict[str, Any], path: str) -> None:
    """Writes the document, indented, after checking it against the schema."""
    problems = validate_report(doc)
    if problems:
        raise ValueError("benchmark JSON does not match its schema: " + "; ".join(problems))
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
