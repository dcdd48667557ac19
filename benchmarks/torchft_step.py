"""torchft training steps over ringreduce vs torchft's ProcessGroupGloo, side by side in one run.

    python benchmarks/torchft_step.py                      # 2 and 3 replicas, rr / rr-tcp / gloo
    python benchmarks/torchft_step.py --replicas 3 --kinds rr,gloo --steps 40 --json out.json

For each replica count and each process group in turn (--kinds: rr = ringreduce.torchft.
ProcessGroupRingreduce, shared memory on one host; rr-tcp = the same over gloo point-to-point,
RINGREDUCE_SHM=0; gloo = torchft's ProcessGroupGloo, as ringreduce.torchft.ProcessGroupGlooReference)
it starts torchft's lighthouse and one process per replica group (torchft's Manager,
DistributedDataParallel and Optimizer over an MLP of 2 x width^2 parameters: 8 MiB of float32
gradients at the default width 1024), runs --warmup untimed and --steps timed steps, then SIGKILLs
the last replica and lets the others run --steps more. Reported per row:

* step (ms): the median time of a committed step (zero_grad, forward, backward with the DDP hook's
  all-reduces, should_commit, optimizer step) over the timed steps of every replica, no failure;
  ratio: its step time over gloo's in the same run;
* with a kill (ms): the mean time per committed step over the survivors' --steps after the kill,
  the failed step and the recovery included;
* kill -> step (s): from the SIGKILL until every survivor completed its first committed step without
  the killed replica.

The lighthouse runs with --join-timeout-ms (default 1000) and --heartbeat-timeout-ms (default 5000,
torchft's). With 3 replicas the two survivors are a majority of the healthy replicas and the next quorum
forms at the join timeout; with 2 the survivor alone is not, and waits until the killed replica's
heartbeat expires (the lighthouse's split-brain rule). The JSON (--json) holds every step of every
replica, the machine, the command, the commit and the load average.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
KINDS = ("rr", "rr-tcp", "gloo")


def replica_main(args: argparse.Namespace) -> None:
    """One replica group: writes one JSON line per step to args.out."""
    import torch
    import torchft
    from torch import nn

    from ringreduce.torchft import ProcessGroupGlooReference, ProcessGroupRingreduce

    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=60)
    pg = ProcessGroupGlooReference(timeout=timeout) if args.kind == "gloo" else ProcessGroupRingreduce(timeout=timeout)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(args.width, args.width), nn.ReLU(), nn.Linear(args.width, args.width))
    inner = torch.optim.SGD(model.parameters(), lr=0.01)

    def load_state_dict(sd: dict) -> None:
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["optim"])

    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = torchft.Manager(
        pg=pg, min_replica_size=1, load_state_dict=load_state_dict,
        state_dict=lambda: {"model": model.state_dict(), "optim": inner.state_dict()},
        replica_id=f"bench_{args.replica}", store_addr="127.0.0.1", store_port=store.port, rank=0, world_size=1,
        lighthouse_addr=args.lighthouse, init_sync=False, timeout=timeout)
    ddp = torchft.DistributedDataParallel(manager, model)
    optimizer = torchft.Optimizer(manager, inner)
    with open(args.out + ".ready", "w"):
        pass
    while not os.path.exists(args.out + ".go"):  # every replica starts its first quorum together
        time.sleep(0.02)
    x = torch.randn(32, args.width, generator=torch.Generator().manual_seed(args.replica))
    with open(args.out, "w", buffering=1) as out:
        while manager.current_step() < args.total:
            start = time.perf_counter()
            optimizer.zero_grad()
            participants = manager.num_participants()
            step = manager.current_step()
            ddp(x).square().mean().backward()
            optimizer.step()
            out.write(json.dumps({"step": step, "participants": participants, "committed": manager.current_step() > step,
                                  "seconds": time.perf_counter() - start, "end": time.time()}) + "\n")
    manager.shutdown(wait=False)


def _start(kind: str, replica: int, lighthouse: str, out: str, args: argparse.Namespace) -> subprocess.Popen:
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo",
               PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    if kind == "rr-tcp":
        env["RINGREDUCE_SHM"] = "0"
    cmd = [sys.executable, os.path.abspath(__file__), "--replica", str(replica), "--kind", kind, "--lighthouse",
           lighthouse, "--out", out, "--total", str(args.warmup + 2 * args.steps), "--width", str(args.width)]
    log = open(out + ".log", "w")  # noqa: SIM115 - the process writes it
    try:
        return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    finally:
        log.close()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _lighthouse_bin() -> str:
    found = shutil.which("torchft_lighthouse") or os.path.join(os.path.dirname(sys.executable), "torchft_lighthouse")
    if not os.path.exists(found):
        raise SystemExit("torchft_lighthouse not found: pip install --no-deps torchft==0.2.0 (docs/torchft.md)")
    return found


def _read(path: str) -> list[dict]:
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.endswith("\n")]
    except FileNotFoundError:
        return []


def run_one(kind: str, replicas: int, args: argparse.Namespace, folder: str) -> dict:
    """One lighthouse (torchft_lighthouse, its output in `folder`) and `replicas` replica processes of
    `kind`; the last one is killed after the steady part."""
    port = _free_port()
    with open(os.path.join(folder, f"lighthouse-{kind}-{replicas}.log"), "w") as log:
        lighthouse = subprocess.Popen(
            [_lighthouse_bin(), "--min_replicas", "1", "--join_timeout_ms", str(args.join_timeout_ms),
             "--heartbeat_timeout_ms", str(args.heartbeat_timeout_ms), "--bind", f"[::]:{port}"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    outs = [os.path.join(folder, f"{kind}-{replicas}-{r}.jsonl") for r in range(replicas)]
    procs = [_start(kind, r, f"http://localhost:{port}", outs[r], args) for r in range(replicas)]
    victim = replicas - 1
    kill_after = args.warmup + args.steps  # committed steps of the victim before it is killed
    killed_at = None
    try:
        deadline = time.monotonic() + args.timeout
        while not all(os.path.exists(o + ".ready") for o in outs):
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise RuntimeError(f"{kind} x{replicas}: a replica did not start; see {folder}")
            time.sleep(0.05)
        for o in outs:
            open(o + ".go", "w").close()
        while any(p.poll() is None for i, p in enumerate(procs) if i != victim):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{kind} x{replicas}: not done within {args.timeout:.0f} s; see {folder}")
            if killed_at is None and sum(s["committed"] for s in _read(outs[victim])) >= kill_after:
                os.kill(procs[victim].pid, signal.SIGKILL)
                killed_at = time.time()
                procs[victim].wait()  # reaped at once: shared memory's liveness check sees no zombie
            time.sleep(0.02)
        codes = [p.wait() for p in procs]
        if codes[:victim] != [0] * victim:
            raise RuntimeError(f"{kind} x{replicas}: exit codes {codes}; see {folder}")
    finally:
        for p in [*procs, lighthouse]:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    steps = [_read(o) for o in outs]
    steady = [s["seconds"] for log in steps for s in log
              if s["committed"] and args.warmup <= s["step"] < args.warmup + args.steps and s["participants"] == replicas]
    row: dict = {"kind": kind, "replicas": replicas, "step_ms": 1000 * statistics.median(steady) if steady else None,
                 "steady_steps": len(steady), "steps": steps, "killed_at": killed_at}
    if killed_at is not None:
        survivors = steps[:victim]
        # the first committed step of the quorum without the victim (a step that was already under way may
        # still have committed with the victim's gradient)
        firsts = [min((s["end"] for s in log if s["committed"] and s["end"] > killed_at and s["participants"] < replicas),
                      default=None) for log in survivors]
        after = [s for log in survivors for s in log if s["end"] > killed_at]
        committed = sum(s["committed"] for s in after)
        row["kill_to_step_s"] = max(firsts) - killed_at if all(f is not None for f in firsts) else None
        # wall time from the kill to the survivors' last step, per committed step of a survivor
        row["with_kill_ms"] = 1000 * (max(s["end"] for s in after) - killed_at) / (committed / len(survivors)) \
            if committed else None
    return row


def _machine() -> dict:
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    try:
        commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                check=False).stdout.strip()
    except OSError:
        commit = ""
    return {"cpu": model, "cpus": os.cpu_count(), "host": platform.node(), "commit": commit,
            "loadavg_start": os.getloadavg(), "utc": datetime.datetime.now(datetime.timezone.utc).isoformat()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", default="2,3", help="replica counts (default 2,3)")
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"process groups (default {','.join(KINDS)})")
    parser.add_argument("--steps", type=int, default=30, help="timed steps, then as many after the kill (default 30)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (default 5)")
    parser.add_argument("--width", type=int, default=1024, help="MLP width: 2 x width^2 parameters (default 1024)")
    parser.add_argument("--join-timeout-ms", type=int, default=1000, help="the lighthouse's join timeout (default 1000)")
    parser.add_argument("--heartbeat-timeout-ms", type=int, default=5000,
                        help="the lighthouse's heartbeat timeout: when a silent replica counts as dead (default "
                             "5000, torchft's)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per run before it is stopped")
    parser.add_argument("--json", default=None, help="write every step and the summary here")
    parser.add_argument("--keep", default=None, help="keep the replicas' and lighthouses' logs in this folder")
    parser.add_argument("--replica", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--kind", help=argparse.SUPPRESS)
    parser.add_argument("--lighthouse", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--total", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.replica is not None:
        replica_main(args)
        return 0
    kinds = [k for k in args.kinds.split(",") if k]
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        parser.error(f"unknown kinds {unknown}; known: {', '.join(KINDS)}")
    machine = _machine()
    rows = []
    with tempfile.TemporaryDirectory(prefix="torchft_step_") as tmp:
        folder = args.keep or tmp
        os.makedirs(folder, exist_ok=True)
        for replicas in [int(n) for n in args.replicas.split(",")]:
            for kind in kinds:
                rows.append(run_one(kind, replicas, args, folder))
                r = rows[-1]
                print(f"[torchft_step] {kind} x{replicas}: step {r['step_ms']:.1f} ms, with a kill "
                      f"{r.get('with_kill_ms') or float('nan'):.1f} ms/step, kill -> step "
                      f"{r.get('kill_to_step_s') or float('nan'):.2f} s", flush=True)
    machine["loadavg_end"] = os.getloadavg()
    grad_mib = 2 * (args.width * args.width + args.width) * 4 / 2**20
    print(f"\ntorchft DDP, MLP {2 * args.width * (args.width + 1)} parameters ({grad_mib:.1f} MiB of float32 "
          f"gradients), {args.steps} timed steps, lighthouse join timeout {args.join_timeout_ms} ms, heartbeat "
          f"timeout {args.heartbeat_timeout_ms} ms; "
          f"{machine['cpu']} x{machine['cpus']}, commit {machine['commit']}, load {machine['loadavg_start'][0]:.1f}")
    print(f"{'replicas':>8} {'kind':>7} {'step (ms)':>10} {'ratio':>6} {'with a kill (ms)':>17} {'kill -> step (s)':>17}")
    for r in rows:
        gloo = next((g for g in rows if g["kind"] == "gloo" and g["replicas"] == r["replicas"]), None)
        ratio = r["step_ms"] / gloo["step_ms"] if gloo and gloo["step_ms"] and r["step_ms"] else float("nan")
        print(f"{r['replicas']:>8} {r['kind']:>7} {r['step_ms']:>10.1f} {ratio:>6.2f} "
              f"{r.get('with_kill_ms') or float('nan'):>17.1f} {r.get('kill_to_step_s') or float('nan'):>17.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"schema": "ringreduce.bench.torchft_step/1", "command": sys.argv, "machine": machine,
                       "args": {k: v for k, v in vars(args).items() if v is not None}, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
