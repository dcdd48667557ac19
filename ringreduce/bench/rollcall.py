"""Joining the default group with a roll call: a rank or host that never joins is named.

torch's env:// rendezvous says only "2/4 clients joined". Here every rank first writes its hostname and
node into the store and waits for all the others' with the group's timeout; at the timeout it raises
DistStoreError naming the missing ranks, their node (rank // LOCAL_WORLD_SIZE, torchrun's numbering)
and the hosts that did join. Only then does ``init_process_group`` run, on that store.
"""

from __future__ import annotations

import datetime
import os
import socket
import time

import torch.distributed as dist

_KEY = "ringreduce/rollcall/{rank}"
_HOST_GRACE_S = 3.0


def describe_missing(missing: list[int], joined: dict[int, str], world_size: int, seconds: float) -> str:
    """The error for ranks `missing` of `world_size` after `seconds`; `joined`: rank -> "host (node k)"."""
    local_world = os.environ.get("LOCAL_WORLD_SIZE", "")
    nodes = sorted({r // int(local_world) for r in missing}) if local_world.isdigit() and int(local_world) > 0 else []
    where = f" (node{'s' if len(nodes) > 1 else ''} {', '.join(map(str, nodes))} by the launcher's numbering, " \
            f"LOCAL_WORLD_SIZE {os.environ.get('LOCAL_WORLD_SIZE')})" if nodes else ""
    hosts: dict[str, list[int]] = {}
    for r, h in sorted(joined.items()):
        hosts.setdefault(h, []).append(r)
    present = "; ".join(f"{h}: ranks {rs}" for h, rs in hosts.items()) or "none"
    return (f"ringreduce: rank{'s' if len(missing) > 1 else ''} {missing} of {world_size}{where} never joined within "
            f"{seconds:.0f} s; joined: {present}. Check that host's launcher and its network path to "
            f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}")


def init_process_group(backend: str, timeout: datetime.timedelta, **kwargs: object) -> None:
    """dist.init_process_group(`backend`, `timeout`, `kwargs`) from the env:// variables after a roll
    call; DistStoreError names the missing ranks if some rank does not arrive within `timeout`."""
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "") == "True"  # torchrun's agent hosts it
    start = time.monotonic()
    try:
        store = dist.TCPStore(addr, port, world_size, rank == 0 and not agent_store, timeout,
                              wait_for_workers=False)
    except dist.DistStoreError as e:
        raise dist.DistStoreError(
            f"ringreduce: rank {rank} could not reach the store at {addr}:{port} (rank 0's host) within "
            f"{timeout.total_seconds():g} s: rank 0's host never joined or cannot be reached ({e})") from None
    node = os.environ.get("GROUP_RANK", "?")
    store.set(_KEY.format(rank=rank), f"{socket.gethostname()} (node {node})")
    keys = [_KEY.format(rank=r) for r in range(world_size)]
    # Rank 0 hosts the store: it waits a little longer, so that the others can read who joined.
    hosting = rank == 0 and not agent_store
    try:
        store.wait(keys, timeout + datetime.timedelta(seconds=_HOST_GRACE_S if hosting else 0))
    except dist.DistStoreError:
        try:
            joined = {r: store.get(keys[r]).decode() for r in range(world_size) if store.check([keys[r]])}
        except dist.DistError:
            raise dist.DistStoreError(f"ringreduce: rank {rank}: some rank never joined within "
                                      f"{time.monotonic() - start:.0f} s (rank 0's store closed before the roll "
                                      "call could be read: rank 0's error names the missing ranks)") from None
        missing = [r for r in range(world_size) if r not in joined]
        raise dist.DistStoreError(describe_missing(missing, joined, world_size, time.monotonic() - start)) from None
    dist.init_process_group(backend, store=dist.PrefixStore("default_pg", store), rank=rank,
                            world_size=world_size, timeout=timeout, **kwargs)  # type: ignore[arg-type]
