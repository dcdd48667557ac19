"""The bench's --algorithms columns (ringreduce with algorithm="ring" / "hierarchical" beside auto and
the stock all-reduce): parsing, the table's ratio columns and footer, and one run on 4 ranks as two
simulated nodes (RINGREDUCE_LOCAL_SIZE=2) whose rows are all exact."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ringreduce.bench import cli
from ringreduce.bench.table import Layout, footer, format_row, header

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _row(impl: str, time_us: float, size: int = 1 << 24) -> dict:
    return {"impl": impl, "size": size, "count": size // 4, "type": "float", "redop": "avg", "time_us": time_us,
            "algbw_gbs": size / time_us / 1e3, "busbw_gbs": size / time_us / 1e3, "wrong": 0, "floor_us": 10.0}


def test_cli_parses_algorithms_and_refuses_others() -> None:
    cfg = cli.make_config(cli.build_parser().parse_args(["--algorithms", "hierarchical,ring,ring"]), [], "gloo", "spawn")
    assert cfg.algorithms == ("hierarchical", "ring")
    assert cli.make_config(cli.build_parser().parse_args([]), [], "gloo", "spawn").algorithms == ()
    with pytest.raises(SystemExit, match="--algorithms takes ring, hierarchical and/or direct, got 'ring,tree'"):
        cli.make_config(cli.build_parser().parse_args(["--algorithms", "ring,tree"]), [], "gloo", "spawn")


def test_table_has_a_ratio_column_per_algorithm() -> None:
    layout = Layout(("ringreduce", "gloo", "rr-ring", "rr-hier"), "gloo")
    assert layout.extras[-2:] == ("ring/gloo", "hier/gloo")
    assert "ring/gloo hier/gloo" in header(layout)[1]
    rows = [_row("ringreduce", 700.0), _row("gloo", 1000.0), _row("rr-ring", 1100.0), _row("rr-hier", 750.0)]
    assert format_row(rows, layout).split()[-2:] == ["1.100", "0.750"]
    lines = footer(rows, layout)
    assert "# Time ratio rr-ring/gloo: 16M 1.100" in lines and "# Time ratio rr-hier/gloo: 16M 0.750" in lines
    assert "ring/gloo" not in Layout(("ringreduce", "gloo"), "gloo").extras


@pytest.mark.full
def test_run_on_two_simulated_nodes_gives_exact_rows(tmp_path) -> None:
    env = dict(os.environ, RINGREDUCE_LOCAL_SIZE="2", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    res = subprocess.run([sys.executable, "-m", "ringreduce.bench", "--nproc", "4", "-b", "64K", "-e", "64K",
                          "--seconds", "0.1", "--rounds", "2", "--algorithms", "ring,hierarchical", "-q",
                          "--json", str(tmp_path / "r.json")], capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rows = json.load(open(tmp_path / "r.json"))["rows"]
    assert [r["impl"] for r in rows] == ["ringreduce", "gloo", "rr-ring", "rr-hier"]
    assert all(r["wrong"] == 0 for r in rows)


def test_direct_columns_compare_it_with_the_ring() -> None:
    """--algorithms ring,direct: direct/ring, both errors, the elements off where the float32 sum is exact;
    with --wire-dtype bf16, direct with the wire over the ring's wire and its error."""
    layout = Layout(("ringreduce", "gloo", "rr-bf16", "ddp-bf16", "rr-ring", "rr-direct", "rr-direct-bf16"), "gloo",
                    wire="bf16")
    assert layout.extras[-7:] == ("direct/ring", "err-ring", "err-direct", "off-ring", "off-direct", "dwire/wire",
                                  "err-dwire")
    rows = [_row("ringreduce", 700.0), _row("gloo", 1000.0), _row("rr-bf16", 600.0), _row("ddp-bf16", 650.0),
            _row("rr-ring", 800.0), _row("rr-direct", 840.0), _row("rr-direct-bf16", 540.0)]
    for row, err, off in zip(rows[2:], (2e-3, 3e-3, 2.5e-3, 1.5e-3, 1.2e-3), (None, None, 9, 0, None), strict=True):
        row["rel_error"] = err
        if off is not None:
            row["off_exact"] = off
    assert format_row(rows, layout).split()[-7:] == ["1.050", "2.50e-03", "1.50e-03", "9", "0", "0.900", "1.20e-03"]
    assert "# Time ratio rr-direct-bf16/gloo: 16M 0.540" in footer(rows, layout)
