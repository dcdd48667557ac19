"""One replica group (one process) of tests/test_torchft.py's torchft DDP scenario.

    python tests/torchft_replica.py --kind rr|gloo --replica R --role first|restarted --lighthouse ADDR --dir DIR

torchft's Manager, DistributedDataParallel and Optimizer, unchanged, over ProcessGroupRingreduce
(--kind rr) or torchft's own ProcessGroupGloo (--kind gloo: ringreduce.torchft.ProcessGroupGlooReference,
whose failed Works end as ProcessGroupRingreduce's do; torchft's DDP survives no failure otherwise).
The scenario, with files in DIR as its only channel to the test: the three replicas run KILL_STEP
steps all three (a step that got fewer participants is not committed); at step KILL_STEP replica
VICTIM SIGKILLs itself once both others are inside that step's all-reduce; the survivors go on and
save their state at SNAPSHOT_STEP. With --rejoin, they then wait for the restarted replica (role
"restarted": a process of its own, which the test starts with the others, so that its imports are
done, and lets go once the victim is dead and the survivors saved their state, the file "restart";
only then does it create its Manager), which heals from them, and every replica ends after two more
committed steps that all three took part in.

The model has a DDP bucket per parameter (the step's all-reduces after the failed one fail too). Its
loss is linear in the parameters and the data are small integers, so every gradient is an
integer and every sum over replicas is exact in any order: ringreduce's ring and gloo's all-reduce,
which add in different orders, must then give the same bits, and the parameters of the two runs can
be compared bit for bit.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torchft
from torch import nn

KILL_STEP = 3
SNAPSHOT_STEP = 6
VICTIM = 2
REPLICAS = 3
IN, OUT, BATCH = 16, 8, 4
WAIT_S = 240.0  # the longest any file this replica waits for may take to appear


def touch(path: str, text: str = "") -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def wait_for(*paths: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not all(os.path.exists(p) for p in paths):
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {WAIT_S:.0f} s for {[p for p in paths if not os.path.exists(p)]}")
        time.sleep(0.02)


def batch(replica: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The data of `replica` at committed step `step`: small integers."""
    g = torch.Generator().manual_seed(1000 * replica + step)
    return (torch.randint(-2, 3, (BATCH, IN), generator=g).float(),
            torch.randint(-2, 3, (BATCH, OUT), generator=g).float())


class TwoLinear(nn.Module):
    """x -> A x + B x + b: linear in its parameters (integer gradients), two DDP buckets."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(IN, OUT)
        self.b = nn.Linear(IN, OUT, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) + self.b(x)


def scenario_pg(base: type, args: argparse.Namespace, manager_of: list) -> Any:
    """`base` (the process group class) with the scenario's kill: the victim dies at KILL_STEP once the
    survivors are inside that step's all-reduce, which they announce."""

    class ScenarioPG(base):  # type: ignore[misc, valid-type]
        announced = False

        def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> Any:
            step = manager_of[0].current_step()
            if args.role == "first" and step == KILL_STEP:
                if args.replica == VICTIM:
                    wait_for(*(os.path.join(args.dir, f"in_allreduce_{r}") for r in range(REPLICAS) if r != VICTIM))
                    print(f"replica {args.replica}: SIGKILL in step {step}'s all-reduce", flush=True)
                    os.kill(os.getpid(), signal.SIGKILL)
                work = super().allreduce(tensors, opts)
                if not self.announced:
                    self.announced = True
                    touch(os.path.join(args.dir, f"in_allreduce_{args.replica}"))
                return work
            return super().allreduce(tensors, opts)

    return ScenarioPG(timeout=datetime.timedelta(seconds=60))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kind", choices=("rr", "gloo"), required=True)
    parser.add_argument("--replica", type=int, required=True)
    parser.add_argument("--role", choices=("first", "restarted"), default="first")
    parser.add_argument("--lighthouse", required=True)
    parser.add_argument("--dir", required=True)
    parser.add_argument("--rejoin", action="store_true", help="wait for the restarted replica after the snapshot")
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    d = args.dir
    if args.role == "restarted":
        wait_for(os.path.join(d, "restart"))
    name = f"{args.kind} replica {args.replica} ({args.role})"

    from ringreduce.torchft import ProcessGroupGlooReference, ProcessGroupRingreduce

    base = ProcessGroupRingreduce if args.kind == "rr" else ProcessGroupGlooReference
    manager_of: list = []
    pg = scenario_pg(base, args, manager_of)

    torch.manual_seed(0)  # every replica starts from the same parameters (init_sync=False below)
    model = TwoLinear()
    inner = torch.optim.SGD(model.parameters(), lr=1 / 16, momentum=0.5)

    def load_state_dict(sd: dict) -> None:
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["optim"])

    def state_dict() -> dict:
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # this replica group's
    manager = torchft.Manager(
        pg=pg, min_replica_size=2, load_state_dict=load_state_dict, state_dict=state_dict,
        replica_id=f"replica_{args.replica}", store_addr="127.0.0.1", store_port=store.port, rank=0, world_size=1,
        lighthouse_addr=args.lighthouse, init_sync=False, timeout=datetime.timedelta(seconds=60),
        quorum_timeout=datetime.timedelta(seconds=180), connect_timeout=datetime.timedelta(seconds=60))
    manager_of.append(manager)
    # a bucket per parameter: the all-reduces after a failed one must fail as quietly
    ddp = torchft.DistributedDataParallel(manager, model, bucket_cap_mb=64 / 2**20)
    optimizer = torchft.Optimizer(manager, inner)

    if args.role == "first":
        touch(os.path.join(d, f"manager_{args.replica}"))
        wait_for(*(os.path.join(d, f"manager_{r}") for r in range(REPLICAS)))  # all three heartbeat
    else:
        touch(os.path.join(d, "restarted_started"))
    log: list[list[Any]] = []  # [step, participants, committed]
    together = 0  # committed steps after the snapshot that all REPLICAS took part in
    while together < 2:
        if args.role == "first" and manager.current_step() == SNAPSHOT_STEP and not os.path.exists(
                os.path.join(d, f"snapshot_{args.replica}.pt")):
            torch.save(state_dict(), os.path.join(d, f"snapshot_{args.replica}.pt"))
            touch(os.path.join(d, f"log_{args.replica}.json"), json.dumps(log))
            if not args.rejoin:
                break
            wait_for(os.path.join(d, "restarted_started"))
        optimizer.zero_grad()  # the quorum
        participants = manager.num_participants()
        step = manager.current_step()  # after the quorum: a healing replica's is the others'
        x, t = batch(args.replica, step)
        (ddp(x) * t).sum().backward()
        if args.role == "first" and step < KILL_STEP and participants < REPLICAS:
            # a first quorum that a slow starter missed: not committed (after backward: an errored
            # Manager's all-reduce returns a Work that torchft's DDP hook cannot take)
            manager.report_error(RuntimeError(f"{name}: waiting for all {REPLICAS} replicas"))
        optimizer.step()  # commits, or not
        committed = manager.current_step() > step
        log.append([step, participants, committed])
        if committed and participants == REPLICAS and step > SNAPSHOT_STEP:
            together += 1
    if args.rejoin or args.role == "restarted":
        torch.save(state_dict(), os.path.join(d, f"final_{args.replica}.pt"))
        touch(os.path.join(d, f"final_log_{args.replica}.json"), json.dumps(log))
    print(f"{name}: done at step {manager.current_step()}", flush=True)
    manager.shutdown(wait=False)
    pg.shutdown()
    sys.stdout.flush()


if __name__ == "__main__":
    main()
