"""Fault-tolerant DDP on CPU with torchft, its cross-replica all-reduce on ringreduce's ring.

One replica group per torchrun (docs/torchft.md); examples/torchft/run_demo.py starts a lighthouse
and three of them, kills one mid-run and lets torchrun restart it:

    torchft_lighthouse --min_replicas 1 --join_timeout_ms 2000 --bind [::]:29510 &
    REPLICA_GROUP_ID=0 TORCHFT_LIGHTHOUSE=http://localhost:29510 \\
        torchrun --nnodes 1 --nproc-per-node 1 --max-restarts 3 --master-port 29600 examples/torchft/train.py
    (the same with REPLICA_GROUP_ID=1 --master-port 29601, and 2 / 29602)

Every step prints `replica R step S participants N loss L`; a replica that healed from the others
says so; at the end each prints a checksum of its parameters, the same on every replica.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import os
import time

import torch
import torchft
from torch import nn

from ringreduce.torchft import ProcessGroupRingreduce


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=400, help="committed steps to train (default 400)")
    parser.add_argument("--width", type=int, default=1024, help="hidden width: 2 x width^2 parameters (default 1024: 8 MiB of gradients)")
    parser.add_argument("--run-dir", default=None, help="where this replica writes its pid (run_demo.py kills it)")
    args = parser.parse_args()
    replica = int(os.environ.get("REPLICA_GROUP_ID", "0"))
    torch.set_num_threads(1)
    if args.run_dir:
        with open(os.path.join(args.run_dir, f"replica_{replica}.pid"), "w") as f:
            f.write(str(os.getpid()))

    torch.manual_seed(0)  # the same initial parameters on every replica (init_sync=False below)
    model = nn.Sequential(nn.Linear(args.width, args.width), nn.ReLU(), nn.Linear(args.width, args.width))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def load_state_dict(state: dict) -> None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])

    def state_dict() -> dict:
        return {"model": model.state_dict(), "optim": optimizer.state_dict()}

    manager = torchft.Manager(
        pg=ProcessGroupRingreduce(timeout=datetime.timedelta(seconds=30)),
        min_replica_size=1,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        replica_id=f"train_ddp_{replica}",  # MASTER_ADDR/MASTER_PORT, RANK, WORLD_SIZE: torchrun's
        timeout=datetime.timedelta(seconds=30),
        init_sync=False,
    )
    ddp = torchft.DistributedDataParallel(manager, model)
    optim = torchft.Optimizer(manager, optimizer)
    teacher = torch.Generator().manual_seed(1234)
    target_map = torch.randn(args.width, args.width, generator=teacher) / args.width**0.5

    healed = False
    while manager.current_step() < args.steps:
        start = time.perf_counter()
        optim.zero_grad()  # starts the step's quorum (torchft may reconfigure the process group here)
        participants = manager.num_participants()
        step = manager.current_step()
        if not manager.is_participating() and not healed:  # it heals in this step: no gradient of its own
            healed = True
            print(f"replica {replica} healing: loads step {step}'s state from a live replica", flush=True)
        g = torch.Generator().manual_seed(replica * 1_000_003 + step)  # this replica's shard of the data
        x = torch.randn(32, args.width, generator=g)
        loss = nn.functional.mse_loss(ddp(x), x @ target_map)
        loss.backward()  # torchft's DDP hook all-reduces the gradients over ringreduce's ring
        optim.step()  # only if every replica group's step succeeded (should_commit)
        committed = "" if manager.current_step() > step else " (not committed)"
        print(f"replica {replica} step {step} participants {participants} loss {loss.item():.5f} "
              f"{1000 * (time.perf_counter() - start):.0f} ms{committed}", flush=True)

    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
    print(f"replica {replica} done: step {manager.current_step()} parameters sha256 {digest[:16]}", flush=True)
    manager.shutdown(wait=False)


if __name__ == "__main__":
    main()
