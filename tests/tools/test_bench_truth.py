"""The benchmark's plot and JSON tell the truth (issue 35): the design's targets for the transport that
ran (none where it names none), which way is better on each axis, the transport in the title, the
whole command, and commit + UTC time + load average; read back from the JSON and the PNG's metadata."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ringreduce.bench.config import BenchConfig
from ringreduce.bench.metrics import aggregate_size
from ringreduce.bench.report import build_report, validate_report
from ringreduce.bench.targets import _TARGETS, target_lines

ROOT = Path(__file__).resolve().parents[2]
KIB, MIB = 1 << 10, 1 << 20


def _rows(ratios: dict[int, float], stock: str) -> list[dict]:
    rows = []
    for size, ratio in ratios.items():
        stats = {"iters": 5, "rounds": 3, "warmup": 1, "impls": {}}
        for name, us in (("ringreduce", 100.0 * ratio), (stock, 100.0)):
            stats["impls"][name] = {"median_us": us, "mean_us": us, "min_us": us, "max_us": us, "floor_us": 1.0,
                                    "wrong": 0, "peak_rss": MIB, "rss_growth": 0, "rss_exact": True,
                                    "cuda_growth": None}
        rows += aggregate_size(size, size // 4, "float", "avg", 2, [stats, stats])
    return rows


def _doc(ratios: dict[int, float], world_size: int = 2, backend: str = "gloo", transport: str = "default",
         env: dict | None = None, nccl_transport: str | None = None) -> dict:
    command = ["python", "-m", "ringreduce.bench", "--nproc", str(world_size), "-b", "1K", "-e", "64M", "-f", "4",
               "--json", "/some/long/path/" + "x" * 40 + "/allreduce.json", "--plot",
               "/some/long/path/" + "y" * 40 + "/allreduce.png", "--seconds", "2", "--rounds", "10", "-w", "5"] * 2
    cfg = BenchConfig(sizes=sorted(ratios), dtypes=("float",), op="avg", backend=backend, transport=transport,
                      command=command)
    machine = {"cpu_model": "cpu", "cpu_cores": 2, "gpus": ["GPU"] if backend == "nccl" else [], "torch": "2",
               "nccl": None, "world_size": world_size, "nodes": 1, "ringreduce": {"version": "0", "shm": True},
               "backend": backend, "transport": nccl_transport, "env": env or {},
               "started_utc": "2026-11-26T15:00:00Z", "load_average_start": [1.5, 1.0, 0.5]}
    stock = "nccl" if backend == "nccl" else "gloo"
    return build_report(cfg, machine, _rows(ratios, stock), stock, 1.0)


def test_design_section_5_states_the_targets_the_benchmark_draws():
    text = (ROOT / "docs" / "design.md").read_text()
    section = text[text.index("## 5. Targets"):text.index("## 6.")]
    flat = " ".join(section.split())
    assert "2 ranks <= 0.10x gloo's time at 1-64 KiB and <= 0.40x at 16 and 64 MiB" in flat
    assert "4 ranks <= 0.25x and <= 0.50x" in flat
    assert _TARGETS["shm"][2] == [(0.10, KIB, 64 * KIB), (0.40, 16 * MIB, 64 * MIB)]
    assert _TARGETS["shm"][4] == [(0.25, KIB, 64 * KIB), (0.50, 16 * MIB, 64 * MIB)]
    assert "<= 1.10x gloo's time at 1, 16 and 64 MiB at 2 and 4 ranks" in flat
    assert "<= 1.10x at every size from 1 KiB to 1 MiB" in flat
    assert _TARGETS["tcp"] == {2: [(1.10, KIB, 64 * MIB)], 4: [(1.10, KIB, 64 * MIB)]}
    assert "2 and 3 ranks: ringreduce <= 1.15x NCCL's time at 16-256 MiB, <= 1.5x at 1 MiB, <= 1.2x at 1-256 KiB" in flat
    assert set(_TARGETS["nccl-socket"]) == {2, 3}
    assert _TARGETS["nccl-socket"][2] == [(1.2, KIB, 256 * KIB), (1.5, MIB, MIB), (1.15, 16 * MIB, 256 * MIB)]


def test_json_names_the_transport_and_the_targets_met_and_missed():
    ratios = {KIB: 0.05, 16 * KIB: 0.2, 64 * KIB: 0.08, MIB: 0.3, 16 * MIB: 0.5, 64 * MIB: 0.3}
    doc = _doc(ratios)
    assert validate_report(doc) == []
    assert doc["ringreduce_transport"] == "shm" and doc["ringreduce_transport_name"] == "shared memory"
    assert [(t["max_time_ratio"], t["met"], t["missed"]) for t in doc["targets"]] == [
        (0.10, [KIB, 64 * KIB], [16 * KIB]), (0.40, [64 * MIB], [16 * MIB])]
    prov = doc["provenance"]
    assert re.fullmatch(r"[0-9a-f]{12}(\+dirty)?", prov["commit"]), prov
    assert prov["started_utc"] == "2026-11-26T15:00:00Z" and re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ",
                                                                          prov["finished_utc"])
    assert prov["load_average_start"] == [1.5, 1.0, 0.5] and len(prov["load_average_end"]) == 3
    lines = target_lines(doc).splitlines()
    assert lines[1] == "#   <= 0.1x gloo at 1K-64K: missed at 16K" and lines[2] == "#   <= 0.4x gloo at 16M-64M: missed at 16M"
    assert lines[-1].startswith(f"# commit {prov['commit']} | 2026-11-26T15:00:00Z | load average 1.50 at start")


@pytest.mark.parametrize("case,transport,bounds", [
    ({"env": {"RINGREDUCE_SHM": "0"}}, "tcp", [1.10]),
    ({"transport": "tcp"}, "tcp", [1.10]),
    ({"world_size": 3}, "shm", []),  # the design names no 3-rank CPU target
    ({"backend": "nccl", "nccl_transport": "nccl-socket-lo (2 ranks share 1 GPU)"}, "nccl-socket", [1.2, 1.5, 1.15]),
    ({"backend": "nccl", "nccl_transport": "nvlink/p2p (one GPU per rank)"}, "nccl", []),
])
def test_targets_follow_the_transport_that_ran(case: dict, transport: str, bounds: list[float]):
    doc = _doc({KIB: 1.0, MIB: 1.0, 64 * MIB: 1.0}, **case)
    assert doc["ringreduce_transport"] == transport
    assert [t["max_time_ratio"] for t in doc["targets"]] == bounds


def test_plot_reads_back_targets_labels_title_and_footer(tmp_path):
    pytest.importorskip("matplotlib")
    from ringreduce.bench.plot import read_plot_metadata, write_plot

    ratios = {KIB: 0.05, 16 * KIB: 0.2, 64 * KIB: 0.08, MIB: 0.3, 16 * MIB: 0.5, 64 * MIB: 0.3}
    doc = _doc(ratios)
    png = tmp_path / "shm.png"
    write_plot(doc, str(png))
    drawn = read_plot_metadata(str(png))
    assert "ringreduce over shared memory vs torch.distributed gloo" in drawn["title"].replace("\n", " ")
    assert "higher is better" in drawn["bandwidth_axis"] and "lower is better" in drawn["ratio_axis"]
    assert [t["label"] for t in drawn["targets"]] == ["target <= 0.1 at 1K-64K (missed at 16K)",
                                                      "target <= 0.4 at 16M-64M (missed at 16M)"]
    assert "target 1.10" not in str(drawn)
    assert " ".join(drawn["footer"][:-1]) == "cmd: " + " ".join(doc["command"])  # wrapped, not cut
    assert len(drawn["footer"]) > 2 and all(len(line) <= 150 for line in drawn["footer"])
    assert drawn["footer"][-1].startswith(f"commit {doc['provenance']['commit']} | 2026-11-26T15:00:00Z")

    tcp = _doc(ratios, env={"RINGREDUCE_SHM": "0"})
    write_plot(tcp, str(png))
    drawn = read_plot_metadata(str(png))
    assert "ringreduce over gloo point-to-point vs torch.distributed gloo" in drawn["title"].replace("\n", " ")
    assert [t["max_time_ratio"] for t in drawn["targets"]] == [1.10]

    write_plot(_doc(ratios, world_size=3), str(png))
    assert read_plot_metadata(str(png))["targets"] == []


def test_an_older_json_is_drawn_again_with_the_targets_of_its_transport(tmp_path):
    """benchmarks/results/*.png are drawn from their JSON (schema /2) by `python -m ringreduce.bench.plot`:
    transport and targets derived from what the JSON recorded, the provenance said to be missing."""
    pytest.importorskip("matplotlib")
    import json

    from ringreduce.bench.plot import main, read_plot_metadata
    from ringreduce.bench.report import upgrade_report

    old = json.loads((ROOT / "benchmarks" / "results" / "cpu-2ranks-tcp.json").read_text())
    assert old["schema"] == "ringreduce.bench.allreduce/2"
    doc = upgrade_report(old)
    assert [p for p in validate_report(doc) if not p.startswith("row ")] == []  # its rows are as they were
    assert doc["ringreduce_transport"] == "tcp"
    assert [t["max_time_ratio"] for t in doc["targets"]] == [1.10]
    png = tmp_path / "again.png"
    assert main([str(ROOT / "benchmarks" / "results" / "cpu-2ranks.json"), str(png)]) == 0
    drawn = read_plot_metadata(str(png))
    assert drawn["transport"] == "shm" and [t["max_time_ratio"] for t in drawn["targets"]] == [0.10, 0.40]
    assert drawn["footer"][-1] == ("commit, time and load average not recorded: written by the benchmark's schema "
                                   "ringreduce.bench.allreduce/2")
