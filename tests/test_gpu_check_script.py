"""scripts/gpu_check.sh on a machine without a GPU: it runs the simulated-device checks, says in
its last line that no CUDA GPU was found, and exits 0 (a reduced run: one quick pytest file, no
C++ build; the full no-GPU run is `scripts/gpu_check.sh` itself)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU mode")
def test_gpu_check_without_gpu_says_so_and_exits_zero(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable, RESULTS=str(tmp_path / "results"), GPU_CHECK_CPP="0",
               SIM_TESTS="tests/test_setup_archs.py")
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "no CUDA GPU was found" in lines[-1]
    assert "PASS  simulated device" in proc.stdout
    assert (tmp_path / "results" / "summary.txt").read_text().strip().splitlines()[-1] == lines[-1]
