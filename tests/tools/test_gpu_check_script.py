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
@pytest.mark.parametrize("part", ["all", "more", "cpu"])
@pytest.mark.full
def test_each_part_rehearses_without_gpu_and_writes_into_out(tmp_path, part):
    """Without a GPU, no argument ("all": speed's rehearsal, then suite's) and "more" run their
    simulated-device rehearsal (reduced: one quick pytest file, no C++ build), and "cpu" on fewer cores
    than its 4 ranks its sweeps at tiny sizes: the last line says which, the exit code is 0, and with OUT set (the device tool's folder) the summary and the log
    are written there line by line and the results folder packed, 3 files (the tool brings back at most
    8). Which steps each of speed and suite runs alone: test_dry_run_prints_each_part_within_its_budget."""
    import tarfile

    out = tmp_path / "out"
    out.mkdir()
    env = dict(os.environ, PYTHON=sys.executable, RESULTS=str(tmp_path / "results"), GPU_CHECK_CPP="0",
               SIM_TESTS="tests/tools/test_knobs.py", GPU_CHECK_CORES="2",  # cpu: its rehearsal on any machine
               OUT=str(out))
    proc = _run([] if part == "all" else [part], env)
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    if part == "cpu":
        assert lines[-1].startswith("gpu_check cpu: 2 cores, fewer than 4: ran the rehearsal only (passed)")
    else:
        assert lines[-1].startswith(f"gpu_check: no CUDA GPU was found; ran the simulated-device rehearsal of '{part}'")
    pub = out / f"gpu_check-{part}"
    assert sorted(p.name for p in pub.iterdir()) == ["gpu_check.log", "results.tar.gz", "summary.txt"]
    summary = (pub / "summary.txt").read_text().strip().splitlines()
    assert summary[-1] == lines[-1] and summary == (tmp_path / "results" / "summary.txt").read_text().strip().splitlines()
    assert lines[-1] in (pub / "gpu_check.log").read_text()
    with tarfile.open(pub / "results.tar.gz") as tar:
        assert "results/summary.txt" in tar.getnames()
    if part == "all":  # speed's steps (the benchmarks' JSON -> summary lines, as on a GPU), then suite's
        assert "PASS  simulated device: kernel body + ring driver" in proc.stdout
        assert proc.stdout.count("PASS  benchmark plumbing on 2 CPU ranks") == 2, proc.stdout
        assert summary.count("      bench: wrong elements 0 (OK)") == 2, summary
        _check_half_summary((tmp_path / "results" / "bench_half_summary.txt").read_text().strip().splitlines())
        assert "PASS  simulated device: communicator registry + GPU harness on CPU ranks" in proc.stdout
    if part == "more":
        assert "SKIP  C++ simulated-device checks (GPU_CHECK_CPP=0)" in summary
    if part == "cpu":  # AVG then SUM, 4 ranks, a table per type with its time over float32's
        assert sum(line.startswith("PASS  ringreduce.bench on CPU ranks: --backend gloo --nproc 4") for line in summary) == 2
        assert [line.strip() for line in summary if line.strip().endswith(("avg:", "sum:"))] == [
            f"{t}, {op}:" for op in ("avg", "sum") for t in ("float", "bfloat16", "half")], summary
        assert summary.count("      bench: 4 ranks, gloo; busbw GB/s per implementation, time ratio ringreduce/gloo "
                             "(< 1: ringreduce faster)") == 2, summary


def _check_half_summary(lines: list[str]) -> None:
    """The half types' step (HALF_SWEEP; rehearsed on 2 CPU ranks at 1 and 4 KiB): a table per type, each
    with direct's time over the ring's and the elements each left off the correctly rounded sum (2 ranks:
    none), the half types' with their time over float32's at the same bytes."""
    assert lines[-1] == "bench: wrong elements 0 (OK)", lines
    impls = {"ringreduce", "gloo", "rr-ring", "rr-direct"}
    for at, name in ((1, "float"), (5, "bfloat16"), (9, "half")):
        extras = ["ratio"] + (["vs-float32"] if name != "float" else []) + ["direct/ring", "off-ring", "off-direct"]
        assert lines[at] == f"  {name}, avg:", lines
        head = lines[at + 1].split()
        assert head[0] == "size" and set(head[1:5]) == impls and head[5:] == extras, lines
        for row in lines[at + 2:at + 4]:
            cells = row.split()
            assert " ".join(cells[:2]) in ("1 KiB", "4 KiB") and len(cells) == 2 + len(head) - 1, lines
            assert all(float(c) > 0 for c in cells[2:-2]) and cells[-2:] == ["0", "0"], lines


def test_dry_run_prints_each_part_within_its_budget():
    """--dry-run prints each part's steps with their limits and runs nothing; speed (build included, the
    half types' sweep last) fits 330 s, suite (on speed's build) 300 s, no argument (speed then suite)
    570 s, and each device command (budget + 30 s) one 600 s run."""
    budgets = {}
    for args in (["speed"], ["suite"], ["more"], ["cpu"], []):
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
    assert budgets["speed"][0] == 330 and sum(budgets["speed"][1]) <= 330 and len(budgets["speed"][1]) == 4
    assert budgets["suite"][0] == 300 and sum(budgets["suite"][1][1:]) <= 300  # with speed's build
    assert budgets["all"][0] == 570 and budgets["all"][1][:4] == budgets["speed"][1] and len(budgets["all"][1]) == 5
    assert sum(budgets["all"][1]) <= 570 and sum(budgets["more"][1]) <= 540
    assert budgets["cpu"][0] == 360 and sum(budgets["cpu"][1]) <= 360 and len(budgets["cpu"][1]) == 3
    # README's device-tool table names every part with its timeout_s (budget + 30)
    table = dict(re.findall(r"^\| `bash scripts/gpu_check\.sh ?(\w*)` \| (\d+) \|", (ROOT / "README.md").read_text(), re.M))
    assert {part or "all": int(t) for part, t in table.items()} == {part: b + 30 for part, (b, _) in budgets.items()}
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


def _gpu_kernels():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import gpu_kernels
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    return gpu_kernels


class _TorchKernel:
    """torch standing in for ringreduce._C._cuda_reduce (out = a + b, / divisor), on any device."""

    @staticmethod
    def _cuda_reduce(a, b, out, op, divisor):
        torch.add(a, b, out=out)
        if divisor:
            out.div_(divisor)


class _NoDivision:
    @staticmethod
    def _cuda_reduce(a, b, out, op, divisor):
        torch.add(a, b, out=out)


def test_kernel_bandwidth_has_a_row_per_half_and_float_type_and_op():
    """scripts/gpu_kernels.py's bandwidth table (issue 48: the half types against float32 of the same
    bytes and against a copy), its logic on the CPU with torch as the kernel: a row per (float32,
    bfloat16, float16) x (sum, avg), each with its own copy timing, its share of the copy and its time
    over float32 SUM's; a kernel whose result is wrong is named in its row."""
    gk = _gpu_kernels()
    rows = gk.bandwidth(_TorchKernel, torch.device("cpu"), nbytes=1 << 16, iters=2)
    assert [(r["dtype"], r["op"]) for r in rows] == [(d, o) for d in ("float32", "bfloat16", "float16")
                                                     for o in ("sum", "avg")]
    assert all(r["right"] and r["bytes"] == 1 << 16 and r["kernel_GBps"] > 0 and r["copy_GBps"] > 0 for r in rows)
    assert rows[0]["vs_float32_sum"] == 1.0 and all(r["vs_float32_sum"] > 0 for r in rows)
    lines = gk.bandwidth_lines(rows)
    assert len(lines) == 7 and lines[0].startswith("kernel bandwidth, two 64K inputs"), lines
    assert "target >= 0.85" in lines[0] and "WRONG" not in "\n".join(lines)
    assert lines[3].split()[:2] == ["bfloat16", "sum:"], lines
    bad = gk.bandwidth(_NoDivision, torch.device("cpu"), nbytes=1 << 16, iters=2)
    assert [r["right"] for r in bad] == [True, False] * 3
    assert sum("WRONG RESULT" in line for line in gk.bandwidth_lines(bad)) == 3
