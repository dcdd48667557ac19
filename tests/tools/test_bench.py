"""The benchmark: pure arithmetic and formatting, a short real sweep, and ringreduce's memory bound."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from ranks import run_ranks, spawn_ranks

from ringreduce.bench.config import BenchConfig
from ringreduce.bench.data import count_wrong, expected_chunk, fill_pattern, pattern_modulus
from ringreduce.bench.metrics import (
    aggregate_size,
    algbw_gbs,
    average_busbw,
    busbw_factor,
    busbw_gbs,
    loopback_efficiency,
    loopback_hbm_bytes,
    loopback_ideal_us,
    time_ratio,
)
from ringreduce.bench.report import build_report, validate_report
from ringreduce.bench.sizes import format_size, parse_dtype, parse_size, size_sweep
from ringreduce.bench.sweep import calls_per_round
from ringreduce.bench.table import Layout, footer, format_row, header, memory_lines
from ringreduce.bench.timing import auto_iters

MIB = 1 << 20
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _rank_stats(median: float, wrong: int = 0, growth: int = MIB, floor: float = 40.0) -> dict:
    return {"median_us": median, "mean_us": median * 1.1, "min_us": median * 0.9, "max_us": median * 2,
            "floor_us": floor, "wrong": wrong, "peak_rss": 500 * MIB, "rss_growth": growth, "rss_exact": True,
            "cuda_growth": None}


def _fake_rows(size: int = 16 * MIB) -> list[dict]:
    per_rank = [
        {"iters": 20, "rounds": 10, "warmup": 5,
         "impls": {"ringreduce": _rank_stats(100.0), "gloo": _rank_stats(200.0)}},
        {"iters": 20, "rounds": 10, "warmup": 5,
         "impls": {"ringreduce": _rank_stats(300.0, wrong=2, floor=60.0), "gloo": _rank_stats(200.0, floor=60.0)}},
    ]
    return aggregate_size(size, size // 4, "float", "avg", 2, per_rank)


# (a) pure functions -------------------------------------------------------------------------------


def test_bandwidth_arithmetic() -> None:
    assert algbw_gbs(1_000_000_000, 1e6) == pytest.approx(1.0)
    assert busbw_factor(2) == 1.0 and busbw_factor(4) == 1.5 and busbw_factor(8) == 1.75
    assert busbw_factor(1) == 0.0
    assert busbw_gbs(64 * MIB, 58_000.0, 2) == pytest.approx(64 * MIB / 0.058 / 1e9)
    assert busbw_gbs(64 * MIB, 100.0, 4) == pytest.approx(algbw_gbs(64 * MIB, 100.0) * 1.5)
    assert algbw_gbs(10, 0.0) == 0.0


def test_aggregate_means_over_ranks_and_sums_wrong() -> None:
    rows = _fake_rows()
    rr, gloo = rows
    assert rr["impl"] == "ringreduce" and rr["time_us"] == 200.0 and rr["time_us_max"] == 300.0
    assert rr["per_rank_median_us"] == [100.0, 300.0] and rr["wrong"] == 2
    assert rr["floor_us"] == 50.0 and rr["rounds"] == 10  # the memcpy floor, averaged over ranks
    assert rr["busbw_gbs"] == pytest.approx(busbw_gbs(16 * MIB, 200.0, 2))
    assert time_ratio(rows, "ringreduce", "gloo") == pytest.approx(1.0)
    assert time_ratio(rows, "ringreduce", "nccl") is None
    assert average_busbw(rows)["gloo"] == pytest.approx(gloo["busbw_gbs"])


def test_table_lines_line_up() -> None:
    layout = Layout(("ringreduce", "rr-nocheck", "gloo"), "gloo")
    assert layout.extras == ("ratio", "floor(us)", "/floor", "check(us)")
    rows = _fake_rows()
    rows.insert(1, dict(rows[0], impl="rr-nocheck", time_us=150.0, wrong=0))
    head = header(layout)
    line = format_row(rows, layout)
    assert len(head) == 3 and all(h.startswith("#") for h in head)
    assert len(head[1]) == len(line)
    fields = line.split()
    assert fields[:4] == [str(16 * MIB), str(4 * MIB), "float", "avg"]
    assert fields[4] == "200.0" and fields[7] == "2" and fields[11] == "0"  # times, #wrong
    assert fields[-4:] == ["1.000", "50.0", "4.00", "50.0"]  # ratio, floor (us), time / floor, check cost (us)
    foot = footer(rows, layout)
    assert foot[0] == "# Out of bounds values : 2 FAILED"
    assert "16M 1.000" in foot[2]
    mem = "\n".join(memory_lines(rows, layout, 8 * MIB))
    assert "bound 8 MiB: OK" in mem


def test_nccl_layout_has_ring_column() -> None:
    layout = Layout(("ringreduce", "nccl", "nccl-ring"), "nccl")
    assert layout.extras == ("ratio", "floor(us)", "/floor", "%ring")
    rows = aggregate_size(MIB, MIB // 4, "float", "avg", 8, [
        {"iters": 5, "rounds": 10, "warmup": 1, "impls": {"ringreduce": _rank_stats(100.0), "nccl": _rank_stats(80.0),
                                                          "nccl-ring": _rank_stats(90.0)}}])
    assert format_row(rows, layout).endswith("1.250      40.0      2.50     90.0%")


def test_loopback_columns() -> None:
    """Note [Loopback ideal]: 7 (n - 1) x size bytes of HBM traffic, ideal = that at a copy's rate (a copy of
    the buffer moves 2 x size); rank 0's loopback time and copy become the ringreduce row's loop(us) and
    loop-eff columns (GPU runs), and the footer's summary line."""
    assert loopback_hbm_bytes(4, 256 * MIB) == 7 * 3 * 256 * MIB
    assert loopback_hbm_bytes(1, MIB) == 0
    assert loopback_ideal_us(4, 100.0) == pytest.approx(1050.0)  # 21 size-units over 2 per copy
    assert loopback_ideal_us(8, 10.0) == pytest.approx(245.0)
    assert loopback_efficiency(2000.0, 1600.0) == pytest.approx(0.8)
    assert loopback_efficiency(0.0, 1.0) == 0.0
    per_rank = [
        {"iters": 5, "rounds": 10, "warmup": 1,
         "impls": {"ringreduce": {**_rank_stats(100.0), "loopback_us": 2100.0, "loopback_copy_us": 200.0},
                   "nccl": _rank_stats(80.0), "nccl-ring": _rank_stats(90.0)}},
        {"iters": 5, "rounds": 10, "warmup": 1,
         "impls": {"ringreduce": _rank_stats(100.0), "nccl": _rank_stats(80.0), "nccl-ring": _rank_stats(90.0)}},
    ]
    rows = aggregate_size(256 * MIB, 64 * MIB, "float", "avg", 2, per_rank)
    rr = rows[0]
    assert rr["loopback_us"] == 2100.0 and rr["loopback_ideal_us"] == pytest.approx(7 / 2 * 200.0)
    assert "loopback_us" not in rows[1]
    layout = Layout(("ringreduce", "nccl", "nccl-ring"), "nccl", loopback=True)
    assert layout.extras == ("ratio", "floor(us)", "/floor", "%ring", "loop(us)", "loop-eff")
    assert len(header(layout)[1]) == len(format_row(rows, layout))  # the columns line up
    assert format_row(rows, layout).split()[-2:] == ["2100.0", "0.33"]
    assert any("Loopback" in line and "256M 0.33" in line for line in footer(rows, layout))
    without = aggregate_size(MIB, MIB // 4, "float", "avg", 2, [per_rank[1]])
    assert format_row(without, layout).split()[-2:] == ["n/a", "n/a"]


def test_json_schema() -> None:
    cfg = BenchConfig(sizes=[16 * MIB], dtypes=("float",), op="avg", backend="gloo", command=["python", "-m", "x"])
    machine = {"cpu_model": "cpu", "cpu_cores": 2, "gpus": [], "torch": "2", "nccl": None, "world_size": 2,
               "ringreduce": {"version": "0"}}
    doc = build_report(cfg, machine, _fake_rows(), "gloo", 1.5)
    assert validate_report(doc) == []
    assert validate_report(json.loads(json.dumps(doc))) == []
    assert doc["summary"]["time_ratio_vs_stock"] == {str(16 * MIB): pytest.approx(1.0)}
    assert doc["summary"]["wrong_total"] == 2
    broken = json.loads(json.dumps(doc))
    del broken["rows"][0]["busbw_gbs"]
    broken["machine"].pop("cpu_model")
    broken["world_size"] = "2"
    problems = validate_report(broken)
    assert len(problems) == 3 and any("busbw_gbs" in p for p in problems)
    assert validate_report([]) == ["document is not an object"]


def test_sizes_and_dtypes() -> None:
    assert parse_size("8") == 8 and parse_size("1K") == 1024 and parse_size("256M") == 256 * MIB
    assert parse_size("1GiB") == 1 << 30 and parse_size("0.5K") == 512
    with pytest.raises(ValueError):
        parse_size("12Q")
    assert format_size(64 * MIB) == "64M" and format_size(1000) == "1000"
    assert size_sweep(8, 256 * MIB, 2, None, 4)[:3] == [8, 16, 32] and size_sweep(8, 256 * MIB, 2, None, 4)[-1] == 256 * MIB
    assert size_sweep(1024, 64 * MIB, 4, None, 4) == [1024 << (2 * i) for i in range(9)]
    assert size_sweep(2, 10, None, 3, 4) == [4, 8]  # rounded down to whole float elements
    assert parse_dtype("float32").name == "float" and parse_dtype("bf16").torch_dtype == torch.bfloat16
    with pytest.raises(ValueError):
        parse_dtype("complex32")
    assert auto_iters(0.06, 4.0, 10, 1000) == 67 and auto_iters(1e-5, 4.0, 10, 1000) == 1000
    assert auto_iters(10.0, 4.0, 10, 1000) == 10


def test_every_column_gets_its_own_calls_per_round() -> None:
    """Note [Calls per round]: in rounds a fast column's count fills its own share of --seconds, not the
    slowest column's; -n fixes every count; single calls take the slowest's for all."""
    base = dict(sizes=[1024], dtypes=("float",), op="avg", backend="gloo", seconds_per_size=1.0, min_iters=10,
                max_iters=1000)
    estimates = [200e-6, 2e-3, 0.5]  # ringreduce, gloo, something slower than --seconds / --rounds
    assert calls_per_round(BenchConfig(**base, rounds=10), estimates) == [500, 50, 10]
    assert calls_per_round(BenchConfig(**{**base, "max_iters": 300}, rounds=10), estimates) == [300, 50, 10]
    assert calls_per_round(BenchConfig(**base, rounds=10, iters=7), estimates) == [7, 7, 7]
    assert calls_per_round(BenchConfig(**base, timing="single"), estimates[:2]) == [500, 500]
    per_rank = [{"iters": 50, "rounds": 10, "warmup": 5,
                 "impls": {"ringreduce": {**_rank_stats(100.0), "iters": 500}, "gloo": {**_rank_stats(200.0), "iters": 50}}}
                for _ in range(2)]
    assert [row["iters"] for row in aggregate_size(1024, 256, "float", "avg", 2, per_rank)] == [500, 50]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.float64])
@pytest.mark.parametrize("world_size", [2, 3, 5, 17])
def test_pattern_expected_matches_brute_force(dtype: torch.dtype, world_size: int) -> None:
    k = pattern_modulus(dtype, world_size)
    assert k % 3 != 0 and 2 <= k <= 16
    count = 1000
    total = torch.zeros(count, dtype=torch.float64)
    for r in range(world_size):
        t = torch.empty(count, dtype=dtype)
        fill_pattern(t, r, k)
        total += t.double()
    assert torch.equal(expected_chunk(0, count, world_size, k, "sum", dtype, torch.device("cpu")), total.to(dtype))
    if dtype.is_floating_point:
        acc = torch.float64 if dtype == torch.float64 else torch.float32
        avg = (total.to(acc) / world_size).to(dtype)
        assert count_wrong(avg, world_size, k, "avg") == 0
        avg[7] += 1
        assert count_wrong(avg, world_size, k, "avg") == 1


# (b) a short real sweep ---------------------------------------------------------------------------


@pytest.mark.parametrize("timing", ["rounds", "single"])
@pytest.mark.full
def test_cli_short_sweep(tmp_path, timing: str) -> None:
    out = tmp_path / "bench.json"
    png = tmp_path / "bench.png"
    cmd = [sys.executable, "-m", "ringreduce.bench", "--nproc", "2", "-b", "1K", "-e", "256K", "-f", "16",
           "-n", "5", "--rounds", "3", "-w", "1", "--timing", timing, "--check-cost", "--json", str(out),
           "--plot", str(png), "-q"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "# Out of bounds values : 0 OK" in proc.stdout
    assert ("rounds of back-to-back calls" if timing == "rounds" else "single barrier-aligned calls") in proc.stdout
    assert "floor(us)" in proc.stdout and "/floor" in proc.stdout
    doc = json.loads(out.read_text())
    assert validate_report(doc) == []
    assert doc["config"]["timing"] == timing
    assert {row["impl"] for row in doc["rows"]} == {"ringreduce", "rr-nocheck", "gloo"}
    assert sorted({row["size"] for row in doc["rows"]}) == [1024, 16 * 1024, 256 * 1024]
    assert all(row["wrong"] == 0 for row in doc["rows"]), doc["rows"]
    assert all(row["iters"] == 5 and row["rounds"] == (3 if timing == "rounds" else 1) for row in doc["rows"])
    assert all(row["floor_us"] > 0 for row in doc["rows"])
    assert png.stat().st_size > 10_000
    # What ran and against what (tests/tools/test_bench_truth.py): shared memory, its 2-rank targets.
    assert doc["ringreduce_transport"] == "shm" and doc["provenance"]["commit"]
    assert [(t["max_time_ratio"], sorted(t["met"] + t["missed"])) for t in doc["targets"]] == [(0.10, [1024, 16 * 1024])]
    assert "# ringreduce ran over shared memory; targets (docs/design.md section 5" in proc.stdout
    from ringreduce.bench.plot import read_plot_metadata

    drawn = read_plot_metadata(str(png))
    assert drawn["transport"] == "shm" and drawn["targets"][0]["label"].startswith("target <= 0.1 at 1K-64K (")


def test_cli_refuses_shm_without_the_transport(monkeypatch) -> None:
    from ringreduce.bench import cli

    # A build without the transport (build_info()["shm"] False) is simulated: every build here has it.
    monkeypatch.setattr(cli, "_has_shm", lambda: False)
    with pytest.raises(SystemExit, match="no shared-memory transport"):
        cli.make_config(cli.build_parser().parse_args(["--transport", "shm"]), [], "gloo", "spawn")


def test_cli_refuses_plot_without_matplotlib_before_the_sweep(monkeypatch) -> None:
    from ringreduce.bench import cli

    monkeypatch.setattr(cli, "_has_matplotlib", lambda: False)
    with pytest.raises(SystemExit, match="--plot needs matplotlib"):
        cli.make_config(cli.build_parser().parse_args(["--plot", "x.png"]), [], "gloo", "spawn")
    cfg = cli.make_config(cli.build_parser().parse_args(["--json", "x.json"]), [], "gloo", "spawn")
    assert cfg.plot_path is None


def test_train_step_refuses_nccl_with_fewer_gpus_than_ranks(monkeypatch) -> None:
    """The training-step benchmark runs one rank per GPU (cuda:LOCAL_RANK): more local ranks than GPUs
    is a clear SystemExit before any rank starts (it was an invalid device ordinal on rank 1)."""
    from ringreduce.bench import train_step

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(SystemExit, match="one rank per GPU.*2 local ranks meet 1 visible GPU.*--backend gloo"):
        train_step._resolve_backend("nccl", 2)
    assert train_step._resolve_backend("auto", 2) == "gloo"
    assert train_step._resolve_backend("nccl", 1) == "nccl"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    with pytest.raises(SystemExit, match="--nproc 4"):
        train_step._resolve_backend("nccl", 8)
    assert train_step._resolve_backend("auto", 4) == "nccl"


def _sweep_on_rank(rank: int, world_size: int, cfg: BenchConfig) -> list | None:
    from ringreduce.bench.sweep import RankContext, run_sweep

    result = run_sweep(cfg, RankContext(rank, world_size, torch.device("cpu")))
    return None if result is None else result[0]


def test_sweep_sum_bfloat16_on_pool() -> None:
    cfg = BenchConfig(sizes=[2, 1000, 65538], dtypes=("bfloat16",), op="sum", backend="gloo", iters=3, warmup=1,
                      quiet=True)
    rows = run_ranks(2, _sweep_on_rank, cfg, timeout=120)[0]
    assert len(rows) == 6 and all(row["wrong"] == 0 for row in rows), rows
    assert [row["count"] for row in rows[::2]] == [1, 500, 32769]


def test_sweep_wire_dtype_adds_the_16_bit_columns_on_pool() -> None:
    """--wire-dtype: ringreduce with the wire and DDP's compress hook in the same run; exact on the
    pattern data (its sums are exact in 16 bits), relative errors ordered as documented."""
    from ringreduce.bench.table import Layout, format_row, header

    cfg = BenchConfig(sizes=[4096, 1 << 20], dtypes=("float",), op="avg", backend="gloo", iters=3, warmup=1,
                      quiet=True, wire_dtype="bf16")
    rows = run_ranks(2, _sweep_on_rank, cfg, timeout=120)[0]
    assert {row["impl"] for row in rows} == {"ringreduce", "gloo", "rr-bf16", "ddp-bf16"}
    assert all(row["wrong"] == 0 for row in rows), rows
    for size in (4096, 1 << 20):
        err = {row["impl"]: row["rel_error"] for row in rows if row["size"] == size}
        assert err["gloo"] is None
        assert err["ringreduce"] < 1e-6 < err["rr-bf16"] < err["ddp-bf16"] < 1e-2, err
    layout = Layout(("ringreduce", "gloo", "rr-bf16", "ddp-bf16"), "gloo", wire="bf16")
    lines = header(layout) + [format_row([r for r in rows if r["size"] == 4096], layout)]
    assert "wire/f32" in lines[1] and "err-ddp" in lines[1]
    assert len(lines[1]) == len(lines[-1]), "\n".join(lines)  # the columns line up


def _rank0_alone_twice(rank: int, world_size: int) -> list[tuple[float, float]]:
    """Two rank-0-alone sections; returns per section (when rank 0's work ended, when this rank left)
    and fails if any rank made a collective meanwhile."""
    import time

    from ringreduce.bench.sweep import RankContext, _on_rank0_alone

    names = ("barrier", "all_reduce", "all_gather", "broadcast", "gather_object", "all_gather_object")
    saved = {name: getattr(dist, name) for name in names}
    collectives: list[str] = []
    for name in names:
        setattr(dist, name, lambda *a, _name=name, **k: collectives.append(_name))
    ctx = RankContext(rank, world_size, torch.device("cpu"))
    out = []
    try:
        for _ in range(2):
            ended = [0.0]

            def work(ended: list[float] = ended) -> None:
                time.sleep(0.3)
                ended[0] = time.time()

            _on_rank0_alone(ctx, work)
            out.append((ended[0], time.time()))
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)
    assert not collectives, f"rank {rank} made collectives while rank 0 worked alone: {collectives}"
    return out


def test_loopback_timing_keeps_the_other_ranks_off_the_gpu() -> None:
    """Rank 0 times the loopback driver alone (bench/sweep.py _on_rank0_alone): the other ranks wait
    on the host until it is done, in no collective (a waiting NCCL barrier would keep a kernel
    spinning on their GPU, which ranks sharing a GPU time-slice against rank 0's work); and a second
    section waits again (its own key)."""
    per_rank = run_ranks(3, _rank0_alone_twice, timeout=60)
    for section in range(2):
        rank0_done = per_rank[0][section][0]
        assert rank0_done > 0
        for r in (1, 2):
            assert per_rank[r][section][1] >= rank0_done, (section, r, per_rank)


def test_cli_refuses_wire_dtype_for_other_types() -> None:
    from ringreduce.bench import cli

    with pytest.raises(SystemExit, match="--wire-dtype applies to float32"):
        cli.make_config(cli.build_parser().parse_args(["--wire-dtype", "bf16", "-d", "half"]), [], "gloo", "spawn")


# (c) ringreduce's memory bound --------------------------------------------------------------------


def _rss_growth_of_all_reduce(rank: int, world_size: int, mib: int) -> float:
    import ringreduce
    from ringreduce.bench.memory import measure_call

    x = torch.full((mib * MIB // 4,), float(rank + 1))  # allocated and touched before measuring
    mem = measure_call(lambda: ringreduce.all_reduce_avg(x), torch.device("cpu"))
    assert mem.rss_exact, "VmHWM could not be reset (/proc/self/clear_refs)"
    assert float(x[0]) == 1.5 and float(x[-1]) == 1.5
    return mem.rss_growth / MIB


def test_ringreduce_memory_is_a_few_segments() -> None:
    """docs/design.md section 5: a 64 MiB float32 all-reduce adds only staging (<= 8 MiB) over its input."""
    results = spawn_ranks(2, _rss_growth_of_all_reduce, 64, timeout=150)
    for status, growth, code in results:
        assert status == "ok" and code == 0, (status, growth, code)
        assert growth <= 8 + 1.0, f"peak RSS grew by {growth:.2f} MiB over the 64 MiB input"


def _staging_after_each_size(rank: int, world_size: int) -> list[tuple[str, int, int, bool]]:
    import ringreduce
    from ringreduce import _C

    pg = dist.new_group(backend="gloo")  # a group of its own: the pool's WORLD keeps slots of earlier jobs
    out = []
    for label, mib_x16, check in [("1M", 16, "0"), ("1M", 16, "1"), ("4M", 64, "1"), ("64M", 1024, "1"),
                                  ("1M again", 16, "1"), ("16K", 0, "1")]:
        os.environ["RINGREDUCE_CHECK"] = check
        ringreduce.reload_knobs()  # the rings read their knobs again (ringreduce/_config.py)
        numel = mib_x16 * MIB // 64 if mib_x16 else 4096
        pattern = (torch.arange(numel) % 4099).to(torch.float32)  # position-dependent, sums exact
        x = pattern + rank
        ringreduce.all_reduce(x, op="sum", group=pg)
        want = world_size * pattern + world_size * (world_size - 1) // 2
        out.append((f"{label} check={check}", int(_C.staging_bytes(pg)), int(_C.memory_bytes(pg)),
                    bool(torch.equal(x, want))))
    os.environ.pop("RINGREDUCE_CHECK", None)
    ringreduce.reload_knobs()  # the rings read their knobs again (ringreduce/_config.py)
    dist.destroy_process_group(pg)
    return out


def test_staging_is_a_slot_per_receive_within_the_bound() -> None:
    """Note [Staging slots]: a 1 MiB float32 all-reduce on 4 ranks stages each of its 12 receives of
    128 KiB in a slot of its own (slot 0 with room for the 1 MiB leading receive when the check is
    on); a 64 MiB one uses 4 slots of 1 MiB; the group never holds more than 8 MiB of staging and
    12 MiB in all (docs/design.md section 5, memory), whatever sizes came before."""
    for rank_result in run_ranks(4, _staging_after_each_size, transport="tcp"):  # the gloo path's staging
        seen = {label: (staging, memory, ok) for label, staging, memory, ok in rank_result}
        assert all(ok for _, _, ok in seen.values()), seen
        assert seen["1M check=0"][0] == 12 * 128 * 1024, seen
        assert seen["1M check=1"][0] == MIB + 11 * 128 * 1024, seen
        assert seen["4M check=1"][0] == MIB + 11 * 512 * 1024, seen
        # staging <= 8 MiB; everything ringreduce holds for the group (staging, agreement-frame
        # buffers, one-shot scratch: Note [One-shot all-reduce]) <= 12 MiB
        assert all(staging <= 8 * MIB and staging <= memory <= 12 * MIB for staging, memory, _ in seen.values()), seen


@pytest.mark.full
def test_traffic_mode_reports_cross_node_bytes(tmp_path) -> None:
    out = tmp_path / "traffic.json"
    cmd = [sys.executable, "-m", "ringreduce.bench.traffic", "--nproc", "4", "--local-size", "2", "--size", "64K",
           "--iters", "1", "--json", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "# ring: max per rank 98304 B = 1.500 S (expected 1.500 S)" in proc.stdout, proc.stdout
    assert "# hierarchical: max per rank 32768 B = 0.500 S (expected 0.500 S)" in proc.stdout, proc.stdout
    doc = json.loads(out.read_text())
    assert doc["summary"]["hierarchical"]["cross_node_bytes_per_node"] == {"0": 65536, "1": 65536}
    assert all(s["correct"] for s in doc["summary"].values())


# (c) --vs deepspeed -------------------------------------------------------------------------------

_HIDE_DEEPSPEED = "import sys; sys.modules['deepspeed'] = None; from ringreduce.bench.cli import main; main({argv!r})"


def test_cli_vs_deepspeed_without_deepspeed_is_a_one_line_refusal() -> None:
    """DeepSpeed is an optional benchmark dependency: where it cannot be imported (hidden here), --vs
    deepspeed exits at once with one line that says how to install it, before any rank starts."""
    argv = ["--vs", "deepspeed", "-b", "1K", "-e", "1K"]
    proc = subprocess.run([sys.executable, "-c", _HIDE_DEEPSPEED.format(argv=argv)], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install deepspeed" in lines[0] and "--vs deepspeed" in lines[0], proc.stderr


def test_vs_columns_line_up_and_report_fallbacks() -> None:
    per_rank = [{"iters": 5, "rounds": 2, "warmup": 1, "impls": {
        "ringreduce": {**_rank_stats(10.0), "rel_error": 1e-3, "off": 0},
        "gloo": {**_rank_stats(400.0), "rel_error": 2e-3, "off": 7},
        "deepspeed": {**_rank_stats(5.0), "rel_error": 1e-3, "off": 0, "calls": 40, "fallback_calls": 40 * r,
                      "profiled_ops": ["deepspeed::inference_all_reduce_"]}}} for r in range(2)]
    rows = aggregate_size(1024, 256, "bfloat16", "sum", 2, per_rank)
    by = {row["impl"]: row for row in rows}
    assert by["deepspeed"]["fallback_calls"] == 40 and by["deepspeed"]["calls"] == 80 and by["gloo"]["off"] == 7
    layout = Layout(("ringreduce", "gloo", "deepspeed"), "gloo")
    lines = header(layout) + [format_row(rows, layout)]
    assert "rr/ds" in lines[1] and "ds-fb" in lines[1] and len(lines[1]) == len(lines[-1]), "\n".join(lines)
    assert "    2.000" in lines[-1]  # ringreduce 10 us / deepspeed 5 us
    assert any("80 calls, 40 fell back" in line for line in footer(rows, layout))


def _deepspeed_segments() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith(f"deepspeed_allreduce_buffer_{os.getuid()}_")}


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed (pip install deepspeed)")
def test_cli_vs_deepspeed_runs_its_shm_op(tmp_path) -> None:
    """A short --vs deepspeed sweep: DeepSpeed's column in the same run, exact on the pattern data, every
    float32 call through its shm op (no fallback; the profiled call ran deepspeed::inference_all_reduce_
    and no gloo all_reduce), accuracy columns, and nothing left behind in /dev/shm."""
    out = tmp_path / "ds.json"
    before = _deepspeed_segments()
    cmd = [sys.executable, "-m", "ringreduce.bench", "--nproc", "2", "-b", "1K", "-e", "1M", "-f", "32", "-n", "5",
           "--rounds", "2", "-w", "1", "-o", "sum", "--vs", "deepspeed", "--pin", "--json", str(out), "-q"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "rr/ds" in proc.stdout and "0 fell back" in proc.stdout, proc.stdout
    doc = json.loads(out.read_text())
    assert validate_report(doc) == [] and doc["machine"]["deepspeed"]
    ds = [row for row in doc["rows"] if row["impl"] == "deepspeed"]
    assert len(ds) == 3 and all(row["wrong"] == 0 and row["fallback_calls"] == 0 and row["calls"] > 0 for row in ds)
    assert all("deepspeed::inference_all_reduce_" in row["profiled_ops"] for row in ds), ds
    assert all(not any(op.startswith("gloo") for op in row["profiled_ops"]) for row in ds), ds
    assert all(row["off"] is not None and row["rel_error"] is not None for row in doc["rows"])
    assert _deepspeed_segments() <= before


@pytest.mark.full
def test_train_step_ddp_backend_variant_runs_ddp_over_ringreduce(tmp_path) -> None:
    """ddp-backend: stock DDP over a "ringreduce" group, beside DDP over gloo; at 2 ranks the two end
    with the same parameters bit for bit (Note [What bitwise-equal DDP needs] in
    tests/test_backend_train.py)."""
    out = tmp_path / "train.json"
    cmd = [sys.executable, "-m", "ringreduce.bench.train_step", "--variants", "ddp,ddp-backend", "--layers", "2",
           "--width", "64", "--steps", "2", "--warmup", "1", "--json", str(out)]
    env = {**os.environ, "PYTHONPATH": REPO}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    rows = {r["variant"]: r for r in doc["rows"]}
    assert set(rows) == {"ddp", "ddp-backend"} and doc["results_agree"], doc
    assert rows["ddp-backend"]["max_param_diff"] == 0.0, rows
    assert rows["ddp-backend"]["median_ms"] > 0 and "ddp-backend" in proc.stdout
