"""Simulated hosts on one machine: network namespaces, own hostnames, shaped links (root only).

Note [The simulated cluster]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Each host is a network namespace ``<prefix>-host<i>`` whose processes run under ``unshare --uts`` with
that hostname: ringreduce keys shared memory on hostname and boot id (csrc/cpu/shm_segment.h), so ranks
of one simulated host share memory and ranks of two never do. A switch namespace ``<prefix>-sw`` holds
a bridge ``br0``; host i's link is a veth pair, ``rr0`` in the host (SUBNET.<i+1>/24) and ``h<i>`` on
the bridge, both ends shaped by a tbf qdisc (``rr0``'s: what the host sends; ``h<i>``'s: what it
receives), whose byte counters are what the link carried. No namespace has a route beyond the bridge's
subnet, so no packet leaves the namespaces. Every name starts with the prefix (default ``rrc-<pid>``);
``down`` removes exactly the namespaces this object created, after killing the processes inside.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Mapping, Sequence
from typing import Any

from ringreduce._launch import stop_session

SUBNET = "10.213.0"  # the bridge's /24, inside the namespaces only
HOST_IF = "rr0"
MASTER_PORT = 29500
_RATE = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit|tbit)$")
_RATE_SCALE = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
TOOLS = ("ip", "tc", "unshare")


class ClusterRefused(RuntimeError):
    """This machine (or user) cannot build the simulated cluster; the message is one line saying why."""


def parse_rate(rate: str) -> int:
    """Bits per second of a tc rate such as "1gbit", "100mbit" or "2.5gbit"; ValueError otherwise."""
    m = _RATE.match(rate.strip().lower())
    if m is None:
        raise ValueError(f"link rate {rate!r} is not a tc rate such as 1gbit, 10gbit or 100mbit")
    bits = int(float(m.group(1)) * _RATE_SCALE[m.group(2)])
    if bits < 10**6:
        raise ValueError(f"link rate {rate!r} is below 1mbit: the collectives would time out")
    return bits


def tbf_args(rate: str) -> list[str]:
    """tc arguments of a tbf shaping to `rate`: a burst of 1 ms at the rate (at least 128 KiB, so
    that a 64 KiB GSO packet fits) and at most 50 ms of queue."""
    burst = max(128 * 1024, parse_rate(rate) // 8 // 1000)
    return ["tbf", "rate", rate, "burst", str(burst), "latency", "50ms"]


def preflight() -> None:
    """Raises ClusterRefused unless this process may build namespaces (root, the tools present)."""
    if os.name != "posix" or not hasattr(os, "geteuid"):
        raise ClusterRefused("the simulated cluster needs Linux network namespaces; this is not Linux")
    if os.geteuid() != 0:
        raise ClusterRefused("the simulated cluster needs root (ip netns, veth, tc); this process runs as "
                             f"uid {os.geteuid()}: run it as root, or simulate nodes on loopback with "
                             "RINGREDUCE_LOCAL_SIZE")
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        raise ClusterRefused(f"the simulated cluster needs {', '.join(missing)} on PATH (iproute2, util-linux)")


def _run(argv: Sequence[str], what: str, refuse: bool = False) -> str:
    res = subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    if res.returncode != 0:
        err = " ".join((res.stderr or res.stdout).split()) or f"exit {res.returncode}"
        msg = f"{what} failed: {' '.join(argv)}: {err}"
        raise ClusterRefused(msg) if refuse else RuntimeError(msg)
    return res.stdout


class Cluster:
    """`hosts` simulated hosts joined by links of `link` rate (Note [The simulated cluster]); ``up()``
    builds it (ClusterRefused: the machine does not allow it), ``down()`` removes it (idempotent)."""

    def __init__(self, hosts: int, link: str, prefix: str | None = None) -> None:
        if hosts < 1 or hosts > 200:
            raise ValueError(f"hosts must be 1..200, got {hosts}")
        parse_rate(link)
        self.hosts = hosts
        self.link = link
        self.prefix = prefix or f"rrc-{os.getpid()}"
        self.created: list[str] = []  # namespaces made by this object, removed by down()
        self.procs: list[subprocess.Popen[Any]] = []

    @property
    def switch(self) -> str:
        return f"{self.prefix}-sw"

    def namespace(self, host: int) -> str:
        return f"{self.prefix}-host{host}"

    def hostname(self, host: int) -> str:
        return self.namespace(host)

    def addr(self, host: int) -> str:
        return f"{SUBNET}.{host + 1}"

    def plan(self) -> list[list[str]]:
        """The commands ``up`` runs, in order (also the --dry-run listing)."""
        sw = self.switch
        cmds = [["ip", "netns", "add", sw], ["ip", "-n", sw, "link", "add", "br0", "type", "bridge"],
                ["ip", "-n", sw, "link", "set", "br0", "up"]]
        for i in range(self.hosts):
            ns, peer = self.namespace(i), f"h{i}"
            cmds += [
                ["ip", "netns", "add", ns],
                ["ip", "link", "add", HOST_IF, "netns", ns, "type", "veth", "peer", "name", peer, "netns", sw],
                ["ip", "-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", HOST_IF],
                ["ip", "-n", ns, "link", "set", "lo", "up"],
                ["ip", "-n", ns, "link", "set", HOST_IF, "up"],
                ["ip", "-n", sw, "link", "set", peer, "master", "br0", "up"],
                ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", HOST_IF, "root", *tbf_args(self.link)],
                ["ip", "netns", "exec", sw, "tc", "qdisc", "add", "dev", peer, "root", *tbf_args(self.link)],
            ]
        return cmds

    def up(self) -> Cluster:
        for argv in self.plan():
            if argv[:3] == ["ip", "netns", "add"]:
                if os.path.exists(f"/run/netns/{argv[3]}"):
                    raise ClusterRefused(f"network namespace {argv[3]} exists already (another cluster with "
                                         "this prefix?); pick another prefix")
                _run(argv, "creating a network namespace (does this machine allow them?)", refuse=True)
                self.created.append(argv[3])
            elif "tc" in argv:
                _run(argv, "shaping a link with tbf (does this kernel have sch_tbf?)", refuse=True)
            else:
                _run(argv, "building the links", refuse=True)
        return self

    def down(self) -> list[str]:
        """Kills every process here, removes the namespaces it created; returns what it did, a line each."""
        done: list[str] = []
        for p in self.procs:
            stop_session(p)
        self.procs.clear()
        for ns in reversed(self.created):
            killed = self._kill_all(ns)
            if killed:
                done.append(f"killed {killed} process(es) left in {ns}")
            res = subprocess.run(["ip", "netns", "del", ns], capture_output=True, text=True, timeout=30)
            done.append(f"ip netns del {ns}" + ("" if res.returncode == 0 else f": {res.stderr.strip()}"))
        self.created.clear()
        return done

    def __enter__(self) -> Cluster:
        try:
            return self.up()
        except BaseException:
            self.down()
            raise

    def __exit__(self, *exc: object) -> None:
        self.down()

    def command(self, host: int, argv: Sequence[str]) -> list[str]:
        """`argv` run on `host`: in its namespace, with its own hostname."""
        return ["ip", "netns", "exec", self.namespace(host), "unshare", "--uts", "sh", "-c",
                'hostname "$0" && exec "$@"', self.hostname(host), *argv]

    def popen(self, host: int, argv: Sequence[str], env: Mapping[str, str] | None = None,
              **kwargs: Any) -> subprocess.Popen[Any]:
        """Starts `argv` on `host` in a session of its own (killed by ``down``), gloo and NCCL on the
        host's link."""
        env = dict(os.environ if env is None else env)
        env.update(GLOO_SOCKET_IFNAME=HOST_IF, NCCL_SOCKET_IFNAME=HOST_IF, TP_SOCKET_IFNAME=HOST_IF)
        env.pop("RINGREDUCE_LOCAL_SIZE", None)  # the hosts are real nodes to ringreduce
        p = subprocess.Popen(self.command(host, argv), env=env, start_new_session=True, **kwargs)
        self.procs.append(p)
        return p

    def _kill_all(self, ns: str) -> int:
        res = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=30)
        pids = [int(x) for x in res.stdout.split() if x.isdigit()]
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return len(pids)

    def kill_host(self, host: int) -> int:
        """SIGKILLs every process on `host` (a host that dies); returns how many."""
        return self._kill_all(self.namespace(host))

    def set_link(self, host: int, up: bool) -> None:
        """Cuts (up=False) or restores `host`'s link at the switch: its packets go nowhere meanwhile."""
        _run(["ip", "-n", self.switch, "link", "set", f"h{host}", "up" if up else "down"], "setting a link")

    def link_bytes(self, host: int) -> dict[str, int]:
        """Bytes the link of `host` carried so far, from its tbf counters (frames with their
        Ethernet/IP/TCP headers): "sent" by the host, "received" by it."""
        def qdisc_bytes(ns: str, dev: str) -> int:
            out = _run(["ip", "netns", "exec", ns, "tc", "-s", "-j", "qdisc", "show", "dev", dev], "reading tc")
            return sum(int(q.get("bytes", 0)) for q in json.loads(out) if q.get("kind") == "tbf")

        return {"sent": qdisc_bytes(self.namespace(host), HOST_IF), "received": qdisc_bytes(self.switch, f"h{host}")}

