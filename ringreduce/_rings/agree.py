"""The ranks of a ring agreeing on the knobs that change what they send one another, through the
group's store (Note [The ranks of a ring agree on its knobs] in ringreduce/_config.py), and the store
polling that the NCCL communicator's rendezvous (ringreduce/_rings/cuda.py) shares."""

from __future__ import annotations

import contextlib
import json
import time
from typing import Any

import torch
import torch.distributed as dist

from ringreduce import _config
from ringreduce._groups import GroupInfo
from ringreduce._interrupt import SLICE_MS, interrupt_reason

# Note [Knob agreement keys]: ringreduce/knobs/<device type>/<ring>/<read>/<ring rank> in the group's
# store (its own prefix: torch's group store, or the one a "ringreduce" group records), <ring> being
# "all" or the ring's rank list as the shared-memory keys name it (ringreduce/shm/..., csrc/cpu/
# shm_path.cpp). <read> is (store.add(".../reads", 1) - 1) // size, equal on every rank since a ring's
# agreements are collective and in one order (as the NCCL generations, ringreduce/_rings/cuda.py): a ring made
# again (release_group, a reused id) never reads an earlier read's values. The last rank to read a read's
# keys deletes them: a ring keeps one counter, whatever its reads.
_KNOBS_KEY = "ringreduce/knobs/{device}/{ring}"


class Agreement:
    """One read of a ring's agreed knobs (read_knobs): this rank's published, the others' awaited."""

    def __init__(self, info: GroupInfo, knobs: _config.Knobs, device: str) -> None:
        """Publishes this rank's agreed knobs (_config.agreed_knobs of `knobs`) in the group's store."""
        self.info, self.store, size = info, info.store, info.size
        ring = ",".join(str(m) for m in info.members) + "," if info.members else "all"
        base = _KNOBS_KEY.format(device=device, ring=ring)
        read = (int(self.store.add(base + "/reads", 1)) - 1) // size
        self.prefix = f"{base}/{read}/"
        self.blob = json.dumps([list(k) for k in _config.agreed_knobs(knobs, device == "cuda")],
                               separators=(",", ":")).encode()
        self.store.set(self.prefix + str(info.rank), self.blob)
        self.keys = [self.prefix + str(r) for r in range(size)]
        self.ranks = list(info.members) if info.members else list(range(size))

    def compare(self, timeout_s: float | None) -> bool:
        """Compares the ranks' knobs, waiting at most `timeout_s` for every rank's (DistBackendError
        naming the ranks that did not publish, as a silent peer's timeout is), or, with None, those
        published by now: ValueError (_config.disagreement) where two of them differ; whether every
        rank's were there."""
        if timeout_s is not None:
            _wait_for_keys(self.store, self.keys, timeout_s, self.info)
            present = list(range(len(self.keys)))
        else:
            present = [i for i, key in enumerate(self.keys) if self.store.check([key])]
        blobs = [bytes(b) for b in self.store.multi_get([self.keys[i] for i in present])]
        whole = len(present) == len(self.keys)
        if whole or len(set(blobs)) > 1:  # this rank's read of this read ends here
            self._done()
        if self.info.rank not in present or blobs[present.index(self.info.rank)] != self.blob:
            return True  # a store that does not keep what is set: nothing to compare
        read_by = [[_config.AgreedKnob(*k) for k in json.loads(b.decode())] for b in blobs]
        message = _config.disagreement(self.info.name, [self.ranks[i] for i in present], read_by)
        if message is not None:
            raise ValueError(message)
        return whole

    def _done(self) -> None:
        """The last rank to be done with this read deletes its keys."""
        if int(self.store.add(self.prefix + "done", 1)) == len(self.keys):
            for key in [*self.keys, self.prefix + "done"]:
                with contextlib.suppress(Exception):  # a store without deletion: never read again anyway
                    self.store.delete_key(key)


def poll_until(store: Any, keys: list[str], deadline: float) -> bool:
    """Whether every key is in `store` before time.monotonic() passes `deadline`, polling: store.wait and
    store.get would block out of Ctrl-C's reach (Note [Ctrl-C] in ringreduce/_interrupt.py). The others
    usually published already: it checks again soon, then every half slice."""
    pause = 0.001
    while not store.check(keys):
        if time.monotonic() > deadline:
            return False
        time.sleep(pause)
        pause = min(2 * pause, SLICE_MS / 2000.0)
    return True


def _wait_for_keys(store: Any, keys: list[str], timeout_s: float, info: GroupInfo) -> None:
    """Waits until every key is in `store`; DistBackendError naming the ranks missing after `timeout_s`."""
    if poll_until(store, keys, time.monotonic() + timeout_s):
        return
    ranks = list(info.members) if info.members else list(range(info.size))
    missing = [ranks[i] for i, key in enumerate(keys) if not store.check([key])]
    if not missing:
        return
    its = "its" if len(missing) == 1 else "their"
    raise dist.DistBackendError(
        f"ringreduce: timed out on {info.name}: {_config.rank_list(missing)} did not publish {its} knobs "
        f"within {timeout_s:g} s (the ring's timeout). The ranks of a ring compare the knobs that change what "
        "they send one another at its first call: every rank must make it (a rank that died, hangs or never "
        "calls leaves the others waiting here)"
    )


def store_timeout_s(store: Any, default: float) -> float:
    """The store's timeout in seconds, `default` for a store without one."""
    try:
        return store.timeout.total_seconds()
    except Exception:  # noqa: BLE001 - a store without a timeout
        return default


def group_timeout_s(info: GroupInfo, knobs: _config.Knobs, device: str, store_timeout: bool = False) -> float:
    """The ring's timeout in seconds: RINGREDUCE_TIMEOUT, else the group's (its `device` backend's
    timeout, else its store's, else c10d's default of 30 minutes); with `store_timeout`, at least the
    store's timeout."""
    least = store_timeout_s(info.store, 0.0) if store_timeout else 0.0
    if knobs.timeout_ms > 0:
        return max(knobs.timeout_ms / 1000.0, least)
    with contextlib.suppress(Exception):  # a group without such a backend, or without options
        return max(float(info.pg._get_backend(torch.device(device)).options._timeout.total_seconds()), least)
    return store_timeout_s(info.store, 1800.0)


def read_knobs(ring: Any, info: GroupInfo | None, device: str, blocking: bool = True,
               store_timeout: bool = False) -> None:
    """Reads `ring`'s knobs (its .knobs and .epoch: the epoch first, so that a reload_knobs() meanwhile
    makes the next call read them again). Until its ranks have agreed on them (its .agreed), and given
    its `info`, they agree first (its .pending: this rank's published read): a first call that waits for
    the others anyway (`blocking`) waits for their knobs too, at most the ring's timeout (with
    `store_timeout`, at least the store's); another (an asynchronous CPU call, or a call after one that
    went on) compares those published by now and, where some are missing, goes on, and the ring's next
    call compares again.
    Where they disagree (ValueError) the ring keeps its epoch and its next call reads and compares anew;
    where a peer did not publish in time (DistBackendError) the ranks' reads are out of step, so the ring
    goes on with the knobs read and never compares again (the native ring diagnoses a silent peer, and a
    late one still meets it); after Ctrl-C in that wait every later call raises DistBackendError, as
    after an interrupted call (Note [Ctrl-C] in ringreduce/_interrupt.py). A reload_knobs() after that
    exchanges nothing (Note [The ranks of a ring agree on its knobs] in ringreduce/_config.py says
    why)."""
    if ring.interrupted is not None:
        raise dist.DistBackendError(ring.interrupted)
    epoch = _config.epoch
    knobs = _config.read()
    if info is not None and not ring.agreed and info.size > 1:
        first = ring.pending is None
        if first:
            ring.pending = Agreement(info, knobs, device)
        else:
            # an earlier call of this ring runs with the knobs published: the native ring waits for the
            # peers (and times out, or fails at once where it is unusable)
            knobs = ring.knobs
        timeout_s = None
        if blocking and first:
            timeout_s = group_timeout_s(info, knobs, device, store_timeout)
        try:
            whole = ring.pending.compare(timeout_s)
        except ValueError:
            ring.pending = None  # the next call reads and publishes anew
            raise
        except KeyboardInterrupt:  # as an interrupted call's wait does (Note [Ctrl-C]): unusable here
            ring.interrupted = interrupt_reason(info.name, None, "compared the ranks' knobs")
            raise
        except BaseException:
            ring.knobs, ring.epoch, ring.agreed, ring.pending = knobs, epoch, True, None
            raise
        if not whole:
            ring.knobs = knobs  # this call runs with them; the epoch stays, so the next call compares again
            return
        ring.agreed, ring.pending = True, None
    elif info is not None:
        ring.agreed = True
    ring.knobs, ring.epoch = knobs, epoch


__all__ = ["Agreement", "group_timeout_s", "poll_until", "read_knobs", "store_timeout_s"]
