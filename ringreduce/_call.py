"""What every collective does before its ring runs, whatever the device: validate locally, refuse
(telling the other ranks), hand the call to its device's backend, and log (docs/design.md section 2.5).
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed.distributed_c10d as _c10d

from ringreduce import _config, _fastpath
from ringreduce._groups import GroupInfo, choose_algorithm, resolve
from ringreduce._native import C
from ringreduce._options import ALGORITHMS, HALF_TYPES, AllreduceOptions, scaling_error
from ringreduce._rings import backend_for, cpu, refusing_backend
from ringreduce._types import KIND_NAMES, CallKind, FrameError, ReduceOp, UnsupportedOpError, to_reduce_op
from ringreduce.work import Work

PLAIN_TYPES, WATCHING = _fastpath.PLAIN_TYPES, _fastpath.WATCHING
_profiler_enabled = torch.autograd._profiler_enabled
_NONE = FrameError.NONE
_run_plan = cpu.run_plan  # Note [Fast path of a repeated call]: only CPU calls leave plans

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


def log_call(info: GroupInfo, handle: Any, tensor: torch.Tensor, op: ReduceOp, kind: Any, level: int,
             async_op: bool, accum: bool, seconds: float | None, local_size: int = 0, *, wire: Any = None,
             predivide: float = 0.0) -> None:
    """One RINGREDUCE_DEBUG line for a call (`handle`: its native handle or None; `seconds`: how long a
    synchronous call took, CUDA: to enqueue; None: async); `level` 2 adds the knobs."""
    backend = backend_for(tensor.device)
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
    elif backend.ENQUEUES:
        msg += f" enqueued in {seconds * 1e6:.0f}us (the GPU runs it after)"
    else:
        msg += f" time={seconds * 1e6:.0f}us"
    if level >= 2:
        msg += (
            f" {backend.ring_parameters()} "
            f"check={backend.check_enabled()} contiguous={tensor.is_contiguous()}"
        )
        if seconds is not None and hasattr(handle, "timing_us"):
            check_us, ring_us = handle.timing_us()
            msg += f" check={check_us:.0f}us ring={ring_us:.0f}us"
    logger.info(msg)


def local_tensor(tensor: Any) -> Any:
    """A DTensor's local shard (reduced in place, placements kept); anything else as is. No DTensor can
    exist before torch.distributed.tensor is imported, so plain tensors cost one dictionary lookup."""
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
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
    try:
        backend_for(tensor.device)
    except (ValueError, RuntimeError) as exc:
        return FrameError.DEVICE, exc, rop, False
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
        device_refusal = backend_for(tensor.device).option_refusal(algorithm, wire_gather)
        if device_refusal is not None:
            return FrameError.OTHER, device_refusal, None, 0.0
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


def refuse(info: GroupInfo | None, kind: Any, code: Any, exc: BaseException, device: torch.device | None,
           algorithm: str | Sequence[str] = "ring") -> None:
    """Tells the other ranks (agreement frame marked as an error) before raising `exc` locally (at once
    where `info` is None: a rank outside the group).

    `device`: where the call's tensors live (None: the CPU path). `algorithm`: what the others run
    the call with, or one per native call they run for it (all_reduce_coalesced: one per dtype
    buffer): a refusal frame stands in for each, so that the next collective's frames meet.
    """
    backend = refusing_backend(device)
    if info is not None and info.size > 1 and backend is not None and backend.check_enabled():
        algorithms = [algorithm] if isinstance(algorithm, str) else list(algorithm)
        seqs = backend.refuse(info, kind, code, algorithms, device)
        if seqs:
            which = f"call #{seqs[0]}" if len(seqs) == 1 else f"calls #{seqs[0]}-#{seqs[-1]}"
            exc.args = (f"{exc.args[0]} ({which} on {info.name}; the other ranks were told)",)
    raise exc


def device_of(tensor: Any) -> torch.device | None:
    return tensor.device if isinstance(tensor, torch.Tensor) else None


class Call:
    """A checked all-reduce as its backend runs it: the ring, the tensor and what the checks decided."""

    __slots__ = ("info", "tensor", "kind", "ntensors", "rop", "accum", "accum_dtype", "wire", "factor", "gather",
                 "extra_divisor", "local_size", "members", "one_shot", "async_op", "group", "plan_key", "world",
                 "env")

    def __init__(self, **fields: Any) -> None:
        for name, value in fields.items():
            setattr(self, name, value)


def run_all_reduce(tensor: Any, op: Any, group: Any, async_op: bool, accum_dtype: torch.dtype | None,
                   algorithm: str, kind: Any, *, wire_dtype: Any = None, predivide_factor: Any = None) -> Work | None:
    """An all-reduce of `tensor` in place with ringreduce.all_reduce's arguments; `kind`: the agreement
    frame's collective. A repeated call runs its plan (Note [Fast path of a repeated call]); any other
    is run_all_reduce_with these options."""
    key = env = world = None
    if type(tensor) in PLAIN_TYPES and tensor.is_cpu and not _profiler_enabled() and WATCHING:
        env, world = _fastpath.generation, _c10d._world.default_pg
        try:
            key = (id(group), id(kind), tensor.dtype, tensor.layout, type(op), op, accum_dtype, algorithm,
                   wire_dtype, type(predivide_factor), predivide_factor)
            plan = _fastpath.plans.get(key)
        except TypeError:  # an unhashable argument: the full path says what is wrong with it
            key = plan = None
        if (plan is not None and plan.env == env and plan.world is world and plan.group is group
                and plan.kind is kind and tensor.numel()):
            return _run_plan(plan, tensor, async_op)
    options = AllreduceOptions(op, accum_dtype, algorithm, wire_dtype, predivide_factor)
    return _checked_all_reduce(tensor, group, options, async_op, kind, 1, key, env, world)


def run_all_reduce_with(tensor: Any, group: Any, options: AllreduceOptions, async_op: bool, kind: Any,
                        ntensors: int = 1) -> Work | None:
    """An all-reduce of `tensor` in place with `options`, made once by a caller of many calls (a hook's
    buckets, a coalesced call's buffers); `ntensors`: a coalesced call's count."""
    key = env = world = None
    if type(tensor) in PLAIN_TYPES and tensor.is_cpu and not _profiler_enabled() and WATCHING:
        env, world = _fastpath.generation, _c10d._world.default_pg
        key = (id(group), id(kind), tensor.dtype, tensor.layout, options, ntensors)
        plan = _fastpath.plans.get(key)
        if (plan is not None and plan.env == env and plan.world is world and plan.group is group
                and plan.kind is kind and tensor.numel()):
            return _run_plan(plan, tensor, async_op)
    return _checked_all_reduce(tensor, group, options, async_op, kind, ntensors, key, env, world)


def _checked_all_reduce(tensor: Any, group: Any, options: AllreduceOptions, async_op: bool, kind: Any, ntensors: int,
                        key: Any, env: Any, world: Any) -> Work | None:
    """The full path of both entries above: every check, then a refusal or the backend's call (whose
    plan, where `key` is set, serves the next identical call)."""
    tensor = local_tensor(tensor)
    info = resolve(group)
    wire_dtype, extra_divisor = options.wire_dtype, options.extra_divisor
    code, exc, rop, accum = local_refusal(tensor, options.op, options.accum_dtype, options.algorithm)
    wire, factor, gather = None, 0.0, "auto"
    if exc is None:
        assert rop is not None
        try:
            gather = wire_gather_setting(options.wire_gather) if wire_dtype is not None else "auto"
        except ValueError as error:
            code, exc = FrameError.OTHER, error
        if exc is None:
            code, exc, wire, factor = scaling_refusal(tensor, rop, options.algorithm, wire_dtype,
                                                      options.predivide_factor, gather)
    if exc is not None:
        # the others run a call with a 16-bit wire on the flat ring (on GPUs; below)
        refuse(info, kind, code, exc, device_of(tensor), "ring" if wire_dtype is not None else options.algorithm)
    assert rop is not None
    if extra_divisor != 1 and (rop not in (ReduceOp.SUM, ReduceOp.AVG) or extra_divisor < 1):
        raise ValueError(f"ringreduce internal error: extra divisor {extra_divisor} with {rop.name}")
    if info is None or tensor.numel() == 0 or info.size == 1:
        if info is not None and extra_divisor != 1 and tensor.numel() > 0:  # one rank still divides by it
            tensor.div_(extra_divisor)
        return Work.completed([tensor]) if async_op else None
    backend = backend_for(tensor.device)
    # a 16-bit wire runs on the backend's WIRE_RING where it has one (the GPU's flat ring)
    local_size, members = choose_algorithm(info, (backend.WIRE_RING if wire is not None else None) or options.algorithm)
    level = debug_level()
    call = Call(info=info, tensor=tensor, kind=kind, ntensors=ntensors, rop=rop, accum=accum,
                accum_dtype=options.accum_dtype, wire=wire, factor=factor, gather=gather, extra_divisor=extra_divisor,
                local_size=local_size, members=members, one_shot=options.algorithm == "auto", async_op=async_op,
                group=group, plan_key=key if not level and world is not None else None, world=world, env=env)
    start = time.perf_counter()
    handle, work = backend.all_reduce(call)
    if level:
        log_call(info, handle, tensor, rop, kind, level, async_op, accum,
                 None if async_op else time.perf_counter() - start, local_size, wire=wire, predivide=factor)
    return work


def run_ring_half(info: GroupInfo, tensor: torch.Tensor, output: torch.Tensor, rop: ReduceOp, kind: Any,
                  async_op: bool) -> Work | None:
    """reduce_scatter (`tensor` = input, `output` = this rank's block) or all_gather (`output` = the
    concatenation) of checked tensors on the ring of `info`, a ring this rank is in."""
    if output.numel() == 0 or info.size == 1:
        if output.numel():
            output.copy_(tensor.reshape(output.shape))
        return Work.completed([output]) if async_op else None
    level = debug_level()
    start = time.perf_counter()
    handle, work = backend_for(tensor.device).ring_half(info, tensor, output, rop, kind, async_op)
    if level:
        log_call(info, handle, tensor, rop, kind, level, async_op, False,
                 None if async_op else time.perf_counter() - start)
    return work


__all__ = ["CallKind", "FrameError", "ReduceOp", "to_reduce_op"]
