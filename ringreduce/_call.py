"""What every collective does before its ring runs, whatever the device: validate locally, refuse
(telling the other ranks), hand the call to its ring, and log (docs/design.md section 2.5).

A tensor's path through ``all_reduce_avg``: ops.py makes (or finds) the AllreduceOptions of its
arguments (_options.options_of), run_all_reduce finds the plan of a repeated call or checks the call
into a Call, the ring of the group and device (_rings.ring_for) turns the Call into its native
CallOptions (_options.native_options) once and submits it; the Work wraps the native handle.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed.distributed_c10d as _c10d

from ringreduce import _config
from ringreduce._groups import GroupInfo, choose_algorithm, resolve
from ringreduce._native import C
from ringreduce._options import ALGORITHMS, HALF_TYPES, SUM_OR_AVG, AllreduceOptions, scaling_error
from ringreduce._rings import refusing_ring, ring_for, ring_type
from ringreduce._types import KIND_NAMES, CallKind, FrameError, ReduceOp, UnsupportedOpError, to_reduce_op
from ringreduce.work import Work

PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)
_profiler_enabled = torch.autograd._profiler_enabled
_NONE = FrameError.NONE

logger = logging.getLogger("ringreduce")


@dataclass(slots=True)
class Call:
    """What the checks decided about one call: its ring (`info`), what it computes, and everything its
    native CallOptions hold (_options.native_options). A refusal is a Call with `local_error` set."""

    info: GroupInfo
    kind: Any
    rop: ReduceOp = ReduceOp.SUM
    device: torch.device | None = None  # where its tensors live (None: no tensor)
    local_error: Any = _NONE  # this rank refuses the call: its frame says why
    ntensors: int = 1  # all_reduce_coalesced: the list's length
    layout: int = 0  # all_reduce_coalesced: layout_hash() of its list (0: not a list)
    accum: bool = False  # half types: float32 partials (accum_dtype=torch.float32)
    narrow: bool = False  # half types: accum_dtype is the tensor's own (per-hop rounding everywhere)
    wire: Any = None  # the native 16-bit wire DType of a float32 tensor, or None
    gather: str = "auto"  # the 16-bit wire's all-gather width setting: "auto", "16" or "32"
    factor: float = 0.0  # the predivide factor (0.0: none)
    extra_divisor: int = 1  # GradientAverager's accumulation steps
    local_size: int = 0  # > 0: the hierarchical all-reduce with this many ranks per node
    members: tuple[int, ...] = ()  # the ring's ranks in its group, in ring order (node by node)
    one_shot: bool = True  # a small flat all-reduce may go in one shot (algorithm "auto" or "direct")
    direct: bool = False  # the direct all-reduce (Note [Direct all-reduce] in csrc/core/direct.h; direct_chosen)


DIRECT_AUTO_MAX_RANKS = 64  # the GPU's in-order kernel takes at most 64 inputs (kOneShotMaxRanks)


def direct_chosen(algorithm: str, size: int, local_size: int, dtype: torch.dtype, rop: ReduceOp,
                  narrow: bool) -> bool:
    """Whether an all-reduce over `size` ranks runs the direct algorithm: "direct" asks for it (every
    dtype and op, in rank order); "auto" picks it for float16/bfloat16 SUM and AVG on a flat group
    (`local_size` 0) of up to DIRECT_AUTO_MAX_RANKS ranks on either device, where it sums in float32
    and rounds once at the 16-bit ring's bytes, unless accum_dtype names the tensor's own dtype
    (`narrow`: per-hop rounding, the ring's). Across nodes "auto" keeps the hierarchical all-reduce
    (docs/algorithm.md, "The direct all-reduce")."""
    if algorithm == "direct":
        return True
    return (algorithm == "auto" and not local_size and size <= DIRECT_AUTO_MAX_RANKS and dtype in HALF_TYPES
            and rop in SUM_OR_AVG and not narrow)


def debug_level(knobs: _config.Knobs) -> int:
    """RINGREDUCE_DEBUG as the ring read it: INFO (1) logs every call; DETAIL (2) adds the ring's
    parameters and where the time went. 0 when unset."""
    if not knobs.debug:
        return 0
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[ringreduce %(process)d] %(message)s"))
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    return knobs.debug


def log_call(ring: Any, call: Call, handle: Any, tensor: torch.Tensor, async_op: bool,
             seconds: float | None) -> None:
    """One RINGREDUCE_DEBUG line for `call` on `ring` (`handle`: its native handle or None; `seconds`:
    how long a synchronous call took, CUDA: to enqueue; None: async); DETAIL adds the knobs."""
    info = call.info
    algo = "direct" if call.direct else f"hierarchical(local_size={call.local_size})" if call.local_size else "ring"
    number = "" if handle is None else f" call #{handle.seq}"
    msg = (
        f"rank {info.rank}/{info.size} {info.name}{number} {KIND_NAMES.get(call.kind, call.kind)} "
        f"op={call.rop.name} dtype={_dtype_name(tensor.dtype)} numel={tensor.numel()} "
        f"algorithm={algo} device={tensor.device.type}{' accum=float32' if call.accum else ''}"
        f"{f' wire={str(call.wire.name).lower()}' if call.wire is not None else ''}"
        f"{f' predivide={call.factor:g}' if call.factor else ''}"
    )
    if seconds is None:
        msg += " async (submitted)"
    elif ring.ENQUEUES:
        msg += f" enqueued in {seconds * 1e6:.0f}us (the GPU runs it after)"
    else:
        msg += f" time={seconds * 1e6:.0f}us"
    if ring.knobs.debug >= 2:
        msg += f" {ring.ring_parameters()} check={ring.check_enabled()} contiguous={tensor.is_contiguous()}"
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


def torch_words(check: str, *args: Any) -> str | None:
    """What torch.distributed's own argument check `check` (a function of distributed_c10d, such as
    "_check_single_tensor") says of `args`, whitespace folded, or None where it accepts them or this
    torch has no such check."""
    fn = getattr(_c10d, check, None)
    if fn is None:
        return None
    try:
        fn(*args)
    except (TypeError, ValueError) as exc:
        return " ".join(str(exc).split())
    return None


def not_a_tensor(value: Any) -> TypeError:
    """The TypeError for a `tensor` argument that is not a tensor, in torch.distributed's words first."""
    ours = f"ringreduce: expected a torch.Tensor, got {type(value).__name__}"
    words = torch_words("_check_single_tensor", value, "tensor")
    return TypeError(f"{words} ({ours})" if words else ours)


def overlaps(tensor: torch.Tensor) -> bool:
    """Whether elements of the strided `tensor` may share memory (an expand()ed view, stride 0, or an
    overlapping as_strided view). With the dims of size > 1 sorted by stride, the elements are apart
    when each stride exceeds the reach of the smaller-stride dims, the sum of their stride * (size - 1);
    anything else counts as overlapping (a few exotic interleavings that do not overlap included, as
    torch's own check calls them "too hard"). Contiguous tensors never overlap: check is_contiguous()
    first, this loop is for the others."""
    reach = 0
    for stride, size in sorted((st, sz) for sz, st in zip(tensor.shape, tensor.stride(), strict=True) if sz > 1):
        if stride <= reach:
            return True
        reach += stride * (size - 1)
    return False


def overlap_error(tensor: torch.Tensor, what: str = "the tensor", fix: str = "reduce a .clone() and copy it back",
                  who: str = "ringreduce") -> ValueError:
    """The ValueError for a written-to `tensor` whose elements may share memory (overlaps)."""
    return ValueError(
        f"{who}: the elements of {what} share memory (an expand()ed or overlapping as_strided view: sizes "
        f"{tuple(tensor.shape)}, strides {tuple(tensor.stride())}), so the ranks' results could differ; {fix}"
    )


def local_refusal(
    tensor: Any, op: Any, accum_dtype: torch.dtype | None, algorithm: str, collective: str = "all_reduce",
    written: bool = True,
) -> tuple[Any, BaseException | None, ReduceOp | None, bool]:
    """(frame error code, exception to raise, op, accum_float32) from purely local checks; messages
    start with torch.distributed's words where it raises for the same input (`collective`: its name).
    `written`: the call writes its result into `tensor` (all-reduce), which then must not overlap
    itself; an input that is only read (all_gather, reduce_scatter) may."""
    if not isinstance(tensor, torch.Tensor):
        return FrameError.NOT_A_TENSOR, not_a_tensor(tensor), None, False
    try:
        rop = to_reduce_op(op)
    except (TypeError, ValueError) as exc:  # TypeError: a bool or a plain integer
        return FrameError.UNSUPPORTED, exc, None, False
    if not isinstance(algorithm, str):
        return FrameError.OTHER, TypeError(
            f"ringreduce: algorithm must be a string, one of {ALGORITHMS}, got {type(algorithm).__name__} "
            f"{algorithm!r}"
        ), rop, False
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
        ring_type(tensor.device)
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
    if written and not tensor.is_contiguous() and overlaps(tensor):
        return FrameError.OTHER, overlap_error(tensor), rop, False
    why = C.unsupported_reason(code, int(rop))
    if why is not None:
        ours = f"ringreduce: op {rop.name} is not supported for dtype {_dtype_name(tensor.dtype)}: {why}"
        if tensor.is_complex():  # torch.distributed's ValueError for the same call, then ours
            ours = f"{collective} does not support {op if not isinstance(op, str) else rop} on complex tensors ({ours})"
        return FrameError.UNSUPPORTED, UnsupportedOpError(ours), rop, False
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
    tensor: torch.Tensor, rop: ReduceOp, wire_dtype: Any, predivide_factor: Any,
) -> tuple[Any, BaseException | None, Any, float]:
    """(frame error code, exception, native wire DType or None, predivide factor, 0.0 for none or 1) of an
    all-reduce's `wire_dtype` and `predivide_factor` (Note [Reduction contract] in csrc/core/functors.h),
    from local checks of a `tensor` local_refusal accepted; what a device cannot run is its ring's
    option_refusal."""
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
        if rop not in SUM_OR_AVG:
            return FrameError.UNSUPPORTED, ValueError(
                f"ringreduce: wire_dtype applies to SUM and AVG, not {rop.name}; drop wire_dtype"
            ), None, 0.0
        wire = C.DType.BFLOAT16 if wire_dtype == torch.bfloat16 else C.DType.FLOAT16
    factor = 0.0
    if predivide_factor is not None:
        if rop not in SUM_OR_AVG:
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


_WIDE_TYPES = (torch.float64, torch.complex128)  # accumulated in float64; every other floating type in float32


def predivide_refusal(factor: float, dtype: torch.dtype, rop: ReduceOp, size: int,
                      extra_divisor: int = 1) -> ValueError | None:
    """The ValueError for a predivide factor (> 0, finite: scaling_refusal's) whose scalings the
    accumulation type cannot hold, else None. Rule (docs/design.md, "Predivide factor"): f and m / f
    must be normal numbers of the accumulation type, float64 for float64/complex128 tensors and float32
    for the others (float32, float16, bfloat16, complex64), where m is the final division's divisor:
    the group's `size` for AVG, 1 for SUM, either times `extra_divisor` (GradientAverager's accumulation
    steps). Outside it f, or the scaling n / f (d / f, f) that the finished sum gets, rounds to 0 or
    infinity in that type and the result would be NaN or infinite on every rank."""
    if not factor:
        return None
    info = torch.finfo(torch.float64 if dtype in _WIDE_TYPES else torch.float32)
    m = (size if rop == ReduceOp.AVG else 1) * extra_divisor
    low, high = max(info.tiny, m / info.max), min(info.max, m / info.tiny)
    if low <= factor <= high:
        return None
    acc = "float64" if dtype in _WIDE_TYPES else "float32"
    return ValueError(
        f"ringreduce: predivide_factor={factor!r} is out of range for a {_dtype_name(dtype)} {rop.name} over "
        f"{size} rank(s): it and {m}/predivide_factor (the final scaling) must be normal {acc} numbers, "
        f"so pass a factor in [{low!r}, {high!r}] (typically the group's size, {size})"
    )


def wire_gather_setting(override: int | None, knobs: _config.Knobs) -> str:
    """The all-gather's width of a 16-bit wire: "16", "32" or "auto" (`override`,
    BackendOptions.wire_gather: 16 or 32; None: RINGREDUCE_WIRE_GATHER as the ring read it)."""
    if override is None:
        return knobs.wire_gather
    if override not in (16, 32) or isinstance(override, bool):
        raise ValueError(f"ringreduce: wire_gather must be 16, 32 or None, got {override!r}")
    return str(override)


def refuse(info: GroupInfo | None, kind: Any, code: Any, exc: BaseException, device: torch.device | None,
           algorithm: str | Sequence[str] = "ring") -> None:
    """Tells the other ranks (agreement frame marked as an error) before raising `exc` locally (at once
    where `info` is None: a rank outside the group).

    `device`: where the call's tensors live (None: the CPU path). `algorithm`: what the others run
    the call with, or a list or tuple of one per native call they run for it (all_reduce_coalesced:
    one per dtype buffer): a refusal frame stands in for each, so that the next collective's frames
    meet. Anything else (an invalid algorithm argument the refusal is about) stands for one call, on
    the ring "auto" picks.
    """
    ring = refusing_ring(info, device) if info is not None and info.size > 1 else None
    if ring is not None and ring.check_enabled():
        algorithms = list(algorithm) if isinstance(algorithm, (list, tuple)) else [algorithm]
        algorithms = [a if isinstance(a, str) and a in ALGORITHMS else "auto" for a in algorithms]
        seqs = ring.refuse(Call(info, kind, device=device, local_error=code), algorithms)
        if seqs:
            which = f"call #{seqs[0]}" if len(seqs) == 1 else f"calls #{seqs[0]}-#{seqs[-1]}"
            exc.args = (f"{exc.args[0]} ({which} on {info.name}; the other ranks were told)",)
    raise exc


def device_of(tensor: Any) -> torch.device | None:
    return tensor.device if isinstance(tensor, torch.Tensor) else None


# Note [Fast path of a repeated call]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A training loop calls all_reduce with the same few argument sets, step after step. The first call of
# a set runs every check (resolve, local_refusal, scaling_refusal, choose_algorithm, native_options);
# on a ring that keeps plans (CPU) its outcome, the ring and the native CallOptions, is kept as a Plan
# (ringreduce/_rings/cpu.py) under a key of everything those checks read:
#
# - the `group` argument, the call kind and the default group (WORLD) at the time, by identity (the
#   Plan holds them, so their ids cannot be reused; a re-initialized WORLD is a new object: a miss);
# - the tensor's dtype and layout (only a CPU torch.Tensor or nn.Parameter with elements qualifies);
# - the options object (one per argument set: _options.options_of, or a caller's own) and the count
#   of a coalesced call;
# - the ring's knobs' epoch (Note [Knobs are read when a ring is made] in ringreduce/_config.py): after
#   ringreduce.reload_knobs() every plan is made again.
#
# The plan serves a tensor of any shape and strides, except one whose elements may share memory
# (overlaps: local_refusal refuses it), which takes the full path; a contiguous tensor costs one
# is_contiguous() there. A refused call, a call with RINGREDUCE_DEBUG set or under the profiler takes
# the full path each time.
# forget_plans() drops the plans (a destroyed ring's group, and at exit).
_plans: dict[tuple[Any, ...], Any] = {}
_plans_lock = threading.Lock()
MAX_PLANS = 1024  # argument sets kept; a program making more distinct calls than that rebuilds its plans


def forget_plans(pg: Any = None) -> None:
    """Drops the plans of process group `pg`'s rings (None: every plan)."""
    with _plans_lock:
        if pg is None:
            _plans.clear()
        else:
            for key in [k for k, p in _plans.items() if p.info.pg is pg]:
                del _plans[key]


def run_all_reduce(tensor: Any, group: Any, options: AllreduceOptions, async_op: bool, kind: Any,
                   ntensors: int = 1, layout: int = 0) -> Work | None:
    """An all-reduce of `tensor` in place with `options` (one object per argument set: Note [Fast path
    of a repeated call]); `kind`: the agreement frame's collective; `ntensors` and `layout`: a coalesced
    call's count and layout_hash()."""
    key = None
    if type(tensor) in PLAIN_TYPES and tensor.is_cpu and not _profiler_enabled():
        key = (id(group), id(kind), tensor.dtype, tensor.layout, options, ntensors, layout)
        plan = _plans.get(key)
        if (plan is not None and plan.epoch == _config.epoch and plan.world is _c10d._world.default_pg
                and plan.group is group and plan.kind is kind and tensor.numel()
                and (tensor.is_contiguous() or not overlaps(tensor))):
            return plan.run(tensor, async_op)
    return _checked_all_reduce(tensor, group, options, async_op, kind, ntensors, layout, key)


def _checked_all_reduce(tensor: Any, group: Any, options: AllreduceOptions, async_op: bool, kind: Any, ntensors: int,
                        layout: int, key: Any) -> Work | None:
    """The full path: every check, then a refusal or the ring's call (whose plan, where `key` is set,
    serves the next identical call)."""
    tensor = local_tensor(tensor)
    wire_dtype, extra_divisor = options.wire_dtype, options.extra_divisor
    code, exc, rop, accum = local_refusal(tensor, options.op, options.accum_dtype, options.algorithm)
    if exc is not None and not _c10d.is_initialized():
        raise exc  # as torch.distributed checks its arguments before the group
    info = resolve(group)
    wire, factor, gather = None, 0.0, "auto"
    if exc is None:
        code, exc, wire, factor = scaling_refusal(tensor, rop, wire_dtype, options.predivide_factor)
    if exc is None and factor and info is not None:
        assert rop is not None
        exc = predivide_refusal(factor, tensor.dtype, rop, info.size, max(1, extra_divisor))
        code = FrameError.OTHER if exc is not None else code
    ring = None
    if exc is None and info is not None:
        ring = ring_for(info, tensor.device, not async_op)
        try:
            gather = wire_gather_setting(options.wire_gather, ring.knobs) if wire is not None else "auto"
        except ValueError as error:
            code, exc = FrameError.OTHER, error
        else:
            device_refusal = ring.option_refusal(options.algorithm, gather) if wire is not None else None
            if device_refusal is not None:
                code, exc = FrameError.OTHER, device_refusal
    if exc is not None:
        # the others run a call with a 16-bit wire on the flat ring (on GPUs; below)
        # (a single call: an algorithm that is not a string is one of the refused arguments)
        refuse(info, kind, code, exc, device_of(tensor),
               "ring" if wire_dtype is not None else options.algorithm if isinstance(options.algorithm, str) else "auto")
    assert rop is not None
    if extra_divisor != 1 and (rop not in SUM_OR_AVG or extra_divisor < 1):
        raise ValueError(f"ringreduce internal error: extra divisor {extra_divisor} with {rop.name}")
    if info is None or tensor.numel() == 0 or info.size == 1:
        if info is not None and extra_divisor != 1 and tensor.numel() > 0:  # one rank still divides by it
            tensor.div_(extra_divisor)
        return Work.completed([tensor]) if async_op else None
    assert ring is not None
    # a 16-bit wire runs on the ring's WIRE_RING where it has one (the GPU's flat ring)
    local_size, members = choose_algorithm(info, (ring.WIRE_RING if wire is not None else None) or options.algorithm,
                                           ring.knobs)
    narrow = options.accum_dtype == tensor.dtype and tensor.dtype in HALF_TYPES
    call = Call(info, kind, rop, device=tensor.device, ntensors=ntensors, layout=layout, accum=accum, narrow=narrow, wire=wire,
                gather=gather, factor=factor, extra_divisor=extra_divisor, local_size=local_size, members=members,
                one_shot=options.algorithm in ("auto", "direct"),
                direct=direct_chosen(options.algorithm, info.size, local_size, tensor.dtype, rop, narrow))
    native = ring.options(call)
    level = debug_level(ring.knobs)
    if key is not None and ring.PLANS and not level:
        plan = ring.plan(call, native, group, _c10d._world.default_pg)
        with _plans_lock:
            if len(_plans) >= MAX_PLANS:
                _plans.clear()
            _plans[key] = plan
    start = time.perf_counter()
    handle, work = ring.all_reduce(call, tensor, native, async_op)
    if level:
        log_call(ring, call, handle, tensor, async_op, None if async_op else time.perf_counter() - start)
    return work


def run_ring_half(info: GroupInfo, tensor: torch.Tensor, output: torch.Tensor, rop: ReduceOp, kind: Any,
                  async_op: bool) -> Work | None:
    """reduce_scatter (`tensor` = input, `output` = this rank's block) or all_gather (`output` = the
    concatenation) of checked tensors on the ring of `info`, a ring this rank is in."""
    if output.numel() == 0 or info.size == 1:
        if output.numel():
            output.copy_(tensor.reshape(output.shape))
        return Work.completed([output]) if async_op else None
    ring = ring_for(info, tensor.device, not async_op)
    call = Call(info, kind, rop, device=tensor.device, members=info.members)
    level = debug_level(ring.knobs)
    start = time.perf_counter()
    handle, work = ring.ring_half(call, tensor, output, async_op)
    if level:
        log_call(ring, call, handle, tensor, async_op, None if async_op else time.perf_counter() - start)
    return work if async_op else None  # a synchronous call returns None, as torch.distributed's


__all__ = ["CallKind", "FrameError", "ReduceOp", "to_reduce_op"]
