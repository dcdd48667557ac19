"""ringreduce on torchft (docs/torchft.md): ProcessGroupRingreduce re-forms its ring at every
configure, aborts promptly, and a torchft DDP job of 3 replica groups survives a replica killed in the
middle of an all-reduce with the same parameters as torchft's own ProcessGroupGloo.

Fresh processes for every test; ranks and replicas on loopback, each with a kill timeout.
"""

from __future__ import annotations

import importlib
import sys

import pytest
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
@pytest.mark.parametrize("transport,peer", [("shm", "silent"), ("tcp", "silent"), ("shm", "dead")])
def test_abort_while_a_call_waits(transport: str, peer: str) -> None:
    """abort() returns within a second while a call waits on a silent or dead peer; the call's Work
    fails (wait() False, DistBackendError); the tensor is never written after the abort, not even when
    the silent peer then makes its call; the ring then re-forms."""
    store = _master_store()
    env = {"RINGREDUCE_SHM": "1" if transport == "shm" else "0"}
    results = spawn_ranks(2, torchft_jobs.abort_while_blocked, store.port, peer, env=env, timeout=180)
    if peer == "dead":
        assert results[1][0] == "died" and results[1][2] == 0, results[1]
        results = results[:1]
    first = _ok(results)[0]
    assert first["blocked"] or peer == "dead", first  # a dead peer may be noticed before the abort
    assert first["abort_s"] < 1.0, first
    assert first["wait"] is False and "DistBackendError" in first["exception"], first
    assert "aborted" in first["exception"] or peer == "dead", first
    assert "DistBackendError" in first["errored"], first
    assert first["unchanged"], first
    if peer == "silent":
        assert first["again_ok"], first
        late = _ok(results)[1]
        assert late["late_call_ok"] is False and late["late_error"] == "DistBackendError", late
        assert late["again_ok"], late

