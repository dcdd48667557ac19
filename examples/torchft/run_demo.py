"""Fault-tolerant training on one machine: torchft's lighthouse and three replica groups, each its own
torchrun of examples/torchft/train.py (DDP on CPU, the cross-replica all-reduce on ringreduce's ring).
Once replica 2 reached step --kill-at, its worker is SIGKILLed: the other two keep stepping, its
torchrun restarts it (--max-restarts), and the new worker heals from a live replica and rejoins.

    python examples/torchft/run_demo.py            # from a clone with ringreduce built (docs/torchft.md)

Every process's output goes to --run-dir (a fresh temporary folder by default), prefixed and shown
here; the last lines compare the replicas' parameter checksums. Exit code 0 when all three ended at
the same step with the same parameters. Nothing here but starting torchft_lighthouse and torchrun,
killing one worker, and reading their output: the engines are torchft's and torchrun's.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
REPLICAS = 3
VICTIM = 2


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Output:
    """Prints a process's lines with a prefix and remembers them."""

    def __init__(self) -> None:
        self.lines: dict[str, list[str]] = {}
        self.lock = threading.Lock()

    def follow(self, name: str, proc: subprocess.Popen, log_path: str) -> None:
        def pump() -> None:
            with open(log_path, "w") as log:
                for line in proc.stdout:
                    log.write(line)
                    log.flush()
                    with self.lock:
                        self.lines.setdefault(name, []).append(line.rstrip("\n"))
                        if not line.startswith("[W"):  # torch's C++ warnings stay in the log file
                            print(f"[{name}] {line}", end="", flush=True)

        threading.Thread(target=pump, daemon=True).start()

    def of(self, name: str) -> list[str]:
        with self.lock:
            return list(self.lines.get(name, []))


def start(cmd: list[str], env: dict, name: str, out: Output, run_dir: str) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    out.follow(name, proc, os.path.join(run_dir, f"{name}.log"))
    return proc


def last_step(lines: list[str]) -> int:
    steps = [int(m.group(1)) for line in lines if (m := re.search(r"\bstep (\d+) participants", line))]
    return max(steps, default=-1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=400, help="committed steps each replica trains (default 400)")
    parser.add_argument("--kill-at", type=int, default=60, help="SIGKILL replica 2's worker once it logged this step")
    parser.add_argument("--join-timeout-ms", type=int, default=2000, help="the lighthouse's --join_timeout_ms")
    parser.add_argument("--run-dir", default=None, help="logs and pid files (default: a new temporary folder)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds before everything is stopped")
    args, train_args = parser.parse_known_args()
    run_dir = args.run_dir or tempfile.mkdtemp(prefix="ringreduce_torchft_")
    os.makedirs(run_dir, exist_ok=True)
    lighthouse_bin = shutil.which("torchft_lighthouse") or os.path.join(os.path.dirname(sys.executable),
                                                                        "torchft_lighthouse")
    if not os.path.exists(lighthouse_bin):
        print("run_demo: torchft_lighthouse not found: pip install --no-deps torchft==0.2.0 (docs/torchft.md)")
        return 2
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    out = Output()
    procs: dict[str, subprocess.Popen] = {}
    lighthouse_port = free_port()
    print(f"run_demo: logs in {run_dir}", flush=True)
    try:
        procs["lighthouse"] = start([lighthouse_bin, "--min_replicas", "1", "--quorum_tick_ms", "100",
                                     "--join_timeout_ms", str(args.join_timeout_ms), "--bind", f"[::]:{lighthouse_port}"],
                                    env, "lighthouse", out, run_dir)
        for r in range(REPLICAS):
            replica_env = dict(env, REPLICA_GROUP_ID=str(r), NUM_REPLICA_GROUPS=str(REPLICAS),
                               TORCHFT_LIGHTHOUSE=f"http://localhost:{lighthouse_port}")
            procs[f"replica {r}"] = start(
                [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "1",
                 "--max-restarts", "3", "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                 os.path.join(HERE, "train.py"), "--steps", str(args.steps), "--run-dir", run_dir, *train_args],
                replica_env, f"replica {r}", out, run_dir)
        deadline = time.monotonic() + args.timeout
        killed_at = None
        replicas = [procs[f"replica {r}"] for r in range(REPLICAS)]
        while any(p.poll() is None for p in replicas):
            if time.monotonic() > deadline:
                print(f"run_demo: not done after {args.timeout:.0f} s; stopping", flush=True)
                return 1
            if killed_at is None and last_step(out.of(f"replica {VICTIM}")) >= args.kill_at:
                with open(os.path.join(run_dir, f"replica_{VICTIM}.pid")) as f:
                    pid = int(f.read())
                os.kill(pid, signal.SIGKILL)
                killed_at = time.monotonic()
                print(f"run_demo: SIGKILLed replica {VICTIM}'s worker (pid {pid}); torchrun restarts it", flush=True)
            time.sleep(0.1)
        done = {r: next((line for line in out.of(f"replica {r}") if " done: " in line), None) for r in range(REPLICAS)}
        print("run_demo: " + ("; ".join(f"replica {r}: {line.split('done: ')[-1] if line else 'no result'}"
                                        for r, line in done.items())), flush=True)
        sums = {line.split(" done: ")[-1] for line in done.values() if line}
        ok = killed_at is not None and len(sums) == 1 and all(done.values()) and all(p.returncode == 0 for p in replicas)
        print(f"run_demo: {'OK: one replica killed, restarted and healed; all three hold the same parameters' if ok else 'FAILED'}",
              flush=True)
        return 0 if ok else 1
    except KeyboardInterrupt:
        return 130
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs.values():
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


if __name__ == "__main__":
    sys.exit(main())
