"""The benchmark sweeps several element types in one run (Note [Several element types in one sweep],
ringreduce/bench/sweep.py): parsing, a table per type with its time over float32's, every row in the
JSON naming its type, the plot's lines and panel per type, and a short real sweep."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from ringreduce.bench import cli
from ringreduce.bench.config import BenchConfig
from ringreduce.bench.metrics import add_vs_float, aggregate_size
from ringreduce.bench.report import build_report, upgrade_report, validate_report
from ringreduce.bench.sizes import parse_dtypes
from ringreduce.bench.table import Layout, footer, table_lines
from ringreduce.bench.targets import target_lines

KIB, MIB = 1 << 10, 1 << 20
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _config(argv: list[str]) -> BenchConfig:
    return cli.make_config(cli.build_parser().parse_args(argv), argv, "gloo", "spawn")


def _stats(us: float) -> dict:
    return {"median_us": us, "mean_us": us, "min_us": us, "max_us": us, "floor_us": 10.0, "wrong": 0,
            "peak_rss": MIB, "rss_growth": 0, "rss_exact": True, "cuda_growth": None}


# ringreduce and gloo times (us) per type and size: bfloat16 1.5x float32's at 64 KiB, 0.9x at 16 MiB.
TIMES = {"float": {64 * KIB: (20.0, 400.0), 16 * MIB: (4000.0, 20000.0)},
         "bfloat16": {64 * KIB: (30.0, 500.0), 16 * MIB: (3600.0, 21000.0)}}


def _rows() -> list[dict]:
    rows = []
    for size in (64 * KIB, 16 * MIB):
        for kind, per_size in TIMES.items():
            rr, gloo = per_size[size]
            per_rank = {"iters": 5, "rounds": 3, "warmup": 1, "impls": {"ringreduce": _stats(rr), "gloo": _stats(gloo)}}
            itemsize = 4 if kind == "float" else 2
            rows += aggregate_size(size, size // itemsize, kind, "avg", 2, [per_rank, per_rank])
    add_vs_float(rows)
    return rows


def _doc(rows: list[dict]) -> dict:
    cfg = BenchConfig(sizes=[64 * KIB, 16 * MIB], dtypes=("float", "bfloat16"), op="avg", backend="gloo",
                      command=["python", "-m", "ringreduce.bench", "-d", "float,bfloat16"])
    machine = {"cpu_model": "cpu", "cpu_cores": 2, "gpus": [], "torch": "2", "nccl": None, "world_size": 2, "nodes": 1,
               "ringreduce": {"version": "0", "shm": True}, "backend": "gloo", "env": {},
               "started_utc": "2026-12-01T10:00:00Z", "load_average_start": [2.0, 1.0, 0.5]}
    return build_report(cfg, machine, rows, "gloo", 1.0)


def test_dtype_lists_parse_in_order_once() -> None:
    assert [d.name for d in parse_dtypes("float,bf16, float16")] == ["float", "bfloat16", "half"]
    assert [d.name for d in parse_dtypes("bfloat16,float32,bf16")] == ["bfloat16", "float"]
    with pytest.raises(ValueError, match="unknown dtype"):
        parse_dtypes("float,complex32")
    with pytest.raises(ValueError, match="no dtype"):
        parse_dtypes(" , ")


def test_cli_takes_several_types_and_gives_each_the_same_bytes() -> None:
    cfg = _config(["-d", "float,bfloat16,float16", "-b", "2", "-e", "64", "-f", "4"])
    assert cfg.dtypes == ("float", "bfloat16", "half")
    assert cfg.sizes == [8, 32]  # whole float32 elements: 2 bytes hold none, 32 hold 8 (and 16 bfloat16)
    assert _config([]).dtypes == ("float",)
    assert _config(["-d", "half", "-b", "2", "-e", "8", "-f", "2"]).sizes == [2, 4, 8]


def test_cli_refuses_what_several_types_cannot_run() -> None:
    with pytest.raises(SystemExit, match="--wire-dtype applies to float32 tensors alone .*-d float,bfloat16"):
        _config(["-d", "float,bfloat16", "--wire-dtype", "bf16"])
    assert _config(["-d", "float", "--wire-dtype", "bf16"]).wire_dtype == "bf16"
    with pytest.raises(SystemExit, match="--vs deepspeed runs one element type per sweep"):
        _config(["-d", "float,bfloat16", "--vs", "deepspeed"])
    with pytest.raises(SystemExit, match="--op avg needs a floating type, not int8"):
        _config(["-d", "float,int8"])
    with pytest.raises(SystemExit, match="unknown dtype"):
        _config(["-d", "float,float8"])


def test_rows_carry_their_type_and_time_over_float32() -> None:
    rows = _rows()
    bf16 = {row["size"]: row for row in rows if row["type"] == "bfloat16" and row["impl"] == "ringreduce"}
    assert bf16[64 * KIB]["vs_float"] == pytest.approx(1.5) and bf16[16 * MIB]["vs_float"] == pytest.approx(0.9)
    gloo = [row for row in rows if row["type"] == "bfloat16" and row["impl"] == "gloo"]
    assert gloo[0]["vs_float"] == pytest.approx(500.0 / 400.0)
    assert all("vs_float" not in row for row in rows if row["type"] == "float")


def test_json_has_a_summary_and_targets_per_type() -> None:
    doc = _doc(_rows())
    assert validate_report(doc) == [] and validate_report(json.loads(json.dumps(doc))) == []
    assert list(doc["config"]["dtypes"]) == ["float", "bfloat16"]
    summary = doc["summary"]
    assert summary["dtypes"] == ["float", "bfloat16"]
    assert summary["time_ratio_vs_stock"] == summary["by_dtype"]["float"]["time_ratio_vs_stock"]
    assert summary["by_dtype"]["bfloat16"]["time_ratio_vs_stock"] == {str(64 * KIB): pytest.approx(0.06),
                                                                      str(16 * MIB): pytest.approx(3600 / 21000)}
    assert summary["by_dtype"]["bfloat16"]["time_ratio_vs_float"] == {str(64 * KIB): pytest.approx(1.5),
                                                                      str(16 * MIB): pytest.approx(0.9)}
    assert "time_ratio_vs_float" not in summary["by_dtype"]["float"]
    # shared memory, 2 ranks: <= 0.10x at 1-64 KiB and <= 0.40x at 16-64 MiB, for each type.
    assert [(t["dtype"], t["max_time_ratio"], t["met"], t["missed"]) for t in doc["targets"]] == [
        ("float", 0.10, [64 * KIB], []), ("float", 0.40, [16 * MIB], []),
        ("bfloat16", 0.10, [64 * KIB], []), ("bfloat16", 0.40, [16 * MIB], [])]
    lines = target_lines(doc).splitlines()
    assert lines[1] == "#   float: <= 0.1x gloo at 1K-64K: missed at none"
    assert lines[3] == "#   bfloat16: <= 0.1x gloo at 1K-64K: missed at none"


def test_one_type_documents_upgrade() -> None:
    """A /3 document (one type, no per-type summary) reads as a /4 one: its provenance kept."""
    doc = _doc([row for row in _rows() if row["type"] == "float"])
    old = json.loads(json.dumps(doc))
    old["schema"] = "ringreduce.bench.allreduce/3"
    del old["summary"]["by_dtype"], old["summary"]["dtypes"]
    for target in old["targets"]:
        del target["dtype"]
    new = upgrade_report(old)
    assert validate_report(new) == [] and new["summary"]["dtypes"] == ["float"]
    assert new["provenance"] == doc["provenance"] and [t["dtype"] for t in new["targets"]] == ["float", "float"]


def test_a_table_per_type_with_its_float32_ratio() -> None:
    rows = _rows()
    bf16 = [row for row in rows if row["type"] == "bfloat16"]
    layout = Layout(("ringreduce", "gloo"), "gloo", vs_float=True)
    assert layout.extras == ("ratio", "floor(us)", "/floor", "/f32")
    lines = table_lines(bf16, layout)
    assert len(lines) == 5 and len({len(line) for line in lines[1:2] + lines[3:]}) == 1, "\n".join(lines)
    assert lines[3].split()[:3] == [str(64 * KIB), str(32 * KIB), "bfloat16"] and lines[3].split()[-1] == "1.500"
    assert lines[4].split()[-1] == "0.900"
    foot = footer(bf16, layout)
    assert "# Time ratio ringreduce bfloat16/float (same bytes): 64K 1.500  16M 0.900" in foot
    plain = table_lines([row for row in rows if row["type"] == "float"], Layout(("ringreduce", "gloo"), "gloo"))
    assert "/f32" not in plain[1]


def test_plot_draws_every_type(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    pytest.importorskip("PIL")
    from ringreduce.bench.plot import read_plot_metadata, write_plot

    png = tmp_path / "types.png"
    write_plot(_doc(_rows()), str(png))
    drawn = read_plot_metadata(str(png))
    assert drawn["dtypes"] == ["float", "bfloat16"]
    assert drawn["lines"] == ["ringreduce, float", "gloo (stock torch.distributed), float", "ringreduce, bfloat16",
                              "gloo (stock torch.distributed), bfloat16"]
    assert drawn["vs_float_lines"] == ["bfloat16 / float"] and "float32" in drawn["vs_float_axis"]
    assert "float, bfloat16" in drawn["title"]
    assert [t["label"] for t in drawn["targets"]] == ["target <= 0.1 at 1K-64K (float: met; bfloat16: met)",
                                                      "target <= 0.4 at 16M-64M (float: met; bfloat16: met)"]
    single = tmp_path / "one.png"
    write_plot(_doc([row for row in _rows() if row["type"] == "float"]), str(single))
    one = read_plot_metadata(str(single))
    assert one["vs_float_axis"] is None and one["lines"] == ["ringreduce", "gloo (stock torch.distributed)"]
    assert one["targets"][0]["label"] == "target <= 0.1 at 1K-64K (met)"


def test_cli_sweeps_three_types_in_one_run(tmp_path) -> None:
    out = tmp_path / "types.json"
    png = tmp_path / "types.png"
    cmd = [sys.executable, "-m", "ringreduce.bench", "--nproc", "2", "-d", "float,bfloat16,float16", "-b", "4K",
           "-e", "256K", "-f", "64", "-n", "3", "--rounds", "2", "-w", "1", "--json", str(out), "-q"]
    if importlib.util.find_spec("matplotlib") is not None:
        cmd += ["--plot", str(png)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = proc.stdout
    for heading in ("# float (torch.float32)", "# bfloat16 (torch.bfloat16)", "# half (torch.float16)"):
        assert heading in text
    assert text.count("# Out of bounds values : 0 OK") == 3
    assert "# Time ratio ringreduce bfloat16/float (same bytes): 4K " in text
    doc = json.loads(out.read_text())
    assert validate_report(doc) == []
    assert {(row["type"], row["impl"], row["size"]) for row in doc["rows"]} == {
        (kind, impl, size) for kind in ("float", "bfloat16", "half") for impl in ("ringreduce", "gloo")
        for size in (4 * KIB, 256 * KIB)}
    assert all(row["wrong"] == 0 for row in doc["rows"])
    assert {row["count"] for row in doc["rows"] if row["type"] == "half" and row["size"] == 4 * KIB} == {2048}
    assert sorted(doc["summary"]["by_dtype"]["half"]["time_ratio_vs_float"]) == sorted([str(4 * KIB), str(256 * KIB)])
    if png.exists():
        from ringreduce.bench.plot import read_plot_metadata

        assert read_plot_metadata(str(png))["vs_float_lines"] == ["bfloat16 / float", "half / float"]


def test_bench_sh_sweeps_float_and_bfloat16_unless_told_otherwise(tmp_path) -> None:
    """scripts/bench.sh's arguments to the bench: -d float,bfloat16 by default; none where the caller names
    the types or asks for --wire-dtype / --vs (one type). Its type rule runs with a stand-in for the bench."""
    script = (open(os.path.join(REPO, "scripts", "bench.sh")).read())
    start = script.index("types=(-d float,bfloat16)")
    rule = script[start:script.index("done", start) + 4]
    probe = tmp_path / "probe.sh"
    probe.write_text("set -euo pipefail\n" + rule + '\necho "${types[@]+"${types[@]}"}"\n')

    def types(*args: str) -> str:
        return subprocess.run(["bash", str(probe), *args], capture_output=True, text=True, check=True).stdout.strip()

    assert types() == "-d float,bfloat16" and types("--nproc", "4", "-b", "1M") == "-d float,bfloat16"
    for told in (["-d", "half"], ["-dhalf"], ["--dtype=float"], ["--wire-dtype", "bf16"], ["--vs", "deepspeed"]):
        assert types(*told) == "", told
