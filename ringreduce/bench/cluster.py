"""``python -m ringreduce.bench.cluster``: the benchmark across simulated hosts on one machine.

One torchrun agent per host, every host's output prefixed ``[hostI]``, then the bytes each link carried;
every namespace is removed, also on failure, Ctrl-C or SIGTERM (docs/design.md section 6; Note [The
simulated cluster] in ringreduce/bench/netns.py). Root only: elsewhere it says why in one line and exits 2.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, TextIO

from ringreduce.bench.netns import MASTER_PORT, Cluster, ClusterRefused, parse_rate, preflight

PROG = "ringreduce.bench.cluster"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=f"python -m {PROG}", description=__doc__.split("\n\n")[0].split(": ", 1)[1],
        epilog="Arguments after -- go to the module on every rank (python -m ringreduce.bench --help).",
    )
    p.add_argument("--hosts", type=int, required=True, help="simulated hosts (>= 1)")
    p.add_argument("--ranks-per-host", type=int, default=1, help="torchrun --nproc-per-node (default 1)")
    p.add_argument("--link", default="1gbit", help="each host's link rate, a tc rate: 1gbit, 10gbit, 100mbit (default 1gbit)")
    p.add_argument("--module", default="ringreduce.bench",
                   help="what each rank runs: python -m MODULE ARGS (default ringreduce.bench; also "
                   "ringreduce.bench.train_step, ringreduce.bench.traffic)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds before the run is stopped (default 3600)")
    p.add_argument("--prefix", default=None, help="namespace name prefix (default rrc-<pid>)")
    p.add_argument("--dry-run", action="store_true", help="print the plan (every command) and exit")
    return p


def torchrun_argv(cluster: Cluster, host: int, ranks_per_host: int, module: str, args: list[str]) -> list[str]:
    """Host `host`'s torchrun agent: static rendezvous on host 0's address."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(cluster.hosts),
            "--nproc-per-node", str(ranks_per_host), "--node-rank", str(host),
            "--master-addr", cluster.addr(0), "--master-port", str(MASTER_PORT),
            "-m", module, *args]


def _pump(stream: TextIO, label: str, out: TextIO, lock: threading.Lock) -> None:
    for line in stream:
        with lock:
            out.write(f"[{label}] {line}" if line.endswith("\n") else f"[{label}] {line}\n")
            out.flush()


class _Stop(Exception):
    """SIGINT/SIGTERM arrived: stop the run and clean up."""


def run(cluster: Cluster, ranks_per_host: int, module: str, args: list[str], timeout: float,
        out: TextIO = sys.stdout) -> int:
    """Runs `module` `args` on every host of the built `cluster`; returns the worst exit code. torchrun's
    agents keep their logs in a folder of TMPDIR that they never remove: here one removed after the run."""
    with tempfile.TemporaryDirectory(prefix="rrc-torchrun-", ignore_cleanup_errors=True) as scratch:
        env = dict(os.environ, TMPDIR=scratch)
        lock = threading.Lock()
        procs, pumps = [], []
        for host in range(cluster.hosts):
            p = cluster.popen(host, torchrun_argv(cluster, host, ranks_per_host, module, args), env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
            t = threading.Thread(target=_pump, args=(p.stdout, f"host{host}", out, lock), daemon=True)
            t.start()
            procs.append(p)
            pumps.append(t)
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline:
                with lock:
                    out.write(f"{PROG}: the run exceeded --timeout {timeout:g} s; stopping it\n")
                return 124
            time.sleep(0.2)
        for t in pumps:
            t.join(timeout=5)
        codes = [p.returncode for p in procs]
        for host, code in enumerate(codes):
            if code != 0:
                out.write(f"{PROG}: host{host}'s torchrun exited {code}\n")
        return max(codes, key=lambda c: (c != 0, abs(c)))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    own, rest = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    a = build_parser().parse_args(own)
    try:
        parse_rate(a.link)
    except ValueError as e:
        raise SystemExit(f"{PROG}: {e}") from None
    if a.hosts < 1 or a.ranks_per_host < 1:
        raise SystemExit(f"{PROG}: --hosts and --ranks-per-host must be >= 1")
    cluster = Cluster(a.hosts, a.link, prefix=a.prefix)
    if a.dry_run:
        print(f"# {a.hosts} host(s) x {a.ranks_per_host} rank(s), {a.link} links; plan:")
        for cmd in cluster.plan():
            print("  " + " ".join(cmd))
        for host in range(a.hosts):
            print("  " + " ".join(cluster.command(host, torchrun_argv(cluster, host, a.ranks_per_host, a.module, rest))))
        print(f"  cleanup: ip netns del {' '.join([cluster.namespace(h) for h in range(a.hosts)] + [cluster.switch])}")
        return 0
    try:
        preflight()
    except ClusterRefused as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 2

    def stop(signum: int, _frame: Any) -> None:
        raise _Stop(signal.Signals(signum).name)

    saved = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    code = 1
    try:
        cluster.up()
        print(f"# {PROG}: {a.hosts} host(s) x {a.ranks_per_host} rank(s), {a.link} links, "
              f"namespaces {cluster.prefix}-host0..{a.hosts - 1}, master {cluster.addr(0)}:{MASTER_PORT}", flush=True)
        code = run(cluster, a.ranks_per_host, a.module, rest, a.timeout)
        print(f"# link counters (tbf, bytes with headers; {cluster.link} per host and direction)")
        for host in range(cluster.hosts):
            b = cluster.link_bytes(host)
            print(f"#   host{host} ({cluster.addr(host)}): sent {b['sent']} B, received {b['received']} B")
    except ClusterRefused as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        code = 2
    except _Stop as e:
        print(f"{PROG}: {e} received; stopping the hosts", file=sys.stderr)
        code = 130
    finally:
        for s in saved:
            signal.signal(s, signal.SIG_IGN)  # a second Ctrl-C must not interrupt the cleanup
        for line in cluster.down():
            print(f"# cleanup: {line}", flush=True)
        for s, h in saved.items():
            signal.signal(s, h)
    return code


if __name__ == "__main__":
    sys.exit(main())
