"""scripts/gpu_check.sh on a machine without a GPU: it runs the simulated-device checks, says in
its last line that no CUDA GPU was found, and exits 0 (a reduced run: one quick pytest file, no
C++ build; the full no-GPU run is `scripts/gpu_check.sh` itself)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _run(args: list[str], env: dict, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU mode")
@pytest.mark.parametrize("part", ["all", "more"])
@pytest.mark.full
def test_each_part_rehearses_without_gpu_and_writes_into_out(tmp_path, part):
    """Without a GPU, no argument ("all": speed's rehearsal, then suite's) and "more" run their
    simulated-device rehearsal (reduced: one quick pytest file, no C++ build): the last line says no GPU
    was found, the exit code is 0, and with OUT set (the device tool's folder) the summary and the log
    are written there line by line and the results folder packed, 3 files (the tool brings back at most
    8). Which steps each of speed and suite runs alone: test_dry_run_prints_each_part_within_its_budget."""
    import tarfile

    out = tmp_path / "out"
    out.mkdir()
    env = dict(os.environ, PYTHON=sys.executable, RESULTS=str(tmp_path / "results"), GPU_CHECK_CPP="0",
               SIM_TESTS="tests/tools/test_knobs.py",
               OUT=str(out))
    proc = _run([] if part == "all" else [part], env)
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert lines[-1].startswith(f"gpu_check: no CUDA GPU was found; ran the simulated-device rehearsal of '{part}'")
    pub = out / f"gpu_check-{part}"
    assert sorted(p.name for p in pub.iterdir()) == ["gpu_check.log", "results.tar.gz", "summary.txt"]
    summary = (pub / "summary.txt").read_text().strip().splitlines()
    assert summary[-1] == lines[-1] and summary == (tmp_path / "results" / "summary.txt").read_text().strip().splitlines()
    assert lines[-1] in (pub / "gpu_check.log").read_text()
    with tarfile.open(pub / "results.tar.gz") as tar:
        assert "results/summary.txt" in tar.getnames()
    if part == "all":  # speed's steps (the benchmark's JSON -> summary lines, as on a GPU), then suite's
        assert "PASS  simulated device: kernel body + ring driver" in proc.stdout
        assert "PASS  benchmark plumbing on 2 CPU ranks" in proc.stdout
        assert "      bench: wrong elements 0 (OK)" in summary
        assert "PASS  simulated device: communicator registry + GPU harness on CPU ranks" in proc.stdout
    if part == "more":
        assert "SKIP  C++ simulated-device checks (GPU_CHECK_CPP=0)" in summary


def test_dry_run_prints_each_part_within_its_budget():
    """--dry-run prints each part's steps with their limits and runs nothing; speed (build included) and
    suite (on speed's build) fit 300 s each, no argument (speed then suite) 540 s, and each device
    command (budget + 30 s) one 600 s run."""
    budgets = {}
    for args in (["speed"], ["suite"], ["more"], []):
        proc = _run([*args, "--dry-run"], dict(os.environ), timeout=30)
        assert proc.returncode == 0, proc.stderr
        head, *steps = proc.stdout.strip().splitlines()
        match = re.match(r"\[gpu_check\] plan of '(\w+)' on a GPU machine: budget (\d+) s \(device tool: run with "
                         r"timeout_s (\d+)\)", head)
        assert match, head
        part, budget, timeout_s = match.group(1), int(match.group(2)), int(match.group(3))
        assert timeout_s == budget + 30 <= 600
        limits = [int(m.group(1)) for line in steps if (m := re.search(r"limit +(\d+) s", line))]
        assert limits and limits[0] == 110, steps  # the build, where none is usable
        budgets[part] = (budget, limits)
    assert budgets["speed"][0] == 300 and sum(budgets["speed"][1]) <= 300
    assert budgets["suite"][0] == 300 and sum(budgets["suite"][1][1:]) <= 300  # with speed's build
    assert budgets["all"][0] == 540 and budgets["all"][1][:3] == budgets["speed"][1] and len(budgets["all"][1]) == 4
    assert sum(budgets["all"][1]) <= 540 and sum(budgets["more"][1]) <= 540
    env = dict(os.environ, GPU_CHECK_DRY_RUN="1")
    assert _run(["speed"], env, timeout=30).stdout == _run(["speed", "--dry-run"], dict(os.environ), timeout=30).stdout
    assert _run(["bogus"], dict(os.environ), timeout=30).returncode == 2


@pytest.mark.full
def test_bench_summary_reads_what_the_benchmark_writes(tmp_path):
    """gpu_check.sh's benchmark lines (scripts/gpu_bench_summary.py) from a JSON the benchmark really
    wrote: a 2-rank CPU run at tiny sizes (the keys are those of every backend's rows)."""
    out = tmp_path / "bench.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    run = subprocess.run([sys.executable, "-m", "ringreduce.bench", "--backend", "gloo", "--nproc", "2", "-b", "1K",
                          "-e", "4K", "-f", "4", "--rounds", "1", "-w", "1", "-n", "2", "-q", "--json", str(out)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_bench_summary.py"), str(out)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines[0].startswith("bench: 2 ranks, gloo;"), lines
    assert lines[-1] == "bench: wrong elements 0 (OK)", lines
    rows = {line.split()[0] + " " + line.split()[1]: line.split()[2:] for line in lines[2:-1]}
    assert set(rows) == {"1 KiB", "4 KiB"}, lines
    for cells in rows.values():
        assert len(cells) == 3 and all(float(c) > 0 for c in cells), lines  # ringreduce, gloo busbw; ratio
    assert "gpu_bench_summary.py" in (ROOT / "scripts" / "gpu_check.sh").read_text()


def test_build_with_a_named_compiler_sets_cc_to_the_c_compiler_beside_it(tmp_path):
    """gpu_check.sh's cc_for: CXX=g++-12 / a bare g++ / clang++ give the C compiler of the same
    toolchain by its full path, and nothing where there is none (CC then stays unset). torch's build
    passes CC to nvcc as -ccbin: the old `$(dirname CXX)/gcc` gave ./gcc for CXX=g++ and a gcc that
    need not exist for g++-12, and every .cu file would fail to compile."""
    import re

    body = re.search(r"^cc_for\(\) \{.*?^\}$", (ROOT / "scripts" / "gpu_check.sh").read_text(), re.S | re.M).group(0)
    tools = tmp_path / "bin"
    tools.mkdir()
    for name in ("g++-12", "gcc-12", "g++", "gcc", "clang++", "clang", "icpx"):
        (tools / name).write_text("#!/bin/sh\n")
        (tools / name).chmod(0o755)
    lonely = tmp_path / "lonely"
    lonely.mkdir()
    (lonely / "g++").write_text("#!/bin/sh\n")
    (lonely / "g++").chmod(0o755)

    def cc_for(cxx: str) -> tuple[int, str]:
        proc = subprocess.run(["bash", "-c", f'{body}\ncc_for "$1"', "cc_for", cxx], capture_output=True, text=True,
                              env=dict(os.environ, PATH=f"{tools}:/usr/bin:/bin"), timeout=30)
        return proc.returncode, proc.stdout.strip()

    assert cc_for(str(tools / "g++-12")) == (0, str(tools / "gcc-12"))
    assert cc_for("g++") == (0, str(tools / "gcc"))  # found on PATH, not ./gcc
    assert cc_for(str(tools / "clang++")) == (0, str(tools / "clang"))
    assert cc_for(str(lonely / "g++"))[0] != 0  # no gcc beside it
    assert cc_for("icpx")[0] != 0  # not a name it knows


def test_probe_sees_a_compiler_that_links_libstdcxx_statically(tmp_path):
    """gpu_check.sh's probe_libstdcxx links a three-line library with the build's compiler and checks
    it as setup.py checks the extension (tools/libstdcxx_check.py): a g++ that adds
    -static-libstdc++ (as the first GPU machine's did) is seen in seconds, before a whole build is
    compiled and refused; the system g++ passes; a compiler that cannot link says "cannot tell"."""
    import re
    import shutil

    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("no g++ on this machine")  # CI's image has one: the build needs it
    static = subprocess.run([gxx, "-print-file-name=libstdc++.a"], capture_output=True, text=True).stdout.strip()
    if not os.path.isabs(static):
        pytest.skip("this g++ has no static libstdc++ to link")
    body = re.search(r"^probe_libstdcxx\(\) \{.*?^\}$", (ROOT / "scripts" / "gpu_check.sh").read_text(),
                     re.S | re.M).group(0)
    wrapper = tmp_path / "static-g++"
    wrapper.write_text(f'#!/bin/sh\nexec {gxx} "$@" -static-libstdc++\n')
    wrapper.chmod(0o755)
    broken = tmp_path / "broken-g++"
    broken.write_text("#!/bin/sh\nexit 1\n")
    broken.chmod(0o755)

    def probe(cxx: str) -> int:
        script = f'PYTHON="{sys.executable}"; ROOT="{ROOT}"\n{body}\nprobe_libstdcxx "$1"'
        return subprocess.run(["bash", "-c", script, "probe", cxx], capture_output=True, timeout=120).returncode

    assert probe(str(wrapper)) == 1
    assert probe(gxx) == 0
    assert probe(str(broken)) == 2
    assert probe("") == 0  # Python's own link command (LDCXXSHARED) on this machine
