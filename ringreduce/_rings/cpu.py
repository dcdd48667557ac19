"""The CPU backend: calls on the native CPU runtime of a ring (shared memory between ranks of one host,
gloo point-to-point between hosts), their native options, and the plans of repeated calls."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from ringreduce import _config, _fastpath
from ringreduce._groups import GroupInfo, one_node
from ringreduce._interrupt import SLICE_MS, interrupt_ring, wait_sliced
from ringreduce._native import C
from ringreduce._options import HALF_TYPES
from ringreduce._types import KIND_NAMES, NATIVE_OPS, FrameError, ReduceOp
from ringreduce.work import Work

ENQUEUES = False  # a synchronous call returns once its result is in the tensor
WIRE_RING = None  # a 16-bit wire runs on the caller's algorithm (the hierarchical one's cross-node ring too)
_NONE = FrameError.NONE


def check_enabled() -> bool:
    """Whether calls exchange agreement frames (RINGREDUCE_CHECK; on by default on CPUs)."""
    return _config.check_enabled(False)


def ring_parameters() -> str:
    """The ring's parameters in a DETAIL log line."""
    return f"segment_bytes={_config.segment_bytes()} slots={_config.num_slots() or 'auto'}"


def option_refusal(algorithm: str, gather: str) -> BaseException | None:
    """What of a 16-bit wire's options the CPU path cannot run: nothing."""
    return None


# Options objects by everything they hold: most programs make the same few calls over and over, so
# a call costs one dictionary lookup instead of building the native struct.
_options_cache: dict[tuple[Any, ...], Any] = {}


def call_options(info: GroupInfo, kind: Any, op: ReduceOp, *, accum: bool = False, local_error: Any = _NONE,
                 ntensors: int = 1, local_size: int = 0, node_order: tuple[int, ...] = (),
                 one_shot: bool = True, wire: Any = None, predivide: float = 0.0, extra_divisor: int = 1,
                 narrow: bool = False, gather16: bool = False) -> Any:
    """The native CallOptions (csrc/core/call_options.h) of one CPU call on `info`'s ring, with the knobs
    read now. `local_error`: a local refusal; `node_order`: the hierarchical ring's members; `narrow`:
    the float16/bfloat16 tensor's own dtype as accum_dtype, rounding at every hop in shared memory too
    (Note [Half types in shared memory] in csrc/cpu/shm_ring.h); `gather16`: the all-gather moves the
    16-bit wire too (Note [16-bit all-gather] in csrc/core/plan.h)."""
    check = _config.check_enabled(False)
    segment, slots, timeout = _config.segment_bytes(), _config.num_slots(), _config.timeout_ms()
    node, shm = one_node(info), _config.shm_enabled()
    key = (kind, op, accum, local_error, ntensors, local_size, node_order, one_shot, check, segment, slots, timeout,
           node, shm, wire, predivide, extra_divisor, narrow, gather16)
    opts = _options_cache.get(key)
    if opts is None:
        opts = C.CallOptions()
        opts.kind, opts.op, opts.accum_float32, opts.accum_narrow = kind, NATIVE_OPS[op], accum, narrow
        opts.local_error, opts.ntensors, opts.check = local_error, ntensors, check
        opts.segment_bytes, opts.num_slots, opts.timeout_ms = segment, slots, timeout
        opts.local_size, opts.node_order, opts.one_shot = local_size, list(node_order), one_shot
        opts.one_node, opts.shm = node, shm
        opts.wire_dtype, opts.predivide, opts.extra_divisor = wire, predivide, extra_divisor
        opts.wire_gather16 = gather16
        if len(_options_cache) > 256:
            _options_cache.clear()
        _options_cache[key] = opts
    return opts


def submit_cpu(info: GroupInfo, tensor: torch.Tensor | None, options: Any, output: torch.Tensor | None = None,
               synchronous: bool = False) -> Any:
    """Queues one CPU call on info's ring and returns its native handle; a `synchronous` call may run on
    this thread (Note [Synchronous calls in shared memory] in csrc/cpu/group_runtime.h)."""
    return C.submit_cpu(info.pg, info.name, list(info.members), tensor, output, options, info.store, synchronous)


_SUBMIT_CPU = submit_cpu
# The extension's own submit (a stub that a test or a measurement puts over C.submit_cpu is called
# instead of a plan's ring).
_NATIVE_SUBMIT = C.submit_cpu


def interrupter(info: GroupInfo, handle: Any) -> Any:
    """What a Ctrl-C during a wait for `handle` does (Note [Ctrl-C] in ringreduce/_interrupt.py)."""
    return lambda: interrupt_ring(info.pg, info.members, info.name, handle)


def refuse(info: GroupInfo, kind: Any, code: Any, algorithms: list[str], device: torch.device | None) -> list[int]:
    """One refusal frame per call the other ranks run (every call of a ring, hierarchical ones too,
    runs on the ring's own runtime); returns their numbers. The others raise "rank r refused"."""
    seqs = []
    for _ in algorithms:
        handle = submit_cpu(info, None, call_options(info, kind, ReduceOp.SUM, local_error=code))
        wait_sliced(handle, -1, interrupter(info, handle))
        seqs.append(handle.seq)
    return seqs


def all_reduce(call: Any) -> tuple[Any, Work | None]:
    """Runs a checked all-reduce (`call`: ringreduce._call.Call) and keeps its plan for the next
    identical call (Note [Fast path of a repeated call] in ringreduce/_fastpath.py)."""
    info, tensor = call.info, call.tensor
    # The profiler range only when a profiler listens: entering one costs ~10 us per call otherwise.
    scope = (torch.profiler.record_function(f"ringreduce.{KIND_NAMES[call.kind]}")
             if torch.autograd._profiler_enabled() else contextlib.nullcontext())
    with scope:
        options = call_options(info, call.kind, call.rop, accum=call.accum, ntensors=call.ntensors,
                               local_size=call.local_size, node_order=call.members if call.local_size else (),
                               one_shot=call.one_shot, wire=call.wire, predivide=call.factor,
                               extra_divisor=call.extra_divisor,
                               narrow=call.accum_dtype == tensor.dtype and tensor.dtype in HALF_TYPES,
                               # "16" always, "auto" where the ring spans several nodes, "32" never
                               gather16=call.wire is not None and (
                                   call.gather == "16" or (call.gather == "auto" and not one_node(info))))
        describe = f"{KIND_NAMES[call.kind]} {call.rop.name} on {info.name}"
        if call.plan_key is not None:
            _fastpath.remember(call.plan_key, _fastpath.Plan(call.group, call.kind, call.world, call.env, info,
                                                             options, describe))
        handle = submit_cpu(info, tensor, options, synchronous=not call.async_op)
        return handle, _finish(info, handle, tensor, call.async_op, describe)


def run_plan(plan: _fastpath.Plan, tensor: torch.Tensor, async_op: bool) -> Work | None:
    """A repeated all-reduce of `tensor` with the outcome of its checks, `plan` (Note [Fast path of a
    repeated call] in ringreduce/_fastpath.py): a synchronous call that ran on this thread returns
    without another Python frame."""
    if submit_cpu is _SUBMIT_CPU:
        if C.submit_cpu is not _NATIVE_SUBMIT:  # a stub over the extension's submit
            handle = C.submit_cpu(*plan.head, tensor, None, plan.options, plan.store, not async_op)
        elif async_op:  # the plan's bound ring (Note [A bound ring] in csrc/torch/cpu_ops.h)
            handle = plan.ring.submit(tensor, None, plan.options)
        else:  # Note [Synchronous calls without a handle] in csrc/torch/bindings.cpp
            handle = plan.ring.run(tensor, plan.options)
            if handle is None:
                return None
    else:  # submit_cpu was replaced (a test's or a measurement's stub): call it as the full path does
        handle = submit_cpu(plan.info, tensor, plan.options, synchronous=not async_op)
    if async_op:  # no extra frame for the hooks' buckets
        return Work(handle, [tensor], describe=plan.describe, on_interrupt=interrupter(plan.info, handle))
    return _finish(plan.info, handle, tensor, False, plan.describe)


def _finish(info: GroupInfo, handle: Any, tensor: torch.Tensor, async_op: bool, describe: str) -> Work | None:
    """The Work of an async call, or None once a synchronous one completed (raising its error)."""
    if async_op:
        return Work(handle, [tensor], describe=describe, on_interrupt=interrupter(info, handle))
    try:  # Note [Ctrl-C] (ringreduce/_interrupt.py); a finished call costs one native wait
        if not handle.wait(SLICE_MS):
            wait_sliced(handle, -1)
    except KeyboardInterrupt:
        interrupt_ring(info.pg, info.members, info.name, handle)
        raise
    if not handle.ok():
        handle.raise_error()
    return None


def ring_half(info: GroupInfo, tensor: torch.Tensor, output: torch.Tensor, rop: ReduceOp, kind: Any,
              async_op: bool) -> tuple[Any, Work | None]:
    """reduce_scatter (`tensor` = input, `output` = this rank's block) or all_gather (`output` = the
    concatenation) of checked tensors on the ring of `info`; (native handle, Work)."""
    tensor = tensor.detach()  # the worker thread copies from it and must not record autograd history
    name = KIND_NAMES[kind]
    with torch.profiler.record_function(f"ringreduce.{name}"):
        handle = submit_cpu(info, tensor, call_options(info, kind, rop), output=output, synchronous=not async_op)
        work = Work(handle, [output], describe=f"{name} {rop.name} on {info.name}",
                    on_interrupt=interrupter(info, handle))
        if not async_op:
            work.wait()
    return handle, work
