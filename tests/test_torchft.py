"""ringreduce on torchft (docs/torchft.md): ProcessGroupRingreduce re-forms its ring at every
configure, aborts promptly, and a torchft DDP job of 3 replica groups survives a replica killed in the
middle of an all-reduce with the same parameters as torchft's own ProcessGroupGloo.

Fresh processes for every test; ranks and replicas on loopback, each with a kill timeout.
"""

from __future__ import annotations

import concurrent.futures
import importlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
import torchft_jobs
from ranks import spawn_ranks

try:
    import torchft  # noqa: F401 - only whether it imports
    TORCHFT = True
except ImportError:
    TORCHFT = False

needs_torchft = pytest.mark.skipif(
    not TORCHFT, reason="torchft is not installed (scripts/setup_env.sh installs it: pip install --no-deps torchft==0.2.0)")

CYCLES = 200


def _master_store() -> dist.TCPStore:
    """The TCPStore that every configure() of a test connects to (torchft's is the replica group's)."""
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def _ok(results: list) -> list:
    for status, value, code in results:
        assert status == "ok" and code == 0, f"a rank ended with {status} (exit code {code}):\n{value}"
    return [value for _, value, _ in results]


def test_import_error_names_pip_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torchft", None)  # import torchft raises ImportError
    monkeypatch.setitem(sys.modules, "torchft.process_group", None)
    monkeypatch.delitem(sys.modules, "ringreduce.torchft", raising=False)
    with pytest.raises(ImportError, match=r"ringreduce\.torchft needs torchft.*pip install torchft"):
        importlib.import_module("ringreduce.torchft")


@needs_torchft
def test_configure_abort_cycles_leave_nothing_behind() -> None:
    """200 configure/abort cycles (shared memory, gloo point-to-point, alone, and aborts of calls that
    wait for a silent peer) leave no thread, fd, /dev/shm segment, ring or kept buffer behind."""
    store = _master_store()
    reports = _ok(spawn_ranks(2, torchft_jobs.configure_abort_cycles, store.port, CYCLES, timeout=600))
    for rank, r in enumerate(reports):
        assert r["wrong"] == [], f"rank {rank}: {r['wrong']}"
        assert r["end"] == r["base"], f"rank {rank}: after {CYCLES} cycles {r['end']}, after the first {r['base']}"
        assert r["end_rss"] - r["base_rss"] < 64 << 20, f"rank {rank}: RSS grew by {r['end_rss'] - r['base_rss']} bytes"
        assert r["kept_after_abort"] == 0
    first = reports[0]
    assert first["timed_out_call_ok"] is False and first["errored_after_failure"] == "DistBackendError"
    assert first["kept_while_poisoned"] > 0  # the failed call's staging, until its ring was released
    assert max(first["aborts_s"]) < 1.0, f"abort() took {max(first['aborts_s']):.2f} s"


@needs_torchft
def test_abort_while_a_call_waits() -> None:
    """abort() returns within a second while a call waits on a silent or dead peer (shared memory and
    gloo point-to-point); the call's Work fails (wait() False, DistBackendError, errored()); the tensor
    is never written after the abort, not even when the silent peer then makes its call; the ring then
    re-forms."""
    store = _master_store()
    results = spawn_ranks(2, torchft_jobs.abort_while_blocked, store.port, timeout=300)
    assert results[1][0] == "died" and results[1][2] == 0, results[1]  # rank 1 exits in the last case
    cases = _ok(results[:1])[0]
    assert [c["case"] for c in cases] == [f"{t}-{p}" for t, p in torchft_jobs.ABORT_CASES]
    for case in cases:
        silent = case["case"].endswith("silent")
        assert case["blocked"] or not silent, case  # a dead peer may be noticed before the abort
        assert case["abort_s"] < 1.0, case
        assert case["wait"] is False and "DistBackendError" in case["exception"], case
        assert "aborted" in case["exception"] or not silent, case
        assert "DistBackendError" in case["errored"], case
        assert case["unchanged"], case
        if silent:
            assert case["again_ok"] and case["peer"]["again_ok"], case
            # The peer's late call fails, or (shared memory) completes with rank 0's contribution, which
            # rank 0 published before it waited: then its sum is right, and rank 0's tensor stayed as it was.
            late = case["peer"]
            assert late["late_sum_right"] if late["late_call_ok"] else late["late_error"] == "DistBackendError", case


@needs_torchft
@pytest.mark.parametrize("body", ["cycles", "abort"])
def test_the_gpu_bodies_on_cpu_ranks(body) -> None:
    """tests/gpu/test_gpu_torchft.py's bodies (configure/abort cycles; abort of a call that waits for a
    silent peer) on CPU ranks through the GPU tests' harness (run_gpu_ranks(device="cpu")), with the
    GPU test's checks: what a lent GPU runs over NCCL has run here on gloo and shared memory."""
    from gpu import test_gpu_torchft as g
    from gpu.gpu_ranks import run_gpu_ranks

    store = g.master_store()
    if body == "cycles":
        g.check_cycles(run_gpu_ranks(g.configure_abort_cycles, store.port, "cpu", g.CYCLES, device="cpu", fresh=True,
                                     timeout=240))
    else:
        g.check_abort(run_gpu_ranks(g.abort_while_waiting, store.port, "cpu", device="cpu", fresh=True, timeout=180))


# --- 3 replica groups, one SIGKILLed in the middle of an all-reduce (tests/torchft_replica.py) ---------

REPLICA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torchft_replica.py")
SCENARIO_S = 400.0  # the whole scenario, startup of 4 replica processes on a loaded 2-core machine included


def _start(kind: str, replica: int, role: str, lighthouse: str, d: str, rejoin: bool) -> subprocess.Popen:
    root = os.path.dirname(os.path.dirname(REPLICA))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p),
               GLOO_SOCKET_IFNAME="lo")
    cmd = [sys.executable, REPLICA, "--kind", kind, "--replica", str(replica), "--role", role,
           "--lighthouse", lighthouse, "--dir", d] + (["--rejoin"] if rejoin else [])
    log = open(os.path.join(d, f"replica_{replica}_{role}.log"), "w")  # noqa: SIM115 - the process writes it
    try:
        return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    finally:
        log.close()


def _logs(d: str) -> str:
    out = []
    for name in sorted(os.listdir(d)):
        if name.endswith(".log"):
            with open(os.path.join(d, name), errors="replace") as f:
                out.append(f"--- {name} ---\n{f.read()[-3000:]}")
    return "\n".join(out)


def _run_scenario(kind: str, d: str, rejoin: bool) -> None:
    """Runs the scenario of tests/torchft_replica.py with a lighthouse of its own; with `rejoin`, the
    replica that replaces the killed one is let go once both survivors saved their snapshot (its
    process starts with the others, so that its imports overlap theirs). Every process is reaped
    as soon as it exits (a zombie would still look alive to shared memory's liveness check) and killed
    at the deadline; exit codes are checked."""
    from torchft._torchft import LighthouseServer
    from torchft_replica import REPLICAS, VICTIM

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=1000, heartbeat_timeout_ms=10000)
    procs: dict[tuple[int, str], subprocess.Popen] = {}
    try:
        for r in range(REPLICAS):
            procs[(r, "first")] = _start(kind, r, "first", lighthouse.address(), d, rejoin)
        if rejoin:
            procs[(VICTIM, "restarted")] = _start(kind, VICTIM, "restarted", lighthouse.address(), d, rejoin)
        deadline = time.monotonic() + SCENARIO_S
        snapshots = [os.path.join(d, f"snapshot_{r}.pt") for r in range(REPLICAS) if r != VICTIM]
        restart = os.path.join(d, "restart")
        while any(p.poll() is None for p in procs.values()):
            if time.monotonic() > deadline:
                pytest.fail(f"{kind}: the scenario did not end within {SCENARIO_S:.0f} s\n{_logs(d)}", pytrace=False)
            if (rejoin and not os.path.exists(restart) and procs[(VICTIM, "first")].poll() is not None
                    and all(os.path.exists(s) for s in snapshots)):
                open(restart, "w").close()
            time.sleep(0.05)
        codes = {key: p.returncode for key, p in procs.items()}
        expected = {key: -signal.SIGKILL if key == (VICTIM, "first") else 0 for key in procs}
        assert codes == expected, f"{kind}: exit codes {codes}, expected {expected}\n{_logs(d)}"
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        lighthouse.shutdown()


def _params(path: str) -> dict:
    return torch.load(path)["model"]


def _json(path: str) -> list:
    with open(path) as f:
        return json.load(f)


def _bitwise_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k].view(torch.int32), b[k].view(torch.int32)) for k in a)


@needs_torchft
def test_three_replicas_survive_a_replica_killed_mid_allreduce(tmp_path) -> None:
    """torchft DDP, 3 replica groups (one process each) and a lighthouse; replica 2 SIGKILLed while the
    other two are inside a step's all-reduce. Over ProcessGroupRingreduce: the survivors' failed step is
    dropped and their steps go on with 2 participants; at the snapshot step their parameters are bitwise
    equal to each other and to torchft's own ProcessGroupGloo in the same scenario (same participants in
    every committed step); the restarted replica heals from them, and after two steps of all three every
    replica holds the same bits."""
    from torchft_replica import KILL_STEP, SNAPSHOT_STEP, VICTIM

    runs = {kind: str(tmp_path / kind) for kind in ("rr", "gloo")}
    for d in runs.values():
        os.makedirs(d)
    # The two runs side by side (a lighthouse each): one's imports overlap the other's waits.
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        done = [pool.submit(_run_scenario, kind, d, kind == "rr") for kind, d in runs.items()]
        for f in done:
            f.result()
    survivors = [r for r in range(3) if r != VICTIM]
    rr, gloo = runs["rr"], runs["gloo"]
    for r in survivors:
        logs = {k: _json(os.path.join(runs[k], f"log_{r}.json")) for k in runs}
        committed = {k: [(s, n) for s, n, ok in log if ok] for k, log in logs.items()}
        assert committed["rr"] == committed["gloo"] == [(s, 3) for s in range(KILL_STEP)] + [
            (s, 2) for s in range(KILL_STEP, SNAPSHOT_STEP)], committed
        for k, log in logs.items():  # the step of the kill ran, failed and was not committed
            assert [KILL_STEP, 3, False] in log, (k, log)
        assert _bitwise_equal(_params(os.path.join(rr, f"snapshot_{r}.pt")), _params(os.path.join(gloo, f"snapshot_{r}.pt")))
    assert _bitwise_equal(*(_params(os.path.join(rr, f"snapshot_{r}.pt")) for r in survivors))
    finals = [_params(os.path.join(rr, f"final_{r}.pt")) for r in range(3)]
    assert all(_bitwise_equal(finals[0], f) for f in finals[1:])
    steps = {r: _json(os.path.join(rr, f"final_log_{r}.json"))[-1][0] for r in range(3)}
    assert len(set(steps.values())) == 1, steps  # all three ended at the same step
    restarted = _json(os.path.join(rr, f"final_log_{VICTIM}.json"))
    assert restarted[0][0] >= SNAPSHOT_STEP, restarted  # it joined after the snapshot, healed to the others' step
