"""Fault-tolerant training on torchft with ringreduce's ring: ``ProcessGroupRingreduce`` (docs/torchft.md).

    from ringreduce.torchft import ProcessGroupRingreduce      # needs `pip install torchft`
    pg = ProcessGroupRingreduce(timeout=timedelta(seconds=60))
    manager = torchft.Manager(pg=pg, load_state_dict=..., state_dict=..., ...)
    model = torchft.DistributedDataParallel(manager, model)    # torchft's own wrappers, unchanged

A torchft process group, as torchft's own ProcessGroupGloo is one (a ``ProcessGroupWrapper``): the
Manager calls ``configure(store_addr, replica_id, rank, world_size, ...)`` at every quorum change,
which aborts the previous ring (``abort()``) and makes a new process group of the "ringreduce"
backend (``RingreduceProcessGroup``, ringreduce/distributed/process_group.py, what
``dist.new_group(backend="ringreduce")`` creates) over the new store prefix: its all-reduces run
ringreduce's ring (CPU tensors in shared memory between ranks of one host, else over the group's
gloo point-to-point; CUDA tensors over ringreduce's NCCL communicator, whose unique ids meet in the
same store), everything else torchft asks of it the group's inner gloo/NCCL.

Note [Failed steps, not exceptions]
    torchft drops a step whose collective failed: ``should_commit`` asks the process group's
    ``errored()`` and commits nothing when it names an error; the next quorum reconfigures. A ring
    call that failed (a dead or silent peer, or ``abort()`` while it waited) is therefore reported as
    torchft's own ProcessGroupNCCL reports an abort, through ``errored()``, which returns its
    DistBackendError until the next ``configure``, and the call itself completes: ``wait()`` returns
    False, as torch's Work contract has an aborted Work's, and its future completes with the call's
    tensors as the failure left them (``is_success()`` is False and ``exception()`` holds the error).
    Neither may raise: torchft 0.2.0's DistributedDataParallel comm hook (torchft/ddp.py
    ``_comm_hook``) asserts on the future chain that ``_ManagedWork.wait`` (torchft/manager.py)
    builds only after the Work's ``wait()`` returned, and a future that raised makes the Manager
    errored at once, so that the model's next bucket gets ``Manager.allreduce``'s ``_DummyWork``,
    whose plain future the same assert rejects.
    Either way the survivors' backward would end with an exception instead of a dropped step. Used
    without torchft, the "ringreduce" backend raises DistBackendError on every rank as before.
"""

from __future__ import annotations

import datetime
import functools
from typing import Any

import torch
import torch.distributed as dist

try:
    from torchft.process_group import ProcessGroupGloo, ProcessGroupWrapper
except ImportError as _exc:
    raise ImportError(
        f"ringreduce.torchft needs torchft, which could not be imported ({_exc}): `pip install torchft` "
        "(tested: torchft 0.2.0; `pip install --no-deps torchft==0.2.0` keeps the installed torch, then install "
        "the dependencies it reports missing)"
    ) from _exc

from ringreduce.distributed.options import BackendOptions
from ringreduce.distributed.process_group import RingreduceProcessGroup
from ringreduce.distributed.support import NAME, python_process_groups_supported
from ringreduce.distributed.work import BackendWork

BACKEND_NAME = "torchft-ringreduce"  # getBackendName(), as torchft's are "torchft-gloo", "torchft-nccl"


class _FailedSteps:
    """What a torchft process group does with its failed calls (Note [Failed steps, not exceptions]):
    its Works end quietly, and errored() names the first failure since the last configure()."""

    _errored: Exception | None = None
    _generation = 0  # rings made by configure(): a Work of an older one reports nothing

    def _new_ring(self) -> None:
        self._errored = None
        self._generation += 1

    def _wrap_work(self, work: Any, opts: object) -> Any:
        """Every call's Work, failing quietly into errored() (BackendWork.failing_quietly): the ring's
        own BackendWork, or one over an inner torch Work (gloo's, the delegated calls')."""
        if not isinstance(work, BackendWork):
            work = BackendWork([work], _result_of(work))
        return work.failing_quietly(functools.partial(self._failed, generation=self._generation))

    def _failed(self, exc: Exception, generation: int) -> None:
        if generation == self._generation and self._errored is None:
            self._errored = exc

    def errored(self) -> Exception | None:
        """The error of a call since the last configure(), or of an abort(), else None: the Manager's
        should_commit then drops the step."""
        return self._errored


class ProcessGroupRingreduce(_FailedSteps, ProcessGroupWrapper):
    """A reconfigurable torchft process group whose collectives run ringreduce's ring.

    Args:
        timeout: the ring's timeout (a silent peer raises after it) and the store's, for every ring
            that configure() makes; ``set_timeout`` changes it for the next one.
        options: the rings' ``ringreduce.BackendOptions`` (accum_dtype, wire_dtype, ...).
        connect_devices: the devices whose ring configure() forms before it returns (Note [Rings
            formed at configure]); default "cpu", and "cuda" (the current device) where CUDA is available.

    Note [Rings formed at configure]
        A ring sets itself up at its first call: shared memory through the store (every rank
        publishes, ring rank 0 decides), or on CUDA its NCCL communicator. A peer that dies before
        it published leaves the others waiting in that store exchange until the ring's timeout. torchft
        configures a new group at every quorum change and a replica may die right then, so configure()
        forms the ring itself, as torchft's ProcessGroupGloo connects gloo's pairs and its
        ProcessGroupNCCL connects NCCL eagerly there: a peer lost during configure() fails configure()
        (torchft then skips the step and forms the next quorum), and a peer lost later is noticed by
        the ring's transport (shared memory within 100 ms by its pid, gloo by its socket).
    """

    def __init__(self, timeout: datetime.timedelta = datetime.timedelta(seconds=60),
                 options: BackendOptions | None = None, connect_devices: tuple[str, ...] | None = None) -> None:
        super().__init__(timeout=timeout)
        self._options = options if options is not None else BackendOptions()
        if connect_devices is None:
            connect_devices = ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)
        self._connect_devices = tuple(connect_devices)

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return BACKEND_NAME

    def _create_pg(self, store: dist.Store, rank: int, world_size: int) -> dist.ProcessGroup:
        """The ring of one configure() (ProcessGroupWrapper.configure has aborted the previous one)."""
        if not python_process_groups_supported():
            raise RuntimeError(f"ringreduce: backend {NAME!r} needs a torch that hosts process groups written in "
                               "Python (docs/design.md section 1.7); use torchft.ProcessGroupGloo on this torch")
        self._new_ring()
        ranks = list(self._global_ranks or [])
        quorum = "torchft group" if self._quorum_id is None else f"torchft quorum {self._quorum_id}"
        label = f"{quorum} (replica rank {rank} of {world_size}, configure #{self._generation})"
        pg = RingreduceProcessGroup(
            store, rank, world_size, self._timeout, f"torchft-ringreduce/{self._generation}",
            ranks if len(ranks) == world_size else [], self._options,
            # each replica group is its own torchrun: its GROUP_RANK says nothing of the others' nodes
            nodes=(0,) * world_size, label=label)
        try:
            self._connect(pg)
        except BaseException:
            pg.abort()
            raise
        return pg

    def _connect(self, pg: RingreduceProcessGroup) -> None:
        """Note [Rings formed at configure]: one all-reduce of one element per device in
        `connect_devices`, so that configure() returns with the ring formed (raising as gloo's
        connection does when a peer is gone)."""
        for device in self._connect_devices:
            work = pg.allreduce([torch.zeros(1, device=device)], dist.AllreduceOptions())
            work.wait()

    def allreduce(self, tensors: list[Any], opts: Any) -> Any:
        # torchft's callers also pass a bare ReduceOp (torchtitan's replicate hook, ManagedProcessGroup)
        if isinstance(opts, dist.ReduceOp):
            opts = _allreduce_options(dist.AllreduceOptions(), opts)
        return super().allreduce(tensors, opts)

    def allreduce_coalesced(self, tensors: list[Any], opts: Any) -> Any:
        if isinstance(opts, dist.ReduceOp):
            opts = _allreduce_options(dist.AllreduceCoalescedOptions(), opts)
        return super().allreduce_coalesced(tensors, opts)

    def abort(self, errored: bool = True) -> None:
        """Aborts the current ring within a second, even while a call waits on a dead or silent peer
        (RingreduceProcessGroup.abort): that call's Work fails (Note [Failed steps, not exceptions]) and
        nothing writes its tensor afterwards. `errored`: as torchft's ProcessGroupNCCL, errored()
        then reports the abort until the next configure() (torchft's own configure passes False)."""
        if errored:
            self._errored = dist.DistBackendError(f"ringreduce: {BACKEND_NAME} was aborted")
        super().abort(errored=errored)

    def shutdown(self) -> None:
        """Releases the current ring (its worker, shared memory, sockets, communicator)."""
        pg, self._pg = self._pg, None
        if pg is not None:
            pg.shutdown()



class ProcessGroupGlooReference(_FailedSteps, ProcessGroupGloo):
    """torchft's own ProcessGroupGloo, its failed calls ending as ProcessGroupRingreduce's do (Note
    [Failed steps, not exceptions]): what tests/test_torchft.py and benchmarks/torchft_step.py compare
    ringreduce with. torchft 0.2.0's DistributedDataParallel does not survive a failed all-reduce over
    the unchanged ProcessGroupGloo (its Works raise); the collectives are gloo's, unchanged."""

    def _create_pg(self, store: dist.Store, rank: int, world_size: int) -> dist.ProcessGroup:
        self._new_ring()
        return super()._create_pg(store, rank, world_size)


def _allreduce_options(opts: Any, op: Any) -> Any:
    opts.reduceOp = op
    return opts


def _result_of(work: Any) -> list[torch.Tensor]:
    """A torch Work's output tensors, or none where its kind has no result() (barrier, send/recv)."""
    try:
        return list(work.result())
    except RuntimeError:
        return []


__all__ = ["BACKEND_NAME", "ProcessGroupGlooReference", "ProcessGroupRingreduce"]
