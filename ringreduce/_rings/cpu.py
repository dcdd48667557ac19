"""CpuRing: the calls of CPU tensors on the native CPU runtime of one ring (shared memory between ranks
of one host, gloo point-to-point between hosts), and the plans repeated calls run."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from ringreduce import _config
from ringreduce._groups import GroupInfo, one_node
from ringreduce._interrupt import SLICE_MS, interrupt_ring, wait_sliced
from ringreduce._native import C
from ringreduce._options import native_options
from ringreduce._rings.agree import read_knobs
from ringreduce._types import KIND_NAMES
from ringreduce.work import Work


class CpuRing:
    """The ring of one process group and rank list for CPU tensors (ringreduce/_rings/__init__.py has
    the interface); its native ring (``_C.CpuRing``, Note [A bound ring] in csrc/torch/cpu_ops.h) is
    bound once, and the native runtime is made at its first call."""

    ENQUEUES = False  # a synchronous call returns once its result is in the tensor
    WIRE_RING = None  # a 16-bit wire runs on the caller's algorithm (the hierarchical one's cross-node ring too)
    PLANS = True
    # the ranks' agreement on the knobs (agree.read_knobs): done, this rank's read in progress, and why
    # every call raises after Ctrl-C in it
    agreed: bool = False
    pending: Any = None
    interrupted: str | None = None

    def __init__(self, info: GroupInfo) -> None:
        self.pg, self.members, self.name = info.pg, info.members, info.name
        self.native = C.CpuRing(info.pg, info.name, list(info.members), info.store)
        # read now; ring_for reads them again at the first call, where the ranks agree on them (epoch -1)
        self.knobs, self.epoch = _config.read(), -1

    def reload(self, info: GroupInfo | None = None, blocking: bool = True) -> None:
        """Reads the knobs (Note [Knobs are read when a ring is made]); with the ring's `info` (ring_for,
        the calls' path) at its first call its ranks agree on them first (agree.read_knobs: an
        asynchronous call, not `blocking`, waits for no peer)."""
        read_knobs(self, info, "cpu", blocking)

    def check_enabled(self) -> bool:
        """Whether calls exchange agreement frames (RINGREDUCE_CHECK; on by default on CPUs)."""
        return self.knobs.check_enabled(False)

    def ring_parameters(self) -> str:
        """The ring's parameters in a DETAIL log line."""
        return f"segment_bytes={self.knobs.cpu_segment_bytes()} slots={self.knobs.num_slots or 'auto'}"

    def option_refusal(self, algorithm: str, gather: str) -> BaseException | None:
        """What of a 16-bit wire's options the CPU path cannot run: nothing."""
        return None

    def options(self, call: Any) -> Any:
        """The native CallOptions of `call` on this ring."""
        return native_options(call, self.knobs, False, one_node(call.info, self.knobs))

    def interrupter(self, info: GroupInfo, handle: Any) -> Any:
        """What a Ctrl-C during a wait for `handle` does (Note [Ctrl-C] in ringreduce/_interrupt.py)."""
        return lambda: interrupt_ring(info.pg, info.members, info.name, handle)

    def all_reduce(self, call: Any, tensor: torch.Tensor, options: Any, async_op: bool) -> tuple[Any, Work | None]:
        """Runs a checked all-reduce with its native `options`; (native handle, Work or None)."""
        # The profiler range only when a profiler listens: entering one costs ~10 us per call otherwise.
        scope = (torch.profiler.record_function(f"ringreduce.{KIND_NAMES[call.kind]}")
                 if torch.autograd._profiler_enabled() else contextlib.nullcontext())
        with scope:
            handle = self.native.submit(tensor, None, options, not async_op)
            return handle, self.finish(call.info, handle, tensor, async_op, describe(call))

    def ring_half(self, call: Any, tensor: torch.Tensor, output: torch.Tensor,
                  async_op: bool) -> tuple[Any, Work | None]:
        """reduce_scatter (`tensor` = input, `output` = this rank's block) or all_gather (`output` = the
        concatenation) of checked tensors; (native handle, Work)."""
        tensor = tensor.detach()  # the worker thread copies from it and must not record autograd history
        with torch.profiler.record_function(f"ringreduce.{KIND_NAMES[call.kind]}"):
            handle = self.native.submit(tensor, output, self.options(call), not async_op)
            work = Work(handle, [output], describe=describe(call), on_interrupt=self.interrupter(call.info, handle))
            if not async_op:
                work.wait()
        return handle, work

    def refuse(self, call: Any, algorithms: list[str]) -> list[int]:
        """One refusal frame (`call`: its kind and local error) per call the other ranks run (every call
        of a ring, hierarchical ones too, runs on the ring's own runtime); returns their numbers. The
        others raise "rank r refused"."""
        seqs = []
        options = self.options(call)
        for _ in algorithms:
            handle = self.native.submit(None, None, options, False)
            wait_sliced(handle, -1, self.interrupter(call.info, handle))
            seqs.append(handle.seq)
        return seqs

    def finish(self, info: GroupInfo, handle: Any, tensor: torch.Tensor, async_op: bool, what: str) -> Work | None:
        """The Work of an async call, or None once a synchronous one completed (raising its error)."""
        if async_op:
            return Work(handle, [tensor], describe=what, on_interrupt=self.interrupter(info, handle))
        try:  # Note [Ctrl-C] (ringreduce/_interrupt.py); a finished call costs one native wait
            if not handle.wait(SLICE_MS):
                wait_sliced(handle, -1)
        except KeyboardInterrupt:
            interrupt_ring(info.pg, info.members, info.name, handle)
            raise
        if not handle.ok():
            handle.raise_error()
        return None

    def plan(self, call: Any, options: Any, group: Any, world: Any) -> Plan:
        """The plan of `call`'s argument set (Note [Fast path of a repeated call] in ringreduce/_call.py)."""
        return Plan(self, call, options, group, world)


def describe(call: Any) -> str:
    """What a call's Work names itself."""
    return f"{KIND_NAMES[call.kind]} {call.rop.name} on {call.info.name}"


class Plan:
    """What the checks of one argument set decided, for the next identical call: the ring, the native
    options and what its Work says (Note [Fast path of a repeated call] in ringreduce/_call.py)."""

    __slots__ = ("ring", "info", "options", "describe", "group", "kind", "world", "epoch")

    def __init__(self, ring: CpuRing, call: Any, options: Any, group: Any, world: Any) -> None:
        self.ring, self.info, self.options, self.describe = ring, call.info, options, describe(call)
        self.group = group  # the `group` argument itself (None: WORLD)
        self.kind = call.kind  # the call kind (its id is in the key)
        self.world = world  # the default process group when the plan was made
        self.epoch = ring.epoch  # the knobs' epoch the options were made in

    def run(self, tensor: torch.Tensor, async_op: bool) -> Work | None:
        """The call on `tensor`: a synchronous call that ran on this thread returns without another
        Python frame (Note [Synchronous calls without a handle] in csrc/torch/bindings.cpp)."""
        native = self.ring.native
        if async_op:  # no extra frame for the hooks' buckets
            handle = native.submit(tensor, None, self.options, False)
            return Work(handle, [tensor], describe=self.describe, on_interrupt=self.ring.interrupter(self.info, handle))
        handle = native.run(tensor, self.options)
        if handle is None:
            return None
        return self.ring.finish(self.info, handle, tensor, False, self.describe)
