"""What every collective does before its ring runs: validate locally, refuse (telling the other ranks),
route to the CPU runtime or the GPU path, and log.

The public modules (ops, scatter_gather, coalesced, nn) only state their own arguments' rules and
call into here.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed.distributed_c10d as _c10d

from ringreduce import _config, _fastpath
from ringreduce._groups import GroupInfo, choose_algorithm, one_node, resolve
from ringreduce._interrupt import SLICE_MS, interrupt_ring, wait_sliced
from ringreduce._native import C
from ringreduce._options import ALGORITHMS, HALF_TYPES, scaling_error
from ringreduce._types import KIND_NAMES, NATIVE_OPS, CallKind, FrameError, ReduceOp, UnsupportedOpError, to_reduce_op
from ringreduce.work import Work

PLAIN_TYPES, ENV_GET, ENV_KEYS = _fastpath.PLAIN_TYPES, _fastpath.ENV_GET, _fastpath.ENV_KEYS
_profiler_enabled = torch.autograd._profiler_enabled
_NONE = FrameError.NONE

logger = logging.getLogger("ringreduce")


def debug_level() -> int:
    """RINGREDUCE_DEBUG=INFO logs every call; DETAIL adds the ring's parameters and where the time went.

    0 when unset.
    """
    raw = _config.debug_setting()
    if raw in ("", "0", "OFF", "WARN", "WARNING"):
        return 0
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[ringreduce %(process)d] %(message)s"))
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    return 2 if raw == "DETAIL" else 1


def ring_parameters(is_cuda: bool) -> str:
    """The ring's parameters in a DETAIL log line: the CPU ring's segment and slots, or the GPU
    pipeline rule's overrides that are set (csrc/cuda/gpu_pipeline.h)."""
    if not is_cuda:
        return f"segment_bytes={_config.segment_bytes()} slots={_config.num_slots() or 'auto'}"
    segment, slots = _config.segment_bytes_override(), _config.num_slots()
    lanes, one_shot = _config.lanes(), _config.one_shot_bytes()
    return " ".join((
        f"segment_bytes<={segment}" if segment else "segment_bytes=gpu rule",  # a set value caps the rule's
        f"slots={slots} per lane" if slots else "slots=gpu rule",
        f"lanes<={lanes}" if lanes else "lanes=gpu rule",  # the communicator's lanes bound it too
        f"one_shot_bytes={one_shot}" if one_shot >= 0 else "one_shot_bytes=gpu rule",
    ))


def log_call(info: GroupInfo, handle: Any, tensor: torch.Tensor, op: ReduceOp, kind: Any, level: int,
             async_op: bool, accum: bool, seconds: float | None, local_size: int = 0, *, wire: Any = None,
             predivide: float = 0.0) -> None:
    """One RINGREDUCE_DEBUG line for a call (`handle`: its native handle or None; `seconds`: how long a
    synchronous call took, CUDA: to enqueue; None: async); `level` 2 adds the knobs."""
    algo = f"hierarchical(local_size={local_size})" if local_size else "ring"
    number = "" if handle is None else f" call #{handle.seq}"
    msg = (
        f"rank {info.rank}/{info.size} {info.name}{number} {KIND_NAMES.get(kind, kind)} "
        f"op={op.name} dtype={_dtype_name(tensor.dtype)} numel={tensor.numel()} "
        f"algorithm={algo} device={tensor.device.type}{' accum=float32' if accum else ''}"
        f"{f' wire={str(wire.name).lower()}' if wire is not None else ''}"
        f"{f' predivide={predivide:g}' if predivide else ''}"
    )
    if seconds is None:
        msg += " async (submitted)"
    elif tensor.is_cuda:
        msg += f" enqueued in {seconds * 1e6:.0f}us (the GPU runs it after)"
    else:
        msg += f" time={seconds * 1e6:.0f}us"
    if level >= 2:
        msg += (
            f" {ring_parameters(tensor.is_cuda)} "
            f"check={_config.check_enabled(tensor.is_cuda)} contiguous={tensor.is_contiguous()}"
        )
        if seconds is not None and hasattr(handle, "timing_us"):
            check_us, ring_us = handle.timing_us()
            msg += f" check={check_us:.0f}us ring={ring_us:.0f}us"
    logger.info(msg)


def local_tensor(tensor: Any) -> Any:
    """A DTensor's local shard (reduced in place, placements kept); anything else as is. No DTensor can
    exist before torch.distributed.tensor is imported, so plain tensors cost one dictionary lookup."""
    module = sys.modules.get("torch.distributed.tensor")
    dtensor = getattr(module, "DTensor", None) if module is not None else None
    if dtensor is not None and isinstance(tensor, dtensor):
        return tensor._local_tensor
    return tensor


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def local_refusal(
    tensor: Any, op: Any, accum_dtype: torch.dtype | None, algorithm: str
) -> tuple[Any, BaseException | None, ReduceOp | None, bool]:
    """(frame error code, exception to raise, op, accum_float32) from purely local checks."""
    if not isinstance(tensor, torch.Tensor):
        return FrameError.NOT_A_TENSOR, TypeError(
            f"ringreduce: expected a torch.Tensor, got {type(tensor).__name__}"
        ), None, False
    try:
        rop = to_reduce_op(op)
    except ValueError as exc:
        return FrameError.UNSUPPORTED, exc, None, False
    if algorithm not in ALGORITHMS:
        return FrameError.OTHER, ValueError(
            f"ringreduce: algorithm must be one of {ALGORITHMS}, got {algorithm!r}"
        ), rop, False
    if getattr(type(tensor), "__torch_dispatch__", None) is not torch.Tensor.__torch_dispatch__:
        # Wrapper subclasses (DTensor is unwrapped before, FakeTensor, functional tensors...) may have
        # no storage of their own: never hand them to the transport.
        return FrameError.OTHER, ValueError(
            f"ringreduce: tensor subclass {type(tensor).__name__} is not supported; pass a plain tensor "
            "(e.g. its local shard or .to_local())"
        ), rop, False
    if tensor.is_sparse or tensor.layout != torch.strided:
        return FrameError.SPARSE, ValueError(
            f"ringreduce: only dense (strided) tensors are supported, got layout {tensor.layout}; "
            "call .to_dense() first"
        ), rop, False
    if tensor.device.type not in ("cpu", "cuda"):
        return FrameError.DEVICE, ValueError(
            f"ringreduce: tensors on {tensor.device.type} are not supported; use CPU or CUDA tensors"
        ), rop, False
    if tensor.is_cuda and not C.native_info["cuda"]:
        return FrameError.DEVICE, RuntimeError(
            "ringreduce: got a CUDA tensor, but this ringreduce build has no CUDA support. Reinstall it "
            "where a CUDA toolkit is found (set CUDA_HOME) with a CUDA build of torch, or reduce a CPU tensor"
        ), rop, False
    try:
        code = C.dtype_code(tensor.dtype)
    except TypeError:
        return FrameError.UNSUPPORTED, TypeError(
            f"ringreduce: dtype {_dtype_name(tensor.dtype)} is not supported (op {rop.name}); "
            "supported: float32, float64, float16, bfloat16, int8, int16, int32, int64, uint8, bool, "
            "complex64, complex128 - convert the tensor first"
        ), rop, False
    why = C.unsupported_reason(code, int(rop))
    if why is not None:
        return FrameError.UNSUPPORTED, UnsupportedOpError(
            f"ringreduce: op {rop.name} is not supported for dtype {_dtype_name(tensor.dtype)}: {why}"
        ), rop, False
    accum = False
    if accum_dtype is not None and accum_dtype != tensor.dtype:
        if accum_dtype == torch.float32 and tensor.dtype in HALF_TYPES:
            accum = True
        else:
            return FrameError.UNSUPPORTED, TypeError(
                f"ringreduce: accum_dtype={accum_dtype} is not supported for {tensor.dtype} tensors; "
                "accum_dtype=torch.float32 applies to float16/bfloat16 (partial sums then travel in float32)"
            ), rop, False
    return _NONE, None, rop, accum


def narrow_accumulation(tensor: torch.Tensor, accum_dtype: torch.dtype | None) -> bool:
    """Whether `accum_dtype` names the float16/bfloat16 tensor's own dtype: partial sums are then
    rounded at every hop in shared memory too (docs/design.md section 1.5)."""
    return accum_dtype is not None and accum_dtype == tensor.dtype and tensor.dtype in HALF_TYPES


def scaling_refusal(
    tensor: torch.Tensor, rop: ReduceOp, algorithm: str, wire_dtype: Any, predivide_factor: Any,
    wire_gather: str = "auto",
) -> tuple[Any, BaseException | None, Any, float]:
    """(frame error code, exception, native wire DType or None, predivide factor, 0.0 for none or 1) of an
    all-reduce's `wire_dtype` and `predivide_factor` (Note [Reduction contract] in csrc/core/functors.h),
    from local checks of a `tensor` local_refusal accepted; `wire_gather`: wire_gather_setting's."""
    if wire_dtype is None and predivide_factor is None:
        return _NONE, None, None, 0.0
    error = scaling_error(wire_dtype, predivide_factor)
    if error is not None:
        return FrameError.OTHER, error, None, 0.0
    wire = None
    if wire_dtype is not None:
        if not (tensor.is_floating_point() or tensor.is_complex()):
            return FrameError.UNSUPPORTED, TypeError(
                f"ringreduce: wire_dtype={wire_dtype} needs a float32 tensor, got {_dtype_name(tensor.dtype)} "
                "(integer and bool values cannot travel as 16-bit floats); drop wire_dtype"
            ), None, 0.0
        if tensor.dtype != torch.float32:
            return FrameError.UNSUPPORTED, ValueError(
                f"ringreduce: wire_dtype={wire_dtype} applies to float32 tensors only, got "
                f"{_dtype_name(tensor.dtype)} (a 16-bit wire must be narrower than the tensor; "
                "float16/bfloat16 tensors already travel in 16 bits); drop wire_dtype"
            ), None, 0.0
        if rop not in (ReduceOp.SUM, ReduceOp.AVG):
            return FrameError.UNSUPPORTED, ValueError(
                f"ringreduce: wire_dtype applies to SUM and AVG, not {rop.name}; drop wire_dtype"
            ), None, 0.0
        if algorithm == "hierarchical" and tensor.is_cuda:
            return FrameError.OTHER, ValueError(
                "ringreduce: on GPUs wire_dtype runs on the flat ring; use algorithm=\"auto\" or \"ring\" with it"
            ), None, 0.0
        if wire_gather == "16" and tensor.is_cuda:
            return FrameError.OTHER, ValueError(
                "ringreduce: a 16-bit all-gather (RINGREDUCE_WIRE_GATHER=16, or BackendOptions(wire_gather=16)) "
                "runs on CPU rings only; on GPUs the all-gather of a 16-bit wire moves float32: unset it or set 32"
            ), None, 0.0
        wire = C.DType.BFLOAT16 if wire_dtype == torch.bfloat16 else C.DType.FLOAT16
    factor = 0.0
    if predivide_factor is not None:
        if rop not in (ReduceOp.SUM, ReduceOp.AVG):
            return FrameError.UNSUPPORTED, ValueError(
                f"ringreduce: predivide_factor applies to SUM and AVG, not {rop.name} (it only moves where a sum "
                "is scaled); drop predivide_factor"
            ), None, 0.0
        if not (tensor.is_floating_point() or tensor.is_complex()):
            return FrameError.UNSUPPORTED, TypeError(
                f"ringreduce: predivide_factor needs a floating-point or complex tensor, got "
                f"{_dtype_name(tensor.dtype)}; drop predivide_factor"
            ), None, 0.0
        factor = 0.0 if float(predivide_factor) == 1.0 else float(predivide_factor)
    return _NONE, None, wire, factor


def wire_gather_setting(override: int | None = None) -> str:
    """The all-gather's width of a 16-bit wire: "16", "32" or "auto" (RINGREDUCE_WIRE_GATHER, or
    `override`, BackendOptions.wire_gather: 16 or 32)."""
    if override is None:
        return _config.wire_gather()
    if override not in (16, 32) or isinstance(override, bool):
        raise ValueError(f"ringreduce: wire_gather must be 16, 32 or None, got {override!r}")
    return str(override)


def gather16_on_cpu(info: GroupInfo, setting: str) -> bool:
    """Whether a CPU all-reduce's all-gather moves the 16-bit wire too (Note [16-bit all-gather] in
    csrc/core/plan.h): "16" always, "auto" where the ring spans several nodes, "32" never."""
    return setting == "16" or (setting == "auto" and not one_node(info))


# Options objects by everything they hold: most programs make the same few calls over and over, so
# a call costs one dictionary lookup instead of building the native struct.
_options_cache: dict[tuple[Any, ...], Any] = {}


def call_options(info: GroupInfo, kind: Any, op: ReduceOp, *, accum: bool = False, local_error: Any = _NONE,
                 ntensors: int = 1, local_size: int = 0, node_order: tuple[int, ...] = (),
                 one_shot: bool = True, wire: Any = None, predivide: float = 0.0, extra_divisor: int = 1,
                 narrow: bool = False, gather16: bool = False) -> Any:
    """The native CallOptions (csrc/core/call_options.h) of one CPU call on `info`'s ring, with the knobs
    read now. `local_error`: a local refusal; `node_order`: the hierarchical ring's members; `narrow`:
    narrow_accumulation (Note [Half types in shared memory] in csrc/cpu/shm_ring.h); `gather16`:
    gather16_on_cpu."""
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
# The extension's own submit and synchronous call (a stub that a test or a measurement puts over
# C.submit_cpu is called instead of either).
_NATIVE_SUBMIT = C.submit_cpu
_NATIVE_RUN = getattr(C, "run_cpu", None)


def interrupter(info: GroupInfo, handle: Any) -> Any:
    """What a Ctrl-C during a wait for `handle` does (Note [Ctrl-C] in ringreduce/_interrupt.py)."""
    return lambda: interrupt_ring(info.pg, info.members, info.name, handle)


def refuse(info: GroupInfo | None, kind: Any, code: Any, exc: BaseException, device: torch.device | None,
           algorithm: str | Sequence[str] = "ring") -> None:
    """Tells the other ranks (agreement frame marked as an error) before raising `exc` locally (at once
    where `info` is None: a rank outside the group).

    `device`: where the call's tensors live (None: the CPU path). `algorithm`: what the others run
    the call with, or one per native call they run for it (all_reduce_coalesced: one per dtype
    buffer): a refusal frame stands in for each, so that the next collective's frames meet.
    """
    algorithms = [algorithm] if isinstance(algorithm, str) else list(algorithm)
    is_cuda = device is not None and device.type == "cuda"
    if info is not None and info.size > 1 and _config.check_enabled(is_cuda):
        if is_cuda and C.native_info["cuda"]:
            from ringreduce import _cuda

            # GPU: the frame goes around the ring the others run the call on (ordered node by node)
            for algo in algorithms:
                try:
                    _, members = choose_algorithm(info, algo if algo in ALGORITHMS else "auto")
                except ValueError:
                    members = info.members
                _cuda.cuda_refuse(info, device, int(kind), int(code), members=members)
        elif not is_cuda:
            # CPU: every call of a ring (hierarchical ones too) runs on the ring's own runtime
            seqs = []
            for _ in algorithms:
                handle = submit_cpu(info, None, call_options(info, kind, ReduceOp.SUM, local_error=code))
                wait_sliced(handle, -1, interrupter(info, handle))  # the others raise "rank r refused"; we raise ours
                seqs.append(handle.seq)
            if seqs:
                which = f"call #{seqs[0]}" if len(seqs) == 1 else f"calls #{seqs[0]}-#{seqs[-1]}"
                exc.args = (f"{exc.args[0]} ({which} on {info.name}; the other ranks were told)",)
    raise exc


def refuse_call(group: Any, tensor: torch.Tensor, kind: Any, exc: BaseException) -> None:
    """Refuses one call of `kind` on `tensor` over `group` for a reason only this rank knows (refuse())."""
    refuse(resolve(group), kind, FrameError.OTHER, exc, device_of(tensor))


def device_of(tensor: Any) -> torch.device | None:
    return tensor.device if isinstance(tensor, torch.Tensor) else None


def run_all_reduce(
    tensor: Any,
    op: Any,
    group: Any,
    async_op: bool,
    accum_dtype: torch.dtype | None,
    algorithm: str,
    kind: Any,
    ntensors: int = 1,
    *,
    wire_dtype: Any = None,
    predivide_factor: Any = None,
    extra_divisor: int = 1,
    wire_gather: int | None = None,
) -> Work | None:
    """An all-reduce of `tensor` in place (arguments as ringreduce.all_reduce's); `kind`: the agreement
    frame's collective; `ntensors`: a coalesced call's count; `extra_divisor`: GradientAverager's
    accumulation steps; `wire_gather`: BackendOptions' (wire_gather_setting)."""
    # Note [Fast path of a repeated call] (ringreduce/_fastpath.py)
    key = env = world = None
    if type(tensor) in PLAIN_TYPES and tensor.is_cpu and not _profiler_enabled() and ENV_GET is not None:
        env = tuple(map(ENV_GET, ENV_KEYS))  # _fastpath.environment(), inlined
        world = _c10d._world.default_pg
        try:
            key = (id(group), id(kind), tensor.dtype, tensor.layout, type(op), op, accum_dtype, algorithm, ntensors,
                   wire_dtype, type(predivide_factor), predivide_factor, extra_divisor, wire_gather)
            plan = _fastpath.plans.get(key)
        except TypeError:  # an unhashable argument: the full path says what is wrong with it
            key = plan = None
        if (plan is not None and plan.env == env and plan.world is world and plan.group is group
                and plan.kind is kind and tensor.numel()):
            return run_plan(plan, tensor, async_op)
    tensor = local_tensor(tensor)
    info = resolve(group)
    code, exc, rop, accum = local_refusal(tensor, op, accum_dtype, algorithm)
    wire, factor, gather = None, 0.0, "auto"
    if exc is None:
        assert rop is not None
        try:
            gather = wire_gather_setting(wire_gather) if wire_dtype is not None else "auto"
        except ValueError as error:
            code, exc = FrameError.OTHER, error
        if exc is None:
            code, exc, wire, factor = scaling_refusal(tensor, rop, algorithm, wire_dtype, predivide_factor, gather)
    if exc is not None:
        # the others run a call with a 16-bit wire on the flat ring (on GPUs; below)
        refuse(info, kind, code, exc, device_of(tensor), "ring" if wire_dtype is not None else algorithm)
    assert rop is not None
    if extra_divisor != 1 and (rop not in (ReduceOp.SUM, ReduceOp.AVG) or extra_divisor < 1):
        raise ValueError(f"ringreduce internal error: extra divisor {extra_divisor} with {rop.name}")
    if info is None or tensor.numel() == 0 or info.size == 1:
        if info is not None and extra_divisor != 1 and tensor.numel() > 0:  # one rank still divides by it
            tensor.div_(extra_divisor)
        return Work.completed([tensor]) if async_op else None
    # On GPUs a 16-bit wire runs on the flat ring; on CPUs also on the hierarchical all-reduce's
    # cross-node ring (Note [Hierarchical 16-bit wire] in csrc/core/collectives.cpp).
    local_size, members = choose_algorithm(info, "ring" if wire is not None and tensor.is_cuda else algorithm)
    level = debug_level()
    if tensor.is_cuda:
        from ringreduce import _cuda

        start = time.perf_counter()
        name = f"ringreduce.{KIND_NAMES[kind]}"
        with torch.profiler.record_function(name), torch.cuda.nvtx.range(name):
            cuda_work = _cuda.cuda_all_reduce(
                tensor, rop, info, async_op, accum, int(kind), local_size=local_size, members=members,
                one_shot=algorithm == "auto", wire=wire, predivide=factor, extra_divisor=extra_divisor,
            )
        if level:
            log_call(info, getattr(cuda_work, "_handle", None), tensor, rop, kind, level, async_op, accum,
                     None if async_op else time.perf_counter() - start, local_size, wire=wire, predivide=factor)
        return cuda_work
    start = time.perf_counter()
    # The profiler range only when a profiler listens: entering one costs ~10 us per call otherwise.
    scope = (torch.profiler.record_function(f"ringreduce.{KIND_NAMES[kind]}")
             if torch.autograd._profiler_enabled() else contextlib.nullcontext())
    work = None
    with scope:
        options = call_options(info, kind, rop, accum=accum, ntensors=ntensors, local_size=local_size,
                               node_order=members if local_size else (), one_shot=algorithm == "auto", wire=wire,
                               predivide=factor, extra_divisor=extra_divisor,
                               narrow=narrow_accumulation(tensor, accum_dtype),
                               gather16=wire is not None and gather16_on_cpu(info, gather))
        describe = f"{KIND_NAMES[kind]} {rop.name} on {info.name}"
        if key is not None and not level and world is not None:
            _fastpath.remember(key, _fastpath.Plan(group, kind, world, env, info, options, describe))
        handle, work = submit_and_wait(info, tensor, options, async_op, describe)
    if level:
        log_call(info, handle, tensor, rop, kind, level, async_op, accum,
                 None if async_op else time.perf_counter() - start, local_size, wire=wire, predivide=factor)
    return work


def run_plan(plan: _fastpath.Plan, tensor: torch.Tensor, async_op: bool) -> Work | None:
    """A repeated all-reduce of `tensor` with the outcome of its checks, `plan` (Note [Fast path of a
    repeated call] in ringreduce/_fastpath.py): submit_and_wait without a Python frame in between."""
    if submit_cpu is _SUBMIT_CPU:
        if async_op or _NATIVE_RUN is None or C.submit_cpu is not _NATIVE_SUBMIT:
            handle = C.submit_cpu(*plan.head, tensor, None, plan.options, plan.store, not async_op)
        else:  # Note [Synchronous calls without a handle] in csrc/torch/bindings.cpp
            handle = _NATIVE_RUN(*plan.head, tensor, plan.options, plan.store)
            if handle is None:
                return None
    else:  # submit_cpu was replaced (a test's or a measurement's stub): call it as the full path does
        handle = submit_cpu(plan.info, tensor, plan.options, synchronous=not async_op)
    if async_op:
        return Work(handle, [tensor], describe=plan.describe, on_interrupt=interrupter(plan.info, handle))
    try:  # Note [Ctrl-C] (ringreduce/_interrupt.py)
        if not handle.wait(SLICE_MS):
            wait_sliced(handle, -1)
    except KeyboardInterrupt:
        interrupt_ring(plan.info.pg, plan.info.members, plan.info.name, handle)
        raise
    if not handle.ok():
        handle.raise_error()
    return None


def submit_and_wait(info: GroupInfo, tensor: torch.Tensor, options: Any, async_op: bool,
                    describe: str) -> tuple[Any, Work | None]:
    """Submits one CPU all-reduce; returns its native handle and, with `async_op`, its Work (named
    `describe`), else None once it completed (raising its error)."""
    handle = submit_cpu(info, tensor, options, synchronous=not async_op)
    if async_op:
        return handle, Work(handle, [tensor], describe=describe, on_interrupt=interrupter(info, handle))
    try:  # Note [Ctrl-C] (ringreduce/_interrupt.py); a finished call costs one native wait
        if not handle.wait(SLICE_MS):
            wait_sliced(handle, -1)
    except KeyboardInterrupt:
        interrupt_ring(info.pg, info.members, info.name, handle)
        raise
    if not handle.ok():
        handle.raise_error()
    return handle, None


def run_ring_half(info: GroupInfo, tensor: torch.Tensor, output: torch.Tensor, rop: ReduceOp, kind: Any,
                  async_op: bool) -> Work | None:
    """reduce_scatter (`tensor` = input, `output` = this rank's block) or all_gather (`output` = the
    concatenation) of checked tensors on the ring of `info`, a ring this rank is in."""
    if output.numel() == 0 or info.size == 1:
        if output.numel():
            output.copy_(tensor.reshape(output.shape))
        return Work.completed([output]) if async_op else None
    if tensor.is_cuda:
        from ringreduce import _cuda

        return _cuda.cuda_ring_half(tensor, output, rop, info, async_op, int(kind))
    tensor = tensor.detach()  # the worker thread copies from it and must not record autograd history
    name = KIND_NAMES[kind]
    level = debug_level()
    start = time.perf_counter()
    with torch.profiler.record_function(f"ringreduce.{name}"):
        handle = submit_cpu(info, tensor, call_options(info, kind, rop), output=output, synchronous=not async_op)
        work = Work(handle, [output], describe=f"{name} {rop.name} on {info.name}",
                    on_interrupt=interrupter(info, handle))
        if not async_op:
            work.wait()
    if level:
        log_call(info, handle, tensor, rop, kind, level, async_op, False,
                 None if async_op else time.perf_counter() - start)
    return work


__all__ = ["CallKind", "FrameError", "ReduceOp", "to_reduce_op"]
