"""Simulated hosts (ringreduce/bench/netns.py, python -m ringreduce.bench.cluster): the tool, and faults
across hosts - a link cut mid-call, a short flap, a host killed, a host that never joins.

Every test builds its own namespaces (prefix rrc-<pid>-<test>) and removes exactly those; ranks run
tests/cluster_job.py on 1 Gbit/s links with the ring's 6 s timeout; every wait is bounded. They need root,
network namespaces and tbf, and skip with the reason elsewhere. The ranks join with a JOIN_TIMEOUT-second
roll call and group, and make their ring (its first call: segments, connections) under the same timeout
(a loaded machine starts 4 interpreters slowly); their later calls run under the ring's 6 s timeout
(RINGREDUCE_TIMEOUT, changed through ringreduce.reload_knobs), the one the faults are measured against.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from ringreduce.bench import cluster as cluster_cli
from ringreduce.bench.netns import MASTER_PORT, Cluster, ClusterRefused, preflight

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/
ROOT = os.path.dirname(HERE)
PG_TIMEOUT = 6.0  # the ring's calls' (RINGREDUCE_TIMEOUT from the second call on; the first is the join's)
# A 2 s flap stalls a call longer than 2 s: TCP's retransmission timer has backed off to seconds by the
# time the link is back, and a loaded machine adds its own delay (beside two busy loops a call waited
# more than 6 s).
FLAP_TIMEOUT = 20.0
JOIN_TIMEOUT = 120.0  # at load 15 one rank of four took more than 60 s to join
ABSENT_JOIN_TIMEOUT = 15.0  # the never-joins case waits it out, its ranks' joins started together (_go)
NUMEL = 1 << 20  # 4 MiB: a call takes ~70 ms at 1 Gbit/s, so faults land mid-call


def _probe() -> str:
    """'' when this machine can build a simulated cluster, else why not."""
    try:
        preflight()
        with Cluster(1, "1gbit", prefix=f"rrc-{os.getpid()}-probe"):
            pass
    except ClusterRefused as e:
        return str(e)
    return ""


_REASON = _probe()
needs_cluster = pytest.mark.skipif(bool(_REASON), reason=f"simulated cluster unavailable: {_REASON}")


def _env(cluster: Cluster, rank: int, host: int, per_host: int, hosts: int, join: float, go: str,
         call: float) -> dict[str, str]:
    env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(hosts * per_host), LOCAL_RANK=str(rank % per_host),
               LOCAL_WORLD_SIZE=str(per_host), GROUP_RANK=str(host), MASTER_ADDR=cluster.addr(0),
               MASTER_PORT=str(MASTER_PORT), CLUSTER_JOIN_TIMEOUT=str(join), RINGREDUCE_TIMEOUT=str(join),
               CLUSTER_CALL_TIMEOUT=str(call),
               OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    env.pop("RINGREDUCE_LOCAL_SIZE", None)
    if go:
        env["CLUSTER_GO"] = go
    return env


def _start(cluster: Cluster, out: str, per_host: int, calls: int, hosts: tuple[int, ...] | None = None,
           join: float = JOIN_TIMEOUT, go: str = "", call: float = PG_TIMEOUT):
    """Starts tests/cluster_job.py for every rank of `hosts` (default all), joining within `join` s (once
    the file `go` exists, when given: _go), its stderr in
    OUT/rank<r>.err (a file: a pipe nobody reads could fill and block the rank); returns {rank: Popen}."""
    procs = {}
    for host in range(cluster.hosts) if hosts is None else hosts:
        for local in range(per_host):
            rank = host * per_host + local
            with open(os.path.join(out, f"rank{rank}.err"), "w") as err:
                procs[rank] = cluster.popen(
                    host, [sys.executable, os.path.join(HERE, "cluster_job.py"), out, str(calls), str(NUMEL)],
                    env=_env(cluster, rank, host, per_host, cluster.hosts, join, go, call),
                    stdout=subprocess.DEVNULL, stderr=err)
            procs[rank].err_path = err.name
    return procs


def _wait_for(out: str, procs: dict, name: str, limit: float, what: str) -> None:
    """Until every rank of `procs` wrote OUT/<name><rank> (cluster_job.py), at most `limit` s; fails at once
    when a rank exits before, with its report."""
    deadline = time.monotonic() + limit
    while len(glob.glob(os.path.join(out, name + "*"))) < len(procs):
        dead = {r: p.returncode for r, p in procs.items() if p.poll() is not None}
        assert not dead, f"ranks exited before {what}: {dead}: {_said(out, dead)} {_stderr(procs)}"
        assert time.monotonic() < deadline, f"the ranks did not reach {what} in time"
        time.sleep(0.05)


def _wait_ready(out: str, procs: dict, limit: float = JOIN_TIMEOUT + 60) -> None:
    _wait_for(out, procs, "ready", limit, "their first call")


def _go(out: str, procs: dict, go: str, limit: float = 300.0) -> None:
    """Once every rank of `procs` started (cluster_job.py's started<rank>), creates `go`: their joins begin
    together, so that a join timeout measures the join, not how long an interpreter took to start."""
    _wait_for(out, procs, "started", limit, "they started")
    open(go, "w").close()


def _said(out: str, ranks) -> str:
    """The reports (cluster_job.py's rank<r>.json) of `ranks` that exist: what stopped them."""
    paths = [os.path.join(out, f"rank{r}.json") for r in ranks]
    return " | ".join(open(p).read() for p in paths if os.path.exists(p))


def _stderr(procs: dict, tail: int = 1500) -> str:
    return " | ".join(f"rank {r}: {open(p.err_path).read()[-tail:]}" for r, p in procs.items())


def _finish(procs: dict, limit: float) -> dict[int, int]:
    """Exit codes of every rank, each within `limit` s from now (else the test fails)."""
    deadline = time.monotonic() + limit
    codes = {}
    for rank, p in procs.items():
        try:
            codes[rank] = p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pytest.fail(f"rank {rank} still runs {limit:.0f} s after the fault; {_stacks(procs)}")
    return codes


def _stacks(procs: dict) -> str:
    """The Python stacks of every rank still running (cluster_job.py dumps them on SIGUSR1 into its
    stderr file), with each rank's stderr: where a rank that outlives its timeout waits."""
    running = {r: p for r, p in procs.items() if p.poll() is None}
    for p in running.values():
        p.send_signal(signal.SIGUSR1)  # the Popen is the rank: ip netns exec, unshare and sh exec it
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline and not all(
            "most recent call first" in open(p.err_path).read() for p in running.values()):
        time.sleep(0.05)
    return "their stacks: " + _stderr(running, tail=6000)


def _reports(out: str, ranks) -> dict[int, dict]:
    return {r: json.load(open(os.path.join(out, f"rank{r}.json"))) for r in ranks}


def _no_segments_of(procs: dict) -> list[str]:
    return [f for p in procs.values() for f in glob.glob(f"/dev/shm/ringreduce-{p.pid}-*")]


@needs_cluster
@pytest.mark.full
def test_link_cut_mid_call_every_rank_raises_within_the_timeout(tmp_path):
    out = str(tmp_path)
    with Cluster(2, "1gbit", prefix=f"rrc-{os.getpid()}-cut") as c:
        procs = _start(c, out, per_host=2, calls=100000)
        _wait_ready(out, procs)
        c.set_link(1, False)
        cut = time.monotonic()
        codes = _finish(procs, limit=PG_TIMEOUT + 20)
        elapsed = time.monotonic() - cut
    assert codes == {r: 3 for r in range(4)}, _stderr(procs)
    for rank, rep in _reports(out, range(4)).items():
        assert rep["host"] == f"rrc-{os.getpid()}-cut-host{rank // 2}"
        assert rep["calls"] >= 1
        assert rep["error"]["dist_backend_error"], rep  # a DistBackendError on every rank, both hosts
        assert rep["error"]["seconds"] < PG_TIMEOUT + 5, rep
    assert elapsed < PG_TIMEOUT + 20
    assert _no_segments_of(procs) == []


@needs_cluster
@pytest.mark.full
def test_link_flap_shorter_than_the_timeout_is_survived(tmp_path):
    out = str(tmp_path)
    with Cluster(2, "1gbit", prefix=f"rrc-{os.getpid()}-flap") as c:
        procs = _start(c, out, per_host=1, calls=60, call=FLAP_TIMEOUT)
        _wait_ready(out, procs)
        c.set_link(1, False)
        time.sleep(2.0)
        c.set_link(1, True)
        codes = _finish(procs, limit=120)
    assert codes == {0: 0, 1: 0}, _stderr(procs)
    assert [rep["calls"] for rep in _reports(out, range(2)).values()] == [60, 60]  # every result checked exact


@needs_cluster
@pytest.mark.full
def test_a_rank_past_its_limit_shows_where_it_waits(tmp_path):
    # What _finish shows when a rank outlives its limit: every running rank's Python stack, down to
    # the line of cluster_job.py it is on (the call loop, here).
    out = str(tmp_path)
    with Cluster(2, "1gbit", prefix=f"rrc-{os.getpid()}-stack") as c:
        procs = _start(c, out, per_host=1, calls=100000)
        _wait_ready(out, procs)
        said = _stacks(procs)
    for r in range(2):
        part = said.split(f"rank {r}: ")[1]
        assert "cluster_job.py" in part and "in main" in part, said


@needs_cluster
@pytest.mark.full
def test_host_killed_the_other_host_raises(tmp_path):
    out = str(tmp_path)
    with Cluster(2, "1gbit", prefix=f"rrc-{os.getpid()}-kill") as c:
        procs = _start(c, out, per_host=2, calls=100000)
        _wait_ready(out, procs)
        assert c.kill_host(1) == 2  # both of host 1's ranks, SIGKILLed
        codes = _finish(procs, limit=PG_TIMEOUT + 20)
    assert codes[2] == codes[3] == -signal.SIGKILL
    assert codes[0] == codes[1] == 3, _stderr(procs)
    for rep in _reports(out, (0, 1)).values():
        assert rep["error"]["dist_backend_error"], rep
    assert _no_segments_of(procs) == []


@needs_cluster
@pytest.mark.full
def test_host_that_never_joins_is_named_at_init(tmp_path):
    out = str(tmp_path)
    with Cluster(2, "1gbit", prefix=f"rrc-{os.getpid()}-absent") as c:
        go = os.path.join(out, "go")
        procs = _start(c, out, per_host=2, calls=1, hosts=(0,), join=ABSENT_JOIN_TIMEOUT, go=go)
        _go(out, procs, go)
        codes = _finish(procs, limit=ABSENT_JOIN_TIMEOUT + 60)
    assert codes == {0: 3, 1: 3}, _stderr(procs)
    for rep in _reports(out, (0, 1)).values():
        assert rep["calls"] == 0
        assert rep["error"]["type"] == "DistStoreError", rep
        msg = rep["error"]["message"]
        assert "ranks [2, 3] of 4 (node 1 " in msg, msg
        assert f"rrc-{os.getpid()}-absent-host0 (node 0): ranks [0, 1]" in msg, msg


def _namespaces(prefix: str) -> list[str]:
    res = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30)
    return [line.split()[0] for line in res.stdout.splitlines() if line.startswith(prefix + "-")]


def _tool(prefix: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "ringreduce.bench.cluster", "--hosts", "2", "--ranks-per-host", "1",
            "--link", "1gbit", "--prefix", prefix, *args]


@needs_cluster
@pytest.mark.full
def test_tool_runs_the_bench_across_hosts_and_removes_everything(tmp_path):
    prefix = f"rrc-{os.getpid()}-tool"
    scratch = set(glob.glob(os.path.join(tempfile.gettempdir(), "torchelastic_*")))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1")
    res = subprocess.run(_tool(prefix, "--", "-b", "256K", "-e", "256K", "--seconds", "0.2", "--rounds", "2",
                               "--json", str(tmp_path / "r.json"), "-q"),
                         capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "[host0] # ringreduce.bench all_reduce: 2 ranks" in res.stdout
    rows = json.load(open(tmp_path / "r.json"))["rows"]
    assert rows and all(r["wrong"] == 0 for r in rows)
    sent = [int(line.split("sent ")[1].split(" B")[0]) for line in res.stdout.splitlines() if "): sent " in line]
    assert len(sent) == 2 and min(sent) > 256 * 1024  # every host's link carried the ring's bytes
    assert f"# cleanup: ip netns del {prefix}-sw" in res.stdout
    assert _namespaces(prefix) == []
    # torchrun's agents' log folders went into a scratch folder the tool removed
    assert set(glob.glob(os.path.join(tempfile.gettempdir(), "torchelastic_*"))) <= scratch


@needs_cluster
@pytest.mark.full
def test_traffic_model_matches_what_the_links_carried(tmp_path):
    """python -m ringreduce.bench.traffic on 2 hosts x 2 ranks: the bytes each host's link carried out
    (tc's tbf counters) over each algorithm's calls lie within [1, 1 + MODEL_TOLERANCE] x the model's
    cross-node payload (docs/algorithm.md: flat ring 2(n-1)/n S per node, hierarchical 2(M-1)/M S)."""
    from ringreduce.bench.traffic import MODEL_TOLERANCE

    prefix = f"rrc-{os.getpid()}-traffic"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    argv = _tool(prefix, "--module", "ringreduce.bench.traffic", "--", "--size", "4M", "--iters", "3",
                 "--link-dev", "rr0", "--json", str(tmp_path / "t.json"))
    argv[argv.index("--ranks-per-host") + 1] = "2"
    res = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    summary = json.load(open(tmp_path / "t.json"))["summary"]
    S, calls = 4 << 20, 4
    assert summary["ring"]["model_node_bytes"] == 1.5 * S * calls
    assert summary["hierarchical"]["model_node_bytes"] == 1.0 * S * calls
    for algo in ("ring", "hierarchical"):
        ratios = summary[algo]["link_over_model"]
        assert sorted(ratios) == ["0", "1"], summary[algo]
        assert all(1.0 <= r <= 1.0 + MODEL_TOLERANCE for r in ratios.values()), (algo, ratios)
    assert _namespaces(prefix) == []


@needs_cluster
@pytest.mark.full
def test_tool_cleans_up_on_sigint(tmp_path):
    prefix = f"rrc-{os.getpid()}-int"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    p = subprocess.Popen(_tool(prefix, "--", "-b", "16M", "-e", "64M", "--seconds", "30"), stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
    try:
        deadline = time.monotonic() + 60
        while len(_namespaces(prefix)) < 3:
            assert time.monotonic() < deadline and p.poll() is None, "the tool did not build its hosts"
            time.sleep(0.1)
        time.sleep(1.0)
        p.send_signal(signal.SIGINT)
        text = p.communicate(timeout=60)[0]
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 130, text[-3000:]
    assert "SIGINT received" in text and f"# cleanup: ip netns del {prefix}-sw" in text
    assert _namespaces(prefix) == []


def test_refusal_is_one_line_without_root(monkeypatch, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert cluster_cli.main(["--hosts", "2", "--link", "1gbit"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs root" in err and "uid 1000" in err


def test_dry_run_prints_the_plan_and_the_cleanup(capsys):
    assert cluster_cli.main(["--hosts", "3", "--ranks-per-host", "2", "--link", "10gbit", "--prefix", "rrc-x",
                             "--dry-run", "--", "-b", "1M"]) == 0
    text = capsys.readouterr().out
    assert "ip netns add rrc-x-host2" in text and "tbf rate 10gbit" in text
    assert "--nnodes 3 --nproc-per-node 2 --node-rank 2 --master-addr 10.213.0.1" in text
    assert "-m ringreduce.bench -b 1M" in text
    assert "cleanup: ip netns del rrc-x-host0 rrc-x-host1 rrc-x-host2 rrc-x-sw" in text


def test_bad_link_rate_is_refused():
    with pytest.raises(SystemExit, match="not a tc rate"):
        cluster_cli.main(["--hosts", "2", "--link", "1 gigabit", "--dry-run"])
