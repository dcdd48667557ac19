"""benchmarks/compare.py: medians over runs of two builds, from the JSON the benchmark writes."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[2]


def _compare():
    spec = importlib.util.spec_from_file_location("rr_bench_compare", _ROOT / "benchmarks" / "compare.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _sweep(path: Path, times: dict[int, tuple[float, float]]) -> None:
    rows = []
    for size, (rr, gloo) in times.items():
        rows.append({"size": size, "impl": "ringreduce", "time_us": rr})
        rows.append({"size": size, "impl": "gloo", "time_us": gloo})
    path.write_text(json.dumps({"rows": rows}))


def test_medians_ratios_and_missing_sizes(tmp_path):
    # three runs of each build; medians: old 1 KiB 20, new 1 KiB 30 (the outlier 900 drops out)
    for i, (o, n) in enumerate([(10.0, 30.0), (20.0, 900.0), (40.0, 25.0)], start=1):
        _sweep(tmp_path / f"old-2r-{i}.json", {1024: (o, 100.0), 2**20: (1000.0, 4000.0)})
        _sweep(tmp_path / f"new-2r-{i}.json", {1024: (n, 200.0)} | ({2**20: (500.0, 4000.0)} if i == 1 else {}))
    (tmp_path / "notes.json").write_text("{}")  # not a run: ignored
    text = _compare().table(_compare().load(tmp_path), "old", "new")
    lines = text.splitlines()
    assert lines[0] == "2 ranks: 3 runs of old, 3 runs of new; medians over runs"
    assert "| 1 KiB | 20.0 | 30.0 | 1.50 | 0.200 | 0.150 |" in lines
    # 1 MiB: the new build ran it once; its median is that run
    assert "| 1 MiB | 1000.0 | 500.0 | 0.50 | 0.250 | 0.125 |" in lines


def test_training_step_table(tmp_path):
    for i, (old, new) in enumerate([(150.0, 120.0), (170.0, 100.0)], start=1):
        for build, step in (("old", old), ("new", new)):
            rows = [{"variant": "ddp", "median_ms": 200.0, "vs_ddp": 1.0},
                    {"variant": "averager", "median_ms": step, "vs_ddp": step / 200.0}]
            (tmp_path / f"train-{build}-{i}.json").write_text(json.dumps({"rows": rows}))
    text = _compare().train_table(_compare().load_train(tmp_path), "old", "new")
    assert "| averager | 160.0 | 110.0 | 0.800 | 0.550 |" in text.splitlines()


def test_results_table_of_one_build(tmp_path):
    # README's results table: times and ratios are medians over runs, world sizes side by side
    for i, (rr, gloo, ds) in enumerate([(10.0, 100.0, 20.0), (12.0, 300.0, 10.0), (30.0, 200.0, 15.0)], start=1):
        rows = [{"size": 1024, "impl": impl, "time_us": t} for impl, t in
                (("ringreduce", rr), ("gloo", gloo), ("deepspeed", ds))]
        (tmp_path / f"main-2r-{i}.json").write_text(json.dumps({"rows": rows}))
    _sweep(tmp_path / "main-4r-1.json", {1024: (50.0, 500.0)})
    _sweep(tmp_path / "other-2r-1.json", {1024: (1.0, 1.0)})  # another build: not in the table
    lines = _compare().results(_compare().load(tmp_path), "main").splitlines()
    assert lines[0] == "main: 3 runs at 2 ranks, 1 runs at 4 ranks; medians over runs"
    assert lines[2] == ("| size | 2 ranks: ringreduce / gloo / DeepSpeed (us) | / gloo | / DeepSpeed "
                        "| 4 ranks: ringreduce / gloo (us) | / gloo |")
    # rr/gloo per run 0.1, 0.04, 0.15 -> 0.100; rr/ds 0.5, 1.2, 2.0 -> 1.200
    assert lines[4] == "| 1 KiB | 12.0 / 200.0 / 15.0 | 0.100 | 1.200 | 50.0 / 500.0 | 0.100 |"
    assert _compare().main([str(tmp_path), "--results", "none"]) == 1


def test_no_pairs_is_an_error(tmp_path, capsys):
    _sweep(tmp_path / "old-2r-1.json", {1024: (1.0, 2.0)})
    assert _compare().main([str(tmp_path)]) == 1
    assert "no pairs" in capsys.readouterr().err


@pytest.mark.parametrize("nbytes,label", [(1024, "1 KiB"), (3 * 2**20, "3 MiB"), (8, "8 B"), (1536, "1536 B")])
def test_size_labels(nbytes, label):
    assert _compare()._size(nbytes) == label


def test_dtype_sweeps_keep_their_types_apart(tmp_path):
    # a `-d float,bfloat16` run: each type's rows read alone, never one over the other; --results of
    # bfloat16 adds its time over float32's in the same run (1.5 and 1.0 -> median of two runs 1.25)
    for i, (f32, bf16) in enumerate([(10.0, 15.0), (20.0, 20.0)], start=1):
        rows = []
        for ty, t in (("float", f32), ("bfloat16", bf16)):
            rows += [{"size": 1024, "type": ty, "impl": "ringreduce", "time_us": t},
                     {"size": 1024, "type": ty, "impl": "gloo", "time_us": 100.0}]
        (tmp_path / f"main-2r-{i}.json").write_text(json.dumps({"rows": rows}))
    cmp = _compare()
    assert cmp.load(tmp_path)[("main", 2)][0][1024]["ringreduce"] == 10.0  # the first type: float
    assert cmp.load(tmp_path, "bfloat16")[("main", 2)][1][1024]["ringreduce"] == 20.0
    assert cmp.load(tmp_path, "half") == {}
    lines = cmp.results(cmp.load(tmp_path, "bfloat16"), "main", cmp.load_over_float(tmp_path, "bfloat16")).splitlines()
    assert lines[2] == "| size | 2 ranks: ringreduce / gloo (us) | / gloo | / float32 |"
    assert lines[4] == "| 1 KiB | 17.5 / 100.0 | 0.175 | 1.25 |"
