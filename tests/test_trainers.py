"""docs/trainers.md's Lightning and Accelerate programs, as the page shows them, at 2 CPU ranks under
torchrun: over "ringreduce" they run ringreduce's ring and end with the same weights, bit for bit, as
over gloo, on every rank; and Accelerate refuses the name on CPU with the message the page quotes."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from ranks import free_port

from ringreduce._launch import stop_session

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DOC = os.path.join(ROOT, "docs", "trainers.md")
# Idle, a program's two runs take 9-15 s; beside two busy loops (load 8-10) up to about 300 s, since four
# new interpreters import torch and the trainer there.
TIMEOUT = 900
REFUSAL = "ValueError: Your assigned backend ringreduce is not available, please use gloo"


def program(name: str) -> str:
    """The ```python block of docs/trainers.md whose first line names `name`."""
    with open(DOC) as f:
        text = f.read()
    blocks = re.findall(r"```python\n(# (\S+\.py) .*?)```", text, re.S)
    found = [code for code, file in blocks if file == name]
    assert len(found) == 1, f"docs/trainers.md has {len(found)} programs named {name}"
    return found[0]


def _env(tmp_path) -> dict:
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]), TMPDIR=str(tmp_path))
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    return env


@pytest.mark.parametrize("name,package", [("lightning_train.py", "pytorch_lightning"),
                                          ("accelerate_train.py", "accelerate")])
@pytest.mark.full
def test_trainer_over_ringreduce_equals_gloo_bitwise(tmp_path, name, package):
    pytest.importorskip(package, reason=f"{package} is not installed (scripts/setup_env.sh installs it)")
    path = tmp_path / name
    path.write_text(program(name))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), os.path.join(HERE, "trainer_runner.py"), str(path), "ringreduce", "gloo"]
    proc = subprocess.Popen(cmd, env=_env(tmp_path), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out = proc.communicate(timeout=TIMEOUT)[0]
    except subprocess.TimeoutExpired:
        stop_session(proc, grace=45)  # torchrun stops its workers (each in a session of its own) on SIGTERM
        pytest.fail(f"{name} did not finish within {TIMEOUT} s; its output:\n{proc.communicate()[0][-6000:]}", pytrace=False)
    assert proc.returncode == 0, out[-6000:]
    hashes = dict(re.findall(r"rank (\d: backend \w+), weights sha256 ([0-9a-f]{64})", out))
    assert sorted(hashes) == ["0: backend gloo", "0: backend ringreduce", "1: backend gloo", "1: backend ringreduce"], out
    assert len(set(hashes.values())) == 1, hashes  # every rank, both backends: the same bits
    calls = dict(re.findall(r"rank (\d: \w+) run: (\d+) ring calls", out))
    assert int(calls["0: ringreduce"]) >= 8 and int(calls["1: ringreduce"]) >= 8, calls  # a gradient all-reduce per step
    assert calls["0: gloo"] == calls["1: gloo"] == "0", calls


def test_accelerate_refuses_the_name_on_cpu_with_the_documented_message(tmp_path):
    pytest.importorskip("accelerate", reason="accelerate is not installed (scripts/setup_env.sh installs it)")
    with open(DOC) as f:
        assert REFUSAL in f.read()
    code = ("import ringreduce\nfrom accelerate import Accelerator\nfrom accelerate.utils import InitProcessGroupKwargs\n"
            "Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(backend='ringreduce')])\n")
    env = dict(_env(tmp_path), RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="2",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode != 0 and REFUSAL in proc.stderr, proc.stderr[-3000:]
