"""RingreduceProcessGroup: the process group of backend "ringreduce". Which collectives run on
ringreduce's ring and which on the inner group (ringreduce/distributed/inner.py): docs/design.md section 1.7.
"""

from __future__ import annotations

import collections
import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ringreduce import _call, _groups, _rings
from ringreduce._call import device_of, local_refusal, overlap_error, overlaps, refuse, run_all_reduce
from ringreduce._groups import GroupInfo
from ringreduce._native import C
from ringreduce._types import CallKind, FrameError, ReduceOp, to_reduce_op
from ringreduce.coalesced import all_reduce_coalesced, copy_blocks
from ringreduce.distributed.inner import InnerGroup
from ringreduce.distributed.options import BackendOptions
from ringreduce.distributed.support import GLOO_ALLTOALL_TORCH, NAME, torch_at_least
from ringreduce.distributed.work import BackendWork
from ringreduce.scatter_gather import gather_into, reduce_scatter
from ringreduce.work import Work


def ring_op(op: Any) -> ReduceOp | None:
    """The ring's op for a torch.distributed ReduceOp, or None for one it does not run (BAND, BOR,
    BXOR, PREMUL_SUM: delegated to the inner backend)."""
    try:
        return to_reduce_op(op)
    except ValueError:
        return None


def _profile(name: str) -> Any:
    """A profiler range "ringreduce:<collective>" (as gloo's "gloo:all_reduce"), only while a profiler
    listens: entering one costs microseconds per call otherwise."""
    if torch.autograd._profiler_enabled():
        return torch.profiler.record_function(f"{NAME}:{name}")
    return contextlib.nullcontext()


def _plain(t: torch.Tensor) -> bool:
    return t.is_contiguous() and not t.is_conj() and not t.is_neg()


def _delegated(name: str, method: str) -> Callable[..., Any]:
    """A method that hands its arguments, as they came, to the inner group's `method` (_delegate)."""

    def call(self: RingreduceProcessGroup, *args: Any, **kwargs: Any) -> Any:
        return self._delegate(name, method, *args, **kwargs)

    return call


class RingreduceProcessGroup(dist.ProcessGroup):
    """One process group of backend "ringreduce", used by torch as the group itself (Note [A
    ProcessGroup, not a Backend] in ringreduce/distributed/__init__.py)."""

    def __init__(self, store: Any, rank: int, size: int, timeout: Any, group_id: str,
                 global_ranks: list[int], options: BackendOptions, nodes: tuple[int, ...] = (),
                 label: str | None = None) -> None:
        """`nodes`: the node of each rank when the creator knows better than the launcher (GroupInfo.nodes);
        `label`: the ring's name in messages instead of "WORLD" / "group <id> ranks [...]"."""
        super().__init__(rank, size)
        self._group_name, self._group_desc = group_id, ""
        self._options = options
        self._inner = InnerGroup(store, rank, size, timeout, group_id)
        ring_store = dist.PrefixStore("ringreduce/ring/", store)
        _groups.set_store(self._inner.pg, ring_store)
        ranks = tuple(global_ranks) if global_ranks else tuple(range(size))
        if label is None:
            label = "WORLD" if not global_ranks else f"group {group_id!r} ranks {list(ranks)}"
        # the ring this group's collectives run on (over the inner group), what ringreduce's resolve()
        # maps this group to (ringreduce/_groups.py _backend_ring)
        self.ring = self._ringreduce_ring = GroupInfo(pg=self._inner.pg, rank=rank, size=size,
                                          name=f"{label} (backend ringreduce)", global_ranks=ranks,
                                          nodes=tuple(nodes))
        # collectives by name ("all_reduce", "_reduce_scatter_base", ...) and where they ran: "ring:<name>"
        # or "inner:<name>" (tests and diagnostics: what went through the ring)
        self.calls: collections.Counter[str] = collections.Counter()
        self._closing = False  # shutdown() or abort() began: no call may start
        self._abort_reason = ""
        self._inner.wait_for_every_rank()  # Note [No rank leaves the creation first] (inner.py)

    # -- identity ---------------------------------------------------------------------------------

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return NAME

    @property
    def _device_types(self) -> list[torch.device]:
        """The devices this group serves (torch reads it, e.g. monitored_barrier wants cpu): a
        ProcessGroup lists its registered backends' devices, and this one registers none."""
        devices = [torch.device("cpu")]
        if torch.cuda.is_available():
            devices.append(torch.device("cuda"))
        return devices

    # A ProcessGroup keeps its name and description in its backends; this one has none (torch's
    # trampoline routes the four calls here).
    def getGroupName(self) -> str:  # noqa: N802
        return self._group_name

    def setGroupName(self, name: str) -> None:  # noqa: N802
        self._group_name = name

    def getGroupDesc(self) -> str:  # noqa: N802
        return self._group_desc

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802
        self._group_desc = desc

    def shutdown(self) -> None:
        """Releases the ring (its worker, shared memory, NCCL communicator) and the inner backends;
        torch calls it from destroy_process_group. Calls queued on the ring finish first. Idempotent."""
        self._release("")

    def abort(self) -> None:
        """Ends the group now, even while a ring call waits for a dead or silent peer (within a poll of
        the shared-memory barriers, 50 ms, or at once over gloo): every ring call in flight or queued
        fails with DistBackendError saying the group was aborted, and the ring's worker has exited when
        this returns, so no tensor is written after it; then as shutdown(). Later calls raise
        DistBackendError. torchft aborts at every reconfiguration and after an error
        (ringreduce/torchft.py). Idempotent."""
        self._release(f"ringreduce: {self.ring.name} was aborted on this rank (ProcessGroup.abort(), as torchft "
                      "does to reconfigure); the group is unusable for ringreduce: create a new one to go on")

    def _release(self, abort_reason: str) -> None:
        """shutdown() and abort(): with an `abort_reason`, the CPU ring is interrupted first (Note
        [Interrupting a wait] in csrc/cpu/c10d_transport.cpp) so that joining its worker cannot wait
        for a peer. A ring call that raced with it (_ring_call) releases again."""
        if self._closing:
            return
        self._closing = True  # before anything is released: _ring_call's check after its submit
        self._abort_reason = abort_reason or f"ringreduce: {self.ring.name} was shut down"
        self._release_rings(abort_reason)
        _call.forget_plans(self.ring.pg)
        _groups.forget_ring(self.ring)
        self._inner.shutdown()

    def _release_rings(self, abort_reason: str) -> None:
        if abort_reason:
            C.interrupt_cpu(self.ring.pg, list(self.ring.members), abort_reason)
        _rings.release_group(self.ring.pg)

    # -- ring collectives --------------------------------------------------------------------------

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        opts = opts if opts is not None else dist.AllreduceOptions()
        rop = ring_op(opts.reduceOp)
        if rop is None or len(tensors) != 1 or tensors[0].layout != torch.strided:
            return self._delegate("all_reduce", "allreduce", tensors, opts)
        tensor = tensors[0]
        options = self._options.allreduce_options(rop, tensor.dtype)
        with self._ring_call("all_reduce"):
            work = run_all_reduce(tensor, self.ring, options, True, CallKind.ALL_REDUCE)
        return BackendWork([work], [tensor])

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        opts = opts if opts is not None else dist.AllreduceCoalescedOptions()
        rop = ring_op(opts.reduceOp)
        if rop is None:
            return self._delegate("all_reduce_coalesced", "allreduce_coalesced", tensors, opts)
        # each dtype's buffer takes the group's options that fit it (AllreduceOptions.for_buffer); a list
        # without float32 tensors has no buffer for the wire
        o = self._options.coalesced_options(rop)
        float32 = any(isinstance(t, torch.Tensor) and t.dtype == torch.float32 for t in tensors)
        with self._ring_call("all_reduce_coalesced"):
            work = all_reduce_coalesced(tensors, rop, self.ring, True, o.accum_dtype, o.algorithm,
                                        o.wire_dtype if float32 else None)
        return BackendWork([work], list(tensors))

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:  # noqa: A002
        with self._ring_call("_all_gather_base"):
            work = self._gather(output, input)
        return BackendWork([work], [output])

    _allgather_base = all_gather_single

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:  # noqa: A002
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        rop = ring_op(opts.reduceOp)
        if rop is None:
            return self._delegate("_reduce_scatter_base", "_reduce_scatter_base", output, input, opts)
        with self._ring_call("_reduce_scatter_base"):
            work = reduce_scatter(output, input, rop, self.ring, True)
        return BackendWork([work], [output])

    _reduce_scatter_base = reduce_scatter_single

    def all_gather_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                    opts: Any = None) -> Any:
        with self._ring_call("allgather_into_tensor_coalesced"):
            works = [self._gather(out, inp) for out, inp in zip(outputs, inputs, strict=True)]
        return BackendWork(works, list(outputs))

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def reduce_scatter_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> Any:
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        rop = ring_op(opts.reduceOp)
        if rop is None:
            return self._delegate("reduce_scatter_tensor_coalesced", "reduce_scatter_tensor_coalesced", outputs,
                                  inputs, opts)
        with self._ring_call("reduce_scatter_tensor_coalesced"):
            works = [reduce_scatter(out, inp, rop, self.ring, True) for out, inp in zip(outputs, inputs, strict=True)]
        return BackendWork(works, list(outputs))

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> Any:
        if len(inputs) != 1 or len(outputs) != 1 or not self._same_blocks(outputs[0], inputs[0]):
            return self._delegate("all_gather", "allgather", outputs, inputs, *([opts] if opts is not None else []))
        blocks, tensor = outputs[0], inputs[0]
        flat = torch.empty(self.size() * tensor.numel(), dtype=tensor.dtype, device=tensor.device)
        with self._ring_call("all_gather"):
            work = self._gather(flat, tensor, plain_output=True)
        return BackendWork([work], list(blocks), functools.partial(copy_blocks, flat, blocks))

    def reduce_scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None) -> Any:
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        rop = ring_op(opts.reduceOp)
        if rop is None or len(outputs) != 1 or len(inputs) != 1 or not self._same_blocks(inputs[0], outputs[0]):
            return self._delegate("reduce_scatter", "reduce_scatter", outputs, inputs, opts)
        output = outputs[0]
        flat = torch.cat([b.reshape(-1) for b in inputs[0]]) if inputs[0] else output.new_empty(0)
        with self._ring_call("reduce_scatter"):
            work = reduce_scatter(output, flat, rop, self.ring, True)
        return BackendWork([work], [output])

    def _same_blocks(self, blocks: list[torch.Tensor], tensor: torch.Tensor) -> bool:
        """A list form the ring runs: one block per rank, each of `tensor`'s numel, dtype and device."""
        return len(blocks) == self.size() and all(
            isinstance(b, torch.Tensor) and b.numel() == tensor.numel() and b.dtype == tensor.dtype
            and b.device == tensor.device and b.layout == torch.strided for b in blocks
        )

    def _gather(self, output: torch.Tensor, tensor: torch.Tensor, plain_output: bool = False) -> Work:
        """The ring's all-gather of `tensor` into `output` (n blocks of its numel, any shape)."""
        ring, kind = self.ring, CallKind.ALL_GATHER
        code, exc, _, _ = local_refusal(tensor, ReduceOp.SUM, None, "ring", written=False)  # only read
        if exc is None:
            if not isinstance(output, torch.Tensor) or output.layout != torch.strided:
                code, exc = FrameError.OTHER, TypeError(
                    "ringreduce: all_gather_into_tensor's output must be a dense tensor")
            elif not output.is_contiguous() and overlaps(output):
                code, exc = FrameError.OTHER, overlap_error(output, "all_gather_into_tensor's output",
                                                            "pass an output made by torch.empty")
            elif output.dtype != tensor.dtype or output.device != tensor.device:
                code, exc = FrameError.OTHER, TypeError(
                    f"ringreduce: all_gather_into_tensor's output ({output.dtype}, {output.device}) must have the "
                    f"input's dtype and device ({tensor.dtype}, {tensor.device})")
            elif output.numel() != tensor.numel() * ring.size:
                code, exc = FrameError.OTHER, ValueError(
                    f"ringreduce: all_gather_into_tensor's output has {output.numel()} elements, but {ring.size} "
                    f"ranks x the input's {tensor.numel()} = {tensor.numel() * ring.size}")
        if exc is not None:
            refuse(ring, kind, code, exc, device_of(tensor))
        finish: Callable[[], None] | None = None
        target = output
        if not plain_output and not _plain(output):
            target = torch.empty(output.shape, dtype=output.dtype, device=output.device)

            def finish() -> None:
                output.copy_(target)

        work = gather_into(ring, target, tensor, True)
        assert work is not None
        return Work.of_parts([work], [output], finish)

    @contextlib.contextmanager
    def _ring_call(self, name: str) -> Any:
        """Around the submission of a ring call: refused once the group is shut down or aborted; a call
        that was submitted while abort() ran (after its check, before its release) is released with the
        ring, so that it fails instead of waiting on a new ring of a dead group."""
        self._check_open(name)
        self.calls[f"ring:{name}"] += 1
        try:
            with _profile(name):
                yield
        finally:
            if self._closing:
                self._release_rings(self._abort_reason)

    def _check_open(self, name: str) -> None:
        if self._closing:
            raise dist.DistBackendError(f"{self._abort_reason}; {name} was called after it")

    # -- delegated to the inner group --------------------------------------------------------------
    # Same arguments as torch's ProcessGroup methods (positional or by keyword), handed on as they
    # came; the inner group picks gloo or NCCL by the tensors' device.

    def _delegate(self, name: str, method: str, *args: Any, **kwargs: Any) -> Any:
        self._check_open(name)
        pg = self._inner.for_tensors(*args, *kwargs.values())
        self.calls[f"inner:{name}"] += 1
        with _profile(name):
            return getattr(pg, method)(*args, **kwargs)

    broadcast = _delegated("broadcast", "broadcast")
    reduce = _delegated("reduce", "reduce")
    allreduce_sparse = _delegated("sparse_all_reduce", "allreduce")
    allgather_coalesced = _delegated("all_gather_coalesced", "allgather_coalesced")
    gather = _delegated("gather", "gather")
    scatter = _delegated("scatter", "scatter")
    all_to_all_single = alltoall_base = _delegated("all_to_all", "alltoall_base")
    send = _delegated("send", "send")
    recv = _delegated("recv", "recv")
    recv_anysource = _delegated("recv", "recv_anysource")

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> Any:
        """all_to_all's list form: the inner backend's, except CPU tensors that gloo cannot take (a torch
        older than GLOO_ALLTOALL_TORCH, whose gloo lacks it, or blocks of different sizes, which gloo
        refuses), which go as one all_to_all_single of the flattened blocks."""
        args = (outputs, inputs, *([opts] if opts is not None else []))
        tensors = [*outputs, *inputs]
        cpu = all(isinstance(t, torch.Tensor) and not t.is_cuda for t in tensors)
        gloo_takes_it = torch_at_least(GLOO_ALLTOALL_TORCH) and len({t.numel() for t in tensors}) == 1
        if not cpu or gloo_takes_it:
            return self._delegate("all_to_all", "alltoall", *args)
        if len(outputs) != self.size() or len(inputs) != self.size():
            raise ValueError(f"ringreduce: all_to_all needs one output and one input tensor per rank ({self.size()}), "
                             f"got {len(outputs)} outputs and {len(inputs)} inputs")
        dtypes = {t.dtype for t in [*outputs, *inputs]}
        if len(dtypes) != 1:
            raise TypeError(f"ringreduce: all_to_all's tensors must share one dtype, got {sorted(map(str, dtypes))}")
        send = torch.cat([t.reshape(-1) for t in inputs])
        recv = send.new_empty(sum(t.numel() for t in outputs))
        out_splits, in_splits = [t.numel() for t in outputs], [t.numel() for t in inputs]
        self._check_open("all_to_all")
        self.calls["inner:all_to_all"] += 1
        with _profile("all_to_all"):
            work = self._inner.pg.alltoall_base(recv, send, out_splits, in_splits,
                                                opts if opts is not None else dist.AllToAllOptions())
        return BackendWork([work], list(outputs), functools.partial(copy_blocks, recv, outputs))

    def barrier(self, *args: Any, **kwargs: Any) -> Any:
        # the inner gloo's (a host barrier) whatever the tensors' device
        self._check_open("barrier")
        self.calls["inner:barrier"] += 1
        with _profile("barrier"):
            return self._inner.pg.barrier(*args, **kwargs)

    def monitored_barrier(self, timeout: Any = None, wait_all_ranks: bool = False) -> None:
        """gloo's monitored barrier. `timeout`: a timedelta (torch.distributed's Python call) or the
        BarrierOptions that torch's C++ trampoline passes."""
        timeout = getattr(timeout, "timeout", timeout)
        self._check_open("monitored_barrier")
        self.calls["inner:monitored_barrier"] += 1
        with _profile("monitored_barrier"):
            if timeout is None:
                self._inner.pg.monitored_barrier(wait_all_ranks=wait_all_ranks)
            else:
                self._inner.pg.monitored_barrier(timeout, wait_all_ranks=wait_all_ranks)
