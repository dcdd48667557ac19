"""The inner process group of a "ringreduce" group: gloo for CPU tensors, NCCL (lazily) for CUDA ones.
It carries the CPU ring and runs every collective the ring does not (docs/design.md section 1.7); torch's
tables never see it.
"""

from __future__ import annotations

import datetime
import threading
from typing import Any

import torch
import torch.distributed as dist

_PREFIX = "ringreduce/inner/"
_CPU = torch.device("cpu")
_CREATED = "created/"  # the keys of Note [No rank leaves the creation first], one per rank

# Note [No rank leaves the creation first]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# gloo connects a pair of ranks asymmetrically: of the two, the initiator (gloo's Device::isInitiator,
# by the ports of the two listening sockets: either rank) is connected as soon as it has read the
# listener's address from the store and written its sequence number into the listener's socket, which
# the kernel accepts into the backlog at once; the listener is connected only once its own main thread
# has read every rank's address from the store (FileStore polls) and its device thread has accepted
# that socket. On a loaded machine the initiator could leave init_process_group seconds before the
# listener, make its first call, run out of the ring's timeout (RINGREDUCE_TIMEOUT) waiting for a peer
# still inside its group's creation, fail and exit: the listener's init_process_group then failed with
# gloo's "Connection closed by peer" (issue 49; tests/test_backend.py::test_dead_and_silent_peers...).
# So the creation ends with a store barrier under the group's timeout: every rank sets created/<rank>
# under the inner prefix once its inner gloo is connected and waits for every other rank's key. No rank
# leaves init_process_group (or new_group) before every rank of the group is connected, and a peer that
# finishes early, even right after its first call, cannot break another rank's init
# (tests/test_backend.py::test_a_peer_that_exits_after_its_first_call_breaks_no_init).


class InnerGroup:
    """A ProcessGroup over `store` (under its own prefix) with the outer group's rank, size and timeout."""

    def __init__(self, store: Any, rank: int, size: int, timeout: datetime.timedelta, name: str) -> None:
        self.store = dist.PrefixStore(_PREFIX, store)
        self.rank, self.size, self.timeout = rank, size, timeout
        self.pg = dist.ProcessGroup(self.store, rank, size)
        btype = dist.ProcessGroup.BackendType
        # gloo's creation connects every pair of ranks: every rank's creator runs it, as torch's own
        gloo = dist.ProcessGroupGloo(dist.PrefixStore("cpu/", self.store), rank, size, timeout=timeout)
        self.pg._set_default_backend(btype.GLOO)
        self.pg._register_backend(_CPU, btype.GLOO, gloo)
        if hasattr(self.pg, "_set_group_name"):
            self.pg._set_group_name(f"ringreduce-inner/{name}")
        self._nccl: Any = None
        self._lock = threading.Lock()
        self.closed = False

    def wait_for_every_rank(self) -> None:
        """Returns once every rank of the group has created its inner group (Note [No rank leaves the
        creation first]); raises DistStoreError, naming the ranks that did not, after the timeout."""
        self.store.set(f"{_CREATED}{self.rank}", "1")
        keys = [f"{_CREATED}{r}" for r in range(self.size)]
        try:
            self.store.wait(keys, self.timeout)
        except RuntimeError as exc:  # DistStoreError from a TCPStore, RuntimeError("Wait timeout") from a FileStore
            missing = [r for r, k in enumerate(keys) if not self.store.check([k])]
            raise dist.DistStoreError(
                f"ringreduce: rank {self.rank} created its part of the group within {self.timeout}, but ranks "
                f"{missing} of {self.size} did not (their init_process_group / new_group did not get that far): {exc}"
            ) from exc

    def for_tensors(self, *tensors: Any) -> Any:
        """The inner ProcessGroup, with its NCCL backend registered first when a tensor is on CUDA."""
        for t in tensors:
            if isinstance(t, (list, tuple)):
                self.for_tensors(*t)
            elif isinstance(t, torch.Tensor) and t.is_cuda:
                self._ensure_nccl()
        return self.pg

    def _ensure_nccl(self) -> None:
        """NCCL for the collectives delegated on CUDA tensors, created on the first of them: its
        constructor does not communicate (the communicator is made by its first collective, on every
        rank alike), so ranks that never delegate a CUDA call never create one."""
        with self._lock:
            if self._nccl is not None:
                return
            if not (dist.is_nccl_available() and torch.cuda.is_available()):
                raise RuntimeError(
                    "ringreduce: a collective on CUDA tensors was delegated to NCCL, but this torch has no NCCL "
                    "or no GPU is visible; use CPU tensors or a torch build with NCCL"
                )
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = self.timeout
            self._nccl = dist.ProcessGroupNCCL(dist.PrefixStore("cuda/", self.store), self.rank, self.size, options)
            self.pg._register_backend(torch.device("cuda"), dist.ProcessGroup.BackendType.NCCL, self._nccl)

    def shutdown(self) -> None:
        """Shuts the inner backends down (idempotent); the ring's runtime must be released before."""
        if self.closed:
            return
        self.closed = True
        for backend in (self.pg._get_backend(_CPU), self._nccl):
            if backend is None:
                continue
            try:
                backend.shutdown()
            except Exception:  # noqa: BLE001 - a backend without shutdown (older torch): dropped with the group
                pass
